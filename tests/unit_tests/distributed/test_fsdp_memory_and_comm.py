"""Bytes held per rank, bytes moved per step, and meta-device materialization."""

from __future__ import annotations

import pytest
import torch

from megatron.core.distributed.fsdp.config import SHARDING_STRATEGIES, FsdpConfig
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.distributed.toy_model import (
    OPT_CONFIG,
    RunState,
    build_toy,
    toy_init,
    train_steps,
)

# hidden 6: root unit = embedding 32*6 + final norm 2*6 = 204 elements; one layer = norm 12 +
# fc1 (6*12 + 12) + fc2 (12*6 + 6) = 174 elements, which pads to 176 at 4 ranks (shard 44).
HIDDEN = 6
MODEL_NUMEL = 204 + 2 * 174  # 552


def _wrap(strategy: str, *, dtype: torch.dtype = torch.float32, **config) -> tuple:
    model = build_toy(hidden=HIDDEN).to(dtype)
    fsdp = FullyShardedDataParallel(
        model,
        fsdp_config=FsdpConfig(data_parallel_sharding_strategy=strategy, **config),
        device="cpu",
    )
    return fsdp, fsdp.build_optimizer(OPT_CONFIG)


def _bytes_per_strategy(rank: int, world_size: int) -> dict:
    result = {}
    for strategy in SHARDING_STRATEGIES:
        model, optimizer = _wrap(strategy)
        result[strategy] = {**model.memory_bytes(), "optimizer": optimizer.state_bytes()}
    model, optimizer = _wrap("optim_grads_params", dtype=torch.bfloat16)
    result["bf16/optim_grads_params"] = {
        **model.memory_bytes(),
        "optimizer": optimizer.state_bytes(),
    }
    return result


def test_bytes_per_rank_by_strategy() -> None:
    results = run_distributed(_bytes_per_strategy, 4)
    full_padded = (204 + 2 * 176) * 4  # 556 fp32 elements: every rank's full buffers
    shard = (51 + 2 * 44) * 4  # 139 elements: one quarter of the padded buffers
    # Adam moments (2 x fp32) of the real elements in a rank's shard: the last rank's layer
    # shards [132, 176) hold 2 padding elements each.
    moments = [2 * 4 * n for n in (139, 139, 139, 135)]
    for rank, got in enumerate(results):
        # fp32 params: the main params are the compute buffer's shard (no second copy).
        assert got["no_shard"] == {
            "params": MODEL_NUMEL * 4,  # one-rank layout: no padding
            "main_params": 0,
            "grads": MODEL_NUMEL * 4,
            "optimizer": 2 * 4 * MODEL_NUMEL,
        }
        assert got["optim"] == {
            "params": full_padded,
            "main_params": 0,
            "grads": full_padded,
            "optimizer": moments[rank],
        }
        assert got["optim_grads"] == {
            "params": full_padded,
            "main_params": 0,
            "grads": shard,
            "optimizer": moments[rank],
        }
        assert got["optim_grads_params"] == {
            "params": shard,
            "main_params": 0,
            "grads": shard,
            "optimizer": moments[rank],
        }
        # bf16 compute, fp32 main: no persistent bf16 compute shard (it was shard // 2 bytes).
        # Like FSDP2, each all-gather casts the fp32 main shard into a temporary bf16 input,
        # the same rounding the optimizer write-back used to do, so the gathered values match.
        assert got["bf16/optim_grads_params"]["params"] == 0
        assert got["bf16/optim_grads_params"] == {
            "params": 0,  # per rank: 0 bytes, down from shard // 2 = 278
            "main_params": shard,  # separate fp32 main shard
            "grads": shard,  # fp32 main grads
            "optimizer": moments[rank],
        }
    assert sum(moments) == 2 * 4 * MODEL_NUMEL  # every element's state lives exactly once


def _comm_bytes(rank: int, world_size: int) -> dict:
    result = {}
    cases = [(s, {}) for s in SHARDING_STRATEGIES]
    cases.append(("optim_grads_params", {"grad_reduce_in_bf16": True}))
    cases.append(
        ("optim_grads_params", {"overlap_param_gather": True, "overlap_grad_reduce": True})
    )
    for strategy, extra in cases:
        model, optimizer = _wrap(strategy, **extra)
        _, stats = train_steps(RunState(model, optimizer), range(2), micro_batches=2)
        result[f"{strategy}{sorted(extra)}"] = stats[-1]
    return result


def test_comm_stats_match_analytic_bytes() -> None:
    results = run_distributed(_comm_bytes, 2)
    buffer_bytes = (204 + 2 * 174) * 4  # 2 ranks: no padding; every unit, fp32
    layer_bytes = 2 * 174 * 4
    zero3_gather = 2 * (204 * 4 + 2 * layer_bytes)  # per micro-batch: root once, layers fwd+bwd
    expected = {
        "no_shard[]": {
            "all_gather_bytes": 0,
            "reduce_scatter_bytes": 0,
            "all_reduce_bytes": buffer_bytes,
        },
        "optim[]": {
            "all_gather_bytes": buffer_bytes,
            "reduce_scatter_bytes": buffer_bytes,
            "all_reduce_bytes": 0,
        },
        "optim_grads[]": {
            "all_gather_bytes": buffer_bytes,
            "reduce_scatter_bytes": 2 * buffer_bytes,
            "all_reduce_bytes": 0,
        },
        "optim_grads_params[]": {
            "all_gather_bytes": zero3_gather,
            "reduce_scatter_bytes": 2 * buffer_bytes,
            "all_reduce_bytes": 0,
        },
        "optim_grads_params['grad_reduce_in_bf16']": {
            "all_gather_bytes": zero3_gather,
            "reduce_scatter_bytes": buffer_bytes,
            "all_reduce_bytes": 0,
        },
        "optim_grads_params['overlap_grad_reduce', 'overlap_param_gather']": {
            "all_gather_bytes": zero3_gather,
            "reduce_scatter_bytes": 2 * buffer_bytes,
            "all_reduce_bytes": 0,
        },
    }
    for got in results:
        assert got == expected


def _meta_init(rank: int, world_size: int, strategy: str) -> dict:
    model = build_toy(num_layers=8, meta=True)
    assert all(p.is_meta for p in model.parameters())
    fsdp = FullyShardedDataParallel(
        model,
        fsdp_config=FsdpConfig(
            data_parallel_sharding_strategy=strategy, init_model_with_meta_device=True
        ),
        device="cpu",
        init_fn=toy_init,
    )
    peak = fsdp.engine.buffer.tracker.peak_bytes
    full = {name: t.numpy() for name, t in fsdp.full_parameters().items()}
    return {"peak": peak, "params": full}


@pytest.mark.parametrize("strategy", ["optim_grads_params"])
def test_meta_device_init_is_sharded_and_bitwise_equal(strategy: str) -> None:
    results = run_distributed(_meta_init, 4, strategy)
    eager = dict(build_toy(num_layers=8).named_parameters())
    full_fp32_bytes = sum(p.numel() for p in eager.values()) * 4
    assert full_fp32_bytes == (544 + 8 * 1104) * 4
    for result in results:
        # A quarter of the model (the rank's shard) plus one unit's transient full tensors.
        assert result["peak"] < full_fp32_bytes / 2, (result["peak"], full_fp32_bytes)
        assert result["peak"] >= full_fp32_bytes / 4
        for name, value in eager.items():
            assert torch.equal(torch.from_numpy(result["params"][name]), value.detach()), name


def _grad_memory_over_a_step(rank: int, world_size: int) -> dict:
    model, optimizer = _wrap("optim_grads_params")
    tracker = model.engine.buffer.tracker
    state = RunState(model=model, optimizer=optimizer)
    train_steps(state, range(1))
    after_step = tracker.live_bytes
    model.zero_grad_buffer()
    after_zero = tracker.live_bytes
    losses, _ = train_steps(state, range(1, 3))
    uninterrupted, _ = train_steps(RunState(*_wrap("optim_grads_params")), range(3))
    return {
        "released": after_step - after_zero,
        "back": tracker.live_bytes - after_zero,
        "losses": losses,
        "uninterrupted": uninterrupted[1:],
    }


def test_grad_memory_is_given_back_between_steps() -> None:
    """zero_grad_buffer() frees each group's grad shard (so a forward never holds grads, as with
    FSDP2's set_to_none); the next backward re-allocates it; training continues unchanged."""
    results = run_distributed(_grad_memory_over_a_step, 4)
    shard = (51 + 2 * 44) * 4  # fp32 grad shards of the three groups, as above
    for result in results:
        assert result["released"] == shard
        assert result["back"] == shard
        assert result["losses"] == result["uninterrupted"]


def _overlapped_toy_watching_reductions(num_layers: int, watch) -> tuple:
    """A ZeRO-3 toy with overlap_grad_reduce whose reduce pipeline calls watch(pending list)
    after each unit's reduction is launched; returns (model, its reduce pipeline)."""
    model = FullyShardedDataParallel(
        build_toy(hidden=HIDDEN, num_layers=num_layers),
        fsdp_config=FsdpConfig(
            data_parallel_sharding_strategy="optim_grads_params", overlap_grad_reduce=True
        ),
        device="cpu",
    )
    reduce = model.engine.reduce
    launch = reduce.reduce_unit

    def watched_reduce_unit(unit, **kwargs):
        launch(unit, **kwargs)
        watch(reduce._pending)  # noqa: SLF001 - the pipeline state under test

    reduce.reduce_unit = watched_reduce_unit
    model.zero_grad_buffer()
    return model, reduce


def _toy_batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8))


def _pending_reductions_during_backward(rank: int, world_size: int) -> list[int]:
    in_flight = []
    model, reduce = _overlapped_toy_watching_reductions(6, lambda p: in_flight.append(len(p)))
    inputs, labels = _toy_batch()
    model(inputs, labels).mean().backward()
    model.finish_grad_sync()
    in_flight.append(len(reduce._pending))  # noqa: SLF001
    return in_flight


def test_grad_reductions_in_flight_stay_bounded() -> None:
    """With overlap_grad_reduce, launching a unit's reduce-scatter stores the older ones, so at
    most one unit's full-size grads wait at any time (not all 7 units' until the backward
    ends); finish_grad_sync() leaves none."""
    for in_flight in run_distributed(_pending_reductions_during_backward, 2):
        assert len(in_flight) == 8  # 6 layers + root reduced, then the final count
        assert in_flight[:-1] == [1] * 7
        assert in_flight[-1] == 0


def _reduce_outputs(rank: int, world_size: int) -> dict:
    in_place = []
    model, _ = _overlapped_toy_watching_reductions(
        2, lambda pending: in_place.append(pending[-1].result is None)
    )
    inputs, labels = _toy_batch()
    with model.no_sync():
        model(inputs[:2], labels[:2]).mean().backward()
    model(inputs[2:], labels[2:]).mean().backward()
    model.finish_grad_sync()
    return {"in_place": in_place}


def test_first_reduce_scatter_of_a_step_lands_in_the_grad_shard() -> None:
    """The first micro-batch's reduce-scatter writes straight into each (fresh) grad shard;
    the second one's output is added to it (the accumulation tests check the values)."""
    for result in run_distributed(_reduce_outputs, 2):
        assert result["in_place"] == [True] * 3 + [False] * 3
