"""compressed-tensors' 4-bit pack formats: a 4-bit layer's tensors on disk and back.

``nvfp4-pack-quantized`` (NVFP4) and ``mxfp4-pack-quantized`` (MXFP4), each a weight-only
scheme (compressed-tensors' ``NVFP4A16`` / ``MXFP4A16`` presets), hold exactly the weight a
``Fp4Linear`` forward multiplies with or a ``FrozenFp4Linear`` holds:

========================  =====================================================================
``weight_packed``         uint8 ``[N, K/2]``: the E2M1 codes as they are (element ``2j`` in
                          byte ``j``'s low nibble, sign in bit 3: compressed-tensors' own
                          ``pack_fp4_to_uint8`` order)
``weight_scale``          NVFP4: float8_e4m3fn ``[N, K/16]``, one per 1x16 group (a 16x16
                          tile's scale repeated over its 16 rows: exact); MXFP4: uint8 ``[N,
                          K/32]``, the E8M0 bytes (``compress_mx_scale``'s)
``weight_global_scale``   NVFP4 only: float32 ``(1,)``, ``G`` below
========================  =====================================================================

compressed-tensors decodes an NVFP4 weight as ``code * (f32(scale) / G)`` (its
``_dequantize``: one float32 division, then one product) rounded to bfloat16, the dtype its
``NVFP4PackedCompressor.decompress`` unpacks to; this library as ``code * (f32(scale) *
f32(1 / S_enc))`` with ``S_enc = min(2688 / amax, FLT_MAX)`` (1 for amax 0) rounded once.
``G`` is ``S_enc`` itself (compressed-tensors' ``generate_gparam`` convention, ``448 * 6 /
amax``; amax 0 gives 1 in both), except where the division and the reciprocal's product
round a decode of this layer to different bfloat16 values (462 of the 2**23 float32 values of
``S_enc`` in a binade, for some scale and code): then the nearest float32 neighbour of
``S_enc`` for which every decode of the layer's scales agrees (``chosen_global_scale``), and
the decoded weight is ours at bfloat16, bit for bit. Where no float32 does (41 of the 462,
for a layer holding every scale) the one with the fewest (scale, code) pairs apart is written
and ``weight_global_scale`` warns. At float32 the two may differ in the last place.

``G`` does not determine the amax (several float32 amaxes share one ``S_enc``), and the amax is
W4A4's epilogue factor here: the export also writes each NVFP4 layer's amax into config.json
under ``AMAX_KEY`` (serving stacks ignore the key), so the import restores it bit for bit
(checked: the export must choose the checkpoint's ``G`` for that amax and those scales). A
checkpoint without it (llm-compressor's) is read with the amax ``fl(2688 / G)`` or its nearest
neighbour whose decode agrees with compressed-tensors' at bfloat16 (``amax_of_global_scale``).

**Static W4A4** (NVFP4 only). A model whose every 4-bit layer is a ``FrozenFp4Linear`` serving
``"w4a4"`` with ``activation_amax="static"`` (calibrated: ``calibrate_fp4_activations``) is
written under compressed-tensors' ``NVFP4`` preset: ``input_activations`` float, 4 bits,
``tensor_group`` of 16, symmetric, ``dynamic: "local"`` (the per-tensor global scale static,
the block scales computed at every call), and per layer

========================  =====================================================================
``input_global_scale``    float32 ``(1,)``: ``S_enc`` of the calibrated input amax, ``min(2688 /
                          amax, FLT_MAX)`` (1 for amax 0): the encode scale, as
                          ``weight_global_scale`` is the weight's (compressed-tensors'
                          ``generate_gparam``; its ModelOpt converter writes ``1 / input_scale``,
                          ModelOpt's ``input_scale`` being ``amax / 2688``)
========================  =====================================================================

and each amax in config.json under ``INPUT_AMAX_KEY`` (W4A4's epilogue multiplies by the amax,
which ``S_enc`` does not determine), so the import restores it bit for bit (checked: its
``S_enc`` must be the checkpoint's). Without the key, the amax is ``fl(2688 / G)`` or its
nearest float32 neighbour whose ``S_enc`` is ``G`` exactly; where none within 8 steps is (a
writer rounding ``448 * 6 / amax`` another way: about 7% of llm-compressor's and ModelOpt's
scales), the neighbour whose ``S_enc`` is nearest, with a ``UserWarning`` naming the layer.
q/k/v and gate/up, which vLLM fuses, read one input: calibrated together, their amaxes are
equal, and so are their input global scales (vLLM serves a fused layer with the largest).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, Final, Literal

import torch
from torch import nn

from computectx.formats import Fp4Linear, FrozenFp4Linear
from computectx.formats.seam import (
    MXFP4_BLOCK,
    NVFP4_BLOCK,
    Fp4Operand,
    Mxfp4Operand,
    Nvfp4Operand,
    check_input_amax,
    check_weight,
    global_encode_scale,
)

__all__ = [
    "AMAX_KEY",
    "FP4_CT_FORMATS",
    "INPUT_AMAX_KEY",
    "Fp4Format",
    "amax_of_global_scale",
    "chosen_global_scale",
    "fp4_format_of",
    "fp4_input_amaxes",
    "fp4_layers",
    "fp4_quantization_config",
    "fp4_tensors",
    "input_amax_of_scale",
    "operand_of_tensors",
    "read_fp4_scheme",
    "reads_static_inputs",
    "weight_global_scale",
]

Fp4Format = Literal["nvfp4", "mxfp4"]
FP4_CT_FORMATS: Final[dict[Fp4Format, str]] = {
    "nvfp4": "nvfp4-pack-quantized",
    "mxfp4": "mxfp4-pack-quantized",
}
"""compressed-tensors' ``format`` of each 4-bit weight format."""
_PRESETS: Final[dict[Fp4Format, str]] = {"nvfp4": "NVFP4A16", "mxfp4": "MXFP4A16"}
_GROUP: Final[dict[Fp4Format, int]] = {"nvfp4": NVFP4_BLOCK, "mxfp4": MXFP4_BLOCK}
_STRATEGY: Final[dict[Fp4Format, str]] = {"nvfp4": "tensor_group", "mxfp4": "group"}
INPUT_AMAX_KEY: Final = "computectx_nvfp4_input_amax"
"""config.json's key for each static W4A4 layer's float32 calibrated input amax, by its
weight's on-disk name without ``.weight`` (what ``input_global_scale`` cannot carry)."""
_W4A4_INPUTS: Final = ("float", 4, NVFP4_BLOCK, "tensor_group", "local")
"""The input activations held here: NVFP4 (type, num_bits, group_size, strategy, dynamic)."""
AMAX_KEY: Final = "computectx_nvfp4_amax"
"""config.json's key for each NVFP4 layer's float32 amax, by its weight's on-disk name
without ``.weight`` (what ``weight_global_scale`` cannot carry)."""
_E2M1: Final = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The nonzero E2M1 magnitudes (a sign flips both decodes alike; zero decodes to zero)."""
_NEIGHBOURS: Final = 8
"""How many float32 steps either side of the natural value a scale is searched."""


def fp4_layers(model: nn.Module) -> dict[str, Fp4Operand]:
    """Each 4-bit linear's weight operand by module name: an ``Fp4Linear``'s forward operand
    (``quantized_weight()``), a ``FrozenFp4Linear``'s held one. ``ValueError`` naming 4-bit
    experts (``Fp4Experts``, ``FrozenFp4Experts``): not exported yet."""
    out: dict[str, Fp4Operand] = {}
    for fqn, module in model.named_modules():
        if isinstance(module, FrozenFp4Linear):
            out[fqn] = module.weight_operand
        elif isinstance(module, Fp4Linear):
            out[fqn] = check_weight(module.quantized_weight(), f"export_pretrained: {fqn}")
        elif type(module).__name__ in ("Fp4Experts", "FrozenFp4Experts"):
            raise ValueError(
                f"export_pretrained: {fqn} is {type(module).__name__} (4-bit experts); "
                f"exporting 4-bit experts is not supported yet (4-bit linears are)"
            )
    return out


def fp4_input_amaxes(model: nn.Module, layers: Mapping[str, Fp4Operand]) -> dict[str, torch.Tensor]:
    """Each static W4A4 layer's calibrated input amax (float32 ``(1,)``, on the CPU) by module
    name: of every one of ``layers`` or of none (module docstring). ``ValueError`` naming the
    layers for a model mixing static W4A4 layers with others (the config holds one scheme) and
    for a static layer not calibrated."""
    static = {
        fqn: m
        for fqn, m in model.named_modules()
        if isinstance(m, FrozenFp4Linear) and (m.mode, m.activation_amax) == ("w4a4", "static")
    }
    if not static:
        return {}
    others = sorted(set(layers) - set(static))
    if others:
        raise ValueError(
            f"export_pretrained: {next(iter(static))} serves static W4A4 (a calibrated input "
            f"amax) and {others[0]} does not; compressed-tensors' config is written with one "
            f"scheme here: freeze every 4-bit layer alike (freeze_fp4_for_serving(model, "
            f"'w4a4', activation_amax='static'), then calibrate_fp4_activations)"
        )
    raw = [fqn for fqn, m in static.items() if not m.input_calibrated]
    if raw:
        raise ValueError(
            f"export_pretrained: {raw[0]} serves static W4A4 but its input amax is not "
            f"calibrated; run calibrate_fp4_activations(model, batches) first"
        )
    return {fqn: m.input_amax.detach().cpu().reshape(1).clone() for fqn, m in static.items()}


def fp4_format_of(q: Fp4Operand) -> Fp4Format:
    return "nvfp4" if isinstance(q, Nvfp4Operand) else "mxfp4"


def _neighbours(x: torch.Tensor) -> Iterator[torch.Tensor]:
    """float32 ``x`` (positive, finite), then its neighbours one, two, ... steps away,
    alternating above and below."""
    bits = x.float().reshape(1).view(torch.int32)
    yield x.float().reshape(1)
    for k in range(1, _NEIGHBOURS + 1):
        for step in (k, -k):
            n = (bits + step).view(torch.float32)
            if bool(torch.isfinite(n).all() & (n > 0).all()):
                yield n


def _mismatches(scale: torch.Tensor, g: torch.Tensor, s_enc: torch.Tensor) -> int:
    """How many (scale, code) pairs of ``scale``'s distinct positive scales and the nonzero
    E2M1 magnitudes decode to different bfloat16s under compressed-tensors' ``scale / g`` and
    this library's ``scale * (1 / s_enc)``."""
    s = torch.unique(scale.float())
    s = s[s > 0]
    codes = torch.tensor(_E2M1, dtype=torch.float32)[:, None]
    theirs = (codes * (s / g)).bfloat16().view(torch.int16)
    ours = (codes * (s * (1.0 / s_enc))).bfloat16().view(torch.int16)
    return int((theirs != ours).sum())


def _decodes_alike(scale: torch.Tensor, g: torch.Tensor, s_enc: torch.Tensor) -> bool:
    return _mismatches(scale, g, s_enc) == 0


def chosen_global_scale(q: Nvfp4Operand) -> tuple[torch.Tensor, int]:
    """The float32 ``(1,)`` ``weight_global_scale`` the export writes for ``q`` and how many
    (scale, code) pairs compressed-tensors then decodes otherwise than this library (module
    docstring): ``S_enc`` if it decodes every pair alike, else the nearest neighbour within 8
    float32 steps that does, else (no float32 does: ties broken oppositely) the one of those
    with the fewest pairs apart, ``S_enc`` first among equals."""
    s_enc = global_encode_scale(q.amax.detach().cpu().reshape(()))
    scale = q.scale.detach().cpu()
    best: tuple[torch.Tensor, int] | None = None
    for g in _neighbours(s_enc):
        apart = _mismatches(scale, g, s_enc)
        if apart == 0:
            return g, 0
        if best is None or apart < best[1]:
            best = (g, apart)
    assert best is not None  # S_enc itself is always a candidate
    return best


def weight_global_scale(name: str, q: Nvfp4Operand) -> torch.Tensor:
    """``chosen_global_scale(q)``'s scale; a ``UserWarning`` naming the layer and the pairs
    apart when no float32 decodes all of them alike (about 41 of the 2**23 float32 values of
    ``S_enc`` in a binade, for a layer holding every E4M3 scale)."""
    g, apart = chosen_global_scale(q)
    if apart:
        warnings.warn(
            f"export_pretrained: {name}: no float32 weight_global_scale near S_enc decodes every "
            f"code times scale of this layer as this library does; compressed-tensors' decode "
            f"differs in the last bfloat16 place for {apart} (scale, code) pair(s); the import "
            f"still restores the layer bit for bit (its amax is in config.json)",
            UserWarning,
            stacklevel=4,
        )
    return g


def amax_of_global_scale(name: str, g: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """An amax (float32 ``()``) whose ``S_enc`` decodes ``scale`` as compressed-tensors
    decodes it with global scale ``g`` (bfloat16, bit for bit): ``fl(2688 / g)`` or its
    nearest neighbour that does; ``ValueError`` naming the layer if none within 8 steps
    does."""
    first = (torch.full((1,), 448.0 * 6.0) / g.float().reshape(1)).clamp(
        max=torch.finfo(torch.float32).max
    )
    for amax in _neighbours(first):
        if _decodes_alike(scale.detach().cpu(), g.float().reshape(1), global_encode_scale(amax)):
            return amax.reshape(())
    raise ValueError(
        f"import_pretrained: {name}: no per-tensor amax decodes the checkpoint's weight as "
        f"compressed-tensors does with weight_global_scale {g.reshape(-1)[0].item()!r} (bfloat16, "
        f"bit for bit); this library's NVFP4 decode is code * scale * (1 / (2688 / amax))"
    )


def fp4_tensors(name: str, q: Fp4Operand) -> dict[str, torch.Tensor]:
    """Layer ``name``'s tensors by suffix (``weight_packed``, ``weight_scale``,
    ``weight_global_scale``), each a tensor of its own (safetensors refuses shared memory)."""
    packed = q.codes.detach().cpu().view(torch.uint8).clone()
    if isinstance(q, Mxfp4Operand):
        return {"weight_packed": packed, "weight_scale": q.scale.cpu().view(torch.uint8).clone()}
    scale = q.scale.detach().cpu()
    if q.tile == "16x16":
        scale = scale.repeat_interleave(NVFP4_BLOCK, dim=0)  # each tile's scale on its 16 rows
    return {
        "weight_packed": packed,
        "weight_scale": scale.contiguous().clone(),
        "weight_global_scale": weight_global_scale(name, q),
    }


def fp4_quantization_config(
    fmt: Fp4Format, ignore: list[str], static_inputs: bool = False
) -> dict[str, Any]:
    """compressed-tensors' ``quantization_config`` of weight-only ``fmt`` (its
    ``NVFP4A16``/``MXFP4A16`` preset on every ``Linear``), or with ``static_inputs`` its NVFP4
    W4A4 preset (``NVFP4``: module docstring), as ``ModelCompressor`` writes one."""
    from compressed_tensors.quantization import (  # type: ignore[import-untyped]
        preset_name_to_scheme,
    )

    from computectx.integrations.hf_checkpoint.formats import ct_config

    preset = "NVFP4" if static_inputs and fmt == "nvfp4" else _PRESETS[fmt]
    return ct_config(preset_name_to_scheme(preset, ["Linear"]), FP4_CT_FORMATS[fmt], ignore)


# ----- reading -----------------------------------------------------------------------------


def read_fp4_scheme(q: Mapping[str, Any]) -> Fp4Format | None:
    """The 4-bit format of a compressed-tensors ``quantization_config`` ``q``, ``None`` when it
    is not a 4-bit pack format; ``ValueError`` naming what it holds and what is read for a
    scheme not held here exactly: weights other than symmetric 4-bit floats in groups of 16
    (NVFP4, ``tensor_group``) or 32 (MXFP4, ``group``), static input activations other than
    NVFP4's W4A4 preset (``reads_static_inputs``), output activations, sparsity."""
    fmt = next((f for f, name in FP4_CT_FORMATS.items() if q.get("format") == name), None)
    if fmt is None:
        return None
    if q.get("sparsity_config"):
        raise ValueError(
            "import_pretrained: the compressed-tensors checkpoint is sparse (sparsity_config "
            "is set); only dense 4-bit weights are read here"
        )
    groups = q.get("config_groups") or {}
    if not groups:
        raise ValueError(
            "import_pretrained: the compressed-tensors checkpoint has no config_groups"
        )
    for gname, group in groups.items():
        w = group.get("weights") or {}
        got = (*(w.get(k) for k in _WEIGHT_KEYS[:4]), w.get("symmetric", True))
        want = ("float", 4, _GROUP[fmt], _STRATEGY[fmt], True)
        if got != want:
            raise ValueError(
                f"import_pretrained: compressed-tensors group {gname!r} in format "
                f"{FP4_CT_FORMATS[fmt]!r} holds weights ({', '.join(_WEIGHT_KEYS)}) = {got}; "
                f"read here: {want}"
            )
        a = group.get("input_activations")
        if group.get("output_activations") or (
            a and a.get("dynamic") is not True and not _static_inputs(fmt, a)
        ):
            raise ValueError(
                f"import_pretrained: compressed-tensors group {gname!r} quantizes activations "
                f"with static scales (input_activations dynamic={a.get('dynamic') if a else None!r}"
                f", output_activations {group.get('output_activations')!r}); read here: "
                f"weight-only 4-bit (NVFP4A16, MXFP4A16), dynamic input activations, or NVFP4's "
                f"W4A4 (input activations (type, num_bits, group_size, strategy, dynamic) = "
                f"{_W4A4_INPUTS}, symmetric: a static global scale, block scales at every call)"
            )
    reads_static_inputs(q)  # the groups agree
    return fmt


_WEIGHT_KEYS: Final = ("type", "num_bits", "group_size", "strategy", "symmetric")


def _static_inputs(fmt: str, a: Mapping[str, Any]) -> bool:
    got = (a.get("type"), a.get("num_bits"), a.get("group_size"), a.get("strategy"))
    return fmt == "nvfp4" and (*got, a.get("dynamic")) == _W4A4_INPUTS and a.get("symmetric", True)


def reads_static_inputs(q: Mapping[str, Any]) -> bool:
    """Whether the 4-bit ``quantization_config`` ``q`` is NVFP4's static W4A4: its groups'
    input activations compressed-tensors' ``NVFP4`` preset's (module docstring); ``ValueError``
    when some groups are and others are not."""
    fmt = next((f for f, name in FP4_CT_FORMATS.items() if q.get("format") == name), "mxfp4")
    groups = (q.get("config_groups") or {}).values()
    kinds = {_static_inputs(fmt, g.get("input_activations") or {}) for g in groups}
    if len(kinds) > 1:
        raise ValueError(
            "import_pretrained: some compressed-tensors groups hold static W4A4 input "
            "activations and others do not; read here: one scheme for every 4-bit layer"
        )
    return kinds == {True}


def input_amax_of_scale(name: str, g: torch.Tensor | None, amax: object) -> torch.Tensor:
    """Static W4A4 layer ``name``'s input amax (float32 ``(1,)``) from its checkpoint's
    ``input_global_scale`` ``g`` and config.json's ``INPUT_AMAX_KEY`` entry ``amax`` (``None``
    when absent; module docstring). ``ValueError`` naming the tensor or entry otherwise."""
    if g is None:
        raise ValueError(
            f"import_pretrained: {name}.input_global_scale is missing from the checkpoint (its "
            f"config declares NVFP4 W4A4: a static input global scale per layer)"
        )
    g = _global_scale_of(f"{name}.input_global_scale", g)
    if amax is not None:
        held = _amax_of_entry(INPUT_AMAX_KEY, name, amax).reshape(1)
        if not torch.equal(global_encode_scale(held), g):
            raise ValueError(
                f"import_pretrained: {name}: config.json's {INPUT_AMAX_KEY} gives input amax "
                f"{amax!r}, whose S_enc is not the checkpoint's "
                f"input_global_scale {g.item()!r}; the two were not written together"
            )
        return check_input_amax(held, f"import_pretrained: {name} ({INPUT_AMAX_KEY})")
    first = (torch.full((1,), 448.0 * 6.0) / g).clamp(max=torch.finfo(torch.float32).max)
    near = list(_neighbours(first))
    for a in near:
        if torch.equal(global_encode_scale(a), g):
            return a.reshape(1)
    # Writers that round 448 * 6 / amax another way (torch's 2688 / tensor is fl(fl(1 / a) *
    # 2688)) give about 7% of their scales no float32 amax whose S_enc is G: the nearest.
    a = min(near, key=lambda c: abs(float(global_encode_scale(c)) - float(g)))
    warnings.warn(
        f"import_pretrained: {name}: no float32 input amax has S_enc = min(2688 / amax, FLT_MAX) "
        f"equal to the checkpoint's input_global_scale {g.item()!r}; the layer serves with the "
        f"nearest, {float(global_encode_scale(a))!r} (amax {float(a)!r}): its activations' block "
        f"scales may differ in the last E4M3 place from a stack quantizing with G itself",
        UserWarning,
        stacklevel=3,
    )
    return a.reshape(1)


def operand_of_tensors(
    name: str,
    fmt: Fp4Format,
    tensors: Mapping[str, torch.Tensor],
    shape: tuple[int, int],
    tile: str,
    amax: object,
) -> Fp4Operand:
    """The operand of on-disk weight ``name`` (``tensors`` by suffix) for a layer of
    ``shape`` (out, in) holding ``tile`` blocks (``"1x16"``, ``"16x16"``, ``"1x32"``) and the
    config's ``amax`` (NVFP4, ``None`` when absent). ``ValueError`` naming the tensor, what it
    is and what is read, before anything is loaded (module docstring)."""
    n, k = shape
    group = _GROUP[fmt]
    want: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
        "weight_packed": (torch.uint8, (n, k // 2)),
        "weight_scale": (torch.float8_e4m3fn if fmt == "nvfp4" else torch.uint8, (n, k // group)),
    }
    parts = (*want, "weight_global_scale") if fmt == "nvfp4" else tuple(want)
    for suffix in parts:
        if suffix not in tensors:
            raise ValueError(f"import_pretrained: {name}.{suffix} is missing from the checkpoint")
    for suffix, (dtype, dims) in want.items():
        t = tensors[suffix]
        if (t.dtype, tuple(t.shape)) != (dtype, dims):
            raise ValueError(
                f"import_pretrained: {name}.{suffix} is {str(t.dtype).removeprefix('torch.')} "
                f"{tuple(t.shape)}; the layer reads {str(dtype).removeprefix('torch.')} {dims}"
            )
    codes = tensors["weight_packed"].view(torch.float4_e2m1fn_x2)
    if fmt == "mxfp4":
        return Mxfp4Operand(codes, tensors["weight_scale"].view(torch.float8_e8m0fnu))
    scale = tensors["weight_scale"]
    bad = scale.float()
    if bool((bad.isnan() | (bad < 0)).any()):  # before the tile check, which would name it
        raise ValueError(
            f"import_pretrained: {name}: block scales must be finite and >= 0 (a NaN scale "
            f"stands for a block that held a NaN: such a weight serves NaN)"
        )
    if tile == "16x16":
        scale = _tiles(name, scale)
    g = _global_scale_of(f"{name}.weight_global_scale", tensors["weight_global_scale"])
    if amax is None:
        held = amax_of_global_scale(name, g, scale)
    else:
        held = _amax_of_entry(AMAX_KEY, name, amax)
        ours = Nvfp4Operand(codes, scale, held, "16x16" if tile == "16x16" else "1x16")
        if not torch.equal(chosen_global_scale(ours)[0], g):
            raise ValueError(
                f"import_pretrained: {name}: config.json's {AMAX_KEY} gives amax {amax!r}, for "
                f"which the export writes another weight_global_scale than the checkpoint's "
                f"{g.item()!r}; the two were not written together"
            )
    return Nvfp4Operand(codes, scale, held, "16x16" if tile == "16x16" else "1x16")


def _global_scale_of(name: str, g: torch.Tensor) -> torch.Tensor:
    """Checkpoint tensor ``name``, a per-tensor global scale, as float32 ``(1,)``: shape
    ``(1,)`` or ``()`` (compressed-tensors writes the one, ModelOpt the other), finite and
    positive, in float32, bfloat16 or float16 (exact widenings) or float64 holding a float32
    value (as the fp8 scales are read). ``ValueError`` naming the tensor otherwise."""
    what = f"import_pretrained: {name} is {str(g.dtype).removeprefix('torch.')} {tuple(g.shape)}"
    if g.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise ValueError(f"{what}; read here: float32, bf16, f16, or f64 holding a float32")
    if tuple(g.shape) not in ((1,), ()):
        raise ValueError(f"{what}; read here: shape (1,) or ()")
    f32 = g.float().reshape(1)
    if g.dtype == torch.float64 and not torch.equal(f32.double(), g.reshape(1)):
        raise ValueError(f"{what}, a value no float32 holds (it would be rounded)")
    if not bool((torch.isfinite(f32) & (f32 > 0)).all()):
        raise ValueError(f"{what}: {f32.item()!r}; read here: finite and positive")
    return f32


def _amax_of_entry(key: str, name: str, amax: object) -> torch.Tensor:
    """config.json's ``key[name]`` amax as a float32 scalar: a number, finite, ``>= 0``, a
    float32 value exactly (the export writes one); ``ValueError`` naming it otherwise."""
    where = f"import_pretrained: config.json's {key}[{name!r}]"
    if isinstance(amax, bool) or not isinstance(amax, (int, float)):
        raise ValueError(f"{where} must be a number, got {type(amax).__name__}")
    held = torch.tensor(float(amax), dtype=torch.float32)
    if not (math.isfinite(amax) and amax >= 0 and float(held) == amax):
        raise ValueError(
            f"{where} is an invalid amax {amax!r}: read here, a finite float32 >= 0 (the "
            f"weight's max |w|, as the export writes it)"
        )
    return held


def _tiles(name: str, scale: torch.Tensor) -> torch.Tensor:
    """1x16 group scales ``[N, K/16]`` as 16x16 tiles ``[N/16, K/16]``: exact only when each
    tile's 16 rows hold the same scales (``ValueError`` naming the weight otherwise)."""
    n = scale.shape[0]
    tiles = scale[::NVFP4_BLOCK]
    rows = tiles.view(torch.uint8).repeat_interleave(NVFP4_BLOCK, dim=0)
    if n % NVFP4_BLOCK or not torch.equal(rows, scale.view(torch.uint8)):
        raise ValueError(
            f"import_pretrained: {name}: the checkpoint's 1x16 scales differ within a 16x16 "
            f"tile (or N = {n} is not a multiple of 16); the layer holds 16x16 tiles: convert "
            f"or freeze it under 1x16 weight blocks (nvfp4+w1x16)"
        )
    return tiles.contiguous()
