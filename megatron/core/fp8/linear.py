"""Fp8Linear: y = x W^T + b with all three GEMMs in FP8 (FP8_NUMERICS.md, "Which copy each
GEMM reads"; E5M2 gradients under "hybrid", so no GEMM is E5M2 x E5M2).

Backward saves quantized bytes, never the high-precision input (but `activation_input`, kept
by the caller). The weight is an nn.Parameter quantized every forward, or (`quantized_model_init`)
a QuantizedTensor whose bytes the optimizer / FSDP engine rewrites. Backend: `backend_for`'s;
settings: the module's `fp8_setup`; torch.compile: `compile.py`. The weight gradient reaches
autograd in the weight's dtype (AccumulateGrad into `weight.grad`: the engine's hook takes it).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core.fp8 import autocast as fp8_state
from megatron.core.fp8.compile import (
    backward_one,
    deliver_stand_in_grad,
    forward_outside_the_graph,
    register_stand_in,
    stand_in_gemm,
    stand_in_owner,
)
from megatron.core.fp8.config import Fp8Config
from megatron.core.fp8.formats import ROLES, fp8_dtype_for_role
from megatron.core.fp8.main_grad import has_main_grad_sink, stand_in_backward_gemms, write_wgrad
from megatron.core.fp8.param_init import current_quantized_init, quantize_weight_for_init
from megatron.core.fp8.quantization import backend_for
from megatron.core.fp8.quantized_tensor import QuantizedTensor
from megatron.core.fp8.recipe import RecipeSpec
from megatron.core.fp8.stats import fp8_stats_vector


@dataclass
class _Plan:
    """Everything the autograd function needs besides tensors, fixed at forward time."""

    config: Fp8Config
    scales: dict[str, torch.Tensor | None]
    metas: dict[str, fp8_state.ScalingMeta] | None
    record: bool
    group: object
    setup: fp8_state.Fp8Setup | None = None
    """Where delayed forward amaxes wait for their flush outside an autocast (apply_fp8_setup)."""
    backward_flush: fp8_state.BackwardFlush | None = None
    """Delayed only: where the grad meta waits for the backward's flush (the setup's, or the
    module's own outside any setup)."""
    stand_in: bool = False
    """The weight argument is an FP8 parameter's stand-in (compiled graphs, see
    `Fp8Linear.refresh_weight_stand_in`): its GEMMs go through megatron_fp8::fp8_weight_gemm."""
    bookkept_outside: bool = False
    """Delayed scaling's amax bookkeeping (flush scheduling) is done by prepare_for_compile's
    hooks, eagerly around the compiled forward; this call only records amaxes in its ops."""
    activation: Callable[[torch.Tensor], torch.Tensor] | None = None
    """The input is activation(source) (`Fp8Linear.forward`'s `activation_input`): wgrad's
    copy of it is quantized in backward from the recomputed input, not saved from forward."""
    stats: Callable[[str, torch.Tensor, int], None] | None = None
    """`Fp8Linear.fp8_stats_sink` bound to the module, on a statistics step (not a recompute)."""
    quantizer: Callable | None = None
    """(ops, t2d, role, rowwise, transposed, compute_dtype) -> operands, None: the backend's;
    wgrad_input: (ops, saved, compute_dtype) -> wgrad's input operand from what it saved."""
    wgrad_input: Callable | None = None
    fused_wgrad: bool = False  # the weight has a main_grad_sink: main_grad.write_wgrad

    @property
    def recipe(self) -> str:
        return self.config.recipe

    @property
    def spec(self) -> RecipeSpec:
        return self.config.spec

    def dtype(self, role: str) -> torch.dtype:
        return fp8_dtype_for_role(self.config.fp8_format, role)


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, plan: _Plan, source):  # noqa: D102
        ctx.plan = plan
        ctx.saved_source = source if weight.requires_grad else None
        ctx.x_shape, ctx.x_dtype, ctx.has_bias = x.shape, x.dtype, bias is not None
        ctx.bias_dtype, ctx.w_dtype = (bias.dtype if bias is not None else None), weight.dtype
        ctx.ops = backend_for(x)
        y2d = _forward(ctx, x, weight, plan)
        if bias is not None:
            y2d = y2d + bias.to(y2d.dtype)
        return y2d.reshape(*x.shape[:-1], y2d.shape[-1])

    @staticmethod
    def backward(ctx, dy):  # noqa: D102
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dy2d = dy.reshape(-1, dy.shape[-1])
        dx2d, dw = _backward(ctx, dy2d, need_dgrad=need_dgrad, need_wgrad=need_wgrad)
        dx = dx2d.reshape(ctx.x_shape) if dx2d is not None else None
        dbias = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            dbias = dy2d.to(torch.float32).sum(dim=0).to(ctx.bias_dtype)
        ctx.saved_weight = ctx.saved_input = ctx.saved_source = None
        return dx, dw, dbias, None, None


def _quantize_operands(
    ops, t2d, plan: _Plan, *, role, rowwise, transposed, record, compute_dtype, saved=None
):
    """One quantization of `t2d`: the operands `role`'s GEMMs read (module docstring table).
    `saved`: whether the transposed operand is kept for backward (default: an input's or a
    weight's is; the backend may then keep it in a smaller form)."""
    found = plan.quantizer and plan.quantizer(ops, t2d, role, rowwise, transposed, compute_dtype)
    if found:
        return found
    meta = plan.metas[role] if plan.metas is not None else None
    return ops.quantize_operands(
        t2d,
        recipe=plan.recipe,
        fp8_dtype=plan.dtype(role),
        role=role,
        rowwise=rowwise,
        transposed=transposed,
        power_2_scale=_pow2(plan),
        scale=plan.scales.get(role),
        amax_history=meta.amax_history if (record and meta is not None) else None,
        dequant_dtype=compute_dtype,
        saved=saved,
    )


def _record_stats(plan: _Plan, role: str, t: torch.Tensor) -> None:
    """--log-fp8-stats: the operand's `fp8_stats_vector` under the scale it quantizes with."""
    if plan.stats is not None:
        args = dict(recipe=plan.recipe, role=role, fp8_format=plan.config.fp8_format)
        vector = fp8_stats_vector(t, **args, scale=plan.scales.get(role), power_2_scale=_pow2(plan))
        plan.stats(role, vector, t.numel())


def _pow2(plan: _Plan) -> bool:
    # delayed: False, mxfp8: True (their fixed rules), else the configured rounding.
    return plan.spec.resolve_power_2_scale(plan.config.quantize_power_2_scale)


def _forward(ctx, x, weight, plan: _Plan) -> torch.Tensor:
    """One quantization per operand, no host sync; delayed amaxes recorded as they quantize."""
    ops = ctx.ops
    compute_dtype = ops.emulation_dtype(x.dtype)
    need_wgrad, need_dgrad = weight.requires_grad, x.requires_grad
    _record_stats(plan, "input", x)
    x_row, x_t = _quantize_operands(
        ops,
        x.reshape(-1, x.shape[-1]),
        plan,
        role="input",
        rowwise=True,
        # Recomputed in backward from the activation's input when that is kept instead.
        transposed=need_wgrad and ctx.saved_source is None,
        record=plan.record,
        compute_dtype=compute_dtype,
    )
    fp8_weight = plan.stand_in or isinstance(weight, QuantizedTensor)
    w_row = None
    if plan.stand_in:
        ctx.saved_weight = weight  # megatron_fp8::fp8_weight_gemm reads the weight's bytes
    elif fp8_weight:
        w_row = ops.weight_operand(weight, "rowwise", compute_dtype=compute_dtype)
        ctx.saved_weight = weight  # re-read in backward, after FSDP re-points its bytes
    else:
        _record_stats(plan, "weight", weight.detach())
        # Quantized once per forward; the transposed copy is kept for dgrad.
        w_row, w_t = _quantize_operands(
            ops,
            weight.detach(),
            plan,
            role="weight",
            rowwise=True,
            transposed=need_dgrad,
            record=plan.record,
            compute_dtype=compute_dtype,
        )
        ctx.saved_weight = w_t
    if plan.record and not plan.bookkept_outside:
        fp8_state.forward_recorded(plan.metas["input"], plan.setup)
        if not fp8_weight:
            fp8_state.forward_recorded(plan.metas["weight"], plan.setup)
    ctx.saved_input = x_t
    ctx.compute_dtype = compute_dtype
    fast = plan.spec.fast_accumulation
    if w_row is None:
        return stand_in_gemm(x_row, weight, "rowwise", x.dtype, fast)
    return ops.gemm(x_row, w_row, recipe=plan.recipe, out_dtype=x.dtype, fast_accum=fast)


def _backward(ctx, dy2d, *, need_dgrad, need_wgrad):
    ops = ctx.ops
    plan: _Plan = ctx.plan
    record = plan.metas is not None
    _record_stats(plan, "grad", dy2d)
    dy_row, dy_t = _quantize_operands(
        ops,
        dy2d,
        plan,
        role="grad",
        rowwise=need_dgrad,
        transposed=need_wgrad,
        record=record,
        compute_dtype=ctx.compute_dtype,
    )
    if record and not plan.bookkept_outside:
        # Recorded even for a recomputed graph (reentrant checkpoint): its backward is real.
        plan.backward_flush.record(plan.metas["grad"], plan.group)
    dx2d = dw = None
    fused = need_wgrad and plan.fused_wgrad and (need_dgrad or not plan.stand_in)
    if need_dgrad and plan.stand_in and not fused:
        dx2d = stand_in_gemm(dy_row, ctx.saved_weight, "columnwise", ctx.x_dtype, False)
    elif need_dgrad and not plan.stand_in:
        w_t = ctx.saved_weight
        if isinstance(w_t, QuantizedTensor):
            w_t = ops.weight_operand(w_t, "columnwise", compute_dtype=ctx.compute_dtype)
        dx2d = ops.gemm(dy_row, w_t, recipe=plan.recipe, out_dtype=ctx.x_dtype, fast_accum=False)
    if need_wgrad:
        x_t = ctx.saved_input
        if ctx.saved_source is not None:
            x_t = _recomputed_input_operand(ops, ctx, plan, dy2d)
        elif plan.wgrad_input is not None:
            x_t = plan.wgrad_input(ops, x_t, ctx.compute_dtype)
        if fused and plan.stand_in:  # dgrad and the wgrad write in one op (main_grad.py)
            dx2d = stand_in_backward_gemms(dy_row, dy_t, x_t, ctx.saved_weight, ctx.x_dtype)
        elif fused:
            write_wgrad(ctx.saved_weight, dy_t, x_t, ops)
        else:
            dw = ops.gemm(dy_t, x_t, recipe=plan.recipe, out_dtype=ctx.w_dtype, fast_accum=False)
    return dx2d, dw


def _recomputed_input_operand(ops, ctx, plan: _Plan, dy2d: torch.Tensor):
    """wgrad's operand of the input, quantized now from activation(source): the bytes the
    forward would have saved (the same elementwise code on the same values, the forward's scale:
    delayed's captured in `plan` with no second record, tensorwise's same amax).

    Compiled, AOTAutograd's partitioner would compute this in the forward (nothing in it depends
    on a grad) and keep the FP8 bytes after all: multiplying the source by the 1.0 that
    megatron_fp8::backward_one makes from the grad ties it to the backward (x * 1.0 == x
    bitwise, NaN and signed zeros included; it fuses into the activation's kernel)."""
    source = ctx.saved_source
    if torch.compiler.is_compiling():
        source = source * backward_one(dy2d)
    x = plan.activation(source)
    _, x_t = _quantize_operands(
        ops,
        x.reshape(-1, x.shape[-1]),
        plan,
        role="input",
        rowwise=False,
        transposed=True,
        record=False,
        compute_dtype=ctx.compute_dtype,
        saved=False,  # read at once by wgrad's GEMM
    )
    return x_t


def build_plan(
    config: Fp8Config,
    delayed_scaling: fp8_state.DelayedScaling | None,
    *,
    recompute: bool,
    group,
    device: torch.device,
) -> _Plan:
    """The plan of one FP8 Linear call under `config`; delayed: its scales from
    `delayed_scaling` (a recompute reuses the first forward's and records nothing)."""
    if not config.spec.delayed:
        return _Plan(config=config, scales={}, metas=None, record=False, group=group)
    if delayed_scaling is None:
        raise ValueError(
            "fp8_autocast asks for recipe 'delayed' but this FP8 layer was built for another "
            "recipe; build the model with the same Fp8Config"
        )
    delayed_scaling.move_to(device)
    metas = delayed_scaling.metas
    if recompute:
        # Same scales as the first forward (saved below), and no second amax record.
        scales = {role: metas[role].forward_scale for role in ("input", "weight")}
    else:
        # Flushes replace scale tensors instead of writing them: no copy is needed.
        scales = {role: metas[role].scale for role in ("input", "weight")}
        for role in ("input", "weight"):
            metas[role].forward_scale = scales[role]
    scales["grad"] = metas["grad"].scale
    return _Plan(config=config, scales=scales, metas=metas, record=not recompute, group=group)


def fp8_linear_apply(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: _Plan
) -> torch.Tensor:
    """y = x W^T + b with all three GEMMs in FP8 under `plan` (the one autograd function of
    every FP8 Linear: Fp8Linear's, and each expert of a stacked expert weight)."""
    return _Fp8LinearFunction.apply(x, weight, bias, plan, None)


class Fp8Linear(nn.Module):
    """y = x W^T + b with FP8 GEMMs; `.weight` is [out, in], `.bias` is [out] or None."""

    bias_in_gemm = True  # False: a subclass adds the bias itself (row-parallel: after the sum)
    fp8_quantizer = fp8_wgrad_input = None  # a subclass's `_Plan.quantizer`, `.wgrad_input` (TP)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        fp8_config: Fp8Config,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"Fp8Linear needs positive sizes, got {in_features}x{out_features}")
        self.in_features, self.out_features = in_features, out_features
        self.fp8_config = fp8_config
        factory = dict(device=device, dtype=dtype)
        weight = torch.empty(out_features, in_features, **factory)
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        self._init_like_nn_linear(weight)
        self.delayed_scaling = None
        self._weight_stand_in: torch.Tensor | None = None
        # prepare_for_compile's pre-forward hook: whether the next forward recomputes; else None.
        self._hooked_recompute: bool | None = None
        self._flush_after_forward: list = []
        self._weight_stand_in_spec: RecipeSpec | None = None
        self.fp8_setup: fp8_state.Fp8Setup | None = None
        """This module's settings (`apply_fp8_setup`, `fp8_autocast`); None: its own config."""
        self.fp8_stats_on = False
        """--log-fp8-stats: an eager forward (and its backward) hands each operand's statistics
        to `fp8_stats_sink(module, role, vector, numel)` (compiled callers: set_stance)."""
        self.fp8_stats_sink: Callable | None = None
        if fp8_config.spec.delayed:
            dtypes = {r: fp8_dtype_for_role(fp8_config.fp8_format, r) for r in ROLES}
            self.delayed_scaling = fp8_state.DelayedScaling(
                config=fp8_config, dtypes=dtypes, device=weight.device
            )
        init = current_quantized_init()
        if init is not None:
            scale = self.delayed_scaling.metas["weight"].scale if self.delayed_scaling else None
            self.weight = quantize_weight_for_init(
                weight, config=fp8_config, init=init, scale=scale
            )
        else:
            self.weight = nn.Parameter(weight)

    def _init_like_nn_linear(self, weight: torch.Tensor) -> None:
        # nn.Linear's reset_parameters: kaiming_uniform(a=sqrt(5)) and U(+-1/sqrt(fan_in)) bias.
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1.0 / math.sqrt(self.in_features)
            nn.init.uniform_(self.bias, -bound, bound)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, recipe={self.fp8_config.recipe}, "
            f"fp8_format={self.fp8_config.fp8_format}, "
            f"fp8_weight={isinstance(self.weight, QuantizedTensor)}"
        )

    def refresh_weight_stand_in(self) -> None:
        """Give an FP8 parameter its stand-in for compiled graphs (a new one when the weight's
        shape, dtype, device or requires_grad changed); none for other weights. A QuantizedTensor
        cannot enter a compiled graph, so the graph takes a zero-stride leaf tensor of its shape and
        dtype; megatron_fp8::fp8_weight_gemm finds the weight through it when it runs (after the
        FSDP engine gathered its bytes), and the stand-in's post-accumulate-grad hook passes its
        wgrad on to the weight. Runs eagerly, from `prepare_for_compile`, before each forward."""
        weight = self.weight
        self._fused_wgrad = has_main_grad_sink(weight)  # plan.fused_wgrad of a stand-in forward
        if not isinstance(weight, QuantizedTensor) or weight.device.type == "meta":
            self._weight_stand_in = self._weight_stand_in_spec = None
            return
        current = self._weight_stand_in
        if (
            current is not None
            and stand_in_owner(current) is self
            and (current.shape, current.dtype, current.device, current.requires_grad)
            == (weight.shape, weight.dtype, weight.device, weight.requires_grad)
        ):
            return
        stand_in = torch.empty_strided(
            weight.shape, (0,) * weight.dim(), dtype=weight.dtype, device=weight.device
        )
        if weight.requires_grad:
            stand_in.requires_grad_()
            stand_in.register_post_accumulate_grad_hook(deliver_stand_in_grad)
        register_stand_in(stand_in, self)
        self._weight_stand_in, self._weight_stand_in_spec = stand_in, weight.spec

    def _current_settings(self) -> tuple[bool, Fp8Config, object, object]:
        """(enabled, config, amax group, setup) of a forward now: the model setup's
        (`apply_fp8_setup`, or an `fp8_autocast` block's), else this module's config, ungrouped."""
        setup = self.fp8_setup
        if setup is not None:
            return setup.enabled, setup.fp8_config or self.fp8_config, setup.group, setup
        return True, self.fp8_config, None, None

    def before_compiled_forward(self, device: torch.device | None = None) -> None:
        """Eager bookkeeping for the next forward (`prepare_for_compile`'s pre-forward hook,
        `device` the unit's input's): refresh the weight stand-in, ask whether this forward is a
        recompute and, for delayed scaling, move its state to `device` and schedule the Python side
        effects a compiled graph cannot run (the forward flush of the input (and weight) metas, the
        grad meta's place in the next backward flush). The move must happen here: traced, a grad
        history made by the forward and written by the backward does not compile (AOTAutograd's
        partitioner: a forward output that depends on the backward)."""
        self.refresh_weight_stand_in()
        if self.delayed_scaling is not None and device is not None:
            self.delayed_scaling.move_to(device)
        recompute = fp8_state.in_recompute()
        self._hooked_recompute = recompute
        enabled, config, group, setup = self._current_settings()
        if recompute or not enabled or not config.spec.delayed or self.delayed_scaling is None:
            return
        metas = self.delayed_scaling.metas
        roles = ("input",) if isinstance(self.weight, QuantizedTensor) else ("input", "weight")
        if setup is not None:
            for role in roles:  # flushed when the model's forward (or fp8_autocast block) ends
                fp8_state.forward_recorded(metas[role], setup)
        else:
            self._flush_after_forward = [metas[role] for role in roles]
        if torch.is_grad_enabled():
            self._backward_flush(setup).expect(metas["grad"], group)

    def _backward_flush(self, setup) -> fp8_state.BackwardFlush:
        return setup.backward if setup is not None else self.delayed_scaling.backward

    def after_compiled_forward(self) -> fp8_state.BackwardFlush | None:
        """The post-forward half: flush outside an autocast (as an eager forward would) and
        forget the hooked state; the backward flush to queue when the backward reaches the
        unit, None when no backward flush is expected."""
        if self._flush_after_forward:
            fp8_state.reduce_and_update(self._flush_after_forward, None)
            self._flush_after_forward = []
        expects = (
            self._hooked_recompute is False
            and self.delayed_scaling is not None
            and torch.is_grad_enabled()
        )
        self._hooked_recompute = None
        return self._backward_flush(self.fp8_setup) if expects else None

    def forward(
        self,
        x: torch.Tensor,
        *,
        activation_input: torch.Tensor | None = None,
        activation: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """y = x W^T + b. With `activation_input` (a tensor the caller keeps for its own
        backward, e.g. fc1's output kept by SwiGLU's) and x == activation(activation_input),
        backward recomputes x from it for the wgrad GEMM instead of keeping an FP8 copy of x
        from forward: one quantization moves from forward to backward, and x's saved bytes
        are gone. `activation` must be elementwise code that recomputes x bitwise."""
        if (activation_input is None) != (activation is None):
            raise ValueError("Fp8Linear: pass activation_input and activation together")
        source = (activation_input, activation) if activation is not None else None
        if isinstance(self.weight, QuantizedTensor) and torch.compiler.is_compiling():
            stand_in = self._weight_stand_in
            if stand_in is not None:
                return self._forward(x, stand_in=stand_in, source=source)
            # No stand-in (not prepared for compile): the whole forward in one eager call,
            # one graph break per Linear rather than one more for in_recompute.
            return forward_outside_the_graph(self, x)
        return self._forward(x, source=source)

    def _forward(
        self,
        x: torch.Tensor,
        *,
        stand_in: torch.Tensor | None = None,
        source: tuple[torch.Tensor, Callable] | None = None,
    ) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"Fp8Linear expects input [..., {self.in_features}], got {tuple(x.shape)}"
            )
        hooked = self._hooked_recompute is not None
        if hooked:
            # prepare_for_compile's hook asked the engine (a graph break if asked here) and
            # scheduled the delayed-scaling flushes.
            recompute = self._hooked_recompute
        elif torch.compiler.is_compiling() and not self.fp8_config.spec.delayed:
            # Reading the autograd engine's task id is a graph break; these recipes keep no
            # scale state, so a recompute runs as the first forward did.
            recompute = False
        else:
            recompute = fp8_state.in_recompute()
        enabled, config, group, setup = self._current_settings()
        if not enabled:
            if stand_in is not None:  # the dequantized weight is computed outside the graph
                return forward_outside_the_graph(self, x)
            # A QuantizedTensor weight dequantizes through __torch_dispatch__; grads still flow.
            bias = None if self.bias is None or not self.bias_in_gemm else self.bias.to(x.dtype)
            return F.linear(x, self.weight.to(x.dtype), bias)
        weight_spec = (
            self._weight_stand_in_spec
            if stand_in is not None
            else self.weight.spec
            if isinstance(self.weight, QuantizedTensor)
            else None
        )
        if weight_spec is not None and weight_spec != config.spec:
            raise ValueError(
                f"FP8 weight was quantized with recipe '{weight_spec.name}' but autocast asks "
                f"for '{config.recipe}'; build the model under the same recipe"
            )
        plan = build_plan(
            config, self.delayed_scaling, recompute=recompute, group=group, device=x.device
        )
        plan.bookkept_outside, plan.setup = hooked, setup
        plan.quantizer, plan.wgrad_input = self.fp8_quantizer, self.fp8_wgrad_input
        if self.fp8_stats_on and not recompute and not torch.compiler.is_compiling():
            plan.stats = functools.partial(self.fp8_stats_sink, self)
        if plan.metas is not None:
            plan.backward_flush = self._backward_flush(setup)
        activation_input, plan.activation = source if source is not None else (None, None)
        plan.stand_in = stand_in is not None
        plan.fused_wgrad = self._fused_wgrad if plan.stand_in else has_main_grad_sink(self.weight)
        weight = self.weight if stand_in is None else stand_in
        bias = self.bias if self.bias_in_gemm else None
        return _Fp8LinearFunction.apply(x, weight, bias, plan, activation_input)


def apply_fp8_setup(
    model: nn.Module,
    *,
    fp8_config: Fp8Config | None,
    amax_reduction_group=None,
    expert_amax_reduction_group=None,
) -> fp8_state.Fp8Setup:
    """The FP8 step of the model-setup seam: every Fp8Linear of `model` runs with `fp8_config`
    (None: each its own) and shares delayed-scaling amaxes over `amax_reduction_group`, with
    no fp8_autocast around the model call. Delayed scaling's forward amaxes are flushed when
    the model's forward ends (one packed all-reduce); its backward flush is unchanged. An
    `fp8_autocast` block replaces these settings while it runs.

    Routed experts (`Fp8StackedLinear`, marked `fp8_expert_weights`) share theirs over
    `expert_amax_reduction_group`, the ranks holding the same experts (the expert-data-parallel
    group; default: `amax_reduction_group`), in a setup of their own."""
    setup = fp8_state.Fp8Setup(fp8_config=fp8_config, group=amax_reduction_group)
    expert_group = expert_amax_reduction_group or amax_reduction_group
    expert_setup = fp8_state.Fp8Setup(fp8_config=fp8_config, group=expert_group)
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.fp8_setup = setup
        elif getattr(module, "fp8_expert_weights", False):
            module.fp8_setup = expert_setup

    def flush(module: nn.Module, args, output) -> None:
        setup.flush()
        expert_setup.flush()

    model.register_forward_hook(flush)
    return setup
