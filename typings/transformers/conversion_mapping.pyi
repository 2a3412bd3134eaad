"""Partial stub of transformers.conversion_mapping (5.24.0); see __init__.pyi."""

from typing import Any

from transformers.core_model_loading import WeightTransform
from transformers.modeling_utils import PreTrainedModel

def get_model_conversion_mapping(
    model: PreTrainedModel,
    key_mapping: dict[str, str] | None = None,
    hf_quantizer: Any = None,  # a transformers.quantizers.HfQuantizer
    add_legacy: bool = True,
) -> list[WeightTransform]: ...
def __getattr__(name: str) -> Any: ...
