"""``DemoSettings``: every setting of one demo run, each bound checked here and only here.

This module imports neither torch nor anything that does: the command line validates its
flags through ``DemoSettings`` before torch is loaded, so a typo is answered at once. What
only torch can tell (whether a CUDA device exists) is checked by ``run_demo``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator
from typing_extensions import Self

__all__ = ["DEFAULT_DTYPES", "POLICY_FLAGS", "DemoError", "DemoSettings"]

POLICY_FLAGS: tuple[str, ...] = (
    "fp32",
    "fp16",
    "bf16",
    "fp8_e4m3",
    "fp8_e5m2",
    "fp8_hybrid",
    "fp8_e4m3_dynamic",
    "fp8_e5m2_dynamic",
    "fp8_hybrid_dynamic",
    "fp8_rowwise",
    "fp8_rowwise_gw_hp",
    "fp8_block",
    "fp8_mx",
    "nvfp4",
    "mxfp4",
)
"""The ``--dtype`` names ``ComputeCtx.from_flag`` accepts. ``computectx.ctx.DTYPE_FLAGS`` is
the source; this copy lets flags be checked without importing torch, and a test keeps the
two equal."""

DEFAULT_DTYPES: tuple[str, ...] = ("fp32", "bf16", "fp8_hybrid")
"""The policies compared when ``--dtype`` is not given: three dtype flags, then bf16 keeping
its activations for the backward as fp8 (``ComputeCtx.activations``)."""

_DEVICE = re.compile(r"cpu|cuda(:[0-9]+)?")
_MOE_FIELDS = frozenset({"experts", "top_k", "shared_experts", "balance", "bias_rate"})


class DemoError(ValueError):
    """A demo setting that cannot work here (found before any training starts)."""


class DemoSettings(BaseModel, frozen=True, extra="forbid", use_attribute_docstrings=True):
    """Everything one demo run depends on; each field is one ``computectx demo`` flag.

    The flag is ``--`` plus the field name with dashes (``batch_size``: ``--batch-size``),
    except ``dtypes`` (``--dtype``); its help is the field's docstring. Values arrive from
    the command line as strings and are converted and bounded by pydantic, the same way as
    from Python. Invalid values raise ``pydantic.ValidationError`` (a ``ValueError``).
    """

    dtypes: tuple[str, ...] = Field(
        default=DEFAULT_DTYPES,
        json_schema_extra={"flag": "--dtype", "metavar": "FLAG[@ACTS]"},
    )
    """Policies to train, in order: fp32, fp16, bf16, fp8_e4m3, fp8_e5m2, fp8_hybrid (delayed
    scaling), fp8_e4m3_dynamic, fp8_e5m2_dynamic, fp8_hybrid_dynamic (dynamic scaling),
    fp8_rowwise, fp8_rowwise_gw_hp (per row), fp8_block (1x128/128x128 blocks), fp8_mx
    (MXFP8), nvfp4, mxfp4 (4-bit); FLAG@ACTS sets ctx.activations. Repeat or use commas."""
    steps: int = Field(default=120, ge=1, le=1_000_000)
    """Optimizer steps per policy."""
    seed: int = Field(default=0, ge=0, le=2**63 - 1)
    """Seeds the initial weights, the batch order and the sample."""
    grad_accum: int = Field(default=1, ge=1, le=4096)
    """Micro-batches per step; above 1 their gradients sum in a LowPrecGradAccumulator."""
    offload: bool = False
    """Step master weights and optimizer state with an OffloadedOptimizer on the CPU."""
    out: Path = Path("computectx-demo")
    """Folder for results.json and loss.png, and expert-load.png with --moe (created if
    missing)."""
    device: str | None = Field(
        default=None,
        json_schema_extra={"metavar": "DEV", "shown_default": "cuda if usable, else cpu"},
    )
    """Device to train on: cpu, cuda or cuda:N."""
    data: Path | None = Field(
        default=None, json_schema_extra={"shown_default": "the Python standard library's sources"}
    )
    """A text file or folder to train on."""
    batch_size: int = Field(default=8, ge=1, le=65536)
    """Sequences per micro-batch."""
    seq_len: int = Field(default=128, ge=8, le=65536)
    """Bytes per training sequence."""
    d_model: int = Field(default=128, ge=32, le=65536, multiple_of=32)
    """Width of the model, a multiple of 32 (attention heads are 32 wide)."""
    layers: int = Field(default=2, ge=1, le=256)
    """Decoder blocks."""
    lr: float = Field(default=3e-3, gt=0.0, le=1.0)
    """Peak AdamW learning rate (linear warm-up over the first tenth of the steps, then cosine
    decay to a tenth of the peak)."""
    sample_tokens: int = Field(default=160, ge=0, le=4096)
    """Bytes generated for each policy's sample (0: no sample)."""
    skip_serving: bool = False
    """Leave out the serving section: each trained model's validation loss through the KV
    cache at f32, bf16 and fp8, one cached decode pass per policy and setting (about a
    quarter of the default run's time)."""
    eval_batches: int = Field(default=4, ge=1, le=4096)
    """Validation batches per evaluation."""
    nproc: int = Field(default=1, ge=1, le=4096)
    """Data-parallel processes: each trains on its share of every batch (the batch size must
    divide evenly) and the gradients are averaged. On the CPU at most the CPUs this process
    may use; on CUDA at most the GPUs (one each)."""
    compile: bool = False
    """Train under torch.compile (the model's forward and backward, fp8 layers included).
    The first step, which compiles, is timed apart (compile_seconds in results.json); the
    tokens/s figure counts the later, steady-state steps only."""
    threads: int = Field(default=1, ge=1, le=4096)
    """Intra-op CPU threads torch uses during the run (restored afterwards). One by default:
    the model's matrices are ~128 wide, so a second thread gains little, and on a busy machine
    threads waiting for a core slow the run several-fold (docs/demo.md has measurements)."""
    moe: bool = False
    """Train the mixture-of-experts ByteLM: every block's MLP becomes routed experts (shaped
    by --experts, --top-k, --shared-experts and --balance) with the same active width; the
    demo then prints each policy's expert load and draws it per step (expert-load.png)."""
    experts: int = Field(default=8, ge=2, le=256)
    """Routed experts per block (with --moe)."""
    top_k: int = Field(default=2, ge=1, le=256)
    """Experts each token is routed to (with --moe; at most --experts)."""
    shared_experts: int = Field(default=1, ge=0, le=16)
    """Shared experts per block, which every token passes through (with --moe)."""
    balance: Literal["aux_free", "aux_loss", "none"] = Field(
        default="aux_free", json_schema_extra={"metavar": "NAME"}
    )
    """Expert load balancing (with --moe): aux_free (DeepSeek-V3's per-expert router bias,
    nudged toward balance after every step), aux_loss (a switch-style auxiliary loss added to
    the training loss) or none."""
    bias_rate: float = Field(default=1e-2, ge=0.0, le=1.0)
    """How far aux_free moves an expert's router bias per step (with --moe). DeepSeek-V3's
    1e-3 is meant for runs of many thousand steps; the demo's hundred or so need more."""

    @field_validator("dtypes", mode="before")
    @classmethod
    def _known_flags(cls, value: Any) -> Any:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) for v in items):
            raise ValueError(f"dtypes must be flag names (strings), got {value!r}")
        flags: list[str] = []
        for item in items:
            names = [n.strip().lower() for n in item.split(",")]
            if "" in names:
                raise ValueError(
                    f"{item!r} has an empty name; give names separated by single commas, "
                    f"from: {', '.join(POLICY_FLAGS)}"
                )
            for name in names:
                flag, at, acts = name.partition("@")
                if flag not in POLICY_FLAGS:
                    raise ValueError(
                        f"unknown dtype {flag!r}; accepted: {', '.join(POLICY_FLAGS)} (repeat "
                        f"--dtype or separate names with commas)"
                    )
                if at and not acts.strip():
                    # The activations text itself is read by ComputeCtx (run_demo: torch).
                    raise ValueError(
                        f"{name!r} names no activations after '@'; give FLAG or "
                        f"FLAG@ACTIVATIONS (bf16@fp8)"
                    )
            flags.extend(names)
        if not flags:
            raise ValueError(f"give at least one name from: {', '.join(POLICY_FLAGS)}")
        dups = sorted({f for f in flags if flags.count(f) > 1})
        if dups:
            raise ValueError(f"{', '.join(dups)} given more than once")
        return tuple(flags)

    @model_validator(mode="after")
    def _moe_shape(self) -> Self:
        shaped = sorted(_MOE_FIELDS & self.model_fields_set)
        if not self.moe and shaped:
            flags = ", ".join("--" + n.replace("_", "-") for n in shaped)
            raise ValueError(f"{flags} shape the experts of --moe; add --moe (or drop them)")
        if self.top_k > self.experts:
            raise ValueError(
                f"top_k={self.top_k} exceeds experts={self.experts}; a token is routed to at "
                f"most every expert"
            )
        return self

    @model_validator(mode="after")
    def _nproc_fits(self) -> Self:
        if self.nproc > 1 and self.batch_size % self.nproc:
            raise ValueError(
                f"nproc={self.nproc} does not divide batch_size={self.batch_size}; every "
                f"process takes an equal share of each batch"
            )
        if self.nproc > 1 and (self.device or "cpu").startswith("cpu"):
            cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
            cpus = cpus or os.cpu_count() or 1
            if self.nproc > cpus:
                raise ValueError(
                    f"nproc={self.nproc} exceeds the {cpus} CPU(s) this process may use; "
                    f"accepted: 1 to {cpus}"
                )
        return self

    @field_validator("device", mode="before")
    @classmethod
    def _device_name(cls, value: Any) -> Any:
        if value is None:
            return None
        if type(value).__module__ == "torch" and type(value).__name__ == "device":
            value = str(value)  # a torch.device from Python callers
        if not isinstance(value, str):
            raise ValueError(f"device must be a string such as 'cpu' or 'cuda:0', got {value!r}")
        name = value.strip().lower()
        if not _DEVICE.fullmatch(name):
            raise ValueError(f"bad device {value!r}; the demo accepts cpu, cuda or cuda:N")
        return name
