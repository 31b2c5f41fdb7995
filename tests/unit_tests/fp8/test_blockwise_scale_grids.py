"""CPU twin of the blockwise GEMM's 128x128 scale grids whose K-block count is not a multiple
of 4 (the GPU side: test_cuda_gemm.py's K = 576, 640, 768 shapes). torch._scaled_mm is replaced
by a stand-in that applies one of the two ScaledBlas.cpp checks of a 128x128 grid (rows padded
to a multiple of 4 blocks in newer PyTorch, contiguous in older) and multiplies what it was
given exactly, so a wrong layout or padding fails either the check or the values."""

from __future__ import annotations

import pytest
import torch

from megatron.core.fp8.cuda import gemm as cuda_gemm
from megatron.core.fp8.cuda.launch import ceil_div

E4M3 = torch.float8_e4m3fn


def _grid_ok(data: torch.Tensor, scale: torch.Tensor, padded_rows: bool) -> bool:
    """Is `scale` a 128x128 grid of the [R, K] operand `data` as the check reads it? As in
    ScaledBlas.cpp's check_size_stride, a dimension of size 1 has its stride unchecked."""
    blocks = ceil_div(data.shape[1], 128)
    row_stride = -(-blocks // 4) * 4 if padded_rows else blocks
    strides_ok = all(
        size <= 1 or stride == want
        for size, stride, want in zip(scale.shape, scale.stride(), (row_stride, 1))
    )
    return scale.shape == (ceil_div(data.shape[0], 128), blocks) and strides_ok


class ScaledMm:
    """torch._scaled_mm for blockwise pairs: each operand's grid checked as 1x128 (outer-dim-
    major) or 128x128 (rows padded or contiguous), then the exact product of what it got."""

    def __init__(self, padded_rows: bool):
        self.padded_rows, self.k_seen = padded_rows, []

    def _grid(self, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if scale.shape == (data.shape[0], ceil_div(data.shape[1], 128)) and data.shape[0] > 128:
            assert scale.stride() == (1, data.shape[0])  # 1x128: outer-dim-major
        elif not _grid_ok(data, scale, self.padded_rows):
            raise RuntimeError("Invalid scaling configuration")
        return cuda_gemm.dequantize_operand(data, scale, recipe="blockwise", dtype=torch.float64)

    def __call__(self, a, b, *, scale_a, scale_b, out_dtype, use_fast_accum, out=None):
        self.k_seen.append(a.shape[1])
        a_exact = self._grid(a, scale_a)
        b_exact = self._grid(b.t().contiguous(), scale_b.t())  # b.t(): [N, K] row-major
        return (a_exact @ b_exact.t()).to(out_dtype)


@pytest.fixture
def cublas(blockwise_probe, monkeypatch):
    """`cublas(padded_rows)` installs the stand-in; the probe state starts untried."""
    monkeypatch.setattr(cuda_gemm, "_blockwise_unavailable", lambda device: None)

    def install(padded_rows: bool) -> ScaledMm:
        fake = ScaledMm(padded_rows)
        monkeypatch.setattr(torch, "_scaled_mm", fake)
        return fake

    return install


def _pair(rows: int, k: int, n: int, a_128x128: bool = False):
    """a [rows, K] and b [n, K] FP8; one of them 128x128-scaled (b unless a_128x128), the
    other 1x128 (outer-dim-major). Row counts above 128 keep the two grids' shapes apart."""
    generator = torch.Generator().manual_seed(k)
    a = (torch.rand(rows, k, generator=generator) * 8 - 4).to(E4M3)
    b = (torch.rand(n, k, generator=generator) * 8 - 4).to(E4M3)
    blocks = ceil_div(k, 128)

    def grid(count, square):
        if square:
            return torch.rand(ceil_div(count, 128), blocks, generator=generator) + 0.5
        return torch.rand(blocks, count, generator=generator).t() + 0.5

    return a, b, grid(rows, a_128x128), grid(n, not a_128x128)


def _gemm(a, b, a_scale, b_scale):
    return cuda_gemm.scaled_mm(
        a,
        b,
        a_scale_inv=a_scale,
        b_scale_inv=b_scale,
        recipe="blockwise",
        out_dtype=torch.float32,
        use_fast_accum=False,
    )


def _exact(a, b, a_scale, b_scale):
    a_exact = cuda_gemm.dequantize_operand(a, a_scale, recipe="blockwise", dtype=torch.float64)
    b_exact = cuda_gemm.dequantize_operand(b, b_scale, recipe="blockwise", dtype=torch.float64)
    return (a_exact @ b_exact.t()).float()


@pytest.mark.parametrize("a_128x128", [False, True], ids=["b-128x128", "a-128x128"])
@pytest.mark.parametrize("k, k_given", [(768, 768), (576, 640), (640, 640)])
def test_padded_grid_rows_keep_k_unpadded_to_512(cublas, k, k_given, a_128x128):
    """A torch that takes 128x128 grids with rows padded to 4 blocks gets K padded to 128
    only (768 stays 768, 576 becomes 640), not to 1024; the product is exact."""
    fake = cublas(padded_rows=True)
    operands = _pair(192, k, 256, a_128x128)
    out = _gemm(*operands)
    assert fake.k_seen == [k_given]
    assert torch.allclose(out, _exact(*operands), rtol=1e-6, atol=1e-6)
    assert cuda_gemm._blockwise_status["grid_rows"] == "padded"
    assert cuda_gemm.blockwise_gemm_path() == "torch._scaled_mm"


def test_a_torch_that_wants_contiguous_grids_gets_k_padded_to_512_from_then_on(cublas):
    fake = cublas(padded_rows=False)
    operands = _pair(192, 768, 256)
    out = _gemm(*operands)
    assert fake.k_seen == [768, 1024]  # refused once, then padded (not emulated)
    assert torch.allclose(out, _exact(*operands), rtol=1e-6, atol=1e-6)
    assert cuda_gemm._blockwise_status["grid_rows"].startswith("contiguous: Invalid scaling")
    assert cuda_gemm.blockwise_gemm_path() == "torch._scaled_mm"
    _gemm(*_pair(160, 576, 256))
    assert fake.k_seen == [768, 1024, 1024]  # no second try


def test_a_one_row_grid_taken_padded_does_not_stop_cublas_for_taller_grids(cublas):
    """An older torch skips the row stride of a 1-row grid, so it takes the padded rows there
    and refuses them for a 2-row grid: that refusal pads K to 512 from then on; it does not
    send every blockwise GEMM to the emulation (measured on an H100, torch 2.11, 2026-12-06)."""
    fake = cublas(padded_rows=False)
    _gemm(*_pair(192, 768, 128))
    assert fake.k_seen == [768] and cuda_gemm._blockwise_status["grid_rows"] == "padded"
    operands = _pair(192, 576, 256)
    out = _gemm(*operands)
    assert fake.k_seen == [768, 640, 1024]  # refused once, then K padded to 512
    assert torch.allclose(out, _exact(*operands), rtol=1e-6, atol=1e-6)
    assert cuda_gemm._blockwise_status["grid_rows"].startswith("contiguous: Invalid scaling")
    assert cuda_gemm.blockwise_gemm_path() == "torch._scaled_mm"
    assert cuda_gemm._blockwise_status["refused"] == ""


def test_k_blocks_a_multiple_of_4_never_probe_the_rows(cublas):
    fake = cublas(padded_rows=False)
    _gemm(*_pair(192, 512, 256))
    assert fake.k_seen == [512]
    assert cuda_gemm._blockwise_status["grid_rows"] == "untried"


def test_out_of_memory_is_raised_not_taken_for_a_refusal(cublas, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    cublas(padded_rows=True)
    monkeypatch.setattr(torch, "_scaled_mm", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        _gemm(*_pair(192, 768, 256))
    assert cuda_gemm._blockwise_status == {
        "path": "untried",
        "refused": "",
        "grid_rows": "untried",
    }
