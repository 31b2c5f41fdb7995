"""HuggingFace DeepSeek-V3, Mixtral and Qwen3-MoE: a tiny random transformers model imports into
our GPTModel with the same logits (fp32, CPU), and exports back to the same files, bitwise."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.core.models.gpt.gpt_model import GPTModel
from tools.checkpoint.convert import convert
from tools.checkpoint.hf_export import (
    UnsupportedArchitectureError,
    convert_state_dict_to_hf,
    hf_architecture,
)
from tools.checkpoint.hf_import import load_hf
from tools.checkpoint.model_state import ConversionError

transformers = pytest.importorskip("transformers", reason="needs `pip install transformers`")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="needs safetensors")

REPO_ROOT = Path(__file__).resolve().parents[3]
MAX_RELATIVE_ERROR = 1e-5
SEQ = 12

DEEPSEEK = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=2,
    n_shared_experts=1,
    n_routed_experts=8,
    routed_scaling_factor=2.5,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=4,
    v_head_dim=8,
    qk_nope_head_dim=8,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=4,
    first_k_dense_replace=1,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 5000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "mscale": 1.0,
    "mscale_all_dim": 0.7,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}
MIXTRAL = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    num_local_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=64,
    rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
)
QWEN3_MOE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    num_experts=4,
    num_experts_per_tok=2,
    mlp_only_layers=[0],
    max_position_embeddings=64,
    rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
)
CONFIGS = {
    "deepseek_v3": transformers.DeepseekV3Config,
    "mixtral": transformers.MixtralConfig,
    "qwen3_moe": transformers.Qwen3MoeConfig,
}


def _hf_model(model_type: str, fields: dict, directory: Path):
    """A transformers model with every weight (and DeepSeek's expert bias) perturbed, so a
    swapped norm or bias shows; saved to `directory` by save_pretrained."""
    torch.manual_seed(0)
    config = CONFIGS[model_type](**fields)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            scale = 0.05 if name.endswith("e_score_correction_bias") else 0.2
            tensor.add_(scale * torch.randn(tensor.shape, generator=generator))
    model.save_pretrained(str(directory))
    return model


def _add_published_mtp_layer(directory: Path, fields: dict) -> dict:
    """DeepSeek's published checkpoints hold MTP depth 1 as `model.layers.{num_hidden_layers}`
    (transformers writes none): add one as they name it, its own tensors random."""
    path = directory / "model.safetensors"
    tensors = safetensors_torch.load_file(str(path))
    last, mtp = fields["num_hidden_layers"] - 1, fields["num_hidden_layers"]
    generator = torch.Generator().manual_seed(11)
    hidden = fields["hidden_size"]
    added = {
        f"model.layers.{mtp}.enorm.weight": torch.randn(hidden, generator=generator),
        f"model.layers.{mtp}.hnorm.weight": torch.randn(hidden, generator=generator),
        f"model.layers.{mtp}.eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=generator),
        f"model.layers.{mtp}.shared_head.norm.weight": torch.randn(hidden, generator=generator),
        f"model.layers.{mtp}.embed_tokens.weight": tensors["model.embed_tokens.weight"],
        f"model.layers.{mtp}.shared_head.head.weight": tensors["lm_head.weight"],
    }
    prefix = f"model.layers.{last}."
    for name, tensor in list(tensors.items()):
        if name.startswith(prefix):
            other = f"model.layers.{mtp}." + name.removeprefix(prefix)
            added[other] = tensor + torch.randn(tensor.shape, generator=generator)
    tensors = {**tensors, **{name: t.contiguous().clone() for name, t in added.items()}}
    safetensors_torch.save_file(tensors, str(path), metadata={"format": "pt"})
    return tensors


def _relative_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    return ((actual - reference).abs().max() / reference.abs().max()).item()


def _import_export(model_type: str, fields: dict, tmp_path: Path, *, mtp: bool = False):
    """(our logits error against transformers', the state, the source and exported files)."""
    hf_model = _hf_model(model_type, fields, tmp_path / "hf")
    files = safetensors_torch.load_file(str(tmp_path / "hf" / "model.safetensors"))
    if mtp:
        files = _add_published_mtp_layer(tmp_path / "hf", fields)
    state = load_hf(str(tmp_path / "hf"))
    ours = GPTModel(state.config).eval()
    ours.load_state_dict(state.state_dict, strict=True)
    tokens = torch.randint(0, fields["vocab_size"], (2, SEQ), generator=torch.Generator())
    with torch.no_grad():
        our_logits = ours(tokens)
        their_logits = hf_model(input_ids=tokens).logits
    assert our_logits.std().item() > 0.5  # the comparison has teeth
    error = _relative_error(our_logits, their_logits)
    convert_state_dict_to_hf(state.state_dict, state.config, output_dir=str(tmp_path / "out"))
    exported = safetensors_torch.load_file(str(tmp_path / "out" / "model.safetensors"))
    return error, state, files, exported


def _assert_bitwise(files: dict, exported: dict) -> None:
    assert sorted(exported) == sorted(files)
    for name, tensor in files.items():
        assert exported[name].dtype == tensor.dtype, name
        assert torch.equal(exported[name], tensor), name


def _reloaded_error(tmp_path: Path, reference: torch.Tensor, tokens: torch.Tensor) -> float:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "out"), dtype=torch.float32
    ).eval()
    with torch.no_grad():
        return _relative_error(model(input_ids=tokens).logits, reference)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"rope_parameters": YARN}, {"q_lora_rank": None}],
    ids=["rope", "yarn", "no-q-compression"],
)
def test_deepseek_v3_imports_with_its_logits_and_exports_bitwise(
    tmp_path: Path, overrides: dict
) -> None:
    fields = {**DEEPSEEK, **overrides}
    error, state, files, exported = _import_export("deepseek_v3", fields, tmp_path, mtp=True)
    assert error < MAX_RELATIVE_ERROR
    config = state.config
    assert config.multi_latent_attention and config.qk_layernorm and config.mtp_num_layers == 1
    assert config.moe_layer_freq == [0, 1, 1]
    assert (config.moe_router_num_groups, config.moe_router_group_topk) == (4, 2)
    assert config.moe_router_topk_scaling_factor == 2.5
    assert config.moe_shared_expert_intermediate_size == 16
    assert config.rope_type == ("yarn" if overrides.get("rope_parameters") else "rope")
    bias = state.state_dict["decoder.layers.1.mlp.router.expert_bias"]
    assert torch.equal(bias, files["model.layers.1.mlp.gate.e_score_correction_bias"])
    assert bias.abs().max() > 0
    assert torch.equal(
        state.state_dict["mtp.layers.0.eh_proj.weight"], files["model.layers.3.eh_proj.weight"]
    )
    _assert_bitwise(files, exported)
    # transformers loads the export (reporting the MTP layer's tensors as unexpected, as it
    # does for DeepSeek's published model.layers.61.*) and computes the same logits.
    tokens = torch.randint(0, fields["vocab_size"], (2, SEQ))
    ours = GPTModel(state.config).eval()
    ours.load_state_dict(state.state_dict, strict=True)
    with torch.no_grad():
        assert _reloaded_error(tmp_path, ours(tokens), tokens) < MAX_RELATIVE_ERROR
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["num_nextn_predict_layers"] == 1
    assert (written["first_k_dense_replace"], written["n_shared_experts"]) == (1, 1)


def test_deepseek_v3_bf16_export_keeps_the_router_in_fp32(tmp_path: Path) -> None:
    """A bf16 export writes every tensor in bf16 but the router's gate weight and expert bias,
    which stay our fp32 values bitwise (transformers keeps them in fp32 when it loads a bf16
    DeepseekV3, and DeepSeek's bf16 checkpoints store them so); transformers reloads them."""
    _hf_model("deepseek_v3", DEEPSEEK, tmp_path / "hf")
    state = load_hf(str(tmp_path / "hf"))
    out = tmp_path / "bf16"
    convert_state_dict_to_hf(
        state.state_dict, state.config, output_dir=str(out), dtype=torch.bfloat16
    )
    exported = safetensors_torch.load_file(str(out / "model.safetensors"))
    fp32 = sorted(name for name, t in exported.items() if t.dtype == torch.float32)
    assert fp32 == [
        f"model.layers.{layer}.mlp.gate.{what}"
        for layer in (1, 2)
        for what in ("e_score_correction_bias", "weight")
    ]
    assert {t.dtype for name, t in exported.items() if name not in fp32} == {torch.bfloat16}
    bias = state.state_dict["decoder.layers.2.mlp.router.expert_bias"]
    assert bias.dtype == torch.float32 and bias.abs().max() > 0
    assert torch.equal(exported["model.layers.2.mlp.gate.e_score_correction_bias"], bias)
    gate = state.state_dict["decoder.layers.2.mlp.router.weight"]
    assert torch.equal(exported["model.layers.2.mlp.gate.weight"], gate.float())
    assert gate.to(torch.bfloat16).float().ne(gate).any()  # bf16 would have rounded it
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16)
    layer = model.model.layers[2].mlp.gate
    assert layer.weight.dtype == torch.float32 and torch.equal(layer.weight, gate.float())
    assert torch.equal(layer.e_score_correction_bias, bias)


def test_deepseek_v3_without_mtp_files_imports_no_mtp(tmp_path: Path) -> None:
    """transformers' save_pretrained writes no MTP layer: the import builds none."""
    error, state, files, exported = _import_export("deepseek_v3", DEEPSEEK, tmp_path)
    assert error < MAX_RELATIVE_ERROR
    assert state.config.mtp_num_layers is None
    assert not any(name.startswith("mtp.") for name in state.state_dict)
    _assert_bitwise(files, exported)


def test_mixtral_imports_with_its_logits_and_exports_bitwise(tmp_path: Path) -> None:
    error, state, files, exported = _import_export("mixtral", MIXTRAL, tmp_path)
    assert error < MAX_RELATIVE_ERROR
    fc1 = state.state_dict["decoder.layers.1.mlp.experts.linear_fc1.weight"]
    assert fc1.shape == (4, 32, 32)  # [E, gate | up, hidden]
    w1, w3 = (files[f"model.layers.1.block_sparse_moe.experts.2.{w}.weight"] for w in ("w1", "w3"))
    assert torch.equal(fc1[2], torch.cat([w1, w3]))
    _assert_bitwise(files, exported)
    tokens = torch.randint(0, 64, (2, SEQ))
    state_model = GPTModel(state.config).eval()
    state_model.load_state_dict(state.state_dict)
    with torch.no_grad():
        assert _reloaded_error(tmp_path, state_model(tokens), tokens) < MAX_RELATIVE_ERROR


@pytest.mark.parametrize("norm_topk_prob", [False, True], ids=["all-softmax", "topk-softmax"])
def test_qwen3_moe_imports_with_its_logits_and_exports_bitwise(
    tmp_path: Path, norm_topk_prob: bool
) -> None:
    fields = {**QWEN3_MOE, "norm_topk_prob": norm_topk_prob}
    error, state, files, exported = _import_export("qwen3_moe", fields, tmp_path)
    assert error < MAX_RELATIVE_ERROR
    assert state.config.moe_layer_freq == [0, 1, 1] and state.config.qk_layernorm
    assert state.config.moe_router_pre_softmax is not norm_topk_prob
    fc2 = state.state_dict["decoder.layers.2.mlp.experts.linear_fc2.weight"]
    assert torch.equal(fc2[3], files["model.layers.2.mlp.experts.3.down_proj.weight"])
    _assert_bitwise(files, exported)


@pytest.mark.parametrize(
    ("model_type", "fields", "message"),
    [
        ("deepseek_v3", {**DEEPSEEK, "rope_interleave": False}, "rope_interleave false"),
        ("deepseek_v3", {**DEEPSEEK, "norm_topk_prob": False}, "norm_topk_prob false"),
        ("deepseek_v3", {**DEEPSEEK, "num_experts_per_tok": 2}, "transformers sums 2"),
        ("deepseek_v3", {**DEEPSEEK, "rms_norm_eps": 1e-5}, "latent norms keep eps 1e-06"),
        ("mixtral", {**MIXTRAL, "sliding_window": 8}, "sliding_window 8"),
    ],
)
def test_what_our_model_does_not_compute_is_refused(
    tmp_path: Path, model_type: str, fields: dict, message: str
) -> None:
    _hf_model(model_type, fields, tmp_path)
    with pytest.raises(ConversionError, match=message):
        load_hf(str(tmp_path))


def test_moe_export_refuses_what_no_architecture_has(tmp_path: Path) -> None:
    _hf_model("mixtral", MIXTRAL, tmp_path / "hf")
    config = load_hf(str(tmp_path / "hf")).config
    config.moe_shared_expert_intermediate_size = 16
    with pytest.raises(UnsupportedArchitectureError, match="mixtral: it has no shared experts"):
        hf_architecture(config)
    config.moe_shared_expert_intermediate_size = None
    hf_architecture(config)  # the model as imported exports
    # Mixtral and Qwen3-MoE rotate whole heads: learned positions or partial rotary (exported
    # as Mixtral, logits were 97-131% off) are refused, as muP is for every architecture.
    for field, value in (("position_embedding_type", "learned_absolute"), ("rotary_percent", 0.5)):
        changed = dataclasses.replace(config, **{field: value})
        with pytest.raises(UnsupportedArchitectureError, match="rotary embeddings over whole"):
            hf_architecture(changed)
    changed = dataclasses.replace(config, use_mup=True, mup_base_hidden_size=16)
    with pytest.raises(UnsupportedArchitectureError, match="has muP"):
        hf_architecture(changed)


def test_expert_bias_matters_to_the_comparison(tmp_path: Path) -> None:
    """Negative control: dropping DeepSeek's expert bias (it changes only which experts are
    chosen) pushes the error far over the bar, so the bar checks the routing."""
    hf_model = _hf_model("deepseek_v3", DEEPSEEK, tmp_path)
    state = load_hf(str(tmp_path))
    for name, tensor in state.state_dict.items():
        if name.endswith("router.expert_bias"):
            tensor.zero_()
    ours = GPTModel(state.config).eval()
    ours.load_state_dict(state.state_dict, strict=True)
    tokens = torch.randint(0, DEEPSEEK["vocab_size"], (2, SEQ))
    with torch.no_grad():
        error = _relative_error(ours(tokens), hf_model(input_ids=tokens).logits)
    assert error > 100 * MAX_RELATIVE_ERROR


def _convert(*argv: str) -> None:
    command = [sys.executable, "tools/checkpoint/convert.py", *argv]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]


def test_qwen3_moe_through_our_checkpoint_exports_bitwise(tmp_path: Path) -> None:
    """hf -> megatron_fp8 (the MoE flags recorded from config.json) -> hf: the same files."""
    _hf_model("qwen3_moe", QWEN3_MOE, tmp_path / "hf")
    _convert(
        "--loader",
        "hf",
        "--saver",
        "megatron_fp8",
        "--load-dir",
        str(tmp_path / "hf"),
        "--save-dir",
        str(tmp_path / "ckpt"),
    )
    _convert(
        "--loader",
        "megatron_fp8",
        "--saver",
        "hf",
        "--load-dir",
        str(tmp_path / "ckpt"),
        "--save-dir",
        str(tmp_path / "out"),
    )
    files = safetensors_torch.load_file(str(tmp_path / "hf" / "model.safetensors"))
    _assert_bitwise(files, safetensors_torch.load_file(str(tmp_path / "out" / "model.safetensors")))
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["mlp_only_layers"], written["num_experts"]) == ([0], 4)


def test_deepseek_v3_through_our_checkpoint_exports_bitwise(tmp_path: Path) -> None:
    """hf -> megatron_fp8 -> hf with a non-zero expert bias (saved as model_buffers.pt) and
    the published-style MTP layer: the same files."""
    _hf_model("deepseek_v3", DEEPSEEK, tmp_path / "hf")
    _add_published_mtp_layer(tmp_path / "hf", DEEPSEEK)
    for loader, saver, source, target in (
        ("hf", "megatron_fp8", "hf", "ckpt"),
        ("megatron_fp8", "hf", "ckpt", "out"),
    ):
        _convert(
            "--loader", loader, "--saver", saver,
            "--load-dir", str(tmp_path / source), "--save-dir", str(tmp_path / target),
        )  # fmt: skip
    files = safetensors_torch.load_file(str(tmp_path / "hf" / "model.safetensors"))
    exported = safetensors_torch.load_file(str(tmp_path / "out" / "model.safetensors"))
    assert files["model.layers.1.mlp.gate.e_score_correction_bias"].abs().max() > 0
    _assert_bitwise(files, exported)


def test_mcore_saver_refuses_what_it_would_lose(tmp_path: Path) -> None:
    _hf_model("deepseek_v3", DEEPSEEK, tmp_path / "hf")
    _add_published_mtp_layer(tmp_path / "hf", DEEPSEEK)
    argv = ["--loader", "hf", "--saver", "mcore", "--load-dir", str(tmp_path / "hf")]
    message = "has MoE layers, multi-latent attention, QK norm, multi-token prediction"
    with pytest.raises(ConversionError, match=message):
        convert([*argv, "--save-dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
