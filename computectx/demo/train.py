"""Training one policy: the model, the optimizer, the step loop, evaluation and the sample."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from rich.progress import Progress
from torch import nn

from computectx.ctx import ComputeCtx
from computectx.demo.corpus import Corpus, train_batches
from computectx.demo.footprint import Footprint, state_footprint
from computectx.demo.moe import LoadRecorder, fp8_experts_backends, moe_config
from computectx.demo.serving import ServingRow, serving_rows
from computectx.demo.settings import DemoError, DemoSettings
from computectx.distributed import Parallel, parallelize, update_expert_bias
from computectx.dtypes import DType
from computectx.formats import Fp4Linear, QuantizedLinear, Recipe, scaling_stats
from computectx.memory import LowPrecGradAccumulator, OffloadedOptimizer, SavedActivations
from computectx.nn import ByteLM, LMConfig, decode_bytes, encode_bytes, generate

__all__ = [
    "SAMPLE_PROMPT",
    "PolicyResult",
    "data_parallel_rank",
    "evaluate",
    "fp8_granularity",
    "lr_at",
    "model_config",
    "policy_ctx",
    "tail_steps",
    "train_policy",
]

SAMPLE_PROMPT = "def "
"""The prompt each trained model continues for the printed sample."""


def tail_steps(steps: int) -> int:
    """How many last steps ``PolicyResult.train_loss`` averages: a tenth of ``steps`` (at
    least one). One step's loss is one batch's, and varies by several hundredths from batch
    to batch; the mean over the tail does not."""
    return max(1, steps // 10)


@dataclasses.dataclass(frozen=True)
class PolicyResult:
    """One policy's run: its curves, final losses, speed, memory and fp8 statistics.

    ``train_loss`` is the mean of the last ``tail_steps`` of ``train_losses`` (the
    per-step losses, which the progress bar shows one at a time); ``val_loss`` is the last
    point of ``val_curve``. ``gemm`` is the ``computectx.nn.GemmPath`` value the blocks used.
    """

    flag: str
    policy: str
    gemm: str
    train_losses: list[float]
    val_curve: list[tuple[int, float]]
    train_loss: float
    val_loss: float
    tokens_per_s: float
    seconds: float
    memory: Footprint
    skipped_steps: int
    fp8_converted: int
    fp8_backend: str | None
    fp8_nonfinite: int | None
    fp8_saturated: float | None
    fp8_layers: dict[str, Any]
    sample: str
    compile_seconds: float | None = None
    """Under ``--compile``: the first step's time (compilation included), which
    ``tokens_per_s`` and ``seconds`` leave out."""
    fp8_granularity: str | None = None
    """Which elements share one fp8 step (``fp8_granularity``), ``None`` without fp8."""
    kv: str = ""
    """The policy's own KV setting (``ctx.kv``), the one its sample is generated with."""
    serving: tuple[ServingRow, ...] = ()
    """The serving section: the trained model's validation loss through the KV cache under
    each setting of ``computectx.demo.serving.SERVING_KV`` (empty on ranks other than 0 and
    under ``DemoSettings.skip_serving``)."""
    expert_load: torch.Tensor | None = None
    """Under ``--moe``: tokens routed to each expert, ``(steps, layers, experts)`` int64
    (``computectx.demo.moe.LoadRecorder``); ``None`` for the dense model."""
    fp8_experts: int = 0
    """MoE layers whose expert GEMMs ran in fp8 (grouped, ``experts.fp8`` set)."""


def fp8_granularity(ctx: ComputeCtx) -> str | None:
    """The fp8 policy's granularity with its options as its text form writes them
    (``tensor``, ``row``, ``row+gw_hp``, ``block``, ``mx``, ``mx+floor``), ``None`` without
    fp8."""
    if not isinstance(ctx.recipe, Recipe):  # none, or 4 bits (refused by DemoSettings)
        return None
    if ctx.recipe.granularity == "tensor":
        return "tensor"
    return str(ctx.recipe).split("/")[1]  # SCHEME/GRANULARITY[+OPTION...]/RECIPE...


def model_config(settings: DemoSettings) -> LMConfig:
    """The ``LMConfig`` of the demo model (long enough for training and the sample)."""
    longest = max(settings.seq_len, len(SAMPLE_PROMPT) + settings.sample_tokens)
    d_ff = (settings.d_model * 3 + 15) // 16 * 16
    return LMConfig(
        d_model=settings.d_model,
        n_layers=settings.layers,
        n_heads=settings.d_model // 32,
        d_ff=d_ff,
        max_len=longest,
        **moe_config(settings, d_ff),  # --moe: the MLPs become experts of the same width
    )


def lr_at(step: int, steps: int, peak: float) -> float:
    """Learning rate of ``step`` (0-based): linear warm-up over the first tenth, then cosine
    decay from ``peak`` to a tenth of it."""
    warm = max(1, steps // 10)
    if step < warm:
        return peak * (step + 1) / warm
    progress = (step - warm) / max(1, steps - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def policy_ctx(flag: str, settings: DemoSettings, device: torch.device) -> ComputeCtx:
    """The ``ComputeCtx`` of ``flag`` on ``device``, adjusted for accumulation and offload.

    ``flag`` is a dtype flag, or ``FLAG@ACTIVATIONS``: that flag's policy keeping activations
    for the backward as ``ACTIVATIONS`` (the text form of ``ComputeCtx.activations``) says;
    ``DemoError`` when that text is not one."""
    name, _, acts = flag.partition("@")
    ctx = ComputeCtx.from_flag(name, device)
    if acts:
        try:
            ctx = ctx.with_activations(acts)
        except ValueError as e:
            raise DemoError(f"--dtype {flag}: {e}") from None
    if settings.grad_accum > 1 and ctx.compute < DType.F32:
        # Low-precision policies keep their summed gradients low-precision too: the
        # accumulator's buffers are at the compute dtype (the fp32 policy stays at f32).
        ctx = ctx.replace(grad=ctx.compute)
    if settings.offload:
        ctx = ctx.replace(offload=torch.device("cpu"))
    return ctx


@torch.no_grad()
def evaluate(model: ByteLM, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean loss of ``model`` over ``batches``, in eval mode (the mode is restored)."""
    was = model.training
    model.eval()
    dev = model.ctx.device
    losses = [float(model.loss(x.to(dev), y.to(dev))) for x, y in batches]
    model.train(was)
    return sum(losses) / len(losses)


def _fp8_summary(model: ByteLM) -> tuple[int, float, dict[str, Any]]:
    stats = scaling_stats(model)
    nonfinite = 0
    saturated = 0.0
    layers: dict[str, Any] = {}
    for name, layer in stats.items():
        roles = {r: dataclasses.asdict(layer[r]) for r in ("input", "weight", "grad")}
        layers[name] = {"policy": layer.policy, **roles}
        for r in roles.values():
            nonfinite += int(r["nonfinite_count"])
            saturated = max(saturated, float(r["saturated_fraction"]))
    return nonfinite, saturated, layers


def data_parallel_rank() -> tuple[int, int]:
    """``(rank, world_size)`` of this process: ``(0, 1)`` unless torch.distributed is up."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _group_mean(t: torch.Tensor, world: int) -> torch.Tensor:
    if world > 1:
        dist.all_reduce(t)
        t = t / world
    return t


def train_policy(
    flag: str,
    settings: DemoSettings,
    device: torch.device,
    corpus: Corpus,
    val: list[tuple[torch.Tensor, torch.Tensor]],
    progress: Progress,
    on_trained: Callable[[ByteLM], None] | None = None,
) -> PolicyResult:
    """Train a fresh model under ``flag`` for ``settings.steps`` steps and measure it.

    Seeds torch with ``settings.seed`` first, so every policy starts from the same weights
    and (through ``train_batches``) sees the same batches. The progress task shows each
    step's own loss.

    Under torch.distributed (``computectx demo --nproc N``) each rank trains its share of
    every batch, set up by ``computectx.distributed.parallelize`` (DDP, fp8 ledgers merged
    across ranks at the end of every backward); the losses reported are the group's means.

    After training, ``on_trained`` (when given) is called with the trained model; then rank
    0 measures the serving section (``serving_rows``) on ``val``, unless
    ``settings.skip_serving``, and draws the sample with the policy's own ``kv``.
    """
    ctx = policy_ctx(flag, settings, device)
    rank, world = data_parallel_rank()
    torch.manual_seed(settings.seed)
    model = ByteLM(ctx, model_config(settings))
    loop = _loop(model, _parallelize(model, ctx, settings), settings, device, rank, world)
    # Under an fp8 policy the blocks build their linears as QuantizedLinear (the head stays).
    fp8_layers = [m for m in model.modules() if isinstance(m, (QuantizedLinear, Fp4Linear))]
    experts_backends = fp8_experts_backends(model)  # one per MoE layer whose experts are fp8
    backends = {m.backend if isinstance(m, Fp4Linear) else m.backend.value for m in fp8_layers}
    backend = ",".join(sorted(backends | set(experts_backends)))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    curves = _train(loop, corpus, val, progress, flag)
    memory = curves.memory
    assert memory is not None  # the last step always runs (settings.steps >= 1)
    if device.type == "cuda":
        memory = dataclasses.replace(memory, peak=int(torch.cuda.max_memory_allocated(device)))
    tail = curves.losses[-tail_steps(len(curves.losses)) :]
    nonfinite = saturated = None
    layers: dict[str, Any] = {}
    if isinstance(ctx.recipe, Recipe):  # fp8's scaling statistics (4 bits keep none)
        nonfinite, saturated, layers = _fp8_summary(model)
    if on_trained is not None:
        on_trained(model)
    serving = tuple(serving_rows(model, val)) if rank == 0 and not settings.skip_serving else ()
    sample = _sample(model, settings, device) if settings.sample_tokens and rank == 0 else ""
    # The whole batch (every rank's share) per step: the group's throughput.
    timed_steps = settings.steps - (1 if curves.compile_seconds is not None else 0)
    tokens = timed_steps * settings.grad_accum * settings.batch_size * settings.seq_len
    seconds = curves.train_seconds
    return PolicyResult(
        flag=flag,
        policy=str(ctx),
        gemm=model.gemm.path.value,
        train_losses=curves.losses,
        val_curve=curves.val_curve,
        train_loss=sum(tail) / len(tail),
        val_loss=curves.val_curve[-1][1],
        tokens_per_s=tokens / seconds if seconds > 0 else float("inf"),
        seconds=seconds,
        memory=memory,
        skipped_steps=curves.skipped,
        fp8_converted=len(fp8_layers),
        fp8_backend=backend or None,
        fp8_nonfinite=nonfinite,
        fp8_saturated=saturated,
        fp8_layers=layers,
        sample=sample,
        compile_seconds=curves.compile_seconds,
        fp8_granularity=fp8_granularity(ctx),
        kv=str(ctx.kv),
        serving=serving,
        expert_load=loop.recorder.load() if loop.recorder is not None else None,
        fp8_experts=len(experts_backends),
    )


@dataclasses.dataclass(frozen=True)
class _Loop:
    """What one policy's training loop works with, set up once (``_loop``)."""

    settings: DemoSettings
    device: torch.device
    world: int
    model: ByteLM
    runner: nn.Module
    """What runs forward: ``Parallel.model``, compiled under ``--compile``."""
    optimizer: torch.optim.Optimizer
    accumulator: LowPrecGradAccumulator | None
    params: list[nn.Parameter]
    share: slice
    """This rank's rows of every batch."""
    recorder: LoadRecorder | None
    saved: SavedActivations
    """Measures what the first step keeps for backward at its peak, by kind."""


@dataclasses.dataclass
class _Curves:
    """What the loop measured."""

    losses: list[float]
    val_curve: list[tuple[int, float]]
    skipped: int = 0
    train_seconds: float = 0.0
    compile_seconds: float | None = None
    memory: Footprint | None = None


def _parallelize(model: ByteLM, ctx: ComputeCtx, settings: DemoSettings) -> Parallel:
    # One call sets up the ranks (DDP, the fp8 amax sync, the memory policy's optimizer and
    # accumulator) or, in one process, just the optimizer and accumulator. The blocks built
    # their QuantizedLinear layers already, so nothing more is converted (the head stays).
    return parallelize(
        model,
        ctx,
        strategy="ddp",
        fp8_filter=lambda module, fqn: False,
        accumulate=settings.grad_accum > 1,
        offload=settings.offload,
        # Every rank runs every training step together here (validation and sampling go
        # through the unwrapped model: rank-local, recording and reducing nothing), so the
        # demo takes the group's amax (one float all-reduced per such quantize) and trains
        # as one process does; DDP's default, the rank's own amax, would differ by the
        # figures docs/distributed.md gives.
        current_amax="group",
        lr=settings.lr,
    )


def _loop(
    model: ByteLM,
    par: Parallel,
    settings: DemoSettings,
    device: torch.device,
    rank: int,
    world: int,
) -> _Loop:
    runner: nn.Module = par.model
    if settings.compile:
        # torch.compile of a module returns an OptimizedModule, itself an nn.Module.
        runner = cast(nn.Module, torch.compile(runner))
    params = list(model.parameters())
    return _Loop(
        settings=settings,
        device=device,
        world=world,
        model=model,
        runner=runner,
        optimizer=par.optimizer,
        accumulator=par.accumulator,
        params=params,
        share=slice(rank * settings.batch_size // world, (rank + 1) * settings.batch_size // world),
        recorder=LoadRecorder(model) if settings.moe else None,
        saved=SavedActivations(exclude=params),
    )


def _train(
    loop: _Loop,
    corpus: Corpus,
    val: list[tuple[torch.Tensor, torch.Tensor]],
    progress: Progress,
    flag: str,
) -> _Curves:
    """Run ``settings.steps`` optimizer steps, evaluating on ``val`` at the start and at six
    even points; the progress task shows each step's loss."""
    settings, opt = loop.settings, loop.optimizer
    batches = train_batches(corpus, settings.batch_size, settings.seq_len, settings.seed)
    eval_at = {round(settings.steps * k / 6) for k in range(1, 7)} - {0}
    curves = _Curves(losses=[], val_curve=[(0, evaluate(loop.model, val))])
    task = progress.add_task(flag, total=settings.steps, loss=float("nan"))
    try:
        for step in range(settings.steps):
            t0 = time.perf_counter()
            for group in opt.param_groups:
                group["lr"] = lr_at(step, settings.steps, settings.lr)
            # One device-to-host read per step, not per micro-batch (and one all-reduce).
            step_loss = float(_group_mean(_forward_backward(loop, batches, step), loop.world))
            if loop.recorder is not None:
                loop.recorder.end_step(loop.world)
            if not _clip_and_step(loop):
                # Non-finite gradients (an fp16 overflow, say) are dropped, not applied;
                # the count goes into the results.
                curves.skipped += 1
            if settings.moe:
                # aux_free's bias step, with the whole group's load (under the other
                # balances it only resets the counts): one all-reduce with --nproc.
                update_expert_bias(loop.model)
            if step == settings.steps - 1:
                saved = None if settings.compile else loop.saved
                curves.memory = state_footprint(
                    loop.model, opt, loop.accumulator, loop.device, saved
                )
            opt.zero_grad(set_to_none=True)
            _time_step(loop, curves, step, t0, progress, flag)
            curves.losses.append(step_loss)
            if step + 1 in eval_at:
                curves.val_curve.append((step + 1, evaluate(loop.model, val)))
            progress.update(task, advance=1, loss=step_loss)
    finally:
        if loop.accumulator is not None:
            loop.accumulator.close()
    return curves


def _forward_backward(
    loop: _Loop, batches: Iterator[tuple[torch.Tensor, torch.Tensor]], step: int
) -> torch.Tensor:
    """Forward and backward over one step's micro-batches; their summed loss, on the
    device."""
    settings, device, model = loop.settings, loop.device, loop.model
    summed = torch.zeros((), device=device)
    # What the step keeps for backward at its peak, measured on the first step (not when
    # compiled: the hooks would be traced into the graph).
    measure = step == 0 and not settings.compile
    with loop.saved if measure else contextlib.nullcontext():
        for _ in range(settings.grad_accum):
            x, y = next(batches)
            x, y = x[loop.share].to(device), y[loop.share].to(device)
            loss = model.loss_of(loop.runner(x), y) / settings.grad_accum
            total = loss
            if settings.moe:
                # --balance aux_loss: the blocks' balancing loss joins the gradient,
                # not the reported loss (a float32 zero under the other balances).
                total = loss + model.aux_loss() / settings.grad_accum
            torch.autograd.backward(total)
            summed += loss.detach()
            if loop.recorder is not None:
                loop.recorder.add()
    return summed


def _clip_and_step(loop: _Loop) -> bool:
    """Hand the accumulated gradients over, clip them to norm 1 and step, unless the norm
    is not finite; whether it stepped."""
    opt, acc = loop.optimizer, loop.accumulator
    if isinstance(opt, OffloadedOptimizer):
        opt.ingest_grads(acc)
        norm = opt.clip_grad_norm(1.0)
    else:
        if acc is not None:
            acc.flush_to_param_grads()
        norm = float(torch.nn.utils.clip_grad_norm_(loop.params, 1.0))
    if not math.isfinite(norm):
        return False
    opt.step()
    return True


def _time_step(
    loop: _Loop, curves: _Curves, step: int, t0: float, progress: Progress, flag: str
) -> None:
    """Add the step's time to the training time; under ``--compile`` the first step's
    (compilation included) is reported apart."""
    if loop.device.type == "cuda":
        torch.cuda.synchronize(loop.device)
    if loop.settings.compile and step == 0:
        curves.compile_seconds = time.perf_counter() - t0
        progress.console.print(
            f"{flag}: first step (torch.compile) took {curves.compile_seconds:.1f} s, "
            f"left out of tokens/s"
        )
    else:
        curves.train_seconds += time.perf_counter() - t0


def _sample(model: ByteLM, settings: DemoSettings, device: torch.device) -> str:
    """The trained model's continuation of ``SAMPLE_PROMPT`` (temperature 0.8, top-k 40)."""
    g = torch.Generator().manual_seed(settings.seed)
    out = generate(
        model,
        encode_bytes(SAMPLE_PROMPT, device),
        settings.sample_tokens,
        temperature=0.8,
        top_k=40,
        generator=g,
    )
    return decode_bytes(out)
