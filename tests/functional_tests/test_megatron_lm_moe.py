"""Megatron-LM's MoE command lines (issue 38, acceptance 4): its Mixtral example script and its
MoE functional-test configs with TP = PP = 1, with and without Megatron-FSDP, run under
torchrun on CPU at their expert-parallel size (megatron_lm_moe.py says what is made tiny).
Those that need a flag we have not built exit 2 before training with one line naming exactly
the flags docs/MEGATRON_LM_FLAGS.md lists for them."""

from __future__ import annotations

import contextlib
import io
import math
import os
import re

import pytest

from megatron.training.flags.arguments import parse_args
from tests.functional_tests.megatron_lm_moe import config_names, tiny_run
from tests.launch import run_torchrun

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCH_TIMEOUT_S = 600

MUON = "--optimizer: invalid choice: 'muon'"
# Without --optimizer muon, the rest of each muon line's unbuilt flags, in the one line.
MUON_REST = {
    "gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_muon": [
        "--muon-extra-scale-factor 0.2",
        "--no-use-layer-wise-param-layout",
    ],
    "gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_muon_param_layout": [
        "--muon-extra-scale-factor 0.2"
    ],
    "gpt3_moe_mcore_te_ep8_resume_torch_dist_muon": [
        "--muon-extra-scale-factor 0.2",
        "--check-weight-hash-across-dp-replicas-interval 1",
    ],
}
# Config -> the flags of it that are not built (docs/MEGATRON_LM_FLAGS.md, "MoE command lines").
UNBUILT = {
    "gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_muon": [MUON],
    "gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_muon_param_layout": [MUON],
    "gpt3_moe_mcore_te_ep8_resume_torch_dist_muon": [MUON],
}
RUNNABLE = [name for name in config_names() if name not in UNBUILT]
# Config -> its flags that change nothing here, each with its log note (MEGATRON_LM_FLAGS.md).
NOTED = {
    "deepseek_proxy_fsdp_ep2_fsdp2_ep_overlap": [
        "--overlap-moe-expert-parallel-comm",
        "--delay-wgrad-compute",
    ],
    "gpt3_mcore_te_tp1_pp1_te_4experts_groupedGEMM_op_fuser": ["--use-transformer-engine-op-fuser"],
}


def _error_line(argv: list[str], world_size: int) -> str:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as info:
        parse_args(argv, world_size=world_size)
    assert info.value.code == 2
    lines = [line for line in err.getvalue().splitlines() if "error:" in line]
    assert len(lines) == 1, err.getvalue()
    return lines[0]


def _logged_losses(text: str) -> dict[int, float]:
    found = re.findall(r"iteration\s+(\d+)/\s*\d+ \|.*? lm loss: (\S+) \|", text)
    return {int(step): float(loss) for step, loss in found}


def test_every_tp1_pp1_moe_config_is_here():
    assert len(config_names()) == 9
    assert set(UNBUILT) <= set(config_names())


@pytest.mark.parametrize("name", sorted(UNBUILT))
def test_unbuilt_flags_are_named_in_one_line(name, tmp_path):
    run = tiny_run(name, tmp_path)
    line = _error_line(run.argv, run.nproc)
    for flag in UNBUILT[name]:
        assert flag in line, line


@pytest.mark.parametrize("name", sorted(MUON_REST))
def test_muon_lines_name_every_unbuilt_flag_once_muon_is_dropped(name, tmp_path):
    argv = tiny_run(name, tmp_path).argv
    at = argv.index("--optimizer")
    line = _error_line(argv[:at] + argv[at + 2 :], 4)
    assert "has not built these Megatron-LM features" in line
    for flag in MUON_REST[name]:
        assert flag in line, line


def _train(argv: list[str], nproc: int, env: dict[str, str]) -> tuple[dict[int, float], str]:
    """(the logged losses by iteration, the run's output)."""
    status, stdout, stderr = run_torchrun(
        ["pretrain_gpt.py", *argv], nproc=nproc, cwd=REPO_ROOT, timeout_s=LAUNCH_TIMEOUT_S, env=env
    )
    text = stdout + stderr
    assert status == 0, text[-4000:]
    return _logged_losses(text), text


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNNABLE)
def test_config_trains_under_torchrun_at_its_ep_size(name, tmp_path):
    run = tiny_run(name, tmp_path)
    losses, text = _train(run.argv, run.nproc, run.env)
    assert sorted(losses) == [1, 2, 3]
    for flag in NOTED.get(name, []):
        assert f"{flag}: no effect here" in text, flag
    assert all(math.isfinite(loss) and 5.0 < loss < 7.5 for loss in losses.values())
    if "--save" in run.argv:
        assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


@pytest.mark.slow
def test_mixtral_script_trains_as_written(tmp_path):
    """The Mixtral line, EP 8 made 4 (pipeline size 4 made 1), as written: alltoall dispatch
    over 4 ranks, --use-distributed-optimizer, and --no-position-embedding with rope (the log
    says why it changes nothing, as in Megatron-LM)."""
    run = tiny_run("mixtral", tmp_path)
    assert run.nproc == 4 and "--expert-model-parallel-size" in run.argv
    assert "--no-position-embedding" in run.argv and "rope" in run.argv
    losses, text = _train(run.argv, run.nproc, run.env)
    assert sorted(losses) == [1, 2, 3]
    assert all(math.isfinite(loss) and 5.0 < loss < 7.5 for loss in losses.values())
    assert "--no-position-embedding: no effect here" in text
