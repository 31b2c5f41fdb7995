"""tools/checkpoint/convert.py with HuggingFace models: round trips, logits, fine-tuning from an
import with --use-checkpoint-args, and bad input refused before anything is written."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatron.core.checkpoint_files import CheckpointError
from megatron.core.models.gpt.gpt_model import GPTModel
from tests.unit_tests.training.common import run_pretrain

transformers = pytest.importorskip("transformers", reason="needs `pip install transformers`")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="needs safetensors")

REPO_ROOT = Path(__file__).resolve().parents[3]
MAX_RELATIVE_ERROR = 1e-5
VOCAB = 96


def _llama_config():
    # GQA (4 heads, 2 groups), a head width that is not hidden / heads, a rope base, untied.
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=5000.0,
        tie_word_embeddings=False,
    )


def _gpt2_config():
    # Exact GeLU: GPT-2's default "gelu_new" (tanh) is refused, see below.
    return transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=32,
        n_inner=80,
        activation_function="gelu",
        layer_norm_epsilon=1e-6,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )


def _tied_llama_config():
    config = _llama_config()
    config.tie_word_embeddings = True
    return config


MODELS = {
    "llama": (transformers.LlamaForCausalLM, _llama_config),
    "llama_tied": (transformers.LlamaForCausalLM, _tied_llama_config),
    "gpt2": (transformers.GPT2LMHeadModel, _gpt2_config),
}


def _save_hf_model(kind: str, directory: Path) -> torch.nn.Module:
    """A tiny transformers model with every weight perturbed (norms at 1 and biases at 0 would
    hide a swapped norm or bias), saved with save_pretrained."""
    model_class, make_config = MODELS[kind]
    torch.manual_seed(0)
    model = model_class(make_config()).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.2 * torch.randn(param.shape))
    model.save_pretrained(str(directory))
    return model


def _convert(*argv: str) -> str:
    from tools.checkpoint.convert import convert

    return convert(list(argv))


def _our_model(checkpoint: Path) -> GPTModel:
    from megatron.training.checkpoint import load_state_for_export

    state_dict, config = load_state_for_export(str(checkpoint))
    model = GPTModel(config).eval()
    model.load_state_dict(state_dict, strict=True)
    return model


def _relative_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    return ((actual - reference).abs().max() / reference.abs().max()).item()


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_hf_round_trip_is_bitwise_and_logits_match(tmp_path: Path, kind: str) -> None:
    hf_model = _save_hf_model(kind, tmp_path / "hf")
    ours, back = tmp_path / "ours", tmp_path / "back"
    line = _convert(
        "--loader",
        "hf",
        "--saver",
        "megatron_fp8",
        "--load-dir",
        str(tmp_path / "hf"),
        "--save-dir",
        str(ours),
    )
    assert line == f"wrote megatron-fp8 checkpoint (--ckpt-format torch) to {ours}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "ours"]  # no ours.tmp left
    _convert(
        "--loader",
        "megatron_fp8",
        "--saver",
        "hf",
        "--load-dir",
        str(ours),
        "--save-dir",
        str(back),
    )

    original = safetensors_torch.load_file(str(tmp_path / "hf" / "model.safetensors"))
    returned = safetensors_torch.load_file(str(back / "model.safetensors"))
    assert sorted(returned) == sorted(original)
    assert len(original) == {"llama": 3 + 2 * 9, "llama_tied": 2 + 2 * 9, "gpt2": 4 + 2 * 12}[kind]
    for name, tensor in original.items():
        assert returned[name].dtype == tensor.dtype == torch.float32, name
        assert torch.equal(returned[name], tensor), name

    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = hf_model(input_ids=tokens).logits
        mine = _our_model(ours)(tokens)
    assert theirs.std().item() > 0.5  # logits spread well beyond fp32 noise
    assert _relative_error(mine, theirs) < MAX_RELATIVE_ERROR


def test_import_records_the_source_config(tmp_path: Path) -> None:
    _save_hf_model("llama", tmp_path / "hf")
    _convert(
        "--loader",
        "hf",
        "--saver",
        "megatron_fp8",
        "--load-dir",
        str(tmp_path / "hf"),
        "--save-dir",
        str(tmp_path / "ours"),
    )
    metadata = json.loads((tmp_path / "ours" / "iter_0000000" / "metadata.json").read_text())
    config, args = metadata["model_config"], metadata["args"]
    assert (config["num_query_groups"], config["kv_channels"], config["rotary_base"]) == (
        2,
        24,
        5000,
    )
    assert (config["ffn_hidden_size"], config["layernorm_epsilon"]) == (80, 1e-6)
    assert (config["vocab_size"], args["make_vocab_size_divisible_by"]) == (VOCAB, 1)
    assert args["untie_embeddings_and_output_weights"] and args["disable_bias_linear"]
    assert (args["no_save_optim"], args["no_save_rng"], metadata["iteration"]) == (True, True, 0)


FINETUNE = [
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    str(VOCAB),
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "2",
    "--train-iters",
    "3",
    "--lr",
    "1e-4",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--eval-iters",
    "0",
    "--log-interval",
    "1",
    "--finetune",
]


def test_finetune_from_import_with_checkpoint_args(tmp_path: Path, monkeypatch, capsys) -> None:
    """pretrain --load IMPORT --finetune --use-checkpoint-args trains on; its first loss is
    transformers' loss of the imported model on the same batch."""
    import megatron.training.training as training

    hf_model = _save_hf_model("llama", tmp_path / "hf")
    ours = tmp_path / "ours"
    _convert(
        "--loader",
        "hf",
        "--saver",
        "megatron_fp8",
        "--load-dir",
        str(tmp_path / "hf"),
        "--save-dir",
        str(ours),
    )
    # Without --use-checkpoint-args the default --hidden-size 128 does not fit the checkpoint.
    with pytest.raises(CheckpointError, match="saved with --hidden-size 64, but this run has 128"):
        run_pretrain(FINETUNE + ["--load", str(ours)])

    batches = []
    forward_backward = training.forward_backward

    def recording(run, batch, **kwargs):
        batches.append({key: value.clone() for key, value in batch.items()})
        return forward_backward(run, batch, **kwargs)

    monkeypatch.setattr(training, "forward_backward", recording)
    capsys.readouterr()
    result = run_pretrain(FINETUNE + ["--load", str(ours), "--use-checkpoint-args"])
    log = capsys.readouterr().out
    assert " > --use-checkpoint-args: --hidden-size 64 (command line: 128)" in log
    assert " > --use-checkpoint-args: --num-query-groups 2 (command line: None)" in log
    assert f" > loaded checkpoint {ours}/iter_0000000 (iteration 0)" in log
    assert sorted(result.losses) == [1, 2, 3]
    assert all(math.isfinite(loss) for loss in result.losses.values())

    first = batches[0]
    with torch.no_grad():
        hf_logits = hf_model(input_ids=first["tokens"]).logits
    token_losses = F.cross_entropy(
        hf_logits.flatten(0, 1), first["labels"].flatten(), reduction="none"
    )
    mask = first["loss_mask"].flatten().float()
    expected = ((token_losses * mask).sum() / mask.sum()).item()
    assert abs(result.losses[1] - expected) < 1e-5 * expected
    assert result.losses[2] != result.losses[1]  # the weights moved: training continued


def _convert_fails(capsys, *argv: str) -> str:
    from tools.checkpoint.convert import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    return err


def _edit_safetensors(path: Path, edit) -> None:
    tensors = safetensors_torch.load_file(str(path))
    edit(tensors)
    safetensors_torch.save_file(tensors, str(path), metadata={"format": "pt"})


def _edit_config(path: Path, **changes) -> None:
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, **changes}))


def _drop_up_proj(tensors: dict) -> None:
    del tensors["model.layers.1.mlp.up_proj.weight"]


def _add_q_norm(tensors: dict) -> None:
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(24)


@pytest.mark.parametrize(
    ("kind", "tensors_edit", "config_edit", "message"),
    [
        ("llama", _drop_up_proj, {}, "tensor model.layers.1.mlp.up_proj.weight is missing"),
        ("llama", _add_q_norm, {}, "unexpected tensor model.layers.0.self_attn.q_norm.weight"),
        (
            "llama",
            None,
            {"intermediate_size": 96},
            r"decoder.layers.0.mlp.linear_fc1.weight has shape \(160, 64\), the model config "
            r"implies \(192, 64\)",
        ),
        ("llama", None, {"model_type": "bert"}, "model_type 'bert' is not one the hf loader reads"),
        ("llama", None, {"rope_scaling": {"rope_type": "llama3"}}, "rope scaling"),
        ("gpt2", None, {"activation_function": "gelu_new"}, "activation_function 'gelu_new'"),
    ],
    ids=["missing", "extra", "shape", "architecture", "rope-scaling", "tanh-gelu"],
)
def test_bad_hf_input_fails_before_writing(
    tmp_path: Path, capsys, kind, tensors_edit, config_edit, message
) -> None:
    source = tmp_path / "hf"
    _save_hf_model(kind, source)
    if tensors_edit is not None:
        _edit_safetensors(source / "model.safetensors", tensors_edit)
    if config_edit:
        _edit_config(source / "config.json", **config_edit)
    err = _convert_fails(
        capsys,
        "--loader",
        "hf",
        "--saver",
        "megatron_fp8",
        "--load-dir",
        str(source),
        "--save-dir",
        str(tmp_path / "out"),
    )
    assert re.search(message, err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # nothing written


def test_wrong_loader_and_contradicting_flags_fail(tmp_path: Path, capsys) -> None:
    source = tmp_path / "hf"
    _save_hf_model("llama", source)
    out = str(tmp_path / "out")
    err = _convert_fails(
        capsys,
        "--loader",
        "megatron_fp8",
        "--saver",
        "hf",
        "--load-dir",
        str(source),
        "--save-dir",
        out,
    )
    assert f"{source}: no latest_checkpointed_iteration.txt" in err
    err = _convert_fails(
        capsys, "--loader", "mcore", "--saver", "hf", "--load-dir", str(source), "--save-dir", out
    )
    assert f"{source}: no latest_checkpointed_iteration.txt and no metadata.json" in err
    err = _convert_fails(
        capsys,
        "--loader",
        "hf",
        "--saver",
        "megatron_fp8",
        "--load-dir",
        str(source),
        "--save-dir",
        out,
        "--hidden-size",
        "32",
    )
    assert "--hidden-size 32 contradicts the hf checkpoint, which records 64" in err
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "notes.txt").write_text("keep")
    err = _convert_fails(
        capsys,
        "--loader",
        "hf",
        "--saver",
        "megatron_fp8",
        "--load-dir",
        str(source),
        "--save-dir",
        str(tmp_path / "used"),
    )
    assert "exists and is not empty" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "used"]


def test_interrupted_conversion_leaves_no_output(tmp_path: Path, monkeypatch) -> None:
    import megatron.training.checkpoint as checkpointing

    _save_hf_model("gpt2", tmp_path / "hf")

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpointing, "save_checkpoint", killed)
    with pytest.raises(KeyboardInterrupt):
        _convert(
            "--loader",
            "hf",
            "--saver",
            "megatron_fp8",
            "--load-dir",
            str(tmp_path / "hf"),
            "--save-dir",
            str(tmp_path / "ours"),
        )
    assert not (tmp_path / "ours").exists()  # only ours.tmp, which nothing reads


def test_cli_exit_status_and_one_error_line(tmp_path: Path) -> None:
    source = tmp_path / "hf"
    _save_hf_model("gpt2", source)
    _edit_config(source / "config.json", model_type="mistral")
    result = subprocess.run(
        [
            sys.executable,
            "tools/checkpoint/convert.py",
            "--loader",
            "hf",
            "--saver",
            "mcore",
            "--load-dir",
            str(source),
            "--save-dir",
            str(tmp_path / "out"),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert result.stderr == (
        f"error: {source}/config.json: model_type 'mistral' is not one the hf loader reads "
        "(deepseek_v3, gpt2, llama, mixtral, qwen3_moe)\n"
    )
    assert not (tmp_path / "out").exists()


def test_sharded_import_round_trip(tmp_path: Path) -> None:
    """--ckpt-format torch_dist: the import is written by Megatron-FSDP's sharded save (one
    rank) and reads back bitwise."""
    _save_hf_model("llama", tmp_path / "hf")
    ours = tmp_path / "ours"
    line = _convert(
        "--loader",
        "hf",
        "--saver",
        "megatron_fp8",
        "--ckpt-format",
        "torch_dist",
        "--load-dir",
        str(tmp_path / "hf"),
        "--save-dir",
        str(ours),
    )
    assert line.startswith("wrote megatron-fp8 checkpoint (--ckpt-format torch_dist)")
    metadata = json.loads((ours / "iter_0000000" / "metadata.json").read_text())
    assert (metadata["ckpt_format"], metadata["args"]["use_megatron_fsdp"]) == ("torch_dist", True)
    _convert(
        "--loader",
        "megatron_fp8",
        "--saver",
        "hf",
        "--load-dir",
        str(ours),
        "--save-dir",
        str(tmp_path / "back"),
    )
    original = safetensors_torch.load_file(str(tmp_path / "hf" / "model.safetensors"))
    returned = safetensors_torch.load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(returned) == sorted(original)
    assert all(torch.equal(returned[name], tensor) for name, tensor in original.items())


def test_use_checkpoint_args_needs_a_checkpoint(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "pretrain_gpt.py",
            "--mock-data",
            "--use-checkpoint-args",
            "--load",
            str(tmp_path / "none"),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert f"--load {tmp_path / 'none'} holds no latest_checkpointed_iteration.txt" in result.stderr


def test_a_converted_checkpoint_resumes_with_the_users_tokenizer(tmp_path: Path) -> None:
    """The converter records no tokenizer (its probe's NullTokenizer and padded rows are not the
    user's): resuming a converted checkpoint with the user's own --vocab-size (500, padded to
    the saved 512 rows) or another tokenizer is not refused, while a training run's checkpoint
    keeps its tokenizer check."""
    from tests.unit_tests.training.common import TINY_GPT

    tiny = list(TINY_GPT)
    tiny[tiny.index("--vocab-size") + 1] = "500"
    run_pretrain([*tiny, "--train-iters", "2", "--save", str(tmp_path / "trained")])
    _convert(
        "--loader", "megatron_fp8", "--saver", "megatron_fp8",
        "--load-dir", str(tmp_path / "trained"), "--save-dir", str(tmp_path / "converted"),
    )  # fmt: skip
    metadata = json.loads(next((tmp_path / "converted").glob("*/metadata.json")).read_text())
    assert metadata["args"]["tokenizer_type"] is None and metadata["args"]["vocab_size"] is None
    resume = ["--train-iters", "3", "--no-load-optim", "--no-load-rng", "--load"]
    result = run_pretrain([*tiny, *resume, str(tmp_path / "converted")])
    assert sorted(result.losses) == [3]
    with pytest.raises(CheckpointError, match="saved with --vocab-size 500, but this run has 512"):
        run_pretrain([*TINY_GPT, *resume, str(tmp_path / "trained")])
