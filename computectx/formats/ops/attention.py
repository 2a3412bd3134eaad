"""Decode attention over a KV cache stored as fp8 codes and float32 steps (or at 16/32 bits).

One query position per (batch, head) against the cached keys and values, the decode step
of serving. ``decode_attention`` checks its arguments and runs one ``torch.library`` custom
operator (``computectx::fp8_decode_attention``, this family's one), so a compiled decode step
sees a single opaque node with a fake implementation: no graph break, no recompile when the
length tensor's values change. The argument list has three spellings: the operator's
signature, ``numerics.attention.DecodeArgs`` (taken whole by the twin,
``numerics.attention.decode_attention_reference``, and its error bound) and the kernel's
(``computectx.kernels.decode_attention``, which imports nothing from the package, takes the
fields as keywords). The KV cache's codes and steps are quantized by ``numerics.kv_quant``
(numerics, not an operator).

The cache (the storage layout of ``KVCache`` for an fp8 ``kv``)::

    k, v     (B, H, T_max, D)  float8_e4m3fn / float8_e5m2 codes; or bf16/f16/f32 values
    k_step   per_token_head (B, H, T_max) | per_head (H,) | per_tensor (1,), float32,
    v_step   bfloat16 or float8_e8m0fnu (``KvFp8.step``; both of one dtype), widened to
             float32 exactly where they are read; None for a 16/32-bit cache. The value a
             code stands for is code * step.
    length   (B,) int64 tensor, or a python int for every row: positions >= length[b]
             are ignored (1 <= length[b] <= T_max). A tensor is never read on the host
             (every block of T_max is visited, masked); an int limits the blocks visited

The semantics (the reference twin ``decode_attention_reference``; the Triton kernel in
``computectx.kernels.decode_attention`` computes the same function): for each (b, h), over
T in blocks of ``block_t`` positions,

1. the block's keys are dequantized in float32 (code widened, times its step);
2. scores ``s = (q . k) * sm_scale`` in float32 (``q`` widened exactly), ``-inf`` beyond
   ``length[b]``;
3. online softmax in float32: ``m_new = max(m, max s)``, ``alpha = exp(m - m_new)``,
   ``p = exp(s - m_new)``, ``l = l * alpha + sum p``;
4. the block's values dequantized in float32, ``acc = acc * alpha + p @ v`` in a float32
   accumulator: two levels of float32 accumulation, within a block and across blocks,
   which is what keeps long contexts from drifting (no partial sum is ever held in fp8 or
   16 bits);
5. at the end ``out = acc / l`` in float32, rounded once to ``q``'s dtype.

The kernel sums in other orders (and may split T across programs, merging the partial
``(m, l, acc)`` the same way), and its ``exp`` is another implementation, so kernel and
twin agree within ``decode_attention_error_bound`` rather than bit for bit; both are
checked against float64 attention over the dequantized cache with that bound.

Backends: ``REFERENCE`` runs the twin; ``TRITON`` the kernel (a CUDA GPU, or the CPU under
``TRITON_INTERPRET=1``), which serves head dims ``D`` that are multiples of 16 up to 256
(``KERNEL_HEAD_DIMS``; ``check_kernel_head_dim``) and ``block_t`` a power of two from 16 to
256; ``CUBLAS`` (which has no attention of its own) runs the kernel on a CUDA device where
triton imports and the twin elsewhere, as the quantize operators do. The twin serves any
``D`` and ``block_t``.
"""

from __future__ import annotations

import math

import torch
from torch.library import custom_op

from computectx._checks import fault, shown_ints
from computectx.dtypes import FLOAT_DTYPES, FP8_DTYPES
from computectx.formats.backend import Backend, check_backend, parse_backend, uses_kernels
from computectx.formats.numerics.attention import DecodeArgs, decode_attention_reference
from computectx.formats.numerics.kv_quant import step_layout
from computectx.kv_policy import STEP_DTYPES

__all__ = [
    "KERNEL_BLOCK_T",
    "KERNEL_HEAD_DIMS",
    "check_decode_attention",
    "check_kernel_head_dim",
    "decode_attention",
    "fp8_decode_attention",
]

KERNEL_HEAD_DIMS = tuple(range(16, 257, 16))
"""Head dims the Triton kernel serves: multiples of 16 (16-byte rows of fp8 codes) up to 256
(one row of K and V per position held in registers)."""
KERNEL_BLOCK_T = (16, 32, 64, 128, 256)
"""``block_t`` values the Triton kernel takes (a power of two: one tile of positions)."""


@custom_op("computectx::fp8_decode_attention", mutates_args=())
def fp8_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_step: torch.Tensor | None,
    v_step: torch.Tensor | None,
    length: torch.Tensor,
    sm_scale: float,
    block_t: int,
    backend: str,
) -> torch.Tensor:
    """``decode_attention`` on checked arguments (``length`` a ``(B,)`` tensor): the kernel
    or the twin, given them as one ``DecodeArgs`` (the kernel as its keywords)."""
    args = DecodeArgs(q, k, v, k_step, v_step, length, sm_scale, block_t)
    if uses_kernels(parse_backend(backend), q):
        from computectx.kernels import decode_attention as kernel

        out: torch.Tensor = kernel.decode_attention(**vars(args))
        return out
    return decode_attention_reference(args)


@fp8_decode_attention.register_fake
def _decode_attention_fake(q: torch.Tensor, *_: object) -> torch.Tensor:
    # Shaped like q, at its dtype, whatever the rest.
    return torch.empty_like(q)


def check_kernel_head_dim(head_dim: int) -> None:
    """``ValueError`` naming ``head_dim`` unless the Triton decode kernel serves it (the
    reference twin serves every head dim)."""
    if head_dim not in KERNEL_HEAD_DIMS:
        raise ValueError(
            f"the Triton decode-attention kernel cannot serve head dim D={head_dim}: it takes "
            f"multiples of 16 from 16 to 256; the reference backend serves any D"
        )


def check_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_step: torch.Tensor | None,
    v_step: torch.Tensor | None,
    length: torch.Tensor | int,
    *,
    sm_scale: float,
    block_t: int,
    backend: Backend,
    check_values: bool = True,
) -> None:
    """Every check ``decode_attention`` runs; ``ValueError``/``TypeError`` naming the bad
    value and what is accepted.

    Shapes, dtypes, devices, ``sm_scale``, ``block_t`` and (for ``TRITON``) the head dim
    read no tensor contents. ``check_values`` adds the value checks, one host read for all:
    every step finite and positive (a NaN scale is an error, never a silent NaN output;
    per_token_head steps only at written positions, ``t < length[b]``, so a preallocated
    cache may hold anything beyond) and every ``length[b]`` in ``[1, T_max]``. They are
    skipped while ``torch.compile`` traces (values are not known then); a cache that
    validated its steps when it wrote or loaded them may pass ``check_values=False`` to keep
    the decode step free of host reads.
    """
    if not isinstance(backend, Backend):
        check_backend(backend)  # the TypeError naming what is accepted
    refused, runs_kernel = _backend_on(backend, q.device)
    if refused:
        raise ValueError(refused)
    if q.dim() != 3 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(
            f"decode_attention takes q (B, H, D) and k, v (B, H, T_max, D); got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    b, h, t_max, d = k.shape
    if tuple(q.shape) != (b, h, d):
        raise ValueError(
            f"q {tuple(q.shape)} does not match the cache {tuple(k.shape)}: expected {(b, h, d)}"
        )
    if 0 in k.shape:
        raise ValueError(f"decode_attention: the cache {tuple(k.shape)} has an empty dim")
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q dtype {q.dtype} not accepted; accepted: bf16, f16, f32")
    if k.dtype != v.dtype or k.dtype not in FP8_DTYPES + FLOAT_DTYPES:
        raise ValueError(
            f"k and v must share one cache dtype, e4m3/e5m2 codes or bf16/f16/f32 values; "
            f"got k {k.dtype}, v {v.dtype}"
        )
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}: one device for all")
    _check_steps(k, k_step, v_step, q.device)
    if isinstance(length, bool) or not isinstance(length, (int, torch.Tensor)):
        raise TypeError(f"length must be an int or an int64 (B,) tensor, got {length!r}")
    if isinstance(length, int):
        if not 1 <= length <= t_max:
            raise ValueError(f"length={length} out of range; accepted: 1 <= length <= {t_max}")
    elif length.dtype != torch.int64 or tuple(length.shape) != (b,) or length.device != q.device:
        raise ValueError(
            f"a length tensor must be int64 of shape ({b},) on {q.device}; got "
            f"{length.dtype} {tuple(length.shape)} on {length.device}"
        )
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):
        raise TypeError(f"sm_scale must be a float, got {sm_scale!r}")
    if not (math.isfinite(sm_scale) and sm_scale > 0):
        raise ValueError(f"sm_scale={sm_scale} must be finite and positive")
    if isinstance(block_t, bool) or not isinstance(block_t, int) or block_t <= 0:
        raise ValueError(f"block_t={block_t!r} must be a positive int")
    if runs_kernel:
        check_kernel_head_dim(d)
        if block_t not in KERNEL_BLOCK_T:
            raise ValueError(
                f"the Triton decode-attention kernel takes block_t in {KERNEL_BLOCK_T}, got "
                f"{block_t}"
            )
    if check_values and not torch.compiler.is_compiling():
        _check_values(k_step, v_step, length, t_max)


def _check_steps(
    k: torch.Tensor, k_step: torch.Tensor | None, v_step: torch.Tensor | None, dev: torch.device
) -> None:
    b, h, t_max, _ = k.shape
    if k.dtype in FLOAT_DTYPES:
        if k_step is not None or v_step is not None:
            raise ValueError(
                f"a {k.dtype} cache holds values, not codes: pass k_step=None and v_step=None"
            )
        return
    accepted = tuple(STEP_DTYPES.values())
    for name, s in (("k_step", k_step), ("v_step", v_step)):
        if s is None:
            raise ValueError(f"an {k.dtype} cache needs {name}: float32 steps, got None")
        if s.dtype not in accepted or s.device != dev:
            raise ValueError(
                f"{name} must be float32, bfloat16 or float8_e8m0fnu (KvFp8.step) on {dev}, "
                f"got {s.dtype} on {s.device}"
            )
        step_layout(s, b, h, t_max)
    if k_step is not None and v_step is not None and k_step.dtype != v_step.dtype:
        raise ValueError(
            f"k_step and v_step must share one step format, got {k_step.dtype} and {v_step.dtype}"
        )


def _check_values(
    k_step: torch.Tensor | None,
    v_step: torch.Tensor | None,
    length: torch.Tensor | int,
    t_max: int,
) -> None:
    # One host read for every value check; the messages are worked out only on failure.
    flags = []
    if isinstance(length, torch.Tensor):
        flags.append(((length >= 1) & (length <= t_max)).all())

    def bad_steps(step: torch.Tensor) -> torch.Tensor:
        s = step.to(torch.float32)  # exact for every step format
        bad = ~(torch.isfinite(s) & (s > 0))
        if s.dim() == 3:  # per_token_head: only the written positions, t < length[b]
            pos = torch.arange(t_max, device=s.device).view(1, 1, -1)
            bad = bad & (
                pos < (length.view(-1, 1, 1) if isinstance(length, torch.Tensor) else length)
            )
        return bad

    for s in (k_step, v_step):
        if s is not None:
            flags.append(~bad_steps(s).any())
    if not flags or bool(torch.stack(flags).all()):
        return
    if isinstance(length, torch.Tensor) and not bool(((length >= 1) & (length <= t_max)).all()):
        raise ValueError(
            f"length {shown_ints(length)} out of range; accepted: 1 <= length[b] <= {t_max}"
        )
    for name, s in (("k_step", k_step), ("v_step", v_step)):
        if s is None:
            continue
        bad = bad_steps(s)
        if bool(bad.any()):
            at = tuple(int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"{name} has {int(bad.sum())} step(s) that are not finite and positive (the "
                f"first, {name}{list(at)}, is {fault(s[at].to(torch.float32))}); steps must be "
                f"finite and > 0"
            )


def _backend_on(backend: Backend, device: torch.device) -> tuple[str, bool]:
    """``(refused, runs_kernel)``: why ``backend`` cannot run on ``device`` (``''`` when it
    can; ``check_backend``'s message), and whether it runs the Triton kernel there.

    A trace-time constant under ``torch.compile`` (marked below): the probes behind it
    (triton's import, ``TRITON_INTERPRET``, which kernel modules are imported, the device's
    capability) run once while dynamo traces and leave no guard, so a compiled decode step
    neither breaks its graph on them nor compiles again when the process imports a module.
    A device's capabilities do not change while a process runs."""
    probe = torch.empty(0, device=device)
    try:
        check_backend(backend, probe)
    except ValueError as err:
        return str(err), False
    return "", uses_kernels(backend, probe)


# What torch.compiler.assume_constant_result does, written out (as
# computectx.formats.linear.recompute
# does: that function imports torch._dynamo, which `import computectx` must not).
_backend_on._dynamo_marked_constant = True  # type: ignore[attr-defined]


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_step: torch.Tensor | None,
    v_step: torch.Tensor | None,
    length: torch.Tensor | int,
    *,
    sm_scale: float,
    block_t: int = 64,
    backend: Backend = Backend.REFERENCE,
    check_values: bool = True,
) -> torch.Tensor:
    """Attention of one query per (batch, head) over a KV cache: ``(B, H, D)`` at ``q``'s
    dtype (the module docstring gives the layout and the semantics).

    ``q`` is ``(B, H, D)`` (bf16, f16 or f32); ``k``/``v`` ``(B, H, T_max, D)`` fp8 codes with
    steps ``k_step``/``v_step`` (float32, bfloat16 or float8_e8m0fnu; per_token_head
    ``(B, H, T_max)``, per_head ``(H,)`` or per_tensor ``(1,)``, each its own layout), or
    16/32-bit values with both steps ``None``; ``length`` an int64 ``(B,)`` tensor or an
    int. ``sm_scale`` multiplies the scores (usually ``D**-0.5``). Checked by
    ``check_decode_attention`` (``check_values`` as there). Not differentiable: a decode
    path, no autograd formula.

    Under ``torch.compile`` pass ``length`` as a tensor: an int is a constant of the graph
    and each new value would compile again. Host reads: a tensor ``length`` is never read
    on the host (every block of ``T_max`` is visited, masked), except by the value checks
    (one read, skipped with ``check_values=False`` and while compiling); an int ``length``
    is a python value, and only the blocks holding the first ``length`` positions are visited
    (the same output as a tensor of that length, bit for bit).
    """
    check_decode_attention(**locals())  # this signature is the check's, name for name
    if isinstance(length, int):
        # Blocks wholly from `length` on are ignored: pass views without them (no copy), so
        # the twin visits only the blocks that hold positions. Whole blocks, so the blocks
        # visited are the ones a length tensor's call visits, the rest of which add exactly
        # nothing: the same output bit for bit.
        stop = min(-(-length // block_t) * block_t, k.shape[2])
        k, v = k[:, :, :stop], v[:, :, :stop]
        if k_step is not None and k_step.dim() == 3:
            k_step = k_step[:, :, :stop]
        if v_step is not None and v_step.dim() == 3:
            v_step = v_step[:, :, :stop]
        length = torch.full((k.shape[0],), length, dtype=torch.int64, device=q.device)
    out: torch.Tensor = fp8_decode_attention(
        q, k, v, k_step, v_step, length, float(sm_scale), block_t, backend.value
    )
    return out
