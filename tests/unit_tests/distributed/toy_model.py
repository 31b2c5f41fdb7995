"""A tiny GPT-shaped model and training loop shared by the Megatron-FSDP tests.

Layers are the FSDP units; the embedding (tied with the output head) and the final norm form
the root unit, as in GPTModel. Values are a function of (parameter name) only, so a model built
eagerly and one materialized from meta are bitwise equal.
"""

from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron.core.distributed.fsdp.config import FsdpConfig
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
from megatron.core.optimizer import MixedPrecisionOptimizer, OptimizerConfig

VOCAB, HIDDEN, SEQ, GLOBAL_BATCH = 32, 16, 16, 8


class ToyLayer(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 2 * hidden)
        self.fc2 = nn.Linear(2 * hidden, hidden)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        return x_BSH + self.fc2(F.gelu(self.fc1(self.norm(x_BSH))))


class ToyGPT(nn.Module):
    fsdp_unit_modules = (ToyLayer,)

    def __init__(self, *, num_layers: int, hidden: int = HIDDEN, vocab: int = VOCAB) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(ToyLayer(hidden) for _ in range(num_layers))
        self.final_norm = nn.LayerNorm(hidden)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x_BSH = self.embedding(input_ids)
        for layer in self.layers:
            x_BSH = layer(x_BSH)
        logits_BSV = self.final_norm(x_BSH) @ self.embedding.weight.t()  # tied output head
        per_token = F.cross_entropy(logits_BSV.flatten(0, 1), labels.flatten(), reduction="none")
        return per_token.view(labels.shape)


@torch.no_grad()
def toy_init(name: str, tensor: torch.Tensor) -> None:
    """Deterministic value of parameter `name`, whatever device/dtype `tensor` has."""
    if name.endswith("bias"):
        tensor.zero_()
    elif "norm" in name:
        tensor.fill_(1.0)
    else:
        generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        values = torch.randn(tensor.shape, generator=generator) * 0.2
        tensor.copy_(values)


def build_toy(*, num_layers: int = 2, meta: bool = False, hidden: int = HIDDEN) -> ToyGPT:
    if meta:
        with torch.device("meta"):
            return ToyGPT(num_layers=num_layers, hidden=hidden)
    model = ToyGPT(num_layers=num_layers, hidden=hidden)
    for name, param in model.named_parameters():
        toy_init(name, param)
    return model


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


OPT_CONFIG = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.5)


def reference_losses(steps: int, *, num_layers: int = 2) -> list[float]:
    """Single process, plain model, one backward on the whole global batch."""
    model = build_toy(num_layers=num_layers)
    optimizer = MixedPrecisionOptimizer(model, config=OPT_CONFIG)
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        inputs, labels = batch(step)
        loss = model(inputs, labels).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@dataclass
class RunState:
    model: FullyShardedDataParallel
    optimizer: object


def wrap_toy(config: FsdpConfig, *, num_layers: int = 2, meta: bool = False) -> RunState:
    model = FullyShardedDataParallel(
        build_toy(num_layers=num_layers, meta=meta),
        fsdp_config=config,
        device="cpu",
        init_fn=toy_init if meta else None,
    )
    return RunState(model=model, optimizer=model.build_optimizer(OPT_CONFIG))


def train_steps(
    state: RunState, steps: range, *, micro_batches: int = 2
) -> tuple[list[float], list[dict]]:
    """The loop documented in mcore_fsdp_adapter; returns global losses and per-step bytes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = state.model, state.optimizer
    losses, stats = [], []
    for step in steps:
        model.zero_grad_buffer()
        inputs, labels = batch(step)
        local = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
        micro_inputs = inputs[local].chunk(micro_batches)
        micro_labels = labels[local].chunk(micro_batches)
        local_loss = torch.zeros(())
        for k in range(micro_batches):
            last = k == micro_batches - 1
            with contextlib.nullcontext() if last else model.no_sync():
                loss = model(micro_inputs[k], micro_labels[k]).mean() / micro_batches
                loss.backward()
            local_loss += loss.detach()
        model.finish_grad_sync()
        result = optimizer.step()
        assert result.update_successful
        dist.all_reduce(local_loss)
        losses.append(local_loss.item() / world)
        stats.append(model.comm_stats())
    return losses, stats
