"""The 4-bit modules' stochastic-rounding streams, one a module by its name in the whole model:
``assign_fp4_streams``.

Every ``Fp4Linear`` and ``Fp4Experts`` keys its Philox bits by ``[word, counter]``, the word its
stream's (``fp4_counter.stream_word``). On one stream two modules of the same shape called
alike (each block's ``attn.q``) would draw the same uniforms in a step: each rounding
unbiased, their errors correlated. ``stream_of(fqn)`` is a stable hash of the module's fully
qualified name (the first 8 bytes of BLAKE2b of its UTF-8, little-endian, masked to 63 bits;
0, kept for a module nobody assigned, becomes 1), so it depends on nothing but the name: not
the rank, not the process, not the model's other modules. Torch's wrappers' parts
(``_orig_mod``, ``_checkpoint_wrapped_module``, ``_fsdp_wrapped_module``) are left out of the
name, so a wrapped model assigns what the plain one does.

The rank is not mixed in: under data parallelism every rank holds the same streams (the same
model, the same names) and draws the same uniforms at the same counter on its own rows, as
before streams (``docs/fp4.md``, "Ranks").
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection
from typing import Final

from torch import nn

from computectx.formats.linear.fp4_counter import FP4_STREAM_LIMIT, CounterLoads

__all__ = ["assign_fp4_streams", "assign_streams_to", "stream_of"]

_WRAPPERS: Final = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def stream_of(fqn: str) -> int:
    """The stream of the module named ``fqn`` in its model (module docstring): in ``[1,
    2**63)``, the same on every rank and in every process."""
    name = ".".join(p for p in fqn.split(".") if p not in _WRAPPERS)
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % FP4_STREAM_LIMIT or 1


def assign_fp4_streams(model: nn.Module) -> dict[str, int]:
    """Give every 4-bit module of ``model`` (``Fp4Linear``, ``Fp4Experts``) the stream its name
    in ``model`` hashes to (``stream_of``; a module reachable under several names by its
    first); returns ``{fqn: stream}``. ``convert_to_quantized`` does this for what it
    converts and ``ByteLM`` for its whole model; call it once on a model assembled from parts
    converted on their own (their streams are those of their names in each part). A module
    that has drawn (counter above 0) on another stream is refused, ``ValueError`` naming it,
    before any stream changes (``check_sr_stream``): a run's streams never change midway, and
    a checkpoint's load restores the streams it saved. Calling it again changes nothing."""
    return assign_streams_to(model, None)


def assign_streams_to(model: nn.Module, modules: Collection[object] | None) -> dict[str, int]:
    """``assign_fp4_streams`` for the 4-bit modules of ``model`` among ``modules`` (every one
    when ``None``), named in ``model``; every module is checked before any changes."""
    chosen = None if modules is None else {id(m) for m in modules}
    plan = [
        (fqn, m, stream_of(fqn))
        for fqn, m in model.named_modules()
        if isinstance(m, CounterLoads) and (chosen is None or id(m) in chosen)
    ]
    for fqn, m, stream in plan:
        m.check_sr_stream(stream, fqn)
    for fqn, m, stream in plan:
        m.set_sr_stream(stream, fqn)
    return {fqn: stream for fqn, _, stream in plan}
