"""A 4-bit recipe's own high-precision rules over a model (``Fp4Recipe.hp``, ``hp_last``):
the block of every module, experts included, and the rules that can keep nothing high.

The blocks are the model's block list as ``linear.fp4.block_list`` finds it for the linears
(the ``nn.ModuleList``/``nn.ModuleDict`` with the most entries among those holding an
``nn.Linear``): ``module_blocks`` gives every module inside its entries the entry's index, so
grouped experts in block ``i`` are kept high by ``hp_last`` exactly when its linears are.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

from torch import nn

from computectx.formats.linear.fp4 import block_list
from computectx.fp4_recipe import Fp4Recipe

__all__ = ["module_blocks", "unheeded_rules"]


def module_blocks(model: nn.Module) -> dict[int, tuple[int, int]]:
    """``id(module) -> (block, blocks)`` for every module inside an entry of the model's block
    list: the container whose entry ``i`` holds the linears ``block_list`` puts in block
    ``i``; empty when the model has none."""
    linears = block_list(model)
    if not linears:
        return {}
    for m in model.modules():
        if not isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            continue
        entries = list(m.children())
        n = len(entries)
        marks = [
            {linears.get(id(s)) for s in e.modules() if isinstance(s, nn.Linear)} for e in entries
        ]
        if any(marks) and all(mark <= {(i, n)} for i, mark in enumerate(marks)):
            found: dict[int, tuple[int, int]] = {}
            for i, entry in enumerate(entries):
                for s in entry.modules():
                    found.setdefault(id(s), (i, n))
            return found
    return {}


def unheeded_rules(recipe: Fp4Recipe, names: Iterable[str], has_blocks: bool) -> list[str]:
    """What ``recipe``'s rules cannot act on, one sentence each: an ``hp`` pattern that
    matches none of ``names`` (the linears and experts modules the conversion looked at),
    ``hp_last`` on a model without a block list (``has_blocks`` false)."""
    seen = [n.lower() for n in names]
    out = [
        f"the 4-bit recipe's hp={p!r} matches no linear or experts module of the model, so it "
        f"keeps nothing in high precision (patterns match the whole dotted name, any case: "
        f"'*.attn.*', 'blocks.0.*')"
        for p in recipe.hp
        if not any(fnmatch.fnmatchcase(n, p) for n in seen)
    ]
    if recipe.hp_last and not has_blocks:
        out.append(
            f"the 4-bit recipe's hp_last={recipe.hp_last} keeps nothing in high precision: the "
            f"model has no block list (an nn.ModuleList or nn.ModuleDict holding nn.Linear "
            f"layers; a block converted on its own, as a model built under a 4-bit ctx converts "
            f"each block, has none). Convert the whole model, or name the layers with hp=PATTERN"
        )
    return out
