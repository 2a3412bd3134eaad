"""Serving is deterministic per request, and fp8 layers build on the meta device.

A frozen layer (``freeze_for_serving``) records nothing in any mode: under delayed scaling
its input step is the static one training left in the input ledger (a saved tensor), and
an input ledger never seeded, or dynamic scaling, takes each request's own amax. So a
request's output never depends on other requests, and a reload gives the same outputs.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from computectx import ComputeCtx
from computectx.formats import QuantizedLinear, Recipe, convert_to_quantized
from computectx.formats.numerics.ledger import ledger_new
from computectx.memory import load_weights, save_weights


def ctx_of(policy: str) -> ComputeCtx:
    return ComputeCtx.from_flag("fp8_hybrid", "cpu").replace(recipe=Recipe.parse(policy))


def mlp(ctx: ComputeCtx, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    convert_to_quantized(model, ctx, module_filter=lambda module, fqn: True)
    return model


def layers(model: nn.Module) -> list[QuantizedLinear]:
    return [m for m in model.modules() if isinstance(m, QuantizedLinear)]


def frozen(model: nn.Sequential) -> nn.Sequential:
    for layer in layers(model):
        layer.freeze_for_serving()
    return model


def train(model: nn.Module, steps: int = 3) -> None:
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        model(torch.randn(8, 32, generator=g)).float().square().mean().backward()


REQUEST = torch.linspace(-2.0, 2.0, 4 * 32).reshape(4, 32)


def state_of(model: nn.Module) -> list[torch.Tensor]:
    """Every layer's ledgers and tallies, then its buffers (copies)."""
    out = []
    for layer in layers(model):
        out += [t for op in layer.scaling.operands.values() for t in (op.ledger, op.tally)]
        out += list(layer.buffers())  # the frozen weight and its step, the meta record
    return [t.clone() for t in out]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def answer(model: nn.Module) -> torch.Tensor:
    out: torch.Tensor = model(REQUEST)
    return out.detach()


def _safetensors(model: nn.Module, ctx: ComputeCtx, path: pathlib.Path) -> nn.Module:
    save_file(model.state_dict(), str(path / "served.safetensors"))
    fresh = frozen(mlp(ctx, seed=9))  # other weights, frozen: everything comes from the file
    fresh.load_state_dict(load_file(str(path / "served.safetensors")))
    return fresh


def _weights(model: nn.Module, ctx: ComputeCtx, path: pathlib.Path) -> nn.Module:
    saved = save_weights(model, path / "served-weights.safetensors")
    fresh = frozen(mlp(ctx, seed=9))
    load_weights(fresh, saved, ctx)
    return fresh


@pytest.mark.parametrize("reload", [_safetensors, _weights], ids=["state_dict", "load_weights"])
@pytest.mark.parametrize(
    ("policy", "trained"),
    [
        ("hybrid/delayed/16/0/max", True),  # static input steps, from training
        ("hybrid/delayed/16/0/max", False),  # never seeded: each request's own amax
        ("hybrid/dynamic/0", True),  # dynamic: each request's own amax
        ("e4m3/row/dynamic/0", True),  # frozen per row
        ("hybrid/block/dynamic/0", True),  # frozen per 128x128 block
    ],
)
def test_a_frozen_model_answers_each_request_alone_before_and_after_a_reload(
    policy: str,
    trained: bool,
    reload: Callable[[nn.Module, ComputeCtx, pathlib.Path], nn.Module],
    tmp_path: pathlib.Path,
) -> None:
    ctx = ctx_of(policy)
    model = mlp(ctx)
    if trained:
        train(model)
    model = frozen(model)
    assert model.training and torch.is_grad_enabled()  # the mode in which training records
    first = answer(model)
    state = state_of(model)
    burst = (100 * REQUEST).requires_grad_(True)
    for _ in range(3):
        model(burst).float().sum().backward()  # 100x inputs, gradients flowing
    with torch.no_grad():
        model(100 * REQUEST)
    model.eval()
    with torch.inference_mode():
        model(100 * REQUEST)
    model.train()
    assert torch.equal(answer(model), first)
    assert same(state_of(model), state)  # nothing recorded
    reloaded = reload(model, ctx, tmp_path)
    assert torch.equal(answer(reloaded), first)
    assert same(state_of(reloaded), state)  # the input steps travel with the weights
    with torch.inference_mode():
        assert torch.equal(reloaded(REQUEST), first)


def test_the_static_input_step_is_the_one_training_left() -> None:
    ctx = ctx_of("hybrid/delayed/16/0/max")
    model = mlp(ctx)
    train(model)
    steps = [layer.scaling.input.ledger.clone() for layer in layers(model)]
    frozen(model)
    model(100 * REQUEST)
    assert all(
        torch.equal(layer.scaling.input.ledger, s)
        for layer, s in zip(layers(model), steps, strict=True)
    )


# ----- item 5: meta-device construction -------------------------------------------------


def test_fp8_layers_build_on_meta_and_materialise_fresh() -> None:
    ctx = ctx_of("hybrid/delayed/4/0/max")
    with torch.device("meta"):
        direct = QuantizedLinear(32, 64, ctx=ctx)
        plain = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    report = convert_to_quantized(plain, ctx, module_filter=lambda module, fqn: True)
    assert report.converted == ("0", "2")
    for model in (direct, plain):
        assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
        model.to_empty(device="cpu")
        assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    fresh = dict(QuantizedLinear(32, 64, ctx=ctx).named_buffers())
    assert all(torch.equal(t, fresh[k]) for k, t in direct.named_buffers())
    assert torch.equal(direct.scaling.input.ledger, ledger_new(4, "cpu"))
    # Parameter initialisation after to_empty: the same model as one built on the CPU.
    torch.manual_seed(0)
    for m in plain.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()
    twin = mlp(ctx)
    train(plain)
    train(twin)
    assert torch.equal(answer(plain), answer(twin))
    for a, b in zip(layers(plain), layers(twin), strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a.buffers(), b.buffers(), strict=True))


def test_a_meta_layer_loads_a_checkpoint_with_assign_and_reset_parameters_starts_fresh() -> None:
    ctx = ctx_of("hybrid/delayed/4/0/max")
    trained = mlp(ctx)
    train(trained)
    with torch.device("meta"):
        model = nn.Sequential(
            QuantizedLinear(32, 64, ctx=ctx), nn.ReLU(), QuantizedLinear(64, 32, ctx=ctx)
        )
    model.load_state_dict(trained.state_dict(), assign=True)
    assert torch.equal(answer(model), answer(trained))
    layer = layers(model)[0]
    assert layer.scaling.input.seeded
    layer.reset_parameters()
    assert not layer.scaling.input.seeded and layer.scaling.input.elements == 0
