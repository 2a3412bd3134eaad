"""``scaling_stats``: per-layer amax, step, saturation and non-finite counts, from the ledgers."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from computectx.formats.linear.autocast import region_scaling_state
from computectx.formats.linear.module import QuantizedLinear
from computectx.formats.numerics.ledger import read_ledger
from computectx.formats.scaling.layer import ScalingState
from computectx.formats.scaling.operand import OperandScaling
from computectx.formats.scaling.saved import ROLES, Role
from computectx.recipes import DelayedScaling

__all__ = ["LayerStats", "OperandStats", "layer_stats", "scaling_stats"]


@dataclass(frozen=True)
class OperandStats:
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
class LayerStats:
    """The statistics of one fp8 layer's three operands, also reachable as ``stats[role]``."""

    policy: str
    input: OperandStats
    weight: OperandStats
    grad: OperandStats

    def __getitem__(self, role: Role) -> OperandStats:
        if role not in ROLES:
            raise KeyError(f"unknown operand role {role!r}; accepted: {', '.join(ROLES)}")
        found: OperandStats = getattr(self, role)
        return found


def _operand_stats(op: OperandScaling, window_is_max: bool) -> OperandStats:
    values = read_ledger(op.ledger)  # one device-to-host copy per operand
    newest = values.history[op.newest_amax_index()]
    return OperandStats(
        amax=newest,
        window_amax=max(values.history) if window_is_max else newest,
        step=values.step,
        saturated_fraction=values.saturated / op.elements if op.elements else 0.0,
        nonfinite_count=int(values.nonfinite),
        elements=op.elements,
    )


def layer_stats(state: ScalingState) -> LayerStats:
    """``LayerStats`` of one scaling state."""
    s = state.policy.scaling
    window_is_max = isinstance(s, DelayedScaling) and s.algo == "max"
    ops = {role: _operand_stats(state.operands[role], window_is_max) for role in ROLES}
    return LayerStats(policy=str(state.policy), **ops)


def scaling_stats(model: nn.Module) -> dict[str, LayerStats]:
    """Statistics of every fp8 layer in ``model``, by fully qualified name.

    Covers ``QuantizedLinear`` modules and plain ``nn.Linear`` layers that have run inside an
    ``autocast`` region. Reading them copies each ledger to the host (a device sync), so
    call it between steps, not inside one.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"scaling_stats takes an nn.Module, got {type(model).__name__}")
    out: dict[str, LayerStats] = {}
    for fqn, module in model.named_modules():
        state: ScalingState | None = None
        if isinstance(module, QuantizedLinear):
            state = module.scaling
        elif isinstance(module, nn.Linear):
            state = region_scaling_state(module.weight)
        if state is not None:
            out[fqn] = layer_stats(state)
    return out
