"""Partial stub of transformers.modeling_utils (5.24.0): ``PreTrainedModel`` as a torch
module with its config; see __init__.pyi."""

from typing import Any

from torch import nn
from transformers.configuration_utils import PreTrainedConfig

class PreTrainedModel(nn.Module):
    config_class: type[PreTrainedConfig] | None
    base_model_prefix: str
    main_input_name: str
    config: PreTrainedConfig
    def __init__(self, config: PreTrainedConfig, *inputs: Any, **kwargs: Any) -> None: ...

def __getattr__(name: str) -> Any: ...
