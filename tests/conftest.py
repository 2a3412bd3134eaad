"""Suite-wide settings: a hypothesis profile sized for 2-core CI machines, and one CPU's worth
of torch threads per xdist worker."""

from __future__ import annotations

import os

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
