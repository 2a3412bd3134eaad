"""fp8 for serving: decode attention over an fp8 or 16/32-bit KV cache
(``serving.decode_attention``: its checks, kernel limits and entry point). The KV cache's
codes and steps are quantized by ``numerics.kv_quant``, which decode attention's twin reads
too; steps may be stored compact (bf16, e8m0: ``KvFp8.step``), and are widened exactly where
they are read; a future paged cache belongs here."""
