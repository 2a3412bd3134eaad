"""Residency-aware weight loading: safetensors checkpoints placed by ``ctx.residency``."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Final

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from computectx._files import atomic_path, target_of
from computectx.ctx import ComputeCtx
from computectx.memory._load_hooks import (
    check_module_state,
    plan_module_state,
    state_defaults,
    state_owners,
)
from computectx.residency import Residency, available_bytes

__all__ = ["LoadReport", "load_weights", "save_weights"]

_EXTRA_STATE: Final = "_extra_state"
"""The state-dict name of a module's ``get_extra_state()`` (torch's)."""
_ALIASES_KEY = "computectx.aliases"
"""safetensors metadata entry: JSON ``{alias: stored name}`` for tied weights."""

_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu, "F4": torch.float4_e2m1fn_x2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What ``load_weights`` did and why.

    ``requested`` is ``ctx.residency``; ``chosen`` is the concrete placement (``DEVICE`` or
    ``MMAP``). ``available_bytes`` is the free memory measured on ``ctx.device`` (``None``
    when the choice did not need a measurement) and ``reserve_bytes`` the headroom kept
    back from it. ``device`` is where the tensors now live; ``reason`` says why in words.
    """

    path: pathlib.Path
    requested: Residency
    chosen: Residency
    checkpoint_bytes: int
    available_bytes: int | None
    reserve_bytes: int
    device: torch.device
    tensors: int
    reason: str

    def __str__(self) -> str:
        return self.reason


def save_weights(model: torch.nn.Module, path: str | os.PathLike[str]) -> pathlib.Path:
    """Write ``model.state_dict()`` to a safetensors file at ``path``; return the path.

    Tied tensors (the same tensor under several names) are stored once and recorded as
    aliases in the file's metadata, which ``load_weights`` reads back. Every tensor of the
    state dict is stored, buffers included (a ``QuantizedLinear``'s scaling state is buffers, so it
    travels with the weights); module extra state that is not a tensor (``get_extra_state``
    returning other objects) cannot go into safetensors and is left out.

    The file is written durably (``computectx._files.atomic_path``): to a temporary in the
    same folder, fsynced, renamed over ``path`` and the folder fsynced, so a crash leaves the
    old checkpoint or the new one. A new file gets the mode the umask gives, an overwritten
    one keeps its mode, and a symlink is written through to its target. An empty path, a
    folder, or a missing folder is refused before anything is written.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    target_of(path, what="weights")  # refuse a bad path before copying any tensor
    named = _tensor_entries(model)
    stored: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first_name: dict[int, str] = {}
    for name, t in named.items():
        if id(t) in first_name:
            aliases[name] = first_name[id(t)]
            continue
        first_name[id(t)] = name
        stored[name] = t.detach().to("cpu").contiguous()
    metadata = {_ALIASES_KEY: json.dumps(aliases, sort_keys=True)}
    with atomic_path(path, what="weights") as tmp:
        try:
            save_file(stored, tmp, metadata=metadata)
        except (SafetensorError, RuntimeError, ValueError) as e:
            raise ValueError(f"cannot save weights to {os.fspath(path)!r}: {e}") from e
    return pathlib.Path(path)


def load_weights(
    model: torch.nn.Module,
    path: str | os.PathLike[str],
    ctx: ComputeCtx,
    *,
    reserve_bytes: int = 0,
) -> LoadReport:
    """Load a safetensors checkpoint into ``model``, placed by ``ctx.residency``.

    ``DEVICE`` materialises every tensor on ``ctx.device`` (a real copy, independent of
    the file). ``MMAP`` keeps the tensors memory-mapped from the file (private
    copy-on-write pages on the host: writes never reach the file); on a CUDA ``ctx`` the
    weights then stay in host memory. ``AUTO`` picks ``DEVICE`` when the checkpoint's
    tensor bytes fit the free memory measured on ``ctx.device`` minus ``reserve_bytes``,
    ``MMAP`` otherwise; the report says which and why.

    Parameters are updated in place (``param.data`` is replaced), so tied weights stay
    tied and optimizers built on the model keep their references. Everything is checked
    first -- file, header, keys, shapes and dtypes -- and any problem raises (naming the
    file and the keys) with the model unchanged. dtypes must match exactly: nothing is
    cast silently. A module that defines ``check_state_tensors`` (an ``Attention``: its
    calibrated ``kv_amax``) checks its tensors then too (its ``ValueError`` is raised again
    naming the file; given a ``prefix`` keyword, it names its tensors by their full keys).
    A module that defines ``state_load_keys`` and ``plan_state_load`` (a ``QuantizedLinear``:
    its scaling state) loads those keys by its own rule, the one its ``load_state_dict``
    follows (``computectx.formats.scaling.load``): they are left out of the key, shape and dtype
    checks here and handed to ``plan_state_load``, which checks them (naming keys, dtypes
    or both policies; another history length is converted; absent, as from an
    ``nn.Linear`` checkpoint, the state starts fresh) before anything is replaced, and
    installs them after the weights. A module that defines
    ``default_state_tensors`` names state a checkpoint may lack (state added after such
    checkpoints were written: an ``Attention``'s calibrated ``kv_amax``); a checkpoint
    without it loads those defaults, and the report says how many. A module's extra state
    that is a tensor goes to its ``set_extra_state``, before the weights are replaced (as
    ``load_state_dict`` hands it over); extra state that is not a tensor (see
    ``save_weights``) is left as it is, and the report says how many entries that was.
    """
    file = _checked_load_args(model, path, ctx, reserve_bytes)
    header, aliases = _read_header(file)
    targets = _tensor_entries(model)
    kept = len(model.state_dict(keep_vars=True)) - len(targets)
    owners = state_owners(model)
    owned = {name for _, _, names in owners for name in names}
    targets = {name: t for name, t in targets.items() if name not in owned}
    _check_not_meta(file, targets)
    defaults = state_defaults(model, targets)
    resolved = _check_keys(file, header, aliases, targets, set(defaults), owned)
    defaulted = {name: t for name, t in defaults.items() if name not in resolved}
    ckpt_bytes = sum(_nbytes(shape, dtype) for shape, dtype in header.values())
    chosen, measured, reason = _choose_residency(ctx, ckpt_bytes, reserve_bytes)
    device = torch.device("cpu") if chosen is Residency.MMAP else ctx.device
    reason += _placement_notes(chosen, ctx, kept, defaulted)

    loaded = _materialise(file, header, chosen, device)
    _check_unchanged(file, header, loaded)
    given = {name: loaded[stored] for name, stored in resolved.items()}
    check_module_state(model, given | defaulted, file)
    own_given = {name: loaded[name] for name in owned if name in loaded}
    finish = plan_module_state(owners, given | own_given, file)
    with torch.no_grad():
        _install(model, targets, resolved, loaded, defaulted, device)
        for install in finish:
            install()
    return LoadReport(
        path=file,
        requested=ctx.residency,
        chosen=chosen,
        checkpoint_bytes=ckpt_bytes,
        available_bytes=measured,
        reserve_bytes=reserve_bytes,
        device=device,
        tensors=len(loaded),
        reason=f"{file}: {reason}",
    )


def _checked_load_args(
    model: object, path: str | os.PathLike[str], ctx: object, reserve_bytes: object
) -> pathlib.Path:
    """``load_weights``' arguments checked; the checkpoint's path, an existing file."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(ctx, ComputeCtx):
        raise TypeError(f"ctx must be a ComputeCtx, got {type(ctx).__name__}")
    if isinstance(reserve_bytes, bool) or not isinstance(reserve_bytes, int) or reserve_bytes < 0:
        raise ValueError(f"reserve_bytes must be a non-negative int, got {reserve_bytes!r}")
    file = pathlib.Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"checkpoint {str(file)!r} does not exist or is not a file")
    return file


def _check_not_meta(file: pathlib.Path, targets: dict[str, torch.Tensor]) -> None:
    """``ValueError`` naming them when tensors of the model are on the meta device (a
    skeleton): their memory is to be made first, as nothing of them can be replaced in place."""
    meta = sorted(name for name, t in targets.items() if t.is_meta)
    if meta:
        raise ValueError(
            f"checkpoint {str(file)!r}: the model's {meta[:4]}{' ...' if len(meta) > 4 else ''} "
            f"({len(meta)} tensor(s)) are on the meta device; load_weights replaces tensors "
            f"that hold memory: call model.to_empty(device=...) first (and fill its "
            f"non-persistent buffers, which no checkpoint holds); nothing was loaded"
        )


def _choose_residency(
    ctx: ComputeCtx, ckpt_bytes: int, reserve_bytes: int
) -> tuple[Residency, int | None, str]:
    """Where the tensors go (``DEVICE`` or ``MMAP``), the free bytes measured (``AUTO``
    only) and why, in words."""
    requested = ctx.residency
    if requested is not Residency.AUTO:
        return requested, None, f"{requested}: requested by ctx.residency"
    measured = available_bytes(ctx.device)
    budget = max(measured - reserve_bytes, 0)
    chosen = requested.resolve(ckpt_bytes, budget)
    relation = "fits in" if chosen is Residency.DEVICE else "exceeds"
    reason = (
        f"auto -> {chosen}: the checkpoint's {ckpt_bytes:,} tensor bytes {relation} the "
        f"{budget:,} bytes free on {ctx.device} ({measured:,} measured free, "
        f"{reserve_bytes:,} reserved)"
    )
    return chosen, measured, reason


def _placement_notes(
    chosen: Residency, ctx: ComputeCtx, kept: int, defaulted: dict[str, torch.Tensor]
) -> str:
    """The report's words on where a memory-mapped load lives, the extra state left as it
    was and the tensors that took their defaults."""
    notes = ""
    if chosen is Residency.MMAP:
        if ctx.device.type != "cpu":
            notes += f"; weights stay memory-mapped in host memory, not on {ctx.device}"
        else:
            notes += "; tensors are views of a private memory map of the file"
    if kept:
        notes += f"; {kept} module extra-state entr{'y' if kept == 1 else 'ies'} left as they were"
    if defaulted:
        notes += (
            f"; {len(defaulted)} tensor(s) the checkpoint lacks took their defaults "
            f"({', '.join(sorted(defaulted))})"
        )
    return notes


def _install(
    model: torch.nn.Module,
    targets: dict[str, torch.Tensor],
    resolved: dict[str, str],
    loaded: dict[str, torch.Tensor],
    defaulted: dict[str, torch.Tensor],
    device: torch.device,
) -> None:
    """Hand every checked tensor to the model: a module's tensor extra state to its
    ``set_extra_state`` first (as ``load_state_dict`` hands it: one that refuses leaves the
    weights as they were), then a parameter's ``data`` is replaced in place (tied weights stay
    tied, optimizers keep their references), a buffer is replaced."""
    owners = {name: _extra_state_owner(model, name) for name in targets}
    extra = {name: owner for name, owner in owners.items() if owner is not None}
    for name, owner in extra.items():
        owner.set_extra_state(loaded[resolved[name]])
    claimed: dict[str, int] = {}
    for name, target in targets.items():
        if name in extra:
            continue
        if name in defaulted:
            _replace_buffer(model, name, defaulted[name].to(device=device, copy=True))
            continue
        stored = resolved[name]
        source = loaded[stored]
        if claimed.setdefault(stored, id(target)) != id(target):
            # Tied in the file, separate in the model: give each its own storage, or
            # an optimizer would update one memory twice through two parameters.
            source = source.clone()
        if isinstance(target, torch.nn.Parameter):
            if target.data is not source:
                target.data = source
        else:
            _replace_buffer(model, name, source)


def _tensor_entries(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # state_dict may also hold modules' extra state (arbitrary objects): only tensors go
    # into safetensors.
    return {
        k: v for k, v in model.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)
    }


def _read_header(
    file: pathlib.Path,
) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], dict[str, str]]:
    shown = repr(str(file))
    try:
        with safe_open(str(file), framework="pt") as f:
            meta = f.metadata() or {}
            header: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
            keys = f.keys()
            for key in keys:
                sl = f.get_slice(key)
                code = sl.get_dtype()
                if code not in _ST_DTYPES:
                    raise ValueError(
                        f"checkpoint {shown}: tensor {key!r} has dtype {code}, which torch "
                        f"cannot hold; accepted: {', '.join(_ST_DTYPES)}"
                    )
                header[key] = (_torch_shape(shown, key, code, sl.get_shape()), _ST_DTYPES[code])
    except SafetensorError as e:
        raise ValueError(f"checkpoint {shown} is not a valid safetensors file: {e}") from e
    raw = meta.get(_ALIASES_KEY, "{}")
    try:
        aliases = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"checkpoint {shown}: bad {_ALIASES_KEY!r} metadata: {e}") from e
    if not isinstance(aliases, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and v in header for k, v in aliases.items()
    ):
        raise ValueError(
            f"checkpoint {shown}: {_ALIASES_KEY!r} metadata must map names to stored tensor "
            f"names, got {raw!r}"
        )
    return header, aliases


def _torch_shape(shown: str, key: str, code: str, shape: list[int]) -> tuple[int, ...]:
    """The tensor's torch shape: safetensors counts an ``F4`` tensor in 4-bit elements, torch
    in bytes (``float4_e2m1fn_x2`` holds two), so the last dimension halves."""
    if code != "F4":
        return tuple(shape)
    if not shape or shape[-1] % 2:
        raise ValueError(
            f"checkpoint {shown}: tensor {key!r} of dtype F4 has shape {shape}; its last "
            f"dimension counts 4-bit elements and must be even (two to a byte)"
        )
    return (*shape[:-1], shape[-1] // 2)


def _check_keys(
    file: pathlib.Path,
    header: dict[str, tuple[tuple[int, ...], torch.dtype]],
    aliases: dict[str, str],
    targets: dict[str, torch.Tensor],
    optional: set[str],
    owned: set[str],
) -> dict[str, str]:
    """Map every model key to the stored tensor it loads from, or raise listing problems.
    Keys in ``optional`` (buffers with a default) may be absent from the file; keys in
    ``owned`` (loaded by their module's own rule) are neither missing nor unexpected."""
    shown = repr(str(file))
    # Names bound to one tensor in the model (tied weights) may be stored under any one
    # of them: the file need not repeat a tie that the model already has.
    groups: dict[int, list[str]] = {}
    for name, t in targets.items():
        groups.setdefault(id(t), []).append(name)
    resolved: dict[str, str] = {}
    split: list[list[str]] = []
    missing: list[str] = []
    for names in groups.values():
        stored = sorted({aliases.get(n, n) for n in names if aliases.get(n, n) in header})
        if not stored:
            missing.extend(n for n in names if n not in optional)
        elif len(stored) > 1:
            split.append(stored)
        else:
            resolved.update({n: stored[0] for n in names})
    used = set(resolved.values()) | {s for group in split for s in group}
    unexpected = sorted((set(header) - used - owned) | (set(aliases) - set(targets) - owned))
    problems = []
    if missing:
        problems.append(f"missing keys {sorted(missing)}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected}")
    if split:
        problems.append(f"tensors tied in the model are stored separately: {split}")
    mismatched = []
    for name, stored_name in resolved.items():
        shape, dtype = header[stored_name]
        t = targets[name]
        if tuple(t.shape) != shape or t.dtype != dtype:
            mismatched.append(
                f"{name!r}: checkpoint {str(dtype).removeprefix('torch.')}{list(shape)} vs "
                f"model {str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
            )
    if mismatched:
        problems.append("shape/dtype mismatches " + "; ".join(sorted(mismatched)))
    if problems:
        raise ValueError(f"checkpoint {shown} does not match the model: " + "; ".join(problems))
    return resolved


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * dtype.itemsize


def _materialise(
    file: pathlib.Path,
    header: dict[str, tuple[tuple[int, ...], torch.dtype]],
    chosen: Residency,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    shown = repr(str(file))
    out: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in header:
                # safetensors maps the file once per handle and returns CPU tensors that
                # view that private mapping: exactly MMAP. DEVICE needs an owned copy.
                t = f.get_tensor(key)
                if chosen is Residency.DEVICE:
                    t = t.to(device=device, copy=True)
                out[key] = t
    except SafetensorError as e:
        raise ValueError(f"checkpoint {shown} could not be read: {e}") from e
    except RuntimeError as e:
        raise ValueError(f"checkpoint {shown} could not be placed on {device}: {e}") from e
    return out


def _check_unchanged(
    file: pathlib.Path,
    header: dict[str, tuple[tuple[int, ...], torch.dtype]],
    loaded: dict[str, torch.Tensor],
) -> None:
    # The keys, shapes and dtypes were checked on the header; the tensors are read by a
    # second open of the file. A file replaced in between (another process saving over it)
    # must not hand over tensors nobody checked: ``param.data = t`` would take any shape.
    changed = sorted(
        key
        for key in header.keys() | loaded.keys()
        if key not in header
        or key not in loaded
        or (tuple(loaded[key].shape), loaded[key].dtype) != header[key]
    )
    if changed:
        raise ValueError(
            f"checkpoint {str(file)!r} changed while it was read (another process wrote "
            f"it?): tensors {changed[:8]} are not what its header said; nothing was loaded"
        )


def _extra_state_owner(model: torch.nn.Module, name: str) -> torch.nn.Module | None:
    """The module whose ``get_extra_state`` gave the entry ``name`` (a tensor), else ``None``."""
    owner_name, _, attr = name.rpartition(".")
    if attr != _EXTRA_STATE:
        return None
    owner = model.get_submodule(owner_name)
    return None if attr in owner._buffers else owner


def _replace_buffer(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    # Module.__setattr__ replaces a registered buffer in place and keeps its persistence.
    setattr(model.get_submodule(owner_name), attr, value)
