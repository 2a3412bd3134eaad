"""``broadcast_frozen`` in one process (a gloo world of one): what it sends (every frozen
buffer but an expert-parallel MoE's frozen experts, each rank's own), in place and unchanged
from the only rank, and its refusals, each raised through ``agree`` (the 2-rank behaviour:
rank 0's codes on every rank, ranks that froze other layers, a DDP that wrapped before a
freeze, is ``test_fp4_ranks.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from computectx import ComputeCtx
from computectx.distributed import AllToAllDispatch, broadcast_frozen
from computectx.formats import QuantizedLinear, convert_to_quantized, freeze_fp4_for_serving
from computectx.formats.linear.fp4_frozen import FrozenFp4Linear
from computectx.nn import GroupedExperts, MoE

FP8 = ComputeCtx.from_flag("fp8_hybrid", "cpu")
NVFP4 = ComputeCtx.from_flag("nvfp4", "cpu")


def frozen_net(expert_parallel: bool) -> nn.Sequential:
    """A frozen fp8 linear and a frozen fp8 MoE, its dispatch an ``AllToAllDispatch`` when
    ``expert_parallel`` (only its class matters here: ``expert_parallel`` in a world of one
    installs none)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 32), MoE(FP8, 32, 32, 4, 2))
    convert_to_quantized(net, FP8, include_head=True, min_features=16)
    for m in net.modules():
        if isinstance(m, QuantizedLinear | GroupedExperts):
            m.freeze_for_serving()
    moe = net[1]
    assert isinstance(moe, MoE)
    if expert_parallel:
        moe.dispatch = AllToAllDispatch.__new__(AllToAllDispatch)
    return net


def test_sends_the_frozen_buffers_in_place_but_expert_parallel_ones(world_of_one: None) -> None:
    experts = ["1.experts.gate_up_fp8", "1.experts.gate_up_step"]
    experts += ["1.experts.down_fp8", "1.experts.down_step"]
    for spread in (False, True):
        net = frozen_net(spread)
        before = {n: (b.data_ptr(), b.clone()) for n, b in net.named_buffers()}
        sent = broadcast_frozen(net)
        # The linear's codes and its scaling state (under delayed scaling its input step
        # comes from its ledger), then the experts' (each rank's own when spread).
        scaling = [
            f"0.fp8_{r}_{p}" for r in ("input", "weight", "grad") for p in ("ledger", "tally")
        ]
        want = (
            "0.weight_fp8",
            "0.weight_step",
            *scaling,
            "0.fp8_meta",
            *([] if spread else experts),
        )
        assert sent == want
        for n, b in net.named_buffers():  # rank 0 is the only rank: its own bytes, in place
            assert b.data_ptr() == before[n][0] and torch.equal(b, before[n][1]), n


def test_a_non_contiguous_buffer_goes_through_a_copy_written_back(world_of_one: None) -> None:
    net = frozen_net(False)
    first = net[0]
    codes = first.weight_fp8
    assert isinstance(codes, torch.Tensor)
    first.weight_fp8 = codes.t().contiguous().t()  # the same codes, column-major
    held = first.weight_fp8
    assert isinstance(held, torch.Tensor) and not held.is_contiguous()
    broadcast_frozen(net)
    assert first.weight_fp8 is held and torch.equal(held.view(torch.uint8), codes.view(torch.uint8))


def test_refusals_name_the_argument_on_every_rank(world_of_one: None) -> None:
    net = frozen_net(False)
    bad: list[tuple[object, object, type[Exception], str]] = [
        (net, True, TypeError, "src must be an int .the group's rank; any integer operator"),
        (net, 1.0, TypeError, "src must be an int .*, got float"),
        (net, 1, ValueError, r"src must be a rank of the group .its group rank, not the global "),
        ("net", 0, TypeError, "takes an nn.Module, got str"),
        # __index__ refuses a float tensor: named, with what is accepted (not torch's words).
        (net, torch.tensor(0.0), TypeError, "integer tensor of one element too.*float32 tensor of"),
        (net, torch.tensor([0, 0]), TypeError, r"got a int64 tensor of shape \(2,\)"),
    ]
    for model, src, error, match in bad:
        with pytest.raises(error, match=rf"failed on rank\(s\) 0 .*{match}"):
            broadcast_frozen(model, src)  # type: ignore[arg-type]


def test_src_takes_any_index_integer_and_a_compiled_wrapper_its_module(world_of_one: None) -> None:
    import numpy as np

    net = frozen_net(False)
    want = broadcast_frozen(net)
    assert broadcast_frozen(net, src=np.int64(0)) == want  # operator.index takes it
    assert broadcast_frozen(net, src=torch.tensor(0)) == want
    # torch.compile's wrapper (an OptimizedModule) holds its module as `_orig_mod`: a
    # stand-in (importing dynamo costs seconds): its module's names, not '_orig_mod.'-prefixed.
    assert broadcast_frozen(Compiled(net)) == want


class Compiled(nn.Module):
    """What broadcast_frozen reads of torch.compile's wrapper: the module, as ``_orig_mod``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._orig_mod = module


def test_the_input_step_read_from_the_ledger_written_in_place(world_of_one: None) -> None:
    # A frozen layer that had seen its input ledger seeded (a host flag) is sent an unseeded
    # one: it takes each request's own amax again, as the sender does.
    x = torch.randn(4, 32).bfloat16()
    fresh = frozen_net(False)[0]
    assert isinstance(fresh, QuantizedLinear)
    with torch.inference_mode():
        want = fresh(x).clone()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 32))
    convert_to_quantized(net, FP8, include_head=True, min_features=16)
    lin = net[0]
    assert isinstance(lin, QuantizedLinear)
    lin(torch.randn(4, 32).bfloat16())  # records: seeded, the host flag set
    lin.freeze_for_serving()
    with torch.no_grad():  # rank 0's unseeded state, written in place (as a broadcast does)
        for name in lin.scaling.tensor_names():
            getattr(lin, name).copy_(getattr(fresh, name))
    lin.scaling.adopt_written()
    with torch.inference_mode():
        assert torch.equal(lin(x), want)


def test_a_buffer_no_rank_could_send_is_refused_in_the_exchange(world_of_one: None) -> None:
    # Checked before the first broadcast, so every rank raises it (through agree), instead
    # of the one rank failing in its broadcast while the others wait in theirs.
    net = frozen_net(False)
    first = net[0]
    codes = first.weight_fp8
    assert isinstance(codes, torch.Tensor)
    first.weight_fp8 = torch.empty_like(codes, device="meta")
    with pytest.raises(ValueError, match=r"rank\(s\) 0 .*'0.weight_fp8' is on the meta device"):
        broadcast_frozen(net)
    with torch.inference_mode():
        made = codes.clone()
    first.weight_fp8 = made  # written in place only under inference_mode
    with pytest.raises(ValueError, match=r"'0.weight_fp8' is an inference tensor"):
        broadcast_frozen(net)
    with torch.inference_mode():
        broadcast_frozen(net)
    assert torch.equal(made.view(torch.uint8), codes.view(torch.uint8))


def static_fp4() -> tuple[nn.Sequential, FrozenFp4Linear]:
    """A model of one NVFP4 linear frozen for W4A4 with a static input amax (uncalibrated)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 32))
    convert_to_quantized(net, NVFP4, include_head=True, min_features=16)
    freeze_fp4_for_serving(net, "w4a4", activation_amax="static")
    layer = net[0]
    assert isinstance(layer, FrozenFp4Linear)
    return net, layer


def test_a_static_layer_is_calibrated_as_the_bytes_written_say(world_of_one: None) -> None:
    # The sender's input_amax written over the layer's (here its own bytes, as a one-rank
    # group sends): the layer serves with it when finite, refuses when NaN, whatever its
    # flag said before (rank 0 calibrated, rank 1 not; or the other way round).
    x = torch.randn(4, 32)
    net, layer = static_fp4()
    with torch.no_grad():
        layer.input_amax.fill_(3.0)  # rank 0's calibrated amax, the flag still unset
    assert not layer.input_calibrated
    assert "0.input_amax" in broadcast_frozen(net)
    assert layer.input_calibrated
    want = layer(x)
    layer.set_input_amax(torch.tensor([2.0]))
    with torch.no_grad():
        layer.input_amax.fill_(float("nan"))  # rank 0 uncalibrated, this rank calibrated
    broadcast_frozen(net)
    assert not layer.input_calibrated
    with pytest.raises(RuntimeError, match="input_amax is not calibrated"):
        layer(x)
    layer.set_input_amax(torch.tensor([3.0]))
    assert torch.equal(layer(x), want)


def test_the_rest_checksum_reads_minus_zero_as_zero_and_never_flushes_subnormals() -> None:
    # The bare model's checksum of the rest: -0.0 and 0.0 alike (690e46f); computed on the
    # bits, so a thread that flushes subnormals to zero neither equates 1e-45 with 0.0 nor
    # differs from one that does not (adversarial s48 I10: a float add followed the mode).
    from computectx.distributed.frozen_broadcast import _checksum

    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        zero, minus, tiny = (torch.tensor([v], dtype=dtype) for v in (0.0, -0.0, 1e-45))
        if dtype in (torch.bfloat16, torch.float16):
            tiny = torch.tensor([1], dtype=torch.int16).view(dtype)  # the least subnormal
        assert _checksum(minus) == _checksum(zero), dtype
        plain = _checksum(tiny)
        flushes = torch.set_flush_denormal(True)
        try:
            assert _checksum(tiny) == plain != _checksum(zero), (dtype, flushes)
        finally:
            torch.set_flush_denormal(False)
