"""Type stubs for the parts of triton computectx uses (triton ships no py.typed)."""

from collections.abc import Callable, Sequence
from typing import Any

from triton import knobs as knobs
from triton import language as language

__version__: str

class JITFunction:
    """A ``@triton.jit`` kernel: ``kernel[grid](*args, **constexprs)`` launches it, and a
    plain call from inside another kernel inlines it."""

    def __getitem__(self, grid: Any) -> Callable[..., Any]: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

class Config:
    kwargs: dict[str, Any]
    num_warps: int
    num_stages: int
    def __init__(
        self,
        kwargs: dict[str, Any],
        num_warps: int = 4,
        num_stages: int = 3,
        num_ctas: int = 1,
        maxnreg: int | None = None,
        pre_hook: Callable[..., Any] | None = None,
    ) -> None: ...

class Autotuner(JITFunction):
    cache: dict[Any, Config]
    best_config: Config

def jit(fn: Callable[..., Any]) -> JITFunction: ...
def autotune(
    configs: Sequence[Config],
    key: Sequence[str],
    prune_configs_by: dict[str, Callable[..., Any]] | None = None,
    reset_to_zero: Sequence[str] | None = None,
    restore_value: Sequence[str] | None = None,
    warmup: int | None = None,
    rep: int | None = None,
) -> Callable[[JITFunction], Autotuner]: ...
def cdiv(x: int, y: int) -> int: ...
def next_power_of_2(n: int) -> int: ...
