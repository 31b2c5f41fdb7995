"""Megatron-LM's readings of flags a command line leaves half given (session 46, a Megatron-LM
user's review): each is resolved as Megatron-LM resolves it, or differs and the log says how.

- `--group-query-attention` without `--num-query-groups`: one key/value head (multi-query
  attention; Megatron-LM's `--num-query-groups` defaults to 1); `--num-query-groups` without
  `--group-query-attention` is ignored (every head has its own keys and values).
- `--fp8-recipe R` without `--fp8-format`: FP8 with `hybrid` here, where Megatron-LM turns FP8 on
  by `--fp8-format` only (configs.resolved_flags applies it and logs RECIPE_ALONE_NOTE).
- A schedule that changes the lr: update k uses the schedule's value at k here; Megatron-LM
  steps its scheduler after the optimizer, so its update k uses the value at k - 1 (the lr
  logged at k is the same in both). Not aligned yet: the one-step shift moved FP8 roundings of
  tests whose bounds were measured on today's trajectory (EP 2 against EP 1, DP 4 against
  DP 2 resumes); logged (SCHEDULE_NOTE) until it is.
"""

from __future__ import annotations

import argparse

QUERY_GROUPS_NOTES = (
    "--group-query-attention without --num-query-groups: one key/value head (multi-query "
    "attention), Megatron-LM's default --num-query-groups 1.",
    "--num-query-groups {} without --group-query-attention: ignored (every head has its own "
    "keys and values), as in Megatron-LM.",
)
RECIPE_ALONE_NOTE = (
    "--fp8-recipe {} without --fp8-format trains in FP8 here, with --fp8-format hybrid "
    "(Megatron-LM turns FP8 on by --fp8-format only and would train this line in bf16)."
)

SCHEDULE_NOTE = (
    "learning-rate schedule: update k uses its value at step k; Megatron-LM steps the scheduler "
    "after the optimizer, so its update k uses the value at step k - 1 (with warmup from "
    "--lr-warmup-init 0 its first update is at lr 0); the lr logged at step k is the same."
)


def schedule_note(flags: argparse.Namespace) -> list[str]:
    """SCHEDULE_NOTE where the schedule changes the lr (a warmup, or a decay that is not
    constant)."""
    warmup = flags.lr_warmup_iters or flags.lr_warmup_fraction or flags.lr_warmup_samples
    return [SCHEDULE_NOTE] if warmup or flags.lr_decay_style != "constant" else []


def resolve_query_groups(flags: argparse.Namespace) -> None:
    """--num-query-groups counts only with --group-query-attention, and defaults to 1 there."""
    if flags.group_query_attention and flags.num_query_groups is None:
        flags.num_query_groups = 1
        flags.megatron_lm_notes.append(QUERY_GROUPS_NOTES[0])
    elif not flags.group_query_attention and flags.num_query_groups is not None:
        flags.megatron_lm_notes.append(QUERY_GROUPS_NOTES[1].format(flags.num_query_groups))
        flags.num_query_groups = None
