"""``computectx demo --moe``: the experts' shape, their load per step, its table and picture.

Under ``--moe`` every block's MLP is a ``computectx.nn.MoE``: ``--experts`` routed SwiGLU
experts, ``--top-k`` of them per token, and ``--shared-experts`` that every token passes
through. Each expert is ``moe_hidden`` wide, so a token's active MLP width,
``(top_k + shared) * moe_hidden``, is the dense model's ``d_ff`` (rounded down to a multiple
of 16): the MoE model does about the dense model's work per token with several times its
expert weights.

The load is what every MoE layer routed in each training step: ``MoE.last_load`` (tokens
per expert) of each micro-batch's forward, summed over the step's micro-batches (and over
the ranks under ``--nproc``), one ``(layers, experts)`` int64 matrix per step
(``LoadRecorder``). Routing is dropless, so each layer's row sums to the step's tokens times
``top_k``. ``load_table`` prints, per policy and layer, the tokens per expert per step over
the last steps (the train loss's tail) with the largest over the smallest, beside the same
ratio over the first steps (before the balancing had time to act); ``plot_expert_load``
draws every step (``expert-load.png``).

This module sits below ``train`` and ``report``: it takes plain data (flags and load
tensors), not their types.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.table import Table
from torch import nn

from computectx._files import atomic_path
from computectx.demo.settings import DemoSettings
from computectx.formats import QuantizedExperts
from computectx.nn import ByteLM, MoE

__all__ = [
    "LayerLoad",
    "LoadRecorder",
    "fp8_experts_backends",
    "layer_loads",
    "load_notes",
    "load_table",
    "moe_config",
    "moe_hidden",
    "plot_expert_load",
]


def moe_hidden(d_ff: int, top_k: int, shared: int) -> int:
    """Each expert's hidden width: the dense ``d_ff`` shared by the ``top_k + shared``
    experts a token passes through, rounded down to a multiple of 16 (at least 16)."""
    return max(16, d_ff // (top_k + shared) // 16 * 16)


def moe_config(settings: DemoSettings, d_ff: int) -> dict[str, Any]:
    """The ``LMConfig`` fields of the demo's MoE model (empty without ``--moe``)."""
    if not settings.moe:
        return {}
    return {
        "n_experts": settings.experts,
        "top_k": settings.top_k,
        "n_shared_experts": settings.shared_experts,
        "moe_hidden": moe_hidden(d_ff, settings.top_k, settings.shared_experts),
        "moe_balance": settings.balance,
        "moe_bias_rate": settings.bias_rate,
    }


def fp8_experts_backends(model: nn.Module) -> list[str]:
    """The fp8 backend of each MoE layer of ``model`` whose experts run in fp8, in order."""
    return [
        m.experts.fp8.backend.value
        for m in model.modules()
        if isinstance(m, MoE) and isinstance(m.experts.fp8, QuantizedExperts)
    ]


class LoadRecorder:
    """Collects the routed load of ``model``'s MoE layers, one matrix per training step.

    ``add()`` after each micro-batch's forward adds ``model.expert_load()`` (every layer's
    ``last_load``); ``end_step`` closes the step (summing over the process group when one is
    given). ``load()`` is the ``(steps, layers, experts)`` int64 tensor on the CPU.
    """

    def __init__(self, model: ByteLM) -> None:
        if not model.moe_layers():
            raise ValueError("the model has no MoE layer to record the load of")
        self.model = model
        self._step: torch.Tensor | None = None
        self._steps: list[torch.Tensor] = []

    def add(self) -> None:
        """Add the load of every layer's last forward to the current step."""
        now = self.model.expert_load().detach().to(torch.int64)
        self._step = now if self._step is None else self._step + now

    def end_step(self, world: int = 1) -> None:
        """Close the current step; with ``world`` above 1 its load is the group's sum."""
        if self._step is None:
            raise RuntimeError("end_step before any add(): no forward was recorded")
        step = self._step
        if world > 1:
            dist.all_reduce(step)
        self._steps.append(step.cpu())
        self._step = None

    def load(self) -> torch.Tensor:
        """Tokens per (step, layer, expert), int64."""
        if not self._steps:
            raise RuntimeError("no step was recorded")
        return torch.stack(self._steps)


@dataclass(frozen=True)
class LayerLoad:
    """One layer's load over the last ``tail`` steps: tokens per expert per step."""

    layer: int
    per_expert: tuple[float, ...]
    """Mean tokens per step of each expert over the tail."""
    first_ratio: float
    """Largest over smallest mean tokens per step over the first ``tail`` steps (``inf``
    when an expert got none)."""

    @property
    def low(self) -> float:
        return min(self.per_expert)

    @property
    def high(self) -> float:
        return max(self.per_expert)

    @property
    def ratio(self) -> float:
        """Largest over smallest (``inf`` when an expert got no token)."""
        return _ratio(self.per_expert)


def _ratio(values: Sequence[float]) -> float:
    low = min(values)
    return math.inf if low == 0 else max(values) / low


def layer_loads(load: torch.Tensor, tail: int) -> list[LayerLoad]:
    """Per layer of ``load`` (``(steps, layers, experts)``): the mean tokens per expert per
    step over the last ``tail`` steps, and the ratio over the first ``tail``."""
    if load.dim() != 3 or load.shape[0] == 0:
        raise ValueError(f"load must be (steps, layers, experts) with a step, got {load.shape}")
    tail = max(1, min(tail, load.shape[0]))
    last = load[-tail:].double().mean(0)
    first = load[:tail].double().mean(0)
    return [
        LayerLoad(i, tuple(last[i].tolist()), _ratio(first[i].tolist()))
        for i in range(load.shape[1])
    ]


def _times(ratio: float) -> str:
    return "inf" if math.isinf(ratio) else f"{ratio:.2f}x"


def load_table(loads: Sequence[tuple[str, torch.Tensor]], tail: int) -> Table:
    """One row per (policy, MoE layer) of ``loads`` (``(flag, load)`` pairs): the min and
    max tokens per expert per step over the last ``tail`` steps, their ratio, and the ratio
    over the first ``tail`` steps."""
    table = Table(title="expert load: tokens routed to each expert per step")
    table.add_column("policy", no_wrap=True)
    table.add_column("layer", justify="right")
    table.add_column(f"min\n(last {tail})", justify="right")
    table.add_column(f"max\n(last {tail})", justify="right")
    table.add_column(f"max/min\n(last {tail})", justify="right")
    table.add_column(f"max/min\n(first {tail})", justify="right")
    for flag, load in loads:
        rows = layer_loads(load, tail)
        for i, row in enumerate(rows):
            table.add_row(
                flag if i == 0 else "",
                str(row.layer),
                f"{row.low:,.1f}",
                f"{row.high:,.1f}",
                _times(row.ratio),
                _times(row.first_ratio),
                end_section=i == len(rows) - 1,
            )
    return table


def load_notes(settings: DemoSettings, tail: int, tokens: int) -> list[str]:
    """What the load table measures, one line each (``tokens``: tokens per step)."""
    s = settings
    even = tokens * s.top_k / s.experts
    balance = {
        "aux_free": "aux_free (a per-expert bias added to the router's scores for the choice "
        "only, nudged after every step toward the experts that got fewer tokens)",
        "aux_loss": "aux_loss (a switch-style auxiliary loss, in the training loss)",
        "none": "none",
    }[s.balance]
    return [
        f"expert load: each of the {s.experts} routed experts per layer (top-{s.top_k}, "
        f"{s.shared_experts} shared), tokens per step: {tokens:,} tokens x {s.top_k} = "
        f"{tokens * s.top_k:,} per layer, {even:,.1f} per expert when balanced; min/max: "
        f"mean over the last {tail} steps; max/min over the first {tail} steps beside them; "
        f"balancing: {balance}. expert-load.png draws every step."
    ]


def plot_expert_load(
    loads: Sequence[tuple[str, torch.Tensor]], path: Path, title: str = ""
) -> None:
    """Write ``path``: one heatmap per policy, a row per (layer, expert) and a column per
    step, coloured by the expert's tokens over the balanced share (1: balanced; blue
    below, red above, white at 1)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed on servers and CI
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    if not loads:
        raise ValueError("no load to draw")
    layers, experts = loads[0][1].shape[1:]
    rows = layers * experts
    shares = []
    for _, load in loads:
        per_step = load.double().sum(-1, keepdim=True)  # tokens x top_k, every layer
        even = (per_step / experts).clamp_min(1e-12)
        shares.append((load.double() / even).reshape(load.shape[0], rows).T)
    top = max(2.0, max(float(s.max()) for s in shares))
    norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=top)
    height = 1.0 + len(loads) * (0.6 + 0.16 * rows)
    fig, axes = plt.subplots(
        len(loads),
        1,
        figsize=(9, height),
        dpi=110,
        squeeze=False,
        sharex=True,
        layout="constrained",
    )
    image = None
    for ax, (flag, load), share in zip(axes[:, 0], loads, shares, strict=True):
        steps = load.shape[0]
        image = ax.imshow(
            share.numpy(),
            aspect="auto",
            interpolation="nearest",
            cmap="RdBu_r",
            norm=norm,
            extent=(0.5, steps + 0.5, rows - 0.5, -0.5),
        )
        for boundary in range(experts, rows, experts):
            ax.axhline(boundary - 0.5, color="black", linewidth=1.2)
        ticks = list(range(rows))
        ax.set_yticks(ticks)
        ax.set_yticklabels(
            [f"L{r // experts} E{r % experts}" if r % experts == 0 else f"E{r % experts}"
             for r in ticks],
            fontsize=6 if rows > 16 else 7,
        )  # fmt: skip
        ax.set_ylabel(f"{flag}\nlayer, expert", fontsize=8)
    axes[-1][0].set_xlabel("optimizer step")
    fig.suptitle(
        title or "tokens per expert per step over the balanced share (1 = balanced)",
        fontsize=9,
    )
    assert image is not None
    bar = fig.colorbar(image, ax=axes[:, 0].tolist(), fraction=0.04, pad=0.01)
    bar.set_label("tokens / balanced share")
    try:
        with atomic_path(path, what="the expert load plot") as tmp:
            fig.savefig(tmp, format=path.suffix.removeprefix(".") or "png")
    finally:
        plt.close(fig)
