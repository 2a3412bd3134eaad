"""fp8 scaling ledgers kept identical on every rank: merged at the end of every backward.

Under data parallelism each rank quantizes its own shard, so each records its own amaxes. Left
alone, the ledgers drift apart (the issue that prompted this measured steps 25x apart after six
steps) and a checkpoint saves one rank's history as if it were the group's.

``sync_scaling`` keeps them identical at every step boundary, with no collective in any
forward. Its hooks on the model that runs forward (the DDP wrapper, the ``fully_shard``-ed
model, or a plain module):

- before a training forward (grad enabled, some fp8 layer in training mode) it arms the
  layers' seam (``GroupAmax``): only then do they record. Calls outside such a forward (the
  unwrapped module, eval, ``no_grad``, ``inference_mode``) record nothing;
- after that forward it puts one gradient hook on the outputs (after a compiled forward, on
  the parameters' accumulated gradients, which need no hook in the graph); when the backward
  reaches it, it queues one callback (``queue_callback``, as DDP and FSDP2 queue theirs) that
  merges every rank's ledgers when the backward ends, eagerly: one all-gather of every
  operand's ledger and element count, combined on the device into what one process would
  hold after quantizing the whole batch (``ledger_merge``; row, block and mx layers keep
  statistics only, merged too). Every rank runs the same backwards (under ``no_sync`` too);
- a training forward whose backward never runs (a validation loss in train mode, on one rank
  or on all) is forgotten: the next training forward first puts back, on the device with no
  collective, what the last merge left (``OperandScaling.restore``). So after every backward
  and every optimizer step every rank holds the merged state; any rank's ``state_dict()`` is
  the world's. ``sync()`` is the same merge on demand, a collective.

Two quantizes need the amax of the tensor in hand, which exists only once the layer before has
run, so no merge between steps can supply it: every call of dynamic scaling, and the first call
of delayed scaling, which seeds its history. ``current_amax`` says whose amax they take. The
rank's own (``"local"``, the default except under FSDP2) issues no collective inside any
quantize, as torchao and TransformerEngine do under data parallelism; the scales of those calls
are the rank's shard's, and the merge makes the delayed histories the whole batch's from step 1
on. The group's (``"group"``, the default under FSDP2, whose forward is collective anyway) is
one MAX all-reduce of one float per such quantize (``GroupAmax``): the scales are one
process's on the whole batch, but every rank must then run every training forward together.
Under ``torch.compile`` the delayed seed stays the rank's own (the seeded check is a device
value there). Weights need none of this: every rank quantizes the same weight, and FSDP2's fp8
all-gather reduces its shard amaxes itself.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from computectx.distributed.collectives import GroupAmax, RankLocal
from computectx.distributed.fp8_all_gather import WeightGatheredQuantized, sharded_weight_of
from computectx.distributed.group import GroupArg, data_parallel_group
from computectx.distributed.ledger_merge import (
    LossNormalization,
    MergeEntry,
    merge_operands,
    payload,
    rescale_grad_ledger,
)
from computectx.distributed.same_setup import check_same_model, check_same_policy
from computectx.formats import QuantizedLinear
from computectx.formats.seam import ROLES, TALLY_ELEMENTS, OperandScaling, Role

__all__ = [
    "AmaxSync",
    "CurrentAmax",
    "LossNormalization",
    "rescale_grad_ledger",
    "scaling_buffer_names",
    "sync_scaling",
]

CurrentAmax = Literal["group", "local"]
"""Whose amax a quantize that needs the current one uses on many ranks: the group's (the
whole batch's) or each rank's own."""

_PARTS = ("ledger", "tally")


@dataclass
class _Snapshot:
    """One operand as the last merge left it (identical on every rank)."""

    ledger: torch.Tensor  # the OperandScaling's ledger object the copy was taken from
    tally: torch.Tensor  # and its tally object
    copy: torch.Tensor
    tally_copy: torch.Tensor

    def holds(self, op: OperandScaling) -> bool:
        """Whether ``op`` still has the tensors this was taken from (not replaced by a load)."""
        return self.ledger is op.ledger and self.tally is op.tally


_Entry = tuple[QuantizedLinear, Role, OperandScaling]


def _fp8_layers(model: nn.Module) -> list[QuantizedLinear]:
    return [m for m in model.modules() if isinstance(m, QuantizedLinear)]


def _tensor_layers(layers: list[QuantizedLinear]) -> list[QuantizedLinear]:
    # The layers whose scaling keeps a history: granularity "tensor" (the ones whose
    # ledgers depend on the world size, and whose quantizes may reduce an amax).
    return [m for m in layers if m.policy.granularity == "tensor"]


def _operands(layers: list[QuantizedLinear]) -> list[_Entry]:
    return [(layer, role, layer.scaling.operands[role]) for layer in layers for role in ROLES]


def _is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def default_current_amax(model: nn.Module) -> CurrentAmax:
    """``current_amax``'s default for ``model``: ``"group"`` under FSDP2 (whose every forward
    is collective already: an amax all-reduce adds latency, not a constraint, and the scales
    are one process's on the whole batch), ``"local"`` otherwise (DDP: no collective inside
    any forward, so one rank may run one alone)."""
    return "group" if _is_fsdp(model) else "local"


def scaling_buffer_names(model: nn.Module) -> list[str]:
    """The names of the scaling-state buffers of every ``QuantizedLinear`` in ``model`` (ledgers,
    tallies, ``fp8_meta``), as ``model.named_buffers()`` gives them.

    DDP must leave these out of its buffer broadcast: with ``broadcast_buffers=True`` (its
    default) it copies rank 0's buffers over every rank's before every forward (``no_grad``
    too), and ``AmaxSync`` merges the ranks' ledgers instead (and a rank-local ledger is
    the rank's own. ``parallelize`` passes them to ``DistributedDataParallel.
    _set_params_and_buffers_to_ignore_for_model`` before wrapping (and its DDP broadcasts
    no buffer after that); ``sync_scaling`` of a ``DistributedDataParallel`` adds them to
    its ignore list.
    """
    return [
        f"{name}.{buffer}" if name else buffer
        for name, m in model.named_modules()
        if isinstance(m, QuantizedLinear)
        for buffer in m.scaling.tensor_names()
    ]


def _out_of_ddp_broadcast(ddp: DistributedDataParallel) -> None:
    # DDP filters its buffers by name on every broadcast (_sync_buffers reassigns them),
    # so names added here are left out from the next forward on.
    ddp.parameters_to_ignore.update(scaling_buffer_names(ddp.module))
    assign = getattr(ddp, "_assign_modules_buffers", None)
    if callable(assign):
        assign()


def _parameter_hook(sync: weakref.ref[AmaxSync]) -> Callable[[torch.Tensor], None]:
    # A plain function holding a weak reference: a deepcopy of the model (an EMA copy)
    # copies its parameters' hooks, and must not copy the sync (and its process group).
    def hook(param: torch.Tensor) -> None:
        owner = sync()
        if owner is not None:
            owner._on_parameter_grad(param)

    return hook


class AmaxSync:
    """Merges the fp8 scaling ledgers of ``model``'s ``QuantizedLinear`` layers across ``group``.

    ``sync_scaling`` builds one with ``hooks=True``: it arms the layers during training
    forwards of ``model`` and merges at the end of every backward (the module docstring).
    ``sync()`` merges now, a collective: every rank of the group must call it the same number
    of times. Built without hooks, the layers record in every training call and the caller
    merges with ``sync()`` alone.

    ``check`` compares the ranks' policies and converted layers (``check_same_policy``,
    ``check_same_model``: parameters too under FSDP2) at construction, one collective;
    ``parallelize``, which compared them before wrapping, passes ``False``.
    """

    def __init__(
        self,
        model: nn.Module,
        group: GroupArg = None,
        *,
        hooks: bool = False,
        current_amax: CurrentAmax | None = None,
        loss_normalization: LossNormalization = "per_rank",
        check: bool = True,
    ) -> None:
        if current_amax not in ("group", "local", None):
            raise ValueError(
                f"current_amax must be 'group' or 'local' (or None: the default for the "
                f"model), got {current_amax!r}"
            )
        if loss_normalization not in ("per_rank", "global"):
            raise ValueError(
                f"loss_normalization must be 'per_rank' or 'global', got {loss_normalization!r}"
            )
        self._loss_normalization: LossNormalization = loss_normalization
        self._model = model
        self._handles: list[RemovableHandle] = []
        self._order_checked = False
        self._snapshots: dict[int, _Snapshot] = {}
        self._current_amax: CurrentAmax = (
            default_current_amax(model) if current_amax is None else current_amax
        )
        self._reduce: GroupAmax | None = None
        self._fine: GroupAmax | None = None
        self._recording = False  # inside a training forward of the model
        self._unfinished = False  # a training forward ran since the last merge
        self._queued = False  # this backward's merge is queued
        self._compiled = False  # the last training forward ran compiled
        if group is None and not (dist.is_available() and dist.is_initialized()):
            # One process that no launcher gave a group (python train.py, or accelerate
            # on one machine): a world of one, in which there is nothing to keep in step.
            self._group: dist.ProcessGroup | None = None
            self._world = 1
            return
        self._group = data_parallel_group(group)
        self._world = dist.get_world_size(self._group)
        # A DDP module, or one inside a framework's wrapper (Lightning Fabric's module runs
        # its DDP as a submodule): its buffer broadcast would overwrite the merged ledgers.
        for module in model.modules():
            if isinstance(module, DistributedDataParallel):
                _out_of_ddp_broadcast(module)
        every = _fp8_layers(model)
        if check:
            if every:
                check_same_policy(every[0].ctx, self._group)
            check_same_model(model, self._group, parameters=_is_fsdp(model))
        # The layers' seam: armed while a training forward of `model` runs (the hooks
        # below); outside one, a layer's call is rank-local and records nothing. Built
        # without hooks, the layers stay armed: the caller then runs every forward on every
        # rank and merges with sync() itself. Row, block and mx layers share it, never
        # reducing (each of their scales is the current block's).
        self._reduce = GroupAmax(
            self._group, reduces=self._current_amax == "group", always_armed=not hooks
        )
        fine = self._fine = GroupAmax(self._group, reduces=False, always_armed=not hooks)
        for layer in every:
            layer.amax_reduce = self._reduce if layer.policy.granularity == "tensor" else fine
        self._to_this_world(every)
        self._take_snapshots(_operands(every))
        if hooks:
            # First among the model's pre-forward hooks: FSDP2's own (which all-gathers,
            # and with enable_quantized_all_gather quantizes each shard with the ledger's step) must
            # see the armed seam and the restored state.
            self._handles = [
                model.register_forward_pre_hook(self._pre_forward, prepend=True),
                model.register_forward_hook(self._post_forward, always_call=True),
            ]
            # A compiled forward's outputs take no hook of ours (registering one would break
            # the graph): the backward of a compiled training forward is seen where its
            # gradients land in the parameters, outside any graph.
            hook = _parameter_hook(weakref.ref(self))
            self._handles += [
                p.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]
                for p in model.parameters()
                if p.requires_grad
            ]

    def _armed(self, value: bool) -> None:
        for seam in (self._reduce, self._fine):
            if seam is not None:
                seam.armed = value

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        # Only a training forward (grad enabled, some fp8 layer in training mode) records:
        # eval, no_grad and inference_mode calls (validation or sampling on one rank) arm
        # nothing and change nothing. None issues a collective.
        self._recording = False
        if not torch.is_grad_enabled():
            return
        layers = _fp8_layers(self._model)
        if not any(layer.training for layer in layers):
            return
        if not self._order_checked:
            self._check_hook_order()
        if self._unfinished:
            # The last training forward's backward never ran (or has not merged): what it
            # recorded is forgotten, on this rank alone, so the ranks stay in step.
            self._restore(_operands(layers))
        self._to_this_world(layers)
        self._unfinished = True
        self._recording = True
        self._armed(True)

    def _check_hook_order(self) -> None:
        # FSDP2 all-gathers (and with the fp8 all-gather quantizes) in a pre-forward hook
        # it puts first in line when fully_shard runs. A sync built before fully_shard is
        # therefore second: the gathers would run unarmed and unrestored, and the weights'
        # ledgers would stop advancing without a word. Checked again at every training
        # forward until it passes, so a caught error is raised again, never forgotten.
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(self._model, FSDPModule) or not self._handles:
            self._order_checked = True
            return
        hooks = list(self._model._forward_pre_hooks)
        if hooks and hooks[0] != self._handles[0].id:
            raise RuntimeError(
                "sync_scaling was called before fully_shard: FSDP2's all-gather now runs "
                "before the fp8 sync's pre-forward hook. Call sync_scaling(model) after "
                "fully_shard (or set up with computectx.distributed.parallelize, which "
                "orders it)"
            )
        self._order_checked = True

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        # Traced into a compiled forward (no graph break): attribute writes only, which
        # torch.compile replays after every call of the graph.
        self._armed(False)
        if not self._recording:
            return
        self._recording = False
        self._compiled = torch.compiler.is_compiling()
        if self._compiled:
            return  # _on_parameter_grad sees its backward
        needing = [
            t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if needing and self._group is not None:
            torch.autograd.graph.register_multi_grad_hook(needing, self._on_backward, mode="any")

    def _on_parameter_grad(self, param: torch.Tensor) -> None:
        if self._compiled and self._unfinished:
            self._on_backward(param)

    def _on_backward(self, grad: torch.Tensor) -> None:
        # The backward has reached the model's outputs: merge when it ends, after every
        # layer's backward has recorded its output gradient, once per backward.
        if not self._queued:
            self._queued = True
            engine = torch.autograd.Variable._execution_engine
            engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._queued = False
        self.sync()

    def remove(self) -> None:
        """Stop arming and merging (``sync()`` still merges on demand), and let each rank
        scale on its own: the layers' seam becomes ``RankLocal`` (every training call
        records the rank's own amaxes; no warning that no sync is attached)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        local = RankLocal()
        for layer in _fp8_layers(self._model):
            if layer.amax_reduce is not None and layer.amax_reduce in (self._reduce, self._fine):
                layer.amax_reduce = local

    @property
    def current_amax(self) -> CurrentAmax:
        """Whose amax a quantize that needs the current one (dynamic scaling, the seed of
        delayed scaling) uses: the group's or the rank's own."""
        return self._current_amax

    def _take_snapshots(self, entries: list[_Entry]) -> None:
        with torch.no_grad():
            self._snapshots = {
                id(op): _Snapshot(
                    op.ledger, op.tally, op.ledger.detach().clone(), op.tally.detach().clone()
                )
                for _, _, op in entries
            }

    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def _restore(self, entries: list[_Entry]) -> None:
        for _, _, op in entries:
            snap = self._snapshots.get(id(op))
            if snap is not None and snap.holds(op):
                op.restore(snap.copy, snap.tally_copy)

    def merged_state(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The scaling tensors the last merge left, keyed as ``module.state_dict()`` keys
        them (``module``: the model the sync was built on, or the one inside its wrapper),
        for the operands a training forward has recorded into since; empty otherwise.
        Copies, nothing read on the host, no collective: what ``Parallel.state_dict`` saves
        in place of this rank's own records."""
        if not self._unfinished:
            return {}
        out: dict[str, torch.Tensor] = {}
        for name, layer in module.named_modules():
            if not isinstance(layer, QuantizedLinear):
                continue
            keys = iter(layer.scaling.tensor_names())
            for role in ROLES:
                ledger_key, tally_key = next(keys), next(keys)
                op = layer.scaling.operands[role]
                snap = self._snapshots.get(id(op))
                if snap is None or not snap.holds(op):
                    continue
                at = f"{name}." if name else ""
                out[at + ledger_key] = snap.copy.clone()
                out[at + tally_key] = snap.tally_copy.clone()
        return out

    @property
    def loss_normalization(self) -> LossNormalization:
        """What each rank's loss is normalized by (see ``sync_scaling``)."""
        return self._loss_normalization

    def _to_this_world(self, layers: list[QuantizedLinear]) -> None:
        # Scaling state recorded at another world size (a checkpoint saved on other ranks):
        # under a per-rank loss, the output-gradient ledger is in that world's units. Before
        # any backward quantizes through it: a pre-forward hook calls this (no collective).
        for layer in _tensor_layers(layers):
            if layer.scaling.world_size != self._world:
                rescale_grad_ledger(layer, self._world, self._loss_normalization)

    def sync(self) -> None:
        """Merge every ledger with the other ranks' (one all-gather), in place, on the device.

        A collective: every rank of the group calls it together (the hooks call it at the end
        of every backward). In a world of one (no process group) there is nothing to merge."""
        layers = _fp8_layers(self._model)
        if not layers or self._group is None:
            return
        self._to_this_world(layers)
        entries = _operands(layers)
        merging: list[MergeEntry] = []
        for layer, role, op in entries:
            # A ledger replaced since the last merge (a checkpoint loaded, a policy with
            # another history length) has no snapshot: it starts from itself, since what it
            # holds came from outside training, identically on every rank.
            snap = self._snapshots.get(id(op))
            valid = snap is not None and snap.holds(op)
            before = snap.copy if snap is not None and valid else op.ledger.detach().clone()
            elements = (
                snap.tally_copy[TALLY_ELEMENTS : TALLY_ELEMENTS + 1]
                if snap is not None and valid
                else None
            )
            # Inputs and gradients differ per rank, and so do the weight shards that
            # FSDP2's fp8 all-gather quantizes (per-tensor layers): their counts add up over
            # the group. A weight every rank quantizes whole is one tensor counted once.
            split = role != "weight" or (
                layer.policy.granularity == "tensor" and _quantizes_shards(layer)
            )
            merging.append(MergeEntry(layer, role, op, before, elements, split))
        local = payload(merging)
        gathered = [torch.empty_like(local) for _ in range(self._world)]
        dist.all_gather(gathered, local, group=self._group)
        merge_operands(merging, torch.stack(gathered))
        self._take_snapshots(entries)
        self._unfinished = False


def _quantizes_shards(layer: QuantizedLinear) -> bool:
    return isinstance(sharded_weight_of(layer.weight), WeightGatheredQuantized)


def sync_scaling(
    model: nn.Module,
    group: GroupArg = None,
    *,
    current_amax: CurrentAmax | None = None,
    loss_normalization: LossNormalization = "per_rank",
) -> AmaxSync:
    """Keep the fp8 scaling state of ``model`` identical on every rank of ``group``.

    ``model`` is what the ranks run forward: a ``DistributedDataParallel`` module, a
    ``fully_shard``-ed one, or a plain module. The ledgers are merged with the other ranks'
    at the end of every backward of its training forwards (the module docstring), so after
    every optimizer step every rank holds the same state. No forward issues a collective of
    the sync's. The ranks' policies and converted layers (under FSDP2 their parameters too)
    are compared once, here: a ``ValueError`` names the ranks and the first layer that
    differs. ``sync.remove()`` detaches it (each rank then scales by its own shard).

    ``current_amax``: whose amax a quantize that needs the current one takes (every call of
    dynamic scaling; the seed of delayed scaling). ``"local"`` (default except under FSDP2):
    the rank's own, no collective. ``"group"`` (default under FSDP2, whose forwards are
    collective anyway): one MAX all-reduce of one float per such quantize, the scales of one
    process on the whole batch; every rank must then run every training forward together.

    ``loss_normalization`` says what each rank's loss is divided by: its own batch
    (``"per_rank"``, a mean-reduced loss under DDP / FSDP2's gradient averaging, the usual
    case), or the global batch (``"global"``: each rank sums its rows over the global
    count). It matters only when scaling state saved at another world size is loaded: under
    ``"per_rank"`` the gradient ledgers are rescaled to this world size
    (``rescale_grad_ledger``).
    """
    return AmaxSync(
        model,
        group,
        hooks=True,
        current_amax=current_amax,
        loss_normalization=loss_normalization,
    )
