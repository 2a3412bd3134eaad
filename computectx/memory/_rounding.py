"""Rounding into a ``LowPrecGradAccumulator``'s buffer dtype, and the generators it draws from.

The unit roundoff and subnormal spacing of each buffer dtype (the terms of the error bound,
see ``computectx.memory.accumulator``), the stochastic rounding kernels, and
``RoundingGenerators``: the private random generators of stochastic rounding, one per device
drawn on, seeded from one seed, with their checkpoint (``state_dict``/``load_state_dict``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Literal

import torch

from computectx._checks import as_int
from computectx.dtypes import DType

__all__ = [
    "GENERATOR_PREFIX",
    "SEED",
    "AccumMode",
    "RoundingGenerators",
    "check_seed",
    "draw_key",
    "keyed_bits",
    "stochastic_round",
    "stochastic_round_keyed",
    "subnormal_spacing",
    "unit_roundoff",
]

AccumMode = Literal["nearest", "stochastic"]
"""How each partial sum is rounded into the buffer dtype."""

SEED = "seed"
"""The key of the seed in ``LowPrecGradAccumulator.state_dict()`` (an int64 scalar)."""

GENERATOR_PREFIX = "generator."
"""Keys ``generator.<device>`` hold the state of the generator on that device (uint8)."""

_SIGNIFICAND_BITS: dict[DType, int] = {DType.F16: 11, DType.BF16: 8, DType.F32: 24, DType.F64: 53}


def unit_roundoff(dtype: DType, mode: AccumMode) -> float:
    """The relative error of one rounding into ``dtype`` by ``mode`` (``u`` in the bound)."""
    p = _SIGNIFICAND_BITS[dtype]
    u = 2.0**-p if mode == "nearest" else 2.0 ** (1 - p)
    if p < _SIGNIFICAND_BITS[DType.F32]:
        # 16-bit buffers are updated as round16(fl32(buffer + g)): the f32 sum adds one more
        # relative error of at most 2**-24 before the 16-bit rounding.
        u = u + 2.0**-24 * (1.0 + u)
    return u


def subnormal_spacing(dtype: DType) -> float:
    """The spacing of ``dtype``'s subnormals (``eta`` in the bound)."""
    info = torch.finfo(dtype.torch)
    return float(info.tiny) * float(info.eps)


def stochastic_round(x: torch.Tensor, target: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """``x`` rounded stochastically (unbiased) into ``target``, drawing from ``gen``."""
    if target == torch.bfloat16:
        return _stochastic_round_bf16(x.float(), gen)
    return _stochastic_round_generic(x.float(), target, gen)


def _stochastic_round_bf16(x32: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    # bf16 is the top 16 bits of an f32. Adding a uniform 16-bit integer to the bit pattern
    # and truncating the low half rounds the magnitude up with probability equal to the
    # discarded fraction of an ulp, so E[result] = x (subnormals included, same split).
    bits = x32.contiguous().view(torch.int32)
    noise = torch.randint(
        0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device, generator=gen
    )
    rounded = torch.bitwise_and(bits + noise, -65536).view(torch.float32)
    # inf and NaN bit patterns must not be perturbed (noise would turn inf into NaN).
    return torch.where(torch.isfinite(x32), rounded, x32).to(torch.bfloat16)


def _stochastic_round_generic(
    x32: torch.Tensor, target: torch.dtype, gen: torch.Generator
) -> torch.Tensor:
    # Round to nearest, find the neighbour on the other side of x, and move to it with
    # probability |x - nearest| / |neighbour - nearest| so that E[result] = x.
    near = x32.to(target)
    near32 = near.float()
    away = torch.where(near32 > x32, -math.inf, math.inf).to(target)
    other = torch.nextafter(near, away)
    gap = (other.float() - near32).abs()
    p = (x32 - near32).abs() / gap
    draw = torch.rand(x32.shape, device=x32.device, generator=gen)
    pick = torch.isfinite(x32) & torch.isfinite(p) & (draw < p)
    return torch.where(pick, other, near)


# ----- counter-based stochastic rounding (the optimizer's write-back) ----------------------

_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _i64(value: int) -> int:
    return (value + 2**63) % 2**64 - 2**63


def draw_key(gen: torch.Generator) -> torch.Tensor:
    """One 64-bit key (an int64 scalar on ``gen``'s device) drawn from ``gen``: a step's
    stochastic rounding of one tensor derives all of its random bits from it (``keyed_bits``),
    so the generator advances by one draw per tensor and its state is the checkpoint."""
    return torch.randint(
        -(2**63), 2**63 - 1, (), dtype=torch.int64, device=gen.device, generator=gen
    )


def _shift(z: torch.Tensor, bits: int) -> torch.Tensor:
    """``z >> bits`` as an unsigned 64-bit shift (torch's ``>>`` on int64 keeps the sign)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def keyed_bits(key: torch.Tensor, numel: int) -> torch.Tensor:
    """The 64 random bits (as int64) of elements ``0 .. numel - 1`` under ``key``:
    splitmix64's finalizer on ``key + (i + 1) * golden`` (wrapping 64-bit arithmetic), the
    same function as the native kernel's ``mix`` (``computectx/kernels/host_adam.cpp``)."""
    i = torch.arange(1, numel + 1, dtype=torch.int64, device=key.device)
    z = key + i * _i64(_GOLDEN)
    z = (z ^ _shift(z, 30)) * _i64(_MIX1)
    z = (z ^ _shift(z, 27)) * _i64(_MIX2)
    return z ^ _shift(z, 31)


def stochastic_round_keyed(x: torch.Tensor, target: torch.dtype, key: torch.Tensor) -> torch.Tensor:
    """``x`` rounded stochastically (unbiased) into ``target`` (bf16 or f16), element ``i``
    (of ``x`` flattened) drawing its bits from ``keyed_bits``: bf16 adds 16 bits to the float32
    pattern and truncates (element ``i`` the ``i % 4``-th 16 bits, from the lowest, of
    ``keyed_bits(key)[i // 4]``: one draw rounds four elements); f16 moves to the other
    neighbour when the top 24 bits of ``keyed_bits(key)[i]``, as a uniform in [0, 1), fall
    below the distance's share of the gap. Non-finite
    values are rounded to nearest, never perturbed. A finite value beyond ``target``'s largest
    finite one is first clamped to it (saturates: finite in, finite out, where rounding to
    nearest gives an infinity from the midpoint up). The native kernel rounds the same float32
    value to the same result."""
    x32 = x.float().contiguous()
    top = torch.finfo(target).max
    x32 = torch.where(torch.isfinite(x32), x32.clamp(-top, top), x32)
    numel = x32.numel()
    if target == torch.bfloat16:  # 16 bits an element: four from each draw, lowest first
        quads = keyed_bits(key, -(-numel // 4)).view(torch.int16)[:numel]
        noise = (quads.to(torch.int32) & 0xFFFF).view(x32.shape)
        rounded = torch.bitwise_and(x32.view(torch.int32) + noise, -65536).view(torch.float32)
        return torch.where(torch.isfinite(x32), rounded, x32).to(torch.bfloat16)
    z = keyed_bits(key, numel).view(x32.shape)
    near = x32.to(target)
    near32 = near.float()
    away = torch.where(near32 > x32, -math.inf, math.inf).to(target)
    other = torch.nextafter(near, away)
    p = (x32 - near32).abs() / (other.float() - near32).abs()
    draw = _shift(z, 40).float() * 2.0**-24
    pick = torch.isfinite(x32) & torch.isfinite(p) & (draw < p)
    return torch.where(pick, other, near)


def check_seed(seed: object) -> None:
    """``TypeError`` unless ``seed`` is an int (not a bool), ``ValueError`` unless it lies in
    ``[0, 2**63)``: it is saved as an int64 tensor (``master_rounding``), so a negative seed
    or one of 2**63 and above would not come back as given (``-1`` and ``2**64 - 1`` both
    save as -1), and one beyond 64 bits fails in torch's ``manual_seed`` at the first step."""
    value = as_int(seed)
    if value is None:
        raise TypeError(f"seed must be an int, got {seed!r}")
    if not 0 <= value < 2**63:
        raise ValueError(f"seed={value} is out of range; accepted: an int in [0, 2**63)")


def _as_int64(seed: int) -> int:
    """``seed`` as the int64 that seeds a generator the same way (torch reads it mod 2**64)."""
    return (seed + 2**63) % 2**64 - 2**63


def canonical(device: torch.device) -> torch.device:
    """``device`` with its index (``cuda`` -> ``cuda:0`` when that is the current one)."""
    if device.index is not None or device.type in ("cpu", "meta"):
        return device
    return torch.empty(0, device=device).device


class RoundingGenerators:
    """The generators of stochastic rounding: one per device drawn on, each seeded by ``seed``.

    A generator is made when its device is first drawn on, so a state saved before any draw
    is the seed alone, and loading it seeds later generators the same way.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._by_device: dict[torch.device, torch.Generator] = {}

    def get(self, device: torch.device) -> torch.Generator:
        """The generator for tensors on ``device`` (made and seeded on first use)."""
        gen = self._by_device.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            self._by_device[device] = gen
        return gen

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``{"seed": int64 scalar, "generator.<device>": uint8 state}``; copies, tensors only."""
        sd = {SEED: torch.tensor(_as_int64(self.seed), dtype=torch.int64)}
        for device, gen in self._by_device.items():
            sd[f"{GENERATOR_PREFIX}{canonical(device)}"] = gen.get_state().clone()
        return sd

    def load_state_dict(
        self, state_dict: Mapping[str, object], devices: Iterable[torch.device], mode: AccumMode
    ) -> None:
        """Restore ``state_dict`` (``state_dict()``'s form), checking all of it first.

        ``devices`` are the devices the accumulator may draw on; a generator of any other
        device is refused, as is any generator when ``mode`` is ``"nearest"`` (it never
        draws). Each state is tried on a scratch generator (torch checks its size and
        content), so a bad entry changes nothing.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
        if SEED not in state_dict:
            raise ValueError(
                f"the accumulator's state_dict has no {SEED!r} entry; got keys "
                f"{sorted(map(str, state_dict))}"
            )
        seed = state_dict[SEED]
        if not (isinstance(seed, torch.Tensor) and seed.dtype == torch.int64 and seed.dim() == 0):
            got = f"{seed.dtype}{list(seed.shape)}" if isinstance(seed, torch.Tensor) else seed
            raise ValueError(f"state_dict[{SEED!r}] must be an int64 scalar tensor, got {got}")
        extra = sorted(
            str(k) for k in state_dict if k != SEED and not str(k).startswith(GENERATOR_PREFIX)
        )
        if extra:
            raise ValueError(
                f"the accumulator's state_dict has unexpected key(s) {extra}; accepted: "
                f"{SEED!r} and {GENERATOR_PREFIX!r} followed by a device"
            )
        usable = {canonical(d) for d in devices}
        restored: dict[torch.device, torch.Generator] = {}
        for key, value in state_dict.items():
            if key != SEED:
                device, state = _check_generator(str(key), value, usable, mode)
                restored[device] = _scratch(str(key), device, state)
        self.seed = int(seed)
        self._by_device = restored


def _check_generator(
    key: str, value: object, usable: set[torch.device], mode: AccumMode
) -> tuple[torch.device, torch.Tensor]:
    """The device ``key`` names and the state ``value``, checked (not yet tried)."""
    where = f"state_dict[{key!r}]"
    name = key[len(GENERATOR_PREFIX) :]
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"{where} does not name a device ({name!r})") from None
    if mode == "nearest":
        raise ValueError(
            f"{where} is the state of stochastic rounding's generator, but this "
            f"accumulator has mode='nearest' and never draws; build it with "
            f"mode='stochastic' to resume that run"
        )
    if not any(u.type == device.type for u in usable) or canonical(device) not in usable:
        raise ValueError(
            f"{where} is the generator of {device}, but this accumulator never draws on "
            f"{device}: it draws on: {', '.join(sorted(map(str, usable)))}. The state was "
            f"saved on another machine; drop the key to resume with a fresh generator "
            f"there (no longer the same random bits)"
        )
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where} must be a tensor, got {type(value).__name__}")
    if value.dtype != torch.uint8 or value.dim() != 1:
        raise ValueError(
            f"{where} must be a 1-D uint8 tensor (a generator's get_state()), got "
            f"{value.dtype}{list(value.shape)}"
        )
    return canonical(device), value


def _scratch(key: str, device: torch.device, state: torch.Tensor) -> torch.Generator:
    """A new generator on ``device`` set to ``state`` (saved under ``key``); torch checks it."""
    gen = torch.Generator(device=device)
    try:
        gen.set_state(state.cpu())
    except RuntimeError as e:
        raise ValueError(f"state_dict[{key!r}] is not a generator state of {device}: {e}") from e
    return gen
