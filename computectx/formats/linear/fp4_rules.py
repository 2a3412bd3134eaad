"""A 4-bit recipe's own high-precision rules over a model (``Fp4Recipe.hp``, ``hp_last``):
the block of every module, linears and experts alike, and the rules that can keep nothing high.

The blocks are the model's **block list** (``model_blocks``): the ``nn.ModuleList`` or
``nn.ModuleDict`` with the most entries among those holding an ``nn.Linear`` (the first in
registration order on a tie: ``ByteLM.blocks``, transformers' ``model.layers``, torchtitan's
``layers``), leaving out a list that sits inside a *repeated* entry of another such list (an
entry whose class another entry holding a linear shares: a layer of a stack). Block ``i`` is
its ``i``-th entry, and every module inside it (a linear, grouped experts) is in block ``i``.
So a model whose experts are an ``nn.ModuleList`` of MLPs in each layer (transformers 4's
Mixtral, Qwen-MoE: 60 experts, 24 layers) has its layers as blocks, not layer 0's experts.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

from torch import nn

from computectx.fp4_recipe import Fp4Recipe

__all__ = ["model_blocks", "unheeded_rules"]


def model_blocks(model: nn.Module) -> dict[int, tuple[int, int]]:
    """``id(module) -> (block, blocks)`` for every module inside an entry of the model's block
    list (module docstring); empty when the model has none."""
    lists: list[tuple[str, list[nn.Module]]] = []
    repeated: list[str] = []  # the names of entries that are layers of a stack
    for name, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            continue
        entries = dict(m.named_children())
        holding = {
            key: e
            for key, e in entries.items()
            if any(isinstance(s, nn.Linear) for s in e.modules())
        }
        if not holding:
            continue
        lists.append((name, list(entries.values())))
        kinds = [type(e) for e in holding.values()]
        repeated += [
            f"{name}.{k}" if name else k for k, e in holding.items() if kinds.count(type(e)) > 1
        ]
    free = [
        entries for name, entries in lists if not any(name.startswith(r + ".") for r in repeated)
    ]
    best = max(free, key=len, default=[])
    blocks: dict[int, tuple[int, int]] = {}
    for i, entry in enumerate(best):
        for s in entry.modules():
            blocks.setdefault(id(s), (i, len(best)))
    return blocks


def unheeded_rules(recipe: Fp4Recipe, names: Iterable[str], has_blocks: bool) -> list[str]:
    """What ``recipe``'s rules cannot act on, one sentence each: an ``hp`` pattern that
    matches none of ``names`` (the linears and experts modules the conversion looked at),
    ``hp_last`` on a model without a block list (``has_blocks`` false)."""
    seen = [n.lower() for n in names]
    # Without a block list the root may be one block, converted as a model built under a
    # 4-bit ctx converts each: it sees its own names only, and says so.
    alone = (
        ""
        if has_blocks
        else "; a block converted on its own, as a model built under a 4-bit ctx converts "
        "each block, sees only its own names ('attn.qkv', not 'blocks.2.attn.qkv'): build "
        "the model without the recipe and convert it whole"
    )
    out = [
        f"the 4-bit recipe's hp={p!r} matches no linear or experts module of the model, so it "
        f"keeps nothing in high precision (patterns match the whole dotted name, any case: "
        f"'*.attn.*', 'blocks.0.*'){alone}"
        for p in recipe.hp
        if not any(fnmatch.fnmatchcase(n, p) for n in seen)
    ]
    if recipe.hp_last and not has_blocks:
        out.append(
            f"the 4-bit recipe's hp_last={recipe.hp_last} keeps nothing in high precision: the "
            f"model has no block list (an nn.ModuleList or nn.ModuleDict holding nn.Linear "
            f"layers; a block converted on its own, as a model built under a 4-bit ctx converts "
            f"each block, has none). Convert the whole model (build it without the recipe, then "
            f"convert_to_quantized(model, ctx)), or name its layers with hp=PATTERN"
        )
    return out
