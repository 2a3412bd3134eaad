"""The policy's dtypes on many ranks: what ``parallelize(strategy="fsdp")`` gathers per kind of
parameter and reduce-scatters, what DDP reduces under a low-precision ``ctx.grad``, and the
training a bf16 gather gives against one process."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.nn.parallel import DistributedDataParallel

from computectx import ComputeCtx, DType
from computectx.distributed import DataParallelGradAccumulator, parallelize
from computectx.formats import convert_to_quantized
from computectx.formats.linear.fp4 import Fp4Linear

ROWS = 8  # tokens per step, split over the ranks


class _Count:
    """What this rank hands the collectives named: ``(dtype, bytes)`` per call, and with
    ``keep=True`` a copy of each input."""

    def __init__(self, *names: str, keep: bool = False) -> None:
        self.calls: dict[str, list[tuple[torch.dtype, int]]] = {n: [] for n in names}
        self.inputs: dict[str, list[torch.Tensor]] = {n: [] for n in names}
        self._keep = keep
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> _Count:
        for name in self.calls:
            original = self._saved[name] = getattr(dist, name)

            def counting(*args: Any, _f: Any = original, _n: str = name, **kw: Any) -> Any:
                # FSDP2 passes (output, input) positionally to its gathers and as keywords
                # to its reduce-scatters; all_reduce takes the tensor first.
                if _n == "all_reduce":
                    inp = args[0] if args else kw["tensor"]
                else:
                    inp = args[1] if len(args) > 1 else kw["input"]
                self.calls[_n].append((inp.dtype, inp.numel() * inp.element_size()))
                if self._keep:
                    self.inputs[_n].append(inp.detach().clone())
                return _f(*args, **kw)

            setattr(dist, name, counting)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)


def _linear(d_in: int, d_out: int, bias: bool = False) -> Callable[[], nn.Module]:
    return lambda: nn.Linear(d_in, d_out, bias=bias)


# name -> (flag, ctx changes, the layer, its input width (0: token ids), converted to fp8)
KINDS: dict[str, tuple[str, dict[str, Any], Callable[[], nn.Module], int, bool]] = {
    "embedding": ("fp8_hybrid", {}, lambda: nn.Embedding(64, 32), 0, False),
    "norm": ("fp8_hybrid", {}, lambda: nn.LayerNorm(32), 32, False),
    "head (not fp8)": ("fp8_hybrid", {}, _linear(32, 64, bias=True), 32, False),
    "fp8 tensor, delayed": ("fp8_hybrid", {}, _linear(32, 64), 32, True),
    "fp8 tensor, dynamic": ("fp8_hybrid_dynamic", {}, _linear(32, 64), 32, True),
    "fp8 block": ("fp8_block", {}, _linear(128, 256), 128, True),
    "fp8 row": ("fp8_rowwise", {}, _linear(32, 64), 32, True),
    "fp8 mx": ("fp8_mx", {}, _linear(64, 64), 64, True),
    "bf16 model": ("bf16", {}, _linear(32, 64, bias=True), 32, False),
    "fp32 model": ("fp32", {}, _linear(32, 64, bias=True), 32, False),
    "bf16 model, bf16 gradients": ("bf16", {"grad": DType.BF16}, _linear(32, 64, True), 32, False),
}


def dtypes(params: dict[str, Any]) -> dict[str, Any]:
    """``fsdp`` and ``fsdp_plain``: per kind of parameter (``KINDS``, each layer alone in a
    model, its own ``fully_shard`` unit), ``steps`` SGD steps through
    ``parallelize(strategy="fsdp")`` with the ctx's mixed precision, and with
    ``mp_policy=MixedPrecisionPolicy()``: the bytes per shard element of each all-gather,
    the dtypes the gathers and the reduce-scatters travel in, what the layer computed with
    (the gathered weight's type and dtype) and its output's dtype.

    ``ddp``: ``parallelize(strategy="ddp")`` under a ctx asking for bf16 gradients, with
    the default accumulator and with ``accumulate=False``: DDP's comm hooks, and the
    all-reduces one step of two micro-batches issues (dtype, bytes)."""
    return {
        "fsdp": _fsdp_kinds(params["steps"], plain=False),
        "fsdp_plain": _fsdp_kinds(params["steps"], plain=True),
        "ddp": {acc: _ddp(acc) for acc in ("default", "off")},
        "fp4_ddp": fp4_ddp(dist.get_rank(), dist.get_world_size()),
    }


def fp4_model() -> nn.Sequential:
    """Two ``Fp4Linear`` (NVFP4, TE's recipe: stochastic rounding, the Hadamard transform)."""
    ctx = ComputeCtx.from_flag("nvfp4", "cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    convert_to_quantized(model, ctx, include_head=True, min_features=16)
    return model


def fp4_batch() -> torch.Tensor:
    """The global batch: 40 rows (20 a rank: the column-wise operands pad to 32)."""
    return torch.randn(40, 32, generator=torch.Generator().manual_seed(1)).bfloat16()


def fp4_ddp(rank: int, world: int) -> dict[str, Any]:
    """``fp4_ddp``: torch's DDP around 4-bit linears (no computectx collective), one step
    on this rank's rows of ``fp4_batch``: the averaged gradients and the counters."""
    model = fp4_model()
    ddp = DistributedDataParallel(model)
    ddp(fp4_batch().chunk(world)[rank]).float().square().sum().backward()
    return {
        "grads": [p.grad.detach().clone() for p in model.parameters() if p.grad is not None],
        "keys": [m.sr_key.clone() for m in model.modules() if isinstance(m, Fp4Linear)],
    }


def _fsdp_kinds(steps: int, plain: bool) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    fsdp: dict[str, Any] = {}
    for name, (flag, changes, build, width, fp8) in KINDS.items():
        ctx = ComputeCtx.from_flag(flag, "cpu").replace(**changes)
        torch.manual_seed(0)
        model = nn.Sequential(build())  # the layer is its own unit; the root holds nothing
        kwargs: dict[str, Any] = {"mp_policy": MixedPrecisionPolicy()} if plain else {}
        par = parallelize(
            model,
            ctx,
            strategy="fsdp",
            optimizer_class=torch.optim.SGD,
            fp8_filter=(lambda module, fqn: True) if fp8 else (lambda module, fqn: False),
            accumulate=False,
            offload=False,
            lr=1e-2,
            **kwargs,
        )
        elements = sum(p.to_local().numel() for p in model.parameters())  # type: ignore[attr-defined]
        seen: dict[str, str] = {}

        def weight(module: nn.Module, args: Any, _s: dict[str, str] = seen) -> None:
            # After FSDP2's pre-forward hook: the gathered weight the layer computes with.
            w = module.weight
            _s["weight"] = f"{type(w).__name__}:{w.dtype}"

        def output(
            module: nn.Module, args: Any, result: torch.Tensor, _s: dict[str, str] = seen
        ) -> None:
            _s["out"] = str(result.dtype)

        hooks = [
            model[0].register_forward_pre_hook(weight),
            model[0].register_forward_hook(output),
        ]
        gen = torch.Generator().manual_seed(10 + rank)
        with _Count("all_gather_single", "reduce_scatter_single") as counter:
            for _ in range(steps):
                if width:
                    x = torch.randn(ROWS // world, width, generator=gen)
                else:
                    x = torch.randint(0, 64, (ROWS // world,), generator=gen)
                par.model(x).float().square().mean().backward()
                par.step()
        for hook in hooks:
            hook.remove()
        gathers = counter.calls["all_gather_single"]
        fsdp[name] = {
            "bytes_per_element": sum(n for _, n in gathers) / (len(gathers) * elements),
            "gather_dtypes": sorted({str(d) for d, _ in gathers}),
            "reduce_dtypes": sorted({str(d) for d, _ in counter.calls["reduce_scatter_single"]}),
            **seen,
        }
    return fsdp


def _ddp(accumulate: str) -> dict[str, Any]:
    ctx = ComputeCtx.new(DType.F32, "cpu").replace(grad=DType.BF16)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    par = parallelize(
        model,
        ctx,
        strategy="ddp",
        offload=False,
        optimizer_class=torch.optim.SGD,
        lr=1e-2,
        accumulate=False if accumulate == "off" else None,
    )
    gen = torch.Generator().manual_seed(dist.get_rank())
    with _Count("all_reduce") as counter:
        for _ in range(2):  # two micro-batches, no no_sync(): DDP reduces after each
            par.model(torch.randn(4, 16, generator=gen)).square().mean().backward()
        # What DDP left in param.grad (its reducer runs in C++, not through dist.all_reduce).
        grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
        par.step()
    hooks = [h.__name__ for h, _ in getattr(par.model, "_comm_hooks", [])]
    return {
        "accumulator": type(par.accumulator).__name__,
        "data_parallel_accumulator": isinstance(par.accumulator, DataParallelGradAccumulator),
        "comm_hooks": hooks,
        "all_reduces": [(str(d), n) for d, n in counter.calls["all_reduce"]],
        "grads": torch.cat([g.view(-1) for g in grads]) if grads else None,
        "elements": sum(p.numel() for p in model.parameters()),
        "parameters": len(list(model.parameters())),
    }


VOCAB, WIDTH, HIDDEN = 64, 32, 96


class TinyLM(nn.Module):
    """Every kind of parameter in one model: an embedding, a norm, two fp8 linears (with
    biases) and a head left high precision. Each child is its own ``fully_shard`` unit, of
    a size no other unit has."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.down(nn.functional.gelu(self.up(self.norm(h))))
        out: torch.Tensor = self.head(h)
        return out


def _data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (ROWS,), generator=gen)
        out.append((ids, torch.randint(0, VOCAB, (ROWS,), generator=gen)))
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    out: torch.Tensor = full() if full is not None else t
    out = getattr(out, "hp", out)  # a WeightGatheredQuantized: its plain tensor
    return out.detach().clone()


def _fp8_filter(module: nn.Module, fqn: str) -> bool:
    return fqn in ("up", "down")


def _fsdp_one_rank(model: nn.Module, ctx: ComputeCtx, lr: float) -> torch.optim.Optimizer:
    """One process computing as the ranks do: FSDP2 on a mesh of this rank alone, with
    the ctx's mixed precision (gathers at ``ctx.compute``, float32 masters, gradients made
    at ``ctx.compute`` and reduced at ``ctx.grad``) and the fp8 all-gather."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from computectx.distributed import enable_quantized_all_gather
    from computectx.distributed.mixed_precision import fsdp_mixed_precision

    if dist.get_world_size() != 1:
        raise RuntimeError("the one-rank reference runs in a world of one")
    convert_to_quantized(model, ctx, module_filter=_fp8_filter)
    enable_quantized_all_gather(model)
    mesh = init_device_mesh("cpu", (1,))
    for child in model.children():
        fully_shard(child, mesh=mesh, mp_policy=fsdp_mixed_precision(ctx))
    fully_shard(model, mesh=mesh, mp_policy=fsdp_mixed_precision(ctx))
    return torch.optim.SGD(model.parameters(), lr=lr)


def train_lm(params: dict[str, Any]) -> dict[str, Any]:
    """``steps`` SGD steps of ``TinyLM`` under ``flag``, once per entry of ``runs``:
    ``"fsdp"`` (``parallelize``, the ctx's mixed precision), ``"fsdp_plain"`` (the same with
    ``mp_policy=MixedPrecisionPolicy()``), ``"one"`` (``parallelize`` in one process) or
    ``"fsdp_one_rank"`` (``_fsdp_one_rank``). The ranks split each batch of ``ROWS``
    tokens. Reports per run the losses of the whole batch (the mean of the ranks' means),
    the first step's gradients and, for FSDP2, the first step's reduce-scatter inputs
    (each rank's own gradients at the reduce dtype), and the final weights."""
    ctx = ComputeCtx.from_flag(params["flag"], "cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    lr = params["lr"]
    out: dict[str, Any] = {}
    for run_name in params["runs"]:
        torch.manual_seed(0)
        model = TinyLM()
        step: Callable[[], object]
        run: nn.Module
        if run_name == "fsdp_one_rank":
            opt = _fsdp_one_rank(model, ctx, lr)

            def step(_o: torch.optim.Optimizer = opt) -> None:
                _o.step()
                _o.zero_grad()

            run = model
        else:
            kwargs: dict[str, Any] = {}
            if run_name == "fsdp_plain":
                kwargs["mp_policy"] = MixedPrecisionPolicy()
            par = parallelize(
                model,
                ctx,
                strategy="ddp" if run_name == "one" else "fsdp",
                optimizer_class=torch.optim.SGD,
                fp8_filter=_fp8_filter,
                offload=False,
                lr=lr,
                **kwargs,
            )
            run, step = par.model, par.step
        per = ROWS // world
        losses: list[float] = []
        result: dict[str, Any] = {}
        for i, (ids, target) in enumerate(_data(params["steps"])):
            mine = slice(rank * per, (rank + 1) * per)
            with _Count("reduce_scatter_single", keep=i == 0) as counter:
                loss = nn.functional.cross_entropy(run(ids[mine]).float(), target[mine])
                loss.backward()  # type: ignore[no-untyped-call]
            whole = loss.detach().clone()
            if world > 1:
                dist.all_reduce(whole)
                whole /= world
            losses.append(float(whole))
            if i == 0:
                result["first_grads"] = {
                    n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None
                }
                result["reduced"] = counter.inputs["reduce_scatter_single"]
            step()
        result["losses"] = torch.tensor(losses, dtype=torch.float64)
        result["weights"] = {n: _full(p) for n, p in model.named_parameters()}
        result["shapes"] = {n: list(p.shape) for n, p in model.named_parameters()}
        out[run_name] = result
    return out
