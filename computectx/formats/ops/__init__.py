"""The fp8 operators, one module per family: ``tensorwise`` (one step per tensor: the ledger
quantizes, dequantize, the scaled GEMM, the float32 wgrad), ``blockwise`` (a step per block:
the block quantize and the block-scaled GEMM, and the standalone quantize API over every
granularity), ``grouped`` (the grouped GEMMs of mixture-of-experts layers and their autograd
entry point), ``attention`` (decode attention over an fp8 KV cache) and ``fp4`` (the 4-bit
NVFP4/MXFP4 quantize, GEMM and grouped GEMMs, emulated by their twins). Each module holds its
operators' ``torch.library`` registrations, fakes, checks and dispatch; the kernels it
launches sit in ``computectx.kernels`` (imported inside the launching function), the
pure-torch twins in ``computectx.formats.numerics`` under the family's name."""
