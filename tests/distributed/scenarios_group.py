"""Scenarios of ``computectx.distributed.group``'s join (``test_group.py``)."""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

from computectx.distributed import group as group_module


class _SlowWait:
    """The join's store, its ``wait`` started ``delay`` seconds late (a rank descheduled
    between counting itself in and reading the verdict)."""

    def __init__(self, store: Any, delay: float) -> None:
        self._store, self._delay = store, delay

    waited = False

    def wait(self, keys: list[str], timeout: Any) -> None:
        self.waited = True  # this rank was not the last to come: it reads the verdict
        time.sleep(self._delay)
        self._store.wait(keys, timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def last_join_then_exit(params: dict[str, Any]) -> dict[str, Any]:
    """Rank 1 joins first and is slow to read the verdict; rank 0, which holds the store,
    completes the join and leaves at once (the process exits after the scenario): rank 1
    must still read its verdict."""
    pg = dist.group.WORLD
    assert pg is not None
    j = group_module._join_of(pg)
    slow = _SlowWait(j.store, params["delay"])
    if dist.get_rank() == 1:
        j.store = slow  # type: ignore[assignment]
    else:
        time.sleep(params["delay"])  # rank 1 counts itself in first
    group_module.join(pg, "the last step")
    return {"gen": j.gen, "slow_read": slow.waited}
