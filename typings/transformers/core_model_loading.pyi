"""Partial stub of transformers.core_model_loading (5.24.0): the weight conversions
computectx.integrations.hf_checkpoint runs forward (import) and in reverse (export); see
__init__.pyi."""

from abc import ABC
from concurrent.futures import Future
from typing import Any

import torch
from transformers.modeling_utils import PreTrainedModel

class ConversionOps(ABC):
    supports_many_to_many: bool

class WeightTransform:
    source_patterns: list[str]
    target_patterns: list[str]
    distributed_operation: Any
    quantization_operation: ConversionOps | None
    collected_tensors: dict[str, list[Future[Any]]]
    layer_targets: dict[str, set[str]]
    scope_prefix: str | None
    base_model_prefix: str | None
    def __init__(
        self, source_patterns: str | list[str], target_patterns: str | list[str]
    ) -> None: ...
    def add_tensor(
        self, target_key: str, source_key: str, source_pattern: str, future: Future[Any]
    ) -> None: ...
    def rename_source_key(self, source_key: str) -> tuple[str, str | None]: ...
    def reverse_transform(self) -> WeightTransform: ...
    def materialize_tensors(self) -> dict[str, list[torch.Tensor]]: ...
    def was_used(self) -> bool: ...

class WeightRenaming(WeightTransform):
    def convert(
        self,
        layer_name: str,
        model: Any = None,
        config: Any = None,
        hf_quantizer: Any = None,
        loading_info: Any = None,
    ) -> dict[str, torch.Tensor | list[torch.Tensor]]: ...

class PrefixChange(WeightRenaming):
    prefix_to_add: str | None
    prefix_to_remove: str | None
    model_prefix: str
    def __init__(
        self,
        prefix_to_add: str | None = None,
        prefix_to_remove: str | None = None,
        model_prefix: str | None = None,
    ) -> None: ...

class WeightConverter(WeightTransform):
    operations: list[ConversionOps]
    force_cpu: bool
    def __init__(
        self,
        source_patterns: str | list[str],
        target_patterns: str | list[str],
        operations: list[ConversionOps],
        force_cpu: bool = False,
    ) -> None: ...
    def convert(
        self,
        layer_name: str,
        model: Any = None,
        config: Any = None,
        hf_quantizer: Any = None,
        loading_info: Any = None,
    ) -> dict[str, torch.Tensor | list[torch.Tensor]]: ...

def dot_natural_key(s: str) -> list[tuple[int, int] | tuple[int, str] | tuple[int, str, int]]: ...
def rename_source_key(
    source_key: str,
    weight_renamings: list[WeightRenaming],
    weight_converters: list[WeightConverter],
    base_model_prefix: str | None = None,
    meta_state_dict: dict[str, Any] | None = None,
    reverse: bool = False,
) -> tuple[str, str | None]: ...
def revert_weight_conversion(
    model: PreTrainedModel, state_dict: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]: ...
def __getattr__(name: str) -> Any: ...
