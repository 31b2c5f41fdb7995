"""Delayed scaling: hand-simulated scale/history evolution, recompute, state_dict, and one
packed all-reduce per direction on 2 gloo ranks."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from megatron.core.fp8 import (
    E4M3,
    E5M2,
    Fp8Config,
    Fp8Linear,
    autocast,
    delayed_scaling_state_dict,
    fp8_autocast,
    load_delayed_scaling_state_dict,
    quantize,
)
from megatron.core.fp8.reference import delayed_scale_update, roll_amax_history
from tests.unit_tests.dist_utils import run_distributed


def unit_pattern(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Values in (-1, 1) with max |value| exactly 1, so a * pattern has amax exactly a."""
    u = torch.rand(rows, cols, generator=torch.Generator().manual_seed(seed)) * 1.8 - 0.9
    u[0, 0] = 1.0
    return u


class HandSimulation:
    """docs/FP8_NUMERICS.md delayed steps 1-4 in plain numpy fp32."""

    def __init__(self, length: int, margin: int, algo: str, fp8_max: float = 448.0):
        self.history = [np.float32(0)] * length
        self.scale = np.float32(1.0)
        self.margin, self.algo, self.fp8_max = margin, algo, np.float32(fp8_max)

    def step(self, amax: float) -> None:
        self.history[0] = max(self.history[0], np.float32(amax))
        used = max(self.history) if self.algo == "max" else self.history[0]
        if np.isfinite(used) and used > 0:
            self.scale = np.float32(np.float32(self.fp8_max / used) / np.float32(2**self.margin))
        self.history = self.history[1:] + self.history[:1]
        self.history[0] = np.float32(0)


def test_scale_and_history_follow_hand_simulation():
    config = Fp8Config(recipe="delayed", fp8_format="hybrid", amax_history_len=3, margin=1)
    layer = Fp8Linear(32, 16, bias=False, fp8_config=config)
    metas = layer.delayed_scaling.metas
    w_amax = layer.weight.detach().abs().max().item()
    sims = {
        "input": HandSimulation(3, 1, "max"),
        "weight": HandSimulation(3, 1, "max"),
        "grad": HandSimulation(3, 1, "max", fp8_max=57344.0),
    }
    for step, (a, b) in enumerate([(2.0, 0.5), (8.0, 3.0), (1.0, 1e-3), (0.5, 0.0), (3.0, 7.0)]):
        x = (a * unit_pattern(4, 32, step)).requires_grad_()
        with fp8_autocast(layer, fp8_config=config):
            y = layer(x)
        sims["input"].step(a)
        sims["weight"].step(w_amax)
        for role in ("input", "weight"):
            assert metas[role].scale.item() == sims[role].scale, (step, role)
            assert metas[role].amax_history.tolist() == [float(v) for v in sims[role].history]
        y.backward(b * unit_pattern(4, 16, 100 + step))
        sims["grad"].step(b)
        assert metas["grad"].scale.item() == sims["grad"].scale, step
        assert metas["grad"].amax_history.tolist() == [float(v) for v in sims["grad"].history]
    # History length 3: 8.0 (step 1) rolled out; the max of 1.0, 0.5, 3.0 sets the scale.
    assert metas["input"].scale.item() == np.float32(np.float32(448.0) / np.float32(3.0)) / 2


def test_most_recent_and_zero_amax_keeps_scale():
    config = Fp8Config(
        recipe="delayed", fp8_format="e4m3", amax_history_len=2, amax_compute_algo="most_recent"
    )
    layer = Fp8Linear(32, 8, bias=False, fp8_config=config)
    scales = []
    for a in (4.0, 1.0, 0.0):
        with fp8_autocast(layer):
            layer(a * unit_pattern(2, 32, 0))
        scales.append(layer.delayed_scaling.metas["input"].scale.item())
    assert scales == [112.0, 448.0, 448.0]  # amax 0 keeps the old scale


def test_quantization_uses_the_scale_before_the_update():
    config = Fp8Config(recipe="delayed", fp8_format="e4m3", amax_history_len=4)
    layer = Fp8Linear(32, 8, bias=False, fp8_config=config)
    x = 2.0 * unit_pattern(4, 32, 1)
    layer(x)  # step 1: scale 1.0, then scale becomes 224
    y = layer(x)  # step 2 quantizes with 224
    scale = torch.tensor(224.0)
    xq = quantize(x, recipe="delayed", fp8_dtype=E4M3, role="input", scale=scale)
    w_scale = torch.tensor(np.float32(448.0) / np.float32(layer.weight.abs().max().item()))
    wq = quantize(
        layer.weight.detach(), recipe="delayed", fp8_dtype=E4M3, role="weight", scale=w_scale
    )
    assert torch.equal(y, xq.dequantize() @ wq.dequantize().t())


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_recompute_reuses_first_forward_scales_and_records_once(use_reentrant):
    config = Fp8Config(recipe="delayed", fp8_format="hybrid", amax_history_len=4)
    torch.manual_seed(0)
    plain = Fp8Linear(32, 16, fp8_config=config)
    torch.manual_seed(0)
    recomputed = Fp8Linear(32, 16, fp8_config=config)
    for step in range(3):
        x = ((step + 1) * unit_pattern(8, 32, step)).requires_grad_()
        grad_y = unit_pattern(8, 16, 50 + step)
        with fp8_autocast(torch.nn.ModuleList([plain, recomputed])):
            y_plain = plain(x)
            y_ckpt = checkpoint(recomputed, x, use_reentrant=use_reentrant)
        assert torch.equal(y_plain, y_ckpt)
        y_plain.backward(grad_y)
        y_ckpt.backward(grad_y)
        for role in ("input", "weight", "grad"):
            ckpt_meta = recomputed.delayed_scaling.metas[role]
            plain_meta = plain.delayed_scaling.metas[role]
            assert torch.equal(ckpt_meta.amax_history, plain_meta.amax_history), (step, role)
            assert torch.equal(ckpt_meta.scale, plain_meta.scale), (step, role)
        # The recompute recorded nothing: slot 0 is still zero after the backward.
        assert recomputed.delayed_scaling.metas["input"].amax_history[0].item() == 0.0
        # Scales changed after the forward, so equal grads prove the recompute used the old ones.
        assert torch.equal(recomputed.weight.grad, plain.weight.grad)
        plain.zero_grad()
        recomputed.zero_grad()


def test_state_dict_round_trip_keyed_by_module_names():
    config = Fp8Config(recipe="delayed", fp8_format="hybrid", amax_history_len=5, margin=2)
    model = torch.nn.Sequential(
        Fp8Linear(32, 16, fp8_config=config), Fp8Linear(16, 8, fp8_config=config)
    )
    for step in range(2):
        with fp8_autocast(model):
            y = model((step + 1) * unit_pattern(4, 32, step))
        y.sum().backward()
    state = delayed_scaling_state_dict(model)
    assert sorted(state) == ["0", "1"]
    assert json.loads(json.dumps(state["0"]["metadata"]))["amax_history_len"] == 5
    fresh = torch.nn.Sequential(
        Fp8Linear(32, 16, fp8_config=config), Fp8Linear(16, 8, fp8_config=config)
    )
    load_delayed_scaling_state_dict(fresh, state)
    for name in ("0", "1"):
        for role in ("input", "weight", "grad"):
            old, new = (
                model[int(name)].delayed_scaling.metas[role],
                fresh[int(name)].delayed_scaling.metas[role],
            )
            assert torch.equal(old.scale, new.scale) and torch.equal(
                old.amax_history, new.amax_history
            )
    assert model[0].delayed_scaling.metas["input"].scale.item() == np.float32(448 / 2.0) / 4
    with pytest.raises(KeyError, match="missing"):
        load_delayed_scaling_state_dict(torch.nn.Sequential(fresh[0]), {"1": state["1"]})
    short = Fp8Linear(32, 16, fp8_config=Fp8Config(recipe="delayed", amax_history_len=3))
    with pytest.raises(ValueError, match="--fp8-amax-history-len"):
        short.delayed_scaling.load_state_dict(state["0"])


def _count_collectives(rank: int, world_size: int) -> dict:
    calls = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        calls.append((tensor.dtype, tensor.numel()))
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    config = Fp8Config(recipe="delayed", fp8_format="hybrid", amax_history_len=4)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        Fp8Linear(32, 16, fp8_config=config), Fp8Linear(16, 8, fp8_config=config)
    )
    x = (rank + 1) * unit_pattern(4, 32, 0)
    with fp8_autocast(model, amax_reduction_group=dist.group.WORLD):
        y = model(x)
        forward_calls = list(calls)  # nothing until the autocast exits
    after_forward = list(calls)
    y.backward((rank + 1) * unit_pattern(4, 8, 1))
    after_backward = list(calls)
    # Tensorwise quantization of a sharded tensor with amax_reduction_group = the whole tensor.
    whole = torch.randn(8, 16, generator=torch.Generator().manual_seed(5)) * 3
    shard = whole[rank * 4 : (rank + 1) * 4]
    qt = quantize(
        shard,
        recipe="tensorwise",
        fp8_dtype=E4M3,
        role="weight",
        amax_reduction_group=dist.group.WORLD,
    )
    dist.all_reduce = real_all_reduce
    metas = model[0].delayed_scaling.metas
    return dict(
        forward_calls=forward_calls,
        after_forward=after_forward,
        after_backward=after_backward,
        input_scale=metas["input"].scale.item(),
        grad_scales=[layer.delayed_scaling.metas["grad"].scale.item() for layer in model],
        shard_bytes=qt.rowwise_data,
        shard_scale_inv=qt.rowwise_scale_inv,
    )


def test_one_packed_all_reduce_per_direction_on_two_ranks():
    results = run_distributed(_count_collectives, 2)
    for result in results:
        assert result["forward_calls"] == []
        # 2 layers x (input, weight) amaxes in one fp32 buffer, then 2 grad amaxes in one.
        assert result["after_forward"] == [(torch.float32, 4)]
        assert result["after_backward"] == [(torch.float32, 4), (torch.float32, 2)]
        # Rank 1's input amax is 2.0: both ranks take the max.
        assert result["input_scale"] == 224.0
        assert result["grad_scales"][1] == 57344.0 / 2.0  # the last layer's dY is (rank+1) * u
    assert results[0]["grad_scales"] == results[1]["grad_scales"]
    whole = torch.randn(8, 16, generator=torch.Generator().manual_seed(5)) * 3
    expected = quantize(whole, recipe="tensorwise", fp8_dtype=E4M3, role="weight")
    gathered = torch.cat([r["shard_bytes"] for r in results])
    assert torch.equal(gathered, expected.rowwise_data)
    assert all(torch.equal(r["shard_scale_inv"], expected.rowwise_scale_inv) for r in results)


def test_stacked_returns_the_tensor_its_rows_come_from_without_a_copy():
    # A flush's outputs are no views themselves (a reshape() of arange would be one).
    histories = torch.arange(12, dtype=torch.float32).reshape(3, 4).clone()
    assert histories._base is None
    assert autocast._stacked(list(histories.unbind(0)), shape=(4,)) is histories
    scales = torch.tensor([1.0, 2.0, 3.0])
    assert autocast._stacked(list(scales.unbind(0)), shape=()) is scales


@pytest.mark.parametrize(
    "change", ["order", "not a view of it", "a row of another tensor", "fewer", "more"]
)
def test_stacked_stacks_anew_unless_given_every_row_in_order(change):
    values = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    base = values.clone()
    rows = list(base.unbind(0))
    if change == "order":
        tensors = [rows[1], rows[0], rows[2]]
    elif change == "not a view of it":
        tensors = [rows[0], rows[1].clone(), rows[2]]
    elif change == "a row of another tensor":
        # Same storage offset as base's row 2, but another tensor's.
        tensors = [rows[0], rows[1], values.clone().unbind(0)[2]]
    elif change == "fewer":
        tensors = rows[:2]
    else:
        tensors = rows + [torch.full((4,), 7.0)]
    out = autocast._stacked(tensors, shape=(4,))
    assert out is not base and out.shape == (len(tensors), 4)
    assert torch.equal(out, torch.stack(tensors))
    assert out.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    out.fill_(-1.0)  # fresh storage: the inputs are untouched
    assert torch.equal(base, values)


def test_stacked_reshapes_scales_that_are_not_rows():
    out = autocast._stacked([torch.tensor(2.0), torch.tensor([3.0])], shape=())
    assert out.shape == (2,) and out.tolist() == [2.0, 3.0]


def test_flushes_reuse_the_previous_flush_outputs_and_follow_the_reference(monkeypatch):
    """Two Fp8Linears over three steps: every flush updates exactly as delayed_scale_update and
    roll_amax_history applied to each meta by hand, and from the second flush of a direction
    on, the stacked histories and scales it updates are the previous flush's outputs (the
    metas' current rows), not copies; scales captured by a forward keep their values."""
    config = Fp8Config(recipe="delayed", fp8_format="hybrid", amax_history_len=3, margin=1)
    torch.manual_seed(0)
    layers = [
        Fp8Linear(32, 16, bias=False, fp8_config=config),
        Fp8Linear(32, 8, bias=False, fp8_config=config),
    ]
    updates = []
    real_update = autocast.delayed_scale_update

    def spying_update(histories, scales, **settings):
        updates.append((histories, scales))
        return real_update(histories, scales, **settings)

    monkeypatch.setattr(autocast, "delayed_scale_update", spying_update)
    forward_metas = [
        layer.delayed_scaling.metas[role] for layer in layers for role in ("input", "weight")
    ]
    grad_metas = [layer.delayed_scaling.metas["grad"] for layer in layers]
    hand = {id(meta): (torch.zeros(3), torch.ones(())) for meta in forward_metas + grad_metas}
    previous = {}

    def check_flush(direction, metas, amaxes, fp8_dtype):
        histories, scales = updates[-1]
        for meta, amax in zip(metas, amaxes, strict=True):
            history, scale = hand[id(meta)]
            history = history.clone()
            history[0] = torch.maximum(history[0], torch.tensor(amax))
            scale = delayed_scale_update(
                history, scale, fp8_dtype=fp8_dtype, margin=1, amax_compute_algo="max"
            )
            history = roll_amax_history(history)
            hand[id(meta)] = (history, scale)
            assert torch.equal(meta.scale, scale), (direction, meta.scale, scale)
            assert torch.equal(meta.amax_history, history), (direction, meta.amax_history)
        # The metas now hold rows of one new history tensor and one new scale tensor.
        history_base, scale_base = metas[0].amax_history._base, metas[0].scale._base
        assert history_base.shape == (len(metas), 3) and scale_base.shape == (len(metas),)
        assert all(meta.amax_history._base is history_base for meta in metas)
        assert all(meta.scale._base is scale_base for meta in metas)
        if direction in previous:
            assert histories is previous[direction][0] and scales is previous[direction][1]
        else:
            assert histories._base is None and scales._base is None  # a fresh stack
        assert histories is not history_base and scales is not scale_base
        previous[direction] = (history_base, scale_base)

    weight_amaxes = [layer.weight.detach().abs().max().item() for layer in layers]
    for step, (a, b) in enumerate([(2.0, 0.5), (8.0, 4.0), (1.0, 0.25)]):
        xs = [
            (a * unit_pattern(4, 32, step)).requires_grad_(),
            (a / 2 * unit_pattern(4, 32, 10 + step)).requires_grad_(),
        ]
        used_scales = [meta.scale for meta in forward_metas]
        used_values = [scale.clone() for scale in used_scales]
        with fp8_autocast(torch.nn.ModuleList(layers)):
            ys = [layer(x) for layer, x in zip(layers, xs)]
        assert len(updates) == 2 * step + 1
        amaxes = [a, weight_amaxes[0], a / 2, weight_amaxes[1]]
        check_flush("forward", forward_metas, amaxes, E4M3)
        assert all(torch.equal(s, v) for s, v in zip(used_scales, used_values))
        assert all(meta.scale is not s for meta, s in zip(forward_metas, used_scales))
        grads = [b * unit_pattern(4, 16, 100 + step), 2 * b * unit_pattern(4, 8, 200 + step)]
        torch.autograd.backward(ys, grads)
        assert len(updates) == 2 * step + 2
        check_flush("backward", grad_metas, [b, 2 * b], E5M2)


class _RaisingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward failed on purpose")


def test_a_backward_that_raises_does_not_stop_later_grad_flushes():
    """A backward that raises never runs its final callbacks, so the grad flush it queued is
    lost; the next backward must queue its own (it is keyed on the graph task), not wait."""
    layer = Fp8Linear(32, 32, bias=False, fp8_config=Fp8Config(recipe="delayed"))
    grad_meta = layer.delayed_scaling.metas["grad"]
    x = torch.randn(16, 32, requires_grad=True)
    with fp8_autocast(layer):
        y = layer(_RaisingBackward.apply(x))
    with pytest.raises(RuntimeError, match="on purpose"):
        y.sum().backward()  # the layer's backward ran (and recorded) before the failure
    assert grad_meta.amax_history[0].item() == 1.0 and grad_meta.scale.item() == 1.0
    with fp8_autocast(layer):
        y = layer(x)
    y.sum().backward()
    # Flushed: slot 0 (max of both passes' |dy| = 1) rolled to the end, scale from amax 1.
    history = grad_meta.amax_history.tolist()
    assert history[0] == 0.0 and history[-1] == 1.0
    assert grad_meta.scale.item() == torch.finfo(grad_meta.fp8_dtype).max


@pytest.mark.parametrize("mixed_formats", [False, True])
def test_batched_weight_update_and_record_equal_one_meta_at_a_time(mixed_formats: bool):
    # The FSDP FP8 storage advances its weights' metas together (reduce_and_update without a
    # group, then record_amaxes): bitwise the per-meta update() and record() it replaced, over
    # steps whose histories are first separate tensors, then rows of one stacked tensor (or,
    # with two formats, never one tensor: each meta records alone).
    config = Fp8Config(recipe="delayed", amax_history_len=4, margin=1)
    dtypes = [E4M3, E5M2 if mixed_formats else E4M3, E4M3]
    batched, single = (
        [autocast.ScalingMeta(fp8_dtype=dtype, config=config) for dtype in dtypes] for _ in range(2)
    )
    generator = torch.Generator().manual_seed(7)
    for step in range(5):
        amaxes = torch.rand(3, generator=generator) * 10 ** (step - 2)
        if step:  # the storage updates from the second write on (delayed_pending)
            autocast.reduce_and_update(batched, None)
            for meta in single:
                meta.update()
        autocast.record_amaxes(batched, amaxes)
        for meta, amax in zip(single, amaxes, strict=True):
            meta.record(amax)
        for got, want in zip(batched, single, strict=True):
            assert torch.equal(got.scale.view(torch.int32), want.scale.view(torch.int32))
            assert torch.equal(got.amax_history, want.amax_history)
    histories = [meta.amax_history for meta in batched]
    stacked = autocast._rows_of(histories, shape=(4,))[0] is not None
    assert stacked == (not mixed_formats)
    assert float(batched[2].amax_history[0]) == float(amaxes[2])


def test_record_amaxes_of_some_rows_in_any_order_writes_only_those():
    # Some rows of the tensor a flush of more metas (the whole model's) left the histories in,
    # in any order: `_rows_of` names them; consecutive rows are written in one maximum over a
    # slice of slot 0 (the experts of one grouped call), others one meta at a time; the
    # values are the per-meta records' either way, and the other rows stay as they were.
    config = Fp8Config(recipe="delayed", amax_history_len=4)
    metas = [autocast.ScalingMeta(fp8_dtype=E4M3, config=config) for _ in range(5)]
    for meta, amax in zip(metas, [1.0, 2.0, 3.0, 4.0, 5.0], strict=True):
        meta.record(torch.tensor(amax))
    autocast.reduce_and_update(metas, None)
    base, rows = autocast._rows_of([m.amax_history for m in metas], shape=(4,))
    assert base is not None and rows == [0, 1, 2, 3, 4]
    before = base.clone()
    chosen = [metas[3], metas[0]]
    assert autocast._rows_of([m.amax_history for m in chosen], shape=(4,))[1] == [3, 0]
    autocast.record_amaxes(chosen, torch.tensor([0.5, 9.0]))
    want = before.clone()
    want[3, 0], want[0, 0] = max(before[3, 0], 0.5), 9.0
    assert torch.equal(base, want) and metas[0].amax_history[0] == 9.0
    autocast.record_amaxes(metas[1:3], torch.tensor([7.0, 0.25]))  # consecutive: one slice
    want[1, 0], want[2, 0] = 7.0, max(want[2, 0], 0.25)
    assert torch.equal(base, want)
    assert [m.amax_history._base is base for m in metas] == [True] * 5  # still views
