"""The files of a checkpoint directory: safetensors (one file, or shards and their index, as
``save_pretrained`` writes them) and config.json, written whole or not at all, and read back
as the index says (``read_tensors``)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

import torch

from computectx._files import atomic_directory

__all__ = ["SHARD_BYTES", "read_tensors", "write_checkpoint"]

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


INDEX: Final = "model.safetensors.index.json"


def read_tensors(
    folder: Path, wanted: Callable[[str], bool] = lambda name: True
) -> dict[str, torch.Tensor]:
    """The tensors of the directory's safetensors whose names are ``wanted`` (all, by default):
    ``model.safetensors``, or the shards ``model.safetensors.index.json`` names.

    Sharded, the index's ``weight_map`` and the shards' headers must agree, name by name (every
    header is read, only wanted tensors are loaded): ``ValueError`` for a shard it names that
    is missing, a tensor in two shards (naming it and both files), a tensor in a shard the
    index puts elsewhere or does not list, and an index entry its shard does not hold. A
    tensor never comes from a file the index does not name for it."""
    from safetensors import safe_open

    if (folder / INDEX).is_file():
        weight_map = _weight_map(folder)
        files = sorted(set(weight_map.values()))
    elif (folder / "model.safetensors").is_file():
        weight_map, files = None, ["model.safetensors"]
    else:
        raise ValueError(
            f"import_pretrained: {str(folder)!r} holds neither model.safetensors nor {INDEX}"
        )
    keys: dict[str, list[str]] = {}
    for file in files:
        with safe_open(folder / file, framework="pt") as f:
            keys[file] = list(f.keys())
    if weight_map is not None:
        _check_shards(weight_map, keys)
    out: dict[str, torch.Tensor] = {}
    for file in files:
        names = [k for k in keys[file] if wanted(k)]
        if names:
            with safe_open(folder / file, framework="pt") as f:
                out.update({k: f.get_tensor(k) for k in names})
    return out


def _weight_map(folder: Path) -> dict[str, str]:
    """The index's ``weight_map`` (tensor name -> shard file), checked: a JSON object of
    strings naming files of ``folder`` that exist."""
    where = f"import_pretrained: {str(folder / INDEX)!r}"
    try:
        index = json.loads((folder / INDEX).read_text("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{where} is not JSON ({e})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise ValueError(f"{where} holds no weight_map of tensor names to shard file names")
    for file in sorted(set(weight_map.values())):
        if Path(file).name != file or not (folder / file).is_file():
            first = next(k for k, v in sorted(weight_map.items()) if v == file)
            raise ValueError(
                f"{where} names the shard {file!r} (for {first!r} and others), which is not a "
                f"file of the directory: a shard is missing or the index does not belong here"
            )
    return weight_map


def _check_shards(weight_map: Mapping[str, str], keys: Mapping[str, list[str]]) -> None:
    """Refuses a tensor in two shards, one in a shard the index does not put it in, and an
    index entry its shard does not hold (``read_tensors``)."""
    seen: dict[str, str] = {}
    for file in sorted(keys):
        for name in keys[file]:
            if name in seen:
                raise ValueError(
                    f"import_pretrained: the tensor {name!r} is in two shards, {seen[name]!r} "
                    f"and {file!r}; the index names {weight_map.get(name)!r}. Refused: which "
                    f"copy is meant is not known"
                )
            seen[name] = file
    for name, file in sorted(seen.items()):
        if weight_map.get(name) != file:
            listed = weight_map.get(name)
            said = "does not list it" if listed is None else f"names {listed!r}"
            raise ValueError(
                f"import_pretrained: the shard {file!r} holds {name!r}, but the index {said}"
            )
    ghosts = sorted(name for name in weight_map if name not in seen)
    if ghosts:
        raise ValueError(
            f"import_pretrained: the index lists {len(ghosts)} tensor(s) no shard holds (the "
            f"first: {ghosts[0]!r}, in {weight_map[ghosts[0]]!r})"
        )
