"""Expert residency: an MoE checkpoint loaded with ``Residency.MMAP`` keeps its experts mapped,
and decoding pages in only the experts its tokens select.

The measure is this process's resident pages of each expert's slices (``/proc/self/pagemap``,
what ``/proc/self/smaps`` counts as ``Rss``). The checkpoint is dropped from the page cache
after it is written (``posix_fadvise(DONTNEED)``), as a checkpoint that was not just written
would be: pages the writer left in the cache can be large folios, and a fault maps a whole
folio, neighbouring experts included. Each expert is 1.5 MiB (16 of them): what the kernel
maps besides the chosen experts (fault-around, 64 KiB windows next to each one, and next to
the header) then comes to 1.14x the chosen experts' bytes here, under the 1.25x bound.
"""

from __future__ import annotations

import mmap
import os
import pathlib
import sys

import pytest
import torch

from computectx import ComputeCtx, DType, Residency, available_bytes
from computectx.memory import load_weights, save_weights
from computectx.memory.expert_residency import (
    ExpertResidency,
    expert_residency,
    experts_of,
    prefetch_experts,
    resident_bytes,
)
from computectx.nn.gemm import GemmPath, forced_gemm_path
from computectx.nn.moe import MoE
from computectx.nn.params import param_dtype
from computectx.recipes import Recipe

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not os.access("/proc/self/pagemap", os.R_OK),
    reason="residency is read from /proc/self/pagemap, which only Linux has",
)

E, DIM, HIDDEN = 16, 128, 1024  # one float32 expert: (2 * 1024 + 1024) * 128 * 4 B = 1.5 MiB
EXPERT_BYTES = 3 * HIDDEN * DIM * 4
CHOSEN = (3, 11)
BOUND = 1.25


def moe(ctx: ComputeCtx, seed: int) -> MoE:
    # 1.5 MiB experts at any parameter width: float32 at HIDDEN, bf16 at twice HIDDEN.
    hidden = HIDDEN * 4 // param_dtype(ctx).itemsize
    torch.manual_seed(seed)
    return MoE(ctx, DIM, hidden, E, top_k=2, balance="none").eval()


def save_routed(ctx: ComputeCtx, path: pathlib.Path) -> tuple[pathlib.Path, MoE]:
    """An MoE whose selection bias sends every token to ``CHOSEN`` (routing weights
    unchanged), saved to ``path``."""
    src = moe(ctx, 0)
    with torch.no_grad():
        src.router.bias.fill_(-1e4)
        src.router.bias[list(CHOSEN)] = 1e4
    return save_weights(src, path), src


@pytest.fixture(scope="module")
def f32_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, MoE]:
    """float32 parameters: what the parity, serving and fp8 blocks all store."""
    return save_routed(ComputeCtx.parity("cpu"), tmp_path_factory.mktemp("moe") / "moe.st")


def drop_from_page_cache(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def load_mapped(path: pathlib.Path, ctx: ComputeCtx) -> MoE:
    """A block loaded from ``path`` (dropped from the page cache first) with ``MMAP``."""
    drop_from_page_cache(path)
    mapped = ctx.replace(residency=Residency.MMAP)
    dst = moe(mapped, 1)
    assert load_weights(dst, path, mapped).chosen is Residency.MMAP
    (before,) = expert_residency(dst)
    assert before.mapped == {n: str(path.resolve()) for n in ("gate_up", "down")}
    # Nothing of the experts read yet: only what the kernel's fault-around (64 KiB windows)
    # mapped next to the header and the small tensors read through the same mapping.
    assert before.resident_total <= 256 * 1024, str(before)
    return dst


def decode(block: MoE, steps: int = 4) -> list[torch.Tensor]:
    torch.manual_seed(5)
    with torch.no_grad():
        return [block(torch.randn(1, 1, DIM)) for _ in range(steps)]


def assert_only_chosen_resident(block: MoE) -> ExpertResidency:
    assert block.last_load.nonzero().flatten().tolist() == list(CHOSEN)
    (r,) = expert_residency(block)
    assert r.experts == E and r.expert_bytes == EXPERT_BYTES
    for e in CHOSEN:  # the chosen experts were read, whole
        assert r.resident[e] >= r.expert_bytes, (e, r.resident[e])
    kib = [b // 1024 for b in r.resident]
    assert r.resident_total <= BOUND * len(CHOSEN) * r.expert_bytes, f"{r}; KiB per expert {kib}"
    return r


def test_mmap_decode_pages_in_only_the_chosen_experts(
    f32_checkpoint: tuple[pathlib.Path, MoE],
) -> None:
    path, src = f32_checkpoint
    dst = load_mapped(path, ComputeCtx.parity("cpu"))
    ys = decode(dst)
    assert_only_chosen_resident(dst)
    for y, ref in zip(ys, decode(src), strict=True):
        # The mapped weights are not 64-byte aligned (safetensors packs tensors after its
        # header), so the GEMM may sum in another order: float32 rounding apart.
        assert torch.allclose(y, ref, rtol=1e-5, atol=1e-6)
    # The meter sees a forward that reads every expert: route to all of them.
    with torch.no_grad():
        dst.router.bias.zero_()
        dst(torch.randn(64, DIM))
    assert int((dst.last_load > 0).sum()) == E
    (r,) = expert_residency(dst)
    assert r.resident_total >= 0.99 * E * r.expert_bytes, str(r)


def test_fp8_experts_quantize_only_the_chosen_experts(
    f32_checkpoint: tuple[pathlib.Path, MoE],
) -> None:
    # quantized_grouped_mm quantizes each expert's weight on its own, and never an empty group's.
    dst = load_mapped(
        f32_checkpoint[0], ComputeCtx.serving("cpu").replace(recipe=Recipe(granularity="block"))
    )
    assert dst.experts.fp8 is not None
    decode(dst, steps=1)
    assert_only_chosen_resident(dst)


def test_compute_dtype_experts_on_a_native_gemm_read_only_the_chosen(
    tmp_path: pathlib.Path,
) -> None:
    # Experts stored at the compute dtype (bf16 parameters: master=BF16) and a native bf16
    # grouped GEMM: no cast of the weights at all.
    ctx = ComputeCtx.serving("cpu").replace(master=DType.BF16)
    with forced_gemm_path(GemmPath.NATIVE):
        path, _ = save_routed(ctx, tmp_path / "bf16.st")
        dst = load_mapped(path, ctx)
        assert dst.experts.gate_up.dtype == torch.bfloat16
        decode(dst, steps=1)
    assert_only_chosen_resident(dst)


def test_a_cast_of_the_expert_weights_reads_only_the_chosen(
    f32_checkpoint: tuple[pathlib.Path, MoE],
) -> None:
    # The serving policy computes in bf16 from float32 parameters.
    dst = load_mapped(f32_checkpoint[0], ComputeCtx.serving("cpu"))
    decode(dst, steps=1)
    assert_only_chosen_resident(dst)


def test_auto_maps_the_experts_when_they_do_not_fit(
    f32_checkpoint: tuple[pathlib.Path, MoE],
) -> None:
    path = f32_checkpoint[0]
    drop_from_page_cache(path)
    ctx = ComputeCtx.parity("cpu").replace(residency=Residency.AUTO)
    dst = moe(ctx, 1)
    # A budget smaller than the experts: every free byte reserved, and a GiB more (other
    # processes may free memory in between).
    report = load_weights(dst, path, ctx, reserve_bytes=available_bytes("cpu") + 2**30)
    assert report.requested is Residency.AUTO and report.chosen is Residency.MMAP
    expert_bytes = sum(t.numel() * t.element_size() for t in experts_of(dst)["experts"].values())
    assert report.checkpoint_bytes > expert_bytes == E * EXPERT_BYTES
    assert "exceeds the 0 bytes free" in report.reason
    (r,) = expert_residency(dst)
    assert set(r.mapped) == {"gate_up", "down"}
    decode(dst, steps=2)
    assert_only_chosen_resident(dst)
    # With room for everything, AUTO materialises the experts instead (anonymous memory).
    dst2 = moe(ctx, 2)
    assert load_weights(dst2, path, ctx).chosen is Residency.DEVICE
    (r2,) = expert_residency(dst2)
    assert r2.mapped == {}


class _Stacked(torch.nn.Module):
    def __init__(self, shapes: tuple[tuple[int, ...], ...]) -> None:
        super().__init__()
        for i, s in enumerate(shapes):
            self.register_parameter(f"w{i}", torch.nn.Parameter(torch.zeros(s)))


class _Seam(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4, 2, 2))

    def expert_weights(self) -> dict[str, torch.Tensor]:
        return {"w": self.w}


def test_experts_of_finds_grouped_experts_and_nothing_else() -> None:
    model = torch.nn.ModuleDict(
        {
            "moe": moe(ComputeCtx.parity("cpu"), 0),
            "titan": _Stacked(((4, 8, 2), (4, 2, 8), (4, 8, 2))),  # torchtitan's w1, w2, w3
            "conv": torch.nn.Conv1d(2, 4, 3),  # one 3-D weight: not experts
            "ragged": _Stacked(((4, 2, 2), (5, 2, 2))),  # no common expert count
            "seam": _Seam(),
        }
    )
    found = experts_of(model)
    assert sorted(found) == ["moe.experts", "seam", "titan"]
    assert sorted(found["moe.experts"]) == ["down", "gate_up"]
    assert sorted(found["titan"]) == ["w0", "w1", "w2"]


def test_resident_bytes_counts_touched_pages() -> None:
    page = mmap.PAGESIZE
    region = mmap.mmap(-1, 64 * page)  # a fresh anonymous mapping: no page touched yet
    t = torch.frombuffer(region, dtype=torch.float32)
    assert resident_bytes(t) == 0
    t[: page // 4 * 8].fill_(1.0)  # 8 pages written
    assert resident_bytes(t) == 8 * page
    assert resident_bytes(t[page // 4 * 8 :]) == 0
    t.fill_(1.0)
    assert resident_bytes(t) == 64 * page
    assert resident_bytes(t[::2]) == 64 * page  # strided: the span it covers
    assert resident_bytes(t[:0]) == 0
    del t
    region.close()
    with pytest.raises(ValueError, match="host memory"):
        resident_bytes(torch.empty(4, device="meta"))


def test_prefetch_experts_advises_only_the_chosen(
    f32_checkpoint: tuple[pathlib.Path, MoE],
) -> None:
    dst = load_mapped(f32_checkpoint[0], ComputeCtx.parity("cpu"))
    weights = list(experts_of(dst)["experts"].values())
    counts = torch.zeros(E, dtype=torch.int64)
    counts[list(CHOSEN)] = 1
    asked = prefetch_experts(weights, counts)
    page = mmap.PAGESIZE
    # The chosen experts' slices, each rounded out to whole pages.
    chosen = len(CHOSEN) * EXPERT_BYTES
    assert chosen <= asked <= chosen + len(CHOSEN) * len(weights) * 2 * page
    assert prefetch_experts(weights, torch.zeros(E, dtype=torch.int64)) == 0
    assert prefetch_experts([torch.zeros(E, 4, 4, device="meta")], counts) == 0
    # Advice reads into the page cache; it maps nothing into the process.
    (r,) = expert_residency(dst)
    assert r.resident_total < 0.1 * EXPERT_BYTES
