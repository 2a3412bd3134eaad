"""One rank of a distributed test: ``run_forked``, or ``worker.py SCENARIO OUT_DIR PARAMS_JSON``.

Started by ``conftest.run_ranks`` with ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``
set, forked from a server that has torch imported already (an import costs seconds per rank).
Joins a gloo group with a short collective timeout, runs the scenario and saves its result
dict to ``OUT_DIR/rank{RANK}.pt``. ``SCENARIO`` is a function of this file (``policy_check``)
or ``FILE:FUNCTION`` for a function of another file in this folder (``scenarios_amax.py:train``);
each takes the params dict and returns a dict of tensors, numbers and strings.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from computectx import ComputeCtx
from computectx.distributed import check_same_policy

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=30)

Result = dict[str, Any]


def policy_check(params: dict[str, Any]) -> Result:
    """Each rank builds the policy named for it and checks the group agrees."""
    flag = params["flags"][dist.get_rank()]
    ctx = ComputeCtx.from_flag(flag, "cpu")
    try:
        check_same_policy(ctx)
    except ValueError as e:
        return {"error": str(e)}
    return {"error": ""}


SCENARIOS: dict[str, Callable[[dict[str, Any]], Result]] = {
    "policy_check": policy_check,
}


def _scenario(spec: str) -> Callable[[dict[str, Any]], Result]:
    if ":" not in spec:
        return SCENARIOS[spec]
    file, name = spec.split(":", 1)
    path = Path(__file__).resolve().parent / file
    module_spec = importlib.util.spec_from_file_location(path.stem, path)
    if module_spec is None or module_spec.loader is None:
        raise FileNotFoundError(f"no scenario file {path}")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    fn: Callable[[dict[str, Any]], Result] = getattr(module, name)
    return fn


def run(spec: str, out: Path, params: dict[str, Any]) -> None:
    """Join the group the environment names, run ``spec`` and save this rank's result."""
    scenario = _scenario(spec)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    try:
        result = scenario(params)
        torch.save(result, out / f"rank{dist.get_rank()}.pt")
    finally:
        dist.destroy_process_group()


def run_forked(spec: str, out: Path, params: dict[str, Any], env: dict[str, str]) -> None:
    """``run`` in a process forked by ``conftest``'s forkserver (torch already imported):
    the rank's variables go into the environment, its output into ``out/rank{RANK}.log``."""
    os.environ.update(env)
    log = os.open(out / f"rank{env['RANK']}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        run(spec, out, params)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def main() -> None:
    run(sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3]))


if __name__ == "__main__":
    main()
elif __name__ == "__forked__":  # conftest runs this file with runpy.run_path in a fork
    run_forked(*globals()["FORK_ARGS"])
