"""Which of torch's implementations the f32 step runs (``_implementation.fastest``): torch's
fused kernel where the class has one, else foreach, written into the groups; the user's own
choice kept; the stepper's groups left unset."""

from __future__ import annotations

import torch

from computectx import ComputeCtx
from computectx.memory import CompactOptimizer, OffloadedOptimizer

CPU = ComputeCtx.parity("cpu")


def _how(opt: torch.optim.Optimizer) -> list[tuple[object, object]]:
    return [(g.get("fused"), g.get("foreach")) for g in opt.param_groups]


def test_unset_groups_run_the_fastest_and_the_users_choice_is_kept() -> None:
    p = torch.nn.Parameter(torch.randn(4, 3))
    assert _how(OffloadedOptimizer([p], CPU)) == [(True, None)]
    assert _how(CompactOptimizer([p], CPU, torch.optim.SGD, lr=0.1)) == [(True, None)]
    assert _how(OffloadedOptimizer([p], CPU, torch.optim.RMSprop)) == [(None, True)]
    assert _how(OffloadedOptimizer([p], CPU, foreach=False)) == [(None, False)]
    assert _how(CompactOptimizer([{"params": [p], "fused": False}], CPU)) == [(False, None)]
    # A differentiable step has neither: torch's default.
    assert _how(OffloadedOptimizer([p], CPU, differentiable=True)) == [(None, None)]


def test_the_stepper_reads_the_groups_as_the_user_left_them() -> None:
    opt = CompactOptimizer([torch.nn.Parameter(torch.randn(3))], CPU)
    assert _how(opt) == [(True, None)] and opt.stepper is None
    # A weight below float32 brings the stepper: the picked group goes back unset.
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3, dtype=torch.bfloat16))]})
    assert opt.stepper is not None and _how(opt) == [(None, None), (None, None)]
    packed = CompactOptimizer([torch.nn.Parameter(torch.randn(3))], CPU.with_optim_state("int8"))
    assert _how(packed) == [(None, None)]


def test_a_plain_checkpoint_is_picked_for_again_and_ours_loads_into_torch_as_run() -> None:
    p, q = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(4, 3))
    plain = torch.optim.AdamW([q])
    q.grad = torch.ones(4, 3)
    plain.step()
    opt = OffloadedOptimizer([p], CPU)
    opt.load_state_dict(plain.state_dict())
    assert _how(opt) == [(True, None)]
    back = torch.optim.AdamW([torch.nn.Parameter(torch.randn(4, 3))])
    back.load_state_dict({k: v for k, v in opt.state_dict().items() if k != "master_weights"})
    assert back.param_groups[0]["fused"] is True


def test_a_sparse_gradient_moves_a_picked_group_to_foreach() -> None:
    emb = torch.nn.Embedding(5, 3, sparse=True)
    ref = torch.nn.Embedding(5, 3, sparse=True)
    ref.load_state_dict(emb.state_dict())
    opt = OffloadedOptimizer(emb.parameters(), CPU, torch.optim.SGD, lr=0.1)
    plain = torch.optim.SGD(ref.parameters(), lr=0.1, foreach=True)
    for m, o in ((emb, opt), (ref, plain)):
        m(torch.tensor([1, 2])).sum().backward()
        o.step()
    assert _how(opt) == [(None, True)]
    assert torch.equal(emb.weight, ref.weight)
