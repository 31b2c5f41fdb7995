"""The Megatron-LM features behind issue 20's flags, one by one, with numbers: loss scaling,
recompute methods, zero-centred norms, decoupled learning rate, per-token loss, profiling,
memory snapshots, manual GC, and how the flags map onto our engines."""

from __future__ import annotations

import gc
import gzip
import json
import math
import pickle
import re

import pytest
import torch

from megatron.core.optimizer import (
    LRScheduleConfig,
    MixedPrecisionOptimizer,
    OptimizerConfig,
    OptimizerParamScheduler,
    learning_rate_at,
)
from megatron.core.optimizer.grad_scaler import GradScaler
from megatron.core.transformer.norm import LayerNorm, RMSNorm
from megatron.training.flags.arguments import parse_args
from megatron.training.flags.configs import resolved_flags
from tests.unit_tests.training.common import NO_DROPOUT, TINY_GPT, run_pretrain


def test_dynamic_loss_scale_sequence():
    """Megatron-LM's DynamicGradScaler: hysteresis 2 absorbs one overflow, then each overflow
    halves the scale (not below the floor); `window` clean steps double it and re-arm the
    hysteresis."""
    scaler = GradScaler(scale=2.0**32, min_scale=2.0**29, growth_interval=3, hysteresis=2)
    seen = []
    for found_inf in (True, True, True, True, False, False, False, True, True):
        scaler.update(found_inf=found_inf)
        seen.append(math.log2(scaler.scale))
    assert seen == [32, 31, 30, 29, 29, 29, 30, 30, 29]
    static = GradScaler(scale=1024.0, dynamic=False)
    static.update(found_inf=True)
    assert static.scale == 1024.0


def _tiny_block(**config):
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=2,
        vocab_size=64,
        max_sequence_length=8,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    return TransformerBlock(TransformerConfig(**base, **config))


@pytest.mark.parametrize(
    "method, layers, chunks",
    [
        ("uniform", 2, [(0, 2), (2, 4)]),
        ("uniform", 3, [(0, 3), (3, 4)]),
        ("block", 1, [(0, 1)]),
        ("block", 3, [(0, 1), (1, 2), (2, 3)]),
        ("block", 9, [(0, 1), (1, 2), (2, 3), (3, 4)]),
    ],
)
def test_recompute_methods_checkpoint_the_megatron_lm_layers(method, layers, chunks, monkeypatch):
    from megatron.core.transformer import transformer_block

    block = _tiny_block(
        recompute_granularity="full", recompute_method=method, recompute_num_layers=layers
    )
    plain = _tiny_block()
    plain.load_state_dict(block.state_dict())
    calls = []
    real = transformer_block.checkpoint

    def spy(function, start, end, *args, **kwargs):
        calls.append((start, end))
        return real(function, start, end, *args, **kwargs)

    monkeypatch.setattr(transformer_block, "checkpoint", spy)
    x = torch.randn(2, 8, 32)
    block(x.clone().requires_grad_()).square().sum().backward()
    plain(x.clone().requires_grad_()).square().sum().backward()
    assert calls == chunks
    for (name, a), b in zip(block.named_parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad), name


@pytest.mark.parametrize("kind", [LayerNorm, RMSNorm])
def test_layernorm_1p_scales_by_one_plus_weight(kind):
    zero_centered = kind(16, eps=1e-5, dtype=torch.float32, zero_centered=True)
    plain = kind(16, eps=1e-5, dtype=torch.float32)
    assert torch.equal(zero_centered.weight, torch.zeros(16))
    with torch.no_grad():
        zero_centered.weight.copy_(torch.linspace(-0.5, 0.5, 16))
        plain.weight.copy_(1.0 + zero_centered.weight)
    x = torch.randn(3, 16)
    assert torch.allclose(zero_centered(x), plain(x), rtol=0, atol=1e-6)


def test_decoupled_lr_schedules_embedding_and_output_separately():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    model = GPTModel(
        TransformerConfig(
            num_layers=1,
            hidden_size=32,
            num_attention_heads=2,
            vocab_size=64,
            max_sequence_length=8,
            untie_embeddings_and_output_weights=True,
        )
    )
    optimizer = MixedPrecisionOptimizer(
        model,
        config=OptimizerConfig(lr=1e-3, min_lr=1e-5, decoupled_lr=5e-3, decoupled_min_lr=4e-4),
    )
    schedule = LRScheduleConfig(
        max_lr=1e-3, min_lr=1e-5, warmup_iters=2, decay_iters=10, decay_style="cosine"
    )
    scheduler = OptimizerParamScheduler(optimizer, config=schedule)
    owners = {id(p): name for name, p in model.named_parameters()}
    own = [g for g in optimizer.param_groups if "max_lr" in g]
    assert sorted(owners[id(p)] for g in own for p in g["params"]) == [
        "embedding.word_embeddings.weight",
        "output_layer.weight",
    ]
    decoupled = LRScheduleConfig(
        max_lr=5e-3, min_lr=4e-4, warmup_iters=2, decay_iters=10, decay_style="cosine"
    )
    for step in range(12):  # update k + 1 uses the schedule at k, as in Megatron-LM
        for group in optimizer.param_groups:
            expected = decoupled if "max_lr" in group else schedule
            assert group["lr"] == pytest.approx(learning_rate_at(step, expected), rel=1e-12)
        scheduler.step()
    assert {g["lr"] for g in own} == {4e-4} and scheduler.get_lr() == pytest.approx(1e-5)


def test_per_token_loss_weights_every_token_of_the_global_batch():
    """Two micro-batches with 5 and 64 loss tokens: --calculate-per-token-loss's grads are those
    of the mean over all 69 tokens, not the mean of the two micro-batch means."""
    from megatron.training.flags.configs import build_run_config, build_transformer_config
    from megatron.training.initialize import DistributedEnv
    from megatron.training.model_setup import setup_model_and_optimizer
    from megatron.training.training import forward_backward

    args = parse_args(TINY_GPT + NO_DROPOUT, world_size=1)
    config = build_transformer_config(args, vocab_size=512)
    env = DistributedEnv(
        rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), dp_group=None
    )
    run = setup_model_and_optimizer(build_run_config(args).model_setup, config=config, env=env)
    generator = torch.Generator().manual_seed(3)
    batches = []
    for tokens_kept in (5, 64):
        tokens = torch.randint(0, 512, (2, 32), generator=generator)
        mask = torch.zeros(2, 32)
        mask.view(-1)[:tokens_kept] = 1.0
        batches.append(
            {
                "tokens": tokens,
                "labels": tokens.roll(-1, 1),
                "loss_mask": mask,
                "position_ids": torch.arange(32).expand(2, 32),
            }
        )

    def grads(**options) -> list[torch.Tensor]:
        run.module.zero_grad()
        for batch in batches:
            forward_backward(run, batch, num_microbatches=2, **options)
        return [p.grad.clone() for p in run.module.parameters()]

    per_token = grads(tokens_per_rank=69.0)
    run.module.zero_grad()
    total = (
        sum(
            (
                run.model(b["tokens"], position_ids=b["position_ids"], labels=b["labels"])
                * b["loss_mask"]
            ).sum()
            for b in batches
        )
        / 69.0
    )
    total.backward()
    reference = [p.grad.clone() for p in run.module.parameters()]
    per_microbatch = grads()
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-8) for a, b in zip(per_token, reference))
    assert not torch.allclose(per_microbatch[0], reference[0], rtol=1e-3)


def test_pytorch_profiler_trace_holds_exactly_the_asked_steps(tmp_path):
    """Megatron-LM's schedule: steps start .. end - 1, ProfilerStep#k being iteration k."""
    run_pretrain(
        TINY_GPT
        + [
            "--train-iters",
            "4",
            "--profile",
            "--use-pytorch-profiler",
            "--profile-step-start",
            "2",
            "--profile-step-end",
            "4",
            "--tensorboard-dir",
            str(tmp_path / "tb"),
        ]
    )
    trace = tmp_path / "torch_profile" / "rank-0.json.gz"
    with gzip.open(trace, "rt") as handle:
        events = json.load(handle)["traceEvents"]
    steps = {e["name"] for e in events if re.fullmatch(r"ProfilerStep#\d+", e.get("name", ""))}
    assert steps == {"ProfilerStep#2", "ProfilerStep#3"}
    assert [p.name for p in (tmp_path / "torch_profile").iterdir()] == ["rank-0.json.gz"]


def test_memory_history_on_cpu_says_so_and_writes_nothing(tmp_path, capsys):
    """torch has no CPU allocator history: on CPU the flag is a logged no-op."""
    if torch.cuda.is_available():
        pytest.skip("CUDA present: test_memory_snapshot_on_gpu covers it")
    snapshot = tmp_path / "snapshot.pickle"
    run_pretrain(
        TINY_GPT
        + ["--train-iters", "1", "--record-memory-history", "--memory-snapshot-path", str(snapshot)]
    )
    out = capsys.readouterr().out
    assert out.count(" > note: --record-memory-history: the CUDA allocator history") == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.gpu
def test_memory_snapshot_on_gpu(tmp_path):
    snapshot = tmp_path / "snapshot.pickle"
    run_pretrain(
        TINY_GPT
        + ["--train-iters", "2", "--record-memory-history", "--memory-snapshot-path", str(snapshot)]
    )
    with open(tmp_path / "snapshot_0.pickle", "rb") as handle:
        dumped = pickle.load(handle)
    assert dumped["segments"] and any(trace for trace in dumped["device_traces"])


def test_manual_gc_collects_on_schedule_and_restores_the_collector(monkeypatch):
    from megatron.training import run_hooks, training

    collections = []
    monkeypatch.setattr(run_hooks.gc, "collect", lambda *a: collections.append(a) or 0)
    automatic = []
    real_step = training.train_step

    def spy_step(args, **kwargs):
        automatic.append(gc.isenabled())
        return real_step(args, **kwargs)

    monkeypatch.setattr(training, "train_step", spy_step)
    run_pretrain(TINY_GPT + ["--train-iters", "4", "--manual-gc", "--manual-gc-interval", "2"])
    assert automatic == [False] * 4 and gc.isenabled()
    assert len(collections) == 1 + 2  # at start, after iterations 2 and 4


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--use-distributed-optimizer"], (True, "optim", "torch_dist")),
        (["--ckpt-format", "torch_dist"], (False, "optim_grads_params", "torch_dist")),
        (
            ["--use-megatron-fsdp", "--use-distributed-optimizer"],
            (True, "optim_grads_params", "torch_dist"),
        ),
        ([], (False, "optim_grads_params", "torch")),
    ],
)
def test_engine_a_megatron_lm_line_means(extra, expected):
    args = resolved_flags(parse_args(TINY_GPT + extra, world_size=1), world_size=1)
    found = (args.use_megatron_fsdp, args.data_parallel_sharding_strategy, args.ckpt_format)
    assert found == expected


def test_flag_spellings_of_megatron_lm_scripts():
    args = parse_args(
        TINY_GPT
        + ["--split", "'99,1,0'", "--sequence-parallel", "--tensor-model-parallel-size", "1"],
        world_size=1,
    )
    args = resolved_flags(args, world_size=1)
    assert args.split == "99,1,0" and args.sequence_parallel is False
    fsdp_dtypes = [
        "--bf16",
        "--use-megatron-fsdp",
        "--megatron-fsdp-main-params-dtype",
        "fp32",
        "--megatron-fsdp-main-grads-dtype",
        "auto",
        "--megatron-fsdp-grad-comm-dtype",
        "bf16",
    ]
    args = resolved_flags(parse_args(TINY_GPT + fsdp_dtypes, world_size=1), world_size=1)
    assert (args.main_params_dtype, args.main_grads_dtype, args.grad_reduce_in_bf16) == (
        "fp32",
        "bf16",
        True,
    )
    # fp64 grad buffers (ours): the layout-independent mode; comm auto follows them.
    fp64 = ["--use-megatron-fsdp", "--megatron-fsdp-main-grads-dtype", "fp64"]
    args = parse_args(TINY_GPT + fp64 + ["--megatron-fsdp-grad-comm-dtype", "auto"], world_size=1)
    args = resolved_flags(args, world_size=1)
    assert (args.main_grads_dtype, args.grad_reduce_in_bf16) == ("fp64", False)


def test_fp16_static_scale_trains_like_fp32():
    """A static --loss-scale 1024 is undone before the update: fp16 losses follow fp32's."""
    fp32 = run_pretrain(TINY_GPT + NO_DROPOUT + ["--train-iters", "3"]).losses
    fp16 = run_pretrain(
        TINY_GPT + NO_DROPOUT + ["--train-iters", "3", "--fp16", "--loss-scale", "1024"]
    ).losses
    assert all(abs(fp16[i] - fp32[i]) < 2e-4 for i in (1, 2, 3)), (fp16, fp32)
    assert fp16[3] < fp16[1] - 0.03  # it trained


def test_per_token_loss_with_distributed_optimizer_is_the_same_at_two_ranks():
    """--calculate-per-token-loss normalizes by the global batch's tokens over all ranks, and
    --use-distributed-optimizer really shards at DP=2: the losses match the one-rank run."""
    from tests.unit_tests.dist_utils import run_distributed
    from tests.unit_tests.training.common import run_pretrain_on_rank

    argv = (
        TINY_GPT
        + NO_DROPOUT
        + ["--train-iters", "3", "--calculate-per-token-loss", "--use-distributed-optimizer"]
    )
    one_rank = run_pretrain(argv).losses
    by_rank = run_distributed(run_pretrain_on_rank, 2, argv)
    assert by_rank[0] == by_rank[1]
    assert all(by_rank[0][i] == pytest.approx(one_rank[i], rel=1e-6) for i in (1, 2, 3))
    assert one_rank[3] < one_rank[1]


def test_fp16_loss_scale_resumes_from_the_checkpoint(tmp_path):
    """The dynamic loss scale is saved with the optimizer state: a resumed fp16 run continues
    with the scale (and so the skipped updates and losses) of the uninterrupted one. 2**20
    overflows this model's fp16 grads at iteration 1 and 2**19 does not at iteration 2, so a
    resume after iteration 1 that restarted at 2**20 would skip iteration 2."""
    fp16 = (
        TINY_GPT + NO_DROPOUT + ["--fp16", "--initial-loss-scale", str(2**20), "--hysteresis", "1"]
    )
    whole = run_pretrain(fp16 + ["--train-iters", "4"])
    assert whole.state.skipped_iterations >= 1 and math.isfinite(whole.grad_norms[4])
    assert math.isnan(whole.grad_norms[1]) and math.isfinite(whole.grad_norms[2])
    run_pretrain(fp16 + ["--train-iters", "4", "--save", str(tmp_path), "--exit-interval", "1"])
    resumed = run_pretrain(fp16 + ["--train-iters", "4", "--load", str(tmp_path)])
    assert [resumed.losses[i] for i in (2, 3, 4)] == [whole.losses[i] for i in (2, 3, 4)]
    assert resumed.state.skipped_iterations == whole.state.skipped_iterations


def test_profile_ranks_leave_other_ranks_unprofiled(tmp_path):
    run_pretrain(
        TINY_GPT
        + [
            "--train-iters",
            "2",
            "--profile",
            "--use-pytorch-profiler",
            "--profile-step-start",
            "1",
            "--profile-step-end",
            "2",
            "--profile-ranks",
            "1",
            "--tensorboard-dir",
            str(tmp_path / "tb"),
        ]
    )
    assert not (tmp_path / "torch_profile").exists()


def test_grad_reduce_in_bf16_under_ddp_reduces_in_bf16():
    """--grad-reduce-in-bf16 without Megatron-FSDP: DDP's all-reduce runs in bf16, so the two
    ranks' updates differ from the fp32 reduction by bf16 rounding only."""
    from tests.unit_tests.dist_utils import run_distributed
    from tests.unit_tests.training.common import run_pretrain_on_rank

    argv = TINY_GPT + NO_DROPOUT + ["--train-iters", "3"]
    fp32 = run_distributed(run_pretrain_on_rank, 2, argv)[0]
    bf16 = run_distributed(run_pretrain_on_rank, 2, argv + ["--grad-reduce-in-bf16"])[0]
    assert fp32[1] == bf16[1]  # same weights before the first update
    assert fp32[3] != bf16[3] and abs(fp32[3] - bf16[3]) < 1e-3


def test_torch_fsdp2_trains_as_ddp_at_two_ranks():
    """--use-torch-fsdp2: fp32 shards on two ranks give the one-rank DDP losses."""
    from tests.unit_tests.dist_utils import run_distributed
    from tests.unit_tests.training.common import run_pretrain_on_rank

    argv = TINY_GPT + NO_DROPOUT + ["--train-iters", "3"]
    ddp = run_pretrain(argv).losses
    fsdp2 = run_distributed(run_pretrain_on_rank, 2, argv + ["--use-torch-fsdp2"])
    assert fsdp2[0] == fsdp2[1]
    assert all(fsdp2[0][i] == pytest.approx(ddp[i], rel=1e-6) for i in (1, 2, 3))
    assert ddp[3] < ddp[1]
