"""Weight residency: where a model's weights live, and how ``AUTO`` becomes a placement; the
package's one device parser (``parse_device``) and the policy's device field type."""

from __future__ import annotations

import enum
import os
from typing import Annotated

import torch
from pydantic import PlainSerializer, PlainValidator, WithJsonSchema

__all__ = ["Residency", "TorchDevice", "available_bytes", "parse_device"]

_DEVICE_SPELLINGS = "'cpu', 'cuda', 'cuda:N', 'mps', 'xpu:N' or a torch.device"


def parse_device(value: object) -> torch.device:
    """A ``torch.device`` from a device string or a ``torch.device``; ``ValueError`` otherwise."""
    if isinstance(value, torch.device):
        return value
    if isinstance(value, str):
        try:
            # Device names are case-insensitive like every name in the policy ("CPU", "Cuda:0").
            return torch.device(value.strip().lower())
        except RuntimeError:
            pass
    raise ValueError(f"bad device {value!r}; accepted: {_DEVICE_SPELLINGS}")


TorchDevice = Annotated[
    torch.device,
    PlainValidator(parse_device),
    PlainSerializer(str, return_type=str),
    WithJsonSchema({"type": "string", "examples": ["cpu", "cuda:0"]}),
]
"""A ``torch.device`` field (``ComputeCtx.device``) that reads device strings and serializes
as its string form."""


class Residency(enum.Enum):
    """Where weights live; orthogonal to dtype.

    ``DEVICE`` materialises every weight on the compute device (fastest; the model must
    fit). ``MMAP`` keeps weights memory-mapped from the checkpoint and lets pages fault in
    on access (runs models larger than the free memory). ``AUTO`` is the minimal placement
    that works: ``DEVICE`` when the model fits the available bytes, ``MMAP`` otherwise.
    """

    DEVICE = "device"
    MMAP = "mmap"
    AUTO = "auto"

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return f"Residency.{self.name}"

    @classmethod
    def parse(cls, value: Residency | str) -> Residency:
        """Read ``"device"``, ``"mmap"`` or ``"auto"`` (case-insensitive)."""
        if isinstance(value, Residency):
            return value
        if isinstance(value, str):
            key = value.strip().lower()
            for member in Residency:
                if member.value == key:
                    return member
        raise ValueError(
            f"unknown residency {value!r}; accepted: " + ", ".join(repr(m.value) for m in Residency)
        )

    def resolve(self, model_bytes: int, available_bytes: int) -> Residency:
        """The concrete placement: ``AUTO`` gives ``DEVICE`` when ``model_bytes <=
        available_bytes`` (an exact fit fits) and ``MMAP`` otherwise; ``DEVICE`` and
        ``MMAP`` pass through. Sizes must be non-negative integers."""
        _check_size("model_bytes", model_bytes)
        _check_size("available_bytes", available_bytes)
        if self is not Residency.AUTO:
            return self
        return Residency.DEVICE if model_bytes <= available_bytes else Residency.MMAP

    def resolve_on(self, model_bytes: int, device: torch.device | str) -> Residency:
        """``resolve`` against the bytes measured free on ``device`` right now."""
        _check_size("model_bytes", model_bytes)
        if self is not Residency.AUTO:
            return self
        return self.resolve(model_bytes, available_bytes(device))


def _check_size(name: str, value: int) -> None:
    # bool is an int subclass; True bytes is a bug at the call site, not a size.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int byte count, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0 bytes, got {value}")


def available_bytes(device: torch.device | str) -> int:
    """Bytes that can be allocated on ``device`` now.

    CUDA: the driver's free device memory (``torch.cuda.mem_get_info``). CPU: the kernel's
    ``MemAvailable`` estimate (free memory plus reclaimable page cache), falling back to free
    physical pages where ``/proc/meminfo`` does not exist.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free)
    if dev.type == "cpu":
        return _cpu_available_bytes()
    raise ValueError(
        f"cannot measure free memory on device {str(dev)!r}; supported device types: 'cpu', 'cuda'"
    )


def _cpu_available_bytes() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the kernel reports kB
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
