"""The 4-bit layers' stochastic-rounding counter: its key, when a call advances it, and its
saved form (``Fp4Linear`` and the 4-bit experts share these).

The key is int64 ``[seed, counter]`` (``fp4_key``): the recipe's seed in two's complement and
the counter of the next element a backward rounds. It is plain CPU state, never a registered
buffer: ``DistributedDataParallel`` broadcasts buffers before a forward, so a forward on one
rank alone (a validation pass) would be a collective the other ranks never join, and rank
0's counter would overwrite every rank's own. On the CPU the operators read it with no device
sync. A call advances it by a new tensor, never in place (a compiled backward may read the
attribute as it was at the call), except a replayed call (``replays_a_call``). It is saved as
``_extra_state`` ``[FP4_STATE_VERSION, recipe_code, seed, counter]``, checked on every load
path by ``saved_counter`` before anything is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import torch
from torch.autograd.function import FunctionCtx

from computectx.formats.linear.recompute import checkpoint_site
from computectx.fp4_recipe import Fp4Recipe

__all__ = [
    "FP4_COUNTER_LIMIT",
    "FP4_STATE_VERSION",
    "CounterLoads",
    "fp4_key",
    "recipe_code",
    "recipe_text",
    "replays_a_call",
    "saved_counter",
    "signed_seed",
]

FP4_STATE_VERSION: Final[int] = 1
"""``_extra_state[0]``: the layout ``[version, recipe code, seed, counter]`` (int64)."""
FP4_COUNTER_LIMIT: Final[int] = 2**61
"""A loaded counter lies in ``[0, FP4_COUNTER_LIMIT)``: the operators draw below ``2**62``
(``numerics.e2m1.Stochastic``), and a layer advances by its backward's elements a call, so
the other ``2**61`` counters are the headroom a run needs."""
_U64: Final[int] = 2**64


def recipe_code(recipe: Fp4Recipe) -> int:
    """The layer numerics of ``recipe`` as bits (what a checkpoint's state is checked by):
    format, weight tile, MXFP4 rounding, stochastic rounding, Hadamard transform."""
    return (
        (recipe.format == "mxfp4")
        | (recipe.weight_tile == "1x16") << 1
        | (recipe.mx_rounding == "floor") << 2
        | recipe.stochastic << 3
        | recipe.hadamard << 4
    )


def recipe_text(code: int, seed: int) -> str:
    """The recipe a saved code and seed stand for (``str(Fp4Recipe)``; a seed in int64's
    two's complement or not)."""
    mx = bool(code & 1)
    try:
        r = Fp4Recipe(
            format="mxfp4" if mx else "nvfp4",
            weight_tile=None if mx else ("1x16" if code & 2 else "16x16"),
            mx_rounding=("floor" if code & 4 else "rceil") if mx else None,
            stochastic=bool(code & 8),
            hadamard=bool(code & 16),
            seed=seed % _U64,
        )
    except ValueError:
        return f"<unknown 4-bit recipe code {code}, seed {seed}>"
    return str(r)


def saved_counter(state: object, recipe: Fp4Recipe, where: str, runs: str) -> int:
    """The counter of a saved 4-bit ``_extra_state`` (int64 ``[version, recipe code, seed,
    counter]``) for a module running ``recipe``; ``ValueError`` naming ``where`` (``"... of
    the 4-bit layer 'x'"``) when it is not such a tensor, has another version, was saved under
    another recipe or seed (naming both: ``runs`` says who runs this one, ``"this layer
    runs"``) or holds a counter outside ``[0, FP4_COUNTER_LIMIT)``. Never prints a value."""
    if (
        not isinstance(state, torch.Tensor)
        or state.dtype != torch.int64
        or tuple(state.shape) != (4,)
        or state.is_meta
    ):
        frozen = (
            isinstance(state, torch.Tensor) and state.dtype == torch.int64 and state.shape == (2,)
        )
        why = (
            "an int64 [version, weight code] is a frozen 4-bit layer's (FrozenFp4Linear: a "
            "serving checkpoint, which loads into a frozen model, not into a training one)"
            if frozen
            else "drop the entry to keep this layer's counter as it is"
            if state is None
            else "an fp8 layer's state is a dict: an fp8 checkpoint does not load into 4 bits"
        )
        raise ValueError(
            f"{where} must be an int64 tensor [version, recipe code, seed, counter]; got "
            f"{_kind_of(state)} ({why})"
        )
    version, code, seed, counter = (int(v) for v in state.tolist())
    if version != FP4_STATE_VERSION:
        raise ValueError(
            f"{where} has version {version}; this computectx reads version {FP4_STATE_VERSION}"
        )
    mine = signed_seed(recipe.seed)
    if code != recipe_code(recipe) or seed != mine:
        raise ValueError(
            f"{where} was saved under the 4-bit recipe {recipe_text(code, seed)!r} but {runs} "
            f"{recipe_text(recipe_code(recipe), mine)!r}; convert under the recipe the "
            f"checkpoint was saved with"
        )
    if not 0 <= counter < FP4_COUNTER_LIMIT:
        raise ValueError(
            f"{where} holds the stochastic-rounding counter {counter}; accepted: an integer "
            f"in [0, 2**61) (FP4_COUNTER_LIMIT: the operators draw below 2**62)"
        )
    return counter


def signed_seed(seed: int) -> int:
    """A seed in ``[0, 2**64)`` as the int64 a key holds (two's complement)."""
    return seed if seed < 2**63 else seed - _U64


def fp4_key(recipe: Fp4Recipe, counter: int = 0) -> torch.Tensor:
    """A 4-bit module's ``sr_key``: int64 ``[seed, counter]`` on the CPU (plain state, never a
    buffer: module docstring)."""
    return torch.tensor([signed_seed(recipe.seed), counter], dtype=torch.int64)


def _kind_of(value: object) -> str:
    """``value`` for an error message, never a tensor's contents."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    if isinstance(value, Mapping):
        return f"a {type(value).__name__} with keys {sorted(map(str, value))[:4]}"
    return type(value).__name__


def replays_a_call() -> bool:
    """Whether this call runs during a backward as the replay of an original call whose
    backward is the one that runs (a non-reentrant checkpoint's recomputation, or a region
    nested in one: its saved tensors replace the original's, its ctx is dropped). A
    reentrant recomputation (its site's key is checkpoint's autograd ctx) builds the graph
    its backward runs, so it is a call of its own. ``False`` while compiling (no site)."""
    site = checkpoint_site(record=False)
    return site is not None and site.recomputing and not isinstance(site.key, FunctionCtx)


class CounterLoads:
    """For a module whose ``_extra_state`` is a 4-bit counter (``Fp4Linear``, ``Fp4Experts``;
    listed before the ``nn.Module`` base): ``load_state_dict`` runs the module's
    ``check_load(local entries, prefix)`` before loading, and a checkpoint without the counter
    (a high-precision one) loads, the counter as it is."""

    def check_load(self, entries: Mapping[str, object], prefix: str) -> None:
        raise NotImplementedError  # each module names itself in its errors

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        local = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
        self.check_load(local, prefix)
        super()._load_from_state_dict(  # type: ignore[misc]
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if prefix + "_extra_state" in missing_keys:
            missing_keys.remove(prefix + "_extra_state")
