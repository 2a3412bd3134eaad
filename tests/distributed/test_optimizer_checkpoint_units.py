"""``optimizer_state_dict`` / ``set_optimizer_state_dict`` in one process (no process group).

The FQN keys against torch's own state-dict helpers, the placeholder state of an optimizer
that has not stepped, a bitwise resume through ``torch.save``/``torch.load(weights_only=True)``,
the exchange with a plain torch optimizer's state dict, and every refusal (each naming the key,
each changing nothing).
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict import (
    set_optimizer_state_dict as torch_set_optimizer_state_dict,
)

from computectx import ComputeCtx, DType
from computectx.distributed import parallelize
from computectx.distributed.optimizer_checkpoint import (
    MASTER_WEIGHTS,
    optimizer_state_dict,
    parameter_fqns,
    set_optimizer_state_dict,
)
from computectx.formats import QuantizedLinear, convert_to_quantized
from computectx.memory import OffloadedOptimizer
from computectx.memory.optim.state import kind_of, round_trip_bound
from computectx.optim_state import OptimState

CTX = ComputeCtx.parity("cpu").replace(master=DType.F32, offload=torch.device("cpu"))


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=gen), torch.randn(4, 2, generator=gen)) for _ in range(6)]
    for s in steps:
        x, y = data[s]
        nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()


def _roundtrip(obj: Any) -> Any:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _flat(sd: dict[str, Any]) -> dict[str, Any]:
    """Every value of an FQN-keyed optimizer state dict, by path (tensors cloned)."""
    out: dict[str, Any] = {}
    for fqn, t in sd[MASTER_WEIGHTS].items():
        out[f"master/{fqn}"] = t.clone()
    for fqn, per in sd["state"].items():
        out.update({f"{k}/{fqn}": v.clone() for k, v in per.items()})
    for j, group in enumerate(sd["param_groups"]):
        out.update({f"group{j}/{k}": v for k, v in group.items()})
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    return all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


@pytest.mark.parametrize("wrap", ["plain", "compiled", "activation checkpoint", "shared weight"])
def test_keys_are_the_fqns_of_torchs_model_state_dict(wrap: str) -> None:
    inner = _model()
    model: nn.Module = inner
    if wrap == "compiled":
        # wraps only: compiling starts at the first call
        model = torch.compile(inner)  # type: ignore[assignment]  # typed as a function
    elif wrap == "activation checkpoint":
        inner[0] = checkpoint_wrapper(inner[0])
    elif wrap == "shared weight":
        inner.append(nn.Linear(16, 2))
        inner[3].weight = inner[2].weight
    opt = OffloadedOptimizer(model.parameters(), CTX)
    sd = optimizer_state_dict(model, opt)
    torch_keys = sorted(get_model_state_dict(model))
    if wrap == "shared weight":
        torch_keys.remove("3.weight")  # torch names a shared weight twice; it is one parameter
    assert sorted(sd[MASTER_WEIGHTS]) == sorted(sd["state"]) == torch_keys
    assert sorted(parameter_fqns(model).values()) == torch_keys
    assert sorted(sd["param_groups"][0]["params"]) == torch_keys


def test_state_shares_the_optimizers_tensors() -> None:
    model = _model()
    opt = OffloadedOptimizer(model.parameters(), CTX)
    _train(model, opt, range(1))
    sd = optimizer_state_dict(model, opt)
    first = opt.master_params[0]
    assert sd[MASTER_WEIGHTS]["0.weight"].data_ptr() == first.data_ptr()
    assert sd["state"]["0.weight"]["exp_avg"] is opt.state[first]["exp_avg"]


def test_an_optimizer_that_has_not_stepped_gets_placeholders_and_stays_as_it_was() -> None:
    model = _model()
    opt = OffloadedOptimizer(model.parameters(), CTX, torch.optim.AdamW, lr=1e-2)
    masters = [m.detach().clone() for m in opt.master_params]
    sd = optimizer_state_dict(model, opt)
    # What one step with zero gradients creates, as torch's get_optimizer_state_dict does...
    assert sorted(sd["state"]["2.weight"]) == ["exp_avg", "exp_avg_sq", "step"]
    assert float(sd["state"]["2.weight"]["step"]) == 1.0
    assert not sd["state"]["0.weight"]["exp_avg"].any()
    assert sd["state"]["0.weight"]["exp_avg"].shape == (16, 8)
    # ... made on a copy: this optimizer has no state and the same masters.
    assert not opt.state
    assert all(torch.equal(m, c) for m, c in zip(opt.master_params, masters, strict=True))
    assert all(p.grad is None for p in (*opt.master_params, *model.parameters()))


def test_resume_through_torch_save_weights_only_is_bitwise() -> None:
    # An fp8 model: its scaling state rides in the model's state dict (extra state).
    ctx = ComputeCtx.from_flag("fp8_hybrid", "cpu")

    def build(seed: int) -> tuple[nn.Sequential, OffloadedOptimizer]:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
        convert_to_quantized(model, ctx, module_filter=lambda module, fqn: True)
        return model, OffloadedOptimizer(model.parameters(), ctx, torch.optim.AdamW, lr=1e-2)

    def train(model: nn.Module, opt: OffloadedOptimizer, steps: range) -> None:
        gen = torch.Generator().manual_seed(2)
        data = [torch.randn(8, 32, generator=gen) for _ in range(4)]
        for s in steps:
            model(data[s]).square().mean().backward()
            opt.step()
            opt.zero_grad()

    model, opt = build(0)
    train(model, opt, range(2))
    # Both forms go through torch.load(weights_only=True) with no safe-globals entry: the FQN
    # form and the position form (OffloadedOptimizer.state_dict) with the model's state dict.
    by_fqn = _roundtrip({"model": model.state_dict(), "optim": optimizer_state_dict(model, opt)})
    by_position = _roundtrip({"model": model.state_dict(), "optim": opt.state_dict()})
    assert isinstance(by_fqn["model"]["0.fp8_input_ledger"], torch.Tensor)
    train(model, opt, range(2, 4))
    for saved in (by_fqn, by_position):
        model2, opt2 = build(5)  # other weights: everything comes from the checkpoint
        model2.load_state_dict(saved["model"])
        if saved is by_fqn:
            set_optimizer_state_dict(model2, opt2, saved["optim"])
        else:
            opt2.load_state_dict(saved["optim"])
        train(model2, opt2, range(2, 4))
        for a, b in zip(model.parameters(), model2.parameters(), strict=True):
            assert torch.equal(a, b)
        for m, m2 in zip(model.modules(), model2.modules(), strict=True):
            if isinstance(m, QuantizedLinear):
                assert isinstance(m2, QuantizedLinear)
                for role, op in m.scaling.operands.items():
                    assert torch.equal(op.ledger, m2.scaling.operands[role].ledger), role
        assert _same(
            _flat(optimizer_state_dict(model2, opt2)), _flat(optimizer_state_dict(model, opt))
        )


def test_exchanges_state_with_a_plain_torch_optimizer() -> None:
    # f32 masters of f32 weights: the offloaded AdamW is the plain AdamW (fused=True, the
    # kernel the f32 step runs) on other tensors.
    plain_model = _model()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2, fused=True)
    _train(plain_model, plain, range(2))
    # torch's FQN form (no master weights) loads: the masters come from the model's weights.
    model = _model(seed=5)
    model.load_state_dict(plain_model.state_dict())
    opt = OffloadedOptimizer(model.parameters(), CTX, torch.optim.AdamW, lr=1e-2)
    # (through torch.save: loading takes the tensors, as Optimizer.load_state_dict does, and
    # the two optimizers must not share moments)
    set_optimizer_state_dict(model, opt, _roundtrip(get_optimizer_state_dict(plain_model, plain)))
    assert all(
        torch.equal(m, p) for m, p in zip(opt.master_params, plain_model.parameters(), strict=True)
    )
    # ... and ours (minus the masters) loads into a plain optimizer through torch's helper.
    _train(model, opt, range(2, 4))
    back_model = _model(seed=6)
    back_model.load_state_dict(model.state_dict())
    back = torch.optim.AdamW(back_model.parameters(), lr=1e-2)
    ours = optimizer_state_dict(model, opt)
    del ours[MASTER_WEIGHTS]
    torch_set_optimizer_state_dict(back_model, back, _roundtrip(ours))
    # All three go on identically.
    _train(plain_model, plain, range(2, 6))
    _train(model, opt, range(4, 6))
    _train(back_model, back, range(4, 6))
    for p, q, r in zip(
        plain_model.parameters(), model.parameters(), back_model.parameters(), strict=True
    ):
        assert torch.equal(p, q) and torch.equal(p, r)


def _set_key(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(sd: dict[str, Any]) -> None:
        target = sd
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return edit


REFUSALS: list[tuple[str, Callable[[dict[str, Any]], Any], type[Exception], list[str]]] = [
    (
        "an unknown top-level key",
        _set_key(("state.0.weight.exp_avg",), torch.zeros(16, 8)),
        ValueError,
        ["'state.0.weight.exp_avg'", "accepted: 'state', 'param_groups'", "flattened"],
    ),
    (
        "no param_groups",
        lambda sd: sd.pop("param_groups"),
        ValueError,
        ["'param_groups' (both required)"],
    ),
    (
        "another number of groups",
        lambda sd: sd["param_groups"].append(dict(sd["param_groups"][0])),
        ValueError,
        ["has 2 group(s); this optimizer has 1"],
    ),
    (
        "a group naming another parameter",
        lambda sd: sd["param_groups"][0]["params"].__setitem__(0, "9.weight"),
        ValueError,
        ["param_groups'][0] does not hold", "missing ['0.weight']", "unexpected ['9.weight']"],
    ),
    (
        "a group listing positions",
        _set_key(("param_groups", 0, "params"), [0, 1, 2, 3]),
        TypeError,
        ["must be a list of parameter FQNs"],
    ),
    (
        "state for an unknown parameter",
        _set_key(("state", "module.0.weight"), {}),
        ValueError,
        ["'module.0.weight', which is not one of", "accepted: '0.weight'"],
    ),
    (
        "a moment of another shape",
        _set_key(("state", "2.weight", "exp_avg"), torch.zeros(2, 15)),
        ValueError,
        ["['2.weight']['exp_avg'] has shape [2, 15], but the master weight is [2, 16]"],
    ),
    (
        "a state entry that is no dict",
        _set_key(("state", "0.bias"), torch.zeros(16)),
        TypeError,
        ["state_dict['state']['0.bias'] must be a dict"],
    ),
    (
        "a missing master",
        lambda sd: sd[MASTER_WEIGHTS].pop("2.bias"),
        ValueError,
        ["missing ['2.bias'], unexpected []"],
    ),
    (
        "a master in another dtype",
        _set_key((MASTER_WEIGHTS, "2.weight"), torch.zeros(2, 16, dtype=torch.bfloat16)),
        ValueError,
        ["['2.weight'] is torch.bfloat16[2, 16]", "master weight is torch.float32"],
    ),
    (
        "a master of another shape",
        _set_key((MASTER_WEIGHTS, "0.bias"), torch.zeros(8)),
        ValueError,
        ["['0.bias'] has shape [8], but the master weight is [16]"],
    ),
    (
        "a master holding NaN",
        _set_key((MASTER_WEIGHTS, "2.bias"), torch.tensor([0.5, math.nan])),
        ValueError,
        ["holds inf or NaN in 1 master weight(s) of trainable parameters: [3] (shape [2])"],
    ),
    (
        "a master that is no tensor",
        _set_key((MASTER_WEIGHTS, "0.bias"), [0.0] * 16),
        TypeError,
        ["['0.bias'] must be a tensor, got list"],
    ),
]


@pytest.mark.parametrize(
    ("edit", "error", "parts"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS]
)
def test_a_bad_state_is_refused_naming_it_and_changes_nothing(
    edit: Callable[[dict[str, Any]], Any], error: type[Exception], parts: list[str]
) -> None:
    model = _model()
    opt = OffloadedOptimizer(model.parameters(), CTX, torch.optim.AdamW, lr=1e-2)
    _train(model, opt, range(2))
    before = _flat(optimizer_state_dict(model, opt))
    weights = [p.detach().clone() for p in model.parameters()]
    # Everything else in the state is a valid change (another learning rate, other moments
    # and masters: test_the_same_changes_without_the_fault_load), so a partial load would show.
    sd = _changed(optimizer_state_dict(model, opt))
    edit(sd)
    with pytest.raises(error) as caught:
        set_optimizer_state_dict(model, opt, sd)
    for part in parts:
        assert part in str(caught.value)
    assert _same(_flat(optimizer_state_dict(model, opt)), before)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))


def _changed(sd: dict[str, Any]) -> dict[str, Any]:
    """A valid state other than ``sd``: moments and masters plus one, learning rate 0.5."""
    return {
        "state": {f: {k: v + 1 for k, v in per.items()} for f, per in sd["state"].items()},
        "param_groups": [{**g, "lr": 0.5, "params": list(g["params"])} for g in sd["param_groups"]],
        MASTER_WEIGHTS: {k: v + 1 for k, v in sd[MASTER_WEIGHTS].items()},
    }


def test_the_same_changes_without_the_fault_load() -> None:
    # The control for the refusals above: the changed state itself is accepted, in full.
    model = _model()
    opt = OffloadedOptimizer(model.parameters(), CTX, torch.optim.AdamW, lr=1e-2)
    _train(model, opt, range(2))
    changed = _changed(optimizer_state_dict(model, opt))
    expected = _flat(changed)
    set_optimizer_state_dict(model, opt, changed)
    assert _same(_flat(optimizer_state_dict(model, opt)), expected)
    assert opt.param_groups[0]["lr"] == 0.5
    first = next(model.parameters())
    assert torch.equal(first, changed[MASTER_WEIGHTS]["0.weight"])  # into the model


def test_a_model_or_optimizer_that_does_not_match_is_refused() -> None:
    model = _model()
    opt = OffloadedOptimizer(model.parameters(), CTX)
    with pytest.raises(ValueError, match=r"optimizer's parameter 0 \(shape \[16, 8\]\) is not a"):
        optimizer_state_dict(_model(), opt)
    plain = torch.optim.AdamW(model.parameters())
    with pytest.raises(TypeError, match="got AdamW; for a plain torch optimizer use"):
        optimizer_state_dict(model, plain)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module, got list"):
        set_optimizer_state_dict(list(model.parameters()), opt, {})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="state_dict must be a mapping, got list"):
        set_optimizer_state_dict(model, opt, [])  # type: ignore[arg-type]


# ----- compact state (ctx.optim_state): the decoded form --------------------------------


def _compact(fmt: str, master: DType = DType.F32, seed: int = 0) -> tuple[nn.Module, Any]:
    model = _model(seed)
    ctx = CTX.replace(master=master).with_optim_state(fmt)
    return model, OffloadedOptimizer(model.parameters(), ctx, torch.optim.AdamW, lr=1e-2)


def _parts(opt: OffloadedOptimizer) -> dict[str, torch.Tensor]:
    return {f"{i}/{k}": v for i, per in opt.state_dict()["state"].items() for k, v in per.items()}


@pytest.mark.parametrize("fmt", ["bf16/min=0", "int8/min=0", "fp8/min=0", "int4/block=32/min=0"])
def test_compact_state_goes_in_decoded_and_loads_back_exactly(fmt: str) -> None:
    model, opt = _compact(fmt, DType.BF16)
    _train(model, opt, range(2))
    form = optimizer_state_dict(model, opt)
    assert form["optim_state"] == fmt and "master_rounding" in form
    shapes = {n: p.shape for n, p in model.named_parameters()}
    for fqn, per in form["state"].items():
        assert sorted(per) == ["exp_avg", "exp_avg_sq", "step"], fqn  # no packed part
        assert per["exp_avg"].dtype == torch.float32 and per["exp_avg"].shape == shapes[fqn]
    assert all(m.dtype == torch.bfloat16 for m in form[MASTER_WEIGHTS].values())
    # Through torch.save (weights_only): a fresh optimizer re-forms every part bit for bit
    # (same blocks), with no conversion warning, and both train on identically (the
    # stochastic rounding generators ride along).
    saved = _roundtrip(form)
    model2, opt2 = _compact(fmt, DType.BF16, seed=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        set_optimizer_state_dict(model2, opt2, saved)
    assert not [w for w in caught if issubclass(w.category, UserWarning)]
    assert _same(_parts(opt2), _parts(opt))
    _train(model, opt, range(2, 4))
    _train(model2, opt2, range(2, 4))
    assert _same(_parts(opt2), _parts(opt))
    assert all(
        torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters(), strict=True)
    )


def test_a_state_of_another_format_converts_within_one_round_trip() -> None:
    model, opt = _compact("int8/min=0")
    _train(model, opt, range(2))
    saved = _roundtrip(optimizer_state_dict(model, opt))
    model2, opt2 = _compact("int4/block=32/min=0", seed=5)
    with pytest.warns(UserWarning, match=r"int8[\s\S]*int4|int4[\s\S]*int8"):
        set_optimizer_state_dict(model2, opt2, saved)
    loaded = optimizer_state_dict(model2, opt2)
    target = OptimState.parse("int4/block=32/min=0")
    for fqn, per in saved["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            bound = round_trip_bound(per[name], target, kind_of(name))
            assert bool(((loaded["state"][fqn][name] - per[name]).abs() <= bound).all())
    # An f32 optimizer's form (no "optim_state": f32) converts too, with the warning.
    plain_model, plain = _compact("f32")
    _train(plain_model, plain, range(1))
    f32_form = optimizer_state_dict(plain_model, plain)
    assert "optim_state" not in f32_form  # the f32 form is as it was
    with pytest.warns(UserWarning, match="f32"):
        set_optimizer_state_dict(model2, opt2, _roundtrip(f32_form))


def test_an_unstepped_compact_optimizer_gives_float32_placeholders() -> None:
    model, opt = _compact("int8/min=0", DType.BF16)
    form = optimizer_state_dict(model, opt)
    assert not opt.state
    moment = form["state"]["0.weight"]["exp_avg"]
    assert moment.dtype == torch.float32 and moment.shape == (16, 8) and not moment.any()


COMPACT_REFUSALS: list[tuple[str, Callable[[dict[str, Any]], Any], type[Exception], str]] = [
    (
        "packed parts",
        _set_key(("state", "0.weight", "exp_avg.codes"), torch.zeros(128, dtype=torch.uint8)),
        ValueError,
        "['0.weight'] holds packed parts ['exp_avg.codes']; accepted: each state tensor decoded",
    ),
    (
        "an unknown format",
        _set_key(("optim_state",), "int3"),
        ValueError,
        "state_dict['optim_state']: ",
    ),
    (
        "a format that is no text",
        _set_key(("optim_state",), 8),
        TypeError,
        "state_dict['optim_state'] must be the text form of an optim_state",
    ),
]


@pytest.mark.parametrize(
    ("edit", "error", "part"),
    [r[1:] for r in COMPACT_REFUSALS],
    ids=[r[0] for r in COMPACT_REFUSALS],
)
def test_a_bad_compact_state_is_refused_and_changes_nothing(
    edit: Callable[[dict[str, Any]], Any], error: type[Exception], part: str
) -> None:
    model, opt = _compact("int8/min=0")
    _train(model, opt, range(2))
    before = _parts(opt)
    sd = _roundtrip(optimizer_state_dict(model, opt))
    sd["param_groups"][0]["lr"] = 0.5
    edit(sd)
    with pytest.raises(error) as caught:
        set_optimizer_state_dict(model, opt, sd)
    assert part in str(caught.value)
    assert _same(_parts(opt), before) and opt.param_groups[0]["lr"] == 1e-2


def test_parallelize_steps_compact_state_and_resumes_it_bitwise() -> None:
    # Without offload or a lower master, a plain torch optimizer would keep f32 state.
    ctx = CTX.replace(offload=None).with_optim_state("int8/min=0")
    par, other = parallelize(_model(), ctx, lr=1e-2), parallelize(_model(5), ctx, lr=1e-2)
    assert isinstance(par.optimizer, OffloadedOptimizer)
    _train(par.model, par.optimizer, range(2))
    assert "exp_avg.codes" in par.optimizer.state_dict()["state"][0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other.load_state_dict(_roundtrip(par.state_dict()))
    assert not [w for w in caught if issubclass(w.category, UserWarning)]  # no conversion
    _train(par.model, par.optimizer, range(2, 4))
    _train(other.model, other.optimizer, range(2, 4))
    pairs = zip(par.module.parameters(), other.module.parameters(), strict=True)
    assert all(torch.equal(p, q) for p, q in pairs)
