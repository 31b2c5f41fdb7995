"""fc2's wgrad input recomputed from the activation's input (`wgrad_input_from_activation`):
the MLP's outputs and every grad equal the default's bitwise, fc2 keeps no FP8 copy of its input
(only fc1's output, which the activation keeps anyway), and a compiled layer still has no graph
break. CPU (reference backend); the same code path runs the fused kernels on CUDA."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from megatron.core.fp8 import Fp8Config, Fp8Linear, quantized_model_init
from megatron.core.fp8.compile import prepare_for_compile
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")


def _config(recipe: str, *, from_activation: bool, swiglu: bool = True) -> TransformerConfig:
    return TransformerConfig(
        num_layers=1,
        hidden_size=128,
        ffn_hidden_size=256,
        num_attention_heads=4,
        vocab_size=128,
        max_sequence_length=64,
        normalization="RMSNorm",
        swiglu=swiglu,
        add_bias_linear=not swiglu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.bfloat16,
        fp8=Fp8Config(
            recipe=recipe, fp8_format="hybrid", wgrad_input_from_activation=from_activation
        ),
    )


def _build(cls, config: TransformerConfig, *, fp8_params: bool):
    torch.manual_seed(0)
    if fp8_params:
        with quantized_model_init(recipe=config.fp8.recipe, preserve_high_precision_init_val=True):
            return cls(config, layer_number=1)
    return cls(config, layer_number=1)


def _run(module, x: torch.Tensor, steps: int = 2):
    """Outputs and grads of `steps` forward/backward passes (delayed scaling's state moves)."""
    results = []
    for step in range(steps):
        x_step = (x * (step + 1)).detach().requires_grad_()
        out = module(x_step)
        out.float().square().sum().backward()
        grads = [p.grad.clone() for p in module.parameters() if p.grad is not None]
        module.zero_grad(set_to_none=True)
        results.append((out.detach(), x_step.grad, grads))
    return results


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("fp8_params", [False, True])
@pytest.mark.parametrize("use_swiglu", [True, False])
def test_mlp_equals_the_default_bitwise(recipe: str, fp8_params: bool, use_swiglu: bool):
    x = torch.randn(2, 32, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    default, recomputing = (
        _build(MLP, _config(recipe, from_activation=flag, swiglu=use_swiglu), fp8_params=fp8_params)
        for flag in (False, True)
    )
    for want, got in zip(_run(default, x), _run(recomputing, x), strict=True):
        (out_w, dx_w, grads_w), (out_g, dx_g, grads_g) = want, got
        assert torch.equal(_bits(out_w), _bits(out_g))
        assert torch.equal(_bits(dx_w), _bits(dx_g))
        assert len(grads_w) == len(grads_g) == len(list(default.parameters()))
        for a, b in zip(grads_w, grads_g, strict=True):
            assert torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("recipe", RECIPES)
def test_fc2_keeps_fc1_output_not_an_fp8_copy(recipe: str):
    x = torch.randn(2, 32, 128).to(torch.bfloat16)
    for flag in (False, True):
        mlp = _build(MLP, _config(recipe, from_activation=flag), fp8_params=True)
        hidden = mlp.linear_fc1(x)
        out = mlp.forward(x)
        node = out.grad_fn  # the autograd Function's ctx
        if flag:
            assert node.saved_input is None
            assert node.saved_source.shape == hidden.shape == (2, 32, 512)
            assert node.saved_source.dtype == torch.bfloat16
        else:
            assert node.saved_source is None
            # The FP8 transposed copy of the SwiGLU output: [256, 64] bytes.
            data = node.saved_input.data
            assert data.element_size() == 1 and data.numel() == 256 * 64


@pytest.mark.parametrize("flag", [False, True])
def test_only_the_recomputed_copy_is_marked_read_at_once(flag: bool, monkeypatch):
    # The backend is told which transposed copies are kept for backward (emulated mxfp8 keeps
    # those as bytes, the rest as values): fc2's recomputed input is read at once (saved=False),
    # every other quantization leaves the role's default (None).
    from megatron.core.fp8 import reference_ops

    calls = []
    quantize = reference_ops.quantize_operands

    def spy(x2d, **kwargs):
        calls.append((kwargs["role"], kwargs["transposed"], kwargs["saved"]))
        return quantize(x2d, **kwargs)

    monkeypatch.setattr(reference_ops, "quantize_operands", spy)
    mlp = _build(MLP, _config("mxfp8", from_activation=flag), fp8_params=False)
    mlp(torch.randn(2, 32, 128).to(torch.bfloat16)).float().sum().backward()
    read_at_once = [call for call in calls if call[2] is not None]
    assert read_at_once == ([("input", True, False)] if flag else [])
    # fc1 and fc2: input and weight in forward, grad in backward; plus the recompute.
    assert len(calls) == 6 + flag


def test_fp8_linear_refuses_half_an_activation_source():
    linear = Fp8Linear(64, 32, bias=False, fp8_config=Fp8Config(recipe="tensorwise"))
    with pytest.raises(ValueError, match="activation_input and activation together"):
        linear(torch.randn(4, 64), activation_input=torch.randn(4, 128))


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_compiled_layer_has_no_graph_break_and_equals_the_compiled_default(recipe: str):
    # Compiled, the recomputation runs in the backward graph: the layer is still one graph,
    # and its outputs and grads equal the compiled default's bitwise.
    x = torch.randn(2, 32, 128, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    results = []
    for flag in (False, True):
        layer = _build(TransformerLayer, _config(recipe, from_activation=flag), fp8_params=True)
        prepare_for_compile(layer)
        layer.forward = torch.compile(layer.forward)
        torch._dynamo.reset()
        counters.clear()
        results.append(_run(layer, x))
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    for (out_d, dx_d, grads_d), (out_r, dx_r, grads_r) in zip(*results, strict=True):
        for want, got in [(out_d, out_r), (dx_d, dx_r), *zip(grads_d, grads_r, strict=True)]:
            assert torch.equal(_bits(want), _bits(got))


@pytest.mark.slow
@pytest.mark.parametrize(
    "compile_flags, recompute",
    [([], False), (["--torch-compile"], False), ([], True)],
    ids=["eager", "compiled", "eager-full-recompute"],
)
def test_pretrain_gpt_flag_trains_the_same_losses(compile_flags, recompute, monkeypatch):
    # The default (`--fp8-wgrad-input-from-activation` on) through the user's entry point: FP8
    # parameters in Megatron-FSDP, SwiGLU, 4 steps; every loss and grad norm equals those of
    # `--no-fp8-wgrad-input-from-activation` (fc2 keeps its FP8 input copy) exactly, and fc2's
    # wgrad input was recomputed in each backward of the default run only.
    from megatron.core.fp8 import linear as fp8_linear
    from tests.unit_tests.training.common import NO_DROPOUT, TINY_GPT, run_pretrain

    calls = []
    if not compile_flags:  # counted in eager only: a traced side effect would change the graph
        recompute = fp8_linear._recomputed_input_operand
        monkeypatch.setattr(
            fp8_linear,
            "_recomputed_input_operand",
            lambda *args: calls.append(1) or recompute(*args),
        )

    flags = [*TINY_GPT, *NO_DROPOUT, "--swiglu", "--disable-bias-linear", "--train-iters", "4"]
    flags += ["--bf16", "--use-megatron-fsdp", "--fp8-recipe", "tensorwise", "--fp8-param-gather"]
    flags += compile_flags
    if recompute:  # the recomputed forward keeps fc1's output for the backward that follows
        flags += ["--recompute-granularity", "full", "--recompute-method", "uniform"]
        flags += ["--recompute-num-layers", "1"]
    keeping = run_pretrain([*flags, "--no-fp8-wgrad-input-from-activation"])
    torch._dynamo.reset()
    assert not calls
    counters.clear()
    recomputing = run_pretrain(flags)
    if compile_flags:
        assert counters["stats"]["calls_captured"] >= 1
        assert not counters["graph_break"], dict(counters["graph_break"])
    else:  # once per fc2 per micro-batch: 2 layers x 4 micro-batches x 4 steps
        assert len(calls) == 2 * 4 * 4
    torch._dynamo.reset()
    steps = range(1, 5)
    assert [keeping.losses[s] for s in steps] == [recomputing.losses[s] for s in steps]
    assert [keeping.grad_norms[s] for s in steps] == [recomputing.grad_norms[s] for s in steps]


def _saved_bytes(layer, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd keeps from one forward (for its backward)."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = layer(x)
    out.float().sum().backward()
    return sum(storages.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("recipe", RECIPES)
def test_compiled_layer_keeps_less_on_gpu(recipe: str):
    # The fused CUDA path, compiled: the recomputation stays in the backward graph, so the
    # forward keeps fc2's input copy no more: 1 byte per element of fc2's input [tokens, ffn]
    # (mxfp8 too: its kept copy is bytes, not dequantized values), plus scales (mxfp8: 1/32).
    tokens, ffn = 2 * 128, 256
    x = torch.randn(2, 128, 128, device="cuda").to(torch.bfloat16).requires_grad_()
    kept = []
    for flag in (False, True):
        with torch.device("cuda"):
            layer = _build(TransformerLayer, _config(recipe, from_activation=flag), fp8_params=True)
        prepare_for_compile(layer)
        layer.forward = torch.compile(layer.forward)
        torch._dynamo.reset()
        _saved_bytes(layer, x)  # compiles
        kept.append(_saved_bytes(layer, x))
    saved = kept[0] - kept[1]
    print(f"{recipe}: kept {kept[0]} -> {kept[1]} bytes")
    assert tokens * ffn <= saved <= 1.1 * tokens * ffn, kept
