"""pretrain_gpt.py with SIGKILLs at planned moments: the worker of test_chaos_restart.py.

torchrun starts `chaos_worker.py <pretrain_gpt.py flags>` instead of pretrain_gpt.py. The plan
(JSON in MEGATRON_CHAOS_PLAN) lists kills as {"attempt", "rank", "iteration", "moment"}; the
worker whose rank and TORCHELASTIC_RESTART_COUNT match one kills itself with SIGKILL at that
moment of that iteration:

  after-backward  in the training step, after forward and backward, before the optimizer step
  save-partial    during the save, once this rank's files are in iter_XXXXXXX.tmp, before
                  metadata.json is written and the directory is published
  save-published  rank 0, after iter_XXXXXXX.tmp was renamed into place and before the tracker
                  file names it

Why from inside: a save of the test's tiny model takes milliseconds, so a kill sent from outside
on seeing a log line lands anywhere within the next iterations and cannot be aimed at a save.
SIGKILL from inside is the same signal as from outside: no handler, no flush, no cleanup. The
hooks wrap module functions from here; the product code has no test switch.
"""

from __future__ import annotations

import functools
import json
import os
import runpy
import signal
import sys

PLAN_ENV = "MEGATRON_CHAOS_PLAN"
MOMENTS = ("after-backward", "save-partial", "save-published")
PRETRAIN_GPT = os.path.abspath(
    os.path.join(os.path.dirname(__file__), "..", "..", "pretrain_gpt.py")
)


def _die(kill: dict) -> None:
    os.write(
        2,
        f"chaos: SIGKILL to rank {kill['rank']} in attempt {kill['attempt']} at iteration "
        f"{kill['iteration']} ({kill['moment']})\n".encode(),
    )
    os.kill(os.getpid(), signal.SIGKILL)


def _install(kills: list[dict]) -> None:
    from megatron.training import training
    from megatron.training.checkpoint import save as checkpoint_save

    current = {"step": 0, "save": 0}  # the iteration being trained, the one being saved
    planned = {(kill["moment"], kill["iteration"]): kill for kill in kills}

    def after(name: str, moment: str, module, counter: str) -> None:
        original = getattr(module, name)  # AttributeError: the hook point moved; fix this file

        @functools.wraps(original)
        def hooked(*args, **kwargs):
            result = original(*args, **kwargs)
            if (kill := planned.get((moment, current[counter]))) is not None:
                _die(kill)
            return result

        setattr(module, name, hooked)

    def track(name: str, module, counter: str, *, ahead: int) -> None:
        original = getattr(module, name)

        @functools.wraps(original)
        def tracked(*args, **kwargs):
            current[counter] = kwargs["state"].iteration + ahead
            return original(*args, **kwargs)

        setattr(module, name, tracked)

    # train_step runs before its iteration is counted; save_checkpoint after.
    track("train_step", training, "step", ahead=1)
    track("save_checkpoint", training, "save", ahead=0)  # the name the loop calls
    after("forward_backward", "after-backward", training, "step")
    after("_write_checkpoint_files", "save-partial", checkpoint_save, "save")
    after("publish_dir", "save-published", checkpoint_save, "save")


def main() -> None:
    plan = json.loads(os.environ.get(PLAN_ENV, "[]"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ.get("RANK", "0"))
    kills = [kill for kill in plan if (kill["attempt"], kill["rank"]) == (attempt, rank)]
    unknown = [kill["moment"] for kill in kills if kill["moment"] not in MOMENTS]
    if unknown:
        raise SystemExit(f"chaos_worker: unknown moments {unknown}; known: {MOMENTS}")
    _install(kills)
    sys.argv = [PRETRAIN_GPT, *sys.argv[1:]]
    runpy.run_path(PRETRAIN_GPT, run_name="__main__")


if __name__ == "__main__":
    main()
