"""clip_and_step: the clip folded into a fused AdamW (grad_scale) updates params as a separate
clip pass followed by the step does; unfused optimizers keep the separate pass, bitwise.

CPU twin of the CUDA path: torch's fused AdamW exists on CPU too, with the same grad_scale
contract as the CUDA kernel the training step uses on GPUs.
"""

import pytest
import torch

from megatron.core.optimizer import clip_and_step, clip_grads_
from megatron.core.optimizer.clip_grads import clip_coefficient


def _params_and_grads(seed: int, scale: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(64, 32), (32,), (7, 5, 3)]
    params = [torch.randn(shape, generator=generator).requires_grad_() for shape in shapes]
    grads = [scale * torch.randn(shape, generator=generator) for shape in shapes]
    return params, grads


def _run(*, fused: bool, folded: bool, scale: float, steps: int = 3) -> list[torch.Tensor]:
    params, grads = _params_and_grads(0, scale)
    kwargs = {"fused": True} if fused else {"foreach": False}
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **kwargs)
    for _ in range(steps):
        for param, grad in zip(params, grads):
            param.grad = grad.clone()
        current = [param.grad for param in params]
        norm = torch.cat([g.flatten() for g in current]).norm().item()
        if folded:
            clip_and_step(optimizer, current, max_norm=1.0, total_norm=norm)
        else:
            clip_grads_(current, max_norm=1.0, total_norm=norm)
            optimizer.step()
    return [param.detach().clone() for param in params]


def test_clip_coefficient_follows_megatron_rule():
    assert clip_coefficient(max_norm=1.0, total_norm=4.0) == pytest.approx(1.0 / (4.0 + 1e-6))
    assert clip_coefficient(max_norm=1.0, total_norm=0.5) is None
    assert clip_coefficient(max_norm=0.0, total_norm=4.0) is None
    assert clip_coefficient(max_norm=1.0, total_norm=float("inf")) is None


@pytest.mark.parametrize("scale", [50.0, 0.001])  # clipped (norm ~ 800) and not clipped
def test_fused_adamw_with_folded_clip_matches_separate_clip(scale):
    separate = _run(fused=True, folded=False, scale=scale)
    folded = _run(fused=True, folded=True, scale=scale)
    for a, b in zip(separate, folded):
        # grad / (1/c) against grad * c: one rounding apart in the grads, far below the update
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    if scale < 1:  # no clip: the same kernel call on the same grads
        assert all(torch.equal(a, b) for a, b in zip(separate, folded))


def test_folded_clip_reaches_the_moments_and_leaves_no_grad_scale():
    """The first moment after one step is (1 - beta1) * clipped grad: the clip took effect
    inside the fused kernel (Adam's update itself hardly sees a constant grad scale)."""
    params, grads = _params_and_grads(0, 50.0)
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
    for param, grad in zip(params, grads):
        param.grad = grad.clone()
    norm = torch.cat([g.flatten() for g in grads]).norm().item()
    coeff = clip_coefficient(max_norm=1.0, total_norm=norm)
    assert coeff is not None and coeff < 0.01
    clip_and_step(optimizer, [p.grad for p in params], max_norm=1.0, total_norm=norm)
    for param, grad in zip(params, grads):
        exp_avg = optimizer.state[param]["exp_avg"]
        torch.testing.assert_close(exp_avg, 0.1 * grad * coeff, rtol=1e-5, atol=1e-9)
    assert not hasattr(optimizer, "grad_scale")


def test_unfused_optimizer_keeps_the_separate_clip_bitwise():
    separate = _run(fused=False, folded=False, scale=50.0)
    folded = _run(fused=False, folded=True, scale=50.0)
    assert all(torch.equal(a, b) for a, b in zip(separate, folded))
