"""Which of torch's implementations runs the inner optimizer's step on float32 state.

A torch optimizer's ``fused`` and ``foreach`` options pick how its step runs, not what it
computes. Left unset (``None``), torch runs the single-tensor loop on the CPU: one pass over
every tensor per operation of the update. ``OffloadedOptimizer`` and ``CompactOptimizer``
read the unset pair as "the fastest torch has": a group that sets neither (as built, or as
loaded from a checkpoint) is given ``fused=True`` where its class has a fused kernel (AdamW,
Adam, SGD, Adagrad: one pass over weight, gradient and state, on the CPU too) and every
tensor it steps is fusable, else ``foreach=True``. A group that sets either (the user's
``fused=``/``foreach=``, in the optimizer's keyword arguments or in the group) runs as it
says. The pick is written into the group, so ``param_groups`` and ``state_dict`` say which
implementation ran, and a plain torch optimizer loading the state dict runs the same one.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["HOW", "fastest"]

HOW = ("fused", "foreach")
"""The group options that pick an implementation (``None``: unset)."""


_FUSED_DEVICES = frozenset({"cpu", "cuda", "xpu", "hpu", "mps", "mtia"})
"""The device types torch's fused optimizer kernels run on (its own list, in 2.13)."""


def _fusable(p: torch.Tensor) -> bool:
    """Whether torch's fused kernels take ``p``: a real floating tensor on a device they
    support, with a dense gradient."""
    return (
        p.is_floating_point()
        and p.device.type in _FUSED_DEVICES
        and (p.grad is None or not p.grad.is_sparse)
    )


def fastest(group: dict[str, Any]) -> dict[str, bool]:
    """The options that make ``group``'s step run at its fastest: ``{"fused": True}`` where
    the group has a ``fused`` option and every parameter is fusable, else ``{"foreach":
    True}`` where it has a ``foreach`` option; ``{}`` (torch's default) when the group sets
    either option itself, is ``differentiable``, or (for ``foreach``) holds a tensor-valued
    option, which torch's multi-tensor path refuses without ``capturable``."""
    if not any(k in group for k in HOW) or any(group.get(k) is not None for k in HOW):
        return {}
    if group.get("differentiable", False):
        return {}
    if "fused" in group and all(_fusable(p) for p in group["params"]):
        return {"fused": True}
    tensor_option = any(isinstance(v, torch.Tensor) for k, v in group.items() if k != "params")
    if "foreach" in group and not (tensor_option and not group.get("capturable", False)):
        return {"foreach": True}
    return {}
