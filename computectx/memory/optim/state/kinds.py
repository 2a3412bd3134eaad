"""Which quantization map each optimizer state tensor takes, by its torch.optim name.

Signed state (first moments, momentum, averages of gradients or weights) takes the signed
map; state that is never negative (second moments, sums of squares, maxima of magnitudes,
step sizes) takes the unsigned one, which spends every code on magnitudes. A name no
torch.optim class uses is read as signed: the signed map holds any value, the unsigned one
would lose the sign.
"""

from __future__ import annotations

from computectx.memory.optim.state.codecs import Kind

__all__ = ["SIGNED_STATE", "UNSIGNED_STATE", "kind_of"]

SIGNED_STATE = frozenset({"exp_avg", "momentum_buffer", "grad_avg", "ax", "prev"})
"""Names of signed state: Adam's first moment, SGD's momentum, centered RMSprop's mean
gradient, ASGD's average, Rprop's previous gradient."""

UNSIGNED_STATE = frozenset(
    {"exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum", "exp_inf", "acc_delta", "step_size"}
)
"""Names of non-negative state: second moments (Adam, RMSprop, Adadelta), AMSGrad's maximum,
Adagrad's sum of squares, Adamax's infinity norm, Adadelta's accumulated updates, Rprop's
step sizes."""


def kind_of(name: str) -> Kind:
    """``"unsigned"`` for the names of ``UNSIGNED_STATE``, ``"signed"`` for any other."""
    return "unsigned" if name in UNSIGNED_STATE else "signed"
