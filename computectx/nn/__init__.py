"""Blocks that thread a ``ComputeCtx``: precise ops, RMSNorm, RoPE, attention with a KV
cache (at a dtype, or fp8 codes and steps: ``KVCache``, ``calibrate_kv``), a SwiGLU MLP,
a dropless mixture of experts (``MoE``: a ``Router``, ``GroupedExperts`` run by grouped GEMMs,
optional shared experts, auxiliary-loss-free or auxiliary-loss balancing), and ``ByteLM``, a
small byte-level decoder-only LM (dense or MoE) with generation and a static-shape decode step.

Their GEMMs run at ``ctx.compute`` with float32 accumulation through ``Gemm``: torch's
kernel, or, on a CPU without native bf16/f16 GEMMs, the same numerics as float32 GEMMs of the
exactly widened operands rounded once (``GemmPath.UPCAST``).

Every module takes ``ctx`` in its constructor, so the policy is decided once and read
everywhere. When ``ctx.recipe`` is set, the attention and MLP linears are built as
``computectx.formats.QuantizedLinear`` (through ``convert_to_quantized``); the LM's output head
stays a
plain ``nn.Linear``; an ``MoE``'s experts run ``quantized_grouped_mm`` and its router stays precise.
"""

from computectx.nn.attention import Attention, Float32MatmulPrecisionWarning
from computectx.nn.calibrate import calibrate_kv
from computectx.nn.experts import GroupedExperts, grouped_linear
from computectx.nn.gemm import Gemm, GemmPath, forced_gemm_path
from computectx.nn.generate import DecodeStep, decode_logits, generate, next_token
from computectx.nn.kv_cache import DecodeKernelFallbackWarning, KVCache, kv_bytes_per_token
from computectx.nn.lm import BYTE_VOCAB, ByteLM, DecoderBlock, LMConfig, decode_bytes, encode_bytes
from computectx.nn.mlp import MLP, swiglu
from computectx.nn.moe import ExpertDispatch, LoadBalance, MoE, Router, RouterScore, Routing
from computectx.nn.norm import RMSNorm
from computectx.nn.params import apply_recipe
from computectx.nn.precise import apply_rope, rms_norm, rope_tables, softmax
from computectx.nn.rope import RotaryEmbedding

__all__ = [
    "BYTE_VOCAB",
    "MLP",
    "Attention",
    "ByteLM",
    "DecodeKernelFallbackWarning",
    "DecodeStep",
    "DecoderBlock",
    "ExpertDispatch",
    "Float32MatmulPrecisionWarning",
    "Gemm",
    "GemmPath",
    "GroupedExperts",
    "KVCache",
    "LMConfig",
    "LoadBalance",
    "MoE",
    "RMSNorm",
    "RotaryEmbedding",
    "Router",
    "RouterScore",
    "Routing",
    "apply_recipe",
    "apply_rope",
    "calibrate_kv",
    "decode_bytes",
    "decode_logits",
    "encode_bytes",
    "forced_gemm_path",
    "generate",
    "grouped_linear",
    "kv_bytes_per_token",
    "next_token",
    "rms_norm",
    "rope_tables",
    "softmax",
    "swiglu",
]


# The 0.1.0 names, plain aliases of the names above until 0.3.0 (CHANGELOG.md; not in __all__).
apply_fp8_policy = apply_recipe
