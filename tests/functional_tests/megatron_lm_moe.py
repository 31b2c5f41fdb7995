"""Megatron-LM's MoE command lines as tiny CPU runs (issue 38, acceptance 4).

Sources (NVIDIA/Megatron-LM d98e8a64dd): the MoE functional-test configs with tensor and
pipeline parallel size 1 (test_cases/moe/<name>/megatron_lm_config.yaml, Megatron-LM's ENV_VARS
and MODEL_ARGS kept as they are), and examples/mixtral/train_mixtral_8x7b_distributed.sh
(MIXTRAL below: its arrays in order, bash's word splitting). `tiny_run` changes only what
acceptance 4 allows: model sizes, batch sizes, iteration counts, data (mock data and the
NullTokenizer instead of a corpus and its tokenizer files), paths (${...} and the checkpoint
directory), and parallel sizes (the expert-parallel size, capped at 4 ranks on CPU, is the
torchrun rank count; the Mixtral script's pipeline size 4 becomes 1); `--distributed-backend
nccl` becomes gloo. Every other flag runs as written: flags that are not built make the run
exit 2 naming them (docs/MEGATRON_LM_FLAGS.md lists them per config).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

MOE_CASES_ROOT = Path(__file__).resolve().parent / "test_cases" / "moe"
MAX_RANKS = 4
"""Ranks a CPU run may use (the expert-parallel size is capped here)."""

# Model and batch sizes, iteration counts: the tiny values (layer counts stay, since
# --moe-layer-freq lists one entry per layer).
TINY_SIZES = {
    "--hidden-size": 64,
    "--ffn-hidden-size": 128,
    "--num-attention-heads": 4,
    "--num-query-groups": 2,
    "--kv-channels": 16,
    "--moe-ffn-hidden-size": 32,
    "--moe-shared-expert-intermediate-size": 32,
    "--q-lora-rank": 32,
    "--kv-lora-rank": 16,
    "--qk-head-dim": 16,
    "--qk-pos-emb-head-dim": 16,
    "--v-head-dim": 16,
    "--seq-length": 32,
    "--max-position-embeddings": 32,
    "--micro-batch-size": 1,
    "--train-iters": 3,
    "--lr-decay-iters": 100,
    "--lr-warmup-iters": 1,
    "--eval-iters": 1,
    "--eval-interval": 1000,
    "--exit-interval": 3,
    "--save-interval": 2,
}
# Data: the corpus and its tokenizer files give way to mock data.
DATA_FLAGS = frozenset(
    {"--data-path", "--vocab-file", "--merge-file", "--data-cache-path", "--tokenizer-model"}
)
MOCK_DATA = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512"]
PARALLEL_SIZES = {"--pipeline-model-parallel-size": 1}

# examples/mixtral/train_mixtral_8x7b_distributed.sh: MODEL_ARGS, MOE_ARGS, DATA_ARGS,
# TRAINING_ARGS, MODEL_PARALLEL_ARGS, LOGGING_ARGS (no WANDB_API_KEY).
MIXTRAL = """
    --use-mcore-models --disable-bias-linear --seq-length 4096 --max-position-embeddings 32768
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
    --init-method-std 0.01 --attention-dropout 0.0 --hidden-dropout 0.0 --normalization RMSNorm
    --position-embedding-type rope --swiglu --untie-embeddings-and-output-weights
    --group-query-attention --num-query-groups 8 --no-masked-softmax-fusion
    --no-position-embedding --rotary-base 1000000
    --num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2 --moe-grouped-gemm --moe-token-dispatcher-type alltoall
    --overlap-param-gather --overlap-grad-reduce
    --tokenizer-type Llama2Tokenizer --tokenizer-model {tmp}/tokenizer.model
    --data-path {tmp}/data --split 99990,8,2
    --micro-batch-size 1 --global-batch-size 256 --lr 1e-4 --train-iters 500000
    --lr-decay-iters 320000 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 0.1
    --lr-warmup-iters 500 --clip-grad 1.0 --bf16
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4
    --expert-model-parallel-size 8 --use-distributed-optimizer --sequence-parallel
    --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10
    --save {tmp}/ckpt --load {tmp}/ckpt --tensorboard-dir {tmp}/ckpt/tensorboard
    --no-load-optim --no-load-rng
"""
MIXTRAL_NUM_LAYERS = 2  # model size; the script's 32 layers are all MoE


@dataclass(frozen=True)
class TinyRun:
    """One tiny CPU run of a Megatron-LM MoE command line."""

    name: str
    argv: list[str]
    nproc: int
    env: dict[str, str]


def megatron_lm_config(name: str) -> dict[str, Any]:
    return yaml.safe_load((MOE_CASES_ROOT / name / "megatron_lm_config.yaml").read_text())


def config_names() -> list[str]:
    return sorted(path.parent.name for path in MOE_CASES_ROOT.glob("*/megatron_lm_config.yaml"))


def _pairs_of_command_line(text: str) -> list[tuple[str, Any]]:
    """A command line's words as (flag, value) pairs; True for a bare switch."""
    words, pairs = text.split(), []
    for index, word in enumerate(words):
        if not word.startswith("--"):
            continue
        following = words[index + 1] if index + 1 < len(words) else "--"
        pairs.append((word, True if following.startswith("--") else following))
    return pairs


def _tiny_argv(pairs: list[tuple[str, Any]], tmp: Path) -> tuple[list[str], int]:
    """(argv, ranks): the pairs with the allowed replacements; ranks = the EP size (<= 4)."""
    argv: list[str] = []
    ep_size = 1
    given = {flag for flag, _ in pairs}
    for flag, value in pairs:
        if flag in DATA_FLAGS or flag == "--tokenizer-type":
            continue
        if flag in ("--save", "--load"):
            value = tmp / "ckpt"
        elif flag == "--num-layers" and "--num-experts" in given and value == 32:
            value = MIXTRAL_NUM_LAYERS
        value = TINY_SIZES.get(flag, PARALLEL_SIZES.get(flag, value))
        if flag == "--global-batch-size":
            value = 8
        if flag == "--expert-model-parallel-size":
            ep_size = value = min(int(value), MAX_RANKS)
        if flag == "--distributed-backend":
            value = "gloo"
        if isinstance(value, str) and "${" in value:
            value = tmp / flag.removeprefix("--")
        if value is True:
            argv.append(flag)
        elif value is not False and value is not None:
            argv += [flag, str(value)]
    for flag in ("--save", "--load"):  # Megatron-LM's test runner passes both
        if flag not in given:
            argv += [flag, str(tmp / "ckpt")]
    return argv + MOCK_DATA, max(ep_size, 1)


def tiny_run(name: str, tmp: Path) -> TinyRun:
    """The tiny CPU run of a functional-test config, or of "mixtral" (the example script)."""
    if name == "mixtral":
        argv, nproc = _tiny_argv(_pairs_of_command_line(MIXTRAL.format(tmp=tmp)), tmp)
        return TinyRun(name, argv, nproc, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    config = megatron_lm_config(name)
    argv, nproc = _tiny_argv(list(config["MODEL_ARGS"].items()), tmp)
    env = {str(key): str(value) for key, value in (config.get("ENV_VARS") or {}).items()}
    return TinyRun(name, argv, nproc, env)
