"""GPTModel under Megatron-FSDP: meta-device build, default TransformerLayer units, tied head."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from megatron.core.distributed.fsdp.config import FsdpConfig
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import MixedPrecisionOptimizer, OptimizerConfig
from megatron.core.transformer.init import init_parameter_
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.dist_utils import run_distributed

STEPS, SEQ, BATCH, SEED = 6, 16, 4, 1234
OPT = OptimizerConfig(lr=3e-3, weight_decay=0.1, clip_grad=1.0)


def _config() -> TransformerConfig:
    return TransformerConfig(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        vocab_size=64,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
        normalization="RMSNorm",
        swiglu=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 64, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


def _reference() -> list[float]:
    model = GPTModel(_config(), seed=SEED)
    optimizer = MixedPrecisionOptimizer(model, config=OPT)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        inputs, labels = _batch(step)
        loss = model(inputs, labels=labels).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _fsdp_run(rank: int, world_size: int, strategy: str) -> list[float]:
    config = _config()
    with torch.device("meta"):
        model = GPTModel(config, seed=SEED)
    model = FullyShardedDataParallel(
        model,
        fsdp_config=FsdpConfig(
            data_parallel_sharding_strategy=strategy,
            init_model_with_meta_device=True,
            overlap_param_gather=True,
            overlap_grad_reduce=True,
        ),
        device="cpu",
        init_fn=lambda name, t: init_parameter_(t, name=name, config=config, seed=SEED),
    )
    units = [unit.name for unit in model.engine.units()]
    assert units == ["", "decoder.layers.0", "decoder.layers.1"]
    optimizer = model.build_optimizer(OPT)
    losses = []
    per_rank = BATCH // world_size
    for step in range(STEPS):
        model.zero_grad_buffer()
        inputs, labels = _batch(step)
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        local = torch.zeros(())
        for k, (x, y) in enumerate(zip(inputs[rows].chunk(2), labels[rows].chunk(2))):
            with model.no_sync() if k == 0 else contextlib.nullcontext():
                loss = model(x, labels=y).mean() / 2
                loss.backward()
            local += loss.detach()
        model.finish_grad_sync()
        assert optimizer.step().update_successful
        dist.all_reduce(local)
        losses.append(local.item() / world_size)
    return losses


@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim"])
def test_gpt_meta_init_matches_single_process(strategy: str) -> None:
    expected = _reference()
    got = run_distributed(_fsdp_run, 2, strategy)[0]
    for step, (a, b) in enumerate(zip(got, expected)):
        assert a == pytest.approx(b, rel=1e-5), step


@pytest.mark.parametrize(
    "fp8",
    [[], ["--fp8-recipe", "tensorwise", "--fp8-param-gather"]],
    ids=["bf16", "fp8_tensorwise"],
)
def test_bf16_meta_init_trains_like_a_materialized_build(fp8) -> None:
    """--bf16 --init-model-with-meta-device starts from the same bf16-rounded weights as a
    normal build (it drew them in fp32 without the rounding: losses 8.7e-6 apart), so the
    two runs are bitwise equal."""
    import torch.distributed as dist

    from tests.unit_tests.training.common import NO_DROPOUT, TINY_GPT, run_pretrain

    argv = TINY_GPT + NO_DROPOUT + ["--train-iters", "3", "--use-megatron-fsdp", "--bf16", *fp8]
    try:
        built = run_pretrain(argv)
        meta = run_pretrain(argv + ["--init-model-with-meta-device"])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert meta.losses == built.losses
    assert meta.grad_norms == built.grad_norms
