"""QuantizedTensor: one torch.Tensor wrapper over every recipe's FP8 storage.

It looks like a tensor of its logical shape and dtype; underneath it holds uint8
rowwise_data / columnwise_data (either may view an external flat buffer that the engine
re-points by assignment and releases by assigning None; later use raises
Fp8DataReleasedError, a never-quantized direction reads None), scale_inv tensors in the
logical block grid (FP8_NUMERICS.md) and the transpose cache. Unhandled ops see the
dequantized tensor; in-place ops other than copy_ raise (they would write into a temporary);
copy_ re-quantizes into the existing bytes. nn.Parameter(qt) returns a QuantizedTensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.utils._pytree import tree_map

from megatron.core.fp8.recipe import RecipeSpec, recipe_spec
from megatron.core.fp8.reference import dequantize_cells, dequantize_reference

aten = torch.ops.aten

# quantization.quantize, registered by that module when it is imported. quantization.py builds
# QuantizedTensors, so this module cannot import it back; the fp8 package's __init__ imports
# quantization.py, and importing this module runs that __init__ first, so it is always set.
_quantize: Callable[..., QuantizedTensor] | None = None


def register_quantize(quantize: Callable[..., QuantizedTensor]) -> None:
    """Give `QuantizedTensor.quantize_` (and copy_) the quantizer it re-quantizes with."""
    global _quantize
    _quantize = quantize


class Fp8DataReleasedError(RuntimeError):
    """Raised on any use of FP8 bytes that the FSDP engine has released."""


class Fp8Operand(NamedTuple):
    """The one operand type FP8 GEMMs take (`fp8_gemm`, both backends' `gemm`), contracted over
    its last dim K: data [rows, K] as its FP8 dtype (emulated MXFP8: high-precision values,
    scale_inv None); scale_inv in the operand's block grid (the fused path's in torch._scaled_mm's
    layout); recipe and block cell ((0, 0): per tensor) for the reference GEMM's dequantize.
    """

    data: torch.Tensor
    scale_inv: torch.Tensor | None
    recipe: str = ""
    block_rows: int = 0
    block_cols: int = 0

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def spec(self) -> RecipeSpec:
        return recipe_spec(self.recipe)

    def dequantize(self) -> torch.Tensor:
        """Exact fp32 values: q * scale_inv per element (padding cropped)."""
        cell = (self.block_rows, self.block_cols) if self.block_cols else None
        e8m0 = cell is not None and self.spec.e8m0_scales
        return dequantize_cells(self.data.to(torch.float32), self.scale_inv, cell, e8m0=e8m0)


class QuantizedTensor(torch.Tensor):
    """FP8 bytes + scales presented as a tensor of logical `shape` and high-precision `dtype`."""

    @staticmethod
    def __new__(
        cls,
        *,
        shape: torch.Size | tuple[int, ...],
        dtype: torch.dtype,
        recipe: str,
        fp8_dtype: torch.dtype,
        role: str,
        rowwise_data: torch.Tensor | None = None,
        rowwise_scale_inv: torch.Tensor | None = None,
        columnwise_data: torch.Tensor | None = None,
        columnwise_scale_inv: torch.Tensor | None = None,
        amax: torch.Tensor | None = None,
        tensor_name: str | None = None,
        requires_grad: bool = False,
        device: torch.device | None = None,
    ) -> QuantizedTensor:
        present = [t for t in (rowwise_data, columnwise_data) if t is not None]
        if not present and device is None:
            raise ValueError("a QuantizedTensor needs rowwise_data, columnwise_data or a device")
        return torch.Tensor._make_wrapper_subclass(
            cls,
            torch.Size(shape),
            dtype=dtype,
            device=present[0].device if present else device,
            requires_grad=requires_grad,
        )

    def __init__(
        self,
        *,
        recipe,
        fp8_dtype,
        role,
        rowwise_data=None,
        rowwise_scale_inv=None,
        columnwise_data=None,
        columnwise_scale_inv=None,
        amax=None,
        tensor_name=None,
        **_wrapper_args,
    ) -> None:
        # shape, dtype, requires_grad and device were consumed by __new__.
        self.recipe = recipe
        self.fp8_dtype = fp8_dtype
        self.role = role
        self.tensor_name = tensor_name
        self.amax = amax
        self._data = {"rowwise": None, "columnwise": None}
        self._released = {"rowwise": False, "columnwise": False}
        self._transpose_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.rowwise_data = rowwise_data
        self.columnwise_data = columnwise_data
        # A direction that was never quantized is absent, not released.
        self._released = {"rowwise": False, "columnwise": False}
        self.rowwise_scale_inv = rowwise_scale_inv
        self.columnwise_scale_inv = columnwise_scale_inv

    # ---- raw storage -------------------------------------------------------------------
    def _get(self, direction: str) -> torch.Tensor | None:
        if self._released[direction]:
            raise Fp8DataReleasedError(
                f"{direction} FP8 data of {self._label()} was released by the FSDP engine; "
                "gather the unit (its pre-forward/pre-backward hook) before using the weight, "
                "or re-point it with `qt.{direction}_data = <uint8 view>`."
            )
        return self._data[direction]

    def _set(self, direction: str, data: torch.Tensor | None) -> None:
        self._transpose_cache = None
        if data is None:
            self._data[direction] = None
            self._released[direction] = True
            return
        if data.dtype != torch.uint8:
            raise TypeError(f"{direction}_data of {self._label()} must be uint8, got {data.dtype}")
        if data.numel() != self.numel():
            raise ValueError(
                f"{direction}_data of {self._label()} must have {self.numel()} bytes "
                f"(logical shape {tuple(self.shape)}), got {data.numel()}"
            )
        self._data[direction] = data.view(self.shape)
        self._released[direction] = False

    # Each direction's uint8 bytes in the logical shape (None: absent); setting re-points them.
    rowwise_data = property(
        lambda self: self._get("rowwise"), lambda self, data: self._set("rowwise", data)
    )
    columnwise_data = property(
        lambda self: self._get("columnwise"), lambda self, data: self._set("columnwise", data)
    )

    def is_released(self, direction: str = "rowwise") -> bool:
        """Whether the FSDP engine released this direction's bytes (assigned None)."""
        return self._released[direction]

    def has_data(self, direction: str = "rowwise") -> bool:
        """Whether this direction's bytes are present now (not absent, not released)."""
        return self._data[direction] is not None

    def _label(self) -> str:
        name = f"{self.tensor_name!r} " if self.tensor_name else ""
        return f"QuantizedTensor {name}(shape {tuple(self.shape)}, recipe {self.recipe})"

    @property
    def spec(self) -> RecipeSpec:
        """The recipe resolved (megatron/core/fp8/recipe.py)."""
        return recipe_spec(self.recipe)

    # ---- transpose cache ---------------------------------------------------------------
    def create_transpose_cache(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[K, M] bytes and scales read by backward GEMMs (per-tensor and 128x128 recipes only).

        Exact: a transpose of the rowwise bytes (per tensor: same scale; 128x128: transposed grid).
        """
        if not self.spec.transposes_rowwise(self.role):
            raise ValueError(
                f"{self._label()} has 1-D blocks: its transposed operand cannot be derived from "
                "rowwise bytes; quantize with columnwise=True and read columnwise_data instead."
            )
        if self._transpose_cache is None:
            source = self.rowwise_data if self.has_data("rowwise") else self.columnwise_data
            if source is None:
                raise ValueError(f"{self._label()} has no bytes to transpose")
            scale_inv = (
                self.rowwise_scale_inv if self.has_data("rowwise") else self.columnwise_scale_inv
            )
            rows2d = source.reshape(-1, self.shape[-1])
            scale_t = scale_inv if scale_inv.dim() == 0 else scale_inv.t().contiguous()
            transposed = (_transpose_bytes(rows2d), scale_t)
            if torch.compiler.is_compiling():
                # Storing into the parameter from a compiled backward is a side effect the
                # compiler refuses (a graph break); the FSDP engine drops the cache after each
                # unit's backward anyway, so a compiled step transposes once per backward too.
                return transposed
            self._transpose_cache = transposed
        return self._transpose_cache

    def discard_transpose_cache(self) -> None:
        self._transpose_cache = None

    @property
    def transpose_cache(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self._transpose_cache

    # ---- numerics ----------------------------------------------------------------------
    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The high-precision tensor these bytes stand for (rowwise copy preferred)."""
        present = [d for d in ("rowwise", "columnwise") if self.has_data(d)]
        if not present:
            for direction in ("rowwise", "columnwise"):
                self._get(direction)  # raises for a released direction
            raise ValueError(f"{self._label()} holds no bytes to dequantize")
        direction = present[0]
        data = self._data[direction]
        return dequantize_reference(
            data,
            getattr(self, f"{direction}_scale_inv"),
            recipe=self.recipe,
            fp8_dtype=self.fp8_dtype,
            role=self.role,
            columnwise=direction == "columnwise",
            out_dtype=dtype or self.dtype,
        )

    def gemm_operand(self, usage: str) -> Fp8Operand:
        """The operand a GEMM reads: "rowwise" contracts over the last dim (K), giving
        [M, K]; "columnwise" contracts over dim 0 (M), giving the transposed [K, M]."""
        if usage == "rowwise":
            data = self.rowwise_data
            if data is None:
                raise ValueError(f"{self._label()} was not quantized rowwise")
            rows2d = data.reshape(-1, self.shape[-1])
            return self._operand(rows2d, self.rowwise_scale_inv)
        if usage != "columnwise":
            raise ValueError(f"usage must be 'rowwise' or 'columnwise', got {usage!r}")
        if self.spec.transposes_rowwise(self.role):
            data_t, scale_t = self.create_transpose_cache()
            return self._operand(data_t, scale_t)
        data = self.columnwise_data
        if data is None:
            raise ValueError(
                f"{self._label()} has no columnwise copy; quantize with columnwise=True"
            )
        data_t = data.reshape(-1, self.shape[-1]).t().contiguous()
        return self._operand(data_t, self.columnwise_scale_inv.t().contiguous())

    def _operand(self, data: torch.Tensor, scale_inv: torch.Tensor) -> Fp8Operand:
        # The operand is contracted along its last dim: its cells have the rowwise shape.
        cell = self.spec.block_shape(self.role, columnwise=False)
        block_rows, block_cols = (0, 0) if cell is None else cell
        return Fp8Operand(data.view(self.fp8_dtype), scale_inv, self.recipe, block_rows, block_cols)

    def quantize_(
        self,
        source: torch.Tensor,
        *,
        scale: torch.Tensor | None = None,
        amax: torch.Tensor | None = None,
        power_2_scale: bool | None = None,
    ) -> None:
        """Re-quantize `source` (high precision, this shape) into the existing bytes in place,
        so external buffers see the new values. delayed needs `scale`; tensorwise may take a
        global `amax` (e.g. from the engine's packed all-reduce)."""
        if tuple(source.shape) != tuple(self.shape):
            raise ValueError(f"cannot write shape {tuple(source.shape)} into {self._label()}")
        fresh = _quantize(
            source.detach(),
            recipe=self.recipe,
            fp8_dtype=self.fp8_dtype,
            role=self.role,
            rowwise=self.has_data("rowwise"),
            columnwise=self.has_data("columnwise"),
            scale=scale,
            amax=amax,
            power_2_scale=power_2_scale,
            backend="auto",
        )
        for direction in ("rowwise", "columnwise"):
            if self.has_data(direction):
                self._data[direction].copy_(getattr(fresh, f"{direction}_data"))
                getattr(self, f"{direction}_scale_inv").copy_(
                    getattr(fresh, f"{direction}_scale_inv")
                )
        self.amax = fresh.amax
        self._transpose_cache = None

    # ---- torch.Tensor plumbing ---------------------------------------------------------
    def _fields(self) -> dict:
        return dict(
            shape=self.shape,
            dtype=self.dtype,
            recipe=self.recipe,
            fp8_dtype=self.fp8_dtype,
            role=self.role,
            rowwise_data=self._data["rowwise"],
            rowwise_scale_inv=self.rowwise_scale_inv,
            columnwise_data=self._data["columnwise"],
            columnwise_scale_inv=self.columnwise_scale_inv,
            amax=self.amax,
            tensor_name=self.tensor_name,
            device=self.device,
        )

    def _rewrap(self, convert=lambda t: t) -> QuantizedTensor:
        """A new QuantizedTensor over convert(each storage tensor); released stays released."""
        fields = {
            k: convert(v) if isinstance(v, torch.Tensor) else v for k, v in self._fields().items()
        }
        return _rebuild_quantized_tensor(fields, dict(self._released))

    def __repr__(self, *, tensor_contents=None) -> str:
        def state(direction: str) -> str:
            if self._released[direction]:
                return "released"
            return "present" if self._data[direction] is not None else "absent"

        fp8 = str(self.fp8_dtype).replace("torch.", "")
        return (
            f"QuantizedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, recipe={self.recipe},"
            f" fp8_dtype={fp8}, role={self.role}, rowwise={state('rowwise')},"
            f" columnwise={state('columnwise')}, device={self.device})"
        )

    def __reduce_ex__(self, protocol):
        return (_rebuild_quantized_tensor, (self._fields(), dict(self._released)))

    def __deepcopy__(self, memo):
        return self._rewrap(lambda t: t.clone())

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):
            return args[0]._rewrap()
        if func is aten.clone.default:
            return args[0]._rewrap(lambda t: t.clone())
        if func is aten.copy_.default and isinstance(args[0], QuantizedTensor):
            source = args[1].dequantize() if isinstance(args[1], QuantizedTensor) else args[1]
            args[0].quantize_(source)
            return args[0]
        if func is aten._to_copy.default and isinstance(args[0], QuantizedTensor):
            return _to_copy(args[0], **kwargs)
        if func._schema.is_mutable and any(isinstance(a, QuantizedTensor) for a in args):
            raise RuntimeError(
                f"in-place {func} on a QuantizedTensor would write into a temporary copy; "
                "compute in high precision and write back with qt.copy_(x) or qt.quantize_(x)"
            )

        def unwrap(value):
            return value.dequantize() if isinstance(value, QuantizedTensor) else value

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))


def _transpose_bytes(rows2d: torch.Tensor) -> torch.Tensor:
    """[K, M] copy of [M, K] bytes: the fused CUDA transpose on GPU, torch elsewhere."""
    if rows2d.is_cuda:
        try:
            from megatron.core.fp8.cuda import transpose_fp8
        except ImportError:
            return rows2d.t().contiguous()
        return transpose_fp8(rows2d)
    return rows2d.t().contiguous()


def _to_copy(qt: QuantizedTensor, *, dtype=None, device=None, **_ignored) -> torch.Tensor:
    """.to(dtype) dequantizes (a different dtype is a different tensor); .to(device) moves bytes."""
    if dtype is not None and dtype != qt.dtype:
        plain = qt.dequantize(dtype)
        return plain if device is None else plain.to(device)
    return qt._rewrap(lambda t: t.to(device) if device is not None else t.clone())


def _rebuild_quantized_tensor(fields: dict, released: dict) -> QuantizedTensor:
    qt = QuantizedTensor(**fields)
    qt._released = released
    return qt
