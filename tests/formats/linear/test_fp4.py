"""Fp4Linear: the 4-bit dense linear (NVFP4, MXFP4) against the twins bit for bit, its
stochastic-rounding counter (advanced, saved, resumed), activation checkpointing, loading with
the policy checked, and ``convert_to_quantized`` under a 4-bit recipe."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils.checkpoint import checkpoint

from computectx import ComputeCtx
from computectx.formats import QuantizedLinear, convert_to_quantized
from computectx.formats.linear.fp4 import Fp4Linear, fp4_quant
from computectx.formats.linear.fp4_counter import stream_word
from computectx.formats.linear.fp4_rules import model_blocks
from computectx.formats.linear.fp4_streams import stream_of
from computectx.formats.numerics import fp4_gemm
from computectx.formats.numerics.e2m1 import Stochastic
from computectx.formats.numerics.fp4 import Nvfp4Operand
from computectx.fp4_recipe import Fp4Recipe
from computectx.memory import load_weights, memory_report, save_weights

NV = ComputeCtx.from_flag("nvfp4", "cpu").replace(recipe=Fp4Recipe(seed=5))
RECIPES = {
    "nvfp4": Fp4Recipe(seed=5),
    "nvfp4+w1x16+no_rht": Fp4Recipe(weight_tile="1x16", hadamard=False, seed=3),
    "mxfp4": Fp4Recipe(format="mxfp4"),
    "mxfp4+floor+sr+rht": Fp4Recipe(
        format="mxfp4", mx_rounding="floor", stochastic=True, hadamard=True
    ),
}


def _ctx(recipe: Fp4Recipe) -> ComputeCtx:
    return NV.replace(recipe=recipe)


def _data(m: int, k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).bfloat16()
    dy = torch.randn(m, n, generator=gen).bfloat16()
    return x, dy


STREAM = 2**62 + 7  # a stream's key word is stream_word(seed, stream), not the seed


@pytest.mark.parametrize(
    ("name", "stream"),
    [*((n, 0) for n in RECIPES), ("nvfp4", STREAM), ("mxfp4+floor+sr+rht", STREAM)],
)
def test_the_three_gemms_are_the_twins_on_the_operand_table(name: str, stream: int) -> None:
    # Y, dX and dW equal the twin's GEMMs of the operands TE's table gives each, bit for bit;
    # dY's two quantizes draw consecutive counter ranges from the layer's key, whose word is
    # the stream's (stream 0: the recipe's seed, as before streams).
    recipe = RECIPES[name]
    torch.manual_seed(0)
    lin = Fp4Linear(64, 32, ctx=_ctx(recipe), sr_stream=stream)
    word = stream_word(recipe.seed, stream)
    assert (word == recipe.seed) is (stream == 0)
    x, dy = _data(21, 64, 32)
    x.requires_grad_(True)
    y = lin(x)
    y.backward(dy)
    how, w, b = fp4_quant(recipe), lin.weight.detach(), lin.bias.detach()
    q = fp4_gemm.quantize_rows
    row = Stochastic(word % 2**64, 0) if recipe.stochastic else None
    col = Stochastic(word % 2**64, 21 * 32) if recipe.stochastic else None
    want_y = fp4_gemm.reference_fp4_mm(q(x.detach(), how), q(w, how, weight=True), x.dtype, b)
    want_dx = fp4_gemm.reference_fp4_mm(
        q(dy, how, stochastic=row), q(w.t().contiguous(), how, weight=True), x.dtype
    )
    qdyt = fp4_gemm.wgrad_operand(dy, how, stochastic=col)
    want_dw = fp4_gemm.reference_fp4_mm(
        qdyt, fp4_gemm.wgrad_operand(x.detach(), how), torch.float32
    )
    assert torch.equal(y, want_y) and y.dtype == torch.bfloat16
    assert x.grad is not None and torch.equal(x.grad, want_dx)
    assert lin.weight.grad is not None and torch.equal(lin.weight.grad, want_dw)
    assert lin.bias.grad is not None and torch.equal(lin.bias.grad, dy.float().sum(0))
    # The counter moved past both ranges (21 rows, padded to 32 for the column-wise one).
    assert lin.sr_key.tolist() == [word, 32 * (21 + 32) if recipe.stochastic else 0]


def test_calls_without_a_backward_advance_nothing_and_a_frozen_weight_keeps_no_xt() -> None:
    lin = Fp4Linear(32, 16, ctx=NV)
    x, _ = _data(4, 32, 16)
    with torch.no_grad():
        lin(x)
    assert lin.sr_key.tolist() == [5, 0]
    lin.weight.requires_grad_(False)
    packed: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lin(x.requires_grad_(True)).sum().backward()
    assert all(t.dtype != torch.float4_e2m1fn_x2 for t in packed)  # no Xᵀ operand kept


def _two_layers(recipe: Fp4Recipe) -> nn.Sequential:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.Linear(32, 16))
    convert_to_quantized(model, _ctx(recipe), include_head=True, min_features=16)
    return model


def _key(model: nn.Sequential) -> torch.Tensor:
    first = model[0]
    assert isinstance(first, Fp4Linear)
    return first.sr_key


def _step(model: nn.Module, x: torch.Tensor, ckpt: bool = False) -> list[torch.Tensor]:
    model.zero_grad()
    y = checkpoint(model, x, use_reentrant=False) if ckpt else model(x)
    y.float().square().sum().backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_activation_checkpointing_is_exact() -> None:
    # The recomputation advances no counter and the backward reads the original call's key.
    x, _ = _data(12, 32, 16, seed=2)
    a, b = _two_layers(RECIPES["nvfp4"]), _two_layers(RECIPES["nvfp4"])
    for _ in range(2):
        ga, gb = _step(a, x), _step(b, x, ckpt=True)
        assert all(torch.equal(u, v) for u, v in zip(ga, gb, strict=True))
    key_a, key_b = _key(a), _key(b)
    assert torch.equal(key_a, key_b) and int(key_a[1]) > 0


def test_a_resumed_run_draws_the_same_bits_through_safetensors(tmp_path: Path) -> None:
    x, _ = _data(12, 32, 16, seed=3)
    run = _two_layers(RECIPES["nvfp4"])
    _step(run, x)
    save_file(run.state_dict(), str(tmp_path / "mid.safetensors"))
    after = _step(run, x)  # the run goes on
    resumed = _two_layers(RECIPES["nvfp4"])
    resumed.load_state_dict(load_file(str(tmp_path / "mid.safetensors")))
    word = stream_word(5, stream_of("0"))  # convert_to_quantized's stream for layer '0'
    assert torch.equal(_key(resumed), torch.tensor([word, 64 * (12 + 16)]))
    assert all(torch.equal(u, v) for u, v in zip(after, _step(resumed, x), strict=True))
    # A fresh layer's counter differs: its dY would round with other bits.
    fresh = _two_layers(RECIPES["nvfp4"])
    assert not all(torch.equal(u, v) for u, v in zip(after, _step(fresh, x), strict=True))


def test_loading_checks_the_policy_both_ways() -> None:
    state4 = _two_layers(RECIPES["nvfp4"]).state_dict()
    fp8 = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.Linear(32, 16))
    fp8_ctx = ComputeCtx.from_flag("fp8_hybrid", "cpu")
    convert_to_quantized(fp8, fp8_ctx, include_head=True, min_features=16)
    with pytest.raises(
        ValueError, match=r"state of a 4-bit Fp4Linear .* does not load into an fp8"
    ):
        fp8.load_state_dict(state4)
    with pytest.raises(ValueError, match=r"an fp8 checkpoint does not load into a 4-bit model"):
        _two_layers(RECIPES["nvfp4"]).load_state_dict(fp8.state_dict())
    other = _two_layers(RECIPES["nvfp4+w1x16+no_rht"])
    with pytest.raises(ValueError, match=r"saved under the 4-bit recipe 'nvfp4\+seed=5' but"):
        other.load_state_dict(state4)
    # An nn.Linear checkpoint loads (the counter as it is).
    plain = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.Linear(32, 16))
    _two_layers(RECIPES["nvfp4"]).load_state_dict(plain.state_dict())


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(32, 32)
        self.up = nn.Linear(32, 64)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 32)
        self.blocks = nn.ModuleList(_Block() for _ in range(4))
        self.head = nn.Linear(32, 16)


def test_convert_keeps_the_head_and_the_recipes_high_layers() -> None:
    model = _Model()
    assert set(model_blocks(model).values()) == {(i, 4) for i in range(4)}
    recipe = Fp4Recipe(hp_last=1, hp=("*.attn",))
    report = convert_to_quantized(model, _ctx(recipe), min_features=16)
    assert report.converted == ("blocks.0.up", "blocks.1.up", "blocks.2.up")
    rules = {s.fqn: s.rule for s in report.skipped}
    assert rules["head"] == "head" and rules["blocks.3.up"] == "kept_high"
    assert rules["blocks.0.attn"] == "kept_high"
    assert isinstance(model.blocks[0].up, Fp4Linear)
    again = convert_to_quantized(model, _ctx(recipe), min_features=16)
    assert again.already_fp8 == report.converted
    # It said "already a QuantizedLinear under fp8=nvfp4..." of an Fp4Linear.
    with pytest.raises(ValueError, match="already a Fp4Linear under recipe=nvfp4"):
        convert_to_quantized(model, _ctx(Fp4Recipe()), min_features=16)


def test_fp8_entry_points_refuse_4_bits_and_widths_are_checked() -> None:
    # (Grouped experts convert to Fp4Experts now: tests/formats/test_convert_experts.py.)
    with pytest.raises(NotImplementedError, match="dense linears are Fp4Linear"):
        QuantizedLinear(32, 32, ctx=NV)
    with pytest.raises(ValueError, match="multiple of 32, the mxfp4 block"):
        Fp4Linear(48, 32, ctx=_ctx(RECIPES["mxfp4"]))


@pytest.mark.parametrize(
    ("recipe", "per_element"),
    [
        (Fp4Recipe(), 0.5 + 1 / 256),
        (Fp4Recipe(weight_tile="1x16"), 0.5625),
        (Fp4Recipe(format="mxfp4"), 0.53125),
    ],
)
def test_the_memory_report_counts_a_4_bit_weights_bytes(
    recipe: Fp4Recipe, per_element: float
) -> None:
    lin = Fp4Linear(256, 128, ctx=_ctx(recipe))
    q = lin.quantized_weight()
    report = memory_report([q.codes, q.scale, *([q.amax] if isinstance(q, Nvfp4Operand) else [])])
    tensor = 4 if recipe.format == "nvfp4" else 0  # the float32 amax
    assert sum(r.bytes for r in report.rows) == 256 * 128 * per_element + tensor == q.nbytes
    assert {r.dtype for r in report.rows} >= {"float4_e2m1fn_x2"}


def test_load_weights_restores_the_counter_and_checks_the_recipe(tmp_path: Path) -> None:
    run = _two_layers(RECIPES["nvfp4"])
    _step(run, _data(12, 32, 16)[0])
    path = save_weights(run, tmp_path / "w.safetensors")
    resumed = _two_layers(RECIPES["nvfp4"])
    load_weights(resumed, path, NV)
    assert torch.equal(_key(resumed), _key(run)) and int(_key(run)[1]) > 0
    other = _two_layers(RECIPES["nvfp4+w1x16+no_rht"])
    with pytest.raises(ValueError, match=r"saved under the 4-bit recipe 'nvfp4\+seed=5'"):
        load_weights(other, path, NV)


def test_an_extra_state_of_none_is_refused_before_any_layer_loads() -> None:
    # It was read as absent by the check, then torch handed it to set_extra_state after the
    # other layers had loaded (TypeError, a half load).
    ctx = ComputeCtx.from_flag("nvfp4", "cpu")
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    convert_to_quantized(model, ctx, include_head=True, min_features=16)
    state = {k: torch.zeros_like(v) if v.is_floating_point() else v
             for k, v in model.state_dict().items()}  # fmt: skip
    state["1._extra_state"] = None
    first = model[0]
    assert isinstance(first, Fp4Linear)
    before = first.weight.detach().clone()
    with pytest.raises(ValueError, match=r"1\._extra_state .* got NoneType \(drop the entry"):
        model.load_state_dict(state)
    assert torch.equal(before, first.weight)
