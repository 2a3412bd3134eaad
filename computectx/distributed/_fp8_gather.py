"""What the two FSDP2 fp8-gather subclasses share: a wrapper around a high-precision shard.

``WeightGatheredQuantized`` (a ``QuantizedLinear`` weight, ``fp8_all_gather``) and
``ExpertsGatheredQuantized`` (3-D expert weights, ``fp8_expert_gather``) are both
``GatheredAsFp8``: a tensor subclass over the shard ``hp`` whose every op runs on ``hp``
(ops that take a piece of the weight, ``SHARD_OPS``, return the same kind of wrapper over the
piece), traceable (flattened to ``hp`` and the subclass's ``meta``), and saved as a plain
tensor (``plain_state_dict_hook``). Each subclass adds FSDP2's two extension points,
``fsdp_pre_all_gather`` and ``fsdp_post_all_gather``: what it sends and how it rebuilds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map
from typing_extensions import Self

__all__ = ["SHARD_OPS", "GatheredAsFp8", "plain_state_dict_hook"]

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

        def unwrap(x: Any) -> Any:
            if isinstance(x, cls):
                metas.append(x._meta)
                return x._hp
            return x

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        if func not in SHARD_OPS or not metas:
            return out
        meta = metas[-1]  # the last wrapper among the arguments, as each class kept it
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
