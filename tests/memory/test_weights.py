"""save_weights / load_weights: residency placement, real memory maps, and bad checkpoints
that leave the model untouched."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

from computectx import ComputeCtx, Residency
from computectx.formats import QuantizedLinear
from computectx.memory import load_weights, save_weights
from computectx.memory.weights import LoadReport
from computectx.nn import ByteLM, LMConfig


def net(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 8)
    )


def ctx(residency: str) -> ComputeCtx:
    return ComputeCtx.parity("cpu").replace(residency=Residency.parse(residency))


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(model: torch.nn.Module, snap: dict[str, torch.Tensor]) -> bool:
    sd = model.state_dict()
    return sd.keys() == snap.keys() and all(torch.equal(sd[k], snap[k]) for k in snap)


def weight(model: torch.nn.Sequential, i: int) -> torch.Tensor:
    w = model[i].weight
    assert isinstance(w, torch.Tensor)
    return w


def file_mapping_of(t: torch.Tensor) -> str | None:
    """The path of the file mapping that contains ``t``'s data, or None (anonymous)."""
    ptr = t.untyped_storage().data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= ptr < hi:
                return fields[5] if len(fields) > 5 and fields[5].startswith("/") else None
    return None


@pytest.fixture
def checkpoint(tmp_path: pathlib.Path) -> tuple[pathlib.Path, dict[str, torch.Tensor]]:
    src = net(1)
    bn = src[1]
    assert isinstance(bn, torch.nn.BatchNorm1d) and bn.running_mean is not None
    bn.running_mean.add_(3.0)  # a buffer with a non-default value
    path = save_weights(src, tmp_path / "w.safetensors")
    return path, snapshot(src)


def test_device_residency_materialises_an_owned_copy(
    checkpoint: tuple[pathlib.Path, dict[str, torch.Tensor]],
) -> None:
    path, expected = checkpoint
    model = net(2)
    w0 = weight(model, 0)
    report = load_weights(model, path, ctx("device"))
    assert same(model, expected)
    assert weight(model, 0) is w0  # the Parameter object survives (optimizers keep it)
    assert report.chosen is Residency.DEVICE and report.requested is Residency.DEVICE
    assert report.available_bytes is None and "requested by ctx.residency" in report.reason
    for t in model.state_dict().values():
        assert file_mapping_of(t) is None  # anonymous memory, not the file
    path.unlink()  # the model no longer needs the file
    assert same(model, expected)


def test_mmap_residency_keeps_tensors_in_a_private_map_of_the_file(
    checkpoint: tuple[pathlib.Path, dict[str, torch.Tensor]],
) -> None:
    path, expected = checkpoint
    model = net(2)
    report = load_weights(model, path, ctx("mmap"))
    assert report.chosen is Residency.MMAP and report.device == torch.device("cpu")
    assert "memory map" in report.reason
    assert same(model, expected)
    for name, t in model.state_dict().items():
        assert file_mapping_of(t) == str(path.resolve()), name
    # Copy-on-write: training the mapped weights never writes the checkpoint.
    before = path.read_bytes()
    with torch.no_grad():
        weight(model, 0).add_(1.0)
    assert path.read_bytes() == before


def test_auto_reports_its_choice_and_why(
    checkpoint: tuple[pathlib.Path, dict[str, torch.Tensor]],
) -> None:
    path, expected = checkpoint
    model = net(2)
    report = load_weights(model, path, ctx("auto"))
    assert isinstance(report, LoadReport)
    assert report.requested is Residency.AUTO and report.chosen is Residency.DEVICE
    assert report.available_bytes is not None and report.available_bytes > 0
    total = sum(t.numel() * t.element_size() for t in expected.values())
    assert report.checkpoint_bytes == total
    assert re.search(rf"auto -> device: .*{total:,} tensor bytes fits in", str(report))
    assert report.tensors == len(expected)
    # With everything reserved, the checkpoint no longer fits: memory map instead. (A GiB
    # beyond what was free a moment ago: other processes may free memory in between.)
    model2 = net(3)
    reserve = report.available_bytes + 2**30
    report2 = load_weights(model2, path, ctx("auto"), reserve_bytes=reserve)
    assert report2.chosen is Residency.MMAP
    assert "exceeds the 0 bytes free" in report2.reason
    assert same(model2, expected)
    assert file_mapping_of(weight(model2, 0)) == str(path.resolve())


def test_tied_weights_are_stored_once_and_stay_tied(tmp_path: pathlib.Path) -> None:
    def tied(seed: int) -> torch.nn.Sequential:
        torch.manual_seed(seed)
        emb = torch.nn.Embedding(20, 8)
        head = torch.nn.Linear(8, 20, bias=False)
        head.weight = emb.weight
        return torch.nn.Sequential(emb, head)

    src = tied(0)
    path = save_weights(src, tmp_path / "tied.safetensors")
    model = tied(1)
    load_weights(model, path, ctx("device"))
    assert weight(model, 0) is weight(model, 1)
    assert torch.equal(weight(model, 0), weight(src, 0))
    # An untied model reading a tied checkpoint gets the same values in both places.
    torch.manual_seed(2)
    untied = torch.nn.Sequential(torch.nn.Embedding(20, 8), torch.nn.Linear(8, 20, bias=False))
    load_weights(untied, path, ctx("device"))
    assert torch.equal(weight(untied, 1), weight(src, 0))
    assert weight(untied, 0).data_ptr() != weight(untied, 1).data_ptr()  # still untied


def test_fp8_model_round_trips_its_weights_and_its_scaling_state(
    tmp_path: pathlib.Path,
) -> None:
    # QuantizedLinear's scaling state is buffers (ledgers, tallies, fp8_meta): tensors, stored and
    # loaded with the weights.
    fp8 = ComputeCtx.from_flag("fp8_e4m3", "cpu")
    config = LMConfig(d_model=32, n_heads=1, d_ff=32, n_layers=1, max_len=16)
    torch.manual_seed(0)
    src = ByteLM(fp8, config)
    layers = [m for m in src.modules() if isinstance(m, QuantizedLinear)]
    assert layers
    for m in layers:
        m.scaling.input.seeded = True  # a state the fresh model does not have
    path = save_weights(src, tmp_path / "fp8.safetensors")
    torch.manual_seed(1)
    model = ByteLM(fp8, config)
    report = load_weights(model, path, ctx("device"))
    assert "extra-state" not in report.reason
    assert report.tensors == len(src.state_dict())
    for (name, a), b in zip(src.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


# ----- bad input: clear errors, model unchanged ----------------------------------------


def test_missing_file(tmp_path: pathlib.Path) -> None:
    model = net(2)
    snap = snapshot(model)
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        load_weights(model, missing, ctx("device"))
    assert same(model, snap)


def _expect_unchanged(model: torch.nn.Module, path: pathlib.Path, pattern: str) -> None:
    snap = snapshot(model)
    for residency in ("device", "mmap", "auto"):
        with pytest.raises(ValueError, match=pattern) as info:
            load_weights(model, path, ctx(residency))
        assert str(path) in str(info.value)
        assert same(model, snap)


def test_wrong_shapes_name_the_keys(tmp_path: pathlib.Path) -> None:
    src = torch.nn.Sequential(
        torch.nn.Linear(32, 65), torch.nn.BatchNorm1d(65), torch.nn.Linear(65, 8)
    )
    path = save_weights(src, tmp_path / "w.safetensors")
    _expect_unchanged(
        net(2), path, r"'0\.weight': checkpoint float32\[65, 32\] vs model float32\[64, 32\]"
    )


def test_wrong_dtype_is_not_cast_silently(tmp_path: pathlib.Path) -> None:
    path = save_weights(net(1).to(torch.bfloat16), tmp_path / "w.safetensors")
    _expect_unchanged(net(2), path, r"'0\.weight': checkpoint bfloat16\[64, 32\] vs model float32")


def test_missing_and_unexpected_keys_are_listed(tmp_path: pathlib.Path) -> None:
    src = net(1)
    path_missing = save_weights(src[:2], tmp_path / "short.safetensors")
    _expect_unchanged(net(2), path_missing, r"missing keys \['2\.bias', '2\.weight'\]")
    bigger = torch.nn.Sequential(*net(1), torch.nn.Linear(8, 2))
    path_extra = save_weights(bigger, tmp_path / "long.safetensors")
    _expect_unchanged(net(2), path_extra, r"unexpected keys \['3\.bias', '3\.weight'\]")


def test_truncated_and_corrupt_files(
    checkpoint: tuple[pathlib.Path, dict[str, torch.Tensor]], tmp_path: pathlib.Path
) -> None:
    path, _ = checkpoint
    data = path.read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[:-50])
    _expect_unchanged(net(2), truncated, "not a valid safetensors file")
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}" + data[100:])
    _expect_unchanged(net(2), corrupt, "not a valid safetensors file")
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    _expect_unchanged(net(2), empty, "not a valid safetensors file")


def test_bad_arguments(tmp_path: pathlib.Path) -> None:
    with pytest.raises(TypeError, match=r"nn\.Module"):
        save_weights({"w": torch.zeros(1)}, tmp_path / "x.safetensors")  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError, match="no such directory"):
        save_weights(net(0), tmp_path / "missing" / "x.safetensors")
    path = save_weights(net(0), tmp_path / "x.safetensors")
    with pytest.raises(TypeError, match="ComputeCtx"):
        load_weights(net(0), path, "cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reserve_bytes"):
        load_weights(net(0), path, ctx("auto"), reserve_bytes=-1)
    assert not list(tmp_path.glob("*.computectx-tmp"))  # no temporary files left behind


@pytest.mark.parametrize("flag", ["nvfp4", "mxfp4"])
def test_frozen_4bit_model_round_trips_its_packed_codes_and_scales(
    tmp_path: pathlib.Path, flag: str
) -> None:
    # safetensors counts an F4 tensor in 4-bit elements, torch in bytes: the header's last
    # dimension is twice the tensor's, and an E8M0 scale is a dtype of its own.
    from computectx.formats import convert_to_quantized, freeze_fp4_for_serving

    def frozen(seed: int) -> torch.nn.Sequential:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32)
        )
        ctx = ComputeCtx.from_flag(flag, "cpu")
        convert_to_quantized(model, ctx, module_filter=lambda m, f: True)
        freeze_fp4_for_serving(model, "w4a4")
        return model

    source, target = frozen(0), frozen(1)
    path = save_weights(source, tmp_path / "w.safetensors")
    load_weights(target, path, ComputeCtx.from_flag(flag, "cpu"))
    for (name, a), (_, b) in zip(
        source.state_dict().items(), target.state_dict().items(), strict=True
    ):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(source(x).view(torch.int16), target(x).view(torch.int16))
    # The frozen layers' [version, weight code] went to set_extra_state (a check), not into a
    # stray attribute holding a view of the file.
    assert not any("_extra_state" in vars(m) for m in target.modules())


class Counted(torch.nn.Module):
    """A module whose extra state is a tensor it installs in ``set_extra_state``."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.count = count

    def get_extra_state(self) -> torch.Tensor:
        return torch.tensor([self.count])

    def set_extra_state(self, state: torch.Tensor) -> None:
        if int(state[0]) < 0:
            raise ValueError("a negative count")
        self.count = int(state[0])


def test_tensor_extra_state_is_handed_to_set_extra_state(tmp_path: pathlib.Path) -> None:
    path = save_weights(Counted(7), tmp_path / "c.safetensors")
    target = Counted(0)
    load_weights(target, path, ctx("device"))
    assert target.count == 7 and "_extra_state" not in vars(target)
    # One it refuses raises before any weight is replaced.
    bad = Counted(-1)
    bad_path = save_weights(bad, tmp_path / "bad.safetensors")
    before = snapshot(target)
    with pytest.raises(ValueError, match="a negative count"):
        load_weights(target, bad_path, ctx("device"))
    assert same(target, before) and target.count == 7


def test_a_meta_skeleton_is_refused_before_anything_and_loads_once_materialised(
    tmp_path: pathlib.Path,
) -> None:
    path = save_weights(net(0), tmp_path / "w.safetensors")
    skeleton = net(1).to("meta")
    with pytest.raises(ValueError, match=r"on the meta device; .*to_empty\(device=\.\.\.\) first"):
        load_weights(skeleton, path, ctx("device"))
    assert all(t.is_meta for t in skeleton.state_dict().values())
    skeleton.to_empty(device="cpu")
    load_weights(skeleton, path, ctx("device"))
    assert same(skeleton, snapshot(net(0)))
