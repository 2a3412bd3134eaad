"""What the FSDP2 quantized-gather subclasses share: a wrapper around a high-precision shard.

``WeightGatheredQuantized`` (a ``QuantizedLinear`` weight, ``fp8_all_gather``),
``ExpertsGatheredQuantized`` (3-D expert weights, ``fp8_expert_gather``) and
``WeightGatheredFp4`` (an ``Fp4Linear`` weight, ``fp4_all_gather``) are all
``GatheredAsFp8``: a tensor subclass over the shard ``hp`` whose every op runs on ``hp``
(ops that take a piece of the weight, ``SHARD_OPS``, return the same kind of wrapper over the
piece), traceable (flattened to ``hp`` and the subclass's ``meta``), and saved as a plain
tensor (``plain_state_dict_hook``). Each subclass adds FSDP2's two extension points,
``fsdp_pre_all_gather`` and ``fsdp_post_all_gather``: what it sends and how it rebuilds.

The rest is the plumbing those extension points and the ``enable_*`` calls share: the shard
group (``shard_group``, ``shard_world``), the high-precision fallback (``hp_inputs``,
``hp_gathered``, ``warn_fallback``), FSDP2's padding (``padded``), the backward's re-gather
(``in_backward``), and wrapping a model's linear weights (``wrap_linear_weights``).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map
from typing_extensions import Self

__all__ = [
    "SHARD_OPS",
    "GatherMeta",
    "GatheredAsFp8",
    "check_row_shard",
    "check_untied_experts",
    "expert_skip",
    "hp_gathered",
    "hp_inputs",
    "in_backward",
    "padded",
    "parameter_holders",
    "plain_state_dict_hook",
    "shard_group",
    "shard_world",
    "warn_fallback",
    "wrap_linear_weights",
]

_aten = torch.ops.aten
SHARD_OPS = {
    _aten.detach.default,
    _aten.alias.default,
    _aten.view.default,
    _aten.as_strided.default,
    _aten.slice.Tensor,
    _aten.split.Tensor,
    _aten.split_with_sizes.default,
    _aten.chunk.default,
    _aten.narrow.default,
    _aten.clone.default,
    _aten.copy_.default,
    _aten.empty_like.default,
    _aten.new_zeros.default,
    _aten.new_empty.default,
    _aten._to_copy.default,
    _aten._pin_memory.default,
}
"""Ops whose result is (a piece of) the same weight: FSDP2 builds the shard with them, and the
result must stay the wrapper (its gather hooks)."""


class GatheredAsFp8(torch.Tensor):
    """A weight FSDP2 all-gathers as fp8, wrapping its high-precision tensor ``hp``.

    ``meta`` is what the subclass's gathers share (flattened with the tensor, handed to every
    piece); ``label`` names the weight in its repr.
    """

    _hp: torch.Tensor
    _meta: Any

    @staticmethod
    def __new__(cls, hp: torch.Tensor, meta: Any) -> Self:
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            hp.shape,
            strides=hp.stride(),
            storage_offset=hp.storage_offset(),
            dtype=hp.dtype,
            device=hp.device,
            layout=hp.layout,
            requires_grad=hp.requires_grad,
        )
        out._hp = hp
        out._meta = meta
        return out

    def __init__(self, hp: torch.Tensor, meta: Any) -> None:
        super().__init__()

    @property
    def hp(self) -> torch.Tensor:
        """The high-precision tensor (the master copy of this shard)."""
        return self._hp

    def _label(self) -> str:
        return str(self._meta)

    # A traceable wrapper subclass: module.to(dtype) / .half() then swap the whole tensor
    # (torch.utils.swap_tensors) instead of setting .data, which would leave _hp behind.
    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["_hp"], self._meta

    @classmethod
    def __tensor_unflatten__(
        cls, inner: dict[str, torch.Tensor], meta: Any, outer_size: Any, outer_stride: Any
    ) -> Self:
        return cls(inner["_hp"], meta)

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        metas: list[Any] = []
        inference: list[bool] = []

        def unwrap(x: Any) -> Any:
            if isinstance(x, cls):
                metas.append(x._meta)
                inference.append(x.is_inference())
                return x._hp
            return x

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        if func not in SHARD_OPS or not metas:
            return out
        meta = metas[-1]  # the last wrapper among the arguments, as each class kept it
        # A piece of a normal tensor is a normal tensor, under inference_mode too (a view
        # shares its base's version counter, which an inference tensor has none of: FSDP2's
        # lazy init views the shard at the first forward, which may run under the mode).
        with torch.inference_mode(inference[-1]):
            return tree_map(lambda x: cls(x, meta) if isinstance(x, torch.Tensor) else x, out)

    def __repr__(self, *, tensor_contents: object = None) -> str:  # type: ignore[override]
        return f"{type(self).__name__}({self._label()}, {self._hp!r})"


def _plain(value: Any) -> Any:
    # Checkpoints hold plain tensors: the subclass is a runtime arrangement, not data.
    local = value.to_local() if isinstance(value, DTensor) else value
    if not isinstance(local, GatheredAsFp8):
        return value
    if isinstance(value, DTensor):
        return DTensor.from_local(
            local.hp,
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    return local.hp


def plain_state_dict_hook(
    attrs: tuple[str, ...],
) -> Callable[[nn.Module, dict[str, Any], str, Any], None]:
    """A state-dict post-hook that saves the module's ``attrs`` as plain tensors (DTensors of
    plain tensors under FSDP2), whatever gather wrapper they are (a ``partial``: a model
    holding it still pickles)."""
    return functools.partial(_save_plain, attrs)


def _save_plain(
    attrs: tuple[str, ...],
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
) -> None:
    for attr in attrs:
        key = prefix + attr
        if key in state_dict:
            state_dict[key] = _plain(state_dict[key])


# ----- What the extension points share --------------------------------------------------------

_M = TypeVar("_M", bound=nn.Module)


class GatherMeta:
    """What a linear weight's shards share (its ``GatheredAsFp8`` meta): its name, which is
    also its label; a subclass adds what the next gather reuses of the last forward's.

    The layer is not kept here: FSDP2 hands the owning module to each gather, so a copy of
    the model (``copy.deepcopy``, an EMA copy) quantizes through its own layers.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return self.name

    def module_as(self, module: nn.Module, kind: type[_M], how: str, what: str) -> _M:
        """``module`` as the ``kind`` this weight gathers for (``TypeError`` naming both
        otherwise); ``how`` and ``what`` word the message ("as fp8", "a QuantizedLinear")."""
        if not isinstance(module, kind):
            raise TypeError(
                f"{self.name!r} gathers {how} for {what}, but FSDP2 gathered it for "
                f"a {type(module).__name__}"
            )
        return module


def shard_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The group FSDP2 shards over: the mesh's last dimension (of an HSDP mesh, whose
    replicas hold equal shards, so a MAX over it is the whole weight's; of a 1-D mesh, the
    mesh)."""
    return mesh.get_group(mesh.ndim - 1)


def shard_world(mesh: DeviceMesh) -> int:
    """How many shards FSDP2 cuts a weight into (the size of ``shard_group``)."""
    return mesh.size(mesh.ndim - 1)


def in_backward() -> bool:
    """Whether this gather is FSDP2's re-gather for the backward: the autograd engine runs
    its pre-backward hook inside a graph task."""
    task: int = torch._C._current_graph_task_id()
    return task != -1


def check_row_shard(name: str, shard: torch.Tensor, outer_size: torch.Size, how: str) -> None:
    """``ValueError`` naming the weight when FSDP2 shards it along another dim than its rows
    (a ``shard_placement_fn`` giving ``Shard(1)``): the quantized gather sends row shards'
    codes and scales. The same on every rank (the shapes), before any collective."""
    if tuple(shard.shape[1:]) != tuple(outer_size[1:]):
        raise ValueError(
            f"{name!r} ({tuple(outer_size)}) is sharded by FSDP2 along another dim than its "
            f"rows (this rank holds {tuple(shard.shape)}): a weight gathers {how} only in row "
            f"shards (Shard(0), FSDP2's default). Shard it along dim 0, or leave the layer out "
            f"of the quantized gather (module_filter)"
        )


def padded(data: torch.Tensor, outer_size: torch.Size, world: int) -> torch.Tensor:
    """``data`` zero-padded along dim 0 to ``ceil(rows / world)``: FSDP2 pads uneven shards
    to that and expects inputs that size."""
    rows = -(-outer_size[0] // world)
    if data.shape[0] == rows:
        return data
    out = data.new_zeros((rows, *data.shape[1:]))
    out[: data.shape[0]].copy_(data)
    return out


def hp_inputs(
    hp: torch.Tensor, outer_size: torch.Size, world: int, mp_policy: Any
) -> tuple[tuple[torch.Tensor, ...], Any]:
    """A shard that gathers high precision: ``fsdp_pre_all_gather``'s answer (the shard at
    FSDP2's ``param_dtype``, as any other parameter, padded; metadata ``("hp",)``)."""
    dtype = getattr(mp_policy, "param_dtype", None) or hp.dtype
    return (padded(hp.to(dtype), outer_size, world),), ("hp",)


def hp_gathered(
    all_gather_outputs: tuple[torch.Tensor, ...], out: torch.Tensor | None
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
    """``fsdp_post_all_gather``'s answer for what ``hp_inputs`` sent: the whole weight."""
    (whole,) = all_gather_outputs
    return None if out is not None else (whole, (whole,))


_fallback_warned: set[tuple[str, tuple[int, ...], int, str]] = set()
"""The weights (name, shape, shard count, rule) already warned about in this process."""


def warn_fallback(
    category: type[Warning], name: str, outer_size: torch.Size, world: int, why: str
) -> None:
    """Warn once per process that weight ``name`` all-gathers high precision because its
    ``world`` shards cut its blocks; ``why`` names the blocks and the rule (the message goes
    on "...rows cut its ")."""
    key = (name, tuple(outer_size), world, why)
    if key in _fallback_warned:
        return
    _fallback_warned.add(key)
    warnings.warn(
        category(
            f"{name!r} ({tuple(outer_size)}) all-gathers high precision: its {world} FSDP2 "
            f"shards of {-(-outer_size[0] // world)} rows cut its {why} Warned once per "
            f"weight and process; every weight that falls back gets its own warning."
        ),
        stacklevel=2,
    )


def parameter_holders(model: nn.Module) -> dict[int, list[str]]:
    """``id(parameter) -> every 'module.attribute' of ``model`` that holds it`` (a tied
    weight has more than one)."""
    owners: dict[int, list[str]] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for p_name, p in mod.named_parameters(recurse=False):
            where = f"{mod_name}.{p_name}" if mod_name else p_name
            if where not in owners.setdefault(id(p), []):
                owners[id(p)].append(where)
    return owners


def expert_skip(skip: object, enable: str) -> frozenset[int]:
    """``skip`` when it is a ``frozenset`` of ``int`` (the weights' ``id``), else a
    ``TypeError`` naming what ``enable`` takes."""
    if isinstance(skip, frozenset) and all(type(i) is int for i in skip):
        return skip
    got = type(skip).__name__
    if isinstance(skip, frozenset):
        got = f"a frozenset holding {sorted({type(i).__name__ for i in skip} - {'int'})}"
    raise TypeError(
        f"{enable}'s skip is a frozenset of the weights' ids (frozenset(map(id, weights))), "
        f"got {got}"
    )


def check_untied_experts(
    owners: dict[int, list[str]], fqn: str, module: nn.Module, attrs: tuple[str, ...], how: str,
    enable: str,
) -> None:  # fmt: skip
    """``ValueError`` naming every holder when one of ``module``'s expert weights ``attrs`` is
    tied (held elsewhere too, ``parameter_holders``): wrapping each holder's weight apart
    would make two Parameters of one, untying them (each trained on its own)."""
    for attr in attrs:
        holders = owners.get(id(getattr(module, attr)), [])
        if len(holders) > 1:
            where = f"{fqn}.{attr}" if fqn else attr
            raise ValueError(
                f"{where} is tied: the same Parameter is {' and '.join(holders)}. Gathering it "
                f"{how} would make each holder's weight a new Parameter, breaking the tie; leave "
                f"it out ({enable}(model, skip=frozenset({{id(weight)}})); parallelize does that "
                f"by itself: it gathers tied weights high precision) or untie the weights"
            )


_SAVE_WEIGHT = plain_state_dict_hook(("weight",))


def wrap_linear_weights(
    model: nn.Module,
    layers: Iterable[tuple[str, nn.Linear]],
    wrapper: type[GatheredAsFp8],
    meta: Callable[[str], Any],
    *,
    enable: str,
    how: str,
    codes: str,
) -> int:
    """Make each ``(fqn, layer)``'s ``weight`` of ``model`` a new ``Parameter`` over
    ``wrapper(weight, meta('fqn.weight'))`` saved as a plain tensor; returns how many.

    A weight that is already a ``wrapper`` is skipped. Refused, before any weight changes:
    a weight already sharded (``RuntimeError``: call ``enable`` before ``fully_shard``) and a
    tied one (``ValueError`` naming every holder: gathering it ``how`` would hand ``codes``
    to every holder).
    """
    chosen: list[tuple[str, nn.Linear]] = []
    owners = parameter_holders(model)
    for name, layer in layers:
        w = layer.weight
        if isinstance(w, wrapper):
            continue
        where = f"{name}.weight" if name else "weight"
        if isinstance(w, DTensor):
            raise RuntimeError(
                f"{where} is already sharded (a DTensor): call {enable} before fully_shard"
            )
        holders = owners.get(id(w), [])
        if len(holders) > 1:
            raise ValueError(
                f"{where} is tied: the same Parameter is {' and '.join(holders)}. Gathering it "
                f"{how} would hand {codes} to every holder and make it a new Parameter, "
                f"breaking the tie; leave the layer out (module_filter=lambda module, fqn: "
                f"fqn != {name!r}) or untie the weights"
            )
        chosen.append((where, layer))
    for where, layer in chosen:
        w = layer.weight
        layer.weight = nn.Parameter(wrapper(w.detach(), meta(where)), requires_grad=w.requires_grad)
        layer.register_state_dict_post_hook(_SAVE_WEIGHT)  # type: ignore[no-untyped-call]
    return len(chosen)
