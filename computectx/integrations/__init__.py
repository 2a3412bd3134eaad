"""Adapters for training frameworks that need something of their own (each imports its
framework: install the ``integrations`` extra). HF accelerate and Lightning Fabric need none:
see docs/integrations.md.

- ``computectx.integrations.torchtitan``: a torchtitan model converter that rewrites the model
  config's linears into ``QuantizedLinear`` ones, and the ``parallelize_fn`` /
  ``post_optimizer_build_fn`` hooks that keep their scaling in step on many ranks.
- ``computectx.integrations.transformers_cache``: ``CtxStaticCache``, a transformers ``Cache``
  that stores K and V as ``ctx.kv`` says (16/32-bit, or fp8 codes with their steps), static
  and compile-friendly like ``StaticCache``, and ``calibrate_transformers_kv`` for the
  calibrated fp8 schemes (needs transformers, which the dev extra installs; see
  docs/serving.md).
- ``computectx.integrations.transformers_moe``: transformers 5's mixture-of-experts experts
  (Qwen3-MoE, Mixtral, gpt-oss) in fp8 through transformers' own ``ExpertsInterface``;
  ``convert_to_quantized`` imports it when a model holds a transformers module (docs/moe.md).
- ``computectx.integrations.torchtitan_moe``: torchtitan's grouped experts in fp8, for its
  converter and for ``convert_to_quantized`` on a built model (docs/moe.md).
- ``computectx.integrations.hf_checkpoint``: ``export_pretrained``, a converted transformers
  model written as a Hugging Face directory in transformers' fine-grained FP8 or
  compressed-tensors' FP8 format (the codes and steps it serves with), for vLLM, SGLang and
  transformers to load.
"""
