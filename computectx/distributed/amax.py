"""fp8 scaling ledgers kept identical on every rank: one collective merges what each rank saw.

Under data parallelism each rank quantizes its own shard, so each records its own amaxes. Left
alone, the ledgers drift apart (the issue that prompted this measured steps 25x apart after six
steps) and a checkpoint saves one rank's history as if it were the group's.
``Fp8AmaxSync`` merges them before every forward: one all-gather of every operand's ledger
(history, step, counts) for all fp8 layers at once, combined on the device into exactly what one
process would hold after quantizing the whole batch:

- history: the element-wise max over ranks. Every rank writes the same slots (the same calls
  in the same order), and the amax of a batch is the max of its shards' amaxes;
- step: recomputed from the merged history by the recipe's formula (the same float32 division
  the quantize kernel does), so it is bit-identical to a one-process step;
- non-finite count: if any rank counted a NaN/inf amax since the last merge, the whole batch
  had one, and every rank takes that rank's ledger, which is what one process holds after such
  a call: the history moved on without recording, the step kept, the call counted once (a NaN
  on one rank poisons no rank);
- saturated count: the sum of the ranks' new saturations, as one process counts the batch.

Nothing is read on the host: the combination is a few device ops.

Fine-grained layers (granularity ``row``, ``block`` or ``mx``) keep no amax history: each
operand is quantized from the amaxes of its own blocks, and every block of ``X``, ``dY`` and
``W`` lies within one rank's rows (the weight is whole on every rank, or gathered whole). So
there is nothing to merge and no amax to reduce: the sync leaves them out of the merge, hands
them a ``RankLocal`` seam (no collective, no ``Fp8ScalingNotSyncedWarning``) and issues no
collective for them, empty micro-batches included. The one operand whose blocks cross ranks
is the weight gradient's contraction over tokens: each rank quantizes its own tokens' blocks
and the gradients are then summed by DDP / FSDP2 (docs/distributed.md says when that equals
one process exactly). Their ledgers hold statistics only, of the rank's own tokens.

Two quantizes need the amax of the tensor in hand, which exists only once the layer before has
run, so no merge between steps can supply it: every call of dynamic scaling, and the first call
of delayed scaling, which seeds its history. ``sync_fp8_scaling`` therefore hands every layer a
``GroupAmax`` (``Fp8Linear.amax_reduce``): those quantizes of an input or an output gradient
reduce their amax (one float, MAX) over the group before taking the step, and the scales are
those of one process on the whole batch from step 1 on. Under ``torch.compile`` the delayed
seed stays the rank's own (the seeded check is a device value there; the merge after step 1
makes every history the one-process one). ``current_amax="local"`` opts out: no collective
inside a step, each rank scaling by its own shard. Weights need none of this: every rank
quantizes the same weight, and FSDP2's fp8 all-gather reduces its shard amaxes itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from computectx.distributed.collectives import GroupAmax, RankLocal
from computectx.distributed.fsdp import WeightGatheredAsFp8, sharded_weight_of
from computectx.distributed.group import GroupArg, check_same_policy, data_parallel_group
from computectx.dtypes import Fp8Format
from computectx.fp8 import Fp8Linear
from computectx.fp8.ledger import (
    ledger_history,
    ledger_nonfinite,
    ledger_saturated,
    ledger_step,
)
from computectx.fp8.reference import step_from_amax
from computectx.fp8.scaling import ROLES, OperandScaling, Role
from computectx.recipes import DelayedScaling

__all__ = [
    "CurrentAmax",
    "Fp8AmaxSync",
    "LossNormalization",
    "fp8_buffer_names",
    "rescale_grad_ledger",
    "sync_fp8_scaling",
]

LossNormalization = Literal["per_rank", "global"]
"""What each rank's loss is divided by: its own batch, or the global batch."""

CurrentAmax = Literal["group", "local"]
"""Whose amax a quantize that needs the current one uses on many ranks: the group's (the
whole batch's) or each rank's own."""


@dataclass
class _Snapshot:
    """One operand's ledger as it was after the last merge (identical on every rank)."""

    ledger: torch.Tensor  # the OperandScaling's ledger object the copy was taken from
    copy: torch.Tensor
    elements: torch.Tensor  # the element count then, a device tensor (no host read)


_Entry = tuple[Fp8Linear, Role, OperandScaling]


def _fp8_layers(model: nn.Module) -> list[Fp8Linear]:
    return [m for m in model.modules() if isinstance(m, Fp8Linear)]


def _layers(model: nn.Module) -> list[Fp8Linear]:
    # The layers whose scaling keeps a history to merge: granularity "tensor". A row, block
    # or mx layer scales every operand from the blocks in hand (no history, no step carried
    # over), so it has nothing to merge and no amax to reduce (_FINE_GRAINED).
    return [m for m in _fp8_layers(model) if m.policy.granularity == "tensor"]


def _operands(layers: list[Fp8Linear]) -> list[_Entry]:
    return [(layer, role, layer.scaling.operands[role]) for layer in layers for role in ROLES]


def fp8_buffer_names(model: nn.Module) -> list[str]:
    """The names of the scaling-state buffers of every ``Fp8Linear`` in ``model`` (ledgers,
    tallies, ``fp8_meta``), as ``model.named_buffers()`` gives them.

    DDP must leave these out of its buffer broadcast: with ``broadcast_buffers=True`` (its
    default) it copies rank 0's buffers over every rank's before each forward with
    gradients on, and ``Fp8AmaxSync`` merges the ranks' ledgers instead (and a rank-local
    ledger is the rank's own). ``parallelize`` passes them to
    ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`` before
    wrapping; ``sync_fp8_scaling`` of a ``DistributedDataParallel`` adds them to its ignore
    list.
    """
    return [
        f"{name}.{buffer}" if name else buffer
        for name, m in model.named_modules()
        if isinstance(m, Fp8Linear)
        for buffer in m.scaling.tensor_names()
    ]


def _out_of_ddp_broadcast(ddp: DistributedDataParallel) -> None:
    # DDP filters its buffers by name on every broadcast (_sync_buffers reassigns them),
    # so names added here are left out from the next forward on.
    ddp.parameters_to_ignore.update(fp8_buffer_names(ddp.module))
    assign = getattr(ddp, "_assign_modules_buffers", None)
    if callable(assign):
        assign()


def _format_of(layer: Fp8Linear, role: Role) -> Fp8Format:
    scheme = layer.policy.format
    return scheme.backward if role == "grad" else scheme.forward


class Fp8AmaxSync:
    """Merges the fp8 scaling ledgers of ``model``'s ``Fp8Linear`` layers across ``group``.

    ``sync_fp8_scaling`` builds one that also runs before every forward of ``model``
    (``before_forward=True``). ``sync()`` merges now: call it before saving a checkpoint,
    so the state saved holds the last step's amaxes of every rank. Every rank of the group
    must call it the same number of times (it is a collective).
    """

    def __init__(
        self,
        model: nn.Module,
        group: GroupArg = None,
        *,
        before_forward: bool = False,
        current_amax: CurrentAmax = "group",
        loss_normalization: LossNormalization = "per_rank",
    ) -> None:
        if current_amax not in ("group", "local"):
            raise ValueError(f"current_amax must be 'group' or 'local', got {current_amax!r}")
        if loss_normalization not in ("per_rank", "global"):
            raise ValueError(
                f"loss_normalization must be 'per_rank' or 'global', got {loss_normalization!r}"
            )
        self._loss_normalization: LossNormalization = loss_normalization
        self._model = model
        self._handles: list[RemovableHandle] = []
        self._order_checked = False
        self._snapshots: dict[int, _Snapshot] = {}
        self._current_amax: CurrentAmax = current_amax
        self._reduce: GroupAmax | None = None
        if group is None and not (dist.is_available() and dist.is_initialized()):
            # One process that no launcher gave a group (python train.py, or accelerate
            # on one machine): a world of one, in which there is nothing to keep in step.
            self._group: dist.ProcessGroup | None = None
            self._world = 1
            return
        self._group = data_parallel_group(group)
        self._world = dist.get_world_size(self._group)
        # A DDP module, or one inside a framework's wrapper (Lightning Fabric's module runs
        # its DDP as a submodule): its buffer broadcast would overwrite the merged ledgers.
        for module in model.modules():
            if isinstance(module, DistributedDataParallel):
                _out_of_ddp_broadcast(module)
        every = _fp8_layers(model)
        if every:
            check_same_policy(every[0].ctx, self._group)
        layers = _layers(model)
        # Row, block and mx layers: nothing to merge and no amax to reduce (every scale is
        # the current block's). Their seam says that they are in step by construction:
        # always armed (training calls record their statistics), never reducing, so they
        # issue no collective and nothing warns that no sync is attached.
        fine = RankLocal()
        for layer in every:
            if layer.policy.granularity != "tensor":
                layer.amax_reduce = fine
        # The layers' seam: armed while a synchronized forward of `model` runs (the
        # hooks below); outside one, a layer's call is rank-local and records nothing.
        # Built without hooks (before_forward=False), the layers stay armed: the caller
        # then runs every forward on every rank and merges with sync() itself.
        self._reduce = GroupAmax(
            self._group, reduces=current_amax == "group", always_armed=not before_forward
        )
        for layer in layers:
            layer.amax_reduce = self._reduce
        self._to_this_world(layers)
        self._take_snapshots(_operands(layers))
        if before_forward:
            # First among the model's pre-forward hooks: FSDP2's own (which all-gathers,
            # and with enable_fp8_all_gather quantizes each shard with the ledger's step) must
            # see the merged step.
            self._handles = [
                model.register_forward_pre_hook(self._pre_forward, prepend=True),
                model.register_forward_hook(self._post_forward, always_call=True),
            ]

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        # Only a training forward (grad enabled, some fp8 layer in training mode) is one
        # that every rank runs: eval, no_grad and inference_mode calls (validation or
        # sampling on one rank) merge nothing, arm nothing and so issue no collective.
        if not torch.is_grad_enabled():
            return
        layers = _layers(self._model)  # walked once per forward, for the check and the merge
        if not any(layer.training for layer in layers):
            return
        if not self._order_checked:
            self._check_hook_order()
        self._merge_all(layers)
        if self._reduce is not None:
            self._reduce.armed = True

    def _check_hook_order(self) -> None:
        # FSDP2 all-gathers (and with the fp8 all-gather quantizes) in a pre-forward hook
        # it puts first in line when fully_shard runs. A sync built before fully_shard is
        # therefore second: the gathers would run unmerged and unarmed, and the weights'
        # ledgers would stop advancing without a word. Checked again at every training
        # forward until it passes, so a caught error is raised again, never forgotten.
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(self._model, FSDPModule) or not self._handles:
            self._order_checked = True
            return
        hooks = list(self._model._forward_pre_hooks)
        if hooks and hooks[0] != self._handles[0].id:
            raise RuntimeError(
                "sync_fp8_scaling was called before fully_shard: FSDP2's all-gather now runs "
                "before the amax merge. Call sync_fp8_scaling(model) after fully_shard (or "
                "set up with computectx.distributed.parallelize, which orders it)"
            )
        self._order_checked = True

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._reduce is not None:
            self._reduce.armed = False

    def remove(self) -> None:
        """Stop merging before forwards (``sync()`` still merges on demand), and let each
        rank scale on its own: the layers' seam becomes ``RankLocal`` (every training call
        records the rank's own amaxes; no warning that no sync is attached)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        local = RankLocal()
        for layer in _layers(self._model):
            if self._reduce is not None and layer.amax_reduce is self._reduce:
                layer.amax_reduce = local

    @property
    def current_amax(self) -> CurrentAmax:
        """Whose amax a quantize that needs the current one (dynamic scaling, the seed of
        delayed scaling) uses: the group's or the rank's own."""
        return self._current_amax

    def _take_snapshots(self, entries: list[_Entry]) -> None:
        self._snapshots = {
            id(op): _Snapshot(op.ledger, op.ledger.detach().clone(), op.elements_tensor.clone())
            for _, _, op in entries
        }

    @property
    def loss_normalization(self) -> LossNormalization:
        """What each rank's loss is normalized by (see ``sync_fp8_scaling``)."""
        return self._loss_normalization

    def _to_this_world(self, layers: list[Fp8Linear]) -> None:
        # Scaling state recorded at another world size (a checkpoint saved on other ranks):
        # under a per-rank loss, the output-gradient ledger is in that world's units.
        for layer in layers:
            if layer.scaling.world_size != self._world:
                rescale_grad_ledger(layer, self._world, self._loss_normalization)

    def sync(self) -> None:
        """Merge every ledger with the other ranks' (one all-gather), in place, on the device.

        In a world of one (no process group) there is nothing to merge."""
        self._merge_all(_layers(self._model))

    def _merge_all(self, layers: list[Fp8Linear]) -> None:
        if not layers or self._group is None:
            return
        self._to_this_world(layers)
        entries = _operands(layers)
        # A ledger replaced since the last merge (a checkpoint loaded, a policy with another
        # history length) has no snapshot: it starts from itself, since what it holds came
        # from outside training, identically on every rank.
        snaps: list[_Snapshot | None] = []
        for _, _, op in entries:
            snap = self._snapshots.get(id(op))
            snaps.append(snap if snap is not None and snap.ledger is op.ledger else None)
        local = torch.cat([op.ledger.detach() for _, _, op in entries])
        gathered = [torch.empty_like(local) for _ in range(self._world)]
        dist.all_gather(gathered, local, group=self._group)
        stacked = torch.stack(gathered)  # (world, total)
        offset = 0
        with torch.no_grad():
            for (layer, role, op), snap in zip(entries, snaps, strict=True):
                size = op.ledger.numel()
                before = op.ledger if snap is None else snap.copy
                # Inputs and gradients differ per rank, and so do the weight shards that
                # FSDP2's fp8 all-gather quantizes: their counts add up over the group. A
                # weight every rank quantizes whole (DDP, FSDP2 gathering high precision)
                # is one tensor counted once, the same on every rank.
                split = role != "weight" or _quantizes_shards(layer)
                self._merge(layer, role, op, before, stacked[:, offset : offset + size], split)
                offset += size
                # The element count stays on the device. Summing the other ranks' counts
                # would take a second collective; equal shards (what DistributedSampler
                # gives) make the group's count the local one times the world size.
                if split and snap is not None:
                    grown = op.elements_tensor - snap.elements
                    op.elements_tensor.copy_(snap.elements + grown * self._world)
        self._take_snapshots(entries)

    def _merge(
        self,
        layer: Fp8Linear,
        role: Role,
        op: OperandScaling,
        before: torch.Tensor,
        ledgers: torch.Tensor,
        split: bool,
    ) -> None:
        each = ledgers.unbind(0)  # one ledger per rank
        nonfinite_all = torch.cat([ledger_nonfinite(r) for r in each])
        saturated_all = torch.cat([ledger_saturated(r) for r in each])
        prev_saturated = ledger_saturated(before)
        # A rank whose non-finite count grew since the last merge saw a NaN/inf amax: the
        # whole batch has one. That rank's ledger is what one process holds after such a call
        # (history rotated, nothing recorded, step kept, counted once), so every rank takes
        # it. Otherwise the history is the element-wise max and the step is recomputed.
        # index_select with a device index (not t[i]): no data-dependent indexing, so the
        # merge traces into a compiled graph without a break.
        poisoned_rank = nonfinite_all.argmax().reshape(1)
        taken = ledgers.index_select(0, poisoned_rank)[0]
        poisoned = ledger_nonfinite(taken) > ledger_nonfinite(before)
        merged_hist = torch.stack([ledger_history(r) for r in each]).amax(dim=0)
        scaling = layer.policy.scaling
        if isinstance(scaling, DelayedScaling) and scaling.algo == "max":
            window = merged_hist.amax().reshape(1)
        else:
            window = merged_hist[op.newest_amax_index()].reshape(1)
        fresh_step = step_from_amax(window, _format_of(layer, role), scaling.margin)
        ledger_history(op.ledger).copy_(torch.where(poisoned, ledger_history(taken), merged_hist))
        ledger_step(op.ledger).copy_(torch.where(poisoned, ledger_step(taken), fresh_step))
        ledger_nonfinite(op.ledger).copy_(ledger_nonfinite(taken))
        if split:
            ledger_saturated(op.ledger).copy_(
                prev_saturated + (saturated_all - prev_saturated).sum()
            )
        else:
            ledger_saturated(op.ledger).copy_(ledger_saturated(taken))


def rescale_grad_ledger(
    layer: Fp8Linear, world_size: int, loss_normalization: LossNormalization = "per_rank"
) -> None:
    """Bring ``layer``'s scaling state to ``world_size`` ranks (device ops, in place).

    Under a loss each rank normalizes by its own batch (``"per_rank"``), a rank's output
    gradient is ``world_size`` times the whole batch's, and so is what its gradient ledger
    holds: a state recorded at ``layer.scaling.world_size`` ranks has its gradient history
    and step multiplied by the ratio of the world sizes (exact for powers of two), so the
    first backward after loading a checkpoint saved at another world size neither saturates
    nor wastes range. Under a ``"global"`` normalization nothing depends on the world size.
    Either way the state is then marked as recorded at ``world_size``.
    """
    state = layer.scaling
    if loss_normalization == "per_rank" and state.world_size != world_size:
        ledger = state.grad.ledger
        ratio = world_size / state.world_size
        with torch.no_grad():
            ledger_history(ledger).mul_(ratio)
            ledger_step(ledger).mul_(ratio)
    state.world_size = world_size


def _quantizes_shards(layer: Fp8Linear) -> bool:
    return isinstance(sharded_weight_of(layer.weight), WeightGatheredAsFp8)


def sync_fp8_scaling(
    model: nn.Module,
    group: GroupArg = None,
    *,
    current_amax: CurrentAmax = "group",
    loss_normalization: LossNormalization = "per_rank",
) -> Fp8AmaxSync:
    """Keep the fp8 scaling ledgers of ``model`` identical on every rank of ``group``.

    ``model`` is what the ranks run forward: a ``DistributedDataParallel`` module, a
    ``fully_shard``-ed one, or a plain module. Before each of its forwards the ledgers are
    merged with the other ranks' (``Fp8AmaxSync``: one all-gather for all layers and
    operands, no host synchronisation). The ranks' policies are compared once, here.
    ``sync.remove()`` detaches it: running data-parallel fp8 without it is an explicit
    choice, and each rank then scales by its own shard only.

    Quantizes that need the current amax of an input or an output gradient (every call of
    dynamic scaling; the seeding first call of delayed scaling) reduce it over the group
    first (``current_amax="group"``, the default): one MAX all-reduce of a single float
    per such quantize, because that amax exists only once the layer before has run. The
    scales are then those of one process on the whole batch. ``current_amax="local"``
    keeps each rank's own (no collective inside a step; the scales then differ from one
    process's until the first merge, and under dynamic scaling always).

    ``loss_normalization`` says what each rank's loss is divided by: its own batch
    (``"per_rank"``, a mean-reduced loss under DDP / FSDP2's gradient averaging, the usual
    case), or the global batch (``"global"``: each rank sums its rows over the global
    count). It matters only when scaling state saved at another world size is loaded: under
    ``"per_rank"`` the gradient ledgers are rescaled to this world size
    (``rescale_grad_ledger``).
    """
    return Fp8AmaxSync(
        model,
        group,
        before_forward=True,
        current_amax=current_amax,
        loss_normalization=loss_normalization,
    )
