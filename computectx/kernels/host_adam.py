"""The compact-state Adam(W) step on the CPU (``host_adam.cpp``): its build, load and launch.

The C++ source is compiled on first use by the system compiler (``COMPILER``, ``g++``) into a
per-user cache (``$XDG_CACHE_HOME/computectx/host_adam``, else ``~/.cache/...``), one file per
hash of (source, flags, compiler version, the CPU's flags): a machine builds it once, in about
a second, and a changed source, compiler or CPU builds anew. The build writes a temporary file,
flushes it to the disk and renames it into place, then its sha256 likewise into a sidecar,
under a lock file, so processes building at once (pytest-xdist workers, distributed ranks)
each load a complete library; a cached library whose sidecar does not match it (truncated,
foreign) is rebuilt rather than loaded, and one that does not load as this kernel (a missing
symbol, another ABI) is rebuilt once. It is a plain C ABI over raw pointers, loaded with
``ctypes`` (no torch headers: those take a minute to compile).

``library()`` is ``None`` when the build fails (no compiler, an error): the caller runs its
torch-ops twin instead, after one ``RuntimeWarning`` that quotes the compiler's error; under
``torch.distributed`` with several ranks it raises instead (a rank on the twin would drift
from ranks on the kernel). The result depends on no CPU feature: the vector code, the
portable build and a baseline ``-march=x86-64`` build give the same bits (tested).

The kernel: one pass per block of the state format (decode -> float32 update -> encode), the
blocks split over ``threads`` threads (the result does not depend on their number): OpenMP's
(``-fopenmp``), which in a torch process are torch's own pool (its ``libgomp.so.1``, loaded
first, is the one this library binds to), so the kernel does not share the cores with torch's
threads spinning after its last parallel op. The usual
configurations (both moments of one format; a float32 or bf16 weight and gradient) read and
write every stream in one loop per block; the others take the same arithmetic in phases.
"""

from __future__ import annotations

import _ctypes
import ctypes
import fcntl
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

__all__ = [
    "COMPILER",
    "FLAGS",
    "PARAM_DTYPES",
    "Moment",
    "cache_dir",
    "cleared",
    "library",
    "quiet_library",
    "step",
]

COMPILER = "g++"
"""The C++ compiler the kernel is built with (tests set a failing one)."""
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
FLAGS = (
    "-O3",
    "-march=native",
    # g++ vectorizes with 256-bit registers on AVX-512 CPUs unless told otherwise; the
    # update's loops run 10-20% faster with 512 (measured on an Ice Lake Xeon, same bits).
    # An x86 option only (a no-op without AVX-512).
    *(("-mprefer-vector-width=512",) if _X86 else ()),
    "-fno-math-errno",
    "-ffp-contract=off",
    "-shared",
    "-fPIC",
    "-std=c++17",
    "-pthread",
    "-fopenmp",
)
"""No ``-ffast-math``: the arithmetic is IEEE float32, each operation rounded once (fused
multiply-adds only where the source asks for them, by ``std::fma`` or an intrinsic)."""
PORTABLE = "-DCC_HOST_ADAM_PORTABLE"
"""Compiles the kernel without its hand-written AVX-512 code (tests compare the two)."""


SOURCE = Path(__file__).with_name("host_adam.cpp")
ABI = 3

PARAM_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""The parameter and gradient dtypes the kernel reads (code as ``host_adam.cpp``'s)."""

# Moment formats, as host_adam.cpp numbers them.
PLAIN, BF16, INT8, FP8, INT4, RANK1 = range(6)


class _Moment(ctypes.Structure):
    _fields_ = [
        ("fmt", ctypes.c_int32),
        ("is_signed", ctypes.c_int32),
        ("block", ctypes.c_int64),
        ("rows", ctypes.c_int64),
        ("data", ctypes.c_void_p),
        ("absmax", ctypes.c_void_p),
        ("cols", ctypes.c_void_p),
        ("new_rows", ctypes.c_void_p),
        ("new_cols", ctypes.c_void_p),
        ("map", ctypes.c_void_p),
        ("table", ctypes.c_void_p),
        ("bounds", ctypes.c_void_p),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("n", ctypes.c_int64),
        ("param", ctypes.c_void_p),
        ("grad", ctypes.c_void_p),
        ("param_dtype", ctypes.c_int32),
        ("grad_dtype", ctypes.c_int32),
        ("l2", ctypes.c_int32),
        ("maximize", ctypes.c_int32),
        ("stochastic", ctypes.c_int32),
        ("threads", ctypes.c_int32),
        ("key", ctypes.c_uint64),
        ("hp", ctypes.c_float * 8),
        ("m", _Moment),
        ("v", _Moment),
    ]


class Moment(NamedTuple):
    """One moment as the kernel reads it: its format (``PLAIN`` .. ``RANK1``), signedness,
    block, rows (rank-1), and its tensors (contiguous, on the CPU; ``None`` where unused)."""

    fmt: int
    signed: bool
    block: int
    rows: int
    data: torch.Tensor
    absmax: torch.Tensor | None = None  # blocked: absmax; rank-1: the old rows
    cols: torch.Tensor | None = None
    new_rows: torch.Tensor | None = None
    new_cols: torch.Tensor | None = None
    map: torch.Tensor | None = None
    table: torch.Tensor | None = None
    bounds: torch.Tensor | None = None


def cache_dir() -> Path:
    """Where built libraries are kept (per user)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "computectx" / "host_adam"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.strip()
    except OSError:
        pass
    return os.uname().machine


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=300, check=False)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _sidecar(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _intact(target: Path) -> bool:
    """Whether ``target`` is the whole library its build wrote: its sidecar (written after
    it) holds its sha256. A truncated copy (a full disk, a home folder copied mid-write) or a
    foreign file at the name fails this, and is never loaded (a short library maps pages past
    the file's end: SIGBUS at the first call)."""
    try:
        return _sidecar(target).read_text().strip() == _digest(target)
    except OSError:
        return False


def _write_durably(tmp: str, target: Path) -> None:
    """``tmp`` (written in ``target``'s folder) renamed to ``target``, flushed to the disk
    before and after (the file, then the folder's entry)."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, target)
    folder = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def _build(compiler: str, flags: tuple[str, ...] | None = None, *, again: bool = False) -> Path:
    """The built library's path (built now unless cached whole; ``FLAGS`` unless ``flags``;
    ``again``: rebuilt even so); ``RuntimeError`` on failure.

    The library is written to a temporary file, flushed and renamed into place, then its
    sha256 likewise into a sidecar (``<name>.sha256``), all under a lock file: a cached
    library is used only when its sidecar matches it (``_intact``), else built anew."""
    flags = FLAGS if flags is None else flags
    try:
        version = _run([compiler, "--version"])
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"{compiler!r} could not be run: {e}") from e
    if version.returncode != 0:
        raise RuntimeError(f"{compiler} --version failed: {version.stderr.strip()[:2000]}")
    source = SOURCE.read_bytes()
    digest = hashlib.sha256()
    for part in (source, " ".join(flags).encode(), version.stdout.encode(), _cpu_flags().encode()):
        digest.update(part)
        digest.update(b"\0")
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"host_adam-{digest.hexdigest()[:24]}.so"
    if not again and _intact(target):
        return target
    # The lock file holds no data (its content is never read): only its flock matters.
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not again and _intact(target):  # another process built it while this one waited
            return target
        _sidecar(target).unlink(missing_ok=True)  # no sidecar until the new library is whole
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".host_adam-", suffix=".so")
        os.close(fd)
        fd, tmp_sum = tempfile.mkstemp(dir=folder, prefix=".host_adam-", suffix=".sha256")
        os.close(fd)
        try:
            done = _run([compiler, *flags, str(SOURCE), "-o", tmp])
            if done.returncode != 0:
                raise RuntimeError(
                    f"{compiler} failed ({done.returncode}): "
                    f"{(done.stderr or done.stdout).strip()[:2000]}"
                )
            _write_durably(tmp, target)
            Path(tmp_sum).write_text(_digest(target) + "\n")
            _write_durably(tmp_sum, _sidecar(target))
        finally:
            for t in (tmp, tmp_sum):
                if os.path.exists(t):
                    os.unlink(t)
    return target


def _open(path: Path) -> ctypes.CDLL:
    """The library at ``path``, its ABI checked and its entry point typed; ``RuntimeError``,
    ``OSError`` or ``AttributeError`` (a missing symbol) when it is not this kernel's."""
    lib = ctypes.CDLL(str(path))
    try:
        if lib.cc_host_adam_abi() != ABI:
            raise RuntimeError(f"the cached library {path} is of another ABI")
        lib.cc_host_adam_step.argtypes = [ctypes.POINTER(_Step)]
        lib.cc_host_adam_step.restype = ctypes.c_int
        lib.cc_host_adam_cleared.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int32,
            ctypes.c_int32,
        ]
        lib.cc_host_adam_cleared.restype = ctypes.c_int
    except (RuntimeError, AttributeError):
        # Unloaded, so that a rebuild at the same path is loaded anew (the loader would
        # otherwise hand back this handle by its name).
        _ctypes.dlclose(lib._handle)
        raise
    return lib


_LOAD_ERRORS = (RuntimeError, OSError, AttributeError, subprocess.SubprocessError)


@functools.cache
def _load(portable: bool) -> ctypes.CDLL | str:
    """The loaded kernel, or the reason it could not be built or loaded. A cached library
    that does not load as this kernel (another ABI, a missing symbol) is rebuilt once."""
    flags = (*FLAGS, PORTABLE) if portable else FLAGS
    try:
        path = _build(COMPILER, flags)
        try:
            return _open(path)
        except (RuntimeError, OSError, AttributeError):
            return _open(_build(COMPILER, flags, again=True))
    except _LOAD_ERRORS as e:
        return str(e)


def _replicated() -> str | None:
    """``"rank R of W"`` when this process is one of several ranks (``torch.distributed``),
    else ``None``."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.get_world_size()
    return f"rank {dist.get_rank()} of {world}" if world > 1 else None


@functools.cache
def _warn(error: str) -> None:
    warnings.warn(
        f"computectx: the native CPU Adam kernel could not be built with {COMPILER!r}, so "
        f"compact-state CPU steps run the slower torch-ops twin. The error: {error}",
        RuntimeWarning,
        stacklevel=4,
    )


def library() -> ctypes.CDLL | None:
    """The loaded kernel (built on first use), or ``None`` after one warning when the build
    or the load failed (the caller runs its twin).

    Under ``torch.distributed`` with more than one rank a failure raises ``RuntimeError``
    instead (naming the rank): the twin's results differ from the kernel's in low bits, so a
    rank that ran it while the others ran the kernel would leave the replicas apart, silently.
    The other ranks learn of it only where the caller has the ranks agree on it
    (``Parallel.step``'s checks); nothing here is a collective."""
    got = _load(False)
    if not isinstance(got, str):
        return got
    rank = _replicated()
    if rank is not None:
        raise RuntimeError(
            f"computectx: the native CPU Adam kernel could not be built with {COMPILER!r} on "
            f"{rank} ({got}). Its torch-ops twin rounds differently in the last bits, so "
            "a rank running it while others run the kernel would make the replicas "
            "drift apart. Install the compiler (g++) on every node, or pass compile=False "
            "to the optimizer on every rank (all run the twin)."
        )
    _warn(got)
    return None


def quiet_library() -> ctypes.CDLL | None:
    """The loaded kernel (built on first use), or ``None`` when it could not be built or
    loaded: no warning and no error, for a caller whose result does not depend on it (the
    non-finite check, ``cleared``, has an exact torch twin)."""
    return _library(False)


def _library(portable: bool) -> ctypes.CDLL | None:
    """The kernel built with (``portable``) or without ``PORTABLE``, ``None`` on failure."""
    got = _load(portable)
    return None if isinstance(got, str) else got


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _moment(x: Moment) -> _Moment:
    return _Moment(
        x.fmt,
        int(x.signed),
        x.block,
        x.rows,
        _ptr(x.data),
        _ptr(x.absmax),
        _ptr(x.cols),
        _ptr(x.new_rows),
        _ptr(x.new_cols),
        _ptr(x.map),
        _ptr(x.table),
        _ptr(x.bounds),
    )


def step(
    lib: ctypes.CDLL,
    param: torch.Tensor,
    grad: torch.Tensor,
    m: Moment,
    v: Moment,
    hp: list[float],
    *,
    l2: bool,
    maximize: bool,
    key: int | None,
    threads: int,
) -> None:
    """One step of ``lib`` (``library()``) on contiguous CPU tensors, in place: ``param``
    (``PARAM_DTYPES``; written by stochastic rounding under ``key`` when it is not None and
    the parameter is below float32), ``grad`` (``PARAM_DTYPES``), the moments, and the eight
    hyper-parameters (decay, wd, 1-b1, b2, 1-b2, sqrt(bc2), eps, -step_size)."""
    args = _Step(
        param.numel(),
        param.data_ptr(),
        grad.data_ptr(),
        PARAM_DTYPES[param.dtype],
        PARAM_DTYPES[grad.dtype],
        int(l2),
        int(maximize),
        int(key is not None),
        threads,
        0 if key is None else key % 2**64,
        (ctypes.c_float * 8)(*hp),
        _moment(m),
        _moment(v),
    )
    lib.cc_host_adam_step(ctypes.byref(args))


def cleared(lib: ctypes.CDLL, t: torch.Tensor, threads: int) -> bool:
    """Whether every element of ``t`` (contiguous, on the CPU, of ``PARAM_DTYPES``) is
    finite with a finite float32 square (``|t| < 2**64``): one read of its bits, on up to
    ``threads`` threads (one per 64K elements). Exactly the torch condition
    ``bool((t.double().abs() < 2**64).all())`` (NaN, inf, 2**64 and beyond: false)."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.dtype not in PARAM_DTYPES:
        raise ValueError(
            f"cleared takes a contiguous CPU tensor of {sorted(map(str, PARAM_DTYPES))}, got "
            f"{t.dtype} on {t.device} (contiguous: {t.is_contiguous()})"
        )
    got = lib.cc_host_adam_cleared(t.data_ptr(), t.numel(), PARAM_DTYPES[t.dtype], threads)
    if got < 0:
        raise RuntimeError(f"cc_host_adam_cleared refused dtype code {PARAM_DTYPES[t.dtype]}")
    return bool(got)
