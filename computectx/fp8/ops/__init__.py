"""The fp8 operations: the one registry of ``computectx::`` operators (``ops.registry``), the
checked entry points (``ops.quantize``, ``ops.gemm``), the ledger and block quantizes behind
them, and the cuBLAS and Triton launchers (``ops.triton`` is the one importer of
``computectx.kernels``)."""
