"""Flag list frozen; every invalid combination exits with status 2 and names the fix."""

import os
import subprocess
import sys

import pytest
import torch

from megatron.training.flags.arguments import build_parser, parse_args
from megatron.training.flags.configs import build_run_config, resolved_flags
from tests.unit_tests.training.common import TINY_GPT, run_pretrain

FROZEN = os.path.join(os.path.dirname(__file__), "frozen_flags.txt")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def test_flag_list_is_frozen():
    """Flags are a public interface: adding/removing one must update frozen_flags.txt."""
    parser = build_parser()
    flags = sorted(
        option
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    )
    with open(FROZEN) as handle:
        assert flags == handle.read().split()


def test_every_flag_has_help():
    for action in build_parser()._actions:
        assert action.help, f"{action.option_strings} has no help text"
    text = build_parser().format_help()  # raises on a stray % in any help string
    assert text.count("\n  --") >= 85 and "Exit when iteration % N == 0." in text


def parse_error(argv, capsys, world_size=1) -> str:
    with pytest.raises(SystemExit) as info:
        parse_args(argv, world_size=world_size)
    assert info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, world_size, expected",
    [
        (["--global-batch-size", "7"], 1, "--global-batch-size 7 is not a multiple of"),
        (["--global-batch-size", "8"], 3, "data-parallel size 3 = 6"),
        (["--hidden-size", "66"], 1, "not divisible by --num-attention-heads"),
        (["--group-query-attention", "--num-query-groups", "3"], 1, "not a multiple of"),
        (["--fp8-format", "e5m2", "--fp8-recipe", "tensorwise"], 1, "E5M2 alone is not allowed"),
        (
            ["--fp8-recipe", "blockwise", "--hidden-size", "72", "--num-attention-heads", "4"],
            1,
            "--hidden-size 72 is not divisible by 16",
        ),
        (
            ["--fp8-recipe", "mxfp8", "--ffn-hidden-size", "200"],
            1,
            "--ffn-hidden-size 200 is not divisible by 16",
        ),
        (["--fp8-recipe", "fp4"], 1, "invalid choice: 'fp4'"),
        (["--fp8-param-gather", "--fp8-recipe", "mxfp8"], 1, "add --use-megatron-fsdp"),
        (["--fp8-param-gather"], 1, "needs --fp8-recipe"),
        (["--fp8-wgrad-input-from-activation"], 1, "needs --fp8-recipe"),
        (["--overlap-param-gather"], 1, "is a Megatron-FSDP option"),
        (["--main-grads-dtype", "fp64"], 1, "--main-grads-dtype fp64 sets Megatron-FSDP's"),
        (
            [
                "--use-megatron-fsdp",
                "--megatron-fsdp-main-grads-dtype",
                "fp64",
                "--megatron-fsdp-grad-comm-dtype",
                "fp32",
            ],
            1,
            "--megatron-fsdp-grad-comm-dtype fp32 with fp64 grad buffers is not built",
        ),
        (
            ["--ckpt-format", "fsdp_dtensor"],
            1,
            "add --use-megatron-fsdp, or use --ckpt-format torch_dist",
        ),
        (["--async-save", "--save", "/tmp/x"], 1, "--async-save needs --ckpt-format torch_dist"),
        (["--async-save", "--ckpt-format", "torch_dist"], 1, "--async-save needs --save DIR"),
        (
            ["--recompute-granularity", "selective", "--recompute-method", "block"],
            1,
            "--recompute-method block goes with --recompute-granularity full",
        ),
        (["--decoupled-min-lr", "1e-4"], 1, "--decoupled-min-lr needs --decoupled-lr"),
        (
            ["--decoupled-lr", "1e-2", "--decoupled-min-lr", "0.1"],
            1,
            "--decoupled-min-lr 0.1 must be in [0, --decoupled-lr 0.01]",
        ),
        (["--fp16", "--bf16"], 1, "--fp16 and --bf16 exclude each other"),
        (
            ["--use-torch-fsdp2", "--fp16", "--save", "/tmp/x"],
            1,
            "--use-torch-fsdp2 does not go with --fp16 here",
        ),
        (
            ["--use-torch-fsdp2", "--use-distributed-optimizer"],
            1,
            "--use-torch-fsdp2 does not go with --use-distributed-optimizer",
        ),
        (
            ["--use-distributed-optimizer", "--ckpt-format", "torch"],
            1,
            "--use-distributed-optimizer (Megatron-FSDP's optim strategy) saves sharded",
        ),
        (["--overlap-param-gather"], 1, "add --use-megatron-fsdp or --use-distributed-optimizer"),
        (["--fp16", "--fp8-format", "hybrid"], 1, "use --bf16 instead of --fp16"),
        (["--profile", "--use-pytorch-profiler"], 1, "pass --tensorboard-dir DIR"),
        (
            ["--profile", "--profile-step-start", "5", "--profile-step-end", "5"],
            1,
            "--profile-step-start 5 must be >= 0 and below --profile-step-end 5",
        ),
        (["--megatron-fsdp-main-params-dtype", "bf16"], 1, "only fp32 main params are built"),
        (["--manual-gc-interval", "-1"], 1, "--manual-gc-interval must be >= 0"),
        (["--distributed-timeout-minutes", "0"], 1, "--distributed-timeout-minutes must be"),
        (["--use-megatron-fsdp", "--ckpt-format", "torch"], 1, "drop --ckpt-format torch"),
        (
            ["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"],
            1,
            "exclude each other",
        ),
        (["--save-interval", "5"], 1, "needs --save"),
        (["--lr-decay-style", "WSD"], 1, "needs --lr-wsd-decay-iters"),
        (
            ["--lr-warmup-iters", "200", "--train-iters", "100"],
            1,
            "must end before the decay does (--lr-decay-iters, 100 iterations)",
        ),
        (
            ["--train-samples", "80", "--lr-decay-style", "WSD"],
            1,
            "--lr-decay-style WSD needs --lr-wsd-decay-samples",
        ),
        (["--min-lr", "1"], 1, "--min-lr 1.0 must be in"),
        (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "5"], 1, "pass only one"),
        (["--lr-warmup-fraction", "1.5"], 1, "--lr-warmup-fraction 1.5 must be in [0, 1)"),
        (["--train-samples", "80", "--train-iters", "5"], 1, "both set the run length"),
        (["--train-samples", "4"], 1, "--train-samples 4 is less than one global batch (8)"),
        (
            ["--train-samples", "80", "--lr-decay-iters", "5"],
            1,
            "with --train-samples give the schedule in samples: replace --lr-decay-iters",
        ),
        (["--lr-warmup-samples", "16"], 1, "--lr-warmup-samples go with --train-samples"),
        (["--lr-warmup-init", "1"], 1, "--lr-warmup-init 1.0 must be in [0, --lr"),
        (["--first-last-layers-bf16", "--fp8-recipe", "delayed"], 1, "must leave at least one"),
        (["--hidden-dropout", "1.5"], 1, "must be in [0, 1)"),
        (["--split", "a,b"], 1, "expected numbers"),
        (["--wandb-project", "p", "--wandb-save-dir", "/tmp/w"], 1, "--wandb-exp-name is not"),
        (["--wandb-project", "p", "--wandb-exp-name", "e"], 1, "--wandb-save-dir is not"),
    ],
)
def test_invalid_combinations(extra, world_size, expected, capsys):
    assert expected in parse_error(TINY_GPT + extra, capsys, world_size=world_size)


def test_missing_data_names_both_fixes(capsys):
    err = parse_error(["--num-layers", "2"], capsys)
    assert "--data-path PREFIX" in err and "--mock-data" in err


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--rotary-base", "0"], "--rotary-base 0 must be > 0; Megatron's default is 10000."),
        (["--rotary-base", "-10000"], "--rotary-base -10000 must be > 0"),
        (["--norm-epsilon", "-1"], "--norm-epsilon -1.0 must be > 0; the default is 1e-5."),
        (["--norm-epsilon", "nan"], "--norm-epsilon nan must be > 0"),
        (["--ffn-hidden-size", "0"], "--ffn-hidden-size 0 must be > 0; omit it for 4 x"),
        (["--ffn-hidden-size", "-16"], "--ffn-hidden-size -16 must be > 0"),
        (["--kv-channels", "0"], "--kv-channels 0 must be > 0; omit it for --hidden-size /"),
        (
            ["--position-embedding-type", "rope", "--max-position-embeddings", "0"],
            "--max-position-embeddings 0 must be > 0; omit it for --seq-length.",
        ),
        (["--init-method-std", "-1"], "--init-method-std -1.0 must be > 0; the default is 0.02."),
        (["--init-method-std", "0"], "--init-method-std 0.0 must be > 0"),
        (["--adam-beta1", "1.5"], "--adam-beta1 1.5 must be in [0, 1); the default is 0.9."),
        (["--adam-beta1", "-0.1"], "--adam-beta1 -0.1 must be in [0, 1)"),
        (["--adam-beta2", "1"], "--adam-beta2 1.0 must be in [0, 1); the default is 0.999."),
        (["--adam-eps", "-1"], "--adam-eps -1.0 must be > 0; the default is 1e-8."),
        (["--adam-eps", "0"], "--adam-eps 0.0 must be > 0"),
        (["--sgd-momentum", "1"], "--sgd-momentum 1.0 must be in [0, 1); 0 disables momentum"),
        (["--lr", "0"], "--lr 0.0 must be > 0; the default is 3e-4."),
        (["--lr", "inf"], "--lr inf must be > 0"),
        (["--weight-decay", "-0.1"], "--weight-decay -0.1 must be a finite number >= 0"),
        (["--weight-decay", "inf"], "--weight-decay inf must be a finite number >= 0"),
        (["--clip-grad", "-1"], "--clip-grad -1.0 must be a finite number >= 0 (0 disables"),
        (["--attention-dropout", "1"], "--attention-dropout 1.0 must be in [0, 1); 0 disables"),
        (["--lr-decay-iters", "0"], "--lr-decay-iters must be positive (omit it for"),
        (["--seed", "-1"], "--seed -1 must be in [0, 2**32)."),
        (["--eval-interval", "0"], "to turn evaluation off, give --eval-iters 0."),
        (["--split", "inf,1,1"], "--split 'inf,1,1': give up to three finite non-negative"),
        (["--split", "1,nan,1"], "--split '1,nan,1': give up to three finite non-negative"),
        (
            ["--tokenizer-type", "ByteTokenizer"],
            "--vocab-size sets the NullTokenizer vocabulary only; --tokenizer-type ByteTokenizer "
            "takes its size from the tokenizer: drop --vocab-size",
        ),
    ],
)
def test_out_of_range_values(extra, expected, capsys):
    assert expected in parse_error(TINY_GPT + extra, capsys)


def test_defaults_and_edge_values_stay_valid():
    args = parse_args(TINY_GPT, world_size=1)
    assert (args.rotary_base, args.norm_epsilon, args.init_method_std) == (10000, 1e-5, 0.02)
    assert (args.adam_beta1, args.adam_beta2, args.adam_eps) == (0.9, 0.999, 1e-8)
    edges = [
        "--adam-beta1",
        "0",
        "--sgd-momentum",
        "0",
        "--weight-decay",
        "0",
        "--clip-grad",
        "0",
        "--hidden-dropout",
        "0",
        "--seed",
        str(2**32 - 1),
        "--ffn-hidden-size",
        "16",
    ]
    args = parse_args(TINY_GPT + edges, world_size=1)
    found = (args.adam_beta1, args.clip_grad, args.seed, args.ffn_hidden_size)
    assert found == (0.0, 0.0, 2**32 - 1, 16)


# Real corpus flags instead of --mock-data: --split applies only to files.
FILE_DATA = [arg for arg in TINY_GPT if arg != "--mock-data"] + ["--data-path", "corpus"]


def test_zero_train_split_fails_at_parse_time(capsys):
    err = parse_error(FILE_DATA + ["--split", "0,1,0"], capsys)
    assert (
        "--split '0,1,0' gives the train split no documents, but --train-iters 100 needs "
        "training data; give the first share a positive weight, like 969,30,1." in err
    )
    assert parse_args(FILE_DATA + ["--split", "1,0,0"], world_size=1).split == "1,0,0"
    # Mock data has no documents to split, so its --split is not checked for a train share.
    assert parse_args(TINY_GPT + ["--split", "0,1,0"], world_size=1).split == "0,1,0"


def _hf_argv(tokenizer_model):
    return [
        "--mock-data",
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        str(tokenizer_model),
    ]


def test_tokenizer_model_directory(capsys, tmp_path):
    (tmp_path / "with").mkdir()
    (tmp_path / "with" / "tokenizer.json").write_text("{}")
    assert parse_args(_hf_argv(tmp_path / "with"), world_size=1).tokenizer_model == str(
        tmp_path / "with"
    )
    (tmp_path / "without").mkdir()
    (tmp_path / "without" / "vocab.json").write_text("{}")
    err = parse_error(_hf_argv(tmp_path / "without"), capsys)
    assert (
        f"--tokenizer-model {tmp_path / 'without'} is a directory without a tokenizer.json; "
        "pass the tokenizer.json file itself or the directory that holds it." in err
    )
    argv = [
        "--mock-data",
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        str(tmp_path / "with"),
        "--merge-file",
        str(tmp_path / "merges.txt"),
    ]
    err = parse_error(argv, capsys)
    assert f"--vocab-file {tmp_path / 'with'} is a directory; pass the file itself." in err


OUTPUT_DIR_FLAGS = ["--save", "--data-cache-path", "--tensorboard-dir", "--wandb-save-dir"]


@pytest.mark.parametrize("flag", OUTPUT_DIR_FLAGS)
def test_output_dir_that_is_a_file(flag, capsys, tmp_path):
    regular = tmp_path / "notes.txt"
    regular.write_text("not a directory")
    err = parse_error(TINY_GPT + [flag, str(regular)], capsys)
    assert f"{flag} {regular} exists and is not a directory; pass a directory" in err
    below = regular / "run1"
    err = parse_error(TINY_GPT + [flag, str(below)], capsys)
    assert f"{flag} {below} cannot be created: {regular} is a file, not a directory" in err


@pytest.mark.parametrize("flag", OUTPUT_DIR_FLAGS)
def test_output_dir_under_unwritable_directory(flag, capsys, tmp_path, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    # Tests run as root here, for whom every directory is writable; deny this one instead.
    monkeypatch.setattr(
        os, "access", lambda path, mode: path != str(locked) and real_access(path, mode)
    )
    err = parse_error(TINY_GPT + [flag, str(locked / "a" / "b")], capsys)
    assert f"{flag} {locked / 'a' / 'b'}: directory {locked} is not writable by this user" in err


@pytest.mark.parametrize("flag", OUTPUT_DIR_FLAGS)
def test_output_dir_to_create_is_accepted_and_not_created(flag, tmp_path):
    target = tmp_path / "runs" / "new"
    args = parse_args(TINY_GPT + [flag, str(target)], world_size=1)
    assert getattr(args, flag[2:].replace("-", "_")) == str(target)
    assert not (tmp_path / "runs").exists()


def test_cli_save_to_a_file_exits_2_before_training(tmp_path):
    regular = tmp_path / "ckpt"
    regular.write_text("")
    proc = subprocess.run(
        [
            sys.executable,
            "pretrain_gpt.py",
            *TINY_GPT,
            "--train-iters",
            "2",
            "--save",
            str(regular),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert f"--save {regular} exists and is not a directory" in proc.stderr
    assert "Traceback" not in proc.stderr and "number of parameters" not in proc.stdout


def test_missing_tokenizer_file(capsys, tmp_path):
    argv = [
        "--mock-data",
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        str(tmp_path / "vocab.json"),
        "--merge-file",
        str(tmp_path / "merges.txt"),
    ]
    assert f"--vocab-file {tmp_path / 'vocab.json'}: no such file" in parse_error(argv, capsys)


def test_recipe_implies_hybrid_format():
    args = parse_args(TINY_GPT + ["--fp8-recipe", "mxfp8"], world_size=1)
    assert args.fp8_format is None and resolved_flags(args).fp8_format == "hybrid"
    args = parse_args(TINY_GPT + ["--fp8-recipe", "mxfp8", "--fp8-format", "e4m3"], world_size=1)
    assert resolved_flags(args).fp8_format == "e4m3"


def test_wgrad_input_from_activation_is_on_with_a_recipe_unless_turned_off():
    from megatron.training.flags.configs import build_transformer_config

    def resolved(extra):
        args = parse_args(TINY_GPT + extra, world_size=1)
        fp8 = build_transformer_config(args, vocab_size=512).fp8
        return resolved_flags(args).fp8_wgrad_input_from_activation, fp8 and (
            fp8.wgrad_input_from_activation
        )

    assert resolved([]) == (False, None)  # no FP8: nothing to recompute, and no Fp8Config
    assert resolved(["--no-fp8-wgrad-input-from-activation"]) == (False, None)
    assert resolved(["--fp8-recipe", "tensorwise"]) == (True, True)
    off = ["--fp8-recipe", "mxfp8", "--no-fp8-wgrad-input-from-activation"]
    assert resolved(off) == (False, False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal needs a machine without GPUs")
def test_nccl_without_gpus_is_a_flag_error(capsys):
    message = parse_error(TINY_GPT + ["--distributed-backend", "nccl"], capsys)
    assert (
        "error: --distributed-backend nccl needs CUDA GPUs and none is visible here; use "
        "--distributed-backend gloo (the default without GPUs).\n" in message
    )


def test_fp8_format_alone_trains_megatron_lm_delayed_defaults():
    """Megatron-LM's FP8 defaults: --fp8-format alone means delayed scaling with a 1-long amax
    history and most_recent, and the run's Fp8Linears are built with exactly that."""
    from megatron.training.flags.configs import build_transformer_config

    args = parse_args(TINY_GPT + ["--fp8-format", "hybrid", "--train-iters", "3"], world_size=1)
    flags = resolved_flags(args)
    assert (flags.fp8_recipe, flags.fp8_format) == ("delayed", "hybrid")
    assert (args.fp8_amax_history_len, args.fp8_amax_compute_algo) == (1, "most_recent")
    fp8 = build_transformer_config(args, vocab_size=512).fp8
    assert (fp8.recipe, fp8.amax_history_len) == ("delayed", 1)
    assert fp8.amax_compute_algo == "most_recent"
    result = run_pretrain(TINY_GPT + ["--fp8-format", "hybrid", "--train-iters", "3"])
    delayed = run_pretrain(
        TINY_GPT
        + [
            "--fp8-recipe",
            "delayed",
            "--train-iters",
            "3",
            "--fp8-amax-history-len",
            "1",
            "--fp8-amax-compute-algo",
            "most_recent",
        ]
    )
    longer = run_pretrain(
        TINY_GPT
        + [
            "--fp8-recipe",
            "delayed",
            "--train-iters",
            "3",
            "--fp8-amax-history-len",
            "1024",
            "--fp8-amax-compute-algo",
            "max",
        ]
    )
    assert result.losses == delayed.losses
    assert result.losses != longer.losses  # the defaults are what changed the numbers


def test_wandb_save_dir_defaults_under_save():
    pytest.importorskip("wandb", reason="--wandb-project needs wandb (pip install wandb)")
    argv = TINY_GPT + ["--wandb-project", "p", "--wandb-exp-name", "e", "--save", "/tmp/ck"]
    args = parse_args(argv, world_size=1)
    assert args.wandb_save_dir is None
    assert build_run_config(args, world_size=1).logging.wandb_save_dir == "/tmp/ck/wandb"


def test_derived_defaults():
    from megatron.training.flags.configs import build_transformer_config

    args = parse_args(TINY_GPT + ["--train-iters", "30"], world_size=2)
    run_config = build_run_config(args, world_size=2)
    assert run_config.training.num_microbatches == 2  # 8 / (2 x 2)
    assert run_config.lr_schedule.decay_iters == 30
    # Derived in the config, not written back into the flags (the flag keeps its default) ...
    assert args.lr_decay_iters is None and not hasattr(args, "num_microbatches")
    # ... but metadata.json's "resolved_args" holds them, which a load merges over "args".
    saved = run_config.checkpoint.resolved_args
    derived = [saved[key] for key in ("num_microbatches", "lr_decay_iters", "lr_warmup_iters")]
    assert derived == [2, 30, 0]
    # The bundle's model config is build_transformer_config's, rows padded to 128.
    model = run_config.model_config(vocab_size=500)
    assert model.vocab_size == 512
    assert model == build_transformer_config(args, vocab_size=500)
    assert args.ckpt_format is None and run_config.checkpoint.ckpt_format == "torch"
    assert run_config.checkpoint.saved_args["ckpt_format"] is None
    fsdp = parse_args(TINY_GPT + ["--use-megatron-fsdp"], world_size=2)
    assert resolved_flags(fsdp).ckpt_format == "torch_dist"
    ddp_sharded = resolved_flags(parse_args(TINY_GPT + ["--ckpt-format", "torch_dist"]))
    assert ddp_sharded.ckpt_format == "torch_dist" and not ddp_sharded.use_megatron_fsdp


def test_cli_exits_2_before_building_a_model():
    """The real entry point: status 2, one-line message, no traceback."""
    proc = subprocess.run(
        [sys.executable, "pretrain_gpt.py", *TINY_GPT, "--global-batch-size", "7"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "--global-batch-size 7 is not a multiple of" in proc.stderr
    assert "Traceback" not in proc.stderr and "number of parameters" not in proc.stdout


def test_a_misspelled_flag_is_refused_with_the_closest_flag_as_its_fix(capsys):
    """Unrecognized flags exit 2 (no abbreviations, as Megatron-LM); a near miss names the
    flag it probably meant, an unknown word names none."""
    err = parse_error(TINY_GPT + ["--hiden-size", "64", "--lr-warmup-iter=5"], capsys)
    assert err.splitlines()[0] == (
        "pretrain_gpt.py: error: unrecognized arguments: --hiden-size 64 --lr-warmup-iter=5; "
        "did you mean --hidden-size for --hiden-size, --lr-warmup-iters for --lr-warmup-iter?"
    )
    err = parse_error(TINY_GPT + ["--banana", "1"], capsys)
    assert err.splitlines()[0] == "pretrain_gpt.py: error: unrecognized arguments: --banana 1"
    # after "--" a known flag is not an option: no guess that names it again
    err = parse_error(TINY_GPT + ["--", "--hidden-size", "64"], capsys)
    assert err.splitlines()[0].endswith("unrecognized arguments: -- --hidden-size 64")
