"""4-bit grouped experts under ``parallelize(strategy="fsdp")`` on 2 gloo ranks
(``test_fp4_expert_fsdp.py``).

``experts``: for each recipe of ``params["recipes"]``, a ``GroupedExperts`` of ``EXPERTS``
experts (32 -> 64 -> 32, converted to ``Fp4Experts``) is set up by ``parallelize`` with FSDP2
gathering float32 where it gathers high precision (``MixedPrecisionPolicy()``) and trained
``STEPS`` SGD steps on ``ROWS[rank]`` rows a step, routed by ``OFFS`` (empty experts on each
rank). Each rank reports the experts' weight operands at its first forward (forward and dgrad,
stacked, as uint8), every all-gather's dtype and bytes and every all-reduce, the warnings, the
weights and the counter after each step. Between steps 0 and 1 of ``params["lone"]`` rank 0
alone calls an evaluation forward and ``state_dict()``. Then: 3 experts (``fallback``: FSDP2's
shards cut one, so they gather high precision, with the warning) one step; column shards
(``Shard(1)``, by hand: ``column``) one forward; under ``parallelize``'s default mixed
precision (bf16 gathers) the first forward's operands (``default_mp``);
``parallelize(..., fp8_all_gather=False)`` (``off``: the wrapper type); two ``GroupedExperts``
sharing their weights (``tied``: after one step under the 4-bit gather and with it off, the
weights and whether the tie holds); the first forward under ``torch.inference_mode``
(``inference``: ``parallelize``'s experts, and by hand dense 4-bit and fp8 layers, each gathered
quantized, against one process).
"""

from __future__ import annotations

import datetime
import importlib.util
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from computectx import ComputeCtx
from computectx.distributed import (
    Parallel,
    enable_fp4_all_gather,
    enable_fp4_expert_gather,
    enable_quantized_all_gather,
    parallelize,
)
from computectx.formats import (
    DynamicScaling,
    Fp4Experts,
    Fp4Recipe,
    Recipe,
    convert_to_quantized,
)
from computectx.nn import GroupedExperts

ROWS = (20, 12)
OFFS = {20: (5, 5, 14, 20), 12: (0, 4, 12, 12), 9: (3, 3, 6, 9)}
"""Each batch size's routing (4 experts): expert 1 empty on rank 0, experts 0 and 3 on rank 1."""
EXPERTS = 4
DIM, HIDDEN = 32, 32
STEPS = 2
LR = 0.1
JOIN_S = 1.0
TIMEOUT_S = 10.0


def _dense_helpers() -> Any:
    # The dense scenario's traffic counter, loaded by path (scenario files are no package).
    path = Path(__file__).resolve().parent / "scenarios_fp4_fsdp.py"
    spec = importlib.util.spec_from_file_location("scenarios_fp4_fsdp", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ctx_of(recipe: str) -> ComputeCtx:
    """A CPU ctx under the 4-bit ``recipe``."""
    return ComputeCtx.from_flag("nvfp4", "cpu").replace(recipe=Fp4Recipe.parse(recipe))


class Experts(nn.Module):
    """A ``GroupedExperts`` routed by ``OFFS`` (rows per expert by batch size)."""

    def __init__(self, n_experts: int) -> None:
        super().__init__()
        self.experts = GroupedExperts(ComputeCtx.from_flag("fp32", "cpu"), DIM, HIDDEN, n_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.experts.n_experts
        ends = OFFS[x.shape[0]] if e == EXPERTS else (x.shape[0] // 2,) * (e - 1) + (x.shape[0],)
        offs = torch.tensor(ends, dtype=torch.int32)
        out: torch.Tensor = self.experts(x, offs)
        return out


def model(recipe: str, n_experts: int = EXPERTS, seed: int = 0) -> Experts:
    """The experts, converted under ``recipe`` (``Fp4Experts``)."""
    torch.manual_seed(seed)
    m = Experts(n_experts)
    convert_to_quantized(m, ctx_of(recipe), min_features=16)
    assert isinstance(m.experts.fp8, Fp4Experts)
    return m


def batch(step: int, rank: int, rows: int | None = None) -> torch.Tensor:
    """Rank ``rank``'s rows at ``step`` (float32)."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(ROWS[rank] if rows is None else rows, DIM, generator=gen)


def counter(m: nn.Module) -> int:
    fp4 = next(x for x in m.modules() if isinstance(x, Fp4Experts))
    return int(fp4.sr_key[1])


def whole(m: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (a DTensor gathered), plain."""
    out = {}
    for n, p in m.named_parameters():
        full = getattr(p, "full_tensor", None)
        t = full() if full is not None else p
        out[n] = getattr(t, "hp", t).detach().clone()
    return out


def _setup(
    recipe: str, mesh: DeviceMesh, n_experts: int = EXPERTS, mp: bool = True, **kw: Any
) -> Parallel:
    return _setup_model(model(recipe, n_experts), mesh, recipe, mp, **kw)


def _setup_model(
    m: nn.Module, mesh: DeviceMesh, recipe: str = "nvfp4", mp: bool = True, **kw: Any
) -> Parallel:
    return parallelize(
        m,
        ctx_of(recipe),
        mesh,
        strategy="fsdp",
        optimizer_class=torch.optim.SGD,
        lr=LR,
        mp_policy=MixedPrecisionPolicy() if mp else None,
        accumulate=False,
        offload=False,
        join_timeout=JOIN_S,
        **kw,
    )


def _capture(m: nn.Module) -> tuple[dict[str, Any], Any]:
    """The experts' operands at the first forward: per weight, forward and dgrad (uint8
    codes, scales, amaxes), or ``"hp"``."""
    seen: dict[str, Any] = {}

    def record(mod: GroupedExperts, args: Any) -> None:
        for name in GroupedExperts.NAMES:
            if name in seen:
                continue
            w = getattr(mod, name)
            if not hasattr(w, "dgrad_operand"):
                seen[name] = "hp"
                continue
            seen[name] = [
                (
                    q.codes.view(torch.uint8).clone(),
                    q.scale.view(torch.uint8).clone(),
                    getattr(q, "amax", torch.zeros(())).clone(),
                )
                for q in (w.operand(), w.dgrad_operand())
            ]

    experts = next(x for x in m.modules() if isinstance(x, GroupedExperts))
    return seen, experts.register_forward_pre_hook(record)


def _step(par: Parallel, i: int) -> None:
    par.model(batch(i, dist.get_rank())).square().mean().backward()
    par.step()


def _lone(par: Parallel, tag: str) -> dict[str, str]:
    """Rank 0 alone: an evaluation forward and ``state_dict()``; rank 1 waits."""
    store = dist.distributed_c10d._get_default_store()
    out: dict[str, str] = {}
    if dist.get_rank() == 0:
        for call, fn in (
            ("eval forward", lambda: par.model(batch(9, 0, rows=9))),
            ("state_dict", par.state_dict),
        ):
            try:
                with torch.no_grad():
                    fn()
                out[call] = "runs"
            except Exception as e:  # judged by the test
                out[call] = f"raises {type(e).__name__}: {e}"
        store.set(f"fp4-experts/{tag}", "done")
    else:
        store.wait([f"fp4-experts/{tag}"], datetime.timedelta(seconds=60))
    dist.barrier()
    return out


def _one_recipe(recipe: str, mesh: DeviceMesh, lone: bool, traffic: Any) -> dict[str, Any]:
    par = _setup(recipe, mesh)
    operands, handle = _capture(par.module)
    out: dict[str, Any] = {"weights": [], "counters": [], "gathers": [], "reduces": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(STEPS):
            if lone and i == 1:
                out["lone"] = _lone(par, recipe)
            with traffic(out):
                _step(par, i)
            out["weights"].append(whole(par.module))
            out["counters"].append(counter(par.module))
    handle.remove()
    model_state = par.state_dict()["model"]
    out["saved_as"] = sorted(
        {type(getattr(v, "_local_tensor", v)).__name__ for v in model_state.values()}
    )
    out["operands"] = operands
    out["warnings"] = [str(w.message) for w in caught]
    experts = par.module.get_submodule("experts")
    out["wrapped"] = [
        type(getattr(w, "_local_tensor", w)).__name__ for w in (experts.gate_up, experts.down)
    ]
    return out


def _fallback(mesh: DeviceMesh) -> dict[str, Any]:
    """3 experts on 2 ranks: one step; the warnings, the weights after it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        par = _setup("nvfp4", mesh, n_experts=3)
        operands, handle = _capture(par.module)
        _step(par, 0)
    handle.remove()
    return {
        "warnings": [str(w.message) for w in caught],
        "operands": operands,
        "weights": whole(par.module),
        "counter": counter(par.module),
    }


def _column(mesh: DeviceMesh) -> dict[str, Any]:
    """Column shards (``Shard(1)``) by hand: the first forward's output and warnings."""
    m = model("nvfp4")
    enable_fp4_expert_gather(m)
    mp = MixedPrecisionPolicy()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fully_shard(m.experts, mesh=mesh, mp_policy=mp, shard_placement_fn=lambda p: Shard(1))
        fully_shard(m, mesh=mesh, mp_policy=mp)
        with torch.no_grad():
            y = m(batch(0, dist.get_rank()))
    return {"y": y, "warnings": [str(w.message) for w in caught]}


class Tied(nn.Module):
    """Two ``GroupedExperts`` of ``EXPERTS`` experts holding the same two weights."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = Experts(EXPERTS), Experts(EXPERTS)
        self.b.experts.gate_up, self.b.experts.down = self.a.experts.gate_up, self.a.experts.down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.a(x) + self.b(x.flip(0))
        return out


def _tied(mesh: DeviceMesh) -> dict[str, Any]:
    """``Tied`` under ``parallelize``, one step, with the 4-bit gather and without."""
    out: dict[str, Any] = {}
    for gather in (True, False):
        torch.manual_seed(0)
        m = Tied()
        convert_to_quantized(m, ctx_of("nvfp4"), min_features=16)
        par = _setup_model(m, mesh, fp8_all_gather=gather, shard_units=[])  # one FSDP2 unit
        _step(par, 0)
        a, b = (par.module.get_submodule(f"{n}.experts") for n in "ab")
        out[str(gather)] = {
            "tied": a.gate_up is b.gate_up and a.down is b.down,
            "params": len(list(par.module.parameters())),
            "local": type(getattr(a.gate_up, "_local_tensor", a.gate_up)).__name__,
            "weights": whole(par.module),
        }
    return out


def _inference(mesh: DeviceMesh) -> dict[str, Any]:
    """Each gather's first forward under ``torch.inference_mode``, and one process's."""
    rank, dense = dist.get_rank(), _dense_helpers()
    mp = MixedPrecisionPolicy()
    fp4 = dense.model("nvfp4")
    enable_fp4_all_gather(fp4)
    torch.manual_seed(0)
    fp8 = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    dynamic = Recipe(scaling=DynamicScaling())  # each gather's own amax: no sync_scaling
    fp8_ctx = ComputeCtx.from_flag("fp8_hybrid", "cpu").replace(recipe=dynamic)
    convert_to_quantized(fp8, fp8_ctx, module_filter=lambda module, fqn: True)
    with torch.no_grad():
        one_fp8 = fp8(dense.batch(0, rank))  # one process, before the gather wraps it
    enable_quantized_all_gather(fp8)
    cases = {"experts": (_setup("nvfp4", mesh).model, batch(0, rank))}
    for name, m in (("dense fp4", fp4), ("dense fp8", fp8)):
        fully_shard(m, mesh=mesh, mp_policy=mp)
        cases[name] = (m, dense.batch(0, rank))
    out: dict[str, Any] = {
        "wrapped": [
            type(getattr(w, "_local_tensor", w)).__name__ for w in (fp4[0].weight, fp8[0].weight)
        ]
    }
    for name, (m, x) in cases.items():
        try:
            with torch.inference_mode():
                y = m(x)
            out[name] = y.clone()
        except Exception as e:  # judged by the test
            out[name] = f"raises {type(e).__name__}: {e}"
    with torch.no_grad():
        out["one process"] = {
            "experts": model("nvfp4")(batch(0, rank)),
            "dense fp4": dense.model("nvfp4")(dense.batch(0, rank)),
            "dense fp8": one_fp8,
        }
    return out


def experts(params: dict[str, Any]) -> dict[str, Any]:
    """Each recipe of ``params["recipes"]`` and the rest (module docstring), on a group whose
    collectives time out after ``TIMEOUT_S``."""
    group = dist.new_group(list(range(2)), timeout=datetime.timedelta(seconds=TIMEOUT_S))
    mesh = DeviceMesh.from_group(group, "cpu")
    traffic = _dense_helpers()._traffic
    out: dict[str, Any] = {}
    for recipe in params["recipes"]:
        out[recipe] = _one_recipe(recipe, mesh, recipe == params["lone"], traffic)
    out["fallback"] = _fallback(mesh)
    out["column"] = _column(mesh)
    default = _setup("nvfp4", mesh, mp=False)  # parallelize's mixed precision: bf16 gathers
    operands, handle = _capture(default.module)
    with torch.no_grad():
        default.model(batch(0, dist.get_rank()))
    handle.remove()
    out["default_mp"] = operands
    off = _setup("nvfp4", mesh, fp8_all_gather=False).module.get_submodule("experts").gate_up
    out["off"] = type(getattr(off, "_local_tensor", off)).__name__
    out["tied"] = _tied(mesh)
    out["inference"] = _inference(mesh)
    return out
