"""Fp8Linear under torch.compile: the GEMM is the custom op `megatron_fp8::gemm` (opaque to the
compiler, with a fake implementation), every recipe compiles a transformer layer without a graph
break (GPU), and compiled FP8 operands and outputs equal eager ones bitwise (GPU). The CPU twins
check the op's registration, its fake, and compiled-vs-eager equality of the op on CPU."""

from __future__ import annotations

import re

import pytest
import torch
from torch._dynamo.utils import counters

from megatron.core.fp8 import Fp8Config, fp8_autocast, quantized_model_init, reference_ops
from megatron.core.fp8.compile import prepare_for_compile
from megatron.core.fp8.cuda import linear_ops
from megatron.core.fp8.quantization import fp8_gemm
from megatron.core.fp8.quantized_tensor import Fp8Operand
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

E4M3 = torch.float8_e4m3fn
RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")


def _tensorwise_operands(rows: int, cols: int, k: int):
    generator = torch.Generator().manual_seed(3)
    a = (torch.randn(rows, k, generator=generator) * 4).to(E4M3)
    b = (torch.randn(cols, k, generator=generator) * 4).to(E4M3)
    return a, torch.tensor(0.5), b, torch.tensor(0.25)


def test_gemm_op_passes_opcheck_on_cpu():
    a, sa, b, sb = _tensorwise_operands(32, 48, 64)
    # The schema check mutates inputs with ops that FP8 dtypes lack: fake and dispatch only.
    torch.library.opcheck(
        linear_ops._gemm_op,
        (a, sa, b, sb, "tensorwise", torch.bfloat16, False),
        test_utils=("test_faketensor", "test_aot_dispatch_dynamic"),
    )
    # Emulated MXFP8: dequantized bf16 operands, no scales.
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(32, 64, generator=generator).to(torch.bfloat16)
    w = torch.randn(48, 64, generator=generator).to(torch.bfloat16)
    torch.library.opcheck(linear_ops._gemm_op, (x, None, w, None, "mxfp8", torch.float32, False))


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("role", ["input", "weight"])
def test_reference_ops_pass_opcheck(recipe: str, role: str):
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(96, 256, generator=generator).to(torch.bfloat16)
    delayed = recipe == "delayed"
    scale = torch.tensor(3.0) if delayed else None
    history = torch.zeros(4) if delayed else None
    power_2 = recipe in ("blockwise", "mxfp8")
    args = (x, recipe, E4M3, role, True, True, power_2, scale, history)
    torch.library.opcheck(reference_ops._quantize_operands_op, args)
    operands = {}
    for name, tensor, tensor_role in (("a", x, "input"), ("b", x[:64], "weight")):
        operands[name] = reference_ops.quantize_operands(
            tensor,
            recipe=recipe,
            fp8_dtype=E4M3,
            role=tensor_role,
            rowwise=True,
            transposed=True,
            power_2_scale=power_2,
            scale=scale,
        )
    (a, a_t), (b, _) = operands["a"], operands["b"]
    assert a.data.shape == (96, 256) and a_t.data.shape == (256, 96)
    cells = [a.block_rows, a.block_cols, b.block_rows, b.block_cols]
    # The fake and dispatch only: the schema check writes into FP8 inputs, which FP8 lacks ops for.
    torch.library.opcheck(
        reference_ops._gemm_op,
        (
            a.data,
            a.scale_inv,
            b.data,
            b.scale_inv,
            recipe,
            cells,
            torch.float32,
            False,
        ),
        test_utils=("test_faketensor", "test_aot_dispatch_dynamic"),
    )
    expected = fp8_gemm(a, b, out_dtype=torch.float32)
    assert torch.equal(
        reference_ops.gemm(a, b, recipe=recipe, out_dtype=torch.float32, fast_accum=False), expected
    )


def test_gemm_op_fake_gives_the_output_shape_and_dtype():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = torch.empty(128, 256, dtype=E4M3)
        b = torch.empty(96, 256, dtype=E4M3)
        out = linear_ops._gemm_op(
            a, torch.empty(()), b, torch.empty(()), "tensorwise", torch.bfloat16, True
        )
    assert (tuple(out.shape), out.dtype, out.stride()) == ((128, 96), torch.bfloat16, (96, 1))


def test_compiled_gemm_equals_eager_on_cpu():
    a, sa, b, sb = _tensorwise_operands(64, 80, 128)

    def product(a, sa, b, sb):
        y = linear_ops.gemm(
            Fp8Operand(a, sa),
            Fp8Operand(b, sb),
            recipe="tensorwise",
            out_dtype=torch.float32,
            fast_accum=False,
        )
        return torch.nn.functional.silu(y) * 2.0

    eager = product(a, sa, b, sb)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(product)(a, sa, b, sb)
    assert explanation.graph_break_count == 0
    ops = [node.target for graph in explanation.graphs for node in graph.graph.nodes]
    assert torch.ops.megatron_fp8.gemm.default in ops
    compiled = torch.compile(product, backend="aot_eager")(a, sa, b, sb)
    assert torch.equal(compiled, eager)
    expected = a.float() @ b.float().t() * (0.5 * 0.25)
    assert torch.allclose(eager, torch.nn.functional.silu(expected) * 2.0, rtol=1e-5, atol=1e-5)


# --- GPU: a whole transformer layer per recipe -------------------------------------------------


def _layer_config(recipe: str) -> TransformerConfig:
    return TransformerConfig(
        num_layers=1,
        hidden_size=256,
        ffn_hidden_size=512,
        num_attention_heads=4,
        vocab_size=128,
        max_sequence_length=256,
        normalization="RMSNorm",
        swiglu=True,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.bfloat16,
        fp8=Fp8Config(recipe=recipe, fp8_format="hybrid"),
    )


def _fp8_layer(recipe: str, *, fp8_params: bool, device: str = "cuda") -> TransformerLayer:
    config = _layer_config(recipe)
    torch.manual_seed(0)
    with torch.device(device):
        if fp8_params:
            with quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True):
                return TransformerLayer(config, layer_number=1)
        return TransformerLayer(config, layer_number=1)


gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


LAYER_CASES = [(recipe, fp8_params) for recipe in RECIPES for fp8_params in (False, True)]


@gpu
@needs_cuda
@pytest.mark.parametrize("recipe, fp8_params", LAYER_CASES)
def test_layer_compiles_without_graph_breaks_and_equals_eager(recipe: str, fp8_params: bool):
    _check_layer_compiles(recipe, fp8_params, device="cuda", tokens=256)


def _check_layer_compiles(recipe: str, fp8_params: bool, *, device: str, tokens: int) -> None:
    x = torch.randn(2, tokens, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    config = Fp8Config(recipe=recipe, fp8_format="hybrid")
    # Eager and compiled runs each start from a fresh, identical layer (delayed scaling's
    # state moves with every forward). The compiled one as in training: its forward compiled
    # and prepared (model_setup.compile_layers), called as a module under fp8_autocast, so
    # prepare_for_compile's hooks run eagerly around the graph.
    eager_layer, compiled_layer = (
        _fp8_layer(recipe, fp8_params=fp8_params, device=device) for _ in range(2)
    )
    prepare_for_compile(compiled_layer)
    compiled_layer.forward = torch.compile(compiled_layer.forward)
    weights, compiled_weights = _linear_weights(eager_layer), _linear_weights(compiled_layer)
    assert all(weight.requires_grad for weight in weights + compiled_weights)
    # backward(), not autograd.grad: a compiled FP8 weight gets its grad through its stand-in's
    # post-accumulate-grad hook, which autograd.grad does not run.
    x_eager, x_compiled = (x.detach().clone().requires_grad_() for _ in range(2))
    with fp8_autocast(eager_layer, enabled=True, fp8_config=config):
        eager = eager_layer(x_eager)
    eager.float().sum().backward()
    torch._dynamo.reset()
    counters.clear()
    with fp8_autocast(compiled_layer, enabled=True, fp8_config=config):
        compiled = compiled_layer(x_compiled)
    compiled.float().sum().backward()
    # One graph for the whole layer: no graph break, FP8-parameter Linears and delayed
    # scaling included.
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    grad_eager, grad_compiled = x_eager.grad, x_compiled.grad
    # Every FP8 weight gets its grad (wgrad GEMM) in the compiled backward, as in eager.
    for want, got in zip(weights, compiled_weights, strict=True):
        assert got.grad is not None
        assert _relative_error(got.grad, want.grad) < 0.06
    # Inductor fuses the norms and SwiGLU in another order, so a few bf16 values round
    # differently and land on neighbouring FP8 values: the outputs agree at FP8 noise level
    # (an E4M3 step is 1/8 to 1/16 relative), not bitwise. The FP8 bytes of the same input are
    # compared exactly below.
    output_error = _relative_error(compiled, eager)
    grad_error = _relative_error(grad_compiled, grad_eager)
    print(
        f"{recipe} fp8_params={fp8_params}: relative error out {output_error:.4f}, "
        f"grad {grad_error:.4f}"
    )
    assert output_error < 0.03 and grad_error < 0.06


@pytest.mark.slow
@pytest.mark.parametrize("recipe, fp8_params", LAYER_CASES)
def test_layer_compiles_without_graph_breaks_and_equals_eager_on_cpu(recipe: str, fp8_params: bool):
    # CPU twin of the GPU test: the reference backend (reference_ops) behind the same
    # Fp8Linear forward, its quantization and GEMM custom ops in the graph.
    _check_layer_compiles(recipe, fp8_params, device="cpu", tokens=64)


def _linear_weights(layer: TransformerLayer) -> list[torch.Tensor]:
    return [
        layer.self_attention.linear_qkv.weight,
        layer.self_attention.linear_proj.weight,
        layer.mlp.linear_fc1.weight,
        layer.mlp.linear_fc2.weight,
    ]


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm())


@gpu
@needs_cuda
@pytest.mark.parametrize("recipe", RECIPES)
def test_compiled_operands_equal_eager_bytes(recipe: str):
    torch.manual_seed(1)
    x = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16) * 3
    x[:, :64] *= 40.0
    scale = torch.tensor(7.0, device="cuda") if recipe == "delayed" else None
    options = dict(
        recipe=recipe,
        fp8_dtype=E4M3,
        role="input",
        rowwise=True,
        transposed=True,
        power_2_scale=recipe in ("blockwise", "mxfp8"),
        scale=scale,
    )

    def operands(x):
        row, col = linear_ops.quantize_operands(x, **options)
        return row.data, row.scale_inv, col.data, col.scale_inv

    eager = operands(x)
    compiled = torch.compile(operands)(x)
    for want, got in zip(eager, compiled):
        if want is None:
            assert got is None
            continue
        assert want.shape == got.shape
        want_bytes, got_bytes = (t.contiguous().reshape(-1).view(torch.uint8) for t in (want, got))
        assert torch.equal(want_bytes, got_bytes)


def _rmsnorm(x, weight):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5) * weight).to(x.dtype)


def _swiglu(h):
    gate, up = h.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@gpu
@needs_cuda
@pytest.mark.parametrize("producer", ["rmsnorm", "swiglu"])
def test_compiled_tensorwise_amax_is_fused_into_the_producer(producer: str):
    # Compiled, tensorwise takes max|x| from linear_ops.producer_amax: Inductor computes the
    # row maxima in the producer's kernel (no amax pass over x), and the bytes equal the
    # eager quantization (with its amax pass) of the same produced tensor.
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(4)
    if producer == "rmsnorm":
        inputs = (torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16) * 3,)
        inputs += (torch.rand(1024, device="cuda") * 2 + 0.1,)
        produce, names = _rmsnorm, ("rsqrt", "amax")
    else:
        inputs = (torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16) * 2,)
        produce, names = _swiglu, ("silu", "amax")
    options = dict(recipe="tensorwise", fp8_dtype=E4M3, role="input", power_2_scale=False)

    def produced_operands(*args):
        x = produce(*args)
        row, col = linear_ops.quantize_operands(x, rowwise=True, transposed=True, **options)
        return x, row.data, col.data, row.scale_inv

    torch._dynamo.reset()
    (x, row, col, scale_inv), code = run_and_get_code(torch.compile(produced_operands), *inputs)
    source = "\n".join(code)
    assert "def amax_partials_kernel(" not in source  # the cast kernel's docstring names it
    kernels = set(re.findall(r"def (triton_(?:per|red)_fused_\w+)\(", source))
    print(f"{producer}: {sorted(kernels)}")
    assert any(all(name in kernel for name in names) for kernel in kernels), kernels
    want_row, want_col = linear_ops.quantize_operands(x, rowwise=True, transposed=True, **options)
    assert torch.equal(scale_inv, want_row.scale_inv)
    for got, want in ((row, want_row.data), (col, want_col.data)):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@gpu
@needs_cuda
def test_compiled_delayed_recording_equals_eager_with_stacked_histories():
    # Delayed scaling records max|x| into slot 0 of each history; after a flush the histories
    # are rows of one stacked tensor (autocast._flush_metas). Compiled, the recording is the
    # custom op megatron_fp8::quantize_operands_recording: same bytes and records as eager.
    torch.manual_seed(2)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16) * 3
    dy = torch.randn(512, 128, device="cuda", dtype=torch.bfloat16) * 0.01
    scale = torch.tensor(11.0, device="cuda")
    args = (x, "delayed", E4M3, "input", True, True, False, scale, torch.zeros(8, device="cuda"))
    torch.library.opcheck(linear_ops._recording_op, args)

    def operands(x, dy, histories):
        out = []
        for tensor, history, role in ((x, histories[0], "input"), (dy, histories[1], "grad")):
            row, col = linear_ops.quantize_operands(
                tensor,
                recipe="delayed",
                fp8_dtype=E4M3,
                role=role,
                rowwise=True,
                transposed=True,
                power_2_scale=False,
                scale=scale,
                amax_history=history,
            )
            out += [row.data, col.data, row.scale_inv]
        return out

    stacks = [torch.zeros(2, 8, device="cuda") for _ in range(2)]
    for stack in stacks:
        stack[:, 0] = torch.tensor([1e-3, 5.0])  # slot 0 already holds a record
    eager = operands(x, dy, stacks[0].unbind(0))
    compiled = torch.compile(operands)(x, dy, stacks[1].unbind(0))
    for want, got in zip(eager, compiled, strict=True):
        assert torch.equal(*(t.reshape(-1).view(torch.uint8) for t in (want, got)))
    # x's max|x| replaced the smaller record; dy's is below the 5.0 already there.
    assert float(stacks[0][0, 0]) == float(x.abs().max().float())
    assert float(stacks[0][1, 0]) == 5.0
    assert torch.equal(stacks[0], stacks[1])


def test_recording_op_fake_gives_the_operand_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(96, 64, dtype=torch.bfloat16)
        history = torch.empty(4)
        data, data_t, scale_inv = linear_ops._recording_op(
            x, "delayed", E4M3, "input", True, False, False, torch.empty(()), history
        )
    shapes = [(tuple(t.shape), t.dtype) for t in (data, data_t, scale_inv)]
    assert shapes == [((96, 64), torch.uint8), ((0,), torch.uint8), ((), torch.float32)]
