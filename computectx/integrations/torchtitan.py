"""computectx fp8 in torchtitan: a model converter, as torchtitan's float8 converter is one.

torchtitan (0.3) builds a model from a config tree, and its converters rewrite that tree before
the build. ``Fp8LinearConverter`` replaces every ``Linear.Config`` it selects with
``Fp8TitanLinear.Config``: the same widths, bias, ``param_init`` and ``sharding_config``, plus
the ``ComputeCtx`` as its text form (``policy``), so the config stays plain data that dumps and
parses. ``Fp8TitanLinear`` is a ``QuantizedLinear`` that is also a torchtitan ``Module`` (config
building, ``init_states``; its scaling buffers start fresh when the model is materialized from
the meta device). Linears left alone: the names in ``filter_fqns``, output heads
(``computectx.formats.HEAD_NAMES``) unless ``convert_head``, widths that are not multiples of 16,
and subclasses of ``Linear`` (their forward is their own). A mixture-of-experts model's
routers keep their ``gate`` linear as it is (routing decides from its scores), and its grouped
experts (``GroupedExperts.Config``) become ``computectx.integrations.torchtitan_moe``'s fp8
class, whose grouped GEMMs run through ``QuantizedExperts.mm`` (``convert_experts``).

Two hooks for the ``ModelSpec``:

- ``fp8_parallelize_fn(base)``: runs the model's own ``parallelize_fn``, then attaches
  ``sync_scaling`` over the ranks that see different data (torchtitan's ``loss`` mesh:
  data parallel and context parallel), after ``fully_shard`` as it must be, with
  torchtitan's loss normalization (``"global"``: each rank's summed loss over the global token
  count, FSDP2's gradient division off);
- ``compose_post_optimizer_build_fn(spec)``: the spec's own ``post_optimizer_build_fn``
  (DeepSeek-V3's, Qwen3's and gpt-oss's ``register_moe_load_balancing_hook``, which moves
  the expert biases) and then fp8's, which registers nothing: the sync merges every rank's
  ledgers at the end of every backward, so after each optimizer step every rank holds them
  all, and the checkpoints torchtitan takes after a step hold every rank's last amaxes with
  no further merge. ``fp8_post_optimizer_build_fn`` alone is kept for ModelSpecs that name
  it, and refuses a model whose MoE layers balance their load when torchtitan's
  load-balancing step hook is not registered before it (it replaced the spec's own hook: the
  biases would not move); so does a hook composed over it.

Tensor-parallel linears (DTensor operands) take the whole tensor's amax by themselves
(``computectx.distributed.tensor_parallel``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from torch import nn
from torchtitan.components.quantization import QuantizationConverter
from torchtitan.models.common.linear import Linear
from torchtitan.protocols.module import Module

from computectx import ComputeCtx
from computectx.distributed import sync_scaling
from computectx.distributed.fp8_amax_sync import LossNormalization
from computectx.formats import FEATURE_MULTIPLE, HEAD_NAMES, Fp4Recipe, QuantizedLinear
from computectx.integrations.torchtitan_moe import (
    convert_experts_configs,
    router_gates,
    swap_config,
)

__all__ = [
    "Fp8LinearConverter",
    "Fp8TitanLinear",
    "compose_post_optimizer_build_fn",
    "fp8_parallelize_fn",
    "fp8_post_optimizer_build_fn",
    "policy_of",
]


def policy_of(policy: str, device: str = "cuda") -> ComputeCtx:
    """A ``ComputeCtx`` from a ``--dtype`` flag (``"fp8_hybrid"``) or a text form."""
    if "=" in policy:
        return ComputeCtx.parse(policy)
    return ComputeCtx.from_flag(policy, device)


class Fp8TitanLinear(QuantizedLinear, Module):
    """``QuantizedLinear`` built from a torchtitan config (``Fp8TitanLinear.Config``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Linear.Config):
        """``Linear.Config`` plus the policy, as ``str(ctx)`` (``ComputeCtx.parse`` reads it)."""

        policy: str

    def __init__(self, config: Config) -> None:
        QuantizedLinear.__init__(
            self,
            config.in_features,
            config.out_features,
            bias=config.bias,
            ctx=ComputeCtx.parse(config.policy),
        )


class Fp8LinearConverter(QuantizationConverter):
    """Replace the selected ``Linear.Config`` entries with ``Fp8TitanLinear.Config``."""

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        policy: str = "fp8_hybrid"
        """A ``--dtype`` flag (``fp8_hybrid``, ``fp8_hybrid_dynamic``, ...) or the text form
        of a ``ComputeCtx``."""

        device: str = "cuda"
        """The device of a policy given as a flag."""

        filter_fqns: list[str] = field(default_factory=list)
        """Linears to leave alone: a layer whose name contains one of these."""

        convert_head: bool = False
        """Whether output heads (``lm_head``, ``output``, ``head``) run in fp8 too."""

        convert_experts: bool = True
        """Whether MoE grouped experts (``GroupedExperts``) run their GEMMs in fp8 too (those
        named in ``filter_fqns`` and those of widths not multiples of 16 stay)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        ctx = policy_of(config.policy, config.device)
        if ctx.recipe is None:
            raise ValueError(f"the policy {config.policy!r} has no fp8 policy: {ctx}")
        if isinstance(ctx.recipe, Fp4Recipe):
            raise NotImplementedError(f"no 4-bit linear is built yet (issue 37): {ctx}")
        self.policy = str(ctx)
        self.multiple = 32 if ctx.recipe.granularity == "mx" else FEATURE_MULTIPLE
        self.converted: list[str] = []
        """The linears and experts converted, by fqn (experts also in ``experts``)."""
        self.experts: list[str] = []

    def selects(self, fqn: str, linear: Any) -> bool:
        """Whether the linear config at ``fqn`` becomes fp8."""
        last = fqn.rsplit(".", 1)[-1].lower()
        return (
            type(linear) is Linear.Config
            and not any(f in fqn for f in self.config.filter_fqns)
            and (self.config.convert_head or last not in HEAD_NAMES)
            and linear.in_features % FEATURE_MULTIPLE == 0
            and linear.out_features % FEATURE_MULTIPLE == 0
        )

    def convert(self, model_config: Any) -> Any:
        """The model config with the selected linears' and experts' configs replaced."""
        gates = router_gates(model_config)
        for fqn, linear, parent, attr in list(model_config.traverse(Linear.Config)):
            if id(linear) in gates or not self.selects(fqn, linear):
                continue
            values = {f.name: getattr(linear, f.name) for f in fields(linear)}
            new = Fp8TitanLinear.Config(**values, policy=self.policy)
            model_config = swap_config(model_config, (parent, attr), new)
            self.converted.append(fqn)
        if self.config.convert_experts:
            model_config, experts = convert_experts_configs(
                model_config, self.policy, self.multiple, self.config.filter_fqns
            )
            self.experts += experts
            self.converted += experts
        return model_config


_SYNC_ATTR = "_computectx_fp8_sync"


def fp8_parallelize_fn(
    base: Callable[..., nn.Module], *, loss_normalization: LossNormalization = "global"
) -> Callable[..., nn.Module]:
    """``base`` (a model's ``parallelize_fn``), then ``sync_scaling`` over the ranks that
    see different data (the ``loss`` mesh), on what ``base`` returned.

    ``loss_normalization`` is torchtitan's by default, ``"global"``: its trainer divides each
    rank's summed loss by the global count of valid tokens and turns FSDP2's gradient
    division off (``disable_fsdp_gradient_division``), so a rank's output gradients are the
    whole batch's, whatever the world size, and a checkpoint saved at another world size
    loads with its gradient ledgers as they are. Pass ``"per_rank"`` for a ``base`` whose
    loss is each rank's mean with FSDP2's averaging (``sync_scaling`` says what it
    changes)."""
    if loss_normalization not in ("per_rank", "global"):
        raise ValueError(
            f"loss_normalization must be 'per_rank' or 'global', got {loss_normalization!r}"
        )

    def parallelize(model: nn.Module, *, parallel_dims: Any, **kwargs: Any) -> nn.Module:
        model = base(model, parallel_dims=parallel_dims, **kwargs)
        mesh = parallel_dims.get_optional_mesh("loss")
        if mesh is not None and mesh.size() > 1:
            sync = sync_scaling(model, mesh, loss_normalization=loss_normalization)
            setattr(model, _SYNC_ATTR, sync)
        return model

    return parallelize


PostOptimizerBuildFn = Callable[[Any, list[nn.Module], Any], None]
"""A ``ModelSpec.post_optimizer_build_fn``: ``(optimizers, model_parts, parallel_dims)``."""

_COMPOSED = "_computectx_composed"


def compose_post_optimizer_build_fn(spec: Any) -> PostOptimizerBuildFn:
    """The hook to set as ``spec.post_optimizer_build_fn``: the spec's own hook (when it has
    one), then fp8's (which adds nothing now, module docstring). Setting
    ``fp8_post_optimizer_build_fn`` instead would *replace* the spec's hook: on DeepSeek-V3,
    Qwen3 MoE and gpt-oss, torchtitan's ``register_moe_load_balancing_hook``, so the expert
    biases would stop moving. Composing twice gives the same hook. Composing a spec whose
    hook already *is* ``fp8_post_optimizer_build_fn`` (the older recipe's line ran first)
    keeps nothing, and the hook returned raises ``ValueError`` when the optimizer is built
    if the model's MoE layers balance their load and torchtitan's load-balancing hook is not
    registered: set the spec's own hook back before composing."""
    if not hasattr(spec, "post_optimizer_build_fn"):
        raise TypeError(
            f"compose_post_optimizer_build_fn takes a torchtitan ModelSpec, got "
            f"{type(spec).__name__}"
        )
    base = spec.post_optimizer_build_fn
    # An older recipe's line ran first (spec.post_optimizer_build_fn =
    # fp8_post_optimizer_build_fn): the spec's own hook is already gone and cannot be found
    # again from here. Nothing is kept, and the composed hook refuses, when the optimizer is
    # built, a model whose MoE layers balance their load (their biases would not move).
    replaced = base is fp8_post_optimizer_build_fn
    if replaced:
        base = None
    if base is not None and getattr(base, _COMPOSED, False):
        composed: PostOptimizerBuildFn = base
        return composed
    if base is not None and not callable(base):
        raise TypeError(f"spec.post_optimizer_build_fn must be callable or None, got {base!r}")

    def post_optimizer_build(
        optimizers: Any, model_parts: list[nn.Module], parallel_dims: Any
    ) -> None:
        if base is not None:
            base(optimizers, model_parts, parallel_dims)
        if replaced:
            _check_balancing_hook(optimizers, model_parts, composed=True)

    setattr(post_optimizer_build, _COMPOSED, True)
    return post_optimizer_build


def _balanced_moe_layers(model_parts: list[nn.Module]) -> list[str]:
    """The names of torchtitan MoE layers with auxiliary-loss-free balancing on."""
    found = []
    for i, part in enumerate(model_parts):
        for name, module in part.named_modules():
            coeff = getattr(module, "load_balance_coeff", None)
            if coeff is not None and hasattr(module, "expert_bias_E"):
                found.append(f"{i}:{name}")
    return found


def fp8_post_optimizer_build_fn(
    optimizers: Any, model_parts: list[nn.Module], parallel_dims: Any
) -> None:
    """Nothing to add after the optimizer is built: the sync that ``fp8_parallelize_fn``
    attached merges every rank's ledgers at the end of every backward, so a checkpoint taken
    after a step already holds them all (a merge here would only repeat it, one more
    collective per step). Kept so that a ``ModelSpec`` naming it still builds; use
    ``compose_post_optimizer_build_fn(spec)``, which keeps the spec's own hook.

    ``ValueError`` when the model has MoE layers that balance their load
    (``load_balance_coeff`` set) and torchtitan's load-balancing step hook (the one
    ``register_moe_load_balancing_hook`` registers) is not on the optimizer: this hook then
    stands where that one was, and the expert biases would silently stop moving. Any other
    step hook (a logger, torchtitan's bf16 state hook) does not count."""
    _check_balancing_hook(optimizers, model_parts, composed=False)


def _is_balancing_hook(hook: object) -> bool:
    # torchtitan's hook is a lambda made inside register_moe_load_balancing_hook: known by
    # its qualified name under that function (and its module, where torchtitan has one).
    hook = getattr(hook, "func", hook)  # a functools.partial around it
    qualname = getattr(hook, "__qualname__", "")
    if not isinstance(qualname, str):
        return False
    owner, _, _ = qualname.partition(".<locals>.")
    if owner != _BALANCING_OWNER[0]:
        return False
    return _BALANCING_OWNER[1] is None or getattr(hook, "__module__", None) == _BALANCING_OWNER[1]


def _balancing_owner() -> tuple[str, str | None]:
    try:
        from torchtitan.components.optimizer.optimizer import register_moe_load_balancing_hook
    except ImportError:  # another torchtitan layout: the name alone
        return "register_moe_load_balancing_hook", None
    return (
        register_moe_load_balancing_hook.__qualname__,
        register_moe_load_balancing_hook.__module__,
    )


_BALANCING_OWNER = _balancing_owner()


def _check_balancing_hook(optimizers: Any, model_parts: list[nn.Module], *, composed: bool) -> None:
    balanced = _balanced_moe_layers(model_parts)
    if not balanced:
        return
    hooks = getattr(optimizers, "_optimizer_step_pre_hooks", None) or {}
    if any(_is_balancing_hook(h) for h in hooks.values()):
        return
    layers = f"{balanced[:3]}{' ...' if len(balanced) > 3 else ''}"
    if composed:
        how = (
            "compose_post_optimizer_build_fn(spec) was given a spec whose "
            "post_optimizer_build_fn was already fp8_post_optimizer_build_fn (the older "
            "recipe's line ran first and replaced the spec's own hook, which cannot be found "
            "again)"
        )
        fix = (
            "Drop the line spec.post_optimizer_build_fn = fp8_post_optimizer_build_fn, or set "
            "the spec's own hook back (torchtitan's register_moe_load_balancing_hook) before "
            "spec.post_optimizer_build_fn = compose_post_optimizer_build_fn(spec)"
        )
    else:
        how = (
            "spec.post_optimizer_build_fn = fp8_post_optimizer_build_fn replaced the spec's own "
            "hook"
        )
        fix = (
            "Set spec.post_optimizer_build_fn = compose_post_optimizer_build_fn(spec) before "
            "building the trainer"
        )
    raise ValueError(
        f"{how}, and the MoE layers {layers} balance their load (load_balance_coeff) through "
        f"torchtitan's register_moe_load_balancing_hook, which is not registered on the "
        f"optimizer: their expert biases would stop moving. {fix}"
    )
