"""One rank of a distributed test: ``worker.py SCENARIO OUT_DIR PARAMS_JSON``.

Started by ``conftest.run_ranks`` with ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``
set. Joins a gloo group with a short collective timeout, runs the scenario and saves its result
dict to ``OUT_DIR/rank{RANK}.pt``.
"""

from __future__ import annotations

import datetime
import json
import sys
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


def main() -> None:
    scenario, out, params = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    try:
        result = SCENARIOS[scenario](params)
        torch.save(result, out / f"rank{dist.get_rank()}.pt")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
