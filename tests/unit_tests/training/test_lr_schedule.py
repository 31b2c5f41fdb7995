"""Learning-rate values at chosen iterations, computed by hand from the schedule formulas."""

import math

import pytest

from megatron.core.optimizer import LRScheduleConfig, learning_rate_at


def cfg(**kwargs) -> LRScheduleConfig:
    base = dict(max_lr=1.0, min_lr=0.1, warmup_iters=10, decay_iters=110)
    base.update(kwargs)
    return LRScheduleConfig(**base)


@pytest.mark.parametrize("iteration, expected", [(1, 0.1), (5, 0.5), (10, 1.0)])
def test_linear_warmup(iteration, expected):
    assert learning_rate_at(iteration, cfg(decay_style="cosine")) == pytest.approx(expected)


def test_constant_after_warmup():
    assert learning_rate_at(500, cfg(decay_style="constant")) == 1.0


@pytest.mark.parametrize("iteration, ratio", [(10, 0.0), (35, 0.25), (60, 0.5), (110, 1.0)])
def test_linear_decay(iteration, ratio):
    expected = 0.1 + (1.0 - ratio) * 0.9
    assert learning_rate_at(iteration, cfg(decay_style="linear")) == pytest.approx(expected)


@pytest.mark.parametrize("iteration, ratio", [(35, 0.25), (60, 0.5), (85, 0.75)])
def test_cosine_decay(iteration, ratio):
    expected = 0.1 + 0.5 * (math.cos(math.pi * ratio) + 1) * 0.9
    assert learning_rate_at(iteration, cfg(decay_style="cosine")) == pytest.approx(expected)


def test_min_lr_after_decay():
    assert learning_rate_at(111, cfg(decay_style="cosine")) == 0.1


@pytest.mark.parametrize(
    "style, iteration, expected",
    [
        ("linear", 90, 1.0),  # still stable: annealing starts at 110 - 20 = 90
        ("linear", 100, 0.1 + 0.5 * 0.9),
        ("cosine", 95, 0.1 + 0.5 * (math.cos(math.pi * 0.25) + 1) * 0.9),
        ("exponential", 100, 0.1 + (2 * 0.5**0.5 - 1) * 0.9),
        ("minus_sqrt", 95, 0.1 + (1 - math.sqrt(0.25)) * 0.9),
        ("linear", 110, 0.1),
    ],
)
def test_wsd(style, iteration, expected):
    config = cfg(decay_style="WSD", wsd_decay_iters=20, wsd_decay_style=style)
    assert learning_rate_at(iteration, config) == pytest.approx(expected)


@pytest.mark.parametrize("iteration, expected", [(1, 0.28), (5, 0.6), (10, 1.0), (11, 1.0)])
def test_warmup_starts_from_warmup_init(iteration, expected):
    # --lr-warmup-init 0.2: init + (max - init) * k / warmup
    config = cfg(decay_style="constant", warmup_init=0.2)
    assert learning_rate_at(iteration, config) == pytest.approx(expected)


def test_warmup_fraction_is_a_share_of_the_decay_length():
    """--lr-warmup-fraction 0.05 of --lr-decay-iters 50: warmup 2.5 iterations, as
    Megatron-LM's fraction x decay steps (not rounded)."""
    from megatron.training.flags.arguments import parse_args
    from megatron.training.flags.configs import build_lr_schedule_config
    from tests.unit_tests.training.common import TINY_GPT

    args = parse_args(
        TINY_GPT
        + [
            "--train-iters",
            "50",
            "--lr",
            "1e-3",
            "--lr-warmup-fraction",
            "0.05",
            "--lr-decay-style",
            "constant",
        ]
    )
    config = build_lr_schedule_config(args)
    assert config.warmup_iters == pytest.approx(2.5)
    assert [learning_rate_at(k, config) for k in (1, 2, 3)] == pytest.approx([4e-4, 8e-4, 1e-3])


def test_a_schedule_saved_before_warmup_init_existed_matches_the_default():
    from megatron.core.optimizer.lr_scheduler import OptimizerParamScheduler

    class Optimizer:
        param_groups = [{"lr": 0.0}]

    scheduler = OptimizerParamScheduler(Optimizer(), config=cfg())
    old_state = scheduler.state_dict()
    del old_state["config"]["warmup_init"]
    assert scheduler.config_differences(old_state) == []
    changed = OptimizerParamScheduler(Optimizer(), config=cfg(warmup_init=0.5))
    assert changed.config_differences(old_state) == [("warmup_init", 0.0, 0.5)]


def test_train_samples_give_whole_batches_and_a_schedule_in_samples():
    from megatron.training.flags.arguments import parse_args
    from megatron.training.flags.configs import build_run_config
    from tests.unit_tests.training.common import TINY_GPT  # global batch size 8

    flags = [
        "--train-samples",
        "100",
        "--lr-warmup-samples",
        "20",
        "--lr-wsd-decay-samples",
        "40",
        "--lr-decay-style",
        "WSD",
    ]
    run_config = build_run_config(parse_args(TINY_GPT + flags, world_size=1), world_size=1)
    assert run_config.training.train_iters == 12  # 100 // 8
    config = run_config.lr_schedule
    assert (config.decay_iters, config.warmup_iters, config.wsd_decay_iters) == (12.5, 2.5, 5.0)


def test_a_run_in_samples_trains_like_the_same_run_in_iterations():
    from tests.unit_tests.training.common import NO_DROPOUT, TINY_GPT, run_pretrain

    samples = run_pretrain(
        TINY_GPT + NO_DROPOUT + ["--train-samples", "24", "--lr-warmup-samples", "8"]
    )
    iterations = run_pretrain(
        TINY_GPT + NO_DROPOUT + ["--train-iters", "3", "--lr-warmup-iters", "1"]
    )
    assert sorted(samples.losses) == [1, 2, 3]
    assert samples.losses == iterations.losses


def test_wsd_annealing_shorter_than_one_iteration_still_ends_at_min_lr():
    # --lr-wsd-decay-samples 4 at global batch 8: half an iteration of annealing
    config = cfg(
        warmup_iters=0,
        decay_iters=10,
        decay_style="WSD",
        wsd_decay_iters=0.5,
        wsd_decay_style="linear",
    )
    assert learning_rate_at(9, config) == pytest.approx(1.0)
    assert learning_rate_at(10, config) == pytest.approx(0.1)


def test_the_same_schedule_written_another_way_is_not_a_difference():
    from megatron.core.optimizer.lr_scheduler import OptimizerParamScheduler

    class Optimizer:
        param_groups = [{"lr": 0.0}]

    saved = OptimizerParamScheduler(Optimizer(), config=cfg(warmup_iters=7)).state_dict()
    fraction = OptimizerParamScheduler(Optimizer(), config=cfg(warmup_iters=0.07 * 100))
    assert 0.07 * 100 != 7 and fraction.config_differences(saved) == []
    longer = OptimizerParamScheduler(Optimizer(), config=cfg(warmup_iters=8))
    assert longer.config_differences(saved) == [("warmup_iters", 7, 8)]
