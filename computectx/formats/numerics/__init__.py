"""The pure-torch twins: the granularity vocabulary and block layouts, the ledger layout, the
tensor-wise and block-wise quantizes and GEMMs with their error bounds, the inline quantize,
and decode attention's twin. The oracle in tests and the backend without Triton; nothing here
registers an operator, holds state or imports another fp8 room."""
