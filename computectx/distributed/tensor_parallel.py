"""fp8 linears of DTensors: tensor parallelism, and DTensor activations in general.

Under ``parallelize_module`` (``ColwiseParallel``, ``RowwiseParallel``, sequence parallel
inputs) or torchtitan's full_dtensor mode, a ``QuantizedLinear`` receives DTensors: its weight is
sharded over the tensor-parallel mesh dimension, its input is replicated or sharded there,
and other mesh dimensions may shard the batch. The fp8 operators take plain tensors, so the
call runs on the local shards (``dtensor_quantized_linear``, which ``computectx.formats`` calls for
any
linear that has a DTensor operand once this package is imported), with one rule: **every
quantize uses the amax of the whole tensor**, never of the rank's shard. For each operand
the mesh dimensions it is sharded over are known from its placements, and its amax is
reduced over exactly those (one MAX all-reduce of one float each, ``ShardAmax``), then over
the data-parallel group when a sync is armed. So the steps, the fp8 codes, and the ledgers
are those of one process holding the whole tensors, and the ledgers stay identical on
every rank of the mesh without a merge: every call, delayed scaling included, records the
whole tensor's amax (``OperandScaling.quantize_sharded``).

Per mesh dimension, the layouts (anything else is redistributed to one of them first, by
DTensor, with autograd):

| input ``x`` | weight ``W`` (``[N, K]``) | output | amax reduced over this dim for |
| --- | --- | --- | --- |
| ``Replicate`` | ``Replicate`` | ``Replicate`` | nothing |
| ``Shard(d)``, ``d`` a batch dim | ``Replicate`` | ``Shard(d)`` | ``x``, the output gradient |
| ``Replicate`` | ``Shard(0)`` (column-wise) | ``Shard(-1)`` | ``W``, the output gradient |
| ``Shard(-1)`` | ``Shard(1)`` (row-wise) | ``Partial("sum")`` | ``x``, ``W`` |

A ``Partial`` input is made ``Replicate`` first (quantizing a partial sum would quantize
the wrong value). The bias follows the output: ``Shard(0)`` beside a column-wise weight,
``Replicate`` otherwise; under a row-wise weight only the first rank of the dimension adds
it, so the partial sums add it once. The gradient of a ``Partial`` output arrives replicated,
so it needs no reduction there.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from computectx.distributed.collectives import ShardAmax
from computectx.formats.seam import AmaxReduce, Fp8LinearPlan, fp8_linear, set_dtensor_linear

__all__ = ["dtensor_quantized_linear"]


def _mesh_of(*ts: torch.Tensor | None) -> DeviceMesh:
    meshes = [t.device_mesh for t in ts if isinstance(t, DTensor)]
    mesh = meshes[0]
    if any(m != mesh for m in meshes[1:]):
        raise ValueError(
            "an fp8 linear's DTensor operands must live on one device mesh; got "
            f"{[str(m) for m in meshes]}"
        )
    return mesh


def _placements(t: torch.Tensor | None, ndim: int) -> list[Placement]:
    # A plain weight or bias beside DTensor activations is the whole tensor on every rank.
    if isinstance(t, DTensor):
        return list(t.placements)
    return [Replicate()] * ndim


def _shard_dim(p: Placement, ndim: int) -> int | None:
    if isinstance(p, Shard):
        return p.dim % ndim if ndim else p.dim
    return None


def _layouts(
    x: DTensor, w_places: list[Placement], b_places: list[Placement] | None
) -> tuple[list[Placement], list[Placement], list[str]]:
    """The input layout each mesh dim needs, the output's, and what each dim does."""
    last = x.ndim - 1
    x_target: list[Placement] = []
    y_places: list[Placement] = []
    kinds: list[str] = []  # "replicate", "batch", "colwise", "rowwise"
    for dim, (px, pw) in enumerate(zip(x.placements, w_places, strict=True)):
        wdim = _shard_dim(pw, 2)
        xdim = _shard_dim(px, x.ndim)
        if isinstance(pw, Partial):
            raise ValueError(f"an fp8 linear's weight cannot be Partial (mesh dim {dim})")
        if wdim == 0:
            x_target.append(Replicate())
            y_places.append(Shard(last))
            kinds.append("colwise")
        elif wdim == 1:
            x_target.append(Shard(last))
            y_places.append(Partial())
            kinds.append("rowwise")
        elif xdim is not None and xdim != last:
            x_target.append(Shard(xdim))
            y_places.append(Shard(xdim))
            kinds.append("batch")
        else:
            x_target.append(Replicate())
            y_places.append(Replicate())
            kinds.append("replicate")
        if b_places is not None:
            pb = b_places[dim]
            want: Placement = Shard(0) if kinds[-1] == "colwise" else Replicate()
            if pb != want:
                raise ValueError(
                    f"an fp8 linear's bias is placed {pb} on mesh dim {dim}, where its weight is "
                    f"{pw}; it must be {want}"
                )
    return x_target, y_places, kinds


def _reducer(groups: list[dist.ProcessGroup], then: AmaxReduce | None) -> AmaxReduce | None:
    # None for an operand no mesh dim shards: it is quantized as in any other call.
    return ShardAmax(groups, then) if groups else None


def dtensor_quantized_linear(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    plan: Fp8LinearPlan,
) -> torch.Tensor:
    """``fp8_linear`` of DTensor operands, on the local shards, with whole-tensor amaxes.

    The output is a DTensor on the operands' mesh (see the module docstring for the
    layouts). A plain weight or bias is taken as replicated; the input must be a DTensor
    whenever the weight is one. A plain weight beside a batch-sharded input gets this rank's
    part of its gradient only, as any plain parameter does: reduce it over the batch shards
    as data parallelism does (DDP, FSDP2), or make it a replicated DTensor, whose gradient
    DTensor sums.
    """
    if not isinstance(x, DTensor):
        raise TypeError(
            "an fp8 linear with a DTensor weight takes a DTensor input (tensor parallel plans "
            "such as ColwiseParallel convert it); got a plain tensor"
        )
    mesh = _mesh_of(x, weight, bias)
    n = mesh.ndim
    w_places = _placements(weight, n)
    b_places = None if bias is None else _placements(bias, n)
    x_target, y_places, kinds = _layouts(x, w_places, b_places)
    # Partial inputs, and shards that do not match the weight's, become the layout needed.
    if list(x.placements) != x_target:
        x = x.redistribute(mesh, x_target)
    # The local gradients: of x, a sum over the column shards (each rank holds a slice of
    # dY · W); of the weight and the bias, a sum over the batch shards.
    x_grad = [Partial() if k == "colwise" else p for k, p in zip(kinds, x_target, strict=True)]
    x_local = x.to_local(grad_placements=x_grad)
    w_local = _local(weight, w_places, kinds, ("batch",))
    b_local = _local(bias, b_places, kinds, ("batch", "rowwise")) if b_places is not None else None
    groups = [mesh.get_group(d) for d in range(n)]
    x_groups = [g for g, p in zip(groups, x_target, strict=True) if isinstance(p, Shard)]
    w_groups = [g for g, p in zip(groups, w_places, strict=True) if isinstance(p, Shard)]
    y_groups = [g for g, p in zip(groups, y_places, strict=True) if isinstance(p, Shard)]
    if b_local is not None and any(k == "rowwise" for k in kinds):
        # Every rank of a row-wise dim adds its partial product; the bias is added once.
        first = all(mesh.get_local_rank(d) == 0 for d, k in enumerate(kinds) if k == "rowwise")
        if not first:
            # Zero in value and in gradient (the first rank's carries it); an inf or NaN
            # bias is zeroed first, as inf * 0 would be NaN and poison the partial sum.
            b_local = b_local.nan_to_num(0.0, 0.0, 0.0) * 0
    local_plan = replace(
        plan,
        input_reduce=_reducer(x_groups, plan.amax_reduce),
        weight_reduce=_reducer(w_groups, None),
        grad_reduce=_reducer(y_groups, plan.amax_reduce),
    )
    y_local = fp8_linear(x_local, w_local, b_local, local_plan)
    out_features = y_local.shape[-1] if weight is None else weight.shape[0]
    shape = torch.Size((*x.shape[:-1], out_features))
    return DTensor.from_local(
        y_local, mesh, y_places, run_check=False, shape=shape, stride=_contiguous(shape)
    )


def _local(
    t: torch.Tensor | None, places: list[Placement], kinds: list[str], summed: tuple[str, ...]
) -> torch.Tensor | None:
    if t is None or not isinstance(t, DTensor):
        return t
    # A replicated weight or bias meets shards of the batch (and a row-wise bias is added on
    # one rank): its local gradient is this rank's part of a sum.
    grad = [Partial() if k in summed else p for k, p in zip(kinds, places, strict=True)]
    local: torch.Tensor = t.to_local(grad_placements=grad)
    return local


def _contiguous(shape: torch.Size) -> tuple[int, ...]:
    strides: list[int] = []
    acc = 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


set_dtensor_linear(dtensor_quantized_linear)
