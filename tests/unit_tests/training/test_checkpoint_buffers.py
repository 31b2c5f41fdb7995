"""Persistent buffers in checkpoints: the routers' aux-loss-free expert bias
(--moe-router-enable-expert-bias) is model state that training changes, so a checkpoint holds
it (model_buffers.pt, every --ckpt-format) and a resumed run continues with it: its next losses
equal the uninterrupted run's within 1e-6; dropping the file (as checkpoints before it did)
changes them."""

from __future__ import annotations

import pytest
import torch

from tests.unit_tests.training.common import run_pretrain
from tests.unit_tests.training.test_moe_training import TINY_MOE

SAVE_AT, TOTAL = 3, 6
BIASED = [
    *TINY_MOE,
    "--train-iters", str(TOTAL),
    "--moe-router-score-function", "sigmoid",
    "--moe-router-enable-expert-bias",
    # A large rate, so that the bias after 3 steps changes which experts tokens go to.
    "--moe-router-bias-update-rate", "0.5",
]  # fmt: skip
BIAS = "decoder.layers.1.mlp.router.expert_bias"


ZERO3 = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]


@pytest.mark.parametrize(
    "ckpt_format, engine",
    [("torch", []), ("torch_dist", []), ("torch_dist", ZERO3)],
    ids=["ddp-torch", "ddp-torch_dist", "megatron_fsdp-torch_dist"],
)
def test_resume_continues_with_the_saved_expert_bias(tmp_path, ckpt_format, engine) -> None:
    directory = tmp_path / "ckpt"
    fmt = ["--ckpt-format", ckpt_format, *engine]
    save = ["--save", str(directory), "--save-interval", str(SAVE_AT)]
    uninterrupted = run_pretrain(BIASED + fmt + save).losses
    iteration = directory / f"iter_{SAVE_AT:07d}"
    saved = torch.load(iteration / "model_buffers.pt", weights_only=True)
    assert sorted(saved) == [BIAS]
    # Each step moves each entry by -0.5, 0 or +0.5 (the sign of its load offset).
    bias = saved[BIAS]
    assert bias.shape == (4,) and 0 < bias.abs().max() <= 0.5 * SAVE_AT
    assert torch.equal(bias * 2, (bias * 2).round())
    load = ["--load", str(directory), "--ckpt-step", str(SAVE_AT)]
    resumed = run_pretrain(BIASED + fmt + load).losses
    assert sorted(resumed) == list(range(SAVE_AT + 1, TOTAL + 1))
    for step, loss in resumed.items():
        assert loss == pytest.approx(uninterrupted[step], rel=1e-6, abs=0), step
    # Without the file the bias restarts at zero and the run differs.
    (iteration / "model_buffers.pt").unlink()
    restarted = run_pretrain(BIASED + fmt + load).losses
    assert any(
        abs(restarted[step] - uninterrupted[step]) > 1e-5 for step in range(SAVE_AT + 1, TOTAL + 1)
    )
