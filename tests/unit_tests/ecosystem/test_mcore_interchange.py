"""Megatron-LM checkpoints in and out, against real megatron-core 0.16.1 in its own venv.

mcore_reference.py (run by the venv's python, from a directory without our `megatron/`) writes
a torch_dist checkpoint the way Megatron-LM's training does, and its logits on fixed tokens. We
import it (`--loader mcore --saver megatron_fp8`) and compare our logits; then export ours
(`--saver mcore`), have megatron-core load that into its GPTModel, and compare its logits with
the original ones bitwise. The venv: $MCORE_VENV, else .venv-mcore here (scripts/setup_mcore_venv.sh
creates it; scripts/run_tests.sh and .ci/run call it).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from megatron.core.models.gpt.gpt_model import GPTModel

REPO_ROOT = Path(__file__).resolve().parents[3]
REFERENCE = Path(__file__).with_name("mcore_reference.py")
MAX_RELATIVE_ERROR = 1e-5


def _venv_python() -> Path:
    candidates = [os.environ.get("MCORE_VENV"), str(REPO_ROOT / ".venv-mcore")]
    for venv in filter(None, candidates):
        python = Path(venv) / "bin" / "python"
        if python.is_file():
            return python
    pytest.skip(
        "no megatron-core 0.16.1 venv (MCORE_VENV or .venv-mcore): "
        "`bash scripts/setup_mcore_venv.sh` creates it (needs network access to PyPI)"
    )


def _reference(*argv: str, cwd: Path) -> None:
    """The venv's python, without our PYTHONPATH (our `megatron` would shadow megatron-core)."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["PYTHONWARNINGS"] = "ignore"
    result = subprocess.run(
        [str(_venv_python()), str(REFERENCE), *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


def _convert(*argv: str) -> str:
    from tools.checkpoint.convert import convert

    return convert(list(argv))


def _our_logits(checkpoint: Path, tokens: torch.Tensor) -> tuple[torch.Tensor, dict]:
    from megatron.training.checkpoint import load_state_for_export

    state_dict, config = load_state_for_export(str(checkpoint))
    model = GPTModel(config).eval()
    model.load_state_dict(state_dict, strict=True)
    with torch.no_grad():
        return model(tokens), json.loads(
            (checkpoint / "iter_0000007" / "metadata.json").read_text()
        )["model_config"]


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["llama", "gpt"])
def test_megatron_core_checkpoint_round_trip(tmp_path: Path, variant: str) -> None:
    reference = tmp_path / "reference"
    reference.mkdir()
    _reference("save", "--variant", variant, "--out", str(reference), cwd=tmp_path)
    tokens = torch.load(reference / "tokens.pt")
    their_logits = torch.load(reference / "logits.pt")
    assert their_logits.shape == (2, 16, 96) and their_logits.std().item() > 0.5

    ours = tmp_path / "ours"
    _convert(
        "--loader",
        "mcore",
        "--saver",
        "megatron_fp8",
        "--load-dir",
        str(reference / "ckpt"),
        "--save-dir",
        str(ours),
    )
    our_logits, config = _our_logits(ours, tokens)  # the iteration (7) is kept
    assert _relative_error(our_logits, their_logits) < MAX_RELATIVE_ERROR
    expected = {
        "llama": dict(
            normalization="RMSNorm",
            swiglu=True,
            num_query_groups=2,
            kv_channels=24,
            rotary_base=5000,
            position_embedding_type="rope",
            add_bias_linear=False,
            untie_embeddings_and_output_weights=True,
            ffn_hidden_size=80,
        ),
        "gpt": dict(
            normalization="LayerNorm",
            swiglu=False,
            num_query_groups=4,
            kv_channels=16,
            position_embedding_type="learned_absolute",
            add_bias_linear=True,
            untie_embeddings_and_output_weights=False,
            max_sequence_length=32,
        ),
    }[variant]
    assert {key: config[key] for key in expected} == expected
    assert (config["vocab_size"], config["layernorm_epsilon"]) == (96, 1e-6)

    exported = tmp_path / "exported"
    _convert(
        "--loader",
        "megatron_fp8",
        "--saver",
        "mcore",
        "--load-dir",
        str(ours),
        "--save-dir",
        str(exported),
    )
    assert (exported / "latest_checkpointed_iteration.txt").read_text() == "7"
    _reference(
        "load",
        "--ckpt",
        str(exported),
        "--tokens",
        str(reference / "tokens.pt"),
        "--out",
        str(tmp_path / "reloaded.pt"),
        cwd=tmp_path,
    )
    assert torch.equal(torch.load(tmp_path / "reloaded.pt"), their_logits)


def _relative_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    return ((actual - reference).abs().max() / reference.abs().max()).item()


def test_qkv_layout_is_per_query_group() -> None:
    """megatron-core's rows, group by group: [q heads of the group | k | v]; ours [q | k | v]."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    from tools.checkpoint.mcore import qkv_mcore_to_ours, qkv_ours_to_mcore

    config = TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=1,
        vocab_size=8,
        max_sequence_length=4,
    )
    # Row labels: q0 q1 k0 v0 | q2 q3 k1 v1 (one channel per head).
    mcore_rows = torch.tensor([0.0, 1.0, 10.0, 20.0, 2.0, 3.0, 11.0, 21.0])
    ours = qkv_mcore_to_ours(mcore_rows, config)
    assert ours.tolist() == [0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 20.0, 21.0]
    assert torch.equal(qkv_ours_to_mcore(ours, config), mcore_rows)
    weight = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)
    assert torch.equal(qkv_ours_to_mcore(qkv_mcore_to_ours(weight, config), config), weight)


def _edited_mcore_checkpoint(path: Path, monkeypatch, edit) -> None:
    """A small Llama-layout Megatron-LM checkpoint written by our saver, its tensors edited."""
    import tools.checkpoint.mcore as mcore
    from megatron.core.transformer.transformer_config import TransformerConfig
    from tools.checkpoint.model_state import ModelState

    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=64,
        max_sequence_length=16,
        normalization="RMSNorm",
        swiglu=True,
        position_embedding_type="rope",
        num_query_groups=2,
        add_bias_linear=False,
    )
    state_dict = {name: p.detach() for name, p in GPTModel(config).named_parameters()}
    original = mcore.mcore_state_dict

    def edited(state):
        tensors = original(state)
        edit(tensors)
        return tensors

    monkeypatch.setattr(mcore, "mcore_state_dict", edited)
    mcore.save_mcore(ModelState(state_dict=state_dict, config=config, iteration=3), str(path))
    monkeypatch.undo()


def _drop_fc2(tensors: dict) -> None:
    del tensors["decoder.layers.mlp.linear_fc2.weight"]


def _add_q_layernorm(tensors: dict) -> None:
    tensors["decoder.layers.self_attention.q_layernorm.weight"] = torch.ones(2, 8)


@pytest.mark.parametrize(
    ("edit", "flags", "message"),
    [
        (
            None,
            ["--num-attention-heads", "8"],
            "--num-attention-heads 8 contradicts the mcore checkpoint, which records 4",
        ),
        (_drop_fc2, [], "tensor decoder.layers.mlp.linear_fc2.weight is missing"),
        (_add_q_layernorm, [], "unexpected tensor decoder.layers.self_attention.q_layernorm"),
    ],
    ids=["contradicting-flag", "missing", "extra"],
)
def test_bad_mcore_input_fails_before_writing(
    tmp_path: Path, monkeypatch, capsys, edit, flags, message
) -> None:
    from tools.checkpoint.convert import main

    _edited_mcore_checkpoint(tmp_path / "mc", monkeypatch, edit or (lambda tensors: None))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "--loader",
                "mcore",
                "--saver",
                "megatron_fp8",
                "--load-dir",
                str(tmp_path / "mc"),
                "--save-dir",
                str(tmp_path / "out"),
                *flags,
            ]
        )
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mc"]


def test_checkpoint_without_args_takes_the_command_line(tmp_path: Path, capsys) -> None:
    """Megatron-LM checkpoints whose common.pt has no args: the model flags come from the
    converter's command line, with Megatron's names; missing ones are named."""
    from tools.checkpoint.convert import convert, main

    _edited_mcore_checkpoint(tmp_path / "mc", pytest.MonkeyPatch(), lambda tensors: None)
    common_path = tmp_path / "mc" / "iter_0000003" / "common.pt"
    common = torch.load(common_path, weights_only=False)
    del common["args"]
    torch.save(common, common_path)
    base = ["--loader", "mcore", "--saver", "megatron_fp8", "--load-dir", str(tmp_path / "mc")]
    with pytest.raises(SystemExit):
        main([*base, "--save-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert "(no saved args) and the command line: records no num_attention_heads" in err
    flags = [
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--group-query-attention",
        "--num-query-groups",
        "2",
        "--normalization",
        "RMSNorm",
        "--swiglu",
        "--position-embedding-type",
        "rope",
        "--max-position-embeddings",
        "16",
        "--disable-bias-linear",
    ]
    convert([*base, "--save-dir", str(tmp_path / "out"), *flags])
    metadata = json.loads((tmp_path / "out" / "iter_0000003" / "metadata.json").read_text())
    assert metadata["model_config"]["num_query_groups"] == 2
    assert metadata["model_config"]["vocab_size"] == 64  # read off the embedding's rows
    assert metadata["model_config"]["num_layers"] == 2  # read off the layer-stacked tensors


def test_local_spec_norm_names_are_read(tmp_path: Path, monkeypatch) -> None:
    """Norms under the local spec's own names (input_layernorm, pre_mlp_layernorm) import as
    the TE-spec names (linear_qkv/linear_fc1.layer_norm_weight) do."""
    from tools.checkpoint.megatron_fp8 import load_megatron_fp8

    def local_names(tensors: dict) -> None:
        for te_name, local_name in (
            ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
            ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
        ):
            tensors[f"decoder.layers.{local_name}"] = tensors.pop(f"decoder.layers.{te_name}")
            tensors[f"decoder.layers.{local_name}"][1] += 1.0  # layer 1 differs from layer 0

    paths = {}
    for name, edit in (("te", lambda tensors: None), ("local", local_names)):
        _edited_mcore_checkpoint(tmp_path / f"mc_{name}", monkeypatch, edit)
        paths[name] = tmp_path / f"ours_{name}"
        source = str(tmp_path / f"mc_{name}")
        _convert(
            "--loader",
            "mcore",
            "--saver",
            "megatron_fp8",
            "--load-dir",
            source,
            "--save-dir",
            str(paths[name]),
        )
    te, local = (load_megatron_fp8(str(paths[name])).state_dict for name in ("te", "local"))
    for norm in ("input_layernorm", "pre_mlp_layernorm"):
        assert torch.equal(
            local[f"decoder.layers.0.{norm}.weight"], te[f"decoder.layers.0.{norm}.weight"]
        )
        assert torch.equal(
            local[f"decoder.layers.1.{norm}.weight"], te[f"decoder.layers.1.{norm}.weight"] + 1.0
        )


class _RunsCommand:
    """What a crafted common.pt could hold: unpickling it would run a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_common_pt_is_read_without_running_code(tmp_path: Path) -> None:
    import argparse

    from tools.checkpoint import mcore_files

    marker = tmp_path / "ran"
    args = argparse.Namespace(hidden_size=64, payload=_RunsCommand(marker), dtype=torch.bfloat16)
    torch.save({"args": args, "iteration": 5}, tmp_path / "common.pt")
    common = mcore_files.read_common(str(tmp_path))
    assert not marker.exists()
    assert isinstance(common["args"].payload, mcore_files.Opaque)
    assert common["args"].payload.qualname in ("posix.system", "nt.system")
    assert (common["iteration"], common["args"].hidden_size) == (5, 64)
    assert common["args"].dtype is torch.bfloat16


@pytest.mark.parametrize(
    ("fields", "feature"),
    [
        (dict(use_mup=True, mup_base_hidden_size=16), "muP"),
        (dict(rope_type="yarn", rotary_scaling_factor=4.0), "YaRN rotary scaling"),
        (dict(qk_layernorm=True), "QK norm"),
    ],
)
def test_mcore_saver_refuses_what_its_args_do_not_record(tmp_path: Path, fields, feature) -> None:
    """muP and YaRN are not in the Megatron-LM args the saver writes (a model built from them
    would be another model): refused before anything is written, as MoE and QK norm are."""
    import tools.checkpoint.mcore as mcore
    from megatron.core.transformer.transformer_config import TransformerConfig
    from tools.checkpoint.model_state import ModelState

    config = TransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64,
        max_sequence_length=16, normalization="RMSNorm", swiglu=True,
        position_embedding_type="rope", add_bias_linear=False, **fields,
    )  # fmt: skip
    state_dict = {name: p.detach() for name, p in GPTModel(config).named_parameters()}
    with pytest.raises(mcore.ConversionError, match=f"this one has {feature}: use --saver"):
        mcore.save_mcore(ModelState(state_dict=state_dict, config=config), str(tmp_path / "m"))
    assert list(tmp_path.iterdir()) == []


def test_megatron_lm_args_read_query_groups_as_megatron_lm_does() -> None:
    """--group-query-attention without --num-query-groups is one key/value head (Megatron-LM's
    default 1); --num-query-groups without --group-query-attention is ignored."""
    from tools.checkpoint.model_flags import config_from_megatron_args

    base = dict(num_layers=1, hidden_size=32, num_attention_heads=4, padded_vocab_size=64)
    base.update(seq_length=16)
    gqa = config_from_megatron_args({**base, "group_query_attention": True}, source="args")
    assert gqa.num_query_groups == 1
    mha = config_from_megatron_args({**base, "num_query_groups": 2}, source="args")
    assert mha.num_query_groups == 4
    both = {**base, "group_query_attention": True, "num_query_groups": 2}
    assert config_from_megatron_args(both, source="args").num_query_groups == 2
