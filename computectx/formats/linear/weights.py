"""``QuantizedWeight``: a weight that arrives already quantized (fp8 codes and one step).

A ``QuantizedLinear`` normally quantizes its high-precision weight on every call. Sometimes the
weight reaches the layer already in fp8: FSDP2's fp8 all-gather
(``computectx.distributed.enable_quantized_all_gather``) quantizes each rank's shard once and
gathers the bytes, so what the layer finds in ``self.weight`` is the gathered fp8 data and the
step the shards were quantized with. ``QuantizedWeight`` carries that pair under the weight's own
shape and nominal dtype, so the rest of PyTorch (autograd, ``nn.Parameter``, FSDP2) sees a
tensor of the right metadata, and the fp8 linear takes the codes and the step as they are,
with no second quantization.

Anything else done with it (``weight.to(x.dtype)`` inside ``autocast(enabled=False)``,
an arithmetic op, printing) sees its dequantized value: ``data * step`` formed in float32 and
rounded once to the nominal dtype. Shape-only aliasing ops (``detach``, ``alias``, ``view``,
``as_strided``) keep it a ``QuantizedWeight`` over the same bytes.

``QuantizedBlockWeight`` is the same for a weight quantized in 128x128 blocks (the ``block``
policy's weight, which FSDP2's fp8 all-gather gathers as codes and block scales): the codes
and the float32 scale of each block, as ``quantize_tensor(w, fmt, granularity="128x128")``
returns them. The block linear multiplies with them as they are, in its forward and,
transposed, in its dgrad.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch.utils._pytree import tree_map
from typing_extensions import Self

from computectx._checks import described
from computectx.dtypes import FLOAT_DTYPES, FP8_DTYPES
from computectx.formats.numerics import blockwise, layouts, tensorwise

__all__ = ["QuantizedBlockWeight", "QuantizedWeight"]

_aten = torch.ops.aten
_ALIASING = {
    _aten.detach.default,
    _aten.alias.default,
    _aten.view.default,
    _aten.as_strided.default,
    _aten._unsafe_view.default,
}


class _CodesWeight(torch.Tensor):
    """What ``QuantizedWeight`` and ``QuantizedBlockWeight`` share: a traceable wrapper subclass
    over fp8
    codes (``_fp8_data``, its shape and strides) and their step(s) (the attribute named by
    ``_STEPS``), at a nominal float dtype. Shape-only aliasing ops make a new weight of the
    same class over the aliased codes where ``_alias`` says the steps still fit them; every
    other op sees the subclass's ``dequantize()``. Private: code tells the public classes apart
    with ``isinstance`` of each, and neither is an instance of the other."""

    _STEPS: ClassVar[str]
    _fp8_data: torch.Tensor

    @classmethod
    def _wrap(
        cls, data: torch.Tensor, steps: object, fits: bool, wanted: str, dtype: torch.dtype
    ) -> Self:
        # The weight's metadata over checked codes, with its steps: a float32 tensor on the
        # codes' device that ``fits`` them (``wanted``: the rule, as the error states it).
        if (
            not isinstance(steps, torch.Tensor)
            or steps.dtype != torch.float32
            or not fits
            or steps.device != data.device
        ):
            raise ValueError(f"{wanted} on {data.device}, got {described(steps)}")
        if dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"{cls.__name__} stands for a float32, bfloat16 or float16 weight, got {dtype}"
            )
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=dtype,
            device=data.device,
            requires_grad=False,
        )
        out._fp8_data = data
        setattr(out, cls._STEPS, steps)
        return out

    def __init__(self, data: torch.Tensor, steps: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()

    @property
    def fp8_data(self) -> torch.Tensor:
        """The fp8 codes, shaped like the weight."""
        return self._fp8_data

    def _alias(self, data: torch.Tensor) -> Self | None:
        """This weight over ``data``, an alias of its codes, or ``None`` where its steps do
        not fit ``data``."""
        raise NotImplementedError

    # A traceable wrapper subclass (what torch.compile and module conversions expect).
    def __tensor_flatten__(self) -> tuple[list[str], torch.dtype]:
        return ["_fp8_data", self._STEPS], self.dtype

    @classmethod
    def __tensor_unflatten__(
        cls, inner: dict[str, torch.Tensor], dtype: torch.dtype, outer_size: Any, outer_stride: Any
    ) -> Self:
        return cls(inner["_fp8_data"], inner[cls._STEPS], dtype)

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in _ALIASING and isinstance(args[0], cls):
            alias = args[0]._alias(func(args[0].fp8_data, *args[1:], **kwargs))
            if alias is not None:
                return alias

        def plain(x: Any) -> Any:
            return x.dequantize() if isinstance(x, cls) else x

        return func(*tree_map(plain, args), **tree_map(plain, kwargs))


class QuantizedWeight(_CodesWeight):
    """A weight held as fp8 codes (``data``) and the float32 ``step`` they were made with.

    Its shape is ``data``'s, its dtype is the nominal ``dtype`` it stands for (the dtype the
    weight's gradient has). ``dequantize()`` gives ``data * step`` at that dtype; every op
    except shape-only aliasing sees that value. ``data`` must be an fp8 tensor
    (``FP8_DTYPES``) and ``step`` a float32 tensor of one element on the same device.
    """

    _STEPS = "_fp8_step"
    _fp8_step: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, step: torch.Tensor, dtype: torch.dtype) -> QuantizedWeight:
        if not isinstance(data, torch.Tensor) or data.dtype not in FP8_DTYPES:
            what = str(data.dtype) if isinstance(data, torch.Tensor) else type(data).__name__
            raise TypeError(f"QuantizedWeight data must be a float8_e4m3fn/e5m2 tensor, got {what}")
        fits = isinstance(step, torch.Tensor) and step.numel() == 1
        wanted = "QuantizedWeight step must be a float32 tensor of one element"
        return cls._wrap(data, step, fits, wanted, dtype)

    @property
    def fp8_step(self) -> torch.Tensor:
        """The step the codes were made with: ``weight ≈ data * step``."""
        return self._fp8_step

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``data * step`` as a plain tensor of ``dtype`` (default: the nominal dtype)."""
        return tensorwise.dequantize(self._fp8_data, self._fp8_step, dtype or self.dtype)

    def _alias(self, data: torch.Tensor) -> QuantizedWeight:
        # One step serves the codes in any shape.
        return type(self)(data, self._fp8_step, self.dtype)

    def __repr__(self, *, tensor_contents: object = None) -> str:  # type: ignore[override]
        return (
            f"QuantizedWeight(shape={tuple(self.shape)}, {self._fp8_data.dtype} as {self.dtype}, "
            f"step={self._fp8_step.reshape(()).item():.6g}, device={self.device})"
        )


class QuantizedBlockWeight(_CodesWeight):
    """A weight held as fp8 codes (``data``, 2-D) and the float32 steps of its 128x128
    blocks (``scale``, ``(ceil(rows/128), ceil(K/128))``: ``quantize_tensor``'s ``128x128``
    layout).

    Its shape is ``data``'s and its dtype the nominal ``dtype`` it stands for. Shape-keeping
    aliasing ops (``detach``, ``alias``, a ``view``/``as_strided`` to the same shape) keep
    it a ``QuantizedBlockWeight`` over the same bytes; every other op sees ``dequantize()``.
    """

    _STEPS = "_fp8_scale"
    _fp8_scale: torch.Tensor

    @staticmethod
    def __new__(
        cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
    ) -> QuantizedBlockWeight:
        if not isinstance(data, torch.Tensor) or data.dtype not in FP8_DTYPES or data.dim() != 2:
            raise TypeError(
                f"QuantizedBlockWeight data must be a 2-D float8_e4m3fn/e5m2 tensor, got "
                f"{described(data)}"
            )
        grid = layouts.layout_of("128x128", data.shape).grid
        fits = isinstance(scale, torch.Tensor) and tuple(scale.shape) == grid
        wanted = (
            f"QuantizedBlockWeight scale of {tuple(data.shape)} codes must be a float32 tensor "
            f"of shape {grid} (one step per 128x128 block)"
        )
        return cls._wrap(data, scale, fits, wanted, dtype)

    @property
    def fp8_scale(self) -> torch.Tensor:
        """The step of each 128x128 block: ``weight ≈ data * step`` of the element's block."""
        return self._fp8_scale

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Each code times its block's step, as a plain tensor of ``dtype`` (default: the
        nominal dtype)."""
        layout = layouts.layout_of("128x128", self._fp8_data.shape)
        return blockwise.dequantize(self._fp8_data, self._fp8_scale, layout, dtype or self.dtype)

    def _alias(self, data: torch.Tensor) -> QuantizedBlockWeight | None:
        if data.shape == self._fp8_data.shape:  # the blocks stay where they were
            return type(self)(data, self._fp8_scale, self.dtype)
        return None

    def __repr__(self, *, tensor_contents: object = None) -> str:  # type: ignore[override]
        return (
            f"QuantizedBlockWeight(shape={tuple(self.shape)}, {self._fp8_data.dtype} as "
            f"{self.dtype}, 128x128 blocks, device={self.device})"
        )
