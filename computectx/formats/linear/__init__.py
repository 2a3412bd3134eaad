"""The fp8 linear: its plan, the router and the tensor-wise and block-wise autograd functions,
recompute and autocast, the fp8 weight subclasses, and ``QuantizedLinear`` (``linear.module``)."""
