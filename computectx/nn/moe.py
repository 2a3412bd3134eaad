"""``MoE``: a dropless token-choice mixture-of-experts block that reads the ctx.

Each token picks ``top_k`` of ``n_experts`` SwiGLU experts through a ``Router`` whose scores,
selection and weights run at ``compute ⊔ accum`` (the dtype ``ctx.precise`` lifts to: a gate
in bf16 would move tokens between experts on rounding alone). The tokens' copies are sorted
by expert (a stable sort, so each expert sees its tokens in order), run through the
``GroupedExperts`` as two grouped GEMMs, put back in token order and summed with their
routing weights at ``compute ⊔ accum``, rounded once to ``ctx.compute``. No token is dropped
and no expert has a capacity. Optional shared experts (one ``MLP`` of width ``n_shared *
hidden``, as DeepSeek-V3 builds them) see every token and add to the output.

Load balancing is the user's choice (``balance``):

- ``"aux_free"``: DeepSeek-V3's auxiliary-loss-free balancing. The router adds a per-expert
  ``bias`` (a buffer, never learned) to the scores when it selects experts, not when it
  weighs them. The training loop moves it after each optimizer step with ``update_bias()``:
  ``bias += bias_rate * sign(mean(load) - load)``, ``load`` the tokens each expert received
  since the last update (``tokens_per_expert``, counted by every forward in training mode).
  Called between steps rather than inside the forward, it is deterministic, runs once per step
  under gradient accumulation, and is not repeated by activation checkpointing's recompute.
  The count is the forward's last step, so torch's default non-reentrant checkpointing
  (``use_reentrant=False``, early stop on) counts each token once: its recompute stops once
  the saved tensors are back, before the count. Reentrant checkpointing, or early stop
  turned off, reruns the whole forward and counts the layer's tokens twice: every expert's
  count doubles, and the sign of ``mean - load`` does not change. With data parallelism,
  all-reduce (sum) each ``tokens_per_expert`` across ranks before ``update_bias()``, so every
  rank moves its bias the same way (``ByteLM.update_expert_bias`` calls it for every block;
  ``update_biases`` checks every layer before it changes any).
- ``"aux_loss"``: a switch-style auxiliary loss, ``aux_coef * E * sum_e f_e * P_e``, ``f_e``
  the fraction of the ``T * top_k`` routed copies that expert ``e`` received and ``P_e`` the
  mean over tokens of its normalized score (the softmax probability; for sigmoid scores,
  each token's scores divided by their sum). Uniform routing gives ``aux_coef``. It is
  stored in ``aux_loss`` by each forward in training mode; add it to the loss.
- ``"none"``: neither. The ``bias`` is still added for selection (a loaded checkpoint's,
  DeepSeek-V3 inference), never moved.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple, get_args

import torch
from torch import nn

from computectx._checks import fault, shown_ints
from computectx.ctx import BuiltUnder, ComputeCtx
from computectx.dtypes import cast_if, dtype_of, promote
from computectx.formats.seam import guard_whole_loads
from computectx.nn.checks import checked_count, checked_flag, checked_real
from computectx.nn.experts import GroupedExperts
from computectx.nn.mlp import MLP
from computectx.nn.params import apply_recipe, param_dtype
from computectx.saved import SAVING, saved_call

__all__ = [
    "ExpertDispatch",
    "LoadBalance",
    "MoE",
    "Router",
    "RouterScore",
    "Routing",
    "update_biases",
]

RouterScore = Literal["softmax", "sigmoid"]
"""How the router scores experts: ``softmax`` over all experts, or DeepSeek-V3's ``sigmoid``
of each expert's logit."""
LoadBalance = Literal["aux_free", "aux_loss", "none"]
"""How an ``MoE`` balances its experts' load (the module docstring)."""

ExpertDispatch = Callable[[torch.Tensor, torch.Tensor, GroupedExperts], torch.Tensor]
"""``(x_sorted, counts, experts) -> y_sorted``: runs the experts on rows sorted by expert,
``counts`` int64 ``(E,)`` rows per expert (expert parallelism, ``computectx.distributed``)."""


class Routing(NamedTuple):
    """A router's decision for ``T`` tokens."""

    weights: torch.Tensor
    """``(T, top_k)`` at ``compute ⊔ accum``: each chosen expert's weight in the combine."""
    experts: torch.Tensor
    """``(T, top_k)`` int64: the chosen experts, by descending biased score."""
    probs: torch.Tensor
    """``(T, E)`` at ``compute ⊔ accum``: every expert's normalized score (rows sum to 1),
    the ``P`` of the auxiliary loss."""


class Router(BuiltUnder, nn.Module):
    """Token-choice top-k gate: ``weight`` ``(E, dim)`` scores each token against every expert.

    Not an ``nn.Linear``, so no fp8 conversion touches it; its GEMM, scores, selection and
    weights run at ``x.dtype ⊔ ctx.accum`` with autocast off. ``softmax``: probabilities, the
    top ``top_k`` of ``probs + bias`` chosen, weighted by their probabilities (renormalized
    to sum 1 when ``renormalize``). ``sigmoid`` (DeepSeek-V3): the top ``top_k`` of
    ``sigmoid(logits) + bias`` chosen, weighted by their sigmoid scores (normalized to sum 1
    when ``renormalize``). Either way the weights are then multiplied by ``route_scale``.
    ``bias`` is a float32 buffer, used for selection only (``MoE``'s ``aux_free``).
    """

    bias: torch.Tensor

    def __init__(
        self,
        ctx: ComputeCtx,
        dim: int,
        n_experts: int,
        top_k: int,
        *,
        score: RouterScore = "softmax",
        renormalize: bool = True,
        route_scale: float = 1.0,
    ) -> None:
        super().__init__()
        dim = checked_count("Router", "dim", dim, 1)
        n_experts = checked_count("Router", "n_experts", n_experts, 1)
        top_k = _checked_top_k("Router", top_k, n_experts)
        _check_choice("router score", score, get_args(RouterScore))
        renormalize = checked_flag("Router", "renormalize", renormalize)
        route_scale = checked_real("Router", "route_scale", route_scale, non_negative=False)
        self.ctx = ctx
        self.n_experts, self.top_k = n_experts, top_k
        self.score, self.renormalize, self.route_scale = score, renormalize, route_scale
        bound = 1 / math.sqrt(dim)
        self.weight = nn.Parameter(
            torch.empty(n_experts, dim, device=ctx.device, dtype=param_dtype(ctx)).uniform_(
                -bound, bound
            )
        )
        self.register_buffer("bias", torch.zeros(n_experts, device=ctx.device))
        guard_whole_loads(self)  # load_state_dict checks the bias (check_load) first

    def check_load(self, entries: dict[str, object], prefix: str) -> None:
        """``ValueError`` unless ``entries`` (this router's, by local name) hold a float
        ``bias`` of shape ``(n_experts,)`` with every value finite (or none): run by
        ``load_state_dict`` on the whole state dict before any module loads. A NaN or inf
        bias would send every token to one expert, with finite outputs."""
        bias = entries.get("bias")
        if bias is None:
            return
        check_bias(bias, self.n_experts, f"{prefix}bias")

    def extra_repr(self) -> str:
        return (
            f"n_experts={self.n_experts}, top_k={self.top_k}, score={self.score!r}, "
            f"renormalize={self.renormalize}, route_scale={self.route_scale}"
        )

    def forward(self, x: torch.Tensor) -> Routing:
        """The routing of ``x`` ``(T, dim)``."""
        work = promote(dtype_of(x), self.ctx.accum)
        with torch.autocast(x.device.type, enabled=False):
            wide = cast_if(x, work)
            logits = nn.functional.linear(wide, cast_if(self.weight, work))
            # Already at accum: ctx.precise runs the score as it is and casts nothing back.
            scores = self.ctx.precise(
                logits, torch.sigmoid if self.score == "sigmoid" else _softmax_last
            )
            chosen = torch.topk(scores + self.bias, self.top_k, dim=-1).indices
            picked = scores.gather(-1, chosen)
            if self.renormalize:
                tiny = torch.finfo(picked.dtype).tiny
                picked = picked / picked.sum(-1, keepdim=True).clamp_min(tiny)
            weights = picked * self.route_scale if self.route_scale != 1.0 else picked
            if self.score == "sigmoid":
                probs = scores / scores.sum(-1, keepdim=True).clamp_min(
                    torch.finfo(work.torch).tiny
                )
            else:
                probs = scores
        return Routing(weights, chosen, probs)


def _checked_top_k(owner: str, top_k: object, n_experts: int) -> int:
    k = checked_count(owner, "top_k", top_k, 1)
    if k > n_experts:
        raise ValueError(f"top_k must lie in [1, n_experts={n_experts}], got {k!r}")
    return k


def _check_choice(what: str, value: object, accepted: tuple[str, ...]) -> None:
    # ValueError naming what unless value is one of the accepted strings.
    if not isinstance(value, str) or value not in accepted:
        raise ValueError(f"{what} must be one of {', '.join(map(repr, accepted))}, got {value!r}")


def check_bias(bias: object, n_experts: int, what: str) -> None:
    """``TypeError``/``ValueError`` naming ``what`` unless ``bias`` is a floating tensor of
    shape ``(n_experts,)`` whose values are all finite (one host read)."""
    if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
        got = bias.dtype if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise TypeError(f"{what} must be a floating-point tensor, got {got}")
    if tuple(bias.shape) != (n_experts,):
        raise ValueError(
            f"{what} must have shape ({n_experts},), one per expert, got {tuple(bias.shape)}"
        )
    bad = ~torch.isfinite(bias)
    if bool(bad.any()):
        experts = bad.nonzero().flatten()
        first = int(experts[0])
        raise ValueError(
            f"{what} must be finite; that of experts {shown_ints(experts)} is not (expert "
            f"{first}'s is {fault(bias[first])}; a NaN or inf router bias sends every token "
            f"to one expert)"
        )


def _combine(y_sorted: torch.Tensor, weights: torch.Tensor, back: torch.Tensor) -> torch.Tensor:
    # MoE's combine: each token's top_k expert outputs, back in token order, weighted and
    # summed at the weights' dtype (compute ⊔ accum).
    n, k = weights.shape
    y = y_sorted[back].view(n, k, y_sorted.shape[-1])
    return (y.to(weights.dtype) * weights.unsqueeze(-1)).sum(1)


def _softmax_last(t: torch.Tensor) -> torch.Tensor:
    return torch.softmax(t, dim=-1)


class MoE(BuiltUnder, nn.Module):
    """Dropless top-k mixture of SwiGLU experts (the module docstring).

    ``forward(x)`` takes ``(..., dim)`` and returns the same shape at ``ctx.compute``.
    Submodules: ``router`` (a ``Router``), ``experts`` (``GroupedExperts``: ``gate_up``
    ``(E, 2 * hidden, dim)``, ``down`` ``(E, dim, hidden)``) and ``shared`` (an ``MLP`` of
    width ``n_shared * hidden``, or ``None``). Under an fp8 ctx the experts and the shared
    MLP run in fp8 from construction (``apply_recipe``); the router never does.

    After each forward: ``last_load`` (buffer, int64 ``(E,)``) holds the routed copies each
    expert received; in training mode ``tokens_per_expert`` (int64 ``(E,)``) adds them up
    until ``update_bias()``, and ``aux_loss`` holds the auxiliary loss under
    ``balance="aux_loss"`` (``None`` otherwise, and in eval mode).

    ``dispatch`` (default ``None``): when set, an ``ExpertDispatch`` called as
    ``dispatch(x_sorted, counts, experts)`` instead of ``experts(x_sorted, offs)``: the hook
    expert parallelism fills (``computectx.distributed``; ``nn`` never imports it).
    ``last_load``, ``tokens_per_expert`` are rank-local: keep them out of DDP's buffer
    broadcast (``local_buffer_names``).
    """

    last_load: torch.Tensor
    tokens_per_expert: torch.Tensor
    aux_loss: torch.Tensor | None
    dispatch: ExpertDispatch | None

    def __init__(
        self,
        ctx: ComputeCtx,
        dim: int,
        hidden: int,
        n_experts: int,
        top_k: int,
        *,
        n_shared: int = 0,
        score: RouterScore = "softmax",
        balance: LoadBalance = "aux_free",
        renormalize: bool = True,
        route_scale: float = 1.0,
        bias_rate: float = 1e-3,
        aux_coef: float = 1e-2,
    ) -> None:
        super().__init__()
        # Every argument checked before anything is built (numpy integers count as ints).
        if not isinstance(ctx, ComputeCtx):
            raise TypeError(f"MoE takes a ComputeCtx, got {type(ctx).__name__}")
        dim = checked_count("MoE", "dim", dim, 1)
        hidden = checked_count("MoE", "hidden", hidden, 1)
        n_experts = checked_count("MoE", "n_experts", n_experts, 1)
        top_k = _checked_top_k("MoE", top_k, n_experts)
        n_shared = checked_count("MoE", "n_shared", n_shared, 0)
        _check_choice("MoE balance", balance, get_args(LoadBalance))
        _check_choice("router score", score, get_args(RouterScore))
        renormalize = checked_flag("MoE", "renormalize", renormalize)
        route_scale = checked_real("MoE", "route_scale", route_scale, non_negative=False)
        bias_rate = checked_real("MoE", "bias_rate", bias_rate, non_negative=True)
        aux_coef = checked_real("MoE", "aux_coef", aux_coef, non_negative=True)
        if n_shared * hidden > 2**31 - 1:
            raise ValueError(
                f"MoE n_shared * hidden must be at most {2**31 - 1}, got {n_shared} * {hidden}"
            )
        self.ctx = ctx
        self.dim, self.hidden, self.n_experts, self.top_k = dim, hidden, n_experts, top_k
        self.balance: LoadBalance = balance
        self.bias_rate, self.aux_coef = bias_rate, aux_coef
        self.experts = GroupedExperts(ctx, dim, hidden, n_experts)
        self.router = Router(
            ctx,
            dim,
            n_experts,
            top_k,
            score=score,
            renormalize=renormalize,
            route_scale=route_scale,
        )
        self.shared = MLP(ctx, dim, n_shared * hidden) if n_shared else None
        for name in self.local_buffer_names():
            zeros = torch.zeros(n_experts, device=ctx.device, dtype=torch.int64)
            self.register_buffer(name, zeros, persistent=False)
        self.aux_loss = None
        self.dispatch = None
        apply_recipe(self, ctx)
        guard_whole_loads(self)  # the router's bias is checked before anything loads

    def extra_repr(self) -> str:
        return f"balance={self.balance!r}"

    @staticmethod
    def local_buffer_names() -> tuple[str, ...]:
        """The buffers each rank keeps for itself (DDP must not broadcast rank 0's)."""
        return ("last_load", "tokens_per_expert")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.dim:
            raise ValueError(f"MoE takes (..., {self.dim}) inputs, got {tuple(x.shape)}")
        with self.ctx.autocast():
            x = self.ctx.to_compute(x)
            flat = x.reshape(-1, self.dim)
            n, k = flat.shape[0], self.top_k
            routing = self.router(flat)
            chosen = routing.experts.reshape(-1)  # copy i*k + j is token i's j-th choice
            order = torch.argsort(chosen, stable=True)
            # A bincount with a static length (bincount's own length depends on the values,
            # which torch.compile cannot trace without a graph break).
            counts = torch.zeros(self.n_experts, dtype=torch.int64, device=chosen.device)
            counts = counts.scatter_add_(0, chosen, torch.ones_like(chosen))
            x_sorted = flat[order // k]
            if self.dispatch is None:
                offs = torch.cumsum(counts, 0, dtype=torch.int32)
                y_sorted = self.experts(x_sorted, offs)
            else:
                y_sorted = self.dispatch(x_sorted, counts, self.experts)
            back = torch.empty_like(order).scatter_(
                0, order, torch.arange(n * k, device=order.device)
            )
            # The combine at compute ⊔ accum: top_k products summed, then one rounding.
            activations, work = self.ctx.activations, routing.weights.dtype
            if torch.compiler.is_compiling() and activations.moe == "keep":
                out = _combine(y_sorted, routing.weights, back)
            elif activations.moe == "keep" or not torch.is_grad_enabled():
                token = SAVING.set("moe")  # what the combine keeps, for SavedActivations
                try:
                    out = _combine(y_sorted, routing.weights, back)
                finally:
                    SAVING.reset(token)
            else:
                # Its backward keeps the experts' outputs (sorted, at the compute dtype) as
                # ctx.activations' moe says, not their float32 copy in token order; the
                # routing weights and the order as they are.
                out = saved_call(
                    _combine,
                    y_sorted,
                    routing.weights,
                    back,
                    mode=activations.moe,
                    group=activations.group,
                    kind="moe",
                )
            if self.shared is not None:
                out = out + self.shared(flat).to(work)
            self._account(counts, routing.probs, n * k)
            return self.ctx.to_compute(out).view(x.shape)

    def _account(self, counts: torch.Tensor, probs: torch.Tensor, copies: int) -> None:
        with torch.no_grad():
            self.last_load.copy_(counts)
            if self.training:
                self.tokens_per_expert.add_(counts)
        if self.balance == "aux_loss" and self.training and copies:
            f = counts.to(probs.dtype) / copies
            # sum_e f_e P_e <= 1, so sum * E <= E: multiplied by aux_coef last, the loss
            # overflows only when its true value does (aux_coef * E formed first may not fit).
            self.aux_loss = (f * probs.mean(0)).sum() * self.n_experts * self.aux_coef
        else:
            self.aux_loss = None

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor | None = None) -> None:
        """One auxiliary-loss-free step: ``router.bias += bias_rate * sign(mean(load) -
        load)``, ``load`` the tokens per expert since the last call (``tokens_per_expert``,
        all-reduced across data-parallel ranks by the caller) or the ``load`` given; then
        ``tokens_per_expert`` starts again from zero. Call it after each optimizer step.
        Under ``balance`` other than ``"aux_free"`` the bias does not move (the count is
        still reset); nor does it when no token was counted. A load that is not a finite,
        non-negative count per expert, a bias that is not finite, or a step that would make
        it so raises and changes nothing (``update_biases`` for many layers at once)."""
        update_biases([self], [load])

    def _planned_bias(self, load: torch.Tensor | None) -> torch.Tensor | None:
        # update_bias's checks and the bias it would write (None: the bias stays), changing
        # nothing. One host read, between steps.
        counted = self.tokens_per_expert if load is None else load
        if not isinstance(counted, torch.Tensor):
            raise TypeError(
                f"update_bias takes a load per expert as a tensor, got {type(counted).__name__}"
            )
        if counted.shape != (self.n_experts,):
            raise ValueError(
                f"update_bias takes a load per expert, shape ({self.n_experts},), got "
                f"{tuple(counted.shape)}"
            )
        if counted.is_complex() or counted.dtype == torch.bool:
            raise TypeError(f"update_bias takes a real load per expert, got {counted.dtype}")
        bias = self.router.bias
        # A bias already non-finite (written around load_state_dict) is refused in every
        # balance: it still decides the selection.
        check_bias(bias, self.n_experts, "the router bias")
        wide = counted.detach().to(device=bias.device, dtype=torch.float64)
        bad_load = ~torch.isfinite(wide) | (wide < 0)
        if bool(bad_load.any()):
            experts = bad_load.nonzero().flatten()
            first = int(experts[0])
            raise ValueError(
                f"update_bias takes a finite, non-negative load per expert (token counts); "
                f"the load of experts {shown_ints(experts)} is not (expert {first}'s is "
                f"{fault(wide[first])})"
            )
        if self.balance != "aux_free":
            return None
        step = torch.sign(wide.mean() - wide) * self.bias_rate
        # No tokens (an eval-only call): mean - load is 0 everywhere, so no step.
        moved = bias + step.to(bias.dtype)
        check_bias(moved, self.n_experts, "the router bias after update_bias")
        return moved


def planned_biases(
    layers: Sequence[MoE],
    loads: Sequence[torch.Tensor | None] | None = None,
    names: Sequence[str] | None = None,
) -> list[torch.Tensor | None]:
    """Every check ``update_biases`` makes, changing nothing: the bias each layer of
    ``layers`` would get (``None``: it stays), or the first refusal, naming the layer (by
    ``names[i]``, its FQN, where given)."""
    layers = list(layers)
    if not all(isinstance(m, MoE) for m in layers):
        bad = next(m for m in layers if not isinstance(m, MoE))
        raise TypeError(f"update_biases takes MoE layers, got {type(bad).__name__}")
    given = [None] * len(layers) if loads is None else list(loads)
    if len(given) != len(layers):
        raise ValueError(
            f"update_biases takes one load per layer: {len(layers)} layers, {len(given)} loads"
        )
    planned = []
    for i, (m, load) in enumerate(zip(layers, given, strict=True)):
        try:
            planned.append(m._planned_bias(load))
        except (TypeError, ValueError) as e:
            if len(layers) == 1 and names is None:
                raise
            which = f"MoE layer {i} of {len(layers)}" if names is None else names[i]
            raise type(e)(f"{which}: {e} (no layer's bias or count was changed)") from None
    return planned


@torch.no_grad()
def update_biases(
    layers: Sequence[MoE], loads: Sequence[torch.Tensor | None] | None = None
) -> None:
    """``MoE.update_bias`` for every layer of ``layers`` (``loads[i]`` the load of layer
    ``i``, ``None`` or left out: its own ``tokens_per_expert``), every layer checked before
    any changes (``planned_biases``): a refused layer (a bad load, a non-finite bias, a step
    that would make one non-finite) raises naming it, and no layer's bias or count has
    moved. Then every bias moves and every count starts again from zero.
    ``ByteLM.update_expert_bias`` and ``distributed.update_expert_bias`` call it."""
    layers = list(layers)
    planned = planned_biases(layers, loads)
    for m, moved in zip(layers, planned, strict=True):
        if moved is not None:
            m.router.bias.copy_(moved)
        m.tokens_per_expert.zero_()
