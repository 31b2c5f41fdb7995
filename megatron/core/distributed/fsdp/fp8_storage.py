"""FP8 compute storage: Linear weights kept only as FP8 bytes (+ scales) in uint8 DP buffers.

One class serves all four recipes; what differs is data, not code paths in the hooks:
- directions: rowwise bytes (every recipe) and, for mxfp8, a second columnwise buffer (32x1
  blocks cannot be derived from rowwise bytes).
- role "forward" gathers rowwise; role "backward" gathers the backward direction (mxfp8:
  columnwise; others: rowwise, then a local transpose into each weight's transpose cache).
- scales: replicated (per-tensor recipes, blockwise, unaligned mxfp8: every rank computes every
  scale from globally reduced amaxes) or sharded with their blocks (aligned mxfp8: E8M0 bytes in
  a 1/32-size buffer gathered alongside the data). fp8_layout.py says which and why.
- aligned mxfp8 under ZeRO-3 keeps no columnwise shard between steps: only backward reads that
  copy, so each backward gather quantizes it from the fp32 main shard (the bytes and scales a
  write would have stored, bit for bit) and all-gathers it. That is one weight copy less per
  rank (half the FP8 weight bytes) for one quantization pass per backward instead of per step.

Writing main params (after each optimizer step, at init, after a checkpoint load) is two-phase
so that a whole model needs ONE collective: `amax_to_reduce` gives this rank's partial amax of
every scale cell it must agree on; the buffer packs all groups' vectors into one all-reduce MAX;
`write_main_shard` then quantizes this rank's elements with the exact global scales. The bytes
and scales equal `megatron.core.fp8.quantize` of the whole fp32 weight bit for bit: the same
fp32 scale formula and the same single multiply-then-saturate per element.

Delayed scaling: the weight's `ScalingMeta` (owned by its Fp8Linear) is advanced here, not in
the forward: each write first applies the previous write's recorded amax (scale update + roll),
quantizes with the resulting scale and records the new global amax. That is exactly the order a
high-precision weight sees when Fp8Linear quantizes it once per forward.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.distributed.fsdp.collectives import all_gather_flat
from megatron.core.distributed.fsdp.fp8_layout import grid_numel
from megatron.core.distributed.fsdp.fp8_matrices import (
    MatrixPiece,
    is_stacked,
    matrix_pieces,
    matrix_shape,
    slot_matrices,
    slot_runs,
    stacked_grid,
)
from megatron.core.distributed.fsdp.fp8_params import Fp8ParamSpec
from megatron.core.distributed.fsdp.memory import MemoryTracker
from megatron.core.distributed.fsdp.shard_layout import UnitLayout
from megatron.core.distributed.fsdp.storage import ComputeStorage, GatherRole
from megatron.core.fp8.engine_interface import (
    MXFP8_BLOCK,
    QuantizedTensor,
    ScalingMeta,
    add_piece_cell_amaxes_,
    advance_delayed_scales,
    cast_piece_,
    new_fp8_weight,
    quantize_mxfp8_bands_,
    record_weight_amaxes,
    stacked_cell_rows,
    weight_cell_geometry,
    weight_cell_scales,
    weight_scale_grid,
)
from megatron.core.optimizer.fused_adamw import AmaxCells


class _Works:
    """Several collectives awaited as one (data and scales of one gather)."""

    def __init__(self, works: list[dist.Work | None]) -> None:
        self.works = [work for work in works if work is not None]

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def _as_work(works: list[dist.Work | None]) -> _Works | None:
    combined = _Works(works)
    return combined if combined.works else None


class Fp8ComputeStorage(ComputeStorage):
    """FP8 weights of one unit (one recipe): uint8 data buffers per direction, plus scales."""

    gather_stats_key = "fp8_all_gather_bytes"

    def __init__(
        self,
        *,
        layout: UnitLayout,
        scales_sharded: bool,
        spec: Fp8ParamSpec,
        delayed_metas: list[ScalingMeta | None],
        device: torch.device,
        sharded: bool,
        group: dist.ProcessGroup,
        tracker: MemoryTracker,
    ) -> None:
        self.layout, self.spec, self.sharded = layout, spec, sharded
        self.scales_sharded = scales_sharded
        self.matrices = slot_matrices(layout.slots)
        """The matrices quantized on their own scales (a stacked expert weight: one each)."""
        one_pass = len(spec.directions) == 1 and not scales_sharded
        self.runs = slot_runs(
            layout.slots, lambda s: stacked_cell_rows(s, spec.recipe_spec) if one_pass else None
        )
        """The matrices as the piece kernels write them (`fp8_matrices.Run`)."""
        self._run_index = {(run.slot_index, run.expert): i for i, run in enumerate(self.runs)}
        self._pieces: dict[int, list[MatrixPiece]] | None = None
        self.delayed_metas = [
            delayed_metas[m.slot_index][m.expert]
            if isinstance(delayed_metas[m.slot_index], tuple)
            else delayed_metas[m.slot_index]
            for m in self.matrices
        ]
        """Per matrix, as `matrices`."""
        self.group, self.tracker, self.device = group, tracker, device
        self.directions = spec.directions
        self.backward_direction = self.directions[-1]
        # Aligned mxfp8, ZeRO-3: the columnwise copy is quantized from the main shard at each
        # backward gather, not stored (module docstring).
        self.columnwise_on_gather = sharded and scales_sharded and "columnwise" in self.directions
        self.stored_directions = tuple(
            d for d in self.directions if not (d == "columnwise" and self.columnwise_on_gather)
        )
        # A rank that holds the whole unit (no_shard, or ZeRO-3 over a group of one) stores
        # the gathered bytes themselves: its stored directions are never gathered or freed.
        whole = not sharded or layout.world_size == 1
        self.resident = {d: whole and d in self.stored_directions for d in self.directions}
        self._main_shard: torch.Tensor | None = None
        self._gather_inputs: list[torch.Tensor] = []
        """Quantized send buffers of a columnwise gather in flight (kept until finish_gather)."""
        # Per-tensor and 128x128 weights: backward reads a transpose of the rowwise bytes.
        self.transpose_for_backward = self.backward_direction == "rowwise"
        self.full = {
            d: tracker.zeros(layout.padded_numel, dtype=torch.uint8, device=device)
            for d in self.directions
        }
        self.scale_full: dict[str, torch.Tensor] = {}
        if scales_sharded:
            for d in self.directions:
                self.scale_full[d] = tracker.zeros(
                    layout.padded_numel // MXFP8_BLOCK, dtype=torch.uint8, device=device
                )
        self.slot_scales = (
            [] if scales_sharded else [self._new_slot_scales(s.shape) for s in layout.slots]
        )
        self.shard: dict[str, torch.Tensor] = {}
        self.scale_shard: dict[str, torch.Tensor] = {}
        for d in self.directions:
            self._allocate_shard(d)
        self.gathered = dict(self.resident)
        self.transposed = False
        """Transpose caches built for the backward role (per-tensor and 128x128 recipes)."""
        self.params: list[QuantizedTensor] = []
        self.delayed_pending = False
        """A write recorded an amax that the next write applies (delayed recipe)."""
        self.optimizer_amaxes: torch.Tensor | None = None
        """The step's partial amaxes (use_optimizer_amaxes), taken by the next amax_to_reduce."""

    def _allocate_shard(self, d: str) -> None:
        """This rank's bytes (and sharded scales) of direction `d`: own buffers under ZeRO-3
        (the full ones then hold no memory until gathered), else views of the full ones."""
        layout, tracker, device = self.layout, self.tracker, self.device
        if d not in self.stored_directions:
            tracker.resize_storage(self.full[d], 0)
            tracker.resize_storage(self.scale_full[d], 0)
            return
        lo, hi = layout.shard_range(layout.rank)
        if not self.resident[d]:
            self.shard[d] = tracker.zeros(layout.shard_numel, dtype=torch.uint8, device=device)
            tracker.resize_storage(self.full[d], 0)
        else:
            self.shard[d] = self.full[d][lo:hi]
        if self.scales_sharded:
            n = layout.shard_numel // MXFP8_BLOCK
            if not self.resident[d]:
                self.scale_shard[d] = tracker.zeros(n, dtype=torch.uint8, device=device)
                tracker.resize_storage(self.scale_full[d], 0)
            else:
                self.scale_shard[d] = self.scale_full[d][lo // MXFP8_BLOCK : hi // MXFP8_BLOCK]

    def _slot_grid(self, shape: torch.Size, direction: str) -> tuple[int, ...]:
        """A weight's scale grid: its matrix's, one per expert when stacked."""
        columnwise = direction == "columnwise"
        grid = weight_scale_grid(matrix_shape(shape), self.spec.recipe_spec, columnwise=columnwise)
        return stacked_grid(shape, grid)

    def _new_slot_scales(self, shape: torch.Size) -> dict[str, torch.Tensor]:
        scales = {}
        for d in self.directions:
            grid = self._slot_grid(shape, d)
            dtype = self.spec.recipe_spec.scale_dtype
            scales[d] = torch.ones(grid, dtype=dtype, device=self.device)
        return scales

    @staticmethod
    def param_alignment(name: str, shape: torch.Size) -> int:
        return 1  # fp8_layout.plan_fp8_layout lays FP8 groups out itself.

    # ----- parameters and their views --------------------------------------------------

    def new_param(self, slot_index: int, *, requires_grad: bool) -> nn.Parameter:
        """An FP8 parameter with no bytes yet (bind_params points it at the buffers)."""
        slot = self.layout.slots[slot_index]
        qt = new_fp8_weight(
            shape=slot.shape,
            dtype=self.spec.dtype,
            spec=self.spec.recipe_spec,
            fp8_dtype=self.spec.fp8_dtype,
            name=slot.name,
            device=self.device,
        )
        return nn.Parameter(qt, requires_grad=requires_grad)

    def bind_params(self, params: list[nn.Parameter]) -> None:
        self.params = list(params)
        for d in self.directions:
            self._point(d) if self.gathered[d] else self._detach(d)

    def _scale_view(self, slot_index: int, direction: str) -> torch.Tensor:
        if not self.scales_sharded:
            return self.slot_scales[slot_index][direction]
        slot = self.layout.slots[slot_index]
        # Whole 32-row bands: a stacked weight's flat grid is its experts' grids in order.
        grid = self._slot_grid(slot.shape, direction)
        lo, hi = slot.offset // MXFP8_BLOCK, slot.end // MXFP8_BLOCK
        return self.scale_full[direction][lo:hi].view(grid)

    def _point(self, direction: str) -> None:
        for index, (slot, qt) in enumerate(zip(self.layout.slots, self.params)):
            setattr(qt, f"{direction}_data", self.full[direction][slot.offset : slot.end])
            setattr(qt, f"{direction}_scale_inv", self._scale_view(index, direction))

    def _detach(self, direction: str) -> None:
        for qt in self.params:
            setattr(qt, f"{direction}_data", None)  # later use raises Fp8DataReleasedError
            if self.scales_sharded:
                setattr(qt, f"{direction}_scale_inv", None)

    # ----- gather / release ------------------------------------------------------------

    def _role_directions(self, role: GatherRole) -> tuple[str, ...]:
        return ("rowwise",) if role == "forward" else (self.backward_direction,)

    def is_gathered(self, role: GatherRole) -> bool:
        # Backward of per-tensor/128x128 weights also needs the local transpose: bytes that
        # stayed gathered since forward still go through finish_gather once.
        needs_transpose = role == "backward" and self.transpose_for_backward
        present = all(self.gathered[d] for d in self._role_directions(role))
        return present and (self.transposed or not needs_transpose)

    def _gather_nbytes(self) -> int:
        scales = self.layout.padded_numel // MXFP8_BLOCK if self.scales_sharded else 0
        return self.layout.padded_numel + scales

    def start_gather(self, *, role: GatherRole, async_op: bool) -> tuple[dist.Work | None, int]:
        works, nbytes = [], 0
        for d in self._role_directions(role):
            if self.gathered[d]:
                continue
            self.tracker.resize_storage(self.full[d], self.layout.padded_numel)
            if self.scales_sharded:
                full_scales = self.scale_full[d]
                self.tracker.resize_storage(full_scales, self.layout.padded_numel // MXFP8_BLOCK)
            if d in self.stored_directions:
                data, scales = self.shard[d], self.scale_shard.get(d)
            else:
                data, scales = self._quantized_columnwise_shard()
            if data is not None:  # None: quantized in place, nothing to gather (DP=1)
                works.append(
                    all_gather_flat(self.full[d], data, group=self.group, async_op=async_op)
                )
                if self.scales_sharded:
                    works.append(
                        all_gather_flat(full_scales, scales, group=self.group, async_op=async_op)
                    )
                nbytes += self._gather_nbytes()
            self.gathered[d] = True
            self._point(d)  # views only; nothing reads them before finish_gather
        return _as_work(works), nbytes

    def _quantized_columnwise_shard(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """This rank's columnwise bytes and E8M0 scales, quantized now from the main shard
        into send buffers that live until finish_gather. At DP=1 they are written straight
        into the gathered buffers instead, and (None, None) says there is nothing to gather."""
        if self._main_shard is None:
            raise RuntimeError("Fp8ComputeStorage: bind_main_shard() was never called")
        layout = self.layout
        if layout.world_size == 1:
            self._write_whole_bands(
                self._main_shard,
                col_data=self.full["columnwise"],
                col_scales=self.scale_full["columnwise"],
            )
            return None, None
        data = self.tracker.empty(layout.shard_numel, dtype=torch.uint8, device=self.device)
        scales = self.tracker.empty(
            layout.shard_numel // MXFP8_BLOCK, dtype=torch.uint8, device=self.device
        )
        self._gather_inputs += [data, scales]
        self._write_whole_bands(self._main_shard, col_data=data, col_scales=scales)
        return data, scales

    def bind_main_shard(self, main_shard: torch.Tensor) -> None:
        self._main_shard = main_shard

    def finish_gather(self, role: GatherRole) -> None:
        self._gather_inputs = []  # the gathers that read them are done
        if role == "backward" and self.transpose_for_backward:
            for qt in self.params:
                if not is_stacked(qt.shape):  # each expert's view transposes its own
                    qt.create_transpose_cache()
            self.transposed = True

    def _discard_transposes(self) -> None:
        for qt in self.params:
            qt.discard_transpose_cache()
        self.transposed = False

    def release(self) -> None:
        self._discard_transposes()
        for d in self.directions:
            if self.gathered[d] and not self.resident[d]:
                self._detach(d)
                self.tracker.resize_storage(self.full[d], 0)
                if self.scales_sharded:
                    self.tracker.resize_storage(self.scale_full[d], 0)
                self.gathered[d] = False

    def main_shard_alias(self, main_dtype: torch.dtype) -> torch.Tensor | None:
        return None  # FP8 bytes can never double as main params

    def load_param_(self, slot_index: int, full_value: torch.Tensor) -> None:
        """Nothing to copy: the bytes come from the first write of the main params."""

    def stored_bytes(self) -> int:
        data = sum(t.numel() for t in (self.shard if self.sharded else self.full).values())
        scales = self.scale_shard if self.sharded else self.scale_full
        total = data + sum(t.numel() for t in scales.values())
        for per_slot in self.slot_scales:
            total += sum(t.numel() * t.element_size() for t in per_slot.values())
        return total

    # ----- writing main params ---------------------------------------------------------

    def _cell_layout(self) -> list[tuple[int, str, int, int]]:
        """(run index, direction, offset, cells) of every cell group in the amax vector: each
        matrix's cells in matrix order, directions inside (a run of several has one)."""
        entries, offset = [], 0
        for index, run in enumerate(self.runs):
            shape = self.matrices[run.first].shape
            for d in self.directions:
                columnwise = d == "columnwise"
                n = run.count * grid_numel(shape, self.spec.recipe_spec, columnwise=columnwise)
                entries.append((index, d, offset, n))
                offset += n
        return entries

    def _run_pieces(self) -> dict[int, list[MatrixPiece]]:
        """run index -> the pieces of this rank's shard inside it (at offsets of run.shape)."""
        if self._pieces is not None:
            return self._pieces
        slot_index = {id(slot): i for i, slot in enumerate(self.layout.slots)}
        self._pieces = {}
        for piece in self.layout.pieces():
            index = slot_index[id(piece.slot)]
            whole = self._run_index.get((index, None))  # a 2-D weight or a one-pass stack
            if whole is not None:
                part = MatrixPiece(None, piece.shard_start, piece.param_start, piece.numel)
                self._pieces.setdefault(whole, []).append(part)
                continue
            for part in matrix_pieces(
                piece.slot, piece.param_start, piece.shard_start, piece.numel
            ):
                self._pieces.setdefault(self._run_index[(index, part.expert)], []).append(part)
        return self._pieces

    @torch.no_grad()
    def local_amaxes(self, main_shard: torch.Tensor) -> torch.Tensor:
        """This rank's partial amax of every scale cell (0 where it holds no element)."""
        entries = self._cell_layout()
        amaxes = torch.zeros(sum(n for *_, n in entries), dtype=torch.float32, device=self.device)
        cells = {(index, d): amaxes[offset : offset + n] for index, d, offset, n in entries}
        for index, parts in self._run_pieces().items():
            run = self.runs[index]
            for part in parts:
                values = main_shard[part.shard_start : part.shard_start + part.numel]
                for d in self.directions:
                    add_piece_cell_amaxes_(
                        values,
                        cells[(index, d)],
                        shape=run.shape,
                        spec=self.spec.recipe_spec,
                        columnwise=d == "columnwise",
                        param_start=part.matrix_start,
                        cell_rows=run.cell_rows,
                    )
        return amaxes

    def amax_to_reduce(self, main_shard: torch.Tensor) -> torch.Tensor | None:
        """Partial amaxes every rank must agree on, or None when blocks never straddle shards
        (aligned mxfp8: each rank's cells are its own). The optimizer step's, when it reported
        them (use_optimizer_amaxes), else measured from the main shard."""
        if self.scales_sharded:
            return None
        reported, self.optimizer_amaxes = self.optimizer_amaxes, None
        return reported if reported is not None else self.local_amaxes(main_shard)

    def optimizer_amax_targets(self, pieces: list) -> tuple[torch.Tensor, list] | None:
        """The amax vector of `amax_to_reduce` and, per piece of this rank, what a step's
        AdamW pass fills in it: a per-tensor 2-D weight's one cell (0-d), else the cells of the
        run the piece lies in (`AmaxCells`: 128x128 blocks, a stacked weight's per-expert
        cells). None (the write measures them): sharded mxfp8 scales, two directions, or a
        piece cut into several runs (a stacked weight quantized per expert)."""
        if self.scales_sharded or self.directions != ("rowwise",):
            return None
        slots = {id(slot): i for i, slot in enumerate(self.layout.slots)}
        runs = [self._run_index.get((slots[id(piece.slot)], None)) for piece in pieces]
        if None in runs:
            return None
        entries = {index: (offset, n) for index, _, offset, n in self._cell_layout()}
        amaxes = torch.zeros(
            sum(n for _, n in entries.values()), dtype=torch.float32, device=self.device
        )
        return amaxes, [self._step_cells(amaxes, entries, i, p) for i, p in zip(runs, pieces)]

    def _step_cells(self, amaxes, entries, index: int, piece):
        """What a step fills for `piece` of run `index` (optimizer_amax_targets)."""
        offset, n = entries[index]
        cells, run, spec = amaxes[offset : offset + n], self.runs[index], self.spec.recipe_spec
        if n == 1:
            return cells[0]  # one cell: max |param| of the piece
        geometry = weight_cell_geometry(run.shape, spec.name, cell_rows=run.cell_rows)
        where = dict(shape=run.shape, spec=spec, columnwise=False, param_start=piece.param_start)
        measure = functools.partial(
            add_piece_cell_amaxes_, cell_amax=cells, cell_rows=run.cell_rows, **where
        )
        return AmaxCells(cells, *geometry, start=piece.param_start, measure_=measure)

    def use_optimizer_amaxes(self, amaxes: torch.Tensor) -> None:
        self.optimizer_amaxes = amaxes

    def _run_scales(self, index: int, direction: str) -> torch.Tensor:
        """Where run `index` keeps its replicated scale_inv of `direction`."""
        run = self.runs[index]
        scales = self.slot_scales[run.slot_index][direction]
        return scales if run.expert is None else scales[run.expert]

    def _scales(self, amax_cells: torch.Tensor, index: int = 0):
        """(quantize multiplier, stored scale_inv) per cell of run `index` (delayed: its
        weights' scaling states; current scaling: any cells), as quantize() derives them."""
        run = self.runs[index]
        return weight_cell_scales(
            amax_cells,
            spec=self.spec.recipe_spec,
            fp8_dtype=self.spec.fp8_dtype,
            power_2_scale=self.spec.power_2_scale,
            delayed_metas=self.delayed_metas[run.first : run.first + run.count],
        )

    @torch.no_grad()
    def write_main_shard(
        self,
        main_shard: torch.Tensor,
        *,
        reduced_amax: torch.Tensor | None = None,
        update_scaling: bool = True,
    ) -> None:
        """Quantize this rank's main shard into its FP8 shard with exact global scales.

        reduced_amax: `amax_to_reduce` after the all-reduce MAX (None: local amaxes suffice).
        update_scaling=False (checkpoint load): quantize with the current delayed scales and
        record nothing.
        """
        self.release()  # gathered bytes are stale from here on
        if self.scales_sharded:
            columnwise = "columnwise" in self.stored_directions
            self._write_whole_bands(
                main_shard,
                row_data=self.shard["rowwise"],
                row_scales=self.scale_shard["rowwise"],
                col_data=self.shard["columnwise"] if columnwise else None,
                col_scales=self.scale_shard["columnwise"] if columnwise else None,
            )
            return
        amaxes = reduced_amax if reduced_amax is not None else self.local_amaxes(main_shard)
        if update_scaling and self.delayed_pending:
            # The weights' scales update together: one stacked update, not a chain of small
            # kernels per weight.
            advance_delayed_scales(self.delayed_metas)
        parts = self._run_pieces()
        # Current scaling: every cell's scales in one elementwise pass (not ~10 small kernels
        # per run); delayed: each run's weights' scaling states.
        every = None if self.spec.recipe_spec.delayed else self._scales(amaxes)
        for index, d, offset, n in self._cell_layout():
            if every is None:
                multiplier, scale_inv = self._scales(amaxes[offset : offset + n], index)
            else:
                multiplier, scale_inv = (t[offset : offset + n] for t in every)
            run = self.runs[index]
            for part in parts.get(index, []):
                lo, hi = part.shard_start, part.shard_start + part.numel
                cast_piece_(
                    main_shard[lo:hi],
                    multiplier,
                    self.shard[d][lo:hi],
                    shape=run.shape,
                    spec=self.spec.recipe_spec,
                    columnwise=d == "columnwise",
                    param_start=part.matrix_start,
                    fp8_dtype=self.spec.fp8_dtype,
                    cell_rows=run.cell_rows,
                )
            target = self._run_scales(index, d)
            target.copy_(scale_inv.reshape(target.shape))
        if update_scaling and self.spec.recipe_spec.delayed:
            # Per-tensor grids have one cell per matrix, in matrix order.
            record_weight_amaxes(self.delayed_metas, amaxes[: len(self.delayed_metas)])
        self.delayed_pending = self.spec.recipe_spec.delayed

    def _write_whole_bands(
        self,
        main_shard: torch.Tensor,
        *,
        row_data: torch.Tensor | None = None,
        row_scales: torch.Tensor | None = None,
        col_data: torch.Tensor | None = None,
        col_scales: torch.Tensor | None = None,
    ) -> None:
        """Aligned mxfp8: every piece is whole 32-row bands, so it owns all its blocks and is
        quantized (bytes and E8M0 scales of each direction given, as flat shard-sized
        buffers) in place, with no amax exchange."""
        for piece in self.layout.pieces():
            cols = piece.slot.shape[-1]
            rows = piece.numel // cols
            lo, hi = piece.shard_start, piece.shard_start + piece.numel
            scale_lo, scale_hi = lo // MXFP8_BLOCK, hi // MXFP8_BLOCK
            row = row_data is not None
            col = col_data is not None
            quantize_mxfp8_bands_(
                main_shard[lo:hi].view(rows, cols),
                fp8_dtype=self.spec.fp8_dtype,
                row_data=row_data[lo:hi].view(rows, cols) if row else None,
                row_scale=row_scales[scale_lo:scale_hi].view(rows, -1) if row else None,
                col_data=col_data[lo:hi].view(rows, cols) if col else None,
                col_scale=col_scales[scale_lo:scale_hi].view(-1, cols) if col else None,
            )

    def reset_delayed_scaling(self) -> None:
        """Forget the weight scales' history (a checkpoint without delayed-scaling state)."""
        for meta in self.delayed_metas:
            if meta is not None:
                meta.scale = torch.ones_like(meta.scale)
                meta.amax_history = torch.zeros_like(meta.amax_history)
        self.delayed_pending = False

    def sync_replicas(self, *, async_op: bool) -> tuple[dist.Work | None, int]:
        self._discard_transposes()
        if self.sharded or self.layout.world_size == 1:
            return None, 0
        works = []
        # Separate inputs (gloo does not document in-place all-gather); kept until the next sync.
        self._sync_inputs = {d: self.shard[d].clone() for d in self.directions}
        for d in self.directions:
            works.append(
                all_gather_flat(
                    self.full[d], self._sync_inputs[d], group=self.group, async_op=async_op
                )
            )
            if self.scales_sharded:
                self._sync_inputs[d + "_scales"] = self.scale_shard[d].clone()
                works.append(
                    all_gather_flat(
                        self.scale_full[d],
                        self._sync_inputs[d + "_scales"],
                        group=self.group,
                        async_op=async_op,
                    )
                )
        return _as_work(works), self._gather_nbytes() * len(self.directions)
