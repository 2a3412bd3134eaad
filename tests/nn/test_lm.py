"""ByteLM: shapes, dtypes, loss, and KV-cached generation equal to full recomputation."""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Sequence

import pytest
import torch

from computectx import ComputeCtx, DType
from computectx.activations import parse_activations
from computectx.nn import (
    ByteLM,
    LMConfig,
    calibrate_kv,
    decode_bytes,
    decode_logits,
    encode_bytes,
    generate,
    next_token,
)
from computectx.nn.attention import Attention
from computectx.nn.kv_cache import KVCache
from computectx.nn.lm import DecoderBlock

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
    with pytest.raises(ValueError, match="bad LMConfig"):
        LMConfig.model_validate(fields)


def test_byte_round_trip() -> None:
    text = "naïve ∑ text\n"
    ids = encode_bytes(text)
    assert ids.dtype == torch.long and len(ids) == len(text.encode())
    assert decode_bytes(ids) == text
    assert decode_bytes(torch.tensor([0xFF, 0x41])) == "\ufffdA"


# ----- bad arguments and non-finite logits: clear errors, not torch's ---------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"temperature": float("inf"), "top_k": 5}, ValueError, "temperature must be finite"),
        ({"temperature": float("inf")}, ValueError, "temperature must be finite"),
        ({"temperature": float("nan")}, ValueError, "temperature must be finite"),
        ({"temperature": "0.5"}, TypeError, "temperature must be a real number.*str '0.5'"),
        ({"temperature": True}, TypeError, "temperature must be a real number.*bool"),
        ({"temperature": 1.0, "top_k": True}, TypeError, "top_k must be an int.*bool True"),
        ({"temperature": 1.0, "top_k": 2.0}, TypeError, "top_k must be an int.*float"),
        ({"temperature": 1.0, "top_k": "3"}, TypeError, "top_k must be an int.*str"),
    ],
)
def test_sampling_arguments_are_refused_by_name(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    model = _model(F32)
    with pytest.raises(error, match=match):
        generate(model, encode_bytes("ab"), 2, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(error, match=match):
        next_token(torch.zeros(1, 256), **kwargs)  # type: ignore[arg-type]


def test_max_new_tokens_refuses_bools_and_other_types() -> None:
    for bad in (True, 2.0, "2"):
        with pytest.raises(TypeError, match="max_new_tokens must be an int"):
            generate(_model(F32), encode_bytes("ab"), bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("temperature", [1e-45, 1e-300, 5e-324])
def test_a_tiny_positive_temperature_samples_among_the_largest_logits(
    temperature: float,
) -> None:
    # The limit of sampling as the temperature goes to 0: uniform over the ids tied at the
    # maximum, never an overflow (torch's multinomial saw inf/nan here before).
    logits = torch.tensor([[0.0, 5.0, 5.0, -1.0, 4.999]])
    g = torch.Generator().manual_seed(0)
    seen = {int(next_token(logits, temperature, None, g)) for _ in range(100)}
    assert seen == {1, 2}
    model = _model(F32, seed=3)
    g = torch.Generator().manual_seed(0)
    sampled = generate(model, encode_bytes("ab"), 8, temperature=temperature, generator=g)
    assert torch.equal(sampled, generate(model, encode_bytes("ab"), 8))  # no ties: greedy


def test_nan_logits_raise_naming_the_row() -> None:
    logits = torch.zeros(3, 256)
    logits[1, 7] = float("nan")
    for temperature in (0.0, 0.8):
        with pytest.raises(ValueError, match="batch row 1 hold NaN"):
            next_token(logits, temperature)
    logits = torch.full((1, 256), float("-inf"))
    with pytest.raises(ValueError, match=r"batch row 0 .* all -inf"):
        next_token(logits, 0.8)
    assert int(next_token(logits)) == 0  # greedy over -inf alone is still an argmax


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_nan_logits_in_generation_raise_naming_the_step_and_position(temperature: float) -> None:
    model = _model(F32)
    prompt = torch.randint(0, 256, (3, 4))

    def poisoned(ids: torch.Tensor, pos: torch.Tensor, caches: Sequence[KVCache]) -> torch.Tensor:
        logits = model.decode_step(ids, pos, caches)
        if int(pos) == 5:  # the step that picks position 6
            logits[2] = float("nan")
        return logits

    g = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match=r"step 2 \(position 6\).*batch row 2 hold NaN"):
        generate(model, prompt, 5, temperature=temperature, generator=g, decode_step=poisoned)
    model.train()
    with torch.no_grad():
        model.head.weight[9, 0] = float("nan")  # every row's logits hold a NaN at id 9
    with pytest.raises(ValueError, match=r"step 0 \(position 4\).*batch row 0 hold NaN"):
        generate(model, prompt, 5, temperature=temperature, generator=g)
    assert model.training  # restored


@pytest.mark.parametrize("bad", [256, -1, 1000])
def test_ids_outside_the_vocabulary_are_named(bad: int) -> None:
    model = _model(F32)
    ids = torch.tensor([[1, 2, bad]])
    with pytest.raises(ValueError, match=rf"ids must lie in \[0, 256\).*got {bad}"):
        model(ids)
    caches = model.new_caches(1, 8)
    with pytest.raises(ValueError, match=rf"ids must lie in \[0, 256\).*got {bad}"):
        model.decode_step(torch.tensor([[bad]]), torch.tensor(0), caches)
    with pytest.raises(ValueError, match=rf"decode_logits: ids must lie in \[0, 256\).*{bad}"):
        decode_logits(model, ids)


@pytest.mark.parametrize("pos", [-1, 8, 48, 10**6])
def test_a_decode_position_outside_the_caches_is_named(pos: int) -> None:
    model = _model(F32)
    caches = model.new_caches(1, 8)
    with pytest.raises(ValueError, match=rf"pos must lie in \[0, 8\).*got {pos}"):
        model.decode_step(torch.tensor([[65]]), torch.tensor(pos), caches)
    with pytest.raises(ValueError, match="caches hold 8 positions, fewer than the T=9"):
        decode_logits(model, torch.zeros(1, 9, dtype=torch.long), caches=caches)


def test_calibrate_kv_refuses_an_empty_batch_and_stores_nothing() -> None:
    model = _model(F32)
    calibrate_kv(model, [torch.randint(0, 256, (2, 5))])
    before = [a.kv_amax.clone() for a in model.modules() if isinstance(a, Attention)]
    for shape in ((2, 0), (0, 5)):
        empty = torch.zeros(shape, dtype=torch.long)
        with pytest.raises(ValueError, match=rf"batch 1 has shape {re.escape(str(shape))}"):
            calibrate_kv(model, [torch.randint(0, 256, (2, 5)), empty])
    after = [a.kv_amax for a in model.modules() if isinstance(a, Attention)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_blocks_wrapped_by_checkpoint_wrapper_still_run_and_train_alike() -> None:
    # torch's apply_activation_checkpointing wraps each block: the wrapped blocks must run
    # (they were once skipped silently: a 0-block model, no error), and give the same
    # gradients; a module that is no block, wrapped or not, is refused by name.
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    ctx = ComputeCtx.from_flag("bf16", "cpu")
    cfg = LMConfig(d_model=32, n_layers=2, n_heads=1, d_ff=32, max_len=16)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    grads = []
    for wrap in (False, True):
        torch.manual_seed(0)
        model = ByteLM(ctx, cfg)
        if wrap:
            apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, DecoderBlock))
            assert not isinstance(model.blocks[0], DecoderBlock)
        torch.autograd.backward(model.loss(ids[:, :-1], ids[:, 1:]))
        grads.append(
            {
                n.replace("_checkpoint_wrapped_module.", ""): p.grad
                for n, p in model.named_parameters()
            }
        )
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        wrapped = grads[1][name]
        assert g is not None and wrapped is not None and torch.equal(g, wrapped), name
    model.blocks[1] = torch.nn.Linear(32, 32)
    with pytest.raises(TypeError, match=r"blocks\[1\] is a Linear"):
        model(ids)


def test_a_checkpoint_rule_that_names_no_block_warns() -> None:
    cfg = LMConfig(d_model=32, n_layers=2, n_heads=1, d_ff=32, max_len=16)
    ctx = ComputeCtx.from_flag("bf16", "cpu")
    with pytest.warns(UserWarning, match=r"checkpoint=blocks:5 names none of 2 blocks"):
        ByteLM(ctx.replace(activations=parse_activations("checkpoint=blocks:5")), cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ByteLM(ctx.replace(activations=parse_activations("checkpoint=blocks:1")), cfg)


@pytest.mark.parametrize("acts", ["keep", "fp8/checkpoint=all"])
def test_an_empty_batch_runs_forward_and_backward(acts: str) -> None:
    cfg = LMConfig(d_model=32, n_layers=1, n_heads=2, d_ff=32, max_len=16, n_experts=2, top_k=1)
    model = ByteLM(
        ComputeCtx.from_flag("bf16", "cpu").replace(activations=parse_activations(acts)), cfg
    )
    ids = torch.zeros(0, 8, dtype=torch.long)
    logits = model(ids)
    assert logits.shape == (0, 8, 256)
    torch.autograd.backward(logits.float().sum())
    with torch.no_grad():
        assert model(ids).shape == (0, 8, 256)
