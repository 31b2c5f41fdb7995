"""OffloadedAdamW: which params a fraction moves to the host, and an update equal to FusedAdamW
keeping everything on the device (fractions 0, 0.5, 1), with amaxes, a grad scale and
precision-aware moments; its state dict is FusedAdamW's and resumes at another fraction.
CPU tests check the math and the split; the copies' overlap needs a GPU.
"""

from __future__ import annotations

import copy

import pytest
import torch

from megatron.core.optimizer import FusedAdamW
from megatron.core.optimizer.offload import OffloadedAdamW, offload_count

SHAPES = [(20, 5), (50,), (40, 5), (10,), (7, 3)]  # 100, 50, 200, 10, 21 elements
BETAS, EPS, LR, WD = (0.9, 0.95), 1e-8, 3e-3, 0.1
PRECISIONS = [
    {},
    {"exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "fp8", "moment_scaling": "block"},
]


def test_offload_count_splits_by_elements_in_order():
    numels = [100, 50, 200, 10]  # 360 elements
    assert offload_count(numels, 0.0) == 0
    assert offload_count(numels, 0.25) == 1  # 90: the second param's midpoint (125) is past it
    assert offload_count(numels, 0.5) == 2  # 180: 150 elements; the third's midpoint is 250
    assert offload_count(numels, 0.9) == 3  # 324: 350 elements, the last midpoint is 355
    assert offload_count(numels, 1.0) == 4
    with pytest.raises(ValueError, match=r"--optimizer-offload-fraction 1.5: give a value in"):
        offload_count(numels, 1.5)


def _params() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=generator) for s in SHAPES]


def _groups(params):
    return [{"params": params[:3], "weight_decay": WD}, {"params": params[3:], "weight_decay": 0.0}]


def _optimizer(params, fraction, precision):
    kwargs = dict(lr=LR, betas=BETAS, eps=EPS, foreach=False, **precision)
    if fraction is None:
        return FusedAdamW(_groups(params), **kwargs)
    return OffloadedAdamW(_groups(params), offload_fraction=fraction, **kwargs)


def _train(optimizer, params, *, first, steps, scaled=False):
    amaxes = {}
    for step in range(first, first + steps):
        generator = torch.Generator().manual_seed(100 + step)
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        params[1].grad = None  # no grad this step: no update, amax still measured
        for group in optimizer.param_groups:  # what the LR scheduler does
            group["lr"] = LR * (1.0 - 0.05 * step)
        if scaled:  # the folded clip (clip_and_step sets it where the step honours it)
            optimizer.grad_scale = torch.tensor(1.5)
        amaxes = {p: torch.zeros(()) for p in params}
        optimizer.amax_targets = amaxes
        optimizer.step()
        optimizer.__dict__.pop("grad_scale", None)
    return amaxes


@pytest.mark.parametrize("precision", PRECISIONS, ids=["fp32", "bf16-fp8"])
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_offloaded_update_equals_the_all_device_one(fraction, precision):
    want = _params()
    # torch's CPU AdamW (the fp32 path) takes no grad_scale; the precision-aware path does.
    scaled = bool(precision)
    _train(_optimizer(want, None, precision), want, first=1, steps=10, scaled=scaled)
    params = _params()
    optimizer = _optimizer(params, fraction, precision)
    assert len(optimizer.offloaded) == {0.0: 0, 0.5: 2, 1.0: 5}[fraction]
    amaxes = _train(optimizer, params, first=1, steps=10, scaled=scaled)
    for param, expected in zip(params, want):
        assert (param - expected).abs().max().item() <= 1e-6
        assert amaxes[param].item() == param.abs().max().item()
    for param in optimizer.offloaded:
        if param is params[1]:  # never had a grad: no state
            continue
        assert optimizer.state[param]["exp_avg"].device.type == "cpu"
        assert optimizer.state[param]["step"].item() == 10


@pytest.mark.parametrize("precision", PRECISIONS, ids=["fp32", "bf16-fp8"])
def test_state_dict_is_fused_adamw_s_and_resumes_at_another_fraction(precision):
    uninterrupted = _params()
    plain = _optimizer(uninterrupted, None, precision)
    _train(plain, uninterrupted, first=1, steps=4)
    reference_state = copy.deepcopy(plain.state_dict())
    _train(plain, uninterrupted, first=5, steps=4)
    params = _params()
    first = _optimizer(params, 0.5, precision)
    _train(first, params, first=1, steps=4)
    saved = first.state_dict()
    assert saved["state"].keys() == reference_state["state"].keys()
    for key, entry in saved["state"].items():
        assert entry.keys() == reference_state["state"][key].keys()
        for name, value in entry.items():
            assert torch.equal(value, reference_state["state"][key][name]), (key, name)
    second = _optimizer(params, 1.0, precision)
    second.load_state_dict(saved)
    _train(second, params, first=5, steps=2)
    third = _optimizer(params, 0.0, precision)
    third.load_state_dict(second.state_dict())
    _train(third, params, first=7, steps=2)
    for param, expected in zip(params, uninterrupted):
        assert (param - expected).abs().max().item() <= 1e-6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS, ids=["fp32", "bf16-fp8"])
def test_offload_on_gpu_pins_host_state_and_matches_the_device_step(precision):
    want = [p.cuda() for p in _params()]
    kwargs = dict(lr=LR, betas=BETAS, eps=EPS, fused=True, **precision)
    _train_cuda(FusedAdamW(_groups(want), **kwargs), want)
    params = [p.cuda() for p in _params()]
    optimizer = OffloadedAdamW(_groups(params), offload_fraction=0.5, **kwargs)
    amaxes = _train_cuda(optimizer, params)
    assert all(host.is_pinned() for host in optimizer.host_params)
    for param, expected in zip(params, want):
        # The host runs torch's CPU step, the device the Triton kernel: ulps apart per step;
        # a moment rounded to a neighbouring bf16/fp8 value moves the param by up to LR * 2^-3.
        atol = 1e-6 if not precision else 10 * LR * 2.0**-3
        torch.testing.assert_close(param, expected, rtol=0, atol=atol)
        assert amaxes[param].item() == param.abs().max().item()


def _train_cuda(optimizer, params):
    amaxes = {}
    for step in range(1, 11):
        generator = torch.Generator().manual_seed(100 + step)
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator).cuda()
        optimizer.grad_scale = torch.tensor(1.5, device="cuda")
        amaxes = {p: torch.zeros((), device="cuda") for p in params}
        optimizer.amax_targets = amaxes
        optimizer.step()
        del optimizer.grad_scale
    torch.cuda.synchronize()
    return amaxes


def test_state_view_creates_states_in_the_owning_part():
    """The engine writes initial state through `optimizer.state[param]` (a defaultdict in
    torch): for an offloaded param that must land in the host part's state."""
    params = _params()
    optimizer = _optimizer(params, 0.5, {})
    optimizer.state[params[0]]["marker"] = torch.ones(1)
    optimizer.state[params[4]]["marker"] = torch.zeros(1)
    assert optimizer.host.state[optimizer.host_params[0]]["marker"].item() == 1.0
    assert optimizer.device.state[params[4]]["marker"].item() == 0.0
    assert optimizer.state[params[0]]["marker"].item() == 1.0
