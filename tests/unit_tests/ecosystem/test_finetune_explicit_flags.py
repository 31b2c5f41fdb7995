"""An HF import continues with the flags that describe the model: the checkpoint check compares
the values flags resolve to (--kv-channels 16 is what a hidden 64, 4-head model saved without
--kv-channels has), not the raw flag values."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megatron.core.checkpoint_files import CheckpointError
from tests.unit_tests.ecosystem.test_checkpoint_convert import FINETUNE, _convert, _llama_config
from tests.unit_tests.training.common import run_pretrain

transformers = pytest.importorskip("transformers", reason="needs `pip install transformers`")

# The imported Llama's own flags, written out as a Megatron-LM user would (head width 16 =
# hidden / heads, so the importer records --kv-channels as omitted).
LLAMA_FLAGS = [
    *("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"),
    *("--kv-channels", "16", "--ffn-hidden-size", "80"),
    *("--group-query-attention", "--num-query-groups", "2"),
    *("--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope"),
    *("--untie-embeddings-and-output-weights", "--disable-bias-linear"),
    *("--max-position-embeddings", "64", "--rotary-base", "5000", "--norm-epsilon", "1e-6"),
    *("--make-vocab-size-divisible-by", "1"),
]


@pytest.fixture
def imported(tmp_path: Path) -> Path:
    config = _llama_config()
    config.head_dim = 16
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(str(tmp_path / "hf"))
    ours = tmp_path / "ours"
    _convert(
        *("--loader", "hf", "--saver", "megatron_fp8"),
        *("--load-dir", str(tmp_path / "hf"), "--save-dir", str(ours)),
    )
    return ours


def test_finetune_with_explicit_kv_channels_trains(imported: Path) -> None:
    result = run_pretrain(FINETUNE + LLAMA_FLAGS + ["--load", str(imported)])
    assert sorted(result.losses) == [1, 2, 3]
    assert all(math.isfinite(loss) for loss in result.losses.values())


def test_a_wrong_resolved_value_is_still_refused(imported: Path) -> None:
    flags = [*LLAMA_FLAGS, "--kv-channels", "8"]
    with pytest.raises(CheckpointError) as info:
        run_pretrain(FINETUNE + flags + ["--load", str(imported)])
    assert "saved with --kv-channels 16, but this run has 8;" in str(info.value)
