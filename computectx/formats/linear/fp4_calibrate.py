"""``calibrate_fp4_activations``: the static input amax of a frozen model's NVFP4 W4A4 layers.

Post-training calibration, as ModelOpt's ``mtq.quantize(model, config, forward_loop)`` and
llm-compressor's calibration pass run it: the model sees a few representative batches, each
``FrozenFp4Linear`` built with ``activation_amax="static"`` records the largest ``|x|`` of its
inputs (over the finite elements, as the dynamic rule's amax; the max over every call of every
batch), and that amax becomes its ``input_amax`` (``S_enc = 2688 / input_amax`` at every later
call, whatever the batch: ``fp4_serving``). During the pass the static layers serve
``"weight_only"`` (the activation unquantized, as ModelOpt's input quantizers pass through while
they calibrate), so each layer's amax is its input with the layers before it at weight-only
precision. The amax is recorded after the forward's autocast cast: what W4A4 would quantize.
The model runs in eval mode (dropout off, batch norm on its running statistics: as it serves),
each module's ``training`` flag restored afterwards, and torch's RNG states (the CPU's and each
CUDA device's) are restored too: nothing else changes, not other layers, modes, the weights,
nor the RNG. A layer whose inputs held no finite non-zero element (all zeros, NaN or inf) would
get an amax of 0, which serves its bias alone: the calibration is refused, naming it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from computectx.formats.linear.fp4_frozen import FrozenFp4Linear
from computectx.formats.linear.fp4_streams import stream_names
from computectx.formats.policy import describe

__all__ = ["calibrate_fp4_activations"]


def calibrate_fp4_activations(model: nn.Module, batches: Iterable[object]) -> tuple[str, ...]:
    """Run ``model`` on each of ``batches`` under ``torch.no_grad`` and install, in every
    ``FrozenFp4Linear`` of ``activation_amax="static"`` inside it, the max ``|x|`` of the
    inputs it saw as its ``input_amax`` (float32 ``(1,)``); return the layers' names, in module
    order (as ``assign_fp4_streams`` names them: torch's wrappers' parts, ``_orig_mod.`` of
    ``torch.compile``, ``module.`` of DDP, left out). A batch is called as ``model(batch)``,
    ``model(**batch)`` for a ``Mapping``, ``model(*batch)`` for a tuple. A layer calibrated
    before is calibrated again (its old amax is not kept). The model runs in eval mode; its
    modules' ``training`` flags and torch's RNG states are restored afterwards.
    ``ValueError`` for a model with no static layer, for no batches, for a static layer no
    batch reached and for one whose amax is 0 (its inputs held no finite non-zero element: it
    would serve its bias alone), each named; an error leaves every ``input_amax`` as it was.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"calibrate_fp4_activations takes an nn.Module, got {describe(model)}")
    layers = [
        (name, m)
        for _, name, m in stream_names(model)
        if isinstance(m, FrozenFp4Linear) and m.activation_amax == "static"
    ]
    if not layers:
        raise ValueError(
            f"calibrate_fp4_activations: {type(model).__name__} holds no FrozenFp4Linear with "
            f"activation_amax='static'; freeze it so (freeze_fp4_for_serving(model, 'w4a4', "
            f"activation_amax='static'))"
        )
    busy = [fqn for fqn, m in layers if m.calibrating is not None]
    if busy:
        raise RuntimeError(f"calibrate_fp4_activations: {busy[0]!r} is being calibrated already")
    seen = _run(model, batches, layers)
    missed = [fqn for fqn, _ in layers if seen[fqn] is None]
    if missed:
        raise ValueError(
            f"calibrate_fp4_activations: no batch reached {missed[0]!r} ({len(missed)} static "
            f"layer(s) unreached); nothing was installed"
        )
    amaxes = {fqn: a for fqn, a in seen.items() if a is not None}
    zero = [fqn for fqn, _ in layers if not bool(amaxes[fqn] > 0)]
    if zero:
        raise ValueError(
            f"calibrate_fp4_activations: the inputs of {zero[0]!r} held no finite non-zero "
            f"element ({len(zero)} static layer(s) so: {zero[:4]}), an amax of 0, with which it "
            f"would serve its bias alone; calibrate with representative batches (or freeze such "
            f"a layer with activation_amax='per_row'); nothing was installed"
        )
    for fqn, m in layers:
        m.set_input_amax(amaxes[fqn].reshape(1))
    return tuple(fqn for fqn, _ in layers)


def _run(
    model: nn.Module, batches: Iterable[object], layers: list[tuple[str, FrozenFp4Linear]]
) -> dict[str, torch.Tensor | None]:
    """Each layer's running max over ``batches``, ``None`` where no call reached it; the layers
    stop recording on the way out, error or not."""
    n = 0
    start = {
        fqn: torch.zeros((), dtype=torch.float32, device=m.weight_fp4.device) for fqn, m in layers
    }
    reached: dict[str, torch.Tensor | None] = {}
    training = [(m, m.training) for m in model.modules()]
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []  # type: ignore[no-untyped-call]
    try:
        for fqn, m in layers:
            m.calibrating = start[fqn]
        model.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=cuda):
            for batch in batches:
                n += 1
                if isinstance(batch, Mapping):
                    model(**batch)
                elif isinstance(batch, tuple):
                    model(*batch)
                else:
                    model(batch)
        # A call replaces the running max by a new tensor: one still the start was never reached.
        for fqn, m in layers:
            reached[fqn] = None if m.calibrating is start[fqn] else m.calibrating
    finally:
        for _, m in layers:
            m.calibrating = None
        for module, mode in training:
            module.training = mode
    if not n:
        raise ValueError("calibrate_fp4_activations: batches held no batch; nothing was installed")
    return reached
