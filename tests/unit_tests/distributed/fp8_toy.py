"""A tiny GPT-shaped model whose layer Linears are Fp8Linear, for the FP8-parameter FSDP tests.

Values are a function of the parameter name only (toy_model.toy_init), so models built in high
precision, on meta, or under quantized_model_init hold the same fp32 main params.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron.core.distributed.fsdp.config import FsdpConfig
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
from megatron.core.fp8 import Fp8Config, Fp8Linear, QuantizedTensor, fp8_autocast, quantize
from megatron.core.fp8.formats import fp8_dtype_for_role
from tests.unit_tests.distributed.toy_model import OPT_CONFIG, RunState, batch, toy_init

HIDDEN = 32
RECIPES = ("tensorwise", "delayed", "blockwise", "mxfp8")


def fp8_config(recipe: str, *, param_gather: bool = True) -> Fp8Config:
    return Fp8Config(
        recipe=recipe, fp8_format="hybrid", amax_history_len=4, fp8_param_gather=param_gather
    )


class Fp8ToyLayer(nn.Module):
    def __init__(self, hidden: int, config: Fp8Config | None, *, bias: bool = True) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        if config is None:
            self.fc1 = nn.Linear(hidden, 2 * hidden, bias=bias)
            self.fc2 = nn.Linear(2 * hidden, hidden, bias=bias)
        else:
            self.fc1 = Fp8Linear(hidden, 2 * hidden, bias=bias, fp8_config=config)
            self.fc2 = Fp8Linear(2 * hidden, hidden, bias=bias, fp8_config=config)

    def to_linear_dtype(self, dtype: torch.dtype) -> None:
        """Plain Linears in `dtype` (the bf16 baseline); the norm stays fp32."""
        self.fc1.to(dtype)
        self.fc2.to(dtype)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        dtype = self.fc1.weight.dtype
        hidden_BSF = F.gelu(self.fc1(self.norm(x_BSH).to(dtype)))
        return x_BSH + self.fc2(hidden_BSF).to(x_BSH.dtype)


class Fp8ToyGPT(nn.Module):
    fsdp_unit_modules = (Fp8ToyLayer,)

    def __init__(
        self, *, config: Fp8Config | None, num_layers: int, hidden: int, bias: bool = True
    ) -> None:
        super().__init__()
        self.embedding = nn.Embedding(32, hidden)
        self.layers = nn.ModuleList(
            Fp8ToyLayer(hidden, config, bias=bias) for _ in range(num_layers)
        )
        self.final_norm = nn.LayerNorm(hidden)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x_BSH = self.embedding(input_ids)
        for layer in self.layers:
            x_BSH = layer(x_BSH)
        logits_BSV = self.final_norm(x_BSH) @ self.embedding.weight.t()
        per_token = F.cross_entropy(logits_BSV.flatten(0, 1), labels.flatten(), reduction="none")
        return per_token.view(labels.shape)


def build_fp8_toy(
    config: Fp8Config | None,
    *,
    num_layers: int = 2,
    hidden: int = HIDDEN,
    meta: bool = False,
    bias: bool = True,
) -> Fp8ToyGPT:
    sizes = dict(config=config, num_layers=num_layers, hidden=hidden, bias=bias)
    if meta:
        with torch.device("meta"):
            return Fp8ToyGPT(**sizes)
    model = Fp8ToyGPT(**sizes)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if isinstance(param, QuantizedTensor):
                continue
            toy_init(name, param)
    return model


def wrap(
    module: nn.Module,
    *,
    strategy: str,
    config: Fp8Config | None,
    init_fn=None,
    pass_fp8_config: bool = True,
    **fsdp_overrides,
) -> RunState:
    model = FullyShardedDataParallel(
        module,
        fsdp_config=FsdpConfig(data_parallel_sharding_strategy=strategy, **fsdp_overrides),
        device="cpu",
        init_fn=init_fn,
        fp8_config=config if pass_fp8_config else None,
    )
    return RunState(model=model, optimizer=model.build_optimizer(OPT_CONFIG))


def train(
    state: RunState, steps: range, *, config: Fp8Config | None, micro_batches: int = 1, after=None
) -> list[float]:
    """Like toy_model.train_steps, with fp8_autocast over the DP group; `after(step)` runs
    after each optimizer step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = state.model, state.optimizer
    autocast = lambda: fp8_autocast(
        model, enabled=True, fp8_config=config, amax_reduction_group=dist.group.WORLD
    )
    losses = []
    for step in steps:
        model.zero_grad_buffer()
        inputs, labels = batch(step)
        local = slice(rank * inputs.shape[0] // world, (rank + 1) * inputs.shape[0] // world)
        micro_inputs, micro_labels = (
            inputs[local].chunk(micro_batches),
            labels[local].chunk(micro_batches),
        )
        local_loss = torch.zeros(())
        for k in range(micro_batches):
            sync = contextlib.nullcontext() if k == micro_batches - 1 else model.no_sync()
            with sync:
                with autocast() if config is not None else contextlib.nullcontext():
                    loss = model(micro_inputs[k], micro_labels[k]).mean() / micro_batches
                loss.backward()
            local_loss += loss.detach()
        model.finish_grad_sync()
        assert optimizer.step().update_successful
        dist.all_reduce(local_loss)
        losses.append(local_loss.item() / world)
        if after is not None:
            after(step)
    return losses


def fp8_weights(model: nn.Module) -> dict[str, QuantizedTensor]:
    return {n: p for n, p in model.named_parameters() if isinstance(p, QuantizedTensor)}


def expected_quantization(
    full_main: torch.Tensor, *, config: Fp8Config, scale: torch.Tensor | None
) -> QuantizedTensor:
    """One rank quantizing the whole fp32 main weight: the reference the engine must match."""
    recipe = config.recipe
    return quantize(
        full_main,
        recipe=recipe,
        fp8_dtype=fp8_dtype_for_role(config.fp8_format, "weight"),
        role="weight",
        rowwise=True,
        columnwise=recipe == "mxfp8",
        scale=scale,
        power_2_scale=None if recipe in ("delayed", "mxfp8") else config.use_power_2_scale,
        backend="reference",
    )
