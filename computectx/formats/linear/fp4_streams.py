"""The 4-bit modules' stochastic-rounding streams, one a module by its name in the whole model:
``assign_fp4_streams``.

Every ``Fp4Linear`` and ``Fp4Experts`` keys its Philox bits by ``[word, counter]``, the word its
stream's (``fp4_counter.stream_word``). On one stream two modules of the same shape called
alike (each block's ``attn.q``) would draw the same uniforms in a step: each rounding
unbiased, their errors correlated. ``stream_of(fqn)`` is a stable hash of the module's fully
qualified name (the first 8 bytes of BLAKE2b of its UTF-8, little-endian, masked to 63 bits;
0, kept for a module nobody assigned, becomes 1), so it depends on nothing but the name: not
the rank, not the process, not the model's other modules. The name is the module's in the model
with torch's wrappers' parts left out where a module really is that wrapper
(``stream_names``: ``DistributedDataParallel``'s and ``DataParallel``'s ``module``,
``torch.compile``'s ``_orig_mod``, ``checkpoint_wrapper``'s ``_checkpoint_wrapped_module``,
FSDP1's ``_fsdp_wrapped_module``; FSDP2's ``fully_shard`` keeps the names), so a wrapped model
assigns what the plain one does, and a child a user named ``_orig_mod`` keeps its part.

The rank is not mixed in: under data parallelism every rank holds the same streams (the same
model, the same names) and draws the same uniforms at the same counter on its own rows, as
before streams (``docs/fp4.md``, "Ranks").
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Collection, Iterable
from typing import Final

from torch import nn

from computectx.formats.linear.fp4_counter import FP4_STREAM_LIMIT, CounterLoads

__all__ = ["assign_fp4_streams", "assign_streams_to", "shared_streams", "stream_names", "stream_of"]

_WRAPPERS: Final = {
    ("torch.nn.parallel.distributed", "DistributedDataParallel"): "module",
    ("torch.nn.parallel.data_parallel", "DataParallel"): "module",
    ("torch._dynamo.eval_frame", "OptimizedModule"): "_orig_mod",
    (
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
        "ActivationWrapper",
    ): "_checkpoint_wrapped_module",
    (
        "torch.distributed.fsdp.fully_sharded_data_parallel",
        "FullyShardedDataParallel",
    ): "_fsdp_wrapped_module",
}
"""Torch's wrapper classes (by module and name: nothing of ``torch.distributed`` is imported
here) and the child each wraps."""


def stream_of(name: str) -> int:
    """The stream of the module whose name (``stream_names``: its FQN less torch's wrappers'
    parts) is ``name`` (module docstring): in ``[1, 2**63)``, the same on every rank and in
    every process."""
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % FP4_STREAM_LIMIT or 1


def _wrapped(module: nn.Module) -> str | None:
    # The child ``module`` wraps, where it is one of torch's wrappers (_WRAPPERS).
    for cls in type(module).__mro__:
        child = _WRAPPERS.get((cls.__module__, cls.__qualname__))
        if child is not None:
            return child
    return None


def stream_names(model: nn.Module) -> list[tuple[str, str, nn.Module]]:
    """``(fqn, name, module)`` for every module of ``model`` in ``named_modules``' order (a
    module reachable under several names by its first): ``name`` is ``fqn`` less the parts
    where a module is one of torch's wrappers and the part is the child it wraps."""
    out: list[tuple[str, str, nn.Module]] = []
    seen: set[int] = set()
    todo: list[tuple[str, str, nn.Module]] = [("", "", model)]
    while todo:
        fqn, name, module = todo.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        out.append((fqn, name, module))
        skip = _wrapped(module)
        children = [
            (f"{fqn}.{part}" if fqn else part, name if part == skip else _join(name, part), child)
            for part, child in module._modules.items()
            if child is not None
        ]
        todo.extend(reversed(children))  # depth first, in order, as named_modules
    return out


def _join(name: str, part: str) -> str:
    return f"{name}.{part}" if name else part


def assign_fp4_streams(model: nn.Module, *, force: bool = False) -> dict[str, int]:
    """Give every 4-bit module of ``model`` (``Fp4Linear``, ``Fp4Experts``) the stream its
    name in ``model`` hashes to (``stream_of`` of its ``stream_names`` name; a module
    reachable under several names by its first); returns ``{fqn: stream}``, FQNs as
    ``model.named_modules()`` gives them. ``convert_to_quantized`` does this for what it
    converts and ``ByteLM`` for its whole model; call it once on a model assembled from parts
    converted on their own (their streams are those of their names in each part), through
    any wrapper (DDP, ``torch.compile``, ``checkpoint_wrapper``: the same streams). A module
    that has drawn (counter above 0) on another stream is refused, ``ValueError`` naming it,
    before any stream changes (``check_sr_stream``): a run's streams never change midway, and
    a checkpoint's load restores the streams it saved. Calling it again changes nothing.

    ``force=True`` moves modules that have drawn too, their counters kept: for a run resumed
    from a version-1 checkpoint (every module on stream 0) or modules that share a stream
    because one loaded another's state. Two 4-bit modules of ``model`` left on one stream
    (``shared_streams``) warn, naming both."""
    return assign_streams_to(model, None, force=force)


def assign_streams_to(
    model: nn.Module, modules: Collection[object] | None, *, force: bool = False
) -> dict[str, int]:
    """``assign_fp4_streams`` for the 4-bit modules of ``model`` among ``modules`` (every one
    when ``None``), named in ``model``; every module is checked before any changes. Then a
    ``UserWarning`` names two 4-bit modules of ``model`` (any of them) that share a stream."""
    chosen = None if modules is None else {id(m) for m in modules}
    named = [(fqn, name, m) for fqn, name, m in stream_names(model) if isinstance(m, CounterLoads)]
    plan = [
        (fqn, m, stream_of(name)) for fqn, name, m in named if chosen is None or id(m) in chosen
    ]
    for fqn, m, stream in plan:
        m.check_sr_stream(stream, fqn, force=force)
    for fqn, m, stream in plan:
        m.set_sr_stream(stream, fqn, force=force)
    shared = shared_streams([(fqn, m.sr_stream) for fqn, _, m in named])
    if shared:
        warnings.warn(shared, UserWarning, stacklevel=3)
    return {fqn: stream for fqn, _, stream in plan}


def shared_streams(streams: Iterable[tuple[str, int]]) -> str:
    """A warning's text when two of ``streams`` (``(fqn, stream)`` of a model's 4-bit modules)
    are one stream, naming the first two and how many share; ``""`` when none do."""
    first: dict[int, str] = {}
    pairs: list[tuple[str, str, int]] = []
    for fqn, stream in streams:
        if stream in first:
            pairs.append((first[stream], fqn, stream))
        else:
            first[stream] = fqn
    if not pairs:
        return ""
    a, b, stream = pairs[0]
    more = f" ({len(pairs) + 1} modules in all share streams)" if len(pairs) > 1 else ""
    return (
        f"the 4-bit modules {a!r} and {b!r} share the stochastic-rounding stream {stream}{more}: "
        f"they draw the same uniforms at the same counter, their rounding errors correlated; "
        f"give each its own with assign_fp4_streams(model) (force=True once they have drawn)"
    )
