"""The per-parameter step over compact optimizer state and low-precision weights.

``Stepper`` steps the parameters of a torch optimizer (``inner``) one at a time, so the
extra memory of a step is one parameter's float32 working copy of weight, gradient and
decoded state, in one reused ``Scratch`` buffer:

- the generic path, for any torch.optim class whose state tensors have the parameter's
  shape or are scalars: the inner optimizer's group is pointed at the one working tensor
  (the weight itself when it is float32, else its float32 copy) and its decoded state,
  ``inner.step()`` runs torch's own update, and the state is encoded back. The inner
  optimizer's ``param_groups`` and ``defaults`` stay the real objects between steps, so LR
  schedulers and checkpoints see them as usual;
- the fused path, for ``torch.optim.Adam``/``AdamW`` without amsgrad, capturable,
  differentiable or torch's fused kernel: ``fused.adam_update`` decodes, updates and
  encodes in one pass: on the CPU the native kernel (``compile=None`` or ``True``; its
  torch-ops twin with ``compile=False``), on CUDA one compiled graph (``compile=None`` or
  ``True``; the twin eagerly with ``compile=False``).

A weight below float32 (a bf16/f16 master, or a bf16 parameter of ``CompactOptimizer``) is
updated in float32 and written back with stochastic rounding, from ``RoundingGenerators``
seeded with ``seed``: one 64-bit key per parameter per step is drawn from the generator and
each element's bits derive from (key, index) (``_rounding.stochastic_round_keyed``). The same
seed draws the same bits on every rank, so data-parallel ranks keep identical weights without
a collective.

Classes whose state does not fit (Adafactor's factored moments, SparseAdam's sparse
updates, LBFGS's history) are refused at construction by ``classes.check_fits``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import torch

from computectx.dtypes import FLOAT_DTYPES
from computectx.memory._rounding import (
    RoundingGenerators,
    check_seed,
    draw_key,
    stochastic_round_keyed,
)
from computectx.memory.optim.classes import check_fits, class_name
from computectx.memory.optim.fused import adam_update, native_ready
from computectx.memory.optim.state.codecs import decode, encode
from computectx.memory.optim.state.packed import Packed
from computectx.memory.optim.state.store import (
    MASTER_ROUNDING_KEY,
    OPTIM_STATE_KEY,
    PARAM_SHAPES_KEY,
    PART_SEP,
    Scratch,
    check_scalars,
    encode_entry,
    kind_of,
    packed_of,
    packs,
    param_shapes,
    split_entry,
    state_name,
)
from computectx.optim_state import OptimState

__all__ = [
    "MASTER_ROUNDING_KEY",
    "OPTIM_STATE_KEY",
    "STEPPED_DTYPES",
    "Stepper",
    "below_f32",
    "check_compile",
    "check_fits",
    "check_seed",
]

STEPPED_DTYPES = FLOAT_DTYPES  # the weights the stepper updates in float32 and writes back


def check_compile(compile: object) -> None:
    """``TypeError`` unless ``compile`` is ``True``, ``False`` or ``None``."""
    if compile is not None and not isinstance(compile, bool):
        raise TypeError(f"compile must be True, False or None, got {compile!r}")


def below_f32(dtype: torch.dtype) -> bool:
    """Whether weights of ``dtype`` are written back with stochastic rounding."""
    return dtype.is_floating_point and torch.finfo(dtype).bits < 32


_NOT_FUSED = ("amsgrad", "capturable", "differentiable", "fused")
"""The Adam group options that the fused update does not take (torch's own update runs)."""


@dataclasses.dataclass
class _Work:
    """One parameter's float32 working tensors during its step."""

    weight: torch.Tensor
    state: dict[str, Any]


class Stepper:
    """Steps the parameters of ``inner`` one at a time, state stored as ``optim_state``.

    ``compile``: ``False`` runs the fused Adam update's torch-ops twin eagerly; ``None``
    and ``True`` run it as the native kernel on the CPU (the twin where the kernel cannot be
    built; a ``RuntimeError`` then under ``torch.distributed`` with several ranks) and
    through ``torch.compile`` on CUDA (Inductor's CPU code is slower than eager).
    ``seed`` seeds the stochastic rounding of weights below float32.
    """

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        optim_state: OptimState,
        *,
        seed: int,
        compile: bool | None,
        who: str,
    ) -> None:
        check_seed(seed)
        check_compile(compile)
        check_fits(type(inner), dict(inner.param_groups[0]), optim_state, who)
        self.inner = inner
        self.who = who
        self.optim_state = optim_state
        self.compile = compile
        self.rounding = RoundingGenerators(seed)
        self.scratch = Scratch()
        # The Packed values of the last encode, per parameter: their parts are the tensors
        # in ``inner.state``, so a step rebuilds nothing (and checks nothing) while the
        # state still holds them; a loaded state is checked by the codec once.
        self._packed: dict[torch.Tensor, dict[str, Packed]] = {}
        self.fused = type(inner) in (torch.optim.Adam, torch.optim.AdamW)
        """Whether Adam/AdamW steps take ``fused.adam_update`` (set ``False`` to run torch's
        own update through the generic path instead; other classes always do)."""
        # State a class makes at construction (Adagrad's sums) is stored as ours at once.
        with torch.no_grad():
            for group in inner.param_groups:
                for p in group["params"]:
                    if inner.state.get(p):
                        self._store(p, dict(inner.state[p]))

    # ----- the step ---------------------------------------------------------------------

    @torch.no_grad()
    def step(self, *, checked: bool = False) -> None:
        """Step every parameter with a gradient, group by group, in order. Everything a step
        reads is checked first (``check``; ``checked=True``: the caller just ran it), so a
        refused step changes nothing; then each parameter's update is computed in full
        (weight and state) before either is written."""
        if not checked:
            self.check()
        inner = self.inner
        groups = inner.param_groups
        for group in list(groups):
            params = group["params"]
            for p in list(params):
                if p.grad is None:
                    continue
                if self._uses_fused(group, p):
                    self._step_fused(group, p)
                else:
                    self._step_generic(group, p)

    def check(self) -> None:
        """``ValueError`` unless the state of every parameter can be stepped: its scalars
        (``step`` a whole number >= 0, the rest finite: ``check_scalars``) and its packed
        parts (the codec's checks, once per set of parts: cached after)."""
        inner = self.inner
        entries: list[tuple[str, dict[str, Any]]] = []
        native = False
        for j, group in enumerate(inner.param_groups):
            for k, p in enumerate(group["params"]):
                native = native or self._native(group, p)
                if p.grad is not None and p.dtype not in STEPPED_DTYPES:
                    raise TypeError(
                        f"{self.who}.step: param_groups[{j}]['params'][{k}] has dtype "
                        f"{p.dtype} (changed since it was added); the stepper takes float32, "
                        f"bfloat16 or float16 weights. Nothing was stepped"
                    )
                entry = inner.state.get(p)
                if not entry:
                    continue
                where = f"{self.who}.step: state of param_groups[{j}]['params'][{k}]"
                entries.append((where, entry))
                _, packed = split_entry(entry)
                for name, parts in packed.items():
                    self._packed_value(p, name, parts, where)
        check_scalars(entries)
        if native:
            # Built now if not yet: under several ranks a build that failed here raises, in
            # the check the ranks agree on before any of them steps (Parallel.step).
            native_ready()

    def _native(self, group: dict[str, Any], p: torch.Tensor) -> bool:
        """Whether ``p``'s fused update runs the native CPU kernel, its gradient aside (an
        ``OffloadedOptimizer`` ingests it after the checks)."""
        return (
            self.fused
            and self.compile is not False
            and p.device.type == "cpu"
            and not p.is_complex()
            and not any(group.get(key, False) for key in _NOT_FUSED)
        )

    def _uses_fused(self, group: dict[str, Any], p: torch.Tensor) -> bool:
        return (
            self.fused
            and not any(group.get(key, False) for key in _NOT_FUSED)
            and not p.is_complex()
            and p.grad is not None
            and not p.grad.is_sparse
        )

    def _generator(self, p: torch.Tensor) -> torch.Generator | None:
        return self.rounding.get(p.device) if below_f32(p.dtype) else None

    def _step_generic(self, group: dict[str, Any], p: torch.Tensor) -> None:
        # Torch's update runs on a float32 working copy of the weight, and its state is
        # encoded, before either is written: an error (a class's own check, state the codec
        # refuses) leaves this parameter's weight and state as they were.
        inner = self.inner
        entry = inner.state.get(p) or {}
        work = self._decode(p, entry)
        w = work.weight
        groups, params = inner.param_groups, group["params"]
        inner.param_groups = [group]
        group["params"] = [w]
        if work.state:
            inner.state[w] = work.state
        try:
            inner.step()
        finally:
            group["params"] = params
            inner.param_groups = groups
            new = dict(inner.state.pop(w, {}))
            w.grad = None
        self._check_shapes(p, new)
        for name, value in new.items():
            if (
                isinstance(value, torch.Tensor)
                and self.scratch.owns(value)
                and not packs(value, p.shape, self.optim_state)
                and not _param_shaped(entry.get(name), p)
            ):
                new[name] = value.clone()
        made: dict[str, Packed] = {}
        try:
            stored = encode_entry(
                new, p.shape, self.optim_state, check_finite=p.device.type == "cpu", packed_out=made
            )
        except ValueError as e:
            raise ValueError(
                f"the optimizer state of a parameter of shape {list(p.shape)} is NaN after "
                f"its step and cannot be stored as {self.optim_state}; this parameter's weight "
                f"and state are kept as before this step ({e})"
            ) from e
        # Everything is computed: now written. A plain value torch kept (step, a tensor
        # below min_size, f32 state) is written into the stored tensor itself.
        for name, value in stored.items():
            old = entry.get(name)
            if (
                isinstance(old, torch.Tensor)
                and isinstance(value, torch.Tensor)
                and value is not old
                and (old.shape, old.dtype, old.device) == (value.shape, value.dtype, value.device)
            ):
                old.copy_(value)
                stored[name] = old
        inner.state[p] = stored
        self._packed[p] = made
        self._write_back(p, w)

    def _decode(self, p: torch.Tensor, entry: dict[str, Any]) -> _Work:
        """The working weight (a float32 copy, with its float32 gradient) and the decoded
        state of ``p``: packed state decoded into scratch views, plain tensors (scalars,
        tensors below ``min_size``, f32 state) copied, so that torch's in-place update
        changes none of the stored values."""
        plain, packed = split_entry(entry)
        low = below_f32(p.dtype)
        full = [k for k, v in plain.items() if _param_shaped(v, p)]
        views = self.scratch.views(p.device, p.shape, len(packed) + len(full) + (2 if low else 1))
        state: dict[str, Any] = {}
        for name, value in plain.items():
            if name in full:
                state[name] = views.pop().copy_(value)
            else:
                state[name] = value.clone() if isinstance(value, torch.Tensor) else value
        for name, parts in packed.items():
            state[name] = decode(self._packed_value(p, name, parts), out=views.pop())
        # Back in torch's order (step first), whatever order the parts were stored in.
        order: dict[str, int] = {}
        for key in entry:
            order.setdefault(state_name(key), len(order))
        state = {k: state[k] for k in sorted(state, key=lambda k: order.get(k, len(order)))}
        w = views.pop().copy_(p)
        assert p.grad is not None
        w.grad = views.pop().copy_(p.grad) if low else p.grad
        return _Work(w, state)

    def _packed_value(
        self, p: torch.Tensor, name: str, parts: dict[str, Any], where: str = "state"
    ) -> Packed:
        """The ``Packed`` value of state ``name`` of ``p`` stored as ``parts`` (checked by the
        codec the first time these very tensors are met, then kept)."""
        cached = self._packed.get(p, {}).get(name)
        if (
            cached is not None
            and cached.parts.keys() == parts.keys()
            and all(cached.parts[k] is v for k, v in parts.items())
        ):
            return cached
        packed = packed_of(parts, name, p.shape, self.optim_state, f"{where}[{name!r}]")
        self._packed.setdefault(p, {})[name] = packed
        return packed

    def _store(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        """Encode ``state`` (decoded, by name) into ``inner.state[p]``."""
        made: dict[str, Packed] = {}
        self.inner.state[p] = encode_entry(
            state, p.shape, self.optim_state, check_finite=p.device.type == "cpu", packed_out=made
        )
        self._packed[p] = made

    def _write_back(self, p: torch.Tensor, w: torch.Tensor) -> None:
        gen = self._generator(p)
        if gen is None:
            p.copy_(w)
        else:
            p.copy_(stochastic_round_keyed(w, p.dtype, draw_key(gen)))

    def _check_shapes(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != p.shape:
                raise ValueError(
                    f"{class_name(type(self.inner))} made state {key!r} of shape "
                    f"{list(value.shape)} for a parameter of shape {list(p.shape)}; compact "
                    f"optimizer state needs the parameter's shape or a scalar"
                )

    def _step_fused(self, group: dict[str, Any], p: torch.Tensor) -> None:
        inner = self.inner
        entry = inner.state.get(p) or {}
        plain, packed = split_entry(entry)
        shape, fmt = p.shape, self.optim_state
        moments: list[Packed | torch.Tensor] = []
        fresh = not entry
        if fresh:
            # Zero moments as later steps read them (packed): one compiled graph, not two.
            step_t = torch.tensor(0.0, dtype=_scalar_dtype())
            for name in ("exp_avg", "exp_avg_sq"):
                z = torch.zeros(shape, dtype=torch.float32, device=p.device)
                moments.append(encode(z, fmt, kind_of(name)) if packs(z, shape, fmt) else z)
        else:
            step_t = plain["step"]
            for name in ("exp_avg", "exp_avg_sq"):
                if name in packed:
                    moments.append(self._packed_value(p, name, packed[name]))
                else:
                    moments.append(cast(torch.Tensor, plain[name]))
        # The stored step is incremented once the update is done (torch adds 1 first; the
        # count the update reads is the same).
        count = int(step_t.item()) + 1
        beta1, beta2 = group["betas"]
        m, v = adam_update(
            p,
            cast(torch.Tensor, p.grad),
            moments[0],
            moments[1],
            count,
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            decoupled=bool(
                group.get("decoupled_weight_decay", isinstance(inner, torch.optim.AdamW))
            ),
            maximize=bool(group.get("maximize", False)),
            state=fmt,
            generator=self._generator(p),
            compiled=p.device.type != "cpu" and self.compile is not False,
            native=p.device.type == "cpu" and self.compile is not False,
        )
        step_t += 1
        new: dict[str, Any] = {"step": step_t}
        made: dict[str, Packed] = {}
        for name, value in (("exp_avg", m), ("exp_avg_sq", v)):
            if isinstance(value, Packed):
                for k, t in value.parts.items():  # parts_of, inline
                    new[f"{name}{PART_SEP}{k}"] = t
                made[name] = value
            else:
                new.update(
                    encode_entry(
                        {name: value},
                        shape,
                        fmt,
                        check_finite=p.device.type == "cpu",
                        packed_out=made,
                    )
                )
        inner.state[p] = new
        self._packed[p] = made

    # ----- checkpoints ------------------------------------------------------------------

    def forget(self) -> None:
        """Drop the kept ``Packed`` values (the state was replaced: a load)."""
        self._packed.clear()

    def extras(self, rounds: bool) -> dict[str, Any]:
        """What a state dict carries beside torch's entries: the format, the parameters'
        shapes under a quantized format (``PARAM_SHAPES_KEY``: a load checks them against
        the packed parts'), and the rounding generators when ``rounds`` (some weight is below
        float32)."""
        out: dict[str, Any] = {OPTIM_STATE_KEY: str(self.optim_state)}
        if self.optim_state.quantized:
            out[PARAM_SHAPES_KEY] = param_shapes(self.inner.param_groups)
        if rounds:
            out[MASTER_ROUNDING_KEY] = self.rounding.state_dict()
        return out

    def checked_rounding(
        self, saved: object, devices: list[torch.device]
    ) -> RoundingGenerators | None:
        """A new ``RoundingGenerators`` loaded from ``saved`` (checked; ``ValueError`` on a
        bad entry), or ``None`` when nothing was saved."""
        if saved is None:
            return None
        if not isinstance(saved, dict):
            raise TypeError(
                f"state_dict[{MASTER_ROUNDING_KEY!r}] must be a dict (RoundingGenerators."
                f"state_dict()), got {type(saved).__name__}"
            )
        gens = RoundingGenerators(self.rounding.seed)
        gens.load_state_dict(saved, devices, "stochastic")
        return gens

    # ----- accounting -------------------------------------------------------------------

    def scratch_buffers(self) -> list[torch.Tensor]:
        """The reused float32 scratch buffers (``memory_report``'s ``"scratch"``)."""
        return self.scratch.buffers()


def _param_shaped(value: object, p: torch.Tensor) -> bool:
    """Whether ``value`` is a plain tensor of ``p``'s shape (not a scalar)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == p.shape


def _scalar_dtype() -> torch.dtype:
    # torch.optim keeps ``step`` at float64 when that is the default dtype, else float32.
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
