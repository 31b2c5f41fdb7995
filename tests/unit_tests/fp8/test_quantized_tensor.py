"""QuantizedTensor: release/re-point semantics, transpose cache, tensor plumbing."""

from __future__ import annotations

import io

import pytest
import torch

from megatron.core.fp8 import E4M3, Fp8DataReleasedError, QuantizedTensor, fp8_gemm, quantize


def weight_qt(recipe: str = "tensorwise", *, seed: int = 0, shape=(16, 64)) -> QuantizedTensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen)
    qt = quantize(x, recipe=recipe, fp8_dtype=E4M3, role="weight", columnwise=recipe == "mxfp8")
    qt.tensor_name = "decoder.layers.0.mlp.fc1.weight"
    return qt


def test_released_data_raises_a_clear_error():
    qt = weight_qt()
    qt.rowwise_data = None  # the FSDP engine frees the gathered bytes
    assert qt.is_released("rowwise") and not qt.has_data("rowwise")
    with pytest.raises(Fp8DataReleasedError, match="decoder.layers.0.mlp.fc1.weight.*released by"):
        _ = qt.rowwise_data
    with pytest.raises(Fp8DataReleasedError, match="released by the FSDP engine"):
        qt.dequantize()
    with pytest.raises(Fp8DataReleasedError, match="released by the FSDP engine"):
        fp8_gemm(weight_qt(seed=1), qt, out_dtype=torch.float32)
    assert "rowwise=released" in repr(qt)
    # A direction never asked for is absent (None), not released.
    assert qt.columnwise_data is None and not qt.is_released("columnwise")


def test_repointing_into_external_buffer_changes_what_gemms_read():
    activations = weight_qt(seed=1, shape=(8, 64))
    qt, other = weight_qt(seed=2), weight_qt(seed=3)
    before = fp8_gemm(activations, qt, out_dtype=torch.float32)
    # The engine's flat buffer holds another weight's bytes at offset 100.
    flat = torch.zeros(100 + qt.numel() + 7, dtype=torch.uint8)
    flat[100 : 100 + qt.numel()] = other.rowwise_data.reshape(-1)
    qt.rowwise_data = flat[100 : 100 + qt.numel()].view(qt.shape)
    qt.rowwise_scale_inv = other.rowwise_scale_inv
    after = fp8_gemm(activations, qt, out_dtype=torch.float32)
    assert torch.equal(after, fp8_gemm(activations, other, out_dtype=torch.float32))
    assert not torch.equal(after, before)
    assert qt.rowwise_data.data_ptr() == flat.data_ptr() + 100
    # Writing into the buffer in place is seen too (no hidden copy).
    flat[100 : 100 + qt.numel()] = 0
    assert fp8_gemm(activations, qt, out_dtype=torch.float32).abs().sum().item() == 0.0
    with pytest.raises(ValueError, match="must have 1024 bytes"):
        qt.rowwise_data = flat[:1000]


def test_transpose_cache_per_tensor_and_128x128():
    per_tensor = weight_qt("tensorwise")
    data_t, scale_t = per_tensor.create_transpose_cache()
    assert torch.equal(data_t, per_tensor.rowwise_data.t()) and scale_t.dim() == 0
    per_tensor.discard_transpose_cache()
    assert per_tensor.transpose_cache is None
    block = weight_qt("blockwise", shape=(130, 300))
    data_t, scale_t = block.create_transpose_cache()
    assert data_t.shape == (300, 130) and scale_t.shape == (3, 2)
    assert torch.equal(scale_t, block.rowwise_scale_inv.t())
    with pytest.raises(ValueError, match="1-D blocks"):
        weight_qt("mxfp8").create_transpose_cache()
    block.rowwise_data = block.rowwise_data.clone()  # re-pointing invalidates the cache
    assert block.transpose_cache is None


def test_parameter_state_dict_shape_dtype_repr_and_save():
    qt = quantize(torch.randn(4, 32).bfloat16(), recipe="mxfp8", fp8_dtype=E4M3, role="weight")
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(qt)
    assert isinstance(module.weight, torch.nn.Parameter) and module.weight.requires_grad
    assert module.weight.shape == (4, 32) and module.weight.dtype == torch.bfloat16
    saved = module.state_dict()["weight"]
    assert isinstance(saved, QuantizedTensor) and not saved.requires_grad
    assert saved.rowwise_data.data_ptr() == qt.rowwise_data.data_ptr()  # detach shares bytes
    assert repr(saved) == (
        "QuantizedTensor(shape=(4, 32), dtype=torch.bfloat16, recipe=mxfp8, "
        "fp8_dtype=float8_e4m3fn, role=weight, rowwise=present, columnwise=absent, device=cpu)"
    )
    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)["weight"]
    assert torch.equal(loaded.rowwise_data, qt.rowwise_data)
    assert torch.equal(loaded.rowwise_scale_inv, qt.rowwise_scale_inv)


def test_unhandled_ops_see_dequantized_values_and_inplace_ops_raise():
    qt = weight_qt()
    values = qt.dequantize()
    assert torch.equal(qt + 1, values + 1)
    assert (qt * 2).sum().item() == pytest.approx(2 * values.sum().item(), rel=1e-6)
    as_bf16 = qt.to(torch.bfloat16)
    assert type(as_bf16) is torch.Tensor and torch.equal(as_bf16, values.bfloat16())
    with pytest.raises(RuntimeError, match="would write into a temporary copy"):
        qt.mul_(2)
    clone = qt.clone()
    assert isinstance(clone, QuantizedTensor)
    assert clone.rowwise_data.data_ptr() != qt.rowwise_data.data_ptr()
    assert torch.equal(clone.rowwise_data, qt.rowwise_data)
