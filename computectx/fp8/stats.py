"""``fp8_stats``: per-layer amax, step, saturation and non-finite counts, read from the ledgers."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from computectx.fp8.linear.autocast import region_scaling_state
from computectx.fp8.linear.module import Fp8Linear
from computectx.fp8.numerics.ledger import read_ledger
from computectx.fp8.scaling.layer import Fp8ScalingState
from computectx.fp8.scaling.operand import OperandScaling
from computectx.fp8.scaling.saved import ROLES, Role
from computectx.recipes import DelayedScaling

__all__ = ["Fp8LayerStats", "Fp8OperandStats", "fp8_stats", "scaling_stats"]


@dataclass(frozen=True)
class Fp8OperandStats:
    """What one operand's scaling state says.

    ``amax``: the newest finite amax recorded (0.0 before the first call). ``window_amax``:
    the amax the step derives from (the window max for ``algo="max"``, else ``amax``).
    ``step``: under delayed scaling the step the *next* quantize uses; under dynamic scaling
    the step the last one used. ``saturated_fraction``: share of all quantized elements that
    exceeded ``fmt.max`` and were clamped (always 0 under dynamic scaling, whose step fits
    the data it measured). ``nonfinite_count``: calls whose amax was NaN or inf (their
    scale was left as it was). ``elements``: elements quantized so far.
    """

    amax: float
    window_amax: float
    step: float
    saturated_fraction: float
    nonfinite_count: int
    elements: int


@dataclass(frozen=True)
class Fp8LayerStats:
    """The statistics of one fp8 layer's three operands, also reachable as ``stats[role]``."""

    policy: str
    input: Fp8OperandStats
    weight: Fp8OperandStats
    grad: Fp8OperandStats

    def __getitem__(self, role: Role) -> Fp8OperandStats:
        if role not in ROLES:
            raise KeyError(f"unknown operand role {role!r}; accepted: {', '.join(ROLES)}")
        found: Fp8OperandStats = getattr(self, role)
        return found


def _operand_stats(op: OperandScaling, window_is_max: bool) -> Fp8OperandStats:
    values = read_ledger(op.ledger)  # one device-to-host copy per operand
    newest = values.history[op.newest_amax_index()]
    return Fp8OperandStats(
        amax=newest,
        window_amax=max(values.history) if window_is_max else newest,
        step=values.step,
        saturated_fraction=values.saturated / op.elements if op.elements else 0.0,
        nonfinite_count=int(values.nonfinite),
        elements=op.elements,
    )


def scaling_stats(state: Fp8ScalingState) -> Fp8LayerStats:
    """``Fp8LayerStats`` of one scaling state."""
    s = state.policy.scaling
    window_is_max = isinstance(s, DelayedScaling) and s.algo == "max"
    ops = {role: _operand_stats(state.operands[role], window_is_max) for role in ROLES}
    return Fp8LayerStats(policy=str(state.policy), **ops)


def fp8_stats(model: nn.Module) -> dict[str, Fp8LayerStats]:
    """Statistics of every fp8 layer in ``model``, by fully qualified name.

    Covers ``Fp8Linear`` modules and plain ``nn.Linear`` layers that have run inside an
    ``fp8_autocast`` region. Reading them copies each ledger to the host (a device sync), so
    call it between steps, not inside one.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fp8_stats takes an nn.Module, got {type(model).__name__}")
    out: dict[str, Fp8LayerStats] = {}
    for fqn, module in model.named_modules():
        state: Fp8ScalingState | None = None
        if isinstance(module, Fp8Linear):
            state = module.scaling
        elif isinstance(module, nn.Linear):
            state = region_scaling_state(module.weight)
        if state is not None:
            out[fqn] = scaling_stats(state)
    return out
