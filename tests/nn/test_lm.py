"""ByteLM: shapes, dtypes, loss, and KV-cached generation equal to full recomputation."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from computectx import ComputeCtx, DType
from computectx.nn import ByteLM, LMConfig, decode_bytes, encode_bytes, generate, next_token

CPU = torch.device("cpu")
F32 = ComputeCtx.parity(CPU)
BF16 = ComputeCtx.new(DType.BF16, CPU)
SERVING = ComputeCtx.serving(CPU)
TINY = LMConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, max_len=48)


def _model(ctx: ComputeCtx, seed: int = 0) -> ByteLM:
    torch.manual_seed(seed)
    return ByteLM(ctx, TINY)


@pytest.mark.parametrize(
    ("ctx", "dtype", "param"),
    [
        (F32, torch.float32, torch.float32),
        (BF16, torch.bfloat16, torch.float32),
        (ComputeCtx.new(DType.F64, CPU), torch.float64, torch.float64),
    ],
)
def test_logits_shape_and_dtype(ctx: ComputeCtx, dtype: torch.dtype, param: torch.dtype) -> None:
    logits = _model(ctx)(torch.randint(0, 256, (3, 11)))
    assert logits.shape == (3, 11, 256)
    assert logits.dtype == dtype
    # Parameters at compute ⊔ master: the f32 copy autocast reads, f64 for an f64 policy.
    assert all(p.dtype == param for p in _model(ctx).parameters())


def test_initial_loss_is_near_uniform_and_in_f32() -> None:
    model = _model(BF16)
    ids = torch.randint(0, 256, (4, 16))
    loss = model.loss(ids[:, :-1], ids[:, 1:])
    assert loss.dtype == torch.float32
    # Small init: logits near zero, so the loss is close to log(256) nats.
    assert abs(float(loss.detach()) - math.log(256)) < 0.1


def test_training_steps_lower_the_loss() -> None:
    model = _model(F32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = encode_bytes(b"abcabcabcabcabcabcabcabcabcabcab")[None, :]
    first = float(model.loss(ids[:, :-1], ids[:, 1:]).detach())
    for _ in range(30):
        loss = model.loss(ids[:, :-1], ids[:, 1:])
        torch.autograd.backward(loss)
        opt.step()
        opt.zero_grad()
    assert float(loss.detach()) < first / 4


def test_model_is_causal() -> None:
    model = _model(F32)
    a = torch.randint(0, 256, (1, 20))
    b = a.clone()
    b[0, 12:] = (b[0, 12:] + 1) % 256
    with torch.no_grad():
        la, lb = model(a), model(b)
    assert torch.equal(la[:, :12], lb[:, :12])
    assert not torch.equal(la[:, 12:], lb[:, 12:])


# Exact token equality needs logits whose ranking float reassociation cannot flip: f32 and
# f64 policies. A bf16 policy is checked on its logits, with a tolerance, below.
@pytest.mark.parametrize("ctx", [F32, ComputeCtx.new(DType.F64, CPU)])
def test_greedy_generation_with_cache_equals_recomputation(ctx: ComputeCtx) -> None:
    model = _model(ctx, seed=3)
    prompt = encode_bytes("def f(x):")
    cached = generate(model, prompt, 24)
    full = generate(model, prompt, 24, use_cache=False)
    assert cached.shape == (len("def f(x):") + 24,)
    assert torch.equal(cached, full)
    assert torch.equal(cached[: len(prompt)], prompt)


@pytest.mark.parametrize(("ctx", "tol"), [(F32, 1e-5), (SERVING, 3e-2)])
def test_cached_step_logits_equal_full_sequence_logits(ctx: ComputeCtx, tol: float) -> None:
    model = _model(ctx, seed=4)
    ids = torch.randint(0, 256, (2, 14))
    with torch.no_grad():
        full = model(ids).float()
        caches = model.new_caches(2)
        steps = [model(ids[:, :5], caches)]
        steps += [model(ids[:, i : i + 1], caches) for i in range(5, 14)]
    assert isinstance(ctx.kv, DType)
    assert all(c.length == 14 and c.dtype == ctx.kv.torch for c in caches)
    # bf16 logits differ by a few bf16 ulps when the matmuls see other shapes.
    assert torch.allclose(torch.cat(steps, dim=1).float(), full, atol=tol, rtol=tol)


def test_caches_are_stored_at_kv_dtype() -> None:
    model = _model(SERVING)
    caches = model.new_caches(1)
    with torch.no_grad():
        model(encode_bytes("abc")[None, :], caches)
    assert [c.k.dtype for c in caches] == [torch.float32, torch.float32]
    assert model(encode_bytes("abc")[None, :]).dtype == torch.bfloat16


def test_sampling_is_seeded_and_cache_independent() -> None:
    model = _model(F32, seed=5)
    prompt = encode_bytes("import ")

    def run(seed: int, use_cache: bool) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return generate(
            model, prompt, 20, temperature=0.9, top_k=20, generator=g, use_cache=use_cache
        )

    assert torch.equal(run(11, True), run(11, True))
    assert torch.equal(run(11, True), run(11, False))
    assert not torch.equal(run(11, True), run(12, True))


def test_batched_generation_and_top_k_one_is_greedy() -> None:
    model = _model(F32, seed=6)
    prompts = torch.randint(0, 256, (3, 4))
    greedy = generate(model, prompts, 6)
    g = torch.Generator().manual_seed(0)
    top1 = generate(model, prompts, 6, temperature=1.5, top_k=1, generator=g)
    assert greedy.shape == (3, 10)
    assert torch.equal(greedy, top1)


def test_next_token_respects_top_k() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0, 3.0]])
    g = torch.Generator().manual_seed(0)
    seen = {int(next_token(logits, 5.0, 2, g)) for _ in range(200)}
    assert seen == {1, 2}
    assert int(next_token(logits)) == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"max_new_tokens": 100}, "max_len=48"),
        ({"max_new_tokens": 2, "temperature": -0.5}, "temperature"),
        ({"max_new_tokens": 2, "temperature": 1.0, "top_k": 0}, "top_k"),
        ({"max_new_tokens": 2, "temperature": 1.0, "top_k": 300}, "top_k"),
    ],
)
def test_generate_rejects_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        generate(_model(F32), encode_bytes("ab"), **kwargs)  # type: ignore[arg-type]


def test_generate_rejects_bad_prompts_and_restores_train_mode() -> None:
    model = _model(F32)
    for bad in (torch.zeros(0, dtype=torch.long), torch.tensor([1.0]), torch.tensor([256])):
        with pytest.raises(ValueError, match="prompt"):
            generate(model, bad, 2)
    model.train()
    generate(model, encode_bytes("x"), 2)
    assert model.training


def test_forward_rejects_bad_ids_and_long_sequences() -> None:
    model = _model(F32)
    with pytest.raises(ValueError, match="int64 ids"):
        model(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="max_len=48"):
        model(torch.zeros(1, 49, dtype=torch.long))


@pytest.mark.parametrize(
    "fields",
    [
        {"d_model": 40},  # not a multiple of 16
        {"d_model": 48, "n_heads": 5},
        {"d_model": 48, "n_heads": 16},  # head width 3 is odd
        {"n_layers": 0},
        {"d_ff": 20},
    ],
)
def test_config_rejects_bad_shapes(fields: dict[str, int]) -> None:
    with pytest.raises(ValidationError):
        LMConfig.model_validate(fields)


def test_byte_round_trip() -> None:
    text = "naïve ∑ text\n"
    ids = encode_bytes(text)
    assert ids.dtype == torch.long and len(ids) == len(text.encode())
    assert decode_bytes(ids) == text
    assert decode_bytes(torch.tensor([0xFF, 0x41])) == "\ufffdA"
