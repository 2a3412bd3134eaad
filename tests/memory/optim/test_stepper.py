"""Every optimizer-state format with every param-shaped torch.optim class, alone
(``CompactOptimizer``) and inside ``OffloadedOptimizer``: the trajectory against f32 state,
the stored form, checkpoints (bit-for-bit resume, conversion between formats, the decoded
form, bad parts) and the optimizer-class check on packed keys."""

from __future__ import annotations

import functools
import io
import re
import warnings
from typing import Any

import pytest
import torch

from computectx import ComputeCtx, DType
from computectx.memory import CompactOptimizer, OffloadedOptimizer
from computectx.memory.optim.state import Kind, decode_entry, round_trip_bound, split_entry

CPU = ComputeCtx.parity("cpu")
STEPS = 12
FORMATS = ("bf16/min=0", "int8/min=0", "fp8/min=0", "int4/min=0")
CLASSES: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "AdamW": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.01}),
    "Adam": (torch.optim.Adam, {"lr": 1e-2}),
    "SGD": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "RMSprop": (torch.optim.RMSprop, {"lr": 1e-3}),
    "RMSprop-centered": (torch.optim.RMSprop, {"lr": 1e-3, "centered": True, "momentum": 0.5}),
    "Adagrad": (torch.optim.Adagrad, {"lr": 5e-2}),
}
# The loss each format reaches after STEPS steps, as a fraction of the f32 state's loss
# reduction: |L - L_f32| <= TOLERANCE * (L_0 - L_f32). Measured on this problem (worst over
# the classes above): bf16 1.6e-5, int8 2.2e-4, fp8 2.8e-3, int4 4.6e-2 (Adam's 4-bit second
# moment: the zero-free linear map lifts its small entries); the bounds are about twice that.
TOLERANCE = {"bf16": 1e-4, "int8": 5e-4, "fp8": 6e-3, "int4": 0.1}

Optim = CompactOptimizer | OffloadedOptimizer


def backward(loss: torch.Tensor) -> None:
    loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward untyped


def problem() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g)
    return x, torch.tanh(x @ (torch.randn(16, 4, generator=g) / 3))


def make_model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 48, bias=False), torch.nn.Tanh(), torch.nn.Linear(48, 4, bias=False)
    ).to(dtype)


def loss_of(model: torch.nn.Module) -> torch.Tensor:
    x, y = problem()
    dtype = next(iter(model.parameters())).dtype
    out: torch.Tensor = model(x.to(dtype))
    return (out.float() - y).pow(2).mean()


def build(kind: str, model: torch.nn.Module, fmt: str, name: str, ctx: ComputeCtx = CPU) -> Optim:
    cls, kwargs = CLASSES[name]
    wrapper = CompactOptimizer if kind == "compact" else OffloadedOptimizer
    return wrapper(model.parameters(), ctx.with_optim_state(fmt), cls, **kwargs)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> float:
    for _ in range(steps):
        backward(loss_of(model))
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        return float(loss_of(model))


@functools.cache
def f32_losses(name: str) -> tuple[float, float]:
    """(initial loss, loss after STEPS steps) with torch's own f32 state."""
    model = make_model()
    cls, kwargs = CLASSES[name]
    with torch.no_grad():
        start = float(loss_of(model))
    return start, train(model, cls(model.parameters(), **kwargs), STEPS)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", list(CLASSES))
def test_trajectory_stays_close_to_f32_state_alone_and_offloaded(name: str, fmt: str) -> None:
    start, ref = f32_losses(name)
    model = make_model()
    opt = build("compact", model, fmt, name)
    got = train(model, opt, STEPS)
    assert ref < 0.5 * start  # the problem trains
    tol = TOLERANCE[fmt.split("/")[0]]
    assert abs(got - ref) <= tol * (start - ref), (got, ref, start)
    # The state really is stored in the format: every moment is packed.
    for entry in opt.state.values():
        plain, packed = split_entry(entry)
        assert packed and all(v.dim() == 0 for v in plain.values() if torch.is_tensor(v))
    # Inside OffloadedOptimizer (f32 masters) the same step runs on the same values: checked
    # for half the pairs (every format and every class at least twice), to keep this fast.
    if (list(CLASSES).index(name) + FORMATS.index(fmt)) % 2:
        return
    offloaded_model = make_model()
    train(offloaded_model, build("offloaded", offloaded_model, fmt, name), STEPS)
    assert _same_bits(list(model.parameters()), list(offloaded_model.parameters()))


def test_stored_form_keeps_scalars_and_small_tensors_f32() -> None:
    torch.manual_seed(0)
    big, small = torch.nn.Parameter(torch.randn(80, 64)), torch.nn.Parameter(torch.randn(64))
    opt = CompactOptimizer([big, small], CPU.with_optim_state("int8"), torch.optim.AdamW)
    big.grad, small.grad = torch.ones_like(big), torch.ones_like(small)
    opt.step()
    layout = {k: (v.dtype, tuple(v.shape)) for k, v in opt.state[big].items()}
    assert layout == {
        "step": (torch.float32, ()),
        "exp_avg.codes": (torch.uint8, (80 * 64,)),
        "exp_avg.absmax": (torch.float32, (80 * 64 // 256,)),
        "exp_avg_sq.codes": (torch.uint8, (80 * 64,)),
        "exp_avg_sq.absmax": (torch.float32, (80 * 64 // 256,)),
    }
    assert {k: v.dtype for k, v in opt.state[small].items()} == dict.fromkeys(
        ("step", "exp_avg", "exp_avg_sq"), torch.float32
    )
    sd = opt.state_dict()
    assert sd["optim_state"] == "int8" and "master_rounding" not in sd
    assert sd["state"][0] is opt.state[big]  # torch's form: the stored entries themselves


def _roundtrip(obj: Any) -> Any:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _snapshot(opt: Optim, model: torch.nn.Module) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for entry in opt.state.values():
        out += [v.clone() for v in entry.values() if torch.is_tensor(v)]
    if isinstance(opt, OffloadedOptimizer):
        out += [mp.detach().clone() for mp in opt.master_params]
    return out


def _same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype
        and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize(
    ("kind", "fmt", "name", "dtype"),
    [
        ("compact", "int8/min=0", "AdamW", torch.float32),
        ("compact", "int4/min=0", "SGD", torch.bfloat16),  # a bf16 weight: SR generators
        ("compact", "fp8/min=0", "RMSprop-centered", torch.float32),
        ("offloaded", "bf16/min=0", "Adagrad", torch.float32),
        ("offloaded", "int8/min=0", "Adam", torch.bfloat16),  # bf16 masters
    ],
)
def test_state_dict_resume_is_bit_for_bit(
    kind: str, fmt: str, name: str, dtype: torch.dtype
) -> None:
    ctx = CPU.replace(master=DType.BF16) if kind == "offloaded" and dtype == torch.bfloat16 else CPU
    model = make_model(dtype if kind == "compact" else torch.float32)
    opt = build(kind, model, fmt, name, ctx)
    train(model, opt, 4)
    saved = _roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    assert ("master_rounding" in saved["opt"]) == (dtype == torch.bfloat16)
    train(model, opt, 3)
    fresh = make_model(dtype if kind == "compact" else torch.float32)
    with torch.no_grad():
        for p in fresh.parameters():
            p.mul_(-1.0)  # everything must come from the checkpoint
    opt2 = build(kind, fresh, fmt, name, ctx)
    fresh.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    train(fresh, opt2, 3)
    assert _same_bits(_snapshot(opt, model), _snapshot(opt2, fresh))


def test_a_plain_torch_checkpoint_is_encoded_on_load_with_a_warning() -> None:
    model = make_model()
    ref = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, ref, 3)
    plain = _roundtrip(ref.state_dict())
    opt = CompactOptimizer(model.parameters(), CPU.with_optim_state("int8/min=0"), lr=1e-2)
    with pytest.warns(UserWarning, match=r"saved with optim_state=f32 .* converted to .*int8"):
        opt.load_state_dict(plain)
    for i, p in enumerate(model.parameters()):
        decoded = decode_entry(opt.state[p], p.shape, opt.ctx.optim_state, "test")
        for key in ("exp_avg", "exp_avg_sq"):
            kind: Kind = "unsigned" if key == "exp_avg_sq" else "signed"
            bound = round_trip_bound(plain["state"][i][key], opt.ctx.optim_state, kind)
            assert bool(((decoded[key] - plain["state"][i][key]).abs() <= bound).all())
        assert torch.equal(decoded["step"], plain["state"][i]["step"])
    train(model, opt, 1)


def test_the_decoded_form_of_the_same_format_loads_without_a_warning() -> None:
    # What a DCP checkpoint holds: packed entries decoded to f32 under their names, with the
    # format carried. Re-encoding a decoded value gives the codes back.
    model = make_model()
    opt = build("compact", model, "int8/min=0", "Adam")
    train(model, opt, 3)
    sd = opt.state_dict()
    params = list(model.parameters())
    decoded = {
        i: decode_entry(e, params[i].shape, opt.ctx.optim_state, f"[{i}]")
        for i, e in sd["state"].items()
    }
    before = _snapshot(opt, model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.load_state_dict({**sd, "state": decoded})
    assert _same_bits(before, _snapshot(opt, model))


@pytest.mark.parametrize(("saved", "ours"), [("int8", "int4"), ("fp8", "f32"), ("bf16", "int8")])
def test_another_format_is_converted_naming_both_and_the_bound(saved: str, ours: str) -> None:
    model = make_model()
    src = build("offloaded", model, saved + "/min=0", "AdamW")
    train(model, src, 3)
    sd = _roundtrip(src.state_dict())
    dst = build("offloaded", model, ours if ours == "f32" else ours + "/min=0", "AdamW")
    assert isinstance(dst, OffloadedOptimizer)
    pattern = rf"optim_state={saved}/min=0 and is converted to this optimizer's optim_state="
    with pytest.warns(UserWarning, match=pattern) as caught:
        dst.load_state_dict(sd)
    text = str(caught[0].message)
    assert ("at most" in text) == (ours != "f32")
    for i, mp in enumerate(dst.master_params):
        want = decode_entry(sd["state"][i], mp.shape, src.ctx.optim_state, "saved")
        got = decode_entry(dst.state[mp], mp.shape, dst.ctx.optim_state, "loaded")
        for key in ("exp_avg", "exp_avg_sq"):
            kind: Kind = "unsigned" if key == "exp_avg_sq" else "signed"
            bound = round_trip_bound(want[key], dst.ctx.optim_state, kind)
            assert bool(((got[key] - want[key]).abs() <= bound).all())
    train(model, dst, 1)


def test_bad_parts_are_refused_naming_the_key_and_nothing_changes() -> None:
    model = make_model()
    opt = build("compact", model, "int8/min=0", "AdamW")
    train(model, opt, 2)
    sd = _roundtrip(opt.state_dict())
    before = _snapshot(opt, model)
    groups = opt.param_groups[0]["lr"]

    def edited(key: str, value: Any, drop: str = "") -> dict[str, Any]:
        state = {i: dict(e) for i, e in sd["state"].items()}
        state[1] = {k: v for k, v in state[1].items() if not (drop and k.startswith(drop))}
        state[1][key] = value
        return {**sd, "state": state}

    codes = sd["state"][1]["exp_avg.codes"]
    with pytest.raises(ValueError, match=r"\['state'\]\[1\]\['exp_avg'\].*'codes'.*int8"):
        opt.load_state_dict(edited("exp_avg.codes", codes.to(torch.int8)))
    with pytest.raises(ValueError, match=r"\['state'\]\[1\]\['exp_avg_sq'\].*'absmax'"):
        opt.load_state_dict(edited("exp_avg_sq.absmax", torch.zeros(7)))
    with pytest.raises(ValueError, match=r"\['state'\]\[1\]\['exp_avg'\] has shape \[3\]"):
        opt.load_state_dict(edited("exp_avg", torch.zeros(3), drop="exp_avg."))
    with pytest.raises(ValueError, match=r"both 'exp_avg' and its packed parts"):
        opt.load_state_dict(edited("exp_avg", torch.zeros(48)))
    with pytest.raises(ValueError, match=r"packed parts .* optim_state=f32"):
        opt.load_state_dict({k: v for k, v in sd.items() if k != "optim_state"})
    with pytest.raises(ValueError, match=r"'optim_state'\] is not a format"):
        opt.load_state_dict({**sd, "optim_state": "int7"})
    assert _same_bits(before, _snapshot(opt, model))
    assert opt.param_groups[0]["lr"] == groups


def test_packed_keys_do_not_make_a_checkpoint_look_foreign() -> None:
    model = make_model()
    adamw = build("offloaded", model, "int4/min=0", "AdamW")
    train(model, adamw, 2)
    sd = _roundtrip(adamw.state_dict())
    build("offloaded", model, "int4/min=0", "AdamW").load_state_dict(sd)  # same class: loads
    sgd = build("offloaded", model, "int4/min=0", "SGD")
    want = "saved by torch.optim.AdamW, not torch.optim.SGD"
    with pytest.raises(ValueError, match=re.escape(want)):
        sgd.load_state_dict(sd)
