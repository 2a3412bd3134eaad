"""A partial stub of transformers (mirrors transformers 5.24.0, the dev extra's pin).

Its ``__init__`` imports its ~2,500 modules under ``TYPE_CHECKING``, so mypy following it
spent ~40% of a cold ``mypy --strict`` run there. These stubs declare what computectx
uses, with the installed release's signatures (where it leaves one unannotated, the type
its code has); ``follow_imports = "skip"`` in pyproject.toml keeps mypy off transformers'
own modules, and every other name, here or in a module without a stub, is ``Any``.
"""

from typing import Any

from transformers.cache_utils import Cache as Cache
from transformers.cache_utils import DynamicCache as DynamicCache
from transformers.cache_utils import DynamicLayer as DynamicLayer
from transformers.cache_utils import StaticLayer as StaticLayer
from transformers.configuration_utils import PreTrainedConfig as PreTrainedConfig
from transformers.modeling_utils import PreTrainedModel as PreTrainedModel

__version__: str

def __getattr__(name: str) -> Any: ...
