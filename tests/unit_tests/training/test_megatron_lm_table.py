"""Every flag of Megatron-LM core_v0.19.0's arguments.py is known (issue 36, acceptance 2)."""

from __future__ import annotations

import pytest

from megatron.training.flags import megatron_lm_table as table
from megatron.training.flags.arguments import build_parser, parse_args
from megatron.training.flags.configs import resolved_flags
from tests.unit_tests.training.common import TINY_GPT

NOT_BUILT = "megatron-fp8 has not built these Megatron-LM features"


def _values(arity: str, default: str) -> list[str]:
    """A value of the flag's arity that differs from Megatron-LM's default where it can."""
    if arity in ("0", "?"):
        return []
    count = 1 if arity in ("1", "+", "*") else int(arity)
    return ["7"] * count


def _outcome(argv, capsys) -> tuple[int, str, list[str]]:
    try:
        args = parse_args(TINY_GPT + argv, world_size=1)
    except SystemExit as error:
        return error.code, capsys.readouterr().err, []
    return 0, "", list(resolved_flags(args, world_size=1).megatron_lm_notes)


def test_table_names_the_release_and_holds_every_flag_once():
    with open(table.TABLE, encoding="utf-8") as handle:
        assert handle.readline().startswith("# Megatron-LM core_v0.19.0 (2026-08-19)")
    rows = table.read_table()
    flags = [row[0] for row in rows]
    assert len(flags) == len(set(flags)) == 846
    assert ("--tp-comm-overlap-cfg", "1", "None") in rows


def test_every_table_flag_is_known_to_the_parser():
    known = build_parser()._option_string_actions
    assert [row[0] for row in table.read_table() if row[0] not in known] == []


def test_every_added_flag_is_refused_by_name_or_accepted_with_a_note(capsys):
    """Each flag the table adds, given with a value of its arity: exit 2 with the one not-built
    message naming it, or a run whose notes say why it has no effect here."""
    own = {
        flag
        for action in build_parser()._actions
        if not isinstance(action, table._Given)
        for flag in action.option_strings
    }
    counts = {"refused": 0, "noted": 0}
    for flag, arity, default in table.read_table():
        if flag in own:
            continue
        argv = [flag, *_values(arity, default)]
        code, err, notes = _outcome(argv, capsys)
        written = " ".join(argv)
        if code == 2:
            assert err.count("error:") == 1 and NOT_BUILT in err and written in err, (argv, err)
            counts["refused"] += 1
        else:
            assert code == 0 and any(note.startswith(f"{written}: no effect") for note in notes)
            counts["noted"] += 1
    assert counts["refused"] > 400 and counts["noted"] > 60, counts


def test_own_flags_of_the_table_are_never_unrecognized(capsys):
    for flag, arity, default in table.read_table():
        code, err, _ = _outcome([flag, *_values(arity, default)], capsys)
        assert "unrecognized arguments" not in err, flag


def test_tp_comm_overlap_cfg_is_named_with_the_other_unbuilt_features(capsys):
    code, err, _ = _outcome(
        [
            "--tp-comm-overlap-cfg",
            "x.yaml",
            "--tensor-model-parallel-size",
            "2",
            "--tp-comm-overlap",
        ],
        capsys,
    )
    assert code == 2 and err.count("error:") == 1
    # Tensor parallelism itself is built (issue 40); its userbuffers overlap is not.
    assert "--tp-comm-overlap-cfg x.yaml" in err and "--tp-comm-overlap (userbuffers)" in err
    assert "unrecognized" not in err


@pytest.mark.parametrize(
    "argv, note",
    [
        (["--ddp-bucket-size", "40000000"], "communication scheduling knob"),
        (["--log-energy"], "logging switch"),
        (["--no-bias-gelu-fusion"], "kernel choice"),
        (["--ckpt-fully-parallel-load"], "checkpoint I/O knob"),
        (["--attention-dropout", "0.1", "--rotary-seq-len-interpolation-factor", "2"], None),
        (["--weight-decay-incr-style", "constant"], "Megatron-LM's default ('constant')"),
        (["--start-weight-decay", "7"], None),
    ],
)
def test_one_note_or_one_refusal(argv, note, capsys):
    code, err, notes = _outcome(argv, capsys)
    if note is None:
        assert code == 2 and f"{argv[-2]} {argv[-1]}" in err
    else:
        assert code == 0 and [n for n in notes if note in n] != []
        assert sum(n.startswith(argv[0]) for n in notes) == 1


def test_value_equal_to_the_default_is_recognised():
    assert table.is_megatron_lm_default("1.0", "1.0")
    assert table.is_megatron_lm_default("1", "1.0")
    assert table.is_megatron_lm_default("single", "'single'")
    assert table.is_megatron_lm_default(["1", "2"], "[1, 2]")
    assert not table.is_megatron_lm_default("2", "1.0")
    assert not table.is_megatron_lm_default("x", "None")
    assert not table.is_megatron_lm_default([], "False")


def test_help_names_the_table_and_hides_its_flags():
    text = build_parser().format_help()
    assert "megatron_lm_core_v0.19.0.tsv" in text
    assert "--tp-comm-overlap-cfg" not in text and "--use-distributed-optimizer" in text


@pytest.mark.parametrize("embedding", ["rope", "learned_absolute"])
def test_no_position_embedding_as_megatron_lm_validates_it(embedding, capsys):
    """Megatron-LM's deprecated --no-position-embedding: accepted with rope (Megatron-core's GPT
    model adds a learned position embedding only for learned_absolute, so with rope it changes
    nothing), refused otherwise as Megatron-LM's validate_args refuses it, naming the fix."""
    code, err, notes = _outcome(
        ["--no-position-embedding", "--position-embedding-type", embedding], capsys
    )
    if embedding == "rope":
        mine = [n for n in notes if n.startswith("--no-position-embedding: no effect here")]
        assert (
            code == 0 and len(mine) == 1 and "only with --position-embedding-type rope" in mine[0]
        )
    else:
        assert code == 2 and err.count("error:") == 1 and NOT_BUILT in err
        assert "--no-position-embedding (deprecated in Megatron-LM" in err
        assert "choose the embedding with --position-embedding-type" in err


def _moe_outcome(extra: list[str], capsys) -> tuple[int, str, list[str]]:
    """A tiny MoE line at 2 ranks (bf16, alltoall dispatch, EP 2 unless extra says) + extra."""
    moe = ["--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2"]
    moe += ["--moe-token-dispatcher-type", "alltoall", "--bf16", "--disable-bias-linear"]
    argv = TINY_GPT + moe + ["--expert-model-parallel-size", "2", *extra]
    try:
        args = parse_args(argv, world_size=2)
    except SystemExit as error:
        return error.code, capsys.readouterr().err, []
    return 0, "", list(resolved_flags(args, world_size=2).megatron_lm_notes)


OVERLAP, DELAY = "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"


@pytest.mark.parametrize(
    "extra, refusal",
    [
        ([OVERLAP, DELAY], None),
        ([OVERLAP], None),
        ([OVERLAP, DELAY, "--transformer-impl", "transformer_engine"], None),
        ([DELAY], f"{DELAY} (Megatron-LM refuses it without {OVERLAP})"),
        ([OVERLAP, DELAY, "--transformer-impl", "local"], "with --transformer-impl local"),
        ([OVERLAP, DELAY, "--transformer-impl", "inference_optimized"], "with --transformer-impl"),
        ([OVERLAP, "--expert-model-parallel-size", "1"], "without --expert-model-parallel-size"),
        ([OVERLAP, "--moe-token-dispatcher-type", "allgather"], "without --moe-token-dispatcher"),
        (
            [OVERLAP, "--recompute-granularity", "full", "--recompute-method", "uniform"]
            + ["--recompute-num-layers", "1"],
            "with --recompute-granularity full",
        ),
        ([OVERLAP, "--mtp-num-layers", "2"], "with --mtp-num-layers above 1"),
        ([OVERLAP, "--recompute-activations", "--recompute-modules", "moe"], "with --recompute-"),
        ([OVERLAP, "--moe-layer-recompute"], "with --recompute-modules moe"),
    ],
)
def test_expert_parallel_overlap_schedules_as_megatron_lm_validates_them(extra, refusal, capsys):
    """Megatron-LM's A2A-overlap schedule flags (the deepseek_proxy ep_overlap config): speed
    only, accepted with a note each where Megatron-LM's validation accepts them, else refused
    in the one line with what Megatron-LM needs."""
    code, err, notes = _moe_outcome(extra, capsys)
    if refusal is None:
        for flag in {OVERLAP, DELAY} & set(extra):
            mine = [n for n in notes if n.startswith(f"{flag}: no effect here: a schedule")]
            assert code == 0 and len(mine) == 1, (flag, notes)
    else:
        assert code == 2 and err.count("error:") == 1 and NOT_BUILT in err and refusal in err, err


def test_expert_parallel_overlap_names_every_missing_setting_in_one_line(capsys):
    """fp32 (no --bf16) and allgather dispatch at once: both named, in Megatron-LM's terms."""
    moe = ["--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2"]
    argv = TINY_GPT + moe + ["--disable-bias-linear", "--expert-model-parallel-size", "2", OVERLAP]
    with pytest.raises(SystemExit) as info:
        parse_args(argv + ["--moe-token-dispatcher-type", "allgather"], world_size=2)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("error:") == 1
    want = "without --moe-token-dispatcher-type alltoall (or flex); without --bf16 (or --fp16)"
    assert f"{OVERLAP} (Megatron-LM refuses it {want})" in err, err


SHARED_OVERLAP = "--moe-shared-expert-overlap"
SHARED = ["--moe-shared-expert-intermediate-size", "32"]


@pytest.mark.parametrize(
    "extra, refusal",
    [
        ([SHARED_OVERLAP, *SHARED], None),
        ([SHARED_OVERLAP], None),  # no shared experts: no effect in Megatron-LM either
        ([SHARED_OVERLAP, "--moe-token-dispatcher-type", "allgather"], None),
        (
            [SHARED_OVERLAP, *SHARED, "--moe-token-dispatcher-type", "allgather"],
            "without --moe-token-dispatcher-type alltoall (or flex)",
        ),
        (
            [SHARED_OVERLAP, *SHARED, "--recompute-activations"]
            + ["--recompute-modules", "shared_experts"],
            "with selective --recompute-modules shared_experts",
        ),
        ([SHARED_OVERLAP, *SHARED, "--bf16", OVERLAP], f"with {OVERLAP}"),
    ],
)
def test_shared_expert_overlap_is_a_schedule_where_megatron_lm_validates_it(extra, refusal, capsys):
    code, err, notes = _moe_outcome(extra, capsys)
    if refusal is None:
        mine = [n for n in notes if n.startswith(f"{SHARED_OVERLAP}: no effect here: a schedule")]
        assert code == 0 and len(mine) == 1, notes
    else:
        want = f"{SHARED_OVERLAP} (Megatron-LM refuses it {refusal})"
        assert code == 2 and err.count("error:") == 1 and want in err, err


def test_expert_parallel_overlap_refuses_the_shared_expert_overlap_with_or_without_them(capsys):
    """Megatron-LM asserts `not moe_shared_expert_overlap` under the A2A overlap whether or not
    shared experts are set."""
    for shared in ([], SHARED):
        code, err, _ = _moe_outcome([OVERLAP, SHARED_OVERLAP, *shared], capsys)
        want = f"{OVERLAP} (Megatron-LM refuses it with {SHARED_OVERLAP})"
        assert code == 2 and err.count("error:") == 1 and want in err, err


def test_moe_router_fusion_is_a_kernel_choice(capsys):
    code, _, notes = _moe_outcome(["--moe-router-fusion"], capsys)
    mine = [n for n in notes if n.startswith("--moe-router-fusion: no effect here: a kernel")]
    assert code == 0 and len(mine) == 1, notes


def test_transformer_engine_op_fuser_is_a_kernel_choice_where_megatron_lm_builds_it(capsys):
    code, _, notes = _outcome(["--use-transformer-engine-op-fuser"], capsys)
    mine = [n for n in notes if n.startswith("--use-transformer-engine-op-fuser: no effect")]
    assert code == 0 and len(mine) == 1 and "kernel choice" in mine[0]
    # Grouped MoE experts: Megatron-LM's fused grouped MLP needs a gated activation.
    fused = ["--use-transformer-engine-op-fuser", "--moe-grouped-gemm"]
    assert _moe_outcome([*fused, "--swiglu"], capsys)[0] == 0
    code, err, _ = _moe_outcome(fused, capsys)
    assert code == 2 and "refuses it without --swiglu (grouped MoE experts)" in err, err


def test_an_fp8_recipe_without_a_format_is_noted(capsys):
    """Megatron-LM turns FP8 on by --fp8-format; here --fp8-recipe alone does (hybrid), and the
    log says so. With the format given, or no recipe, there is no such note."""
    code, _, notes = _outcome(["--fp8-recipe", "tensorwise"], capsys)
    assert code == 0
    assert [n for n in notes if n.startswith("--fp8-recipe")] == [
        "--fp8-recipe tensorwise without --fp8-format trains in FP8 here, with --fp8-format "
        "hybrid (Megatron-LM turns FP8 on by --fp8-format only and would train this line in bf16)."
    ]
    for argv in (["--fp8-recipe", "tensorwise", "--fp8-format", "hybrid"], []):
        _, _, notes = _outcome(argv, capsys)
        assert not [n for n in notes if n.startswith("--fp8-recipe")]


def test_query_groups_read_as_megatron_lm_reads_them(capsys):
    """--group-query-attention alone is one key/value head (Megatron-LM's --num-query-groups
    default 1); --num-query-groups alone is ignored (every head its own keys and values)."""
    args = parse_args(TINY_GPT + ["--group-query-attention"], world_size=1)
    flags = resolved_flags(args, world_size=1)
    assert flags.num_query_groups == 1
    assert any(n.startswith("--group-query-attention without") for n in flags.megatron_lm_notes)
    args = parse_args(TINY_GPT + ["--num-query-groups", "2"], world_size=1)
    flags = resolved_flags(args, world_size=1)
    assert flags.num_query_groups is None
    assert "--num-query-groups 2 without --group-query-attention: ignored" in " ".join(
        flags.megatron_lm_notes
    )
    args = parse_args(TINY_GPT + ["--group-query-attention", "--num-query-groups", "2"])
    assert resolved_flags(args, world_size=1).num_query_groups == 2
