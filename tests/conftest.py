"""Suite-wide settings: a hypothesis profile sized for 2-core CI machines, and one CPU's worth
of torch threads per xdist worker."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

# Timing varies too much on shared 2-core machines for per-example deadlines to mean
# anything; correctness properties are what the examples check.
# derandomize: CI runs the same examples every time, so a red run is reproducible and a green
# one stays green; HYPOTHESIS_PROFILE=thorough explores new examples (2000 per test, random).
settings.register_profile(
    "ci",
    deadline=None,
    max_examples=100,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("thorough", deadline=None, max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Inductor's first C++ compile in a process test-builds its vector headers for every
# instruction set the CPU reports (avx512_vnni, avx512, avx2 here) and loads each build in a
# child process: 9-11 CPU-s in the first process of a fresh cache, about 1.2 in every later
# one (each xdist worker, each compiled demo, docs sample or rank). Trusting the reported
# sets picks the same one (`pick_vec_isa()` is unchanged, so is the generated code); a runner
# whose compiler could not build a reported set fails its Inductor tests instead of falling
# back. Read when torch._inductor.config is first imported: nothing has imported it yet.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")


def _share_the_cores() -> None:
    # Under `pytest -n N` every worker would start torch with a thread per core, N times over
    # on the same cores, and the processes a test starts (docs samples, the demo) would do the
    # same: on a 2-core CI machine that is 4+ busy threads on 2 cores. Each worker takes its
    # share, and so do its children (OMP_NUM_THREADS); ranks launched by the distributed
    # harness pin themselves to 1 already. Results do not depend on it: every comparison in
    # the suite is within one process or against a bound.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    share = max(1, (os.cpu_count() or 1) // workers)
    os.environ["OMP_NUM_THREADS"] = str(share)
    import torch

    torch.set_num_threads(share)


_share_the_cores()


def _triton_interpreted_first() -> None:
    # Triton decides when it is imported whether its own language functions (tl.zeros and
    # the rest of triton.language.standard) run interpreted. A test module that imports
    # triton before tests/kernels/conftest.py sets TRITON_INTERPRET (torch._dynamo does, at
    # module level) would leave them compiled, and every interpreted kernel would then fail
    # with "Cannot call @triton.jit'd outside of the scope of a kernel". Without an fp8 GPU,
    # import triton interpreted here, before any test module, and restore the environment.
    import importlib.util

    from computectx import capability

    if importlib.util.find_spec("triton") is None or capability.fp8_tensor_cores():
        return
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


_triton_interpreted_first()


def _freeze(obj: object, memo: dict[int, tuple[int, object]] | None = None) -> object:
    """A comparable picture of ``obj`` and everything it holds, for fault-injection tests
    ("a refused call changes nothing"): every tensor by its metadata, storage address,
    bytes, ``grad`` and hook counts; every module, and every object of this library, by all
    its attributes (hook dicts included), recursively; anything else by its identity."""
    import torch

    memo = {} if memo is None else memo
    if isinstance(obj, (type(None), bool, int, float, complex, str, bytes, torch.dtype)):
        return obj
    if isinstance(obj, torch.device):
        return ("device", str(obj))
    if id(obj) in memo:
        return ("seen", memo[id(obj)][0])
    memo[id(obj)] = (len(memo), obj)  # held, so that no temporary's id is reused
    if isinstance(obj, torch.Tensor) and obj.layout != torch.strided:
        dense = obj.detach().to_dense().cpu().reshape(-1).view(torch.uint8)
        return ("tensor", str(obj.layout), obj.dtype, tuple(obj.shape), dense.numpy().tobytes())
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        local = t.to_local() if hasattr(t, "to_local") else t
        data = (
            None
            if local.is_meta
            else local.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        )
        hooks = getattr(obj, "_post_accumulate_grad_hooks", None) or {}
        back = getattr(obj, "_backward_hooks", None) or {}
        return (
            "tensor", type(obj).__name__, obj.dtype, tuple(obj.shape), tuple(local.stride()),
            str(obj.device), None if local.is_meta else local.untyped_storage().data_ptr(),
            local.storage_offset(), obj.requires_grad, data,
            _freeze(obj.grad, memo) if obj.is_leaf else None, len(hooks), len(back),
            _freeze(dict(vars(obj)), memo) if isinstance(obj, torch.nn.Parameter) else None,
        )  # fmt: skip
    if isinstance(obj, torch.Generator):
        return ("generator", obj.get_state().numpy().tobytes())
    if isinstance(obj, dict):
        items = tuple((repr(k), _freeze(v, memo)) for k, v in obj.items())
        return ("dict", type(obj).__name__, items)
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(_freeze(v, memo) for v in obj))
    if isinstance(obj, (set, frozenset)):
        return (type(obj).__name__, tuple(sorted(repr(_freeze(v, memo)) for v in obj)))
    module = type(obj).__module__ or ""
    if isinstance(obj, torch.nn.Module) or module.startswith("computectx"):
        fields: dict[str, object] = dict(getattr(obj, "__dict__", {}))
        for cls in type(obj).__mro__:
            for name in getattr(cls, "__slots__", ()):
                if hasattr(obj, name):
                    fields[name] = getattr(obj, name)
        return ("object", type(obj).__qualname__, _freeze(fields, memo))
    return ("identity", type(obj).__qualname__, id(obj))


@pytest.fixture
def freeze() -> Callable[..., object]:
    """``freeze(*objects)``: a comparable picture of the objects and all they hold
    (``_freeze``): equal pictures before and after a refused call mean nothing changed."""

    def picture(*objects: object) -> object:
        memo: dict[int, tuple[int, object]] = {}
        return tuple(_freeze(o, memo) for o in objects)

    return picture


@contextlib.contextmanager
def _wall_limit(seconds: float, what: str) -> Iterator[None]:
    # SIGALRM interrupts the test's (main) thread: a run that hangs in-process fails the test
    # with TimeoutError after ``seconds`` rather than holding the suite.
    def expired(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError(f"{what} ran past its wall limit of {seconds:g} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture
def wall_limit() -> Callable[[float, str], contextlib.AbstractContextManager[None]]:
    """A context manager that fails the test when its block runs longer than a wall limit,
    for runs a test makes in its own process (where a subprocess's ``timeout`` used to be)."""
    return _wall_limit


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A gloo process group of one rank (this process) for the module's tests, destroyed
    after them: collectives and their refusals without launching ranks."""
    import pathlib

    import torch.distributed as dist

    assert not dist.is_initialized()
    store = pathlib.Path(tmp_path_factory.mktemp("pg")) / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def grouped_operands(monkeypatch: pytest.MonkeyPatch) -> Callable[[], list[tuple[Any, Any, Any]]]:
    """Call it to record, from then on, every operand the grouped GEMMs quantize, as
    ``(operand, codes, steps)``: ``formats.numerics.grouped.quantize_operand`` behind a probe."""

    def install() -> list[tuple[Any, Any, Any]]:
        import computectx.formats.numerics.grouped as numerics_grouped

        seen: list[tuple[Any, Any, Any]] = []
        real = numerics_grouped.quantize_operand

        def probe(x: Any, *args: Any) -> tuple[Any, Any]:
            q, s = real(x, *args)
            seen.append((x, q, s))
            return q, s

        monkeypatch.setattr(numerics_grouped, "quantize_operand", probe)
        return seen

    return install


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests marked ``slow`` start first, in their collected order, then the rest.

    Under ``-n auto --dist worksteal`` each worker starts on one contiguous half of the
    collection and an idle one takes the tail of the other's queue, so a long test collected
    near the end (the mypy run of test_typing.py, the compiled demo) starts late and leaves
    one core idle while it runs alone; started first, it runs while the other worker clears
    the short tests. The order is the same on every worker (xdist requires it)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
