"""FP8 parameters under Megatron-FSDP: the bytes and scales every gather delivers equal one-rank
quantize of the full fp32 main weight, at 1, 2 and 4 ranks, at init and after 10 steps."""

from __future__ import annotations

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.distributed.fp8_toy import (
    RECIPES,
    build_fp8_toy,
    expected_quantization,
    fp8_config,
    fp8_weights,
    train,
    wrap,
)


def _check_gathered(state, config) -> int:
    """Gather every unit for both roles; compare each weight with one-rank quantize. Returns
    the number of weights checked."""
    fsdp = state.model
    engine = fsdp.engine
    full_main = fsdp.full_parameters()
    checked = 0
    for unit in engine.buffer.units[1:]:
        for role in ("forward", "backward"):
            engine.gather.ensure_gathered(unit, role)
            for name, qt in fp8_weights(unit.module).items():
                full_name = f"{unit.name}.{name}"
                meta = unit.module.get_submodule(name.rpartition(".")[0]).delayed_scaling
                scale = meta.metas["weight"].scale if config.recipe == "delayed" else None
                want = expected_quantization(full_main[full_name], config=config, scale=scale)
                if role == "forward":
                    assert torch.equal(qt.rowwise_data, want.rowwise_data), full_name
                    assert torch.equal(qt.rowwise_scale_inv, want.rowwise_scale_inv), full_name
                elif config.recipe == "mxfp8":
                    assert torch.equal(qt.columnwise_data, want.columnwise_data), full_name
                    assert torch.equal(qt.columnwise_scale_inv, want.columnwise_scale_inv)
                else:  # backward reads the transpose cache, made from the gathered bytes
                    # ZeRO-3 builds it when the backward gather finishes; replicas lazily.
                    assert qt.transpose_cache is not None or not fsdp.fsdp_config.shards_params
                    data_t, scale_t = qt.create_transpose_cache()
                    assert torch.equal(data_t, want.rowwise_data.t()), full_name
                    want_scale = want.rowwise_scale_inv
                    assert torch.equal(
                        scale_t, want_scale if want_scale.dim() == 0 else want_scale.t()
                    )
                checked += 1
        engine.gather.release(unit)
    return checked


def _replicated_scale_bytes(storage) -> int:
    return sum(t.numel() * t.element_size() for s in storage.slot_scales for t in s.values())


def _exact_bytes(rank: int, world_size: int) -> dict:
    result = {}
    strategies = ["optim_grads_params"]
    if world_size == 2:
        strategies += ["no_shard", "optim", "optim_grads"]
    for recipe in RECIPES:
        config = fp8_config(recipe)
        for strategy in strategies:
            steps = 10 if strategy == "optim_grads_params" else 2
            state = wrap(build_fp8_toy(config), strategy=strategy, config=config)
            counts = [_check_gathered(state, config)]
            for step in range(steps):
                train(state, range(step, step + 1), config=config)
                counts.append(_check_gathered(state, config))
            groups = state.model.engine.buffer.fp8_groups()
            result[f"{recipe}/{strategy}"] = dict(
                checked=counts,
                scales_sharded=[g.storage.scales_sharded for g in groups],
                empty_weights=sum(len(g.layout.slots) - len(g.pieces()) for g in groups),
                # Bytes each group keeps between steps (FP8 data and sharded E8M0 scales,
                # beside the replicated scales), against one direction's shard.
                stored=[g.storage.stored_bytes() for g in groups],
                replicated_scales=[_replicated_scale_bytes(g.storage) for g in groups],
                kept_numel=[
                    g.layout.shard_numel if g.storage.sharded else g.layout.padded_numel
                    for g in groups
                ],
                columnwise_buffer_bytes=[
                    g.storage.full["columnwise"].untyped_storage().nbytes()
                    for g in groups
                    if "columnwise" in g.storage.full
                ],
            )
    return result


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_gathered_fp8_equals_one_rank_quantize(world_size: int) -> None:
    results = run_distributed(_exact_bytes, world_size)
    for rank_result in results:
        for name, got in rank_result.items():
            steps = 10 if name.endswith("optim_grads_params") else 2
            # 2 layers x 2 weights x 2 roles, at init and after every step.
            assert got["checked"] == [8] * (steps + 1), name
            # mxfp8 shards fall on 32-row band edges at 1 and 2 ranks; at 4 ranks an edge
            # would cut fc2's only band, so scales are replicated from reduced amaxes.
            aligned = name.startswith("mxfp8") and world_size < 4
            assert got["scales_sharded"] == [aligned, aligned], name
            # What each group keeps: one direction's bytes (a shard under ZeRO-3, the whole
            # unit when params are replicated) for every recipe but mxfp8 without ZeRO-3 or
            # unaligned, which also keep the columnwise copy; aligned ZeRO-3 mxfp8 quantizes
            # that copy at each backward gather and keeps neither it nor its buffer.
            zero3 = name.endswith("optim_grads_params")
            for stored, replicated, numel in zip(
                got["stored"], got["replicated_scales"], got["kept_numel"], strict=True
            ):
                directions = 2 if name.startswith("mxfp8") and not (aligned and zero3) else 1
                sharded_scales = numel // 32 if aligned else 0
                assert stored - replicated == directions * (numel + sharded_scales), name
            if aligned and zero3:
                assert got["columnwise_buffer_bytes"] == [0, 0], name
    if world_size == 4:
        # Ranks 2 and 3 hold none of fc1 (its 2048 elements are ranks 0-1's shards).
        assert results[2]["tensorwise/optim_grads_params"]["empty_weights"] == 2


def _step_amaxes(rank: int, world_size: int) -> dict:
    """Per recipe: the amax vectors the optimizer step reported to each FP8 group, against the
    amaxes the storage measures from the updated main shard (exact values)."""
    result = {}
    for recipe in RECIPES:
        config = fp8_config(recipe)
        for strategy in ("optim_grads_params", "no_shard"):
            state = wrap(build_fp8_toy(config), strategy=strategy, config=config)
            groups = state.model.engine.buffer.fp8_groups()
            reported = {id(g.storage): [] for g in groups}
            for group in groups:
                storage = group.storage
                plain, sink = storage.use_optimizer_amaxes, reported[id(storage)]

                def spy(amaxes, sink=sink, plain=plain):
                    sink.append(amaxes.clone())
                    plain(amaxes)

                storage.use_optimizer_amaxes = spy
            mismatches = []
            for step in range(3):
                train(state, range(step, step + 1), config=config)
                for group in groups:
                    got = reported[id(group.storage)]
                    if got:
                        measured = group.storage.local_amaxes(group.main_shard)
                        mismatches += [] if torch.equal(got[-1], measured) else [(step, group)]
                    # Taken by the step's write-back, never left for a later one.
                    assert group.storage.optimizer_amaxes is None
            result[f"{recipe}/{strategy}"] = dict(
                reports=[len(v) for v in reported.values()], mismatches=len(mismatches)
            )
    return result


@pytest.mark.parametrize("world_size", [1, 2])
def test_step_reports_the_amaxes_of_fp8_weights(world_size: int) -> None:
    """FusedAdamW hands per-tensor recipes the amax of every updated weight and blockwise the
    amax of every 128x128 cell (`AmaxCells`), bitwise what the storage would measure, so the
    re-quantization does not read the fp32 weights twice; the bytes above are checked after
    steps that used them. Aligned mxfp8 (sharded E8M0 scales) writes whole bands alone."""
    for rank_result in run_distributed(_step_amaxes, world_size):
        for name, got in rank_result.items():
            reported = name.split("/")[0] != "mxfp8"
            assert got["reports"] == ([3, 3] if reported else [0, 0]), name
            assert got["mismatches"] == 0, name


def _kernel_cell_rule(values: torch.Tensor, target, group: int = 128) -> None:
    """FusedAdamW's Triton rule for an AmaxCells target, in torch: the NaN-skipping max |x| of
    each `group` consecutive elements, maxed into the cell of the group's first element by
    the kernel's index formula (its geometry the target's)."""
    magnitude = values.abs().masked_fill(values.isnan(), 0.0)
    padded = torch.zeros(-(-values.numel() // group) * group)
    padded[: values.numel()] = magnitude
    groups = padded.view(-1, group).amax(dim=1)
    first = target.start + torch.arange(groups.numel()) * group
    row = first // target.cols
    cell = (row // target.cell_rows) * target.grid_cols + (first - row * target.cols) // (
        target.cell_cols
    )
    target.cells.scatter_reduce_(0, cell, groups, reduce="amax")


def _cell_targets(rank: int, world_size: int) -> dict:
    """Blockwise at hidden 256 (fc1 [512, 256]: 4 x 2 cells of 128 x 128): the targets the
    step would fill, filled by the kernel's rule from the updated main pieces, against the
    amaxes the storage measures."""
    from megatron.core.optimizer.fused_adamw import AmaxCells

    config = fp8_config("blockwise")
    state = wrap(build_fp8_toy(config, hidden=256), strategy="optim_grads_params", config=config)
    train(state, range(2), config=config)
    counts, mismatches = {"cells": 0, "fused": 0}, 0
    for group, pieces in state.optimizer.pieces_by_group:
        made = group.storage.optimizer_amax_targets([p.piece for p in pieces])
        if made is None:
            continue
        amaxes, targets = made
        for piece, target in zip(pieces, targets):
            values = piece.main.detach().reshape(-1)
            if isinstance(target, AmaxCells):
                counts["cells"] += 1
                fused = target.groups_in_one_cell(128)
                counts["fused"] += fused
                _kernel_cell_rule(values, target) if fused else target.measure_(values)
            else:
                target.copy_(piece.main.detach().abs().max())
        mismatches += not torch.equal(amaxes, group.storage.local_amaxes(group.main_shard))
    return dict(counts, mismatches=mismatches)


@pytest.mark.parametrize("world_size, pieces", [(1, 4), (4, 8), (3, 8)])
def test_cell_targets_carry_the_kernel_geometry(world_size: int, pieces: int) -> None:
    """The AmaxCells a blockwise storage hands the step (cols, cell edges, grid, each piece's
    start) make the Triton pass's index rule land every group in the cell the storage
    measures: whole weights at one rank; at 4 ranks each weight cut at row 256 (a piece
    starting mid-weight); at 3 ranks cuts off the 128-element grid, measured after the step."""
    results = run_distributed(_cell_targets, world_size)
    assert sum(got["cells"] for got in results) == pieces, results
    fused = sum(got["fused"] for got in results)
    assert fused == pieces if world_size != 3 else 0 < fused < pieces, results
    assert all(got["mismatches"] == 0 for got in results), results
