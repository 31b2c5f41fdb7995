"""Fp8StackedLinear: the routed experts' stacked weight [num_experts, out, in] (one Linear per
expert) with every expert GEMM of forward and backward in FP8 (FP8_NUMERICS.md, "Experts").

Each expert is quantized as the recipe quantizes one Linear weight: its own tensorwise scale,
its own delayed-scaling state (input, weight and grad metas), its own 128x128 blocks or 1x32 /
32x1 mxfp8 cells. Each call of an expert runs `megatron.core.fp8.linear.fp8_linear_apply`, the
autograd function of Fp8Linear, on `weight[e]`: one rule set for dense and expert GEMMs, and
the weight gradient lands in the stacked parameter's rows through autograd.

Segments: an expert's rows may come from several source ranks (expert parallelism). Each
segment (the rows of one expert from one source rank) is quantized and multiplied on its own,
so the bytes every GEMM reads do not depend on how tokens are grouped across ranks: the
expert-parallel layout changes only the order of fp32 sums (acceptance 1 of issue 38).

`grouped_fp8_gemm` is a loop over segments through Fp8Linear's autograd function (every recipe;
the reference). Where `grouped_fp8.grouped_path_applies` (every recipe; mxfp8 by shape), the
forward takes `grouped_fp8.grouped_fp8_linear` instead: the same rule in one autograd function
over all experts, one quantize pass per operand and grouped GEMMs on CUDA (delayed with
`DelayedExperts`, eagerly, under `schedule_expert_flushes`' rule; mxfp8 through
`grouped_mxfp8`, eagerly, where each expert's 32x1 cells are its own).

FP8 parameters (--fp8-param-gather): Megatron-FSDP keeps the stacked weight as a
QuantizedTensor [num_experts, out, in] whose scales have one leading dim per expert
(`megatron.core.distributed.fsdp.fp8_matrices`). Each expert GEMM reads expert e's bytes and
scales as they are (no re-quantization): the grouped function reads the stacked bytes and
scales directly; the segment loop reads them through `ExpertWeight`, and `_ExpertWeights`
stacks their wgrads into the parameter's grad (zeros for experts without tokens), as the
grouped function's weight gradient is.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core.fp8 import autocast as fp8_state
from megatron.core.fp8.config import Fp8Config
from megatron.core.fp8.formats import ROLES, fp8_dtype_for_role
from megatron.core.fp8.linear import Fp8Linear, build_plan, fp8_linear_apply
from megatron.core.fp8.quantized_tensor import QuantizedTensor
from megatron.core.fp8.stats import fp8_stats_vector
from megatron.core.numerics import amax_ignoring_nan
from megatron.core.transformer.moe import grouped_operands as operands
from megatron.core.transformer.moe.grouped_fp8 import grouped_fp8_linear, grouped_path_applies


class ExpertDelayedScaling:
    """Delayed-scaling state of a stacked expert weight: one `DelayedScaling` per expert and
    one backward flush for all of them. Checkpoints see flat keys `expert<g>.<role>.<what>` and
    `metas` keys `<role>.<g>`, g the GLOBAL expert index (first_expert + the local one), so
    the states of every expert-parallel rank are distinct entries and a run of another
    expert-parallel size finds its experts' states."""

    def __init__(
        self, *, num_experts: int, config: Fp8Config, device=None, first_expert: int = 0
    ) -> None:
        dtypes = {role: fp8_dtype_for_role(config.fp8_format, role) for role in ROLES}
        self.experts = [
            fp8_state.DelayedScaling(config=config, dtypes=dtypes, device=device)
            for _ in range(num_experts)
        ]
        self.first_expert = first_expert
        self.backward = fp8_state.BackwardFlush()  # used outside any Fp8Setup
        for scaling in self.experts:
            scaling.backward = self.backward

    @property
    def metas(self) -> dict[str, fp8_state.ScalingMeta]:
        """Every expert's metas, keyed `<role>.<g>` (materializing meta-device state)."""
        return {
            f"{role}.{self.first_expert + e}": meta
            for e, scaling in enumerate(self.experts)
            for role, meta in scaling.metas.items()
        }

    def move_to(self, device: torch.device) -> None:
        for scaling in self.experts:
            scaling.move_to(device)

    def state_dict(self) -> dict:
        state: dict = {}
        for e, scaling in enumerate(self.experts):
            expert_state = scaling.state_dict()
            metadata = expert_state.pop("metadata")
            prefix = f"expert{self.first_expert + e}."
            state.update({prefix + key: value for key, value in expert_state.items()})
        state["metadata"] = metadata
        return state

    def load_state_dict(self, state: dict) -> None:
        for e, scaling in enumerate(self.experts):
            prefix = f"expert{self.first_expert + e}."
            expert_state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            if not expert_state:
                raise ValueError(
                    f"checkpoint has no delayed-scaling state for expert {self.first_expert + e}; "
                    "it was saved with fewer experts, or by a run that lost them"
                )
            scaling.load_state_dict(expert_state)


def schedule_expert_flushes(scaling, *, fp8_param, recompute, setup, group) -> None:
    """Delayed scaling's rule for a stacked expert weight, before either path quantizes: every
    local expert's metas, in expert order, whether or not it has rows in this call. The
    forward metas join the setup's flush (input, and the weight unless an FP8 parameter, whose
    engine records it), the grad metas the next backward flush (when a backward can follow).
    Ranks holding the same experts then pack the same metas in the same order into each
    flush's MAX all-reduce, whatever tokens each got; an expert without rows records amax 0
    (its scale stays, its history rolls). Without a setup each call's forward metas flush when
    it records them (no collective). A recompute changes nothing."""
    if recompute:
        return
    for role in ("input", "weight"):  # role-major: a role's metas are consecutive rows after
        for expert in scaling.experts:  # the flush, which `record_amaxes` writes in one slice
            meta = expert.metas[role]
            meta.forward_scale = meta.scale  # a recompute's forward quantizes at these
            if setup is not None and not (fp8_param and role == "weight"):
                fp8_state.forward_recorded(meta, setup)
    if torch.is_grad_enabled():
        flush = setup.backward if setup is not None else scaling.backward
        for expert in scaling.experts:
            flush.expect(expert.metas["grad"], group)


class DelayedExperts:
    """Delayed scaling of one grouped call (`grouped_fp8.grouped_fp8_linear`), what the
    per-segment path's plans (`linear.build_plan`) give each expert's Fp8Linear, for all
    experts at once: each role's scales stacked ([E]; a recompute's forward those its first
    forward used, `schedule_expert_flushes`), and every expert's amaxes recorded in one
    maximum (an expert without rows: 0)."""

    def __init__(self, scaling, segments, *, recompute, setup, group, device) -> None:
        scaling.move_to(device)
        self.metas = {role: [s.metas[role] for s in scaling.experts] for role in ROLES}
        self.recompute, self.setup, self.group = recompute, setup, group
        self.backward_flush = setup.backward if setup is not None else scaling.backward
        owners = [e for e, counts in enumerate(segments) for _ in counts]
        self.seg_expert = None  # one segment per expert, in order: segments are experts
        if owners != list(range(len(segments))):
            self.seg_expert = operands.on_device(owners, device)
        self.scales = {}
        for role in ROLES:
            metas = self.metas[role]
            use_first = recompute and role != "grad"
            scales = [m.forward_scale if use_first and m.forward_scale is not None else m.scale
                      for m in metas]  # fmt: skip
            self.scales[role] = torch.stack(scales).float()

    def segment_scales(self, role: str) -> torch.Tensor:
        """Each segment's scale ([S]): its expert's."""
        scales = self.scales[role]
        return scales if self.seg_expert is None else scales[self.seg_expert]

    def record(self, role: str, segment_amax: torch.Tensor) -> None:
        """Each segment's amax ([S]) into its expert's meta (the max of its segments')."""
        if self.seg_expert is None:
            return self.record_experts(role, segment_amax)
        experts = segment_amax.new_zeros(len(self.metas[role]))
        experts = experts.scatter_reduce(0, self.seg_expert, segment_amax.float(), "amax")
        return self.record_experts(role, experts)

    def record_experts(self, role: str, amax: torch.Tensor) -> None:
        """Every expert's amax ([E]) into its meta, as its Fp8Linear records it: a forward's
        not in a recompute (without a setup, flushed now), a grad's always, flushed when the
        running backward ends."""
        if role != "grad" and self.recompute:
            return
        fp8_state.record_amaxes(self.metas[role], amax)
        if role == "grad":
            for meta in self.metas["grad"]:
                self.backward_flush.expect(meta, self.group)
            self.backward_flush.queue()
        elif self.setup is None:
            for meta in self.metas[role]:
                fp8_state.forward_recorded(meta, None)


def record_idle_experts(scaling, weight, segments, *, fp8_param, recompute, setup) -> None:
    """The per-segment path's share of `schedule_expert_flushes`' rule for the experts without
    rows, which get no Fp8Linear call: a high-precision weight's amax recorded (the grouped
    path quantizes every expert's weight), and without a setup their forward metas flushed."""
    if recompute:
        return
    for e, counts in enumerate(segments):
        if sum(counts) > 0:
            continue
        metas = scaling.experts[e].metas
        if not fp8_param:
            metas["weight"].record(amax_ignoring_nan(weight[e].detach()))
        if setup is None:
            for role in ("input",) if fp8_param else ("input", "weight"):
                fp8_state.forward_recorded(metas[role], None)


class ExpertWeight(QuantizedTensor):
    """Expert e's [out, in] of a stacked FP8 parameter: bytes and scales read from the stacked
    weight when used, so a backward sees what the engine gathered for it (the mxfp8
    columnwise copy, the transpose of re-gathered bytes), never the forward's pointers."""

    @staticmethod
    def __new__(cls, stacked: QuantizedTensor, expert: int):
        return torch.Tensor._make_wrapper_subclass(
            cls, stacked.shape[1:], dtype=stacked.dtype, device=stacked.device
        )

    def __init__(self, stacked: QuantizedTensor, expert: int) -> None:
        self.stacked, self.expert = stacked, expert
        self.recipe, self.fp8_dtype, self.role = stacked.recipe, stacked.fp8_dtype, stacked.role
        self.tensor_name = f"{stacked.tensor_name}[{expert}]"
        self.amax = None
        self._released = {"rowwise": False, "columnwise": False}
        self._transpose_cache = None

    def _get(self, direction: str) -> torch.Tensor | None:
        data = self.stacked._get(direction)  # raises if the engine released it
        return None if data is None else data[self.expert]

    def has_data(self, direction: str = "rowwise") -> bool:
        return self.stacked.has_data(direction)

    @property
    def _data(self) -> dict[str, torch.Tensor | None]:
        return {d: self._get(d) if self.has_data(d) else None for d in ("rowwise", "columnwise")}

    def _scale(self, direction: str) -> torch.Tensor | None:
        scale = getattr(self.stacked, f"{direction}_scale_inv")
        return None if scale is None else scale[self.expert]

    rowwise_scale_inv = property(lambda self: self._scale("rowwise"))
    columnwise_scale_inv = property(lambda self: self._scale("columnwise"))


class _ExpertWeights(torch.autograd.Function):
    """A stacked FP8 parameter -> one `ExpertWeight` per expert; backward stacks their wgrads
    (zeros for an expert without tokens) into the parameter's grad."""

    @staticmethod
    def forward(ctx, stacked):  # noqa: D102
        ctx.set_materialize_grads(False)
        ctx.shape, ctx.dtype, ctx.device = stacked.shape, stacked.dtype, stacked.device
        return tuple(ExpertWeight(stacked, e) for e in range(stacked.shape[0]))

    @staticmethod
    def backward(ctx, *grads):  # noqa: D102
        zeros = torch.zeros(ctx.shape[1:], dtype=ctx.dtype, device=ctx.device)
        return torch.stack([zeros if grad is None else grad for grad in grads])


def grouped_fp8_gemm(
    tokens: torch.Tensor,
    weight,
    segments: list[list[int]],
    plan_for_expert,
) -> torch.Tensor:
    """y[rows of expert e] = tokens[rows of expert e] @ weight[e]^T, every segment (its list
    of row counts per expert) quantized and multiplied on its own under plan_for_expert(e);
    weight: [E, out, in], or each expert's `ExpertWeight`. The reference of
    `grouped_fp8.grouped_fp8_linear`, and the path of the other recipes (and of FP8 parameters)."""
    sizes = [count for counts in segments for count in counts]
    pieces = iter(tokens.split(sizes, dim=0))
    outputs = []
    for expert, counts in enumerate(segments):
        plan = None
        for count in counts:
            piece = next(pieces)
            if count == 0:
                continue  # nothing to quantize; the expert's weight gets no contribution
            plan = plan or plan_for_expert(expert)
            outputs.append(fp8_linear_apply(piece, weight[expert], None, plan))
    if not outputs:
        return tokens.new_zeros(0, weight[0].shape[0])
    return torch.cat(outputs, dim=0)


def _grouped_with_stats(sink, tokens, weight, segments, config: Fp8Config, delayed=None):
    """`grouped_fp8_linear` under --log-fp8-stats: the tokens and (from a hook) the output's
    gradient per segment (per tensor: each its own scale), a high-precision weight per expert
    (its own scale, or 128x128 cells: each expert's rows padded to whole cells with zeros,
    which never count). delayed (`DelayedExperts`): as the per-segment path counts them."""
    if delayed is not None:
        return _delayed_grouped_with_stats(sink, tokens, weight, segments, config, delayed)
    if isinstance(segments, torch.Tensor):
        sizes = segments.reshape(-1)
    else:
        sizes = torch.tensor([n for counts in segments for n in counts], device=tokens.device)
    args = dict(recipe=config.recipe, fp8_format=config.fp8_format)
    args["power_2_scale"] = config.quantize_power_2_scale
    sink("input", fp8_stats_vector(tokens, role="input", segments=sizes, **args), tokens.numel())
    if not isinstance(weight, QuantizedTensor):  # FP8 parameters: as Fp8Linear, no weight role
        experts, rows, cols = weight.shape
        cell_rows = (config.spec.block_shape("weight", columnwise=False) or (1, cols))[0]
        if cell_rows > 1:
            padded = F.pad(weight.detach(), (0, 0, 0, -rows % cell_rows)).reshape(-1, cols)
            stats = fp8_stats_vector(padded, role="weight", **args)
        else:
            by_expert = torch.full((experts,), rows, device=weight.device)
            stats = fp8_stats_vector(weight.detach(), role="weight", segments=by_expert, **args)
        sink("weight", stats, weight.numel())
    output = grouped_fp8_linear(tokens, weight, segments, config)

    def grad_stats(dy: torch.Tensor) -> None:
        sink("grad", fp8_stats_vector(dy, role="grad", segments=sizes, **args), dy.numel())

    if output.requires_grad:
        output.register_hook(grad_stats)
    return output


def _delayed_grouped_with_stats(sink, tokens, weight, segments, config, delayed):
    """Delayed's statistics on the grouped call: per segment with rows, at its expert's scale,
    as each Fp8Linear call of the per-segment path hands them over (input then weight in
    segment order; the grads from the backward, last segment first)."""
    args = dict(recipe=config.recipe, fp8_format=config.fp8_format, power_2_scale=False)
    pieces = [(e, rows) for e, counts in enumerate(segments) for rows in counts]
    starts = operands.bounds([rows for _, rows in pieces])
    plain_weight = not isinstance(weight, QuantizedTensor)
    for s, (e, rows) in enumerate(pieces):
        if rows == 0:
            continue
        piece = tokens[starts[s] : starts[s + 1]]
        scale = delayed.scales["input"][e]
        sink("input", fp8_stats_vector(piece, role="input", scale=scale, **args), piece.numel())
        if plain_weight:
            w, w_scale = weight[e].detach(), delayed.scales["weight"][e]
            sink("weight", fp8_stats_vector(w, role="weight", scale=w_scale, **args), w.numel())
    grad_scales = delayed.scales["grad"]
    output = grouped_fp8_linear(tokens, weight, segments, config, delayed=delayed)

    def grad_stats(dy: torch.Tensor) -> None:
        for s in reversed(range(len(pieces))):
            e, rows = pieces[s]
            if rows:
                piece = dy[starts[s] : starts[s + 1]]
                vector = fp8_stats_vector(piece, role="grad", scale=grad_scales[e], **args)
                sink("grad", vector, piece.numel())

    if output.requires_grad:
        output.register_hook(grad_stats)
    return output


def _host_counts(config: Fp8Config) -> bool:
    """Recipes whose expert calls run eagerly, on counts read on the host: delayed (its
    scaling state is Python, updated as the experts run) and mxfp8 (`grouped_mxfp8`)."""
    return config.spec.delayed or config.spec.e8m0_scales


@torch._dynamo.disable
def _forward_outside_the_graph(module, tokens, tokens_per_expert, segments) -> torch.Tensor:
    """An Fp8StackedLinear forward run eagerly from a compiled caller (a graph break each
    side): an FP8 parameter on a path that cannot take its stand-in."""
    return module.forward(tokens, tokens_per_expert, segments)


class Fp8StackedLinear(nn.Module):
    """The stacked weight [num_experts, out, in] of one Linear per expert, run in FP8.

    `forward(tokens, tokens_per_expert, segments=None)`: tokens [N, in] sorted by expert;
    segments[e] the row counts of expert e per source rank (None: one segment per expert)."""

    fp8_expert_weights = True
    """`apply_fp8_setup` gives these modules the expert amax reduction group."""

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        *,
        fp8_config: Fp8Config,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
        first_expert: int = 0,
    ) -> None:
        super().__init__()
        self.fp8_config = fp8_config
        self.weight = nn.Parameter(
            torch.empty(num_experts, out_features, in_features, dtype=dtype, device=device)
        )
        self.delayed_scaling = None
        if fp8_config.spec.delayed:
            self.delayed_scaling = ExpertDelayedScaling(
                num_experts=num_experts, config=fp8_config, device=device, first_expert=first_expert
            )
        self.fp8_setup: fp8_state.Fp8Setup | None = None
        """This module's settings (`apply_fp8_setup`, `fp8_autocast`); None: its own config."""
        self.grouped = True
        """Take `grouped_fp8.grouped_fp8_linear` where it applies (False: the per-segment
        reference path, `grouped_fp8_gemm`, as the tests compare them)."""
        self._weight_stand_in: torch.Tensor | None = None
        self._weight_stand_in_spec = None
        self._fused_wgrad = False  # the weight has a main_grad_sink (refresh_weight_stand_in)
        self.fp8_stats_on = False
        """--log-fp8-stats, as Fp8Linear's: an eager forward (and its backward) hands each
        operand's statistics to `fp8_stats_sink(module, role, vector, numel)`: the grouped
        path's over all experts, the per-segment path's one per segment (an expert's weight
        once per segment: at EP > 1 once per source rank)."""
        self.fp8_stats_sink = None

    refresh_weight_stand_in = Fp8Linear.refresh_weight_stand_in
    """An FP8 parameter's stand-in for compiled graphs, made and registered as Fp8Linear's
    (`fp8.compile`): the grouped function reads the weight through it
    (megatron_fp8::grouped_fp8_weight_mm) and its grad reaches the parameter."""

    def before_compiled_forward(self, device: torch.device | None = None) -> None:
        """`prepare_for_compile`'s eager step before each compiled forward: the stand-in."""
        self.refresh_weight_stand_in()

    def after_compiled_forward(self) -> None:
        """Nothing to flush after a compiled forward (`prepare_for_compile`): the grouped
        function keeps no scaling state, and other paths run outside the graph."""
        return None

    def takes_device_counts(self, tokens: torch.Tensor) -> bool:
        """Whether this call takes `grouped_fp8_linear` (an FP8 parameter in a compiled graph:
        through its stand-in), which reads the token counts on the device: `GroupedExperts`
        hands them over there where both Linears take them."""
        enabled, config, _, _ = self._current_settings()
        weight = self.weight
        if isinstance(weight, QuantizedTensor) and torch.compiler.is_compiling():
            weight = self._weight_stand_in
            if weight is None or self._weight_stand_in_spec != config.spec:
                return False
        grouped = enabled and self.grouped and tokens.shape[0] > 0
        return grouped and not _host_counts(config) and grouped_path_applies(config, weight)

    def _compiled_fp8_param_forward(self, tokens, tokens_per_expert, segments) -> torch.Tensor:
        """An FP8 parameter in a compiled graph: its stand-in through the grouped function
        (no graph break), else the whole forward eagerly (a QuantizedTensor is not traceable)."""
        if self.takes_device_counts(tokens):
            config = self._current_settings()[1]
            stand_in = self._weight_stand_in
            fused = self._fused_wgrad
            return grouped_fp8_linear(
                tokens, stand_in, segments, config, stand_in=True, fused_wgrad=fused
            )
        return _forward_outside_the_graph(self, tokens, tokens_per_expert, segments)

    def extra_repr(self) -> str:
        experts, out_features, in_features = self.weight.shape
        return (
            f"num_experts={experts}, in_features={in_features}, out_features={out_features}, "
            f"recipe={self.fp8_config.recipe}, fp8_format={self.fp8_config.fp8_format}"
        )

    def _current_settings(self) -> tuple[bool, Fp8Config, object, object]:
        setup = self.fp8_setup
        if setup is not None:
            return setup.enabled, setup.fp8_config or self.fp8_config, setup.group, setup
        return True, self.fp8_config, None, None

    def forward(
        self,
        tokens: torch.Tensor,
        tokens_per_expert: list[int] | torch.Tensor,
        segments: list[list[int]] | None = None,
    ) -> torch.Tensor:
        """tokens_per_expert: a list, or the counts on the tokens' device (one segment per
        expert), which the grouped function reads there (no host sync); other paths read them
        on the host."""
        enabled, config, group, setup = self._current_settings()
        if torch.compiler.is_compiling() and enabled and _host_counts(config):
            return _forward_outside_the_graph(self, tokens, tokens_per_expert, segments)
        if isinstance(tokens_per_expert, torch.Tensor):
            if segments is None and self.takes_device_counts(tokens):
                segments = tokens_per_expert
            else:
                tokens_per_expert = tokens_per_expert.tolist()
        if segments is None:
            segments = [[count] for count in tokens_per_expert]
        on_device = isinstance(segments, torch.Tensor)
        if not on_device and [sum(counts) for counts in segments] != list(tokens_per_expert):
            raise ValueError("Fp8StackedLinear: segments must sum to tokens_per_expert")
        if isinstance(self.weight, QuantizedTensor) and torch.compiler.is_compiling():
            return self._compiled_fp8_param_forward(tokens, tokens_per_expert, segments)
        weight = self.weight
        fp8_param = isinstance(weight, QuantizedTensor)  # an FP8 parameter of Megatron-FSDP
        if fp8_param and weight.spec != config.spec:
            raise ValueError(
                f"FP8 expert weight was quantized with recipe '{weight.recipe}' but "
                f"autocast asks for '{config.recipe}'; build the model under the same recipe"
            )
        stats = None  # a statistics step runs eagerly; a recompute is not counted twice
        if enabled and self.fp8_stats_on and not torch.compiler.is_compiling():
            if not fp8_state.in_recompute():
                stats = functools.partial(self.fp8_stats_sink, self)
        if not enabled:
            pieces = tokens.split(list(tokens_per_expert), dim=0)
            outputs = [F.linear(piece, weight[e].to(piece.dtype)) for e, piece in enumerate(pieces)]
            if not outputs:
                return tokens.new_zeros(0, self.weight.shape[1])
            return torch.cat(outputs, dim=0)
        delayed = None
        if config.spec.delayed:  # both paths: every expert's metas, this call's rows or not
            where = dict(recompute=fp8_state.in_recompute(), setup=setup, group=group)
            scaling = self._delayed_scaling(config, where, tokens.device)
            schedule_expert_flushes(scaling, fp8_param=fp8_param, **where)
        if self.grouped and tokens.shape[0] > 0 and grouped_path_applies(config, weight):
            if config.spec.delayed:
                delayed = DelayedExperts(scaling, segments, device=tokens.device, **where)
            if stats is not None:
                return _grouped_with_stats(stats, tokens, weight, segments, config, delayed)
            return grouped_fp8_linear(tokens, weight, segments, config, delayed=delayed)
        if fp8_param:
            weight = _ExpertWeights.apply(weight)
        recompute = fp8_state.in_recompute()

        def plan_for_expert(expert: int):
            scaling = None if self.delayed_scaling is None else self.delayed_scaling.experts[expert]
            plan = build_plan(
                config, scaling, recompute=recompute, group=group, device=tokens.device
            )
            plan.setup, plan.stats = setup, stats
            if plan.metas is not None:
                plan.backward_flush = setup.backward if setup is not None else scaling.backward
            return plan

        output = grouped_fp8_gemm(tokens, weight, segments, plan_for_expert)
        if config.spec.delayed:
            options = dict(fp8_param=fp8_param, recompute=recompute, setup=setup)
            record_idle_experts(scaling, self.weight, segments, **options)
        return output

    def _delayed_scaling(self, config: Fp8Config, where: dict, device) -> ExpertDelayedScaling:
        """This layer's delayed-scaling state; a layer built for another recipe fails with
        `build_plan`'s message."""
        if self.delayed_scaling is None:
            build_plan(
                config, None, recompute=where["recompute"], group=where["group"], device=device
            )
        return self.delayed_scaling
