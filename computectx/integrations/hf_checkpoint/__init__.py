"""A converted transformers model as a Hugging Face checkpoint that serving stacks load.

``export_pretrained(model, directory, format=...)`` writes a model that ``convert_to_quantized``
converted as a model directory in one of two published fp8 formats, with the codes and steps
the model serves with (``computectx.formats.serving_weights``: no requantization):

- ``"fine-grained-fp8"``: transformers' ``FineGrainedFP8Config`` layout (DeepSeek-V3's), read by
  transformers and vLLM: each quantized ``{module}.weight`` in ``float8_e4m3fn`` with
  ``{module}.weight_scale_inv``, float32, one per 128x128 block (``ceil(N/128), ceil(K/128)``),
  and ``quantization_config = {"quant_method": "fp8", "activation_scheme": "dynamic",
  "weight_block_size": [128, 128], "modules_to_not_convert": [...]}``.
- ``"compressed-tensors"``: llm-compressor's ``float-quantized`` format, read by vLLM and by
  the ``compressed_tensors`` package: ``{module}.weight`` in ``float8_e4m3fn`` with
  ``{module}.weight_scale`` float32, shaped by the strategy (``tensor`` ``(1,)``, ``channel``
  ``(N, 1)``, ``block`` ``(ceil(N/128), ceil(K/128))``), the ``quantization_config`` built with
  ``compressed_tensors``' own classes: one group targeting ``Linear``, dynamic fp8
  activations (per token; per group of 128 for blocks), an ``ignore`` list. An ``mx``
  recipe's weights go to its MXFP8 format (``mxfp8-quantized``, the ``MXFP8`` preset scheme):
  ``weight_scale`` ``(N, K/32)`` in ``uint8``, one E8M0 exponent per 1x32 group, as its
  ``compress_mx_scale`` writes them (dynamic MXFP8 activations).

A 4-bit model (``Fp4Linear`` or ``FrozenFp4Linear`` layers, NVFP4 or MXFP4) goes to
``"compressed-tensors"``' ``nvfp4-pack-quantized`` / ``mxfp4-pack-quantized`` formats,
weight-only (``hf_checkpoint.fp4``: the codes and scales as held, NVFP4's per-tensor scale as
compressed-tensors' ``weight_global_scale``, decoding to our weights at bfloat16 bit for bit).

Both formats' scales are dequantize multipliers (``weight ≈ code * scale``; an E8M0 byte
``b`` is ``2**(b - 127)``), as ``ServingWeight``'s steps are. Which recipe each format
holds, exactly:

============================  ======================  ======================
recipe (granularity)          ``fine-grained-fp8``    ``compressed-tensors``
============================  ======================  ======================
``tensor`` (e4m3 forward)     yes (the step repeated  yes (``tensor``)
                              over every block)
``row``                       refused                 yes (``channel``)
``block``                     yes                     yes (``block``)
``mx`` (MXFP8)                refused                 yes (``mxfp8-quantized``,
                                                      ``group`` of 32)
e5m2 forward                  refused                 refused
``nvfp4``, ``mxfp4``          refused                 yes, weight-only
                                                      (``nvfp4-pack-quantized``,
                                                      ``mxfp4-pack-quantized``)
============================  ======================  ======================

Everything else is written as the model holds it (embeddings, norms, the head, routers, the
linears and experts left unconverted, which the ``modules_to_not_convert`` / ``ignore`` list
names); no scaling state (``fp8_*``). Tensors carry transformers' on-disk names: the model's
own reverse weight conversion (``save_pretrained``'s) lays fused experts out per expert
(``mlp.experts.{e}.gate_proj.weight``, ...), and each scale is its weight's name with the
format's suffix, so reading back is the straight inverse. A tied head is written once, as
``save_pretrained`` writes it.
"""

from __future__ import annotations

from computectx.integrations.hf_checkpoint.export import export_pretrained
from computectx.integrations.hf_checkpoint.formats import (
    EXPORT_FORMATS,
    FORMAT_LAYOUTS,
    ExportFormat,
)
from computectx.integrations.hf_checkpoint.kv import KvCalibration
from computectx.integrations.hf_checkpoint.load import import_kv_calibration, import_pretrained

__all__ = [
    "EXPORT_FORMATS",
    "FORMAT_LAYOUTS",
    "ExportFormat",
    "KvCalibration",
    "export_pretrained",
    "import_kv_calibration",
    "import_pretrained",
]
