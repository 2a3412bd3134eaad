"""Row, block and mx fp8 policies on many ranks through ``parallelize``: DDP and FSDP2 against
one process on the whole batch, an empty micro-batch, and a DCP round trip."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from computectx import ComputeCtx
from computectx.distributed import parallelize
from computectx.formats import QuantizedLinear

IN = 64
WIDTHS = (64, 256, 256)
"""in, hidden, out: every weight 256 rows, whole 128-row blocks in each of 2 FSDP2 shards."""


def _model(widths: tuple[int, ...] = WIDTHS) -> nn.Sequential:
    # No bias: its gradient sums dY over the tokens in float32, in an order that differs
    # between one process (all rows) and two ranks (half each, then the reduction).
    torch.manual_seed(0)
    d_in, hidden, out = widths
    return nn.Sequential(
        nn.Linear(d_in, hidden, bias=False), nn.ReLU(), nn.Linear(hidden, out, bias=False)
    )


def _batch(
    step: int, rows: int, widths: tuple[int, ...] = WIDTHS
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(rows, widths[0], generator=gen)
    x[rows // 2 :] *= 20.0  # the second rank's half: another range
    return x, torch.randn(rows, widths[-1], generator=gen)


def _full(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    out: torch.Tensor = full() if full is not None else t
    return out.detach().clone()


class _CountAmaxCollectives:
    """The amax sync's collectives this rank issues (``dist.all_gather`` merges ledgers,
    ``dist.all_reduce`` reduces an amax); DDP and FSDP2 issue theirs otherwise."""

    def __init__(self) -> None:
        self.calls = {"all_gather": 0, "all_reduce": 0}
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> _CountAmaxCollectives:
        for name in self.calls:
            original = getattr(dist, name)
            self._saved[name] = original

            def counting(*args: Any, _f: Any = original, _n: str = name, **kw: Any) -> Any:
                self.calls[_n] += 1
                return _f(*args, **kw)

            setattr(dist, name, counting)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)


class _CountGathered:
    """What this rank hands FSDP2's all-gathers: ``(dtype, bytes)`` per call."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.dtype, int]] = []
        self._original: Any = None

    def __enter__(self) -> _CountGathered:
        self._original = original = dist.all_gather_single

        def counting(out: Any, inp: torch.Tensor, *args: Any, **kw: Any) -> Any:
            self.calls.append((inp.dtype, inp.numel() * inp.element_size()))
            return original(out, inp, *args, **kw)

        dist.all_gather_single = counting  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_gather_single = self._original


def _peek(into: list[Any]) -> Any:
    """A forward pre-hook (after FSDP2's, which gathers) that keeps what the layer's weight
    is in the forward: its type, and a block weight's codes and scales."""

    def hook(module: nn.Module, args: Any) -> None:
        w = module.weight
        data, scale = getattr(w, "fp8_data", None), getattr(w, "fp8_scale", None)
        into.append(
            {
                "type": type(w).__name__,
                "codes": None if data is None else data.view(torch.uint8).clone(),
                "scale": None if scale is None else scale.clone(),
            }
        )

    return hook


def _capture(layers: list[QuantizedLinear], store: dict[str, torch.Tensor]) -> list[Any]:
    """Hooks that keep each layer's input and output gradient of the next call."""
    handles = []
    for i, layer in enumerate(layers):

        def forward_hook(module: nn.Module, args: Any, out: torch.Tensor, i: int = i) -> None:
            store[f"{i}.x"] = args[0].detach().clone()

            def keep(grad: torch.Tensor) -> None:
                store[f"{i}.dy"] = grad.detach().clone()

            out.register_hook(keep)  # type: ignore[no-untyped-call]

        handles.append(layer.register_forward_hook(forward_hook))
    return handles


def _reference(
    ctx: ComputeCtx, widths: tuple[int, ...]
) -> tuple[nn.Sequential, list[QuantizedLinear]]:
    """The same model in this process alone: one process on the whole batch (its layers'
    seam reduces nothing, as a one-process layer's; the sync's seam says the same)."""
    from computectx.distributed.collectives import RankLocal
    from computectx.formats import convert_to_quantized

    model = _model(widths)
    convert_to_quantized(model, ctx, module_filter=lambda module, fqn: True)
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    for layer in layers:
        layer.amax_reduce = RankLocal()
    return model, layers


def _float32_gathers(strategy: str) -> MixedPrecisionPolicy | None:
    # These scenarios compare the sharded arithmetic with one process bit for bit, so FSDP2
    # gathers at the parameters' dtype (float32) as one process computes; the ctx's bf16
    # gathers are tested against one process in test_mixed_precision.py.
    return MixedPrecisionPolicy() if strategy == "fsdp" else None


def train(params: dict[str, Any]) -> dict[str, Any]:
    """``steps`` SGD steps through ``parallelize(model, ctx, strategy=...)`` under the flag
    ``flag``; the whole batch has ``rows`` rows and each rank takes its share (one process:
    all). ``empty_at``: the step at which the last rank's share is empty.

    Reports the outputs and losses of every step, the final weights, the amax collectives
    issued in the loop, the warnings, and per step each layer's input and output gradient
    and the weight gradients. With ``reference=True`` each step also runs one process on
    the whole batch from the same weights (``_reference``) and reports the same of it."""
    ctx = ComputeCtx.from_flag(params["flag"], "cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = params["rows"]
    per = rows // world
    widths = tuple(params.get("widths", WIDTHS))
    model = _model(widths)
    out: dict[str, Any] = {"outs": [], "losses": [], "steps": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        par = parallelize(
            model,
            ctx,
            strategy=params["strategy"],
            optimizer_class=torch.optim.SGD,
            fp8_filter=lambda module, fqn: True,
            mp_policy=_float32_gathers(params["strategy"]),
            lr=params.get("lr", 0.05),
        )
        layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
        ref, ref_layers = _reference(ctx, widths) if params.get("reference") else (None, [])
        out["initial"] = {n: _full(p) for n, p in model.named_parameters()}
        gathered: list[Any] = []
        peek = [m.register_forward_pre_hook(_peek(gathered)) for m in layers]
        with _CountAmaxCollectives() as counter, _CountGathered() as wire:
            for step in range(params["steps"]):
                x, y = _batch(step, rows, widths)
                lo = rank * per
                empty = step == params.get("empty_at") and rank == world - 1
                hi = lo if empty else lo + per
                mine: dict[str, torch.Tensor] = {}
                handles = _capture(layers, mine)
                pred = par.model(x[lo:hi])
                loss = nn.functional.mse_loss(pred.float(), y[lo:hi])
                if empty:  # no rows, so no mean: the empty share still takes part
                    loss = pred.float().sum()
                loss.backward()  # type: ignore[no-untyped-call]
                for h in handles:
                    h.remove()
                mine.update(_grads(model))
                if ref is not None:
                    mine.update(_reference_step(ref, ref_layers, model, x, y))
                out["steps"].append(mine)
                par.step()
                out["outs"].append(pred.detach().clone())
                out["losses"].append(float(loss.detach()))
                for h in peek:
                    h.remove()
                peek = []
    out["gathered"] = gathered
    out["wire"] = wire.calls
    out["weights"] = {n: _full(p) for n, p in model.named_parameters()}
    out["amax_collectives"] = counter.calls
    out["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    out["merged_operands"] = -1 if par.sync is None else len(par.sync._snapshots)
    out["seams"] = [
        f"{type(m.amax_reduce).__name__}(reduces={getattr(m.amax_reduce, 'reduces', None)})"
        for m in layers
    ]
    out["ledgers"] = {
        f"{i}.{role}.{part}": getattr(op, part).detach().clone()
        for i, m in enumerate(layers)
        for role, op in m.scaling.operands.items()
        for part in ("ledger", "tally")
    }
    return out


def train_each(params: dict[str, Any]) -> dict[str, Any]:
    """``train`` once per strategy of ``strategies``, in this one launch (each a fresh model)."""
    return {s: train({**params, "strategy": s}) for s in params["strategies"]}


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {f"{n}.grad": _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def _reference_step(
    ref: nn.Sequential,
    layers: list[QuantizedLinear],
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
) -> dict[str, torch.Tensor]:
    # One process on the whole batch from the weights the ranks hold now.
    with torch.no_grad():
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            q.copy_(_full(p))
    seen: dict[str, torch.Tensor] = {}
    handles = _capture(layers, seen)
    nn.functional.mse_loss(ref(x).float(), y).backward()  # type: ignore[no-untyped-call]
    for h in handles:
        h.remove()
    seen.update(_grads(ref))
    ref.zero_grad(set_to_none=True)
    return {f"ref.{k}": v for k, v in seen.items()}


def checkpoint_round_trip(params: dict[str, Any]) -> dict[str, Any]:
    """Under ``flag`` through ``parallelize``: two steps then a DCP save of
    ``par.state_dict()`` to ``path``; with ``load=True`` a fresh setup (other initial
    weights) loads it instead. Reports the output on a fixed probe and the state's keys."""
    from torch.distributed.checkpoint.state_dict_loader import load
    from torch.distributed.checkpoint.state_dict_saver import save

    ctx = ComputeCtx.from_flag(params["flag"], "cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    model = _model()
    if params.get("load"):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-0.5)  # not the weights saved: the load must bring them
    par = parallelize(
        model,
        ctx,
        strategy=params["strategy"],
        fp8_filter=lambda module, fqn: True,
        mp_policy=_float32_gathers(params["strategy"]),
        lr=1e-2,
    )
    if params.get("load"):
        state = par.state_dict()
        load(state, checkpoint_id=params["path"])
        par.load_state_dict(state)
    else:
        per = 64 // world
        for step in range(2):
            x, y = _batch(step, 64)
            xs, ys = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
            nn.functional.mse_loss(par.model(xs).float(), ys).backward()  # type: ignore[no-untyped-call]
            par.step()
        state = par.state_dict()
        save(state, checkpoint_id=params["path"])
    with torch.no_grad():
        probe = par.model(torch.linspace(-2.0, 2.0, 4 * IN).reshape(4, IN))
    return {"probe": probe, "keys": sorted(state["model"])}
