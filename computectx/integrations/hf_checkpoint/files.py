"""The files of a checkpoint directory: safetensors (one file, or shards and their index, as
``save_pretrained`` writes them) and config.json, written whole or not at all."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import torch

from computectx._files import atomic_directory

__all__ = ["SHARD_BYTES", "write_checkpoint"]

SHARD_BYTES: Final = 5 * 2**30
"""The largest safetensors file written before the tensors go into shards (5 GiB)."""


def _shards(
    tensors: Mapping[str, torch.Tensor], max_shard_bytes: int
) -> dict[str, dict[str, torch.Tensor]]:
    """File name -> its tensors: one ``model.safetensors``, or shards in name order."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        return {"model.safetensors": shards[0]}
    n = len(shards)
    return {f"model-{i + 1:05d}-of-{n:05d}.safetensors": s for i, s in enumerate(shards)}


def write_checkpoint(
    target: Path,
    tensors: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    max_shard_bytes: int,
) -> None:
    """Write ``tensors`` and ``config`` as a checkpoint directory at ``target`` (through
    ``atomic_directory``: the old directory or the new one, never a mix)."""
    from safetensors.torch import save_file

    files = _shards(tensors, max_shard_bytes)
    texts = {"config.json": config}
    if len(files) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map = {name: file for file, shard in files.items() for name in shard}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        texts["model.safetensors.index.json"] = index
    with atomic_directory(target) as folder:
        for file, shard in files.items():
            save_file(shard, folder / file, metadata={"format": "pt"})
        for file, data in texts.items():
            (folder / file).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", "utf-8")
