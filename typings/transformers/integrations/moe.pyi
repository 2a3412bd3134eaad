"""Partial stub of transformers.integrations.moe (5.24.0): the experts interface
computectx.integrations.transformers_moe registers its fp8 experts forward in; see
../__init__.pyi."""

from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import torch

class GeneralInterface(MutableMapping[Any, Any]):  # from transformers.utils.generic
    def __init__(self) -> None: ...
    def __getitem__(self, key: Any) -> Any: ...
    def __setitem__(self, key: Any, value: Any) -> None: ...
    def __delitem__(self, key: Any) -> None: ...
    def __iter__(self) -> Iterator[Any]: ...
    def __len__(self) -> int: ...
    @classmethod
    def register(cls, key: str, value: Callable[..., Any]) -> None: ...
    def valid_keys(self) -> list[str]: ...

class ExpertsInterface(GeneralInterface):
    def get_interface(
        self, experts_implementation: str, default: Callable[..., Any]
    ) -> Callable[..., Any]: ...

ALL_EXPERTS_FUNCTIONS: ExpertsInterface

def use_experts_implementation(
    experts_class: type[torch.nn.Module] | None = None,
    *,
    experts_interface: ExpertsInterface = ...,
    is_concatenated: bool = True,
    is_transposed: bool = False,
    has_bias: bool = False,
    has_gate: bool = True,
    has_post_expert_norm: bool = False,
) -> type[torch.nn.Module]: ...
def grouped_mm_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor: ...
def __getattr__(name: str) -> Any: ...
