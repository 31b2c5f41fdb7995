"""The distributed optimizer: Adam(W)/SGD over this rank's fp32 main-param shards.

Each optimizer "parameter" is one LocalPiece: the part of one model parameter inside this rank's
shard (a view of the main-shard buffer, its grad a view of the grad shard), so updates land in
the buffers with no copies. Pieces of weights are viewed as [1, n] so that the decay/no-decay
rule (`is_no_weight_decay`: ndim < 2 or a bias) sees the owning parameter's rank, not 1-D.

Step: finish the grad reduction; global L2 norm over all ranks' pieces (each element counted
once: pieces are disjoint; under no_shard everything is replicated so the norm is local); skip
on NaN/Inf; clip; step; write main shards back into the compute storage (all-gathering the
replicas for optim/optim_grads).

HSDP: with outer no_shard every replica runs the same update on the same shard (the norm sums
over the shard group only); with outer optim each replica updates only its part of the shard
(`BufferGroup.optimizer_range`; the norm sums over every DP rank) and the updated parts are
all-gathered across replicas before the compute params are written.

Tensor parallelism (`tensor_parallel_grads`): the engine shards each TP rank's local shards
over its DP groups and never sees TP; the step then sums the grads of sequence-parallel
replicated params (norms) over TP, and the grad norm counts each TP shard once and each
replicated param on TP rank 0 only, summed over TP (Megatron-LM's finalize and clip).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing.flat_dtensor import data_parallel_mesh, local_piece
from megatron.core.distributed.fsdp.buffer_group import BufferGroup
from megatron.core.distributed.fsdp.megatron_fsdp import MegatronFSDP
from megatron.core.distributed.fsdp.shard_layout import LocalPiece
from megatron.core.distributed.fsdp.state_dict import (
    FlatValues,
    engine_mesh,
    named_slots,
    set_present,
)
from megatron.core.optimizer import (
    FusedAdamW,
    MegatronOptimizer,
    OffloadedAdamW,
    OptimizerConfig,
    StepResult,
    build_torch_optimizer,
    clip_and_step,
    count_zeros,
    global_grad_norm,
    unscale_grads_,
)
from megatron.core.tensor_parallel import TensorParallelGrads


@dataclass(eq=False)
class ShardPiece:
    """One optimizer parameter: a piece of a model parameter in this rank's main shard."""

    name: str
    piece: LocalPiece
    group: BufferGroup
    main: torch.Tensor
    """The optimizer's parameter tensor: a view of the main shard ([1, n] for weights)."""

    def grad_view(self) -> torch.Tensor:
        lo = self.piece.shard_start
        return self.group.grad_shard()[lo : lo + self.piece.numel].view(self.main.shape)


class FsdpDistributedOptimizer(MegatronOptimizer):
    def __init__(
        self,
        engine: MegatronFSDP,
        *,
        config: OptimizerConfig,
        tensor_parallel_grads: TensorParallelGrads | None = None,
    ) -> None:
        self.engine = engine
        self.config = config
        self.tp_grads = tensor_parallel_grads
        self.pieces: list[ShardPiece] = []
        for group in engine.buffer.all_groups():
            group.ensure_grad_buffer()
            for piece in group.optimizer_pieces():
                flat = group.main_shard[piece.shard_start : piece.shard_start + piece.numel]
                is_matrix = len(piece.slot.shape) >= 2
                main = flat.view(1, -1) if is_matrix else flat
                self.pieces.append(ShardPiece(piece.slot.name, piece, group, main))
        self.pieces_by_group = [
            (group, [p for p in self.pieces if p.group is group])
            for group in engine.buffer.all_groups()
        ]
        """Each buffer group with its pieces, in order (the step asks them for amaxes)."""
        named = [(p.name, p.main) for p in self.pieces]
        # torch optimizers reject an empty parameter list; a rank whose shards hold only padding
        # (tiny models, many ranks) keeps placeholder groups so the LR scheduler still works.
        self.optimizer = build_torch_optimizer(named, config=config) if named else None
        if self.optimizer is not None:
            self.param_groups = self.optimizer.param_groups
            self._init_state()
        else:
            self.param_groups = [{"lr": config.lr, "weight_decay": config.weight_decay}]
        self.replicated = not engine.config.shards_optimizer_state
        # fp64 grad buffers: the norm too is layout-independent (global_grad_norm).
        fp64 = engine.config.main_grads_dtype == torch.float64
        self.norm_dtype = torch.float64 if fp64 else torch.float32
        groups = engine.groups
        # The group over which the ranks' pieces are disjoint and cover the model once: the
        # grad norm sums over it, and optimizer-state checkpoints are sharded over it.
        self.piece_group = None
        if not self.replicated:
            outer_split = groups.outer is not None and engine.config.outer_shards_optimizer
            self.piece_group = groups.full if outer_split else groups.shard

    @torch.no_grad()
    def _init_state(self) -> None:
        """Create optimizer state up front so that a checkpoint template has every key.

        Adam's state comes from the optimizer's init_state (its moments in their dtypes, so
        bf16 moments really hold half the bytes); zero moments with step 0 (and a zero SGD
        momentum buffer) update exactly as the lazily created state would.
        """
        if self.config.optimizer == "adam":
            self.optimizer.init_state()
            return
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                self.optimizer.state[param]["momentum_buffer"] = torch.zeros_like(param)

    def state_bytes(self) -> int:
        """Bytes of optimizer state (moments) this rank holds: its pieces only, no padding."""
        if self.optimizer is None:
            return 0
        return sum(
            value.numel() * value.element_size()
            for state in self.optimizer.state.values()
            for key, value in state.items()
            if key != "step"
        )

    def zero_grad(self) -> None:
        self.engine.zero_grad_buffer()

    def _attach_grads(self) -> list[torch.Tensor]:
        grads = []
        for shard_piece in self.pieces:
            grad = shard_piece.grad_view()
            if grad.dtype != shard_piece.main.dtype:
                grad = grad.to(shard_piece.main.dtype)
            shard_piece.main.grad = grad
            grads.append(grad)
        return grads

    def step(self) -> StepResult:
        self.engine.finish_grad_sync()
        grads = self._attach_grads()
        if self.tp_grads is not None:
            self.tp_grads.sum_partial_grads_(
                [g for p, g in zip(self.pieces, grads) if p.name in self.tp_grads.partial_names]
            )
        if not grads:
            grads = [torch.zeros(1, device=self.engine.buffer.device)]
        unscale_grads_(grads, self.loss_scale)
        grad_norm, zeros = self._norm_and_zeros(grads)
        if not math.isfinite(grad_norm):
            self._detach_grads()
            self.engine.zero_grad_buffer()
            return StepResult(update_successful=False, grad_norm=grad_norm, num_zeros_in_grad=zeros)
        if self.optimizer is not None:
            reports = self._request_amaxes()
            try:
                clip_and_step(
                    self.optimizer, grads, max_norm=self.config.clip_grad, total_norm=grad_norm
                )
            finally:
                self.optimizer.amax_targets = {}
            for storage, amaxes in reports:
                storage.use_optimizer_amaxes(amaxes)
        self._detach_grads()
        self.engine.buffer.gather_outer_main_shards(stats=self.engine.stats)
        self.engine.buffer.write_back_main_params(stats=self.engine.stats)
        return StepResult(update_successful=True, grad_norm=grad_norm, num_zeros_in_grad=zeros)

    def _counted(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Under TP, the tensors of the parameters this rank counts in a norm."""
        if self.tp_grads is None or len(tensors) != len(self.pieces):
            return tensors
        names = self.tp_grads.counted_names
        counted = [t for p, t in zip(self.pieces, tensors) if p.name in names]
        return counted or [torch.zeros(1, device=self.engine.buffer.device)]

    def _norm_and_zeros(self, grads: list[torch.Tensor]) -> tuple[float, int | None]:
        """The global grad norm (and zero count): over the piece group, then over TP."""
        counted = self._counted(grads)
        norm = global_grad_norm(counted, group=self.piece_group, accumulate_dtype=self.norm_dtype)
        zeros = count_zeros(counted, group=self.piece_group) if self.count_zeros_in_grad else None
        if self.tp_grads is not None:
            device = self.engine.buffer.device
            norm = self.tp_grads.norm_over_group(norm, device)
            if zeros is not None:
                zeros = int(self.tp_grads.sum_over_group(zeros, device))
        return norm, zeros

    def _request_amaxes(self) -> list[tuple]:
        """Ask the step for the amaxes that re-quantizing FP8 weights needs (per-tensor
        recipes), so write_back_main_params does not read every updated weight again to find
        them. Only where this rank's optimizer updates its whole shard (not outer optim)."""
        if not isinstance(self.optimizer, (FusedAdamW, OffloadedAdamW)):
            return []
        reports, targets = [], {}
        for group, pieces in self.pieces_by_group:
            if group.optimizer_range is not None:
                continue
            made = group.storage.optimizer_amax_targets([p.piece for p in pieces])
            if made is None:
                continue
            amaxes, cells = made
            targets.update((p.main, cell) for p, cell in zip(pieces, cells))
            reports.append((group.storage, amaxes))
        self.optimizer.amax_targets = targets
        return reports

    def params_norm(self) -> float:
        """L2 norm of all main params over the shards (--log-params-norm)."""
        mains = self._counted([piece.main for piece in self.pieces]) or [
            torch.zeros(1, device=self.engine.buffer.device)
        ]
        norm = global_grad_norm(mains, group=self.piece_group)
        if self.tp_grads is not None:
            norm = self.tp_grads.norm_over_group(norm, self.engine.buffer.device)
        return norm

    def _detach_grads(self) -> None:
        for shard_piece in self.pieces:
            shard_piece.main.grad = None

    def state_dict(self) -> dict:
        """Rank-local state (resume at the same DP size); sharded_state_dict() reshards."""
        return {"optimizer": None if self.optimizer is None else self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])  # refreshes offloaded params

    def sharded_state_dict(self) -> dict[str, Any]:
        """Optimizer state as flat per-parameter pieces that DCP can reshard to any DP size
        (state_dict.py describes the layout)."""
        engine = self.engine
        adam = self.config.optimizer == "adam"
        keys = ("exp_avg", "exp_avg_sq") if adam else ("momentum_buffer",)
        by_name = {shard_piece.name: shard_piece for shard_piece in self.pieces}
        state: dict[str, Any] = {key: {} for key in keys}
        # On the engine's device: NCCL reduces only device tensors (the fused AdamW keeps it there).
        device = engine.buffer.device
        # HSDP with outer optim splits optimizer state over every DP rank (self.piece_group).
        mesh = engine_mesh(engine)
        if mesh is not None and self.piece_group is not None:
            mesh = data_parallel_mesh(self.piece_group, device)
        flat_value = FlatValues.of(engine, mesh)
        step = torch.zeros((), dtype=torch.float32, device=device)
        for name, group, index in named_slots(engine):
            shard_piece = by_name.get(name)
            torch_state = self.optimizer.state[shard_piece.main] if shard_piece else {}
            piece = shard_piece.piece if shard_piece else None
            values = self._flat_states(shard_piece, keys) if shard_piece else {}
            for key in keys:
                view = values.get(key)
                set_present(state[key], name, flat_value(group.layout.slots[index], piece, view))
            if "step" in torch_state:
                step = torch_state["step"].detach().float().to(device, copy=True)
        if adam:
            if engine.config.shards_optimizer_state:
                # Replicated value: a rank without pieces must still write the true step count.
                dist.all_reduce(step, op=dist.ReduceOp.MAX, group=engine.process_group)
            state["step"] = step
        return state

    def _flat_states(self, shard_piece: ShardPiece, keys: tuple[str, ...]) -> dict:
        """The piece's states flattened, in fp32: views of fp32 states (DCP loads in place),
        the logical fp32 values of bf16/fp16/fp8 moments (new tensors), so a checkpoint holds
        the same values whatever moment dtypes saved it and loads into any."""
        main = shard_piece.main
        torch_state = self.optimizer.state[main]
        if all(torch_state[key].dtype == torch.float32 for key in keys):
            # An offloaded piece's state is on the host: a device copy for the collectives.
            return {key: torch_state[key].view(-1).to(main.device) for key in keys}
        logical = self.optimizer.logical_state(main)
        return {key: logical[key].view(-1).to(main.device) for key in keys}

    @torch.no_grad()
    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        """Take a state that DCP filled (pieces already in place where they are views);
        moments held in other dtypes are rounded into them from the loaded fp32 values."""
        adam = self.config.optimizer == "adam"
        for piece in self.pieces:
            torch_state = self.optimizer.state[piece.main]
            if "step" in torch_state:
                torch_state["step"].copy_(state["step"])
            keys = ("exp_avg", "exp_avg_sq") if adam else ("momentum_buffer",)
            converted = {}
            for key in keys:
                loaded = local_piece(state[key].get(piece.name))
                value = torch_state[key]
                if loaded is None or loaded.data_ptr() == value.data_ptr():
                    continue
                if value.dtype == torch.float32:
                    value.view(-1).copy_(loaded.reshape(-1))
                else:
                    converted[key] = loaded.reshape(piece.main.shape)
            if converted:
                self.optimizer.set_logical_state(piece.main, converted)
        self.refresh_offloaded_params()

    def refresh_offloaded_params(self) -> None:
        """With CPU offload, copy the main params into the host update's copies: after a load
        changed them (the checkpoint loads the model before the optimizer)."""
        if isinstance(self.optimizer, OffloadedAdamW):
            self.optimizer.refresh_host_params()
