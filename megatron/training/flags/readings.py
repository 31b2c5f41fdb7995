"""Megatron-LM's readings of flags a command line leaves half given (session 46, a Megatron-LM
user's review): each is resolved as Megatron-LM resolves it, or differs and the log says how.

- `--group-query-attention` without `--num-query-groups`: one key/value head (multi-query
  attention; Megatron-LM's `--num-query-groups` defaults to 1); `--num-query-groups` without
  `--group-query-attention` is ignored (every head has its own keys and values).
- `--fp8-recipe R` without `--fp8-format`: FP8 with `hybrid` here, where Megatron-LM turns FP8 on
  by `--fp8-format` only (configs.resolved_flags applies it and logs RECIPE_ALONE_NOTE).
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


def resolve_query_groups(flags: argparse.Namespace) -> None:
    """--num-query-groups counts only with --group-query-attention, and defaults to 1 there."""
    if flags.group_query_attention and flags.num_query_groups is None:
        flags.num_query_groups = 1
        flags.megatron_lm_notes.append(QUERY_GROUPS_NOTES[0])
    elif not flags.group_query_attention and flags.num_query_groups is not None:
        flags.megatron_lm_notes.append(QUERY_GROUPS_NOTES[1].format(flags.num_query_groups))
        flags.num_query_groups = None
