"""Serving with an fp8 KV cache, end to end on a tiny trained model: the loss through the
cached decode path against f32 KV, parse -> calibrate -> save -> load -> generate (eager and
compiled), and the errors of calibration and of loading calibrated scales."""

from __future__ import annotations

import pathlib
import random
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from computectx import ComputeCtx, DType, KvFp8
from computectx.memory import load_weights, save_weights
from computectx.nn import (
    Attention,
    ByteLM,
    KVCache,
    LMConfig,
    calibrate_kv,
    decode_logits,
    encode_bytes,
    generate,
)

CPU = torch.device("cpu")
F32 = ComputeCtx.parity(CPU)
CONFIG = LMConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, max_len=96)
"""Head dim 16, a width the Triton decode kernel serves too."""
SEQ = 64


@dataclass(frozen=True)
class Trained:
    """A trained model's weights, with held-out and calibration byte sequences."""

    state: dict[str, torch.Tensor]
    val_ids: torch.Tensor
    val_targets: torch.Tensor
    calib: list[torch.Tensor]

    def model(self, ctx: ComputeCtx) -> ByteLM:
        """A fresh model under ``ctx`` holding the trained weights (no KV calibration)."""
        m = ByteLM(ctx, CONFIG)
        m.load_state_dict(self.state)
        return m.eval()

    def loss(self, model: ByteLM, caches: list[KVCache] | None = None) -> float:
        """Validation loss through the cached decode path (one position per step)."""
        logits = decode_logits(model, self.val_ids, caches=caches)
        return float(model.loss_of(logits, self.val_targets))


def _corpus(seed: int) -> torch.Tensor:
    # Lines that repeat a random name: predicting its later copies needs attention to the
    # first, so the cached keys and values carry real information.
    rng = random.Random(seed)
    words = ["cache", "key", "value", "head", "token", "scale", "step", "decode", "byte"]
    lines = []
    for _ in range(400):
        name = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(5))
        lines.append(f"{name}: the {rng.choice(words)} of {name} is {rng.choice(words)} {name}.\n")
    return torch.tensor(list("".join(lines).encode()), dtype=torch.long)


def _windows(data: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - SEQ - 1, (n,), generator=gen)
    return torch.stack([data[s : s + SEQ + 1] for s in starts.tolist()])


@pytest.fixture(scope="module")
def trained() -> Trained:
    """80 AdamW steps of batch 8 (a few seconds): validation loss about 2.2 nats, down from
    ln 256 = 5.5 (a random model predicts every byte alike, with or without a cache)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small runs fastest on one thread
    try:
        torch.manual_seed(0)
        model = ByteLM(F32, CONFIG)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        train = _corpus(0)
        for step in range(80):
            batch = _windows(train, 8, seed=100 + step)
            loss = model.loss(batch[:, :-1], batch[:, 1:])
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]  # torch leaves it untyped
            opt.step()
    finally:
        torch.set_num_threads(threads)
    val = _windows(_corpus(1), 8, seed=1)
    calib = [_windows(_corpus(2), 4, seed=s)[:, :-1] for s in (2, 3)]
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return Trained(state, val[:, :-1], val[:, 1:], calib)


def _attns(model: nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def _rel_gap(loss: float, ref: float) -> float:
    return abs(loss - ref) / ref


def test_the_cached_f32_path_is_the_full_forward(trained: Trained) -> None:
    model = trained.model(F32)
    with torch.no_grad():
        full = model(trained.val_ids)
    torch.testing.assert_close(decode_logits(model, trained.val_ids), full, rtol=1e-5, atol=1e-5)
    assert trained.loss(model) < 3.0  # trained: attention and the cache matter


def test_fp8_kv_loss_is_within_the_targets_of_f32_kv(trained: Trained) -> None:
    # The targets on the decode path: per_token_head within 0.5% of f32 KV, with
    # float32, bf16 or e8m0 steps; calibrated per_head within 1%. (A window of recent
    # positions reads them exactly: tests/nn/test_kv_steps.py; its loss is in
    # bench/bench_kv.py's table.)
    ref = trained.loss(trained.model(F32))
    targets = (
        (KvFp8(), 0.005),
        (KvFp8(step="bf16"), 0.005),
        (KvFp8(step="e8m0"), 0.005),
        (KvFp8(scaling="per_head"), 0.01),
    )
    for kv, target in targets:
        model = trained.model(F32.with_kv(kv))
        if kv.static:
            calibrate_kv(model, trained.calib)
        gap = _rel_gap(trained.loss(model), ref)
        assert gap <= target, (kv, gap)
    # The measure can fail: per-tensor steps a hundred times too small saturate the keys
    # and values, and the loss moves far beyond the target.
    model = trained.model(F32.with_kv(KvFp8(scaling="per_tensor")))
    calibrate_kv(model, trained.calib)
    with torch.no_grad():
        for attn in _attns(model):
            attn.kv_amax.div_(100)  # a calibration that saw values 100 times too small
    assert _rel_gap(trained.loss(model, model.new_caches(8, SEQ)), ref) > 0.05


def test_parse_calibrate_save_load_generate(trained: Trained, tmp_path: pathlib.Path) -> None:
    ctx = ComputeCtx.parse("compute=f32,kv=e4m3/per_head,device=cpu")
    model = trained.model(ctx)
    with pytest.raises(ValueError, match="no calibrated KV amax"):
        generate(model, encode_bytes("ab"), 4)
    found = calibrate_kv(model, trained.calib)
    assert sorted(found) == ["blocks.0.attn", "blocks.1.attn"]
    # Independently: an f32 cache holds the keys and values exactly as they enter it (after
    # RoPE); its per-head amax over the calibration batches is the calibration.
    plain = trained.model(F32)
    seen = torch.zeros(2, 2, 2)
    for batch in trained.calib:
        caches = plain.new_caches(batch.shape[0], SEQ)
        with torch.no_grad():
            plain(batch, caches)
        for i, c in enumerate(caches):
            now = torch.stack([c.k.abs().amax(dim=(0, 2, 3)), c.v.abs().amax(dim=(0, 2, 3))])
            seen[i] = torch.maximum(seen[i], now)
    for i, name in enumerate(["blocks.0.attn", "blocks.1.attn"]):
        torch.testing.assert_close(found[name], seen[i], rtol=0, atol=0)
        assert torch.equal(_attns(model)[i].kv_amax, found[name])

    path = save_weights(model, tmp_path / "served.safetensors")
    fresh = trained.model(ctx)
    assert not any(a.kv_calibrated for a in _attns(fresh))
    load_weights(fresh, path, ctx)
    for attn, amax in zip(_attns(fresh), found.values(), strict=True):
        assert torch.equal(attn.kv_amax, amax)
    prompt = encode_bytes("abcde: the ")
    out = generate(fresh, prompt, 24)
    assert torch.equal(out, generate(model, prompt, 24))
    # One checkpoint serves every KV setting: the same file loads under f32 KV and
    # per_tensor, where the static steps come from the same calibration.
    for other in (F32, ctx.with_kv(KvFp8(scaling="per_tensor"))):
        again = ByteLM(other, CONFIG)
        load_weights(again, path, other)
        assert generate(again, prompt, 8).shape == (len(prompt) + 8,)


def test_the_compiled_decode_step_compiles_once_for_64_steps(
    trained: Trained, tmp_path: pathlib.Path
) -> None:
    # The static-shape decode step (preallocated caches, a position tensor) under
    # torch.compile(fullgraph=True): no graph break (fullgraph raises on one), one graph,
    # and no recompile as the position moves (error_on_recompile raises on one). Graphs,
    # breaks and recompiles are Dynamo's, whatever the backend: aot_eager hands the same
    # graph to AOT autograd without generating code (seconds less than Inductor's C++);
    # tests/nn/test_kv_cache_stateful.py and docs/serving.md's sample compile the decode
    # step with Inductor.
    import torch._dynamo
    from torch._dynamo.utils import counters

    ctx = ComputeCtx.parse("compute=f32,kv=e4m3/per_head,device=cpu")
    served = trained.model(ctx)
    calibrate_kv(served, trained.calib)
    path = save_weights(served, tmp_path / "served.safetensors")
    model = ByteLM(ctx, CONFIG).eval()
    load_weights(model, path, ctx)
    ids = torch.cat((trained.val_ids[:1], trained.val_targets[:1, -1:]), dim=1)  # 65 bytes
    prompt = ids[0, :4]
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(model.decode_step, fullgraph=True, backend="aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = decode_logits(model, ids, decode_step=step, caches=model.new_caches(1, 96))
        out = generate(model, prompt, 65, decode_step=step, cache_len=96)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"]
    eager = decode_logits(model, ids, caches=model.new_caches(1, 96))
    # Float32 throughout: a compiled graph may differ from eager by float32 reassociation.
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    assert torch.equal(out, generate(model, prompt, 65, cache_len=96))


def test_calibration_refuses_what_it_cannot_use_and_stores_nothing(trained: Trained) -> None:
    model = trained.model(F32.with_kv(KvFp8(scaling="per_head")))
    before = calibrate_kv(model, trained.calib)
    with pytest.raises(ValueError, match="batches is empty"):
        calibrate_kv(model, [])
    with pytest.raises(ValueError, match="batches is empty"):
        calibrate_kv(model, iter(()))
    with pytest.raises(ValueError, match="has no Attention layer"):
        calibrate_kv(nn.Linear(4, 4), [torch.zeros(1, 4)])
    # Values of head 1 all zero in the last layer: no scale can be learned from them.
    with torch.no_grad():
        last = _attns(model)[1].qkv
        assert isinstance(last, nn.Linear)
        last.weight[2 * 32 + 16 : 3 * 32] = 0.0
    with pytest.raises(
        ValueError, match=r"blocks\.1\.attn values of head 1 have an amax that is 0 over"
    ):
        calibrate_kv(model, trained.calib)
    for attn, amax in zip(_attns(model), before.values(), strict=True):
        assert torch.equal(attn.kv_amax, amax)  # every layer kept its previous calibration
    assert model.training is False
    assert all(a.kv_observed is None for a in _attns(model))


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        # What is wrong and where (kv_amax[1, 0]: values of head 0), never the amax's values.
        (float("nan"), r"kv_amax must be finite .*; kv_amax\[1, 0\] is NaN"),
        (float("inf"), r"kv_amax must be finite .*; kv_amax\[1, 0\] is inf"),
        (-1.0, r"all zero .* or all positive .*; kv_amax\[1, 0\] is negative"),
        (0.0, r"all positive .*; 1 of its 4 entries are 0 and the others positive"),
    ],
)
def test_loading_bad_scales_is_refused_and_changes_nothing(
    trained: Trained, tmp_path: pathlib.Path, bad: float, needle: str
) -> None:
    ctx = F32.with_kv(KvFp8(scaling="per_head"))
    source = trained.model(ctx)
    calibrate_kv(source, trained.calib)
    with torch.no_grad():
        _attns(source)[1].kv_amax[1, 0] = bad
    path = save_weights(source, tmp_path / "bad.safetensors")
    target = trained.model(ctx)
    calibrate_kv(target, trained.calib[:1])
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ValueError, match=needle) as err:
        load_weights(target, path, ctx)
    # The message names the tensor by its full key (layer 1's) and the file it came from.
    assert "blocks.1.attn.kv_amax" in str(err.value) and str(path) in str(err.value)
    after = target.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing half-loaded


def test_loading_scales_of_the_wrong_shape_is_refused(
    trained: Trained, tmp_path: pathlib.Path
) -> None:
    # Four heads of width 8 instead of two of 16: every weight has the same shape, the
    # calibrated scales do not.
    four = LMConfig(d_model=32, n_layers=2, n_heads=4, d_ff=64, max_len=96)
    other = ByteLM(F32, four)
    path = save_weights(other, tmp_path / "four_heads.safetensors")
    model = trained.model(F32)
    with pytest.raises(ValueError, match=r"'blocks\.0\.attn\.kv_amax': checkpoint float32\[2, 4\]"):
        load_weights(model, path, F32)
    assert torch.equal(model.embed.weight, trained.state["embed.weight"])


@pytest.mark.parametrize("kv", ["bf16", "e4m3/per_token_head", "e5m2/per_token_head"])
def test_generate_runs_under_every_kv(trained: Trained, kv: str) -> None:
    ctx = ComputeCtx.parse(f"compute=bf16,kv={kv},accum=f32,device=cpu")
    model = trained.model(ctx)
    prompt = encode_bytes("abcde: ")
    out = generate(model, prompt, 12)
    assert out.shape == (7 + 12,) and out.dtype == torch.long and torch.equal(out[:7], prompt)
    # Every new id is the greedy choice of the cached path: the same logits, teacher-forced
    # through caches of generate's length (prompt in one pass, then one decode step per id).
    logits = decode_logits(model, out[None, :-1], prefill=7, caches=model.new_caches(1, 19))
    assert torch.equal(logits[0, 6:].argmax(dim=-1), out[7:])
    f32_kv = trained.model(ctx.with_kv(DType.F32))
    if kv == "bf16":
        # bf16 compute makes keys and values in bf16: a bf16 cache holds them exactly, as an
        # f32 one does, so generation is the same, id for id.
        assert torch.equal(out, generate(f32_kv, prompt, 12))
    else:
        # fp8 per_token_head: the validation loss through the cache within the documented
        # 0.5% of f32 KV's under the same compute.
        gap = _rel_gap(trained.loss(model), trained.loss(f32_kv))
        assert gap <= 0.005, gap
    assert model.kv_bytes_per_token() == 2 * (
        2 * 2 * 16 * (2 if kv == "bf16" else 1) + (0 if kv == "bf16" else 2 * 2 * 4)
    )
    assert isinstance(model.ctx.kv, (DType, KvFp8))


def test_a_checkpoint_written_before_kv_amax_loads_as_not_calibrated(
    trained: Trained, tmp_path: pathlib.Path
) -> None:
    # A ByteLM checkpoint without the kv_amax buffers (written before they existed): every
    # weight loads, and the layers come back not calibrated rather than keeping a
    # calibration made for other weights.
    old = {k: v for k, v in trained.state.items() if not k.endswith("kv_amax")}
    assert len(old) == len(trained.state) - 2
    path = tmp_path / "before_kv_amax.safetensors"
    save_file(old, str(path))
    ctx = F32.with_kv(KvFp8(scaling="per_head"))
    model = ByteLM(ctx, CONFIG)
    calibrate_kv(model, trained.calib)
    report = load_weights(model, path, ctx)
    assert "2 tensor(s) the checkpoint lacks took their defaults" in str(report)
    assert "blocks.0.attn.kv_amax" in str(report)
    assert torch.equal(model.embed.weight, trained.state["embed.weight"])
    assert not any(a.kv_calibrated for a in _attns(model))
    with pytest.raises(ValueError, match="no calibrated KV amax"):
        model.new_caches(1)
    # A missing weight is still an error.
    del old["embed.weight"]
    save_file(old, str(path))
    with pytest.raises(ValueError, match=r"missing keys \['embed.weight'\]"):
        load_weights(model, path, ctx)
