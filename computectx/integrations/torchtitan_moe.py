"""fp8 grouped experts in torchtitan: its ``GroupedExperts`` with their GEMMs in
``QuantizedExperts``.

torchtitan (0.3) keeps a mixture-of-experts layer's routed experts in one ``GroupedExperts``
(``w1_EFD``, ``w3_EFD`` ``(E, hidden, dim)``, ``w2_EDF`` ``(E, dim, hidden)``; gpt-oss's
``GptOssGroupedExperts`` with ``mlp1``/``mlp2`` weights and biases), and runs each projection
through one seam, ``_grouped_mm(A=x, B_t=w.transpose(-2, -1), offs=offs)`` (torchtitan's own
MXFP8 converter overrides the same seam). ``fp8_experts_class(cls)`` is ``cls`` with that seam
running ``QuantizedExperts.mm(x, w, offs)`` instead (one subclass per class, cached), so routing,
the
activation, biases and the token dispatcher stay torchtitan's; the router (``moe.router``,
its ``gate`` a ``Linear``) is never converted.

Two ways in:

- building: ``Fp8LinearConverter`` (``computectx.integrations.torchtitan``) replaces each
  ``GroupedExperts.Config`` with ``fp8_experts_class(cls).Config`` (the same fields plus the
  policy as ``str(ctx)``), as it does linears, and leaves the routers' gates alone;
- a built model: ``TitanExperts``, the ``ExpertsConverter`` registered here, lets
  ``computectx.formats.convert_to_quantized`` switch a built ``GroupedExperts`` to its fp8 class in
  place
  (and back), keeping its parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn
from torchtitan.models.common.moe import GroupedExperts, TokenChoiceTopKRouter

from computectx import ComputeCtx
from computectx.formats import (
    Fp4Recipe,
    QuantizedExperts,
    register_experts_converter,
    select_backend,
)

__all__ = [
    "FP8_ATTR",
    "TitanExperts",
    "convert_experts_configs",
    "experts_fp8_of",
    "fp8_experts_class",
    "router_gates",
]

FP8_ATTR = "computectx_fp8"
"""The attribute of a converted experts module that holds its ``QuantizedExperts``."""

_FP8_CLASSES: dict[type[GroupedExperts], type[GroupedExperts]] = {}  # class -> its fp8 one
_BASES: dict[type[GroupedExperts], type[GroupedExperts]] = {}  # fp8 class -> its base


def experts_fp8_of(ctx: ComputeCtx) -> QuantizedExperts:
    """The ``QuantizedExperts`` of ``ctx``: its fp8 policy, the backend of ``ctx.device``."""
    if ctx.recipe is None:
        raise ValueError(f"the policy has no fp8 policy: {ctx}")
    if isinstance(ctx.recipe, Fp4Recipe):
        raise NotImplementedError(f"no 4-bit grouped GEMM is built yet (issue 37): {ctx}")
    return QuantizedExperts(ctx.recipe, select_backend(ctx.device)[0])


def fp8_experts_class(base: type[GroupedExperts]) -> type[GroupedExperts]:
    """``base`` (a ``GroupedExperts`` class) with its ``_grouped_mm`` in fp8; cached."""
    if base in _BASES:
        return base
    if base in _FP8_CLASSES:
        return _FP8_CLASSES[base]
    if not (isinstance(base, type) and issubclass(base, GroupedExperts)):
        raise TypeError(f"fp8_experts_class takes a GroupedExperts class, got {base!r}")
    parent_config: Any = base.Config

    class Fp8Experts(base):  # type: ignore[misc]
        @dataclass(kw_only=True, slots=True)
        class Config(parent_config):  # type: ignore[misc]
            """``base.Config`` plus the policy, as ``str(ctx)`` (``ComputeCtx.parse``)."""

            policy: str

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            setattr(self, FP8_ATTR, experts_fp8_of(ComputeCtx.parse(config.policy)))

        def _grouped_mm(  # torchtitan's seam, its keyword names
            self,
            *,
            A: torch.Tensor,  # noqa: N803
            B_t: torch.Tensor,  # noqa: N803
            offs: torch.Tensor,
        ) -> torch.Tensor:
            fp8: QuantizedExperts = vars(self)[FP8_ATTR]
            return fp8.mm(A, B_t.transpose(-2, -1), offs)

    Fp8Experts.__name__ = Fp8Experts.__qualname__ = f"Fp8{base.__name__}"
    _FP8_CLASSES[base] = Fp8Experts
    _BASES[Fp8Experts] = base
    return Fp8Experts


def router_gates(model_config: Any) -> set[int]:
    """The ids of every router's gate config (``TokenChoiceTopKRouter.Config.gate``)."""
    return {id(r.gate) for _, r, _, _ in model_config.traverse(TokenChoiceTopKRouter.Config)}


def convert_experts_configs(
    model_config: Any, policy: str, multiple: int, skip: list[str]
) -> tuple[Any, list[str]]:
    """``model_config`` with every ``GroupedExperts.Config`` (not named in ``skip``, widths
    multiples of ``multiple``) replaced by its fp8 class's; the fqns replaced."""
    done: list[str] = []
    for fqn, cfg, parent, attr in list(model_config.traverse(GroupedExperts.Config)):
        owner = type(cfg)._owner
        if owner in _BASES or any(f in fqn for f in skip):
            continue
        if cfg.dim % multiple or cfg.hidden_dim % multiple:
            continue
        fp8_config: Any = fp8_experts_class(owner).Config
        new = fp8_config(**_fields(cfg), policy=policy)
        model_config = swap_config(model_config, (parent, attr), new)
        done.append(fqn)
    return model_config, done


def _fields(cfg: Any) -> dict[str, Any]:
    return {f.name: getattr(cfg, f.name) for f in fields(cfg)}


def swap_config(model_config: Any, place: tuple[Any, Any], new: Any) -> Any:
    """``model_config`` with ``new`` put at ``place``, a ``(parent, attr)`` pair from
    ``model_config.traverse``: ``new`` itself when the parent is ``None`` (the root)."""
    parent, attr = place
    if parent is None:
        return new
    if isinstance(parent, list):
        parent[attr] = new
    else:
        setattr(parent, attr, new)
    return model_config


class TitanExperts:
    """The ``ExpertsConverter`` for built torchtitan ``GroupedExperts`` (any subclass)."""

    def weights(self, module: nn.Module) -> dict[str, torch.Tensor] | None:
        """The 3-D expert weights (``(E, out, in)`` as torchtitan stores them) by name."""
        if not isinstance(module, GroupedExperts):
            return None
        found = {n: p for n, p in module.named_parameters(recurse=False) if p.dim() == 3}
        return found or None

    def current(self, module: nn.Module) -> QuantizedExperts | None:
        """The module's ``QuantizedExperts`` if it is converted."""
        found = vars(module).get(FP8_ATTR)
        return found if type(module) in _BASES and isinstance(found, QuantizedExperts) else None

    def convert(self, module: nn.Module, fp8: QuantizedExperts | None) -> None:
        """Switch ``module`` to its fp8 class with ``fp8`` (``None``: back to its own)."""
        if not isinstance(module, GroupedExperts):
            raise TypeError(f"not a torchtitan GroupedExperts: {type(module).__name__}")
        if fp8 is None:
            module.__class__ = _BASES.get(type(module), type(module))
            vars(module).pop(FP8_ATTR, None)
            return
        if not isinstance(fp8, QuantizedExperts):
            raise TypeError(f"convert takes a QuantizedExperts or None, got {type(fp8).__name__}")
        module.__class__ = fp8_experts_class(type(module))
        setattr(module, FP8_ATTR, fp8)


register_experts_converter(TitanExperts())
