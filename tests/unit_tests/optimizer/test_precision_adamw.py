"""Precision-aware FusedAdamW: every moment dtype combination (fp32/bf16/fp16/fp8, per-tensor or
per-block scales) over fp32 and fp16 main params and fp32 and bf16 grads equals a reference AdamW
written here in plain torch, rounding its states the same way, over 10 steps; and stays within
its dtypes' rounding of an fp32 AdamW. State dicts keep each state's dtype and convert on load.
The GPU tests check the Triton kernel against the torch path.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from megatron.core.optimizer import FusedAdamW
from megatron.core.optimizer.precision import check_main_dtypes

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SHAPES = [(40, 33), (300,), (1,), (129,)]  # not multiples of the 128-element scale block
BETAS, EPS, LR, WD, STEPS = (0.9, 0.95), 1e-8, 3e-3, 0.1, 10
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPES["fp8"] = torch.float8_e4m3fn
RANGES = {"fp16": 65504.0 / 2, "fp8": 448.0}
UNIT_ROUNDOFF = {"fp32": 2.0**-24, "bf16": 2.0**-9, "fp16": 2.0**-11, "fp8": 2.0**-4}


def _moment_cases() -> list[tuple[str, str, str]]:
    cases = []
    for m, v in itertools.product(DTYPES, DTYPES):
        scaled = m in RANGES or v in RANGES
        cases += [(m, v, rule) for rule in (("tensor", "block") if scaled else ("tensor",))]
    return cases


def _params(param_dtype, device="cpu") -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=generator).to(device, param_dtype) for s in SHAPES]
    for param in params:
        param.grad_dtype = None  # grads may be bf16 (--main-grads-dtype) under fp32 params
    return params


def _grads(step, grad_dtype, device="cpu") -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    # Grads of 1e-3 put exp_avg_sq near 1e-7: below fp16's normal range unless scaled.
    return [(1e-3 * torch.randn(s, generator=generator)).to(device, grad_dtype) for s in SHAPES]


def _round_state(values, name_dtype, rule):
    """The reference's rounding of a state: TE's scale rule, per tensor or per 128 elements."""
    if name_dtype not in RANGES:
        return values.to(DTYPES[name_dtype]).float()
    limit, flat = RANGES[name_dtype], values.reshape(-1)
    groups = [flat] if rule == "tensor" else list(flat.split(128))
    rounded = []
    for group in groups:
        scale = group.abs().max() / limit
        inverse = 1.0 / scale if scale > 0 else torch.zeros(())
        stored = (group * inverse).clamp(-limit, limit).to(DTYPES[name_dtype])
        rounded.append(stored.float() * scale)
    return torch.cat(rounded).view(values.shape)


def _reference(case, param_dtype, grad_dtype, rounding=True):
    """AdamW (decoupled decay) over the test's grads, in fp32, states rounded per `case`."""
    m_dtype, v_dtype, rule = case
    params = [p.float() for p in _params(param_dtype)]
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    for step in range(1, STEPS + 1):
        for i, grad in enumerate(_grads(step, grad_dtype)):
            grad, (m, v) = grad.float(), moments[i]
            wd = WD if i < 2 else 0.0
            p = params[i] * (1.0 - LR * wd)
            m = BETAS[0] * m + (1.0 - BETAS[0]) * grad
            v = BETAS[1] * v + (1.0 - BETAS[1]) * grad * grad
            denom = v.sqrt() / math.sqrt(1.0 - BETAS[1] ** step) + EPS
            p = p - (LR / (1.0 - BETAS[0] ** step)) * m / denom
            if rounding:
                p = p.to(param_dtype).float()
                m, v = _round_state(m, m_dtype, rule), _round_state(v, v_dtype, rule)
            params[i], moments[i] = p, (m, v)
    return params, moments


def _optimizer(params, case, **kwargs) -> FusedAdamW:
    groups = [{"params": params[:2], "weight_decay": WD}, {"params": params[2:], "weight_decay": 0}]
    m_dtype, v_dtype, rule = case
    return FusedAdamW(
        groups,
        lr=LR,
        betas=BETAS,
        eps=EPS,
        exp_avg_dtype=m_dtype,
        exp_avg_sq_dtype=v_dtype,
        moment_scaling=rule,
        **kwargs,
    )


def _train(optimizer, params, grad_dtype, *, first=1, steps=STEPS, device="cpu"):
    targets = {}
    for step in range(first, first + steps):
        for param, grad in zip(params, _grads(step, grad_dtype, device)):
            param.grad = grad
        targets = {p: torch.zeros((), device=device) for p in params}
        optimizer.amax_targets = targets
        optimizer.step()
    return targets


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", _moment_cases(), ids="-".join)
def test_every_combination_equals_the_reference_over_10_steps(case, param_dtype, grad_dtype):
    params = _params(param_dtype)
    optimizer = _optimizer(params, case, foreach=False)
    amaxes = _train(optimizer, params, grad_dtype)
    want_params, want_moments = _reference(case, param_dtype, grad_dtype)
    for i, (param, want) in enumerate(zip(params, want_params)):
        assert param.dtype == param_dtype
        torch.testing.assert_close(param.float(), want, rtol=1e-6, atol=1e-9)
        assert amaxes[param].item() == param.abs().max().item()
        state = optimizer.state[param]
        assert state["exp_avg"].dtype == DTYPES[case[0]]
        assert state["exp_avg_sq"].dtype == DTYPES[case[1]]
        assert state["step"].item() == STEPS
        logical = optimizer.logical_state(param)
        for name, value, expected in zip(
            ("exp_avg", "exp_avg_sq"), logical.values(), want_moments[i]
        ):
            # torch's own step (fp32) forms the moments with lerp/addcmul: ulps of the terms.
            atol = 1e-6 * expected.abs().max().item()
            torch.testing.assert_close(value, expected, rtol=1e-6, atol=atol, msg=name)
    # Within the dtypes' rounding of unrounded fp32 AdamW: each step's update (LR times m/sqrt(v),
    # at most about 3 here) carries the moments' relative rounding; fp16 params add theirs.
    exact, _ = _reference(case, torch.float32, grad_dtype, rounding=False)
    moment_u = UNIT_ROUNDOFF[case[0]] + UNIT_ROUNDOFF[case[1]] / 2
    param_u = 0.0 if param_dtype == torch.float32 else UNIT_ROUNDOFF["fp16"] * 4.0
    bound = STEPS * (LR * 3.0 * 2 * moment_u + param_u) + 1e-6  # + fp32 ulps of |param| < 4
    worst = max((p.float() - e).abs().max().item() for p, e in zip(params, exact))
    assert worst <= bound, (worst, bound)


def test_fp32_moments_keep_torch_adamw_state_and_step():
    """All-fp32 is torch.optim.AdamW, bit for bit, and its state dict has torch's keys."""
    params, torch_params = _params(torch.float32), _params(torch.float32)
    ours = _optimizer(params, ("fp32", "fp32", "tensor"), foreach=False)
    groups = [{"params": torch_params[:2], "weight_decay": WD}]
    groups.append({"params": torch_params[2:], "weight_decay": 0})
    reference = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, foreach=False)
    _train(ours, params, torch.float32, steps=3)
    _train(reference, torch_params, torch.float32, steps=3)
    for a, b in zip(params, torch_params):
        assert torch.equal(a, b)
    assert ours.state_dict()["state"][0].keys() == {"step", "exp_avg", "exp_avg_sq"}


def test_fp32_bf16_fp32_state_dict_round_trip():
    fp32, bf16 = ("fp32", "fp32", "tensor"), ("bf16", "bf16", "tensor")
    params = _params(torch.float32)
    first = _optimizer(params, fp32, foreach=False)
    _train(first, params, torch.float32, steps=3)
    saved = first.state_dict()
    assert saved["state"][0]["exp_avg"].dtype == torch.float32
    second = _optimizer(params, bf16, foreach=False)
    second.load_state_dict(saved)
    for key, param in enumerate(params):
        for name in ("exp_avg", "exp_avg_sq"):
            got = second.state[param][name]
            assert got.dtype == torch.bfloat16
            assert torch.equal(got, saved["state"][key][name].to(torch.bfloat16))
        assert second.state[param]["step"].item() == 3
    _train(second, params, torch.float32, first=4, steps=2)
    saved_bf16 = second.state_dict()
    assert saved_bf16["state"][1]["exp_avg_sq"].dtype == torch.bfloat16  # saved in its dtype
    third = _optimizer(params, fp32, foreach=False)
    third.load_state_dict(saved_bf16)
    for key, param in enumerate(params):
        got = third.state[param]["exp_avg"]
        assert got.dtype == torch.float32
        assert torch.equal(got, saved_bf16["state"][key]["exp_avg"].float())
        assert third.state[param]["step"].item() == 5


@pytest.mark.parametrize("case", [("fp8", "fp8", "block"), ("fp16", "fp8", "tensor")], ids="-".join)
def test_scaled_state_resumes_bitwise(case):
    uninterrupted = _params(torch.float32)
    _train(_optimizer(uninterrupted, case, foreach=False), uninterrupted, torch.float32, steps=6)
    resumed = _params(torch.float32)
    first = _optimizer(resumed, case, foreach=False)
    _train(first, resumed, torch.float32, steps=3)
    saved = first.state_dict()
    assert saved["state"][0]["exp_avg_sq"].dtype == torch.float8_e4m3fn
    assert saved["state"][0]["exp_avg_sq_scale"].numel() == (11 if case[2] == "block" else 1)
    second = _optimizer(resumed, case, foreach=False)
    second.load_state_dict(saved)
    _train(second, resumed, torch.float32, first=4, steps=3)
    for a, b in zip(uninterrupted, resumed):
        assert torch.equal(a, b)


def test_bad_combinations_name_the_flag_and_the_fix():
    params = _params(torch.float32)
    with pytest.raises(ValueError, match=r"--exp-avg-dtype fp8 needs a scale rule.*'tensor'"):
        _optimizer(params, ("fp8", "fp32", None))
    with pytest.raises(ValueError, match=r"--exp-avg-sq-dtype fp16 needs a scale rule"):
        _optimizer(params, ("bf16", "fp16", None))
    with pytest.raises(ValueError, match=r"--exp-avg-sq-dtype fp4: unknown dtype; choose one of"):
        _optimizer(params, ("fp32", "fp4", "tensor"))
    with pytest.raises(ValueError, match=r"unknown scale rule; choose 'tensor'"):
        _optimizer(params, ("fp8", "fp8", "row"))
    with pytest.raises(ValueError, match=r"--main-params-dtype bf16: unknown dtype.*fp32, fp16"):
        check_main_dtypes(main_params_dtype="bf16", main_grads_dtype="fp32")
    with pytest.raises(ValueError, match=r"--main-grads-dtype fp16: unknown dtype.*fp32, bf16"):
        check_main_dtypes(main_params_dtype="fp32", main_grads_dtype="fp16")
    assert check_main_dtypes(main_params_dtype="fp16", main_grads_dtype="bf16") == (
        torch.float16,
        torch.bfloat16,
    )


def _copy_state(source: FusedAdamW, target: FusedAdamW, sources, targets) -> None:
    """Give `target` the params and optimizer state of `source` (same dtypes and layout)."""
    for param, other in zip(sources, targets):
        other.copy_(param)
        for name, value in source.state[param].items():
            target.state[other][name] = value.clone()


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", _moment_cases(), ids="-".join)
def test_triton_kernel_matches_the_torch_path_on_gpu(case, param_dtype):
    """Each of 10 steps from the same params and state: the kernel's new params, amaxes and
    moments against the torch path's. Compared step by step because the two differ by fp32 ulps
    (the kernel's sqrt, division and FMAs), which may round an fp16 param to the neighbouring
    value; over several steps such flips would add up and hide a real one-step error."""
    from megatron.core.optimizer import fused_adamw

    assert fused_adamw._triton_kernel() is not None, "Triton is needed on the GPU machine"
    kernel_params, torch_params = _params(param_dtype, "cuda"), _params(param_dtype, "cuda")
    kernel = _optimizer(kernel_params, case, fused=True)
    assert kernel._triton_usable()
    torch_path = _optimizer(torch_params, case, fused=True, use_triton=False)
    moment_u = UNIT_ROUNDOFF[case[0]] + UNIT_ROUNDOFF[case[1]]
    for step in range(1, STEPS + 1):
        if step > 1:
            _copy_state(kernel, torch_path, kernel_params, torch_params)
        amaxes = _train(kernel, kernel_params, torch.bfloat16, first=step, steps=1, device="cuda")
        _train(torch_path, torch_params, torch.bfloat16, first=step, steps=1, device="cuda")
        for param, want in zip(kernel_params, torch_params):
            # fp32 params: LR times the moments' rounding (the update reads unrounded moments);
            # fp16 params: at most one fp16 ulp of |param| (2^-10 of it, relative).
            rtol = 0.0 if param_dtype == torch.float32 else 2.0**-10
            atol = 1e-6 + LR * 3.0 * moment_u
            torch.testing.assert_close(param.float(), want.float(), rtol=rtol, atol=atol)
            assert amaxes[param].item() == param.float().abs().max().item()
            got, ref = kernel.logical_state(param), torch_path.logical_state(want)
            for name, dtype in zip(got, case[:2]):
                ulps = max(8 * UNIT_ROUNDOFF[dtype], 4e-6)
                atol = ref[name].abs().max().item() * ulps
                torch.testing.assert_close(got[name], ref[name], rtol=0, atol=atol, msg=name)


def test_optimizer_config_checks_name_the_flags():
    from megatron.core.optimizer import OffloadedAdamW, OptimizerConfig, build_torch_optimizer

    named = [(f"layer.{i}.weight", p) for i, p in enumerate(_params(torch.float32))]
    with pytest.raises(ValueError, match=r"need --use-precision-aware-optimizer"):
        build_torch_optimizer(named, config=OptimizerConfig(exp_avg_dtype="bf16"))
    with pytest.raises(ValueError, match=r"--optimizer-cpu-offload needs --use-precision-aware"):
        build_torch_optimizer(named, config=OptimizerConfig(optimizer_cpu_offload=True))
    fp8 = dict(use_precision_aware_optimizer=True, exp_avg_dtype="fp8", moment_scaling=None)
    with pytest.raises(ValueError, match=r"--exp-avg-dtype fp8 needs a scale rule"):
        build_torch_optimizer(named, config=OptimizerConfig(**fp8))
    config = OptimizerConfig(
        use_precision_aware_optimizer=True,
        exp_avg_dtype="bf16",
        exp_avg_sq_dtype="fp8",
        optimizer_cpu_offload=True,
        optimizer_offload_fraction=0.5,
    )
    optimizer = build_torch_optimizer(named, config=config)
    assert isinstance(optimizer, OffloadedAdamW)
    assert optimizer.host.precision.exp_avg_sq_dtype == torch.float8_e4m3fn
    assert len(optimizer.offloaded) == 1  # 1320 of 1750 elements: the first param's midpoint
