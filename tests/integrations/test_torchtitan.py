"""torchtitan (docs/integrations.md): its llama3 debug model built with
``Fp8LinearConverter`` on the CPU, forward and backward in one process.

Stock torchtitan cannot train on a CPU (FlexAttention has no CPU backward), so the test
swaps the inner attention's config for torch's SDPA before the build; nothing else changes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip(
    "torchtitan", reason="torchtitan is in the optional extra: pip install -e '.[integrations]'"
)

from torchtitan.models.common.attention import (
    FlexAttention,
    ScaledDotProductAttention,
)
from torchtitan.models.llama3 import model_registry

from computectx import ComputeCtx
from computectx.formats import QuantizedLinear
from computectx.integrations.torchtitan import (
    Fp8LinearConverter,
    Fp8TitanLinear,
    fp8_parallelize_fn,
    fp8_post_optimizer_build_fn,
)

from .conftest import torchrun


def _build(converters: list[Any]) -> torch.nn.Module:
    spec = model_registry("debugmodel", converters=converters)
    for _fqn, _cfg, parent, attr in list(spec.model.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())  # CPU backward
    with torch.device("meta"):
        model: torch.nn.Module = spec.model.build()
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_states(buffer_device=torch.device("cpu"))  # type: ignore[operator]
    return model


def test_the_llama3_debug_model_trains_in_fp8_on_the_cpu() -> None:
    converter = Fp8LinearConverter.Config(policy="fp8_hybrid", device="cpu")
    model = _build([converter])
    plain = _build([])
    fp8 = {n for n, m in model.named_modules() if isinstance(m, Fp8TitanLinear)}
    # Every linear of the 6 blocks (fused qkv, wo, w1, w2, w3); the output head stays.
    assert len(fp8) == 30 and "lm_head" not in fp8
    layer = model.get_submodule("layers.0.feed_forward.w1")
    assert isinstance(layer, QuantizedLinear)
    assert str(layer.ctx) == str(ComputeCtx.from_flag("fp8_hybrid", "cpu"))
    assert all(op.seeded is False for op in layer.scaling.operands.values())  # fresh, not meta

    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(1))
    logits = model(tokens)
    want = plain(tokens)
    assert logits.shape == (2, 32, 2048)
    # The same weights (same seed, same init), within the fp8 error of 30 quantized GEMMs.
    rel = ((logits.float() - want.float()).norm() / want.float().norm()).detach()
    assert float(rel) < 0.1, float(rel)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
    loss.backward()  # type: ignore[no-untyped-call]
    for name, p in model.named_parameters():
        assert p.grad is not None and bool(torch.isfinite(p.grad).all()), name
    for op in layer.scaling.operands.values():
        assert op.seeded and op.elements > 0  # input, weight and the output gradient


def test_the_hooks_do_nothing_in_one_process() -> None:
    class Dims:
        def get_optional_mesh(self, name: str) -> None:
            return None

    model = torch.nn.Linear(16, 16)
    calls = []

    def base(m: torch.nn.Module, *, parallel_dims: Any, **kwargs: Any) -> torch.nn.Module:
        calls.append(kwargs)
        return m

    assert fp8_parallelize_fn(base)(model, parallel_dims=Dims(), training=None) is model
    assert calls == [{"training": None}]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fp8_post_optimizer_build_fn(opt, [model], Dims())  # no sync attached: no hook
    assert not opt._optimizer_step_post_hooks


def test_the_parallelize_hook_normalizes_the_loss_as_torchtitan_does(tmp_path: Path) -> None:
    # torchtitan divides each rank's summed loss by the global token count and sums the
    # ranks' gradients, so a rank's output gradients are the whole batch's at any world size.
    # The hook's sync says so ("global"): a checkpoint recorded in one process loads on 2
    # ranks with its gradient ledgers as they are, and the next step's scaling state is
    # one process's on the whole batch, exactly. Under "per_rank" (the sync's own default,
    # which the hook used) the loaded gradient ledgers were doubled.
    for r in torchrun("torchtitan_worker.py", 2, tmp_path):
        assert r["world"] == 2 and r["default_normalization"] == "global"
        assert r["per_rank_normalization"] == "per_rank"
        for key, want in r["one"].items():
            assert torch.equal(r["default"][key], want), key
        grad = "0.grad.history"
        assert torch.equal(r["per_rank"][grad][:-1], 2 * r["one"][grad][:-1])  # the loaded slots
        for name, w in r["one_weights"].items():  # the gradients' sums in another order
            torch.testing.assert_close(r["default_weights"][name], w, rtol=1e-5, atol=1e-7)
