"""Fp8Linear vs an fp64 reference, the GEMM copy table, FP8 weights (quantized_model_init)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.core.fp8 import (
    E4M3,
    E5M2,
    Fp8Config,
    Fp8Linear,
    QuantizedTensor,
    clear_high_precision_init_val,
    fp8_autocast,
    get_high_precision_init_val,
    quantize,
    quantized_model_init,
)

RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
# Recorded relative Frobenius-norm error bounds vs fp64 on unit-normal data (measured values
# are about 0.035 for E4M3 tensors and 0.06 where E5M2 grads enter, on every recipe).
FPROP_BOUND = 0.05
GRAD_BOUND = {"e4m3": 0.05, "hybrid": 0.08}
# And a floor: an error this small would mean the GEMM did not run in FP8 at all.
FP8_FLOOR = 0.02


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected).norm() / expected.norm()).item()


def make_pair(recipe: str, fp8_format: str, *, seed: int = 0):
    torch.manual_seed(seed)
    config = Fp8Config(recipe=recipe, fp8_format=fp8_format, amax_history_len=4)
    layer = Fp8Linear(64, 48, fp8_config=config)
    reference = torch.nn.Linear(64, 48).double()
    with torch.no_grad():
        reference.weight.copy_(layer.weight)
        reference.bias.copy_(layer.bias)
    return layer, reference


@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8_format", ["hybrid", "e4m3"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_outputs_and_grads_within_recorded_bounds(recipe, fp8_format, input_dtype):
    layer, reference = make_pair(recipe, fp8_format)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 40, 64, generator=gen).to(input_dtype).requires_grad_()
    x_ref = x.detach().double().requires_grad_()
    grad_y = torch.randn(3, 40, 48, generator=gen)
    for _ in range(2):  # the second step runs delayed scaling with a real (non-1.0) scale
        layer.zero_grad()
        x.grad = None
        with fp8_autocast(layer, fp8_config=layer.fp8_config):
            y = layer(x)
        y.backward(grad_y.to(input_dtype))
    y_ref = reference(x_ref)
    y_ref.backward(grad_y.double())
    assert y.dtype == input_dtype and y.shape == (3, 40, 48)
    assert x.grad.dtype == input_dtype and layer.weight.grad.dtype == torch.float32
    errors = {
        "fprop": rel_err(y, y_ref),
        "dgrad": rel_err(x.grad, x_ref.grad),
        "wgrad": rel_err(layer.weight.grad, reference.weight.grad),
    }
    assert FP8_FLOOR < errors["fprop"] < FPROP_BOUND, errors
    for name in ("dgrad", "wgrad"):
        assert FP8_FLOOR < errors[name] < GRAD_BOUND[fp8_format], errors
    bias_tol = 1e-6 if input_dtype == torch.float32 else 1e-2
    assert rel_err(layer.bias.grad, reference.bias.grad) < bias_tol


@pytest.mark.parametrize("recipe", RECIPES)
def test_gemms_read_the_copies_of_the_table(recipe):
    """fprop/dgrad/wgrad equal hand-built products of the documented copies, bit for bit."""
    config = Fp8Config(recipe=recipe, fp8_format="hybrid")
    torch.manual_seed(3)
    layer = Fp8Linear(64, 32, bias=False, fp8_config=config)
    # Rows of very different size, so that row blocks and column blocks get different scales.
    x = (torch.randn(96, 64) * torch.logspace(-2, 2, 96)[:, None]).requires_grad_()
    grad_y = torch.randn(96, 32)
    y = layer(x)  # outside autocast: FP8 with the layer's own config
    y.backward(grad_y)
    pow2 = {"blockwise": True}.get(recipe)
    scale = {"scale": torch.tensor(1.0)} if recipe == "delayed" else {}

    def q(t, role, fp8_dtype, columnwise):
        return quantize(
            t,
            recipe=recipe,
            fp8_dtype=fp8_dtype,
            role=role,
            rowwise=not columnwise,
            columnwise=columnwise,
            power_2_scale=pow2,
            **scale,
        )

    w = layer.weight.detach()
    x_row, w_row = q(x.detach(), "input", E4M3, False), q(w, "weight", E4M3, False)
    assert torch.equal(y, x_row.dequantize() @ w_row.dequantize().t())
    # dgrad: dY rowwise (E5M2) x W columnwise; wgrad: dY columnwise x X columnwise.
    w_col = q(w, "weight", E4M3, recipe == "mxfp8")
    dy_row, dy_col = q(grad_y, "grad", E5M2, False), q(grad_y, "grad", E5M2, True)
    x_col = q(x.detach(), "input", E4M3, True)
    assert torch.equal(x.grad, dy_row.dequantize() @ w_col.dequantize())
    assert torch.equal(layer.weight.grad, dy_col.dequantize().t() @ x_col.dequantize())
    if recipe in ("blockwise", "mxfp8"):  # 1-D blocks: columnwise values differ from rowwise
        assert not torch.equal(x_col.dequantize(), x_row.dequantize())


def test_autocast_disabled_runs_high_precision_exactly():
    layer, _ = make_pair("tensorwise", "hybrid")
    x = torch.randn(4, 64)
    with fp8_autocast(layer, enabled=False):
        y = layer(x)
    assert torch.equal(y, F.linear(x, layer.weight, layer.bias))


def test_constructor_matches_model_factory_and_nn_linear_init():
    config = Fp8Config(recipe="mxfp8")
    torch.manual_seed(7)
    layer = Fp8Linear(32, 16, bias=True, fp8_config=config, dtype=torch.bfloat16)
    torch.manual_seed(7)
    plain = torch.nn.Linear(32, 16, bias=True, dtype=torch.bfloat16)
    assert layer.weight.shape == (16, 32) and layer.weight.dtype == torch.bfloat16
    assert torch.equal(layer.weight, plain.weight) and torch.equal(layer.bias, plain.bias)
    with pytest.raises(ValueError, match=r"expects input \[..., 32\]"):
        layer(torch.randn(2, 31, dtype=torch.bfloat16))


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_weight_from_quantized_model_init(recipe):
    config = Fp8Config(recipe=recipe, fp8_format="hybrid")
    torch.manual_seed(11)
    plain = Fp8Linear(64, 32, fp8_config=config)
    torch.manual_seed(11)
    with quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True):
        fp8_layer = Fp8Linear(64, 32, fp8_config=config)
    weight = fp8_layer.weight
    assert isinstance(weight, QuantizedTensor) and isinstance(weight, torch.nn.Parameter)
    assert weight.shape == (32, 64) and weight.dtype == torch.float32
    # Main params must be seeded with the exact init values, not dequantized FP8.
    init_val = get_high_precision_init_val(weight)
    assert init_val.device.type == "cpu" and torch.equal(init_val, plain.weight.detach())
    assert not torch.equal(weight.dequantize(), init_val)
    clear_high_precision_init_val(weight)
    assert get_high_precision_init_val(weight) is None
    assert weight.has_data("columnwise") == (recipe == "mxfp8")
    # Same forward as quantizing the high-precision weight on the fly.
    x = torch.randn(8, 64, requires_grad=True)
    routed = []
    weight.register_post_accumulate_grad_hook(lambda p: routed.append(p.grad.clone()))
    y = fp8_layer(x)
    assert torch.equal(y, plain(x))
    y.sum().backward()
    assert weight.grad.dtype == torch.float32 and weight.grad.shape == (32, 64)
    assert len(routed) == 1 and torch.equal(routed[0], weight.grad)
    sd = fp8_layer.state_dict()
    assert sd["weight"].shape == (32, 64) and sd["weight"].dtype == torch.float32


def test_quantized_init_recipe_mismatch_is_an_error():
    with (
        quantized_model_init(recipe="mxfp8"),
        pytest.raises(ValueError, match="pass the same recipe"),
    ):
        Fp8Linear(32, 32, fp8_config=Fp8Config(recipe="tensorwise"))


def test_optimizer_write_back_into_fp8_weight_in_place():
    config = Fp8Config(recipe="tensorwise", fp8_format="hybrid")
    with quantized_model_init(recipe="tensorwise"):
        layer = Fp8Linear(32, 16, fp8_config=config)
    weight = layer.weight
    storage = weight.rowwise_data.data_ptr()
    new_main = torch.randn(16, 32) * 3
    with torch.no_grad():
        weight.copy_(new_main)  # what an optimizer step does after updating main params
    expected = quantize(new_main, recipe="tensorwise", fp8_dtype=E4M3, role="weight")
    assert weight.rowwise_data.data_ptr() == storage
    assert torch.equal(weight.rowwise_data, expected.rowwise_data)
    assert torch.equal(weight.rowwise_scale_inv, expected.rowwise_scale_inv)


def test_meta_device_construction_for_deferred_init():
    with torch.device("meta"), quantized_model_init(recipe="blockwise"):
        layer = Fp8Linear(300, 130, fp8_config=Fp8Config(recipe="blockwise"))
    weight = layer.weight
    assert weight.device.type == "meta" and weight.rowwise_data.shape == (130, 300)
    assert tuple(weight.rowwise_scale_inv.shape) == (2, 3)  # 128x128 blocks
    assert get_high_precision_init_val(weight) is None  # nothing to keep on meta


def test_quantized_model_init_is_one_function_with_te_signature():
    from megatron.core.distributed import fsdp
    from megatron.core.fp8 import param_init

    assert fsdp.quantized_model_init is quantized_model_init
    assert param_init.quantized_model_init is quantized_model_init
    config = Fp8Config(recipe="blockwise")
    # TransformerEngine's keywords, a recipe given as name or as Fp8Config, and enabled=False.
    with quantized_model_init(enabled=True, recipe=config, preserve_high_precision_init_val=False):
        layer = Fp8Linear(256, 128, fp8_config=config)
    assert isinstance(layer.weight, QuantizedTensor)
    assert tuple(layer.weight.rowwise_scale_inv.shape) == (1, 2)
    assert get_high_precision_init_val(layer.weight) is None
    with fsdp.quantized_model_init(enabled=False, recipe="mxfp8"):
        plain = Fp8Linear(32, 16, fp8_config=Fp8Config(recipe="tensorwise"))
    assert not isinstance(plain.weight, QuantizedTensor) and plain.weight.shape == (16, 32)
    with pytest.raises(ValueError, match="recipe must be one of"):
        with quantized_model_init(True, "fp4"):
            pass
