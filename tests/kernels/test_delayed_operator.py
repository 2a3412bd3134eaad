"""The delayed quantize operator on the Triton backend: its first call and its launches.

``computectx::fp8_quantize_delayed`` wraps the quantize kernel with the seeding check, the
history's rotation and the tally's update. Here, on an fp8 GPU or under the interpreter:
a NaN in the first call is counted once, as on the twins, and one call issues exactly the
launches docs/fp8.md states ("Delayed scaling").
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from computectx.dtypes import Fp8Format
from computectx.formats import Backend
from computectx.formats.numerics.ledger import ledger_new, read_ledger, tally_new
from computectx.formats.ops import tensorwise as tensor_ops
from computectx.formats.ops.tensorwise import quantize_operand
from computectx.kernels import quantize
from computectx.recipes import DelayedScaling

pytestmark = [pytest.mark.interpreter, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

E4M3 = Fp8Format.E4M3
SEEDING_LAUNCHES = 28
"""docs/fp8.md, "Delayed scaling": what the seeding check adds to a delayed quantize."""
# Ops that launch nothing on a GPU: allocations (views are told apart by their schema).
_NO_LAUNCH = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


@pytest.mark.parametrize("backend", [Backend.TRITON, Backend.REFERENCE])
def test_a_nan_first_call_is_counted_once_on_the_operator(
    backend: Backend, device: torch.device
) -> None:
    ledger, tally = ledger_new(4, device), tally_new(device)
    x = torch.randn(300, generator=torch.Generator().manual_seed(0)).to(device)
    x[17] = math.nan
    q, used = quantize_operand(
        x, E4M3, ledger, tally, DelayedScaling(history_len=4), backend=backend
    )
    after = read_ledger(ledger)
    assert (after.nonfinite, after.step, after.history) == (1.0, 1.0, (0.0,) * 4)
    assert used.item() == 1.0 and tally.tolist() == [1, 300]
    assert torch.isnan(q[17].float())


class _Launches(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch leaves it untyped
    """Counts the torch ops that launch a kernel on a GPU, and the quantize kernel's
    launches (the ops its launcher runs to allocate are its own, not counted)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops: list[str] = []
        self.kernels = 0
        self.inside = False

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        name = func.overloadpacket.__name__
        if not (self.inside or func.is_view or name in _NO_LAUNCH):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> _Launches:
    mode = _Launches()
    real = quantize.quantize_delayed

    def launcher(**kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        mode.kernels += 1
        mode.inside = True
        try:
            return real(**kwargs)
        finally:
            mode.inside = False

    monkeypatch.setattr(quantize, "quantize_delayed", launcher)
    return mode


@pytest.mark.parametrize(
    ("history", "expected"), [(16, ["roll", "copy_", "fill_", "add_"]), (1, ["fill_", "add_"])]
)
def test_one_seeded_delayed_quantize_is_the_launches_the_docs_state(
    history: int, expected: list[str], launches: _Launches, device: torch.device
) -> None:
    ledger, tally = ledger_new(history, device), tally_new(device)
    x = torch.randn(4096, device=device)

    def call(may_seed: bool) -> None:
        tensor_ops.delayed_call(x, ledger, tally, E4M3.torch, "max", 0, "triton", may_seed)

    call(True)  # seeds (and creates the kernel's scratch)
    launches.kernels = 0
    with launches:
        call(False)  # what eager calls pass once the ledger is seeded
    # docs/fp8.md: the quantize kernel, the rotation (roll, copy) and the tally (fill, add).
    assert launches.kernels == 1
    assert launches.ops == expected


def test_the_seeding_check_adds_the_launches_the_docs_state(
    launches: _Launches, device: torch.device
) -> None:
    ledger, tally = ledger_new(16, device), tally_new(device)
    x = torch.randn(4096, device=device)
    with launches:
        tensor_ops.delayed_call(x, ledger, tally, E4M3.torch, "max", 0, "triton", may_seed=True)
    assert launches.kernels == 1
    assert launches.ops[-4:] == ["roll", "copy_", "fill_", "add_"]
    seeding = launches.ops[:-4]
    # Two of them pass over x (abs, then amax of |x|); the others touch one element.
    assert len(seeding) == SEEDING_LAUNCHES, seeding
    assert seeding[1:3] == ["abs", "amax"] and seeding.count("abs") == 3
