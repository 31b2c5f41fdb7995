"""--async-save's host copy (issue 21, acceptance 3): buffers reused across saves, holding the
values of the save's iteration; on CUDA pinned, copied on a side stream that the next optimizer
step and the writer wait for (megatron/training/checkpoint/staging.py)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron.core.dist_checkpointing.flat_dtensor import local_piece
from megatron.core.dist_checkpointing.safe_reader import SafeFileSystemReader
from megatron.core.distributed.fsdp.distributed_optimizer import FsdpDistributedOptimizer
from megatron.training.checkpoint.async_save import AsyncCheckpointSaver
from megatron.training.checkpoint.staging import HostStaging
from tests.unit_tests.training.common import NO_DROPOUT, TINY_GPT, run_pretrain
from tests.unit_tests.training.common import ZERO3_DTENSOR as ZERO3

SAVES = [2, 4, 5]  # --save-interval 2 of --train-iters 5, and the last iteration
# About half a second of GPU time at ~2 GHz: the copies are still queued when the next
# iteration's optimizer step is issued (a tiny model's forward and backward take milliseconds).
COPY_DELAY_CYCLES = 1_000_000_000


def test_buffers_are_reused_and_hold_the_values_of_their_save():
    staging = HostStaging(device=torch.device("cpu"))
    weight = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    live = {"params": {"w": weight}, "step": torch.tensor(3.0), "metadata": {"len": 4}}
    first = staging.stage(live, name="sharded", cpu_mesh=None)
    weight.mul_(2).add_(1)  # the next optimizer step
    live["step"] = torch.tensor(4.0)
    assert first["params"]["w"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert first["step"].item() == 3.0 and first["metadata"] == {"len": 4}
    assert first["params"]["w"].data_ptr() != weight.data_ptr()
    second = staging.stage(live, name="sharded", cpu_mesh=None)
    assert second["params"]["w"].data_ptr() == first["params"]["w"].data_ptr()
    assert second["step"].data_ptr() == first["step"].data_ptr()
    assert second["params"]["w"].tolist() == [[1.0, 3.0, 5.0], [7.0, 9.0, 11.0]]
    assert second["step"].item() == 4.0
    assert sorted(staging.buffers) == [("sharded", "params", "w"), ("sharded", "step")]
    # Another entry name gets buffers of its own.
    other = staging.stage({"w": weight}, name="fp8", cpu_mesh=None)
    assert other["w"].data_ptr() != second["params"]["w"].data_ptr()
    assert len(staging.buffers) == 3


def test_a_shape_or_dtype_change_reallocates_and_release_frees():
    staging = HostStaging(device=torch.device("cpu"))
    first = staging.stage({"w": torch.zeros(4)}, name="sharded", cpu_mesh=None)["w"]
    longer = staging.stage({"w": torch.ones(6)}, name="sharded", cpu_mesh=None)["w"]
    assert longer.data_ptr() != first.data_ptr()
    assert longer.tolist() == [1.0] * 6 and first.tolist() == [0.0] * 4
    assert staging.buffers[("sharded", "w")] is longer
    halves = torch.full((6,), 2.5, dtype=torch.bfloat16)
    narrower = staging.stage({"w": halves}, name="sharded", cpu_mesh=None)["w"]
    assert narrower.dtype == torch.bfloat16 and narrower.data_ptr() != longer.data_ptr()
    assert narrower.tolist() == [2.5] * 6
    again = staging.stage({"w": halves * 2}, name="sharded", cpu_mesh=None)["w"]
    assert again.data_ptr() == narrower.data_ptr() and again.tolist() == [5.0] * 6
    staging.release()
    assert staging.buffers == {}


def test_no_new_copy_while_a_write_is_in_flight():
    saver = AsyncCheckpointSaver.__new__(AsyncCheckpointSaver)  # no process group needed
    saver.pending = object()
    saver.staging = HostStaging(device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match="still writes the host copy; finalize it first"):
        saver.stage({"w": torch.zeros(2)}, name="sharded")
    assert saver.staging.buffers == {}


def _flat_tensors(state, prefix: str = "") -> dict[str, torch.Tensor]:
    """DCP's flat keys ("model.params.<name>") of every tensor of a state dict, as CPU clones
    (the whole tensor at DP=1: the local piece is all of it)."""
    flat = {}
    for key, value in state.items():
        if isinstance(value, dict):
            flat.update(_flat_tensors(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor):
            flat[f"{prefix}{key}"] = local_piece(value).detach().to("cpu", copy=True)
    return flat


def _load_every_tensor(sharded_dir: str) -> dict[str, torch.Tensor]:
    metadata = SafeFileSystemReader(sharded_dir).read_metadata()
    template = {
        key: torch.empty(item.size, dtype=item.properties.dtype)
        for key, item in metadata.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata)
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "no process group: loading on one rank"
        dcp.load(template, storage_reader=SafeFileSystemReader(sharded_dir), no_dist=True)
    return template


def _run_with_spy(tmp_path, monkeypatch, *, delay_copies: bool) -> dict:
    """Train 5 iterations saving asynchronously at 2, 4 and 5; record, at each save, the live
    state (cloned before the copy is queued), the buffers' addresses and the saver."""
    seen = {"live": [], "buffers": [], "pinned": [], "in_flight": [], "saver": None}
    real_stage = AsyncCheckpointSaver.stage

    def spy_stage(saver, state, *, name):
        if name != "sharded":
            return real_stage(saver, state, name=name)
        seen["saver"] = saver
        seen["live"].append(_flat_tensors(state))
        seen["calls"].append("save")
        if delay_copies:
            with torch.cuda.stream(saver.staging.copy_stream):
                torch.cuda._sleep(COPY_DELAY_CYCLES)
        staged = real_stage(saver, state, name=name)
        if delay_copies:
            seen["in_flight"].append(not saver.staging.copied.query())
        buffers = {key: b for key, b in saver.staging.buffers.items() if key[0] == "sharded"}
        seen["buffers"].append(buffers)  # held, so a fresh allocation cannot reuse an address
        if torch.cuda.is_available():
            seen["pinned"].append(all(buffer.is_pinned() for buffer in buffers.values()))
        return staged

    monkeypatch.setattr(AsyncCheckpointSaver, "stage", spy_stage)
    seen["calls"] = []
    for owner, method in (
        (AsyncCheckpointSaver, "before_optimizer_step"),
        (FsdpDistributedOptimizer, "step"),
    ):
        real = getattr(owner, method)

        def spy(self, _real=real, _method=method):
            seen["calls"].append(_method)
            return _real(self)

        monkeypatch.setattr(owner, method, spy)
    save = tmp_path / "ckpt"
    argv = TINY_GPT + NO_DROPOUT + ZERO3 + ["--train-iters", "5", "--async-save"]
    run_pretrain(argv + ["--save", str(save), "--save-interval", "2"])
    seen["saved"] = {
        iteration: _load_every_tensor(os.path.join(save, f"iter_{iteration:07d}", "sharded"))
        for iteration in SAVES
    }
    return seen


def _assert_each_checkpoint_holds_its_iteration(seen: dict) -> None:
    # Every optimizer step first waits for the copy of a save that came before it.
    step = ["before_optimizer_step", "step"]
    assert seen["calls"] == step * 2 + ["save"] + step * 2 + ["save"] + step + ["save"]
    assert len(seen["live"]) == len(SAVES)
    for iteration, live in zip(SAVES, seen["live"]):
        saved = seen["saved"][iteration]
        assert sorted(saved) == sorted(live)
        assert any(key.startswith("optimizer.exp_avg_sq.") for key in saved)
        for key, value in live.items():
            assert torch.equal(saved[key], value.view(saved[key].shape)), (iteration, key)
    # Training changed params and moments after each save, so each checkpoint is its own.
    changed = [
        key
        for key in seen["live"][0]
        if not torch.equal(seen["live"][0][key], seen["live"][1][key])
    ]
    assert any(key.startswith("model.params.") for key in changed)
    assert any(key.startswith("optimizer.exp_avg.") for key in changed)
    # One buffer per entry, allocated at the first save and reused by the next two.
    first, *later = seen["buffers"]
    assert len(first) == len(seen["live"][0])
    for buffers in later:
        assert {key: b.data_ptr() for key, b in buffers.items()} == {
            key: b.data_ptr() for key, b in first.items()
        }
    assert seen["saver"].staging.buffers == {}  # freed when training ended


def test_each_async_checkpoint_equals_the_state_at_its_save(tmp_path, monkeypatch):
    seen = _run_with_spy(tmp_path, monkeypatch, delay_copies=False)
    _assert_each_checkpoint_holds_its_iteration(seen)


@pytest.mark.gpu
def test_pinned_copy_on_a_side_stream_is_ordered_before_the_next_write():
    device = torch.device("cuda", torch.cuda.current_device())
    staging = HostStaging(device=device)
    assert staging.copy_stream.cuda_stream != torch.cuda.current_stream().cuda_stream
    assert staging.copy_stream.cuda_stream != torch.cuda.default_stream().cuda_stream
    params = torch.arange(16 * 2**20, dtype=torch.float32, device=device)  # 64 MiB
    expected = params.cpu()
    torch.cuda._sleep(COPY_DELAY_CYCLES)  # the current stream is busy: the copy must wait
    staged = staging.stage({"w": params}, name="sharded", cpu_mesh=None)["w"]
    assert staged.is_pinned()
    assert not staging.copied.query()  # queued, not done: the host did not wait for it
    staging.before_optimizer_step()
    params.add_(1.0)  # the optimizer step, queued behind the copy
    staging.copied.synchronize()
    assert torch.equal(staged, expected)
    torch.cuda.synchronize()
    assert params[:3].tolist() == [1.0, 2.0, 3.0]
    staging.release()
    assert staging.buffers == {}


@pytest.mark.gpu
def test_checkpoint_equals_the_save_while_the_next_step_ran_during_the_copy(tmp_path, monkeypatch):
    seen = _run_with_spy(tmp_path, monkeypatch, delay_copies=True)
    assert seen["in_flight"] == [True] * len(SAVES)
    assert seen["pinned"] == [True] * len(SAVES)
    assert seen["saver"].staging.copy_stream is not None
    _assert_each_checkpoint_holds_its_iteration(seen)
