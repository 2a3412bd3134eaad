"""The KV-cache scales of a checkpoint: a calibrated static fp8 KV scheme's per-layer
``k_scale`` / ``v_scale`` as each format holds them, and read back into this library's terms.

A transformers model served here with a static fp8 KV scheme (``KvFp8`` ``per_tensor`` or
``per_head``) takes its steps from a calibrated amax, ``(layers, 2, key/value heads)``
(``calibrate_transformers_kv``), given to ``CtxStaticCache`` as ``kv_amax``. The checkpoint
holds the steps that cache serves with (dequantize multipliers, ``amax / 448`` in float32 for
e4m3 with ``f32`` steps; a ``bf16`` or ``e8m0`` step as it is held, rounded up), float32,
under the attention module of each layer (``model.layers.{i}.self_attn.k_scale``):

- ``"compressed-tensors"``: ``quantization_config.kv_cache_scheme`` (compressed_tensors'
  ``QuantizationArgs``: 8-bit float, symmetric, static), strategy ``"tensor"`` (a
  ``per_tensor`` scheme: scales ``(1,)``) or ``"attn_head"`` (``per_head``: ``(H, 1, 1)``),
  the shapes compressed_tensors registers on the attention module (``initialize_qparams``).
- ``"fine-grained-fp8"``: the format has no KV field in its ``quantization_config``; the
  scales are 0-d tensors (vLLM's fp8 method reads one ``k_scale`` / ``v_scale`` per layer).
  A ``per_head`` scheme is written per tensor there: each layer's largest head step, which is
  the ``per_tensor`` step of the same amax.

A dynamic scheme (``per_token_head``), a dtype cache or no ``kv`` writes no scales. Both
formats' KV scales are for e4m3 codes; an e5m2 static scheme is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final, NamedTuple

import torch
from torch import nn

from computectx._checks import fault
from computectx.ctx import ComputeCtx
from computectx.dtypes import DType, Fp8Format
from computectx.integrations.hf_checkpoint.formats import float32_scale
from computectx.kv_policy import KvFp8, KvScaling
from computectx.nn.kv_steps import static_steps, widen_steps

if TYPE_CHECKING:
    from computectx.integrations.hf_checkpoint.formats import ExportFormat

__all__ = [
    "KV_SCALE_NAMES",
    "KvCalibration",
    "kv_cache_scheme",
    "kv_scale_tensors",
    "read_kv_scales",
]

KV_SCALE_NAMES: Final = ("k_scale", "v_scale")
"""The tensors of each attention module that hold its key and value scales."""
_STRATEGY: Final[dict[KvScaling, str]] = {"per_tensor": "tensor", "per_head": "attn_head"}
_SCALING: Final[dict[str, KvScaling]] = {v: k for k, v in _STRATEGY.items()}


class KvCalibration(NamedTuple):
    """KV scales read from a checkpoint, as this library serves them: ``CtxStaticCache(config,
    ctx.with_kv(kv), max_cache_len, kv_amax=amax)`` serves with the checkpoint's steps
    exactly."""

    kv: KvFp8
    """The scheme the scales are for: e4m3, ``per_tensor`` or ``per_head``, ``f32`` steps."""
    amax: torch.Tensor
    """``(layers, 2, key/value heads)`` float32 (row 0 keys, row 1 values): for each step, an
    amax whose ``amax / 448`` in float32 is that step (a ``per_tensor`` step on every head)."""


def _attention_modules(model: nn.Module) -> list[str]:
    """The fqn of each layer's attention module, by its ``layer_idx`` (transformers' attention
    modules: a class named ``*Attention*`` with ``k_proj`` / ``v_proj``)."""
    found: dict[int, str] = {}
    for fqn, module in model.named_modules():
        idx = getattr(module, "layer_idx", None)
        if "attention" not in type(module).__name__.lower() or not isinstance(idx, int):
            continue
        if not (hasattr(module, "k_proj") and hasattr(module, "v_proj")) or idx in found:
            continue
        found[idx] = fqn
    if sorted(found) != list(range(len(found))):
        raise ValueError(
            f"KV scales: the model's attention modules have layer indices {sorted(found)}; "
            f"expected 0 .. layers - 1, one module each"
        )
    return [found[i] for i in range(len(found))]


def _served_steps(model: nn.Module, kv: KvFp8, kv_amax: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's ``(2, S)`` float32 steps (``S`` heads or 1) as ``CtxStaticCache`` serves
    them from ``kv_amax`` (its checks, its rule, the held step format widened)."""
    from computectx.integrations.transformers_cache import CtxStaticCache

    config: Any = getattr(model, "config", None)
    try:
        cache = CtxStaticCache(config, ComputeCtx.serving("cpu").with_kv(kv), 1, kv_amax=kv_amax)
    except ValueError as e:
        raise ValueError(f"export_pretrained kv_amax: {e}") from None
    heads = kv_amax.shape[-1]
    out = []
    for layer in cache.layers:
        held = static_steps(kv, getattr(layer, "steps", None), heads, torch.device("cpu"))
        out.append(torch.stack([widen_steps(s) for s in held]))
    return out


def kv_scale_tensors(
    model: nn.Module,
    fmt: ExportFormat,
    kv: KvFp8 | DType | None,
    kv_amax: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    """The checkpoint's ``{attention}.k_scale`` / ``.v_scale`` tensors for ``kv`` (module
    docstring), ``{}`` when ``kv`` is not a static fp8 scheme. ``ValueError``, before anything
    is written, for: a ``kv_amax`` with a scheme that takes none; a static scheme without one
    (a step of 1.0 is never assumed); an e5m2 scheme; an amax that is not ``(layers, 2,
    key/value heads)`` of finite positive values; attention modules that do not match it."""
    if kv is not None and not isinstance(kv, (KvFp8, DType)):
        raise TypeError(f"export_pretrained kv takes a KvFp8, a DType or None, got {kv!r}")
    static = isinstance(kv, KvFp8) and kv.static
    if not static:
        if kv_amax is not None:
            raise ValueError(
                f"export_pretrained: kv={kv} takes no kv_amax; only the static fp8 KV schemes "
                f"(per_head, per_tensor) are served from a calibration"
            )
        return {}
    assert isinstance(kv, KvFp8)
    if kv_amax is None:
        raise ValueError(
            f"export_pretrained: kv={kv} is a static scheme and no kv_amax was given; pass the "
            f"calibrated amax (calibrate_transformers_kv) so the checkpoint carries the steps "
            f"it serves with, or kv=None to export without KV scales"
        )
    if kv.format != Fp8Format.E4M3:
        raise ValueError(
            f"export_pretrained: kv={kv}: the KV scales of both formats are for e4m3 codes "
            f"(vLLM's fp8 KV cache, compressed-tensors' 8-bit float); use an e4m3 scheme"
        )
    steps = _served_steps(model, kv, kv_amax)
    names = _attention_modules(model)
    if len(names) != len(steps):
        raise ValueError(
            f"export_pretrained kv_amax: {len(steps)} cache layers but {len(names)} attention "
            f"modules in the model"
        )
    out: dict[str, torch.Tensor] = {}
    for fqn, pair in zip(names, steps, strict=True):
        for name, s in zip(KV_SCALE_NAMES, pair, strict=True):
            if fmt == "fine-grained-fp8":
                scale = s.amax().reshape(())
            elif kv.scaling == "per_head":
                scale = s.reshape(-1, 1, 1)
            else:
                scale = s.reshape(1)
            out[f"{fqn}.{name}"] = scale.contiguous()
    return out


def kv_cache_scheme(fmt: ExportFormat, kv: KvFp8 | DType | None) -> dict[str, Any] | None:
    """compressed-tensors' ``kv_cache_scheme`` for a static e4m3 ``kv`` (built with its own
    ``QuantizationArgs``); ``None`` for fine-grained FP8 (no such field) or any other ``kv``."""
    if fmt != "compressed-tensors" or not isinstance(kv, KvFp8) or not kv.static:
        return None
    from compressed_tensors.quantization import QuantizationArgs  # type: ignore[import-untyped]

    args = QuantizationArgs(
        num_bits=8, type="float", strategy=_STRATEGY[kv.scaling], symmetric=True, dynamic=False
    )
    dumped: dict[str, Any] = args.model_dump()
    return dumped


def _amax_of(step: torch.Tensor) -> torch.Tensor:
    """An amax whose ``amax / 448`` in float32 is ``step`` (``step * 448``, or a neighbour
    when that product rounded away), so the cache built from it holds ``step`` itself."""
    top = Fp8Format.E4M3.max
    a = step * top
    up = torch.nextafter(a, torch.full_like(a, float("inf")))
    down = torch.nextafter(a, torch.zeros_like(a))
    a = torch.where(a / top == step, a, torch.where(up / top == step, up, a))
    return torch.where(a / top == step, a, torch.where(down / top == step, down, a))


def _scheme(config: Mapping[str, Any], found: bool) -> KvFp8 | None:
    """The KV scheme the checkpoint's config declares, or (fine-grained) its tensors imply."""
    quant = config.get("quantization_config") or {}
    method = quant.get("quant_method")
    scheme = quant.get("kv_cache_scheme") if method == "compressed-tensors" else None
    if scheme is None:
        if method == "compressed-tensors" and found:
            raise ValueError(
                "the checkpoint holds k_scale / v_scale tensors but its quantization_config "
                "has no kv_cache_scheme"
            )
        return KvFp8(scaling="per_tensor") if found else None
    strategy = scheme.get("strategy")
    if (
        scheme.get("type") != "float"
        or scheme.get("num_bits") != 8
        or scheme.get("dynamic")
        or not scheme.get("symmetric", True)
        or strategy not in _SCALING
    ):
        raise ValueError(
            f"kv_cache_scheme {dict(scheme)} is not a KV scheme read here; accepted: 8-bit "
            f"float, symmetric, static, strategy 'tensor' or 'attn_head'"
        )
    if not found:
        raise ValueError(
            f"the checkpoint's kv_cache_scheme (strategy {strategy!r}) has no k_scale / "
            f"v_scale tensors"
        )
    return KvFp8(scaling=_SCALING[strategy])


def read_kv_scales(
    tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any], model: nn.Module
) -> KvCalibration | None:
    """The KV scales of a checkpoint (its ``tensors`` by name and its config.json ``config``)
    for ``model``'s attention modules, or ``None`` when it has none. The shapes read, exactly:
    a per-tensor scale (compressed-tensors strategy ``"tensor"``, or fine-grained FP8) ``()``
    or ``(1,)`` (export writes ``(1,)`` and ``()`` respectively; vLLM-style checkpoints hold
    either), an ``"attn_head"`` scale ``(H, 1, 1)`` for ``H`` key/value heads (what
    compressed_tensors registers). The dtypes read: those of ``formats.float32_scale``
    (float32; bfloat16, float16, e8m0 widened; float64 holding float32 values). ``ValueError``
    naming the tensor for: scales on some layers only, or on a module that is not an attention
    module of ``model``; a shape other than the scheme's; another dtype, or a float64 value
    off the float32 grid; a scale that is not finite and positive; a ``kv_cache_scheme`` this
    library has no scheme for."""
    present = {k for k in tensors if k.rpartition(".")[2] in KV_SCALE_NAMES}
    kv = _scheme(config, bool(present))
    if kv is None:
        return None
    names = _attention_modules(model)
    wanted = {f"{fqn}.{n}" for fqn in names for n in KV_SCALE_NAMES}
    if present != wanted:
        odd = sorted(present ^ wanted)[:4]
        raise ValueError(
            f"KV scales: the checkpoint's k_scale / v_scale tensors do not match the model's "
            f"{len(names)} attention modules (first differences: {odd})"
        )
    text: Any = getattr(model, "config", None)
    text = text.get_text_config(decoder=True)
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    per_head = kv.scaling == "per_head"
    count = heads if per_head else 1
    shapes: list[tuple[int, ...]] = [(heads, 1, 1)] if per_head else [(), (1,)]
    rows = []
    for fqn in names:
        pair = []
        for n in KV_SCALE_NAMES:
            name = f"{fqn}.{n}"
            t = tensors[name]
            if tuple(t.shape) not in shapes:
                raise ValueError(
                    f"KV scale {name}: {kv.scaling} scales are {count} finite positive float "
                    f"value(s) of shape {' or '.join(str(s) for s in shapes)}, got {t.dtype} "
                    f"{tuple(t.shape)}"
                )
            step = float32_scale(f"KV scale {name}", t).reshape(-1).cpu()
            bad = ~(torch.isfinite(step) & (step > 0))
            if bool(bad.any()):
                first = int(bad.nonzero()[0, 0])
                at = f"head {first}'s scale" if per_head else "the scale"
                raise ValueError(
                    f"KV scale {name}: {kv.scaling} scales are {count} finite positive float "
                    f"value(s), got {t.dtype} {tuple(t.shape)} whose {at} is "
                    f"{fault(step[first])} ({int(bad.sum())} of {step.numel()} refused)"
                )
            pair.append(_amax_of(step).expand(heads))
        rows.append(torch.stack(pair))
    return KvCalibration(kv=kv, amax=torch.stack(rows).contiguous())
