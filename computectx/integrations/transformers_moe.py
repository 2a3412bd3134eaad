"""fp8 experts for transformers 5's mixture-of-experts models, through its ``ExpertsInterface``.

transformers 5 stores a model's routed experts as 3-D parameters in one module per layer
(``Qwen3MoeExperts``, ``MixtralExperts``, ``GptOssExperts``, ...), decorated with
``use_experts_implementation``: the module's ``forward`` looks up
``self.config._experts_implementation`` in ``ALL_EXPERTS_FUNCTIONS`` (``"grouped_mm"`` by
default) and runs that function. Importing this module registers one more function there,
``"computectx_fp8"`` (``IMPLEMENTATION``), and an ``ExpertsConverter`` with
``computectx.formats.register_experts_converter``, so ``convert_to_quantized(model, ctx)`` converts
the
experts of a transformers model like its linears (``computectx.formats`` imports this module when
a model holds transformers modules). No transformers class is patched.

Converting one experts module (``TransformersExperts.convert``) stores the ``QuantizedExperts`` on
it
(attribute ``computectx_fp8``, ``FP8_ATTR``) and gives it its own shallow copy of its config
whose ``_experts_implementation`` is ``"computectx_fp8"``. The model's config is left as it
was: ``save_pretrained`` writes what it wrote before, a module left unconverted (a
``module_filter``) keeps its implementation, and ``model.set_experts_implementation`` later
does not undo the conversion (``convert(module, None)`` does: it restores the config the module
had). ``freeze_experts_for_serving(module)`` then holds the two expert weights as fp8 codes
(``formats.ops.grouped_frozen``), dropping the parameters.

The function is transformers' ``grouped_mm`` experts forward with the two grouped GEMMs run by
``QuantizedExperts.mm``: the (token, expert) pairs sorted by expert (stable), int32 cumulative
``offs``, ``gate_up_proj`` (or ``up_proj``), the module's ``_apply_gate`` (or ``act_fn``),
``down_proj``, the routing weights, and each token's ``top_k`` rows summed. The layouts the
decorator declares are all served: transposed weights (gpt-oss: ``(E, in, out)``, passed to
the GEMM as the ``(E, out, in)`` view), biases (added per row after the GEMM), interleaved
gate/up columns (the module's own ``_apply_gate`` splits them), ungated experts, a post-expert
norm, and expert parallelism's sentinel rows (ids ``>= num_experts`` sort to the end, past
``offs[-1]``, and come out zero). Routers (``Qwen3MoeTopKRouter``, ...) hold no 3-D experts and
are never converted; they run at the model's precision.
"""

from __future__ import annotations

import copy
import inspect
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, use_experts_implementation

from computectx.formats import QuantizedExperts, ServingWeight, register_experts_converter
from computectx.formats.seam import (
    freeze_experts,
    frozen_experts_mm,
    guard_whole_loads,
    held_experts,
)

__all__ = [
    "FP8_ATTR",
    "IMPLEMENTATION",
    "TransformersExperts",
    "fp8_experts_forward",
    "freeze_experts_for_serving",
    "load_fp8_pretrained",
]

IMPLEMENTATION = "computectx_fp8"
"""The name of the experts function in transformers' ``ALL_EXPERTS_FUNCTIONS``."""

FP8_ATTR = "computectx_fp8"
"""The attribute of a converted experts module that holds its ``QuantizedExperts``."""

_HP_CONFIG = "_computectx_hp_config"  # the config the module had before it was converted


class _Probe(nn.Module):
    """Decorated once, to learn the code of the decorator's dispatching ``forward``."""

    def forward(self, *args: Any) -> Any:
        return None


_DISPATCH = use_experts_implementation(_Probe).forward.__code__


def _dispatches_here(module: nn.Module) -> bool:
    """Whether ``type(module).forward`` is ``use_experts_implementation``'s dispatcher, reading
    ``ALL_EXPERTS_FUNCTIONS`` (not another interface, as transformers' own fp8 experts do)."""
    forward = getattr(type(module), "forward", None)
    if getattr(forward, "__code__", None) is not _DISPATCH:
        return False
    assert forward is not None
    found = inspect.getclosurevars(forward).nonlocals.get("experts_interface")
    return found is ALL_EXPERTS_FUNCTIONS


def _names(module: nn.Module) -> tuple[str, str] | None:
    """The names of a decorated module's two expert weights, ``None`` when they are not 3-D
    parameters (or frozen codes, ``_held``) of ``num_experts`` experts."""
    first = "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"
    experts = getattr(module, "num_experts", None)
    for name in (first, "down_proj"):
        p = getattr(module, name, None)
        p = p if isinstance(p, nn.Parameter) else _held(module, name)
        if p is None or p.dim() != 3 or p.shape[0] != experts:
            return None
    return first, "down_proj"


def _held(module: nn.Module, name: str) -> torch.Tensor | None:
    """The frozen codes ``[E, N, K]`` of expert weight ``name`` (``freeze_experts_for_serving``),
    ``None`` when it is not frozen."""
    return module._buffers.get(name + "_fp8") if getattr(module, name, None) is None else None


def _out_in(module: nn.Module, name: str) -> torch.Tensor:
    """Expert weight ``name`` as ``(E, out, in)``: its frozen codes, or the parameter."""
    held = _held(module, name)
    return held if held is not None else _as_out_in(module, getattr(module, name))


def _as_out_in(module: nn.Module, w: torch.Tensor) -> torch.Tensor:
    """``w`` as ``(E, out, in)``: a transposed layout (gpt-oss) as its transposed view."""
    return w.transpose(-2, -1) if getattr(module, "is_transposed", False) else w


class TransformersExperts:
    """The ``ExpertsConverter`` for transformers' experts modules (any class decorated with
    ``use_experts_implementation`` on ``ALL_EXPERTS_FUNCTIONS``)."""

    serves_frozen = True  # fp8_experts_forward reads frozen codes (freeze_experts_for_serving)

    def weights(self, module: nn.Module) -> dict[str, torch.Tensor] | None:
        """The two expert weights as ``(E, out, in)`` (the transposed views for a transposed
        layout), by parameter name; ``None`` for any other module."""
        if not _dispatches_here(module):
            return None
        names = _names(module)
        if names is None:
            return None
        return {name: _out_in(module, name) for name in names}

    def current(self, module: nn.Module) -> QuantizedExperts | None:
        """The module's ``QuantizedExperts`` if it is converted."""
        found = vars(module).get(FP8_ATTR)
        return found if isinstance(found, QuantizedExperts) else None

    def convert(self, module: nn.Module, fp8: QuantizedExperts | None) -> None:
        """From now on the module's GEMMs run through ``fp8.mm``; ``None``: as before."""
        state = vars(module)
        if fp8 is None:
            if any(_held(module, n) is not None for n in ("gate_up_proj", "up_proj", "down_proj")):
                raise ValueError(
                    f"{type(module).__name__} is frozen for serving: it holds fp8 codes, no "
                    f"expert weights to run another way; convert a copy made before freezing"
                )
            if _HP_CONFIG in state:
                module.config = state.pop(_HP_CONFIG)
            state.pop(FP8_ATTR, None)
            return
        if not isinstance(fp8, QuantizedExperts):
            raise TypeError(f"convert takes a QuantizedExperts or None, got {type(fp8).__name__}")
        if self.weights(module) is None:
            raise ValueError(
                f"{type(module).__name__} is not a transformers experts module with 3-D "
                f"expert weights dispatched through ALL_EXPERTS_FUNCTIONS"
            )
        if _HP_CONFIG not in state:
            own: Any = copy.copy(module.config)
            # The internal field: the property's setter would also set the sub-configs,
            # which the shallow copy shares with the model's config.
            own._experts_implementation_internal = IMPLEMENTATION
            state[_HP_CONFIG] = module.config
            module.config = own
        state[FP8_ATTR] = fp8


def _grouped(
    fp8: QuantizedExperts,
    module: nn.Module,
    x: torch.Tensor,
    name: str,
    offs: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """One grouped projection of the sorted rows ``x``, with its bias if it has one: frozen
    codes at ``x``'s dtype (there is no weight whose dtype to take), else the weight."""
    held = held_experts(module, name, fp8)
    if held is not None:
        out = frozen_experts_mm(fp8, x, held, offs)
    else:
        w = getattr(module, name)
        out = fp8.mm(x.to(w.dtype), _as_out_in(module, w), offs)
    if getattr(module, "has_bias", False):
        out = out + getattr(module, f"{name}_bias")[ids]
    return out


def fp8_experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """transformers' ``grouped_mm`` experts forward, its grouped GEMMs in fp8 (the module's
    ``QuantizedExperts``); registered as ``"computectx_fp8"`` in ``ALL_EXPERTS_FUNCTIONS``."""
    fp8 = vars(self).get(FP8_ATTR)
    if not isinstance(fp8, QuantizedExperts):
        raise RuntimeError(
            f"{type(self).__name__} runs experts_implementation={IMPLEMENTATION!r} but holds no "
            f"QuantizedExperts: convert the model with computectx.formats.convert_to_quantized("
            f"model, ctx) instead of naming the implementation"
        )
    experts: Any = self.num_experts
    n_experts = int(experts)
    top_k = top_k_index.size(-1)
    n_tokens, hidden = hidden_states.shape

    # (token, expert) pairs sorted by expert; sentinels (>= n_experts) sort past offs[-1].
    ids, perm = torch.sort(top_k_index.reshape(-1), stable=True)
    x = hidden_states[perm // top_k]
    pair_weights = top_k_weights.reshape(-1)[perm]
    bounds = torch.arange(1, n_experts + 1, device=ids.device, dtype=ids.dtype)
    offs = torch.searchsorted(ids, bounds, out_int32=True)  # pairs with id < g + 1
    sentinel = None
    if getattr(self, "_is_expert_parallel", False):
        sentinel = (ids >= n_experts).unsqueeze(-1)
        ids = ids.clamp(max=n_experts - 1)  # in bounds for the bias gathers

    gated = bool(getattr(self, "has_gate", True))
    h = _grouped(fp8, self, x, "gate_up_proj" if gated else "up_proj", offs, ids)
    h = getattr(self, "_apply_gate" if gated else "act_fn")(h)
    y = _grouped(fp8, self, h, "down_proj", offs, ids)
    if getattr(self, "has_post_expert_norm", False):
        norm: Any = self.post_expert_norm
        y = norm(y)
    if sentinel is not None:
        y = y.masked_fill(sentinel, 0.0)
    y = y * pair_weights.unsqueeze(-1)

    back = torch.empty_like(perm)
    back[perm] = torch.arange(perm.numel(), device=perm.device)
    out: torch.Tensor = y[back].view(n_tokens, top_k, hidden).sum(dim=1)
    return out.to(hidden_states.dtype)


ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, fp8_experts_forward)
register_experts_converter(TransformersExperts())


def freeze_experts_for_serving(
    module: nn.Module, weights: Mapping[str, ServingWeight] | None = None
) -> nn.Module:
    """Hold a converted transformers experts module's two expert weights as fp8 codes and
    steps, as ``QuantizedLinear.freeze_for_serving`` holds a linear's (``formats.ops.
    grouped_frozen``): buffers ``{name}_fp8`` and ``{name}_step`` (``gate_up_proj_fp8``, ...;
    the codes ``[E, out, in]`` as the GEMM multiplies them, a transposed layout's too), the
    parameters dropped (``None``: only ``fp8_experts_forward`` runs the module, and it reads
    the codes). ``weights``: a ``ServingWeight`` for each expert weight name, copied bit for
    bit after one check (else ``TypeError``/``ValueError``, nothing changed); without it the
    codes are those the forward makes. Later forwards run each projection at the rows'
    dtype. Cast the model (``.to(dtype)``) before freezing: a cast afterwards would widen the
    codes, and the forward then refuses them. ``ValueError`` for a module that is not a
    converted experts module. Returns ``module``."""
    converter = TransformersExperts()
    fp8, weights_now = converter.current(module), converter.weights(module)
    if fp8 is None or weights_now is None:
        raise ValueError(
            f"freeze_experts_for_serving takes a transformers experts module converted by "
            f"convert_to_quantized, got {type(module).__name__}"
            f"{'' if weights_now is None else ' in high precision'}. Nothing was changed"
        )
    freeze_experts(module, fp8, weights_now, weights)
    guard_whole_loads(module)  # load_state_dict checks the codes and steps before any load
    return module


def _is_fp8_state(key: str) -> bool:
    return key.rsplit(".", 1)[-1].startswith("fp8_")


def load_fp8_pretrained(model: nn.Module, path: str | os.PathLike[str]) -> tuple[str, ...]:
    """Load the fp8 scaling state that ``save_pretrained`` wrote at ``path`` (a directory of
    ``*.safetensors`` files, sharded or not, or one file) into ``model``, which
    ``from_pretrained`` built from the same directory and ``convert_to_quantized`` converted as the
    saved model was. Returns the keys loaded.

    The reload of a transformers model, MoE or not: ``save_pretrained`` writes a MoE
    block's experts one by one under their checkpoint names (``experts.0.gate_proj.weight``,
    ...; Mixtral's ``block_sparse_moe``), while the live module holds them fused
    (``gate_up_proj``), so ``load_state_dict(load_file(...))`` reports missing and
    unexpected keys. ``from_pretrained`` already merged the weights; this loads only the
    ``fp8_*`` keys. Checked before anything loads: every one of the model's fp8 keys must be
    in the checkpoint and every fp8 key of the checkpoint in the model (``ValueError``
    naming them: another conversion, another ``min_features``), and each layer's state
    against its policy (``load_state_dict``'s own checks). A refused call changes nothing."""
    from safetensors.torch import load_file

    root = Path(path)
    files = sorted(root.glob("*.safetensors")) if root.is_dir() else [root]
    if not files or not all(f.is_file() for f in files):
        raise ValueError(f"load_fp8_pretrained found no .safetensors file at {str(root)!r}")
    saved: dict[str, torch.Tensor] = {}
    for f in files:
        saved.update({k: v for k, v in load_file(f).items() if _is_fp8_state(k)})
    own = {k for k in model.state_dict() if _is_fp8_state(k)}
    if not own:
        raise ValueError(
            "load_fp8_pretrained: the model holds no fp8 scaling state; call convert_to_quantized "
            "on it first, as the saved model was converted"
        )
    missing, unexpected = sorted(own - saved.keys()), sorted(saved.keys() - own)
    if missing or unexpected:
        raise ValueError(
            f"load_fp8_pretrained: the checkpoint at {str(root)!r} and the model hold other "
            f"fp8 layers (convert the model as the saved one was): missing from the "
            f"checkpoint {missing[:4]}{' ...' if len(missing) > 4 else ''}, not in the model "
            f"{unexpected[:4]}{' ...' if len(unexpected) > 4 else ''}"
        )
    model.load_state_dict(saved, strict=False)
    return tuple(sorted(saved))
