"""The parameter groups of an ``OffloadedOptimizer`` and the master weights that mirror them.

``MasterWeights`` holds the aligned lists (compute parameter ``i`` has master ``i``), makes
the masters (``ctx.master`` on ``ctx.offload_device``, this rank's shard under a
``Sharding``), adopts weights changed outside the optimizer, and copies the masters back
into the compute parameters after a step.

A compute parameter that already is what its master would be (``ctx.master`` on the offload
device, contiguous, all of its storage, no sharding, no staging: an f32 model on the CPU with
f32 masters on the CPU) is its own master's memory: the master is a second ``Parameter`` over
the same storage, so the step writes the model's weights directly and the copy-back is
skipped (it would copy every element onto itself). A skipped step writes nothing, as before;
``param.data = t`` parts them, and from then on the master is copied back as any other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, Protocol

import torch

from computectx.ctx import ComputeCtx
from computectx.memory._transfer import Staging, Transfer, uses_staging

__all__ = [
    "MasterWeights",
    "Sharding",
    "check_sharding",
    "is_dtensor",
    "matches_copy_back",
    "normalise_groups",
]


NEAR_DEVICE_TYPES: tuple[str, ...] = ("cuda",)
"""The device types whose small parameters keep their masters on the device (``near``); the
CPU tests add ``"cpu"`` to run that path."""


class Sharding(Protocol):
    """How the compute parameters are split across ranks (``sharding=`` of the optimizer).

    ``computectx.distributed.ShardedParams`` is the implementation for FSDP2; the memory
    layer itself never talks to ``torch.distributed``.
    """

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a compute parameter or gradient, as a plain tensor (a view)."""
        ...

    def all_reduce(self, values: torch.Tensor, op: Literal["sum", "max"]) -> torch.Tensor:
        """``values`` (a small f64 tensor on the CPU) reduced over the ranks sharing the params."""
        ...


def check_sharding(sharding: Sharding | None) -> Sharding | None:
    """``sharding`` when it is ``None`` or has the ``Sharding`` methods; else ``TypeError``."""
    if sharding is None:
        return None
    if not (
        callable(getattr(sharding, "local", None))
        and callable(getattr(sharding, "all_reduce", None))
    ):
        raise TypeError(
            f"sharding must be a Sharding (e.g. computectx.distributed.ShardedParams(mesh)) "
            f"or None, got {type(sharding).__name__}"
        )
    return sharding


def normalise_groups(params: Any) -> list[dict[str, Any]]:
    """The optimizer's ``params`` argument as a list of param-group dicts."""
    if isinstance(params, (torch.Tensor, torch.nn.Module)):
        raise TypeError(
            f"params must be an iterable of tensors or of param-group dicts (e.g. "
            f"model.parameters()), got {type(params).__name__}"
        )
    try:
        items = list(params)
    except TypeError:
        raise TypeError(
            f"params must be an iterable of tensors or of param-group dicts, got "
            f"{type(params).__name__}"
        ) from None
    if not items:
        raise ValueError("OffloadedOptimizer got an empty parameter list")
    if all(isinstance(g, Mapping) for g in items):
        return [dict(g) for g in items]
    if any(isinstance(g, Mapping) for g in items):
        raise TypeError("params mixes tensors and param-group dicts; pass one kind")
    return [{"params": items}]


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (FSDP2's sharded parameters are), told by its methods: the
    memory layer does not import ``torch.distributed``."""
    return hasattr(t, "placements") and hasattr(t, "to_local")


def stamp(p: torch.Tensor) -> tuple[int, int]:
    """Where ``p``'s data lives and how often it was written in place.

    In-place writes bump the version counter; ``param.data = t`` swaps the storage.
    """
    return p.data_ptr(), p._version


def matches_copy_back(weight: torch.Tensor, master: torch.Tensor) -> bool:
    """Whether ``weight`` holds exactly what copying ``master`` back into it writes.

    The master is cast to the weight's dtype where it lives (as the copy-back casts it),
    then moved to the weight's device; NaN never matches. A tensor without data (the meta
    device) never matches.
    """
    if weight.is_meta or master.is_meta or weight.shape != master.shape:
        return False
    back = master.detach().to(dtype=weight.dtype).to(device=weight.device)
    return bool(torch.equal(weight.detach(), back))


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same elements of the same storage (a master that is its
    parameter's memory), so that copying one into the other changes nothing."""
    return (
        a.data_ptr() == b.data_ptr()
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.device == b.device
    )


class MasterWeights:
    """Compute parameters and their master copies, aligned by position."""

    def __init__(self, ctx: ComputeCtx, transfer: Transfer, sharding: Sharding | None) -> None:
        self.ctx = ctx
        self.transfer: Transfer = transfer
        self.sharding = sharding
        self.compute: list[torch.Tensor] = []
        self.master: list[torch.Tensor] = []
        self._seen: list[tuple[int, int]] = []  # stamp of each compute param at our last write
        self._staging: dict[int, Staging] = {}  # upload buffers, by position
        self.near_below = 0
        """Masters of CUDA parameters with fewer elements than this stay on their device
        (the overlapped step steps them there); 0: every master on the offload device."""

    def near(self, p: torch.Tensor) -> bool:
        """Whether compute parameter ``p``'s master stays on ``p``'s device: a CUDA parameter
        with fewer than ``near_below`` elements."""
        return p.device.type in NEAR_DEVICE_TYPES and p.numel() < self.near_below

    def master_device(self, p: torch.Tensor) -> torch.device:
        """Where compute parameter ``p``'s master lives: the offload device, or ``p``'s own
        device when it is ``near``."""
        return p.device if self.near(p) else self.ctx.offload_device

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``t`` (``t`` itself without a sharding)."""
        return t if self.sharding is None else self.sharding.local(t)

    def check_group(self, group: dict[str, Any], where: str) -> list[torch.Tensor]:
        """The compute parameters of ``group``, checked; ``where`` names it in errors."""
        if "params" not in group:
            raise ValueError(f"{where} has no 'params' key; got keys {sorted(group)}")
        raw = group["params"]
        compute = [raw] if isinstance(raw, torch.Tensor) else list(raw)
        known = {id(p) for p in self.compute}
        seen: set[int] = set()
        for i, p in enumerate(compute):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"{where}['params'][{i}] is a {type(p).__name__}, not a tensor")
            if not p.is_leaf:
                raise ValueError(f"{where}['params'][{i}] is not a leaf tensor; can't optimize it")
            if not p.is_floating_point():
                raise TypeError(
                    f"{where}['params'][{i}] has dtype {p.dtype}; only floating tensors "
                    f"can be optimized"
                )
            if self.sharding is None and is_dtensor(p):
                raise TypeError(
                    f"{where}['params'][{i}] is a DTensor (a parameter sharded by FSDP2 "
                    f"fully_shard); pass sharding=computectx.distributed.ShardedParams(mesh) "
                    f"so that the masters are this rank's local shards and clip_grad_norm "
                    f"measures the global norm"
                )
            if id(p) in known or id(p) in seen:
                raise ValueError(
                    f"{where}['params'][{i}] (shape {tuple(p.shape)}) appears more than once "
                    f"in this optimizer's parameters"
                )
            seen.add(id(p))
        return compute

    def make(self, compute: list[torch.Tensor]) -> list[torch.Tensor]:
        """New masters for ``compute`` (not yet added): ``ctx.master`` on the offload device,
        over the parameter's own storage where it already is one (``shares_master``)."""
        return [
            torch.nn.Parameter(
                p.detach()
                if self.shares_master(p)
                else self.local(p.detach()).to(
                    device=self.master_device(p), dtype=self.ctx.master.torch, copy=True
                ),
                requires_grad=p.requires_grad,
            )
            for p in compute
        ]

    def shares_master(self, p: torch.Tensor) -> bool:
        """Whether compute parameter ``p`` can be its own master's memory: a whole (unsharded)
        contiguous tensor of dtype ``ctx.master`` on the offload device that is all of its
        storage (no view of a buffer another parameter may share), with weights and
        gradients crossing no staging buffer."""
        return (
            self.sharding is None
            and not is_dtensor(p)
            and p.layout == torch.strided
            and p.is_contiguous()
            and p.storage_offset() == 0
            and p.untyped_storage().nbytes() == p.numel() * p.element_size()
            and p.dtype == self.ctx.master.torch
            and p.device == self.master_device(p)
            and not uses_staging(self.transfer, p.device, p.device)
        )

    def add(self, compute: list[torch.Tensor], masters: list[torch.Tensor]) -> None:
        """Append aligned compute parameters and masters (``make``'s result)."""
        self.compute.extend(compute)
        self.master.extend(masters)
        self._seen.extend(stamp(self.local(p)) for p in compute)

    def master_of(self, param: torch.Tensor) -> torch.Tensor:
        """The master copy of compute parameter ``param``."""
        for cp, mp in zip(self.compute, self.master, strict=True):
            if cp is param:
                return mp
        raise ValueError(f"the tensor of shape {tuple(param.shape)} is not optimized here")

    def adopt_outside_edits(self) -> None:
        """Copy every compute parameter written by someone else since our last write into
        its master, which would otherwise undo that write at the next copy-back.

        A write that left the parameter exactly as the master's copy-back has it (the
        model's checkpoint loaded after the optimizer's, which wrote those very weights) is
        no edit: the master stays, with the bits the lower-precision weight lacks. Reading
        the stamps costs no device work; a parameter whose stamp changed costs one
        comparison with its master, cast to the compute dtype on the master's device.
        """
        with torch.no_grad():
            for i, (cp, mp) in enumerate(zip(self.compute, self.master, strict=True)):
                local = self.local(cp)
                now = stamp(local)
                if now != self._seen[i]:
                    if not matches_copy_back(local, mp):
                        mp.copy_(local)
                    self._seen[i] = now

    def load(self, sources: list[torch.Tensor] | None) -> None:
        """Set the masters from ``sources`` (aligned; ``None``: the compute parameters), then
        copy them into the compute parameters."""
        with torch.no_grad():
            for mp, src in zip(
                self.master, self.compute if sources is None else sources, strict=True
            ):
                mp.copy_(self.local(src))
        self.copy_to_compute()

    def copy_to_compute(self) -> None:
        """Write every master into its compute parameter, at the compute dtype.

        CUDA <-> CPU pairs (per ``transfer``) go through one reused staging buffer per
        parameter, cast on the host before the upload.
        """
        for i in range(len(self.master)):
            self.copy_one(i)

    def copy_one(self, i: int) -> None:
        """Write master ``i`` into its compute parameter (``copy_to_compute`` for one): a
        staged upload is queued on the compute device's current stream and not waited on."""
        cp, mp = self.compute[i], self.master[i]
        with torch.no_grad():
            dst = self.local(cp)
            if uses_staging(self.transfer, dst.device, mp.device):
                st = self._staging.get(i)
                if st is None:
                    st = Staging(dst.shape, dst.dtype, host=mp.device, peer=dst.device)
                    self._staging[i] = st
                # The previous upload may still be reading the buffer.
                st.wait()
                st.buffer.copy_(mp)  # the cast to the compute dtype runs on the host
                st.drain_to(dst)
            elif not same_memory(dst, mp):
                dst.copy_(mp)
            self._seen[i] = stamp(dst)

    def staging_buffers(self) -> list[torch.Tensor]:
        """The upload staging buffers allocated so far (for ``memory_report``)."""
        return [st.buffer for st in self._staging.values()]
