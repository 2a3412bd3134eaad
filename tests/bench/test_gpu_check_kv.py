"""bench/gpu_check_kv.py imports without CUDA, accounts its bytes, and runs its CPU smoke."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gpu_check_kv as KV  # noqa: N812
import pytest
import torch

from computectx import Fp8Format
from computectx.formats.numerics.kv_quant import quantize_kv

ROOT = Path(__file__).resolve().parents[2]
PATH = ROOT / "bench" / "gpu_check_kv.py"


def test_imports_with_cuda_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    # A fresh copy of the module, loaded and run while torch reports no CUDA device (in this
    # process, which has torch already: a subprocess only imported torch again).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    spec = importlib.util.spec_from_file_location("gpu_check_kv_without_cuda", PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    skipped = module.section_kv_decode(torch.device("cpu"), False, 1)
    assert "no CUDA device" in skipped["skipped"], skipped


@pytest.mark.parametrize("fp8", [True, False])
def test_decode_bytes_is_what_the_call_touches(fp8: bool) -> None:
    # Independently: the bytes of every tensor one decode call reads or writes.
    b, h, t, d = 3, 2, 40, 16
    cache = torch.float8_e4m3fn if fp8 else torch.bfloat16
    tensors = [torch.empty(b, h, t, d, dtype=cache) for _ in range(2)]  # k, v
    if fp8:
        tensors += [torch.empty(b, h, t) for _ in range(2)]  # float32 steps
    tensors += [torch.empty(b, h, d, dtype=torch.bfloat16) for _ in range(2)]  # q, out
    tensors.append(torch.empty(b, dtype=torch.int64))  # length
    assert KV.decode_bytes(b, h, t, d, cache, fp8) == sum(x.nbytes for x in tensors)


def test_fp8_cache_moves_about_half_of_bf16_at_the_gpu_shape() -> None:
    # Per (token, head): 2 x 128 one-byte codes + 2 x 4 step bytes against 2 x 128 x 2 bf16
    # bytes, (128 + 4) / 256 = 0.5156; q, out and lengths are negligible at 32k positions.
    s = KV.GPU_SHAPE
    b, h, d = s["batch"], s["heads"], s["head_dim"]
    fp8 = KV.decode_bytes(b, h, 32768, d, torch.float8_e4m3fn, True)
    bf16 = KV.decode_bytes(b, h, 32768, d, torch.bfloat16, False)
    assert abs(fp8 / bf16 - (128 + 4) / 256) < 1e-4


def test_cpu_smoke_runs_every_variant() -> None:
    rows = KV.section_kv_decode(torch.device("cpu"), True, 1)
    assert isinstance(rows, list)
    contexts = KV.SMOKE_SHAPE["contexts"]
    assert [(r["op"], r["context"]) for r in rows] == [
        (op, t)
        for t in contexts
        for op in ("fp8 e4m3 per_token_head", "bf16 (same kernel)", "bf16 SDPA")
    ]
    for row in rows:
        assert row["us"] > 0 and row["gbps"] > 0, row
        assert row["backend"] == ("torch" if row["op"] == "bf16 SDPA" else "reference")


def test_the_fp8_rows_time_the_caches_own_quantizer(monkeypatch: pytest.MonkeyPatch) -> None:
    # The fp8 cache the bench times is quantize_kv's (per_token_head, E4M3), what a KVCache
    # stores, not a copy of its rule.
    seen: list[tuple[tuple[int, ...], str]] = []

    def spy(
        x: torch.Tensor, fmt: Fp8Format, step: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append((tuple(x.shape), str(fmt)))
        return quantize_kv(x, fmt, step)

    monkeypatch.setattr(KV, "quantize_kv", spy)
    monkeypatch.setitem(KV.SMOKE_SHAPE, "contexts", (32,))
    KV.section_kv_decode(torch.device("cpu"), True, 1)
    s = KV.SMOKE_SHAPE
    shape = (s["batch"], s["heads"], 32, s["head_dim"])
    assert seen == [(shape, "e4m3"), (shape, "e4m3")]
