"""The 4-bit modules' stochastic-rounding streams (``linear.fp4_streams``, ``fp4_counter``): same-
shaped layers of a model draw different bits; stream 0 is the recipe's seed (every module's key
before streams); the key word is splitmix64's documented mix; a model's streams come from its
names (``ByteLM`` and ``convert_to_quantized`` alike); a module that has drawn keeps its stream;
``_extra_state`` version 2 saves the stream and version 1 loads as stream 0, a bad stream
refused on every load path before anything is written."""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import cast

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from computectx import ComputeCtx
from computectx.formats import Fp4Experts, Fp4Linear, assign_fp4_streams, convert_to_quantized
from computectx.formats.linear.fp4_counter import (
    FP4_STATE_VERSION,
    recipe_code,
    signed_seed,
    stream_word,
)
from computectx.formats.linear.fp4_streams import stream_of
from computectx.fp4_recipe import Fp4Recipe
from computectx.memory import load_weights, save_weights
from computectx.nn import ByteLM, LMConfig

RECIPE = Fp4Recipe(seed=5)
NV = ComputeCtx.from_flag("nvfp4", "cpu").replace(recipe=RECIPE)
M64 = 2**64


def _splitmix64(seed: int, n: int) -> int:
    """The ``n``-th output (from 1) of splitmix64 seeded with ``seed``, as its generator runs."""
    state = seed
    for _ in range(n):
        state = (state + 0x9E3779B97F4A7C15) % M64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % M64
    return z ^ (z >> 31)


def test_stream_zero_is_the_seed_and_another_is_splitmix64s_output() -> None:
    assert stream_word(0, 1) == signed_seed(0xE220A8397B1DCDAF)  # splitmix64(0)'s first output
    for seed in (0, 5, 2**63, M64 - 1):
        assert stream_word(seed, 0) == signed_seed(seed)  # before streams: the seed itself
        for stream in (1, 2, 7):
            assert stream_word(seed, stream) == signed_seed(_splitmix64(seed, stream))
    lin = Fp4Linear(32, 16, ctx=NV.replace(recipe=Fp4Recipe(seed=M64 - 1)))
    assert lin.sr_stream == 0 and lin.sr_key.tolist() == [-1, 0]
    big = Fp4Linear(32, 16, ctx=NV, sr_stream=2**63 - 1)
    assert big.sr_key.tolist() == [stream_word(5, 2**63 - 1), 0]
    assert Fp4Experts(Fp4Recipe(seed=5), sr_stream=9).sr_key.tolist() == [stream_word(5, 9), 0]
    for bad, error in ((-1, ValueError), (2**63, ValueError), (True, TypeError), (1.0, TypeError)):
        with pytest.raises(error, match=r"Fp4Linear\(32, 16\): the stochastic-rounding stream"):
            Fp4Linear(32, 16, ctx=NV, sr_stream=bad)  # type: ignore[arg-type]


def test_stream_of_hashes_the_name() -> None:
    name = "blocks.0.attn.out"
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    assert stream_of(name) == int.from_bytes(digest, "little") & (2**63 - 1) != 0
    assert stream_of("blocks.1.attn.out") != stream_of(name)
    # Wrapper parts are left out by the tree walk (stream_names), not by their text.
    assert stream_of("_orig_mod.blocks.0.attn.out") != stream_of(name)


def _bytelm(experts: int = 0) -> ByteLM:
    torch.manual_seed(0)
    cfg = LMConfig(d_model=64, n_layers=2, n_heads=2, max_len=32)
    if experts:
        cfg = LMConfig(
            d_model=64, n_layers=2, n_heads=2, max_len=32, n_experts=experts, moe_hidden=32
        )
    return ByteLM(NV, cfg)


def _converted() -> nn.Sequential:
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    convert_to_quantized(seq, NV, include_head=True, min_features=16)
    return seq


@pytest.mark.parametrize("build", ["ByteLM", "convert_to_quantized"])
def test_same_shaped_layers_draw_different_bits_in_one_backward(build: str) -> None:
    # dW = dYᵀ Xᵀ rounds dYᵀ stochastically and reads no weight: two layers given the same X
    # and dY at the same counter give the same dW exactly when they draw the same bits (every
    # layer on the recipe's seed before streams: blocks.0 and blocks.1's attn.out alike).
    if build == "ByteLM":
        model: nn.Module = _bytelm()
        names = ("blocks.0.attn.out", "blocks.1.attn.out")
    else:
        model, names = _converted(), ("0", "1")
    a, b = (model.get_submodule(n) for n in names)
    assert isinstance(a, Fp4Linear) and isinstance(b, Fp4Linear)
    assert (a.sr_stream, b.sr_stream) == (stream_of(names[0]), stream_of(names[1]))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(24, a.in_features, generator=gen).bfloat16()
    dy = torch.randn(24, a.out_features, generator=gen).bfloat16()
    for layer in (a, b):
        layer.zero_grad()
        torch.autograd.backward(layer(x), dy)
    assert a.weight.grad is not None and b.weight.grad is not None
    assert not torch.equal(a.weight.grad, b.weight.grad)
    assert int(a.sr_key[1]) == int(b.sr_key[1]) > 0


def test_a_models_streams_are_its_names_and_assigning_again_changes_nothing() -> None:
    model = _bytelm(experts=4)
    fp4 = {n: m for n, m in model.named_modules() if isinstance(m, Fp4Linear | Fp4Experts)}
    assert "blocks.1.mlp.experts.fp8" in fp4 and "blocks.0.attn.qkv" in fp4
    streams = {n: m.sr_stream for n, m in fp4.items()}
    assert streams == {n: stream_of(n) for n in fp4} and len(set(streams.values())) == len(fp4)
    assert assign_fp4_streams(model) == streams


def test_assembled_parts_get_their_streams_but_never_once_a_module_has_drawn() -> None:
    whole = nn.Sequential(_converted(), _converted())  # each part named its layers '0', '1'
    first, second = (whole.get_submodule(n) for n in ("0.0", "1.0"))
    assert isinstance(first, Fp4Linear) and isinstance(second, Fp4Linear)
    assert first.sr_stream == second.sr_stream == stream_of("0")
    assert assign_fp4_streams(whole)["1.0"] == second.sr_stream == stream_of("1.0")
    drawn = nn.Sequential(_converted(), _converted())
    drawn(torch.randn(4, 32)).sum().backward()
    keys = [m.sr_key for m in drawn.modules() if isinstance(m, Fp4Linear)]
    with pytest.raises(ValueError, match=r"'0\.0' has drawn on the stochastic-rounding stream"):
        assign_fp4_streams(drawn)
    after = [m.sr_key for m in drawn.modules() if isinstance(m, Fp4Linear)]
    assert all(torch.equal(u, v) for u, v in zip(keys, after, strict=True))  # none changed
    last = drawn.get_submodule("1.1")
    assert isinstance(last, Fp4Linear)
    refused = r"^the 4-bit layer has drawn .* \(counter 640\): its stream cannot change to 3"
    with pytest.raises(ValueError, match=refused):
        last.set_sr_stream(3)
    last.set_sr_stream(last.sr_stream)  # the same stream again: no change


def _trained(stream: int) -> Fp4Linear:
    torch.manual_seed(2)
    lin = Fp4Linear(32, 16, ctx=NV, sr_stream=stream)
    lin(torch.randn(12, 32)).sum().backward()
    return lin


def test_version_2_saves_and_restores_the_stream_and_version_1_loads_as_stream_0(
    tmp_path: Path,
) -> None:
    source = _trained(77)
    counter = 16 * (12 + 16)
    state = source.state_dict()
    assert FP4_STATE_VERSION == 2
    assert state["_extra_state"].tolist() == [2, recipe_code(RECIPE), 5, counter, 77]
    target = Fp4Linear(32, 16, ctx=NV)
    target.load_state_dict(state)
    assert target.sr_stream == 77 and torch.equal(target.sr_key, source.sr_key)
    save_weights(source, tmp_path / "w.safetensors")
    loaded = Fp4Linear(32, 16, ctx=NV)
    load_weights(loaded, tmp_path / "w.safetensors", NV)
    assert loaded.sr_stream == 77 and torch.equal(loaded.sr_key, source.sr_key)
    # A checkpoint from before streams: every module drew on the seed, stream 0.
    v1 = dict(state, _extra_state=torch.tensor([1, recipe_code(RECIPE), 5, counter]))
    with pytest.warns(UserWarning, match=r"^the 4-bit layer loaded a version-1 .* stream 0"):
        target.load_state_dict(v1)
    assert target.sr_stream == 0 and target.sr_key.tolist() == [5, counter]


def test_a_bad_stream_is_refused_naming_it_with_nothing_written(tmp_path: Path) -> None:
    state = {k: v.clone() for k, v in _trained(77).state_dict().items()}
    state["_extra_state"][4] = -3
    state["weight"] += 1.0  # would change the weight if anything were written
    target = _trained(5)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    msg = r"holds the stochastic-rounding stream -3; accepted: an integer in \[0, 2\*\*63\)"
    with pytest.raises(ValueError, match=msg):
        target.load_state_dict(state)
    with pytest.raises(ValueError, match=msg):
        target.set_extra_state(state["_extra_state"])
    wrapped = nn.Sequential(target)
    path = tmp_path / "bad.safetensors"
    save_file({f"0.{k}": v for k, v in state.items()}, str(path))
    with pytest.raises(ValueError, match=r"0\._extra_state .*stream -3"):
        load_weights(wrapped, path, NV)
    after = target.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items()) and target.sr_stream == 5


def _ddp_around(model: nn.Module) -> nn.Module:
    # A DistributedDataParallel instance around ``model`` without a process group: only its
    # class and its ``module`` child matter to the names (the 2-rank launch checks a real one).
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel.__new__(DistributedDataParallel)
    nn.Module.__init__(ddp)
    ddp.module = model
    return ddp


def test_a_wrapped_model_assigns_what_the_plain_one_does_and_a_users_name_counts() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    plain = _converted()
    streams = [m.sr_stream for m in plain.modules() if isinstance(m, Fp4Linear)]
    assert streams == [stream_of("0"), stream_of("1")]
    wrappers: list[Callable[[nn.Module], nn.Module]] = [
        _ddp_around,
        lambda m: cast(nn.Module, torch.compile(m)),
        checkpoint_wrapper,
    ]
    for wrap in wrappers:
        model = _converted()
        assigned = assign_fp4_streams(wrap(model))  # before training: the plain names' streams
        assert [m.sr_stream for m in model.modules() if isinstance(m, Fp4Linear)] == streams
        assert sorted(assigned.values()) == sorted(streams)
    trained = _converted()
    trained(torch.randn(4, 32)).sum().backward()
    assign_fp4_streams(_ddp_around(trained))  # a trained model: no change, no refusal
    assert [m.sr_stream for m in trained.modules() if isinstance(m, Fp4Linear)] == streams

    class Holder(nn.Module):  # a child the user named "_orig_mod" is no wrapper's
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(32, 32)
            self._orig_mod = nn.Sequential()
            self._orig_mod.add_module("lin", nn.Linear(32, 32))

    holder = Holder()
    convert_to_quantized(holder, NV, include_head=True, min_features=16)
    inner = holder._orig_mod.get_submodule("lin")
    assert isinstance(holder.lin, Fp4Linear) and isinstance(inner, Fp4Linear)
    assert (holder.lin.sr_stream, inner.sr_stream) == (stream_of("lin"), stream_of("_orig_mod.lin"))
    assert stream_of("lin") != stream_of("_orig_mod.lin")


def test_a_direct_sequential_refuses_a_bad_layer_before_any_layer_loads() -> None:
    torch.manual_seed(0)
    src = nn.Sequential(Fp4Linear(32, 32, ctx=NV, sr_stream=1), Fp4Linear(32, 32, ctx=NV))
    state = {k: v.clone() for k, v in src.state_dict().items()}
    state["0._extra_state"][3:] = torch.tensor([64, 999])  # a good state for layer 0
    state["1._extra_state"][4] = -5  # a bad stream for layer 1
    dst = nn.Sequential(Fp4Linear(32, 32, ctx=NV, sr_stream=11), Fp4Linear(32, 32, ctx=NV))
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(ValueError, match=r"1\._extra_state of the 4-bit layer '1' holds .* -5"):
        dst.load_state_dict(state)
    after = dst.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items()) and dst[0].sr_stream == 11


def test_layers_sharing_a_stream_are_told_and_force_gives_them_their_names() -> None:
    # One layer initialised from another's state copies its stream and counter: both draw the
    # same uniforms. assign_fp4_streams refuses (they have drawn) naming force=True; force
    # moves them to their names' streams, the counters kept.
    model = _converted()
    model(torch.randn(4, 32)).sum().backward()
    model[1].load_state_dict(model[0].state_dict())
    a, b = model
    assert isinstance(a, Fp4Linear) and isinstance(b, Fp4Linear) and torch.equal(a.sr_key, b.sr_key)
    counters = [int(a.sr_key[1]), int(b.sr_key[1])]
    with pytest.raises(ValueError, match=r"'1' has drawn .*force=True"):
        assign_fp4_streams(model)
    assert a.sr_stream == b.sr_stream  # refused: nothing changed
    assert assign_fp4_streams(model, force=True) == {"0": stream_of("0"), "1": stream_of("1")}
    assert [int(a.sr_key[1]), int(b.sr_key[1])] == counters
    assert [a.sr_stream, b.sr_stream] == [stream_of("0"), stream_of("1")]
    # A layer converted under a name another part's layer was converted under: told.
    whole = nn.Sequential(nn.Linear(32, 32), nn.Sequential(nn.Linear(32, 32)))
    convert_to_quantized(whole[1], NV, include_head=True, min_features=16)  # '0' in its part
    with pytest.warns(UserWarning, match=r"'0' and '1\.0' .*share the stochastic-rounding stream"):
        convert_to_quantized(whole, NV, include_head=True, min_features=16)


def test_a_version_1_resume_warns_and_force_gives_each_layer_its_stream() -> None:
    model = _bytelm()
    state = model.state_dict()
    for k, v in list(state.items()):
        if k.endswith("_extra_state"):
            state[k] = torch.tensor([1, *v[1:3].tolist(), 4096])  # saved before streams
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.load_state_dict(state)
    fp4 = {n: m for n, m in model.named_modules() if isinstance(m, Fp4Linear)}
    told = [str(w.message) for w in caught]
    assert len(told) == len(fp4) and all(
        f"the 4-bit layer {n!r} loaded a version-1 stochastic-rounding state" in t
        and "assign_fp4_streams(model, force=True)" in t
        for n, t in zip(fp4, told, strict=True)
    )
    assert {m.sr_stream for m in fp4.values()} == {0}
    assign_fp4_streams(model, force=True)
    assert all(m.sr_stream == stream_of(n) and int(m.sr_key[1]) == 4096 for n, m in fp4.items())


def test_a_stream_is_any_integer_and_a_refusal_names_the_value() -> None:
    import enum

    import numpy as np

    class Stream(enum.IntEnum):
        MAIN = 3

    for value in (np.int64(3), np.uint8(3), Stream.MAIN):
        lin = Fp4Linear(32, 16, ctx=NV, sr_stream=value)  # type: ignore[arg-type]
        assert type(lin.sr_stream) is int and lin.sr_stream == 3
        lin.set_sr_stream(value)  # type: ignore[arg-type]
        other = Fp4Linear(32, 16, ctx=NV)
        other.set_sr_stream(value)  # type: ignore[arg-type]
        assert type(other.sr_stream) is int and other.get_extra_state()[4] == 3
    for bad, shown in ((2.0, r"got 2\.0 \(float\)"), ("4", r"got '4' \(str\)"), (None, "None")):
        with pytest.raises(TypeError, match=shown):
            Fp4Linear(32, 16, ctx=NV).set_sr_stream(bad)  # type: ignore[arg-type]


def test_refusals_name_the_layer_or_the_experts() -> None:
    lin = _trained(5)
    bad = lin.state_dict()
    bad["_extra_state"] = bad["_extra_state"].clone()
    bad["_extra_state"][4] = -1
    with pytest.raises(ValueError, match=r"^_extra_state of the 4-bit layer holds the stoch"):
        lin.load_state_dict(bad)
    experts = Fp4Experts(RECIPE)
    experts.sr_key = experts.sr_key + torch.tensor([0, 16])  # has drawn
    with pytest.raises(ValueError, match=r"^the 4-bit experts 'blocks\.0\.mlp' has drawn"):
        experts.set_sr_stream(3, "blocks.0.mlp")
