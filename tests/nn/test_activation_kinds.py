"""The kinds the LM's layers keep as ``ctx.activations`` says: attention's queries, keys and
values (and what its GEMMs keep), the residual stream at the blocks' norms, the MoE combine.
Bytes counted with ``SavedActivations``; gradients against ``keep``: bit for bit under
``recompute`` (and ``offload`` on a CPU), within an SQNR bound under ``fp8``."""

from __future__ import annotations

import functools

import pytest
import torch

from computectx import ComputeCtx, DType
from computectx.memory import SavedActivations
from computectx.nn import ByteLM, LMConfig
from computectx.nn.gemm import GemmPath, forced_gemm_path
from computectx.saved import encode_groups

CPU = torch.device("cpu")
DENSE = LMConfig(d_model=64, n_layers=2, n_heads=2, d_ff=64, max_len=32)
MOE = LMConfig(d_model=32, n_layers=1, n_heads=2, d_ff=32, max_len=32, n_experts=4, top_k=2)


@functools.cache
def _ids() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, 17), generator=g)
    return ids[:, :-1], ids[:, 1:]


@functools.cache
def _run(spec: str, moe: bool = False) -> tuple[SavedActivations, tuple[torch.Tensor, ...]]:
    """What one bf16 micro-batch keeps under ``spec``, by kind, and the gradients it gives."""
    ctx = ComputeCtx.new(DType.BF16, CPU).with_activations(spec)
    torch.manual_seed(0)
    model = ByteLM(ctx, MOE if moe else DENSE)
    ids, targets = _ids()
    with SavedActivations(exclude=[*model.parameters(), *model.buffers()]) as saved:
        loss = model.loss(ids, targets)
    torch.autograd.backward(loss)
    return saved, tuple(p.grad.clone() for p in model.parameters() if p.grad is not None)


def _coded(*shape: int) -> int:
    """The bytes ``fp8`` keeps of a bf16 tensor of ``shape``: codes and scales (128 groups)."""
    return sum(t.untyped_storage().nbytes() for t in encode_groups(torch.zeros(shape), 128))


def _sqnr(approx: tuple[torch.Tensor, ...], exact: tuple[torch.Tensor, ...]) -> float:
    a = torch.cat([t.float().flatten() for t in approx])
    e = torch.cat([t.float().flatten() for t in exact])
    return float(10 * torch.log10(e.pow(2).sum() / (a - e).pow(2).sum()))


def _equal(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_attention_under_keep_tags_what_its_gemms_keep() -> None:
    keep, _ = _run("keep")
    # q, k, v and the probabilities the GEMMs keep, plus softmax's float32 probabilities.
    assert keep.by_dtype[("cpu", "attention", "bfloat16")] >= 2 * 3 * 2 * 2 * 16 * 32 * 2
    assert keep.by_dtype[("cpu", "attention", "float32")] >= 2 * 2 * 2 * 16 * 16 * 4


@pytest.mark.parametrize("mode", ["recompute", "offload"])
def test_attention_recompute_keeps_q_k_v_only_and_gives_keeps_gradients(mode: str) -> None:
    keep, exact = _run("keep")
    saved, grads = _run(f"attention:{mode}")
    # (2 layers) x q, k, v of (2, 2, 16, 32) bf16 + the (16, 16) causal mask: no T x T scores.
    qkv = 3 * 2 * 2 * 16 * 32 * 2 + 16 * 16
    assert saved.bytes("attention") == 2 * qkv < keep.bytes("attention")
    assert saved.bytes() - saved.bytes("attention") == keep.bytes() - keep.bytes("attention")
    assert _equal(grads, exact)


def test_attention_fp8_keeps_q_k_v_as_groups_within_the_bound() -> None:
    keep, exact = _run("keep")
    saved, grads = _run("attention:fp8")
    assert saved.bytes("attention") == 2 * (3 * _coded(2, 2, 16, 32) + 16 * 16)
    assert saved.bytes("attention") < keep.bytes("attention") // 2
    assert _sqnr(grads, exact) > 30


def test_residual_fp8_keeps_the_blocks_norms_inputs_as_groups() -> None:
    keep, exact = _run("keep")
    saved, grads = _run("residual:fp8")
    # 5 norms on the stream (2 per block, the final one) of (2, 16, 64) bf16, now fp8 groups.
    assert saved.bytes("residual") == 5 * _coded(2, 16, 64)
    assert saved.bytes("precise") < keep.bytes("precise")  # RoPE's tables stay with precise
    assert _sqnr(grads, exact) > 30
    # residual:keep leaves the norms to precise, as today.
    fp8_norms, _ = _run("precise:fp8")
    assert fp8_norms.bytes("residual") == 0 and fp8_norms.bytes("precise") > 0


def test_residual_offload_on_a_cpu_keeps_the_stream_as_it_is_and_keeps_gradients() -> None:
    _, exact = _run("keep")
    saved, grads = _run("residual:offload")
    assert saved.bytes("residual") == 5 * 2 * 16 * 64 * 2
    assert _equal(grads, exact)


def test_moe_keeps_the_combines_expert_outputs_as_its_mode_says() -> None:
    keep, exact = _run("keep", moe=True)
    fp8, grads = _run("moe:fp8", moe=True)
    offload, same = _run("moe:offload", moe=True)
    copies, dim = 2 * 16 * 2, 32
    # keep: the float32 outputs in token order, the weights and the order (int64).
    assert keep.bytes("moe") >= copies * dim * 4 + copies * 4
    # fp8: the sorted bf16 outputs as codes and scales, the weights and the order as they are.
    weights_and_order = copies * 4 + copies * 8
    assert fp8.bytes("moe") == _coded(copies, dim) + weights_and_order
    assert offload.bytes("moe") == copies * dim * 2 + weights_and_order  # the CPU: as it is
    assert _sqnr(grads, exact) > 30
    assert _equal(same, exact)


@pytest.mark.parametrize("rule", ["every:2", "all"])
def test_checkpoint_by_rule_keeps_the_blocks_inputs_only_and_is_exact(rule: str) -> None:
    keep, exact = _run("keep")
    saved, grads = _run(f"checkpoint={rule}")
    blocks = 1 if rule == "every:2" else 2  # every:2 takes block 0 of 2
    stream = 2 * 16 * 64 * 2  # a block's input, bf16
    assert saved.bytes("residual") == blocks * stream
    # A checkpointed block's attention, SwiGLU and norms keep nothing for the backward.
    for kind in ("attention", "act_fn"):
        assert saved.bytes(kind) == keep.bytes(kind) * (2 - blocks) // 2, kind
    assert saved.bytes() < keep.bytes()
    assert _equal(grads, exact)


def test_checkpoint_by_rule_counts_each_token_once_in_an_moe() -> None:
    loads = []
    for spec in ("keep", "checkpoint=all"):
        torch.manual_seed(0)
        model = ByteLM(ComputeCtx.new(DType.BF16, CPU).with_activations(spec), MOE)
        ids, targets = _ids()
        torch.autograd.backward(model.loss(ids, targets))
        loads.append(model.moe_layers()[0].tokens_per_expert.clone())
    assert torch.equal(loads[0], loads[1]) and int(loads[0].sum()) == 2 * 16 * 2


def test_the_new_paths_compile_whole_and_give_the_eager_gradients() -> None:
    # Attention computed again (through the upcast GEMMs, which torch.func cannot read as
    # Gemm's autograd.Function), the MoE combine and the stream's norms as fp8, SwiGLU
    # offloaded (a CPU: kept), the one block checkpointed: one graph, no break.
    spec = "attention:recompute/moe:fp8/residual:fp8/act_fn:offload/checkpoint=every:2"
    torch.manual_seed(0)
    with forced_gemm_path(GemmPath.UPCAST):
        model = ByteLM(ComputeCtx.new(DType.BF16, CPU).with_activations(spec), MOE)
    ids, targets = _ids()
    grads = []
    for run in (model, torch.compile(model, fullgraph=True, backend="aot_eager")):
        model.zero_grad()
        torch.autograd.backward(model.loss_of(run(ids), targets))
        grads.append(tuple(p.grad.clone() for p in model.parameters() if p.grad is not None))
    torch._dynamo.reset()
    assert _equal(grads[0], grads[1])
