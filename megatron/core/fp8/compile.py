"""Fp8Linear under torch.compile, with no graph break: FP8 weight stand-ins (a registry from
stand-in to layer, the custom op megatron_fp8::fp8_weight_gemm, grad delivery),
megatron_fp8::backward_one, and `prepare_for_compile`'s eager hooks. Finds Fp8Linears by
`before_compiled_forward` (no import of linear.py)."""

from __future__ import annotations

import weakref

import torch
from torch import nn

from megatron.core.fp8.quantization import backend_for
from megatron.core.fp8.quantized_tensor import Fp8Operand, QuantizedTensor


@torch.library.custom_op("megatron_fp8::backward_one", mutates_args=())
def backward_one(grad: torch.Tensor) -> torch.Tensor:
    """A 0-d fp32 1.0 made from `grad` (whose values it does not read): a data dependency on
    the backward for `_recomputed_input_operand`."""
    return torch.ones((), dtype=torch.float32, device=grad.device)


@backward_one.register_fake
def _(grad):
    return grad.new_empty((), dtype=torch.float32)


@torch._dynamo.disable
def forward_outside_the_graph(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An Fp8Linear's forward run eagerly from a compiled caller (a graph break each side):
    an FP8 parameter without a stand-in, or one that runs in high precision. The
    QuantizedTensor itself must not be traced: it is not a traceable tensor subclass, so a
    compiled graph does not see it as needing a grad and drops its wgrad
    (dev/probe_compile_grads.py shows it per parameter)."""
    return module._forward(x)


# ---- FP8 parameters in compiled graphs: stand-ins (Fp8Linear.refresh_weight_stand_in) -------

# (device, data pointer of the stand-in's one-element storage) -> its Fp8Linear
_stand_in_owners: dict[tuple[str, int], weakref.ref] = {}


def _stand_in_key(stand_in: torch.Tensor) -> tuple[str, int]:
    return str(stand_in.device), stand_in.untyped_storage().data_ptr()


def register_stand_in(stand_in: torch.Tensor, module: nn.Module) -> None:
    key = _stand_in_key(stand_in)
    owner = _stand_in_owners[key] = weakref.ref(module)

    def forget() -> None:  # the storage (so the key) may be reused once the stand-in dies
        if _stand_in_owners.get(key) is owner:
            del _stand_in_owners[key]

    weakref.finalize(stand_in, forget)


def stand_in_owner(stand_in: torch.Tensor) -> nn.Module | None:
    owner = _stand_in_owners.get(_stand_in_key(stand_in))
    return owner() if owner is not None else None


def stand_in_weight(stand_in: torch.Tensor) -> QuantizedTensor:
    module = stand_in_owner(stand_in)
    if module is None or not isinstance(module.weight, QuantizedTensor):
        raise RuntimeError(
            "an FP8 weight stand-in reached megatron_fp8::fp8_weight_gemm without its "
            "Fp8Linear; call prepare_for_compile(module) on the compiled module"
        )
    return module.weight


def deliver_stand_in_grad(stand_in: torch.Tensor) -> None:
    """The stand-in's post-accumulate-grad hook: its grad becomes the FP8 weight's, and the
    weight's own post-accumulate-grad hooks (the FSDP engine's) run, as after AccumulateGrad."""
    grad, stand_in.grad = stand_in.grad, None
    weight = stand_in_weight(stand_in)
    weight.grad = grad if weight.grad is None else weight.grad + grad
    for hook in list((weight._post_accumulate_grad_hooks or {}).values()):
        hook(weight)


def prepare_for_compile(module: nn.Module) -> None:
    """Hooks running eagerly around each compiled forward of `module` what a graph cannot:
    before it each Fp8Linear's `before_compiled_forward`; after it the forward flush outside an
    autocast and, when a backward follows, an output hook queueing delayed scaling's backward
    flush. The unit's Fp8Linears then compile without graph breaks. Register them before the
    FSDP engine's hooks; they read no weight bytes."""

    def linears(unit: nn.Module) -> list[nn.Module]:
        return [child for child in unit.modules() if hasattr(child, "before_compiled_forward")]

    def before(unit: nn.Module, args) -> None:
        inputs = _tensors(args)
        device = inputs[0].device if inputs else None
        for linear in linears(unit):
            linear.before_compiled_forward(device)

    def after(unit: nn.Module, args, output) -> None:
        flushes = [linear.after_compiled_forward() for linear in linears(unit)]
        flushes = list({id(flush): flush for flush in flushes if flush is not None}.values())
        outputs = [t for t in _tensors(output) if t.requires_grad]
        if flushes and outputs:
            torch.autograd.graph.register_multi_grad_hook(
                outputs, lambda grads: [flush.queue() for flush in flushes], mode="any"
            )

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def stand_in_gemm(a: Fp8Operand, stand_in, usage: str, out_dtype, fast_accum: bool):
    """megatron_fp8::fp8_weight_gemm of either backend's operand."""
    args = (a.data, a.scale_inv, stand_in, usage, a.block_rows, a.block_cols)
    return _fp8_weight_gemm(*args, out_dtype, fast_accum)


@torch.library.custom_op("megatron_fp8::fp8_weight_gemm", mutates_args=())
def _fp8_weight_gemm(
    a_data: torch.Tensor,
    a_scale_inv: torch.Tensor | None,
    stand_in: torch.Tensor,
    usage: str,
    a_block_rows: int,
    a_block_cols: int,
    out_dtype: torch.dtype,
    fast_accum: bool,
) -> torch.Tensor:
    """A [M, K] times the FP8 weight that `stand_in` stands for: W^T ("rowwise", fprop) or W
    ("columnwise", dgrad); `a` an `Fp8Operand` given as its fields."""
    weight = stand_in_weight(stand_in)
    ops = backend_for(a_data)
    # Emulated MXFP8 on the fused path multiplies values in a's dtype; else fp32 (unused).
    compute_dtype = a_data.dtype if weight.spec.fused_linear_emulates else torch.float32
    a = Fp8Operand(a_data, a_scale_inv, weight.recipe, a_block_rows, a_block_cols)
    b = ops.weight_operand(weight, usage, compute_dtype=compute_dtype)
    out = ops.gemm(a, b, recipe=weight.recipe, out_dtype=out_dtype, fast_accum=fast_accum)
    return out.contiguous()


@_fp8_weight_gemm.register_fake
def _(a_data, a_scale_inv, stand_in, usage, a_block_rows, a_block_cols, out_dtype, fast_accum):
    columns = stand_in.shape[0] if usage == "rowwise" else stand_in.shape[1]
    return a_data.new_empty((a_data.shape[0], columns), dtype=out_dtype)
