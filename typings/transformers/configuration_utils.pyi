"""Partial stub of transformers.configuration_utils (5.24.0); see __init__.pyi.

A config holds each model's own fields (``num_attention_heads``, ...) as attributes, and its
``__getattribute__`` / ``__setattr__`` (untyped at runtime) make any undeclared attribute
``Any`` to mypy, here as there."""

from typing import Any, ClassVar, Literal

import torch

class PreTrainedConfig:
    model_type: ClassVar[str]
    transformers_version: str | None
    architectures: list[str] | None
    output_hidden_states: bool | None
    return_dict: bool | None
    dtype: str | torch.dtype | None
    chunk_size_feed_forward: int
    is_encoder_decoder: bool
    id2label: dict[int, str] | dict[str, str] | None
    label2id: dict[str, int] | dict[str, str] | None
    problem_type: (
        Literal["regression", "single_label_classification", "multi_label_classification"] | None
    )
    # A dataclass (strict, accept_kwargs=True): other keywords become attributes.
    def __init__(
        self,
        *,
        transformers_version: str | None = None,
        architectures: list[str] | None = None,
        output_hidden_states: bool | None = False,
        return_dict: bool | None = True,
        dtype: str | torch.dtype | None = None,
        chunk_size_feed_forward: int = 0,
        is_encoder_decoder: bool = False,
        id2label: dict[int, str] | dict[str, str] | None = None,
        label2id: dict[str, int] | dict[str, str] | None = None,
        problem_type: Literal[
            "regression", "single_label_classification", "multi_label_classification"
        ]
        | None = None,
        **kwargs: Any,
    ) -> None: ...
    def get_text_config(
        self, decoder: bool | None = None, encoder: bool | None = None
    ) -> PreTrainedConfig: ...
    def to_dict(self) -> dict[str, Any]: ...
    def to_diff_dict(self) -> dict[str, Any]: ...
    def __getattribute__(self, key: str) -> Any: ...
    def __setattr__(self, key: str, value: Any) -> None: ...

def __getattr__(name: str) -> Any: ...
