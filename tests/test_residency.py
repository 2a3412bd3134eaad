"""Residency parsing, resolution and the free-memory measurement it resolves against."""

from __future__ import annotations

import pytest
import torch

from computectx import Residency, available_bytes


def test_the_rust_resolution_table() -> None:
    assert Residency.AUTO.resolve(80, 100) is Residency.DEVICE
    assert Residency.AUTO.resolve(120, 100) is Residency.MMAP
    assert Residency.AUTO.resolve(100, 100) is Residency.DEVICE  # an exact fit fits
    assert Residency.DEVICE.resolve(999, 1) is Residency.DEVICE
    assert Residency.MMAP.resolve(1, 999) is Residency.MMAP


@pytest.mark.parametrize("bad", [1.5, True, "10", None])
def test_sizes_must_be_ints(bad: object) -> None:
    with pytest.raises(TypeError, match="model_bytes must be an int byte count"):
        Residency.AUTO.resolve(bad, 10)  # type: ignore[arg-type]


def test_parse_names_and_errors() -> None:
    assert Residency.parse(" MMAP ") is Residency.MMAP
    assert Residency.parse(Residency.AUTO) is Residency.AUTO
    assert str(Residency.DEVICE) == "device"
    with pytest.raises(ValueError, match="unknown residency 'disk'; accepted: 'device', 'mmap'"):
        Residency.parse("disk")


def test_cpu_available_bytes_is_a_plausible_measurement() -> None:
    free = available_bytes("cpu")
    total = _meminfo_kib("MemTotal") * 1024
    assert 0 < free <= total
    assert available_bytes(torch.device("cpu")) > 0


def test_resolve_on_measures_the_device() -> None:
    assert Residency.AUTO.resolve_on(1, "cpu") is Residency.DEVICE
    assert Residency.AUTO.resolve_on(2**62, "cpu") is Residency.MMAP
    assert Residency.MMAP.resolve_on(1, "cpu") is Residency.MMAP
    with pytest.raises(ValueError, match=">= 0 bytes"):
        Residency.DEVICE.resolve_on(-1, "cpu")


def test_unmeasurable_devices_are_refused() -> None:
    with pytest.raises(ValueError, match="cannot measure free memory on device 'meta'"):
        available_bytes("meta")


def _meminfo_kib(key: str) -> int:
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith(f"{key}:"):
                return int(line.split()[1])
    raise AssertionError(f"{key} missing from /proc/meminfo")
