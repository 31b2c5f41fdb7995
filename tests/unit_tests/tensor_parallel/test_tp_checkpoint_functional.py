"""Issue 40, acceptance 4, under torchrun on CPU: Megatron-LM's functional config
gpt3_mcore_te_tp2_zp_z3_resume_fsdp_dtensor as written (its --save/--load, --save-interval,
--ckpt-format fsdp_dtensor, --async-save and --use-persistent-ckpt-worker) but for model size,
data, iteration counts and paths, trains at TP 2 with Megatron-FSDP ZeRO-3 and resumes: the
resumed iterations log the losses of the uninterrupted run. Its TP 2 x PP 2 sibling with
--tp-comm-overlap (gpt3_weekly_mcore_tp2_pp2_current_scaling_native_fp8_tp_pp_sp_tp_overlap)
is refused at parse time in one exit-2 line naming the unbuilt flags."""

from __future__ import annotations

import math
import os
import re

import pytest

from megatron.training.flags.arguments import parse_args
from tests.launch import run_torchrun
from tests.unit_tests.tensor_parallel.test_tp_functional_config import (
    TP2_ZP_Z3_RESUME_FSDP_DTENSOR,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))

# Its MODEL_ARGS in file order (a `true` is the bare flag): 12 layers -> 2, hidden 512 -> 64,
# global batch 128 -> 8, seq 1024 -> 32, 2000 iterations -> 3, data -> mock, nccl -> gloo.
TP2_PP2_TP_OVERLAP = """
    --num-layers 2 --hidden-size 64 --num-attention-heads 8 --log-params-norm
    --log-num-zeros-in-grad --log-validation-ppl-to-tensorboard --log-timers-to-tensorboard
    --tensorboard-dir {tmp}/tb --micro-batch-size 2 --global-batch-size 8 --seq-length 32
    --max-position-embeddings 32 --train-iters 3 --timing-log-level 0 --lr-decay-iters 320000
    --save {tmp}/ckpt --load {tmp}/ckpt --mock-data --tokenizer-type NullTokenizer
    --vocab-size 512 --split 949,50,1 --distributed-backend gloo --lr 0.00015
    --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2 --clip-grad 1.0
    --lr-warmup-fraction .01 --log-interval 1 --save-interval 10000 --eval-interval 1000
    --eval-iters 10 --transformer-impl transformer_engine --tensor-model-parallel-size 2
    --pipeline-model-parallel-size 2 --sequence-parallel --tp-comm-overlap
    --tp-comm-overlap-cfg {tmp}/tp_comm_overlap_cfg.yaml --deterministic-mode
    --no-gradient-accumulation-fusion --fp8-format hybrid --fp8-recipe tensorwise
    --fp8-param-gather --use-distributed-optimizer --attention-softmax-in-fp32
    --ckpt-format torch_dist --dist-ckpt-strictness log_all --data-cache-path {tmp}/cache
    --bf16 --log-memory-to-tensorboard --normalization RMSNorm --async-save
    --use-persistent-ckpt-worker
"""
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*? lm loss: (\S+) \|")


def _train(argv: list[str]) -> tuple[dict[int, float], str]:
    status, stdout, stderr = run_torchrun(
        [os.path.join(REPO, "pretrain_gpt.py"), *argv], nproc=2, cwd=REPO, timeout_s=600
    )
    assert status == 0, stderr[-3000:]
    return {int(it): float(loss) for it, loss in LOSS.findall(stdout)}, stdout


def _with_train_iters(argv: list[str], iters: int) -> list[str]:
    argv = list(argv)
    argv[argv.index("--train-iters") + 1] = str(iters)
    return argv


def test_tp2_zero3_fsdp_dtensor_config_trains_and_resumes_under_torchrun(tmp_path) -> None:
    """3 iterations saving at 2 and 3 (--save-interval 2), as written; then the same line
    stopped at 2 and run again to 3 resumes from iteration 2 with iteration 3's loss."""
    whole = TP2_ZP_Z3_RESUME_FSDP_DTENSOR.format(tmp=tmp_path / "whole").split()
    losses, stdout = _train(whole)
    assert sorted(losses) == [1, 2, 3]
    assert all(math.isfinite(v) and 5.0 < v < 7.5 for v in losses.values()), losses
    assert "use-megatron-fsdp=True data-parallel-size=1 tensor-parallel-size=2" in stdout
    saved = tmp_path / "whole" / "ckpt"
    assert (saved / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert (saved / "iter_0000002" / "sharded" / ".metadata").is_file()

    parted = TP2_ZP_Z3_RESUME_FSDP_DTENSOR.format(tmp=tmp_path / "parted").split()
    first, _ = _train(_with_train_iters(parted, 2))
    assert first == {1: losses[1], 2: losses[2]}
    resumed, stdout = _train(parted)
    assert "loaded checkpoint" in stdout and "(iteration 2)" in stdout
    assert sorted(resumed) == [3]
    assert resumed[3] == pytest.approx(losses[3], rel=1e-6)


def test_tp2_pp2_tp_comm_overlap_config_is_refused_naming_the_unbuilt_flags(
    tmp_path, capsys
) -> None:
    (tmp_path / "tp_comm_overlap_cfg.yaml").write_text("qkv_fprop:\n  method: ring_exchange\n")
    argv = TP2_PP2_TP_OVERLAP.format(tmp=tmp_path).split()
    with pytest.raises(SystemExit) as info:
        parse_args(argv, world_size=4)
    assert info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1, errors
    for flag in ("--pipeline-model-parallel-size 2", "--tp-comm-overlap (userbuffers)"):
        assert flag in errors[0], errors[0]
