"""Issue 40 acceptance 5: the tensor-parallel bytes of a GPT step that docs/SCALING.md projects
(megatron.core.tensor_parallel.traffic) equal the counters of the collectives the step made
(mappings.tensor_parallel_bytes), at TP 2 and 4, with and without sequence parallelism, for
two model variants; and the sequence-parallel gradient count of tools/scaling_table.py equals
the parameters the model marks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel import TensorParallel, all_reduce_sequence_parallel_grads
from megatron.core.tensor_parallel.layers import SEQUENCE_PARALLEL_ATTR
from megatron.core.tensor_parallel.mappings import (
    reset_tensor_parallel_bytes,
    tensor_parallel_bytes,
)
from megatron.core.tensor_parallel.traffic import step_bytes, wire_bytes
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.tensor_parallel.tp_cases import BATCH, GPT_VARIANTS, SEQ, tiny_config
from tools.scaling_table import sequence_parallel_parameters

MICRO_BATCHES = 2


def _measure(rank: int, world_size: int) -> dict[str, dict]:
    torch.set_default_dtype(torch.float32)
    results = {}
    for sequence_parallel in (False, True):
        tp = TensorParallel(dist.group.WORLD, sequence_parallel=sequence_parallel)
        for variant, overrides in GPT_VARIANTS.items():
            config = tiny_config(**overrides)
            model = GPTModel(config, seed=7, tensor_parallel=tp)
            generator = torch.Generator().manual_seed(3)
            reset_tensor_parallel_bytes()
            for _ in range(MICRO_BATCHES):
                ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=generator)
                model(ids, labels=ids.roll(-1, dims=1)).mean().backward()
            if sequence_parallel:
                all_reduce_sequence_parallel_grads(model, tp.group)
            marked = [p for p in model.parameters() if getattr(p, SEQUENCE_PARALLEL_ATTR, False)]
            results[f"{variant}/sp={sequence_parallel}"] = {
                "counted": tensor_parallel_bytes(),
                "marked_elements": sum(p.numel() for p in marked),
            }
    return results


_RESULTS: dict[int, list] = {}


@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("variant", sorted(GPT_VARIANTS))
def test_formula_equals_the_counted_bytes(tp_size, sequence_parallel, variant) -> None:
    if tp_size not in _RESULTS:
        _RESULTS[tp_size] = run_distributed(_measure, tp_size)
    config = tiny_config(**GPT_VARIANTS[variant])
    sp_elements = sequence_parallel_parameters(config)
    expected = step_bytes(
        micro_batches=MICRO_BATCHES,
        sequence_parallel_grad_bytes=sp_elements * 4,
        sequence_parallel=sequence_parallel,
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        micro_batch=BATCH,
        seq_length=SEQ,
        activation_bytes=4,
    )
    for rank, results in enumerate(_RESULTS[tp_size]):
        got = results[f"{variant}/sp={sequence_parallel}"]
        assert got["marked_elements"] == (sp_elements if sequence_parallel else 0), rank
        assert got["counted"] == expected, (rank, got["counted"], expected)
        assert sum(got["counted"].values()) > 0


def test_wire_bytes_of_a_ring() -> None:
    logical = {"all_reduce": 800, "all_gather": 400, "reduce_scatter": 400}
    assert wire_bytes(logical, 1) == 0.0
    assert wire_bytes(logical, 2) == pytest.approx(0.5 * (1600 + 800))
    assert wire_bytes(logical, 8) == pytest.approx(7 / 8 * 2400)
