"""Encode and decode optimizer state tensors in the compact formats of ``OptimState``.

``encode(x, state, kind)`` stores a floating tensor as a ``Packed`` (named parts);
``decode(p)`` gives it back as float32. Blocks are taken over the flattened tensor in
row-major order, never cross its end (the last block is zero-padded while encoding; the
padding is not stored) and so never straddle parameters or shards. Nearest rounding
everywhere (ties to the lower code for the maps, to even for fp8 and bf16).

Round-trip bound, ``|decode(encode(x)) - x|`` per element (``round_trip_bound`` computes
it; property-tested). ``s`` is the element's scale: its block's absmax, or for rank-1
``min(row max, column max)``; ``n = x / s``; ``gap(n)`` is the distance between the two map
entries around ``n``; ``slack = s * 2**-20 + 2**-149`` (float32 rounding of ``x / s`` and of
``code * s``, subnormals included):

| format / kind | bound per element | worst case |
|---|---|---|
| bf16 | ``|x| * 2**-8 + 2**-134`` (unsigned: ``2**-133``) | relative 2**-8 = 0.39 % |
| int8 signed | ``gap(n) / 2 * s + slack`` | 0.0070 * block absmax |
| int8 unsigned | ``gap(n) / 2 * s + slack`` (*) | 0.0035 * block absmax |
| fp8 signed | ``max(|x| * 2**-4, s * 2**-10 / 448) + slack`` | relative 6.25 %; s * 2.2e-6 near 0 |
| fp8 unsigned | as signed (*) | relative 6.25 %; s * 4.4e-6 near 0 |
| int4 signed | ``gap(n) / 2 * s + slack`` | 0.1125 * block absmax |
| int4 unsigned | ``s / 32 + slack`` for n >= 1/16, else ``(1/16 - n) * s + slack`` | s / 16 at 0 |

Measured (1024 x 1024, default blocks; m ~ N(0, 1e-3), v = (N(0, 1e-3) * e**N(0, 1))**2),
relative RMS error ``|decode(encode(x)) - x| / |x|``: bf16 1.7e-3 / 1.8e-3 (m / v), int8
1.1e-2 / 2.4e-3, fp8 2.6e-2 / 8.2e-3, int4 0.16 / 0.65 (rank-1 on i.i.d. heavy-tailed v;
0.036 on a v with row-times-column structure, which rank-1 normalization is made for).

The maps (``maps.py``): int8 signed/unsigned = dynamic tree map (255 / 256 entries, smallest
non-zero 1e-6 / 1e-7 of the block absmax); int4 signed = 4-bit dynamic exponent map (15
entries); int4 unsigned = ``(i + 1) / 16``. Zeros stay zero and signs are kept (a value may
round to zero, never across it) in every format but int4 unsigned, whose map has no zero.
Unsigned state never rounds an x > 0 to zero but to the smallest code c > 0 at least (int8
1e-7 * s, fp8 2**-9 / 448 * s, bf16 2**-133; after either search), so Adam's update can only
shrink; (*): or ``c - x + slack`` where larger. (c underflows only for s below ~1e-38.)
fp8 stores e4m3 (``torch.float8_e4m3fn``) bit patterns as uint8 with the block absmax:
``decode = e4m3(code) / 448 * absmax``, i.e. a scale of ``absmax / 448`` per block.

int4 unsigned is rank-1 normalized (lpmm) when the tensor has 2 or more dims and its row and
column maxima (of the tensor viewed as ``(shape[0], -1)``) take no more room than one absmax
per block would (``rows + cols <= ceil(numel / block)``); otherwise it uses blocks.

Fixed point: each block's (row's, column's) largest magnitude decodes exactly (the maps hold
±1, e4m3 holds 448), so the scales of ``decode(p)`` are ``p``'s own scales, and every value
decodes within a few f32 ulps of a code's value, which re-encodes to the same code. Hence
``encode(decode(p))`` has parts identical to ``p`` for bf16, int8, fp8 and int4 (both kinds),
provided ``map_min * s`` is a normal float32 (s above about 1e-31 for int8, 1e-36 for int4,
1e-33 for fp8): below that the decoded values are f32 subnormals and may land on another code.
The check is ``test_re_encoding_is_a_fixed_point`` (tests/memory/optim/state/test_codecs.py).

Resharding (DCP 2 <-> 1): blocks are per block, so shards cut at block boundaries re-form the
blocks exactly (the same parts, concatenated); a cut inside a block re-encodes the blocks it
touches, within the saved layout's bound plus ``round_trip_bound`` of the new layout
(``test_shards_split_at_a_block_boundary_merge_exactly``). Rank-1 int4's column maxima
depend on which rows a shard holds, so it is re-encoded under that same combined bound.

Saturation: every finite float32 input encodes to finite parts and decodes to finite
values, never NaN (property-tested over the whole float32 range, subnormals included). A
finite value beyond bf16's largest (``|x| > 3.3895e38``) is stored as ``±3.3895e38`` (bf16
round to nearest would make it inf); the block formats hold every finite float32 exactly
in scale. ``encode`` refuses NaN, a negative value for ``kind="unsigned"`` and, unless
``saturate=True``, ±inf (ValueError); with ``saturate=True`` (the optimizers' own state after
torch's arithmetic overflowed, as float32 state then holds inf) ±inf is stored as the
format's largest finite magnitude: ``±3.4028e38`` in the block formats, ``±3.3895e38`` in
bf16. It decodes as that finite value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from computectx.memory.optim.state.maps import map_for, qmap
from computectx.memory.optim.state.packed import (
    FP8_MAX,
    Kind,
    Packed,
    Spec,
    check_format,
    decode_tensors,
    element_scale,
    encode_tensors,
    maps_for,
    part_layout,
    safe_scale,
    scales_of,
    spec_for,
    spec_of,
    unpack4,
)
from computectx.optim_state import OptimState

__all__ = ["decode", "encode", "from_parts", "round_trip_bound"]

_TINY = 2.0**-149
_SLACK = 2.0**-20


def _check_input(x: object, state: OptimState, kind: str, what: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} takes a tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{what} takes a floating tensor (read as float32), got {x.dtype}")
    check_format(state, kind)
    return x.float()


def encode(
    x: torch.Tensor,
    state: OptimState,
    kind: Kind,
    *,
    check_finite: bool = True,
    saturate: bool = False,
) -> Packed:
    """``x`` (floating, any shape, read as float32) stored in ``state.format``.

    Finite values beyond the format's range saturate (see the module docstring). Raises
    ValueError on NaN, on ±inf unless ``saturate`` (then stored as the largest finite
    magnitude), and on a negative value when ``kind="unsigned"``; ``check_finite=False``
    skips these checks and their device sync, for callers that know their state is not NaN
    and, if unsigned, non-negative. Nothing is encoded when a check fails.
    """
    x32 = _check_input(x, state, kind, "encode")
    spec = spec_for(state, kind, x.shape)
    if check_finite and x32.numel() > 0:
        bad = x32.isnan().any() if saturate else ~torch.isfinite(x32).all()
        if kind == "unsigned":
            bad = bad | (x32 < 0).any()
        if bool(bad):
            raise ValueError(_bad_input_message(x32, state, kind, saturate))
    parts = encode_tensors(x32, spec, maps_for(spec, x32.device))
    names = part_layout(spec, x.shape)
    return Packed(
        state.format, kind, torch.Size(x.shape), spec.block, dict(zip(names, parts, strict=True))
    )


def _bad_input_message(x32: torch.Tensor, state: OptimState, kind: str, saturate: bool) -> str:
    bad = x32.isnan() if saturate else ~torch.isfinite(x32)
    count = int(bad.sum())
    if count:
        what = "NaN" if saturate else "non-finite"
        return (
            f"encode({state.format}, {kind}) got {count} {what} value(s) in a tensor of shape "
            f"{list(x32.shape)}; only {'non-NaN' if saturate else 'finite'} state can be encoded"
        )
    return (
        f"encode({state.format}, unsigned) got negative value(s) (min {float(x32.min())}); "
        f"unsigned state (second moments, sums of squares) must be >= 0: use kind='signed'"
    )


def decode(p: Packed, out: torch.Tensor | None = None) -> torch.Tensor:
    """``p`` as a float32 tensor of ``p.shape`` (written into ``out`` when given)."""
    spec = spec_of(p)
    names = tuple(part_layout(spec, p.shape))
    flat = decode_tensors([p.parts[k] for k in names], spec, maps_for(spec, p.device), p.numel)
    if out is None:
        return flat.view(p.shape)
    if out.dtype != torch.float32 or out.shape != p.shape or out.device != p.device:
        raise ValueError(
            f"decode's out must be float32 of shape {list(p.shape)} on {p.device}, got "
            f"{out.dtype}{list(out.shape)} on {out.device}"
        )
    return out.copy_(flat.view(p.shape))


def from_parts(
    parts: Mapping[str, object],
    shape: Sequence[int],
    state: OptimState,
    kind: Kind,
    where: str,
) -> Packed:
    """A ``Packed`` from ``parts`` (``parts_of``'s form), checked; it holds the given tensors.

    Checks the names, dtypes, shapes and devices of the parts, and that every code is one the
    format makes and every scale is finite and >= 0. Raises ValueError naming ``where`` and
    what is accepted.
    """
    check_format(state, kind)
    shape = torch.Size(shape)
    spec = spec_for(state, kind, shape)
    layout = part_layout(spec, shape)
    what = f"{where}: {state.format} {kind} state of shape {list(shape)}"
    got = sorted(map(str, parts))
    if got != sorted(layout):
        raise ValueError(f"{what} has parts {got}; accepted: exactly {sorted(layout)}")
    tensors: dict[str, torch.Tensor] = {}
    for name, (dtype, part_shape) in layout.items():
        t = parts[name]
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{what}: part {name!r} must be a tensor, got {type(t).__name__}")
        if t.dtype != dtype or tuple(t.shape) != part_shape:
            raise ValueError(
                f"{what}: part {name!r} is {t.dtype}{list(t.shape)}; accepted: "
                f"{dtype}{list(part_shape)}"
            )
        tensors[name] = t
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        raise ValueError(f"{what}: parts lie on several devices {sorted(map(str, devices))}")
    _check_values(tensors, spec, what)
    return Packed(state.format, kind, shape, spec.block, tensors)


def _check_values(tensors: dict[str, torch.Tensor], spec: Spec, what: str) -> None:
    for name in ("absmax", "rows", "cols"):
        t = tensors.get(name)
        if t is not None and t.numel() and not bool((torch.isfinite(t) & (t >= 0)).all()):
            raise ValueError(f"{what}: part {name!r} holds negative or non-finite scales")
    codes = tensors.get("codes")
    if codes is None or codes.numel() == 0:
        return
    if spec.format == "fp8":
        if bool((codes & 0x7F == 0x7F).any()):
            raise ValueError(f"{what}: part 'codes' holds e4m3 NaN codes (0x7f/0xff)")
        return
    size = len(qmap(map_for(spec.format, spec.signed)))
    top = (
        int(codes.max()) if spec.format == "int8" else int(unpack4(codes, 2 * codes.numel()).max())
    )
    if top >= size:
        raise ValueError(
            f"{what}: part 'codes' holds code {top}; the {spec.format} "
            f"{'signed' if spec.signed else 'unsigned'} map has codes 0..{size - 1}"
        )


def round_trip_bound(x: torch.Tensor, state: OptimState, kind: Kind) -> torch.Tensor:
    """The documented bound on ``|decode(encode(x)) - x|`` per element (float32, x's shape).

    See the table in this module's docstring. ``f32`` state is not encoded: zeros.
    """
    if state.format == "f32":
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    x32 = _check_input(x, state, kind, "round_trip_bound")
    ax = x32.abs().reshape(-1)
    spec = spec_for(state, kind, x.shape)
    if spec.format == "bf16":
        return (ax * 2.0**-8 + (2.0**-134 if spec.signed else 2.0**-133)).view(x.shape)
    scale = element_scale(scales_of(x32, spec), spec, ax.numel())
    slack = scale * _SLACK + _TINY
    positive = ax > 0 if not spec.signed else torch.zeros_like(ax, dtype=torch.bool)
    if spec.format == "fp8":
        bound = torch.maximum(ax * 2.0**-4, scale * (2.0**-10 / FP8_MAX))
        floor = torch.where(positive, scale * (2.0**-9 / FP8_MAX) - ax, 0.0)  # below code 1
        return (torch.maximum(bound, floor) + slack).view(x.shape)
    values = maps_for(spec, x32.device).values
    n = x32.reshape(-1) / safe_scale(scale)
    i = (torch.bucketize(n, values, right=True) - 1).clamp(0, len(values) - 2)
    half_gap = (values[i + 1] - values[i]) / 2
    half_gap = torch.where(n < values[0], values[0] - n, half_gap)
    if float(values[0]) == 0.0:  # int8 unsigned: a positive value below entry 1 takes entry 1
        half_gap = torch.where(positive & (n < values[1]), values[1] - n, half_gap)
    return (half_gap * scale + slack).view(x.shape)
