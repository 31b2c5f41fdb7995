"""write_grad_: a micro-batch grad into its fp32 slot, copied or accumulated. On CUDA a bf16 or
fp16 grad goes through the Triton kernel, which must equal torch's copy_/add_ bitwise (GPU
test); elsewhere torch's ops run (CPU twin)."""

import pytest
import torch

from megatron.core.distributed.fsdp.grad_copy import _fast_path, write_grad_


def _grads(numel: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=generator) * 3
    values[:5] = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0])
    values[5] = 1e-40  # an fp32 subnormal: bf16 keeps its exponent range
    return values.to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_copy_then_accumulate_on_cpu(dtype):
    buffer = torch.full((1000,), 7.0)
    first, second = _grads(300, dtype, "cpu", 0), _grads(300, dtype, "cpu", 1)
    window = buffer[101:401]
    write_grad_(window, first.view(20, 15), accumulate=False)
    torch.testing.assert_close(window, first.float(), rtol=0, atol=0, equal_nan=True)
    write_grad_(window, second, accumulate=True)
    want = first.float() + second.float()
    torch.testing.assert_close(window, want, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(buffer[:101], torch.full((101,), 7.0))  # neighbours untouched
    assert torch.equal(buffer[401:], torch.full((599,), 7.0))
    assert not _fast_path(window, first)  # CPU: torch's ops


def test_size_mismatch_is_refused():
    with pytest.raises(ValueError, match="does not fit a slot of 4"):
        write_grad_(torch.zeros(4), torch.zeros(5, dtype=torch.bfloat16), accumulate=False)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN payloads aside (both NaN at the same places)."""
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    return torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("offset, numel", [(0, 4096 * 3), (3, 100_003), (1, 7), (64, 1 << 20)])
def test_triton_kernel_equals_torch_bitwise(dtype, offset, numel):
    first = _grads(numel, dtype, "cuda", 2)
    second = _grads(numel, dtype, "cuda", 3)
    fast = torch.full((offset + numel + 5,), 7.0, device="cuda")
    slow = fast.clone()
    window = fast[offset : offset + numel]
    assert _fast_path(window, first)
    write_grad_(window, first, accumulate=False)
    slow[offset : offset + numel].copy_(first)
    assert _same_bits(fast, slow)  # signed zeros, infinities, subnormals included
    write_grad_(window, second, accumulate=True)
    slow[offset : offset + numel].add_(second)
    assert _same_bits(fast, slow)
    assert torch.equal(fast[:offset], torch.full((offset,), 7.0, device="cuda"))
    assert torch.equal(fast[offset + numel :], torch.full((5,), 7.0, device="cuda"))
