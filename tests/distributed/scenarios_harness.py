"""An example scenario file for ``worker.py FILE:FUNCTION`` (kept tiny: it tests the harness)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def sum_of_ranks(params: dict[str, Any]) -> dict[str, Any]:
    """All-reduce ``rank + offset`` over the group."""
    t = torch.tensor([float(dist.get_rank() + params["offset"])])
    dist.all_reduce(t)
    return {"sum": t}
