"""The 4-bit layers' stochastic-rounding counter: its key, its stream, when a call advances
it, and its saved form (``Fp4Linear`` and the 4-bit experts share these).

The key is int64 ``[key word, counter]`` (``fp4_key``): the word the Philox bits are keyed
by and the counter of the next element a backward rounds. The word is the module's stream's
(``stream_word``): on stream 0 the recipe's seed in two's complement (every module's before
streams), on stream ``s > 0`` the ``s``-th output of splitmix64 seeded with the recipe's
seed, so two modules on different streams draw unrelated bits at the same counter (the
operators take the word as they took the seed: nothing below the key changes).
``assign_fp4_streams`` (``linear.fp4_streams``) gives each module of a model the stream its
name hashes to. It is plain CPU state, never a registered buffer:
``DistributedDataParallel`` broadcasts buffers before a forward, so a forward on one rank
alone (a validation pass) would be a collective the other ranks never join, and rank 0's
counter would overwrite every rank's own. On the CPU the operators read it with no device
sync. A call advances it by a new tensor, never in place (a compiled backward may read the
attribute as it was at the call), except a replayed call (``replays_a_call``). It is saved
as ``_extra_state`` ``[FP4_STATE_VERSION, recipe_code, seed, counter, stream]`` (version 2;
version 1, ``[1, recipe code, seed, counter]``, loads as stream 0, which it was), checked on
every load path by ``saved_counter`` before anything is written.
"""

from __future__ import annotations

import abc
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Final, NamedTuple

import torch
from torch.autograd.function import FunctionCtx

from computectx._checks import as_int
from computectx.formats.linear.recompute import checkpoint_site
from computectx.fp4_recipe import Fp4Recipe

__all__ = [
    "FP4_COUNTER_LIMIT",
    "FP4_STATE_VERSION",
    "FP4_STREAM_LIMIT",
    "CounterLoads",
    "SavedCounter",
    "check_stream",
    "fp4_key",
    "recipe_code",
    "recipe_text",
    "replays_a_call",
    "saved_counter",
    "signed_seed",
    "stream_word",
]

FP4_STATE_VERSION: Final[int] = 2
"""``_extra_state[0]``: the layout ``[version, recipe code, seed, counter, stream]`` (int64;
version 1, without the stream, still loads: as stream 0)."""
_LENGTHS: Final = {1: 4, 2: 5}
"""Entries of each saved version's layout."""
FP4_STREAM_LIMIT: Final[int] = 2**63
"""A stream lies in ``[0, FP4_STREAM_LIMIT)`` (an int64 saves it)."""
FP4_COUNTER_LIMIT: Final[int] = 2**61
"""A loaded counter lies in ``[0, FP4_COUNTER_LIMIT)``: the operators draw below ``2**62``
(``numerics.e2m1.Stochastic``), and a layer advances by its backward's elements a call, so
the other ``2**61`` counters are the headroom a run needs."""
_U64: Final[int] = 2**64
_GOLDEN: Final[int] = 0x9E3779B97F4A7C15  # splitmix64's increment (2**64 / golden ratio)


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


class SavedCounter(NamedTuple):
    """What a saved 4-bit ``_extra_state`` restores: the counter and the stream (and the
    layout's version: a version-1 state, saved before streams, loads as stream 0)."""

    counter: int
    stream: int
    version: int = FP4_STATE_VERSION


def saved_counter(state: object, recipe: Fp4Recipe, where: str, runs: str) -> SavedCounter:
    """The counter and stream of a saved 4-bit ``_extra_state`` (int64 ``[2, recipe code, seed,
    counter, stream]``, or version 1's ``[1, recipe code, seed, counter]``: stream 0) for a
    module running ``recipe``; ``ValueError`` naming ``where`` (``"... of the 4-bit layer
    'x'"``) when it is not such a tensor, has another version or length, was saved under
    another recipe or seed (naming both: ``runs`` says who runs this one, ``"this layer
    runs"``), holds a counter outside ``[0, FP4_COUNTER_LIMIT)`` or a negative stream.
    Never prints a tensor's contents."""
    if (
        not isinstance(state, torch.Tensor)
        or state.dtype != torch.int64
        or state.dim() != 1
        or state.shape[0] not in _LENGTHS.values()
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
            f"{where} must be an int64 tensor [version, recipe code, seed, counter, stream] "
            f"(version 1: without the stream); got {_kind_of(state)} ({why})"
        )
    version, code, seed, counter, *rest = (int(v) for v in state.tolist())
    if _LENGTHS.get(version) != len(rest) + 4:
        raise ValueError(
            f"{where} has version {version} and {len(rest) + 4} entries; this computectx reads "
            f"version {FP4_STATE_VERSION} (5 entries) and version 1 (4 entries)"
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
    stream = rest[0] if rest else 0
    if stream < 0:  # an int64 lies below FP4_STREAM_LIMIT
        raise ValueError(
            f"{where} holds the stochastic-rounding stream {stream}; accepted: an integer in "
            f"[0, 2**63) (FP4_STREAM_LIMIT)"
        )
    return SavedCounter(counter, stream, version)


def check_stream(stream: object, where: str) -> int:
    """``stream`` as a stream: an integer (``int``, a numpy integer, an ``IntEnum``: stored as
    a plain ``int``; not a ``bool``) in ``[0, FP4_STREAM_LIMIT)``; ``TypeError``/``ValueError``
    naming ``where`` and the value otherwise."""
    n = as_int(stream)
    if n is None:
        shown = _kind_of(stream) if isinstance(stream, torch.Tensor) else repr(stream)[:60]
        raise TypeError(
            f"{where}: the stochastic-rounding stream must be an integer in [0, 2**63) (an int "
            f"or a numpy integer, not a bool), got {shown} ({type(stream).__name__})"
        )
    if not 0 <= n < FP4_STREAM_LIMIT:
        raise ValueError(
            f"{where}: the stochastic-rounding stream {n} is outside [0, 2**63) (FP4_STREAM_LIMIT)"
        )
    return n


def stream_word(seed: int, stream: int) -> int:
    """The key word (int64, two's complement) a module on ``stream`` draws by under the seed
    ``seed`` (``[0, 2**64)``): the seed itself on stream 0, else splitmix64's ``stream``-th
    output from the state ``seed``::

        z = (seed + stream * 0x9E3779B97F4A7C15) mod 2**64
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 mod 2**64
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB mod 2**64
        word = z ^ (z >> 31)

    A bijection of ``z`` (the finalizer's steps are invertible), so distinct streams under one
    seed get distinct words."""
    if stream == 0:
        return signed_seed(seed)
    z = (seed + stream * _GOLDEN) % _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % _U64
    return signed_seed(z ^ (z >> 31))


def signed_seed(seed: int) -> int:
    """A seed in ``[0, 2**64)`` as the int64 a key holds (two's complement)."""
    return seed if seed < 2**63 else seed - _U64


def fp4_key(recipe: Fp4Recipe, counter: int = 0, stream: int = 0) -> torch.Tensor:
    """A 4-bit module's ``sr_key``: int64 ``[stream_word(seed, stream), counter]`` on the CPU
    (plain state, never a buffer: module docstring)."""
    return torch.tensor([stream_word(recipe.seed, stream), counter], dtype=torch.int64)


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


_LOADING: Final = "_fp4_loading_as"
"""The attribute naming a module while ``load_state_dict`` loads it (for its warnings)."""


# abc.ABCMeta, not abc.ABC: ABC's empty __slots__ would change the layout of an nn.Module
# subclass, and FSDP2's __class__ swap (to FSDP<cls>) refuses another layout.
class CounterLoads(metaclass=abc.ABCMeta):
    """The counter's state for a module whose ``_extra_state`` is a 4-bit counter
    (``Fp4Linear``, ``Fp4Experts``; listed before the ``nn.Module`` base): its stream
    (``sr_stream``, ``set_sr_stream``), its saved form (``get_extra_state``, ``set_extra_state``,
    ``memory.load_weights``' ``plan_state_load``), and ``load_state_dict`` running the module's
    ``check_load(local entries, prefix)`` before loading; a checkpoint without the counter (a
    high-precision one) loads, the counter and stream as they are."""

    recipe: Fp4Recipe
    sr_key: torch.Tensor
    sr_stream: int
    """The stream the module draws on (``[0, 2**63)``; 0, the recipe's seed itself, unless
    set: ``assign_fp4_streams`` gives each module of a model the one its name hashes to)."""

    @abc.abstractmethod
    def check_load(self, entries: Mapping[str, object], prefix: str) -> None:
        """Refuse (``ValueError`` naming ``prefix``) what of ``entries`` (this module's own
        keys of a state dict, ``prefix`` stripped) its load would refuse, changing nothing:
        each module names itself in its errors."""

    kind: str = "4-bit layer"
    """What the module calls itself in its errors and warnings (``"4-bit experts"``)."""

    def named(self, name: str) -> str:
        """``"the 4-bit layer 'x'"`` for the module named ``name`` (none: ``"the 4-bit
        layer"``), as its errors and warnings name it."""
        return f"the {self.kind} {name!r}" if name else f"the {self.kind}"

    def check_sr_stream(self, stream: object, name: str, *, force: bool = False) -> int:
        """``stream`` checked (``check_stream``) as this module's new stream: ``ValueError``
        naming ``name`` when the module has drawn (counter above 0) on another stream, so a
        run's streams never change midway (the same stream again is no change), unless
        ``force`` (``set_sr_stream``)."""
        layer = self.named(name)
        stream = check_stream(stream, layer)
        counter = int(self.sr_key[1])
        if stream != self.sr_stream and counter and not force:
            raise ValueError(
                f"{layer} has drawn on the stochastic-rounding stream "
                f"{self.sr_stream} (counter {counter}): its stream cannot change to {stream} "
                f"midway through a run; assign streams before training (a checkpoint's load "
                f"restores the streams it saved). Modules that share a stream (resumed from a "
                f"version-1 checkpoint, or one loaded from another's state) move with "
                f"assign_fp4_streams(model, force=True), their counters kept"
            )
        return stream

    def set_sr_stream(self, stream: int, name: str = "", *, force: bool = False) -> None:
        """Draw on ``stream`` (``check_sr_stream`` first; the same stream again changes
        nothing), the counter kept: 0 unless ``force`` moved a module that has drawn (for
        modules that share a stream: a version-1 resume, a state copied from another module;
        a counter never moves back, so no bits drawn before are drawn again on the old
        stream)."""
        stream = self.check_sr_stream(stream, name, force=force)
        if stream != self.sr_stream:
            self._install(SavedCounter(int(self.sr_key[1]), stream))

    def _install(self, saved: SavedCounter, name: str = "") -> None:
        # A new key tensor, never written in place (a backward may hold the old one).
        if saved.version == 1:
            warnings.warn(
                f"{self.named(name)} loaded a version-1 stochastic-rounding state (saved before "
                f"streams): it draws on stream 0, the recipe's seed, as every 4-bit module of "
                f"that run did, so modules of one shape draw the same uniforms; give each its "
                f"own stream with assign_fp4_streams(model, force=True) (the counters kept)",
                UserWarning,
                stacklevel=2,
            )
        self.sr_stream = saved.stream
        self.sr_key = fp4_key(self.recipe, saved.counter, saved.stream)

    def get_extra_state(self) -> torch.Tensor:
        """int64 ``[FP4_STATE_VERSION, recipe code, seed, counter, stream]`` (a tensor:
        safetensors and DCP save it as they save the weights)."""
        code, seed = recipe_code(self.recipe), signed_seed(self.recipe.seed)
        counter = int(self.sr_key[1])
        return torch.tensor(
            [FP4_STATE_VERSION, code, seed, counter, self.sr_stream], dtype=torch.int64
        )

    def set_extra_state(self, state: Any) -> None:
        """Install a saved counter and stream (checked by ``check_load`` first)."""
        self.check_load({"_extra_state": state}, "")
        name = getattr(self, _LOADING, "")  # set while load_state_dict loads this module
        self._install(saved_counter(state, self.recipe, "_extra_state", "this module runs"), name)

    def saved_stream(self, state: object, name: str = "") -> int:
        """The stream a saved ``_extra_state`` of this module restores (a version-1 state's:
        0), read as its load reads it (``saved_counter``: a ``ValueError`` naming the module
        ``name`` for a state its load refuses)."""
        where = f"_extra_state of {self.named(name)}"
        return saved_counter(state, self.recipe, where, "this module runs").stream

    def state_load_keys(self) -> tuple[str, ...]:
        """``computectx.memory.load_weights``' seam: ``_extra_state`` loads by this rule."""
        return ("_extra_state",)

    def plan_state_load(
        self, tensors: Mapping[str, torch.Tensor], *, prefix: str = ""
    ) -> Callable[[], None]:
        """Check ``tensors`` (local names) as ``load_state_dict`` does (``check_load``) and
        return what installs the saved counter and stream once the weights are in place
        (none saved: both as they are)."""
        self.check_load(tensors, prefix)
        if "_extra_state" not in tensors:
            return lambda: None
        # Read now: a memory-mapped file may go.
        saved = saved_counter(tensors["_extra_state"], self.recipe, "_extra_state", "it runs")
        return lambda: self._install(saved, prefix[:-1])

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
        object.__setattr__(self, _LOADING, prefix[:-1])  # the name set_extra_state warns by
        try:
            super()._load_from_state_dict(  # type: ignore[misc]
                state_dict,
                prefix,
                local_metadata,
                strict,
                missing_keys,
                unexpected_keys,
                error_msgs,
            )
        finally:
            object.__delattr__(self, _LOADING)
        if prefix + "_extra_state" in missing_keys:
            missing_keys.remove(prefix + "_extra_state")
