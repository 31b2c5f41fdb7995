"""Issue 38, acceptance 1 (fp32 part): a tiny MoE GPT (dense first layer, then an MoE layer
with shared experts; dropless top-2, aux loss and z-loss) trained 20 steps by pretrain() on
gloo ranks, expert parallelism inside the data-parallel ranks as in Megatron-LM, gives the
single-process losses within 1e-5: under DDP, and under Megatron-FSDP ZeRO-3
(optim_grads_params), optim (--use-distributed-optimizer) and HSDP 2 x 2 (outer no_shard and
optim), where the routed experts are sharded and reduced over the expert-data-parallel group
(under HSDP: its ranks in one replica, then across the replicas) and the rest over every DP
rank.
Also the MoE log fields."""

from __future__ import annotations

import pytest

from megatron.core.distributed.expert_parallel import (
    expert_parallel_rank_lists,
    replica_expert_dp_rank_lists,
)
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.common import NO_DROPOUT, TINY_GPT, run_pretrain

STEPS = 20
TINY_MOE = [
    *TINY_GPT,
    *NO_DROPOUT,
    "--train-iters", str(STEPS),
    "--disable-bias-linear",
    "--num-experts", "4",
    "--moe-ffn-hidden-size", "32",
    "--moe-layer-freq", "([0]*1+[1]*1)",
    "--moe-shared-expert-intermediate-size", "48",
    "--moe-router-topk", "2",
    "--moe-aux-loss-coeff", "0.01",
    "--moe-z-loss-coeff", "0.001",
    "--moe-token-dispatcher-type", "alltoall",
]  # fmt: skip


def _losses_on_rank(rank: int, world_size: int, argv: list[str]) -> list[float]:
    result = run_pretrain(argv)
    return [result.losses[step] for step in range(1, STEPS + 1)]


@pytest.fixture(scope="module")
def single_process_losses() -> list[float]:
    losses = _losses_on_rank(0, 1, TINY_MOE)
    assert losses[-1] < losses[0] - 0.3  # it learns
    return losses


def test_hsdp_expert_data_parallel_groups_stay_in_one_replica():
    assert replica_expert_dp_rank_lists(4, 2, 2) == [[0], [1], [2], [3]]
    assert replica_expert_dp_rank_lists(8, 2, 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert replica_expert_dp_rank_lists(8, 2, 1) == expert_parallel_rank_lists(8, 2)[1]
    with pytest.raises(ValueError, match="must divide the ranks of one HSDP replica"):
        replica_expert_dp_rank_lists(4, 4, 2)


def test_rank_order_is_megatron_lms():
    ep, edp = expert_parallel_rank_lists(8, 2)
    assert ep == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert edp == [[0, 2, 4, 6], [1, 3, 5, 7]]
    ep, edp = expert_parallel_rank_lists(4, 4)
    assert ep == [[0, 1, 2, 3]] and edp == [[0], [1], [2], [3]]


ZERO3 = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
OPTIM = ["--use-distributed-optimizer"]
HSDP = [*ZERO3, "--num-distributed-optimizer-instances", "2"]
HSDP_OUTER_OPTIM = [*HSDP, "--outer-dp-sharding-strategy", "optim"]


@pytest.mark.parametrize(
    "world_size, ep_size, dispatcher, engine",
    [
        (2, 2, "alltoall", []),
        (4, 1, "alltoall", []),
        (4, 2, "alltoall", []),
        (4, 4, "allgather", []),
        (2, 2, "alltoall", ZERO3),
        (4, 1, "alltoall", ZERO3),
        (4, 2, "alltoall", ZERO3),
        (4, 4, "alltoall", ZERO3),
        (4, 2, "allgather", OPTIM),
        (4, 2, "alltoall", HSDP),
        (4, 2, "alltoall", HSDP_OUTER_OPTIM),
        (4, 1, "alltoall", HSDP),
    ],
    ids=lambda value: "-".join(value) if isinstance(value, list) else str(value),
)
def test_expert_parallel_equals_single_process(
    world_size, ep_size, dispatcher, engine, single_process_losses
):
    argv = [
        *TINY_MOE,
        *engine,
        "--expert-model-parallel-size", str(ep_size),
        "--moe-token-dispatcher-type", dispatcher,
    ]  # fmt: skip
    results = run_distributed(_losses_on_rank, world_size, argv)
    for rank_losses in results:
        assert rank_losses == pytest.approx(single_process_losses, rel=1e-5, abs=0)


def _line_fields(line: str) -> dict[str, str]:
    """A log line's fields by name, in their order."""
    return dict(part.strip().split(": ", 1) for part in line.split("|") if ": " in part)


def test_log_line_has_megatron_lm_moe_fields(capsys):
    argv = [*TINY_MOE, "--train-iters", "2", "--moe-expert-capacity-factor", "1.0"]
    run_pretrain(argv)
    lines = [line for line in capsys.readouterr().out.splitlines() if " iteration " in line]
    assert len(lines) == 2
    for line in lines:
        fields = _line_fields(line)
        assert 0.5 < float(fields["load_balancing_loss"]) < 2.0  # E sum f_i P_i: 1 if balanced
        assert 0.0 < float(fields["z_loss"]) < 100.0
        assert 0.0 <= float(fields["dropped_token_fraction"]) < 1.0
        # Megatron-LM's places: the MoE losses after lm loss, the rest before loss scale
        names = list(fields)
        start = names.index("lm loss")
        assert names[start : start + 5] == [
            "lm loss", "load_balancing_loss", "z_loss", "dropped_token_fraction", "loss scale"
        ]  # fmt: skip


def test_meta_device_build_with_expert_bias_aux_loss_and_mtp_equals_the_regular_build():
    """--init-model-with-meta-device under Megatron-FSDP with the DeepSeek-style router state
    (expert bias, sequence aux loss) and MTP: the routers' buffers are re-created on the
    device and the aux losses' backward scales live on the host (both were left on the meta
    device: 'Tensor on device meta is not on the expected device', then 'Cannot copy out of
    meta tensor'); the losses equal the regular build's bitwise."""
    argv = [
        *TINY_MOE,
        "--train-iters", "3",
        "--use-megatron-fsdp",
        "--data-parallel-sharding-strategy", "optim_grads_params",
        "--moe-router-score-function", "sigmoid",
        "--moe-router-enable-expert-bias",
        "--moe-router-load-balancing-type", "seq_aux_loss",
        "--mtp-num-layers", "1",
    ]  # fmt: skip
    regular = run_pretrain(argv).losses
    meta = run_pretrain([*argv, "--init-model-with-meta-device"]).losses
    assert sorted(meta) == [1, 2, 3] and meta == regular


def test_per_token_loss_back_propagates_the_aux_losses_as_the_mean_loss_does():
    """--calculate-per-token-loss with every token counted (mock data masks none) and 4
    micro-batches: the aux losses' gradient scale is 1 / micro-batches as without it, as
    Megatron-LM's router arranges (aux x num_local_tokens, every grad / global tokens); so
    both runs train alike. The scale was 4x too strong (loss scale alone) before."""
    argv = [*TINY_MOE, "--train-iters", "4", "--moe-aux-loss-coeff", "1.0"]
    mean = run_pretrain(argv)
    per_token = run_pretrain([*argv, "--calculate-per-token-loss"])
    assert sorted(mean.grad_norms) == [1, 2, 3, 4]
    assert per_token.grad_norms == pytest.approx(mean.grad_norms, rel=1e-5, abs=0)
    assert per_token.losses == pytest.approx(mean.losses, rel=1e-5, abs=0)


def test_per_layer_logging_sends_each_moe_layer_as_megatron_lm_names_it(tmp_path, capsys):
    """--moe-per-layer-logging: TensorBoard gets moe/<name>_layer_<i> (i 0-based) for the two
    MoE layers of a dense-MoE-MoE model, whose mean is the log line's value."""
    pytest.importorskip("tensorboard", reason="needs tensorboard (pip install tensorboard)")
    from tests.unit_tests.ecosystem.readers import read_tensorboard_scalars

    argv = [*TINY_MOE, "--train-iters", "2", "--log-interval", "2", "--num-layers", "3"]
    argv += ["--moe-layer-freq", "([0]*1+[1]*2)", "--tensorboard-dir", str(tmp_path / "tb")]
    run_pretrain([*argv, "--moe-per-layer-logging"])
    line = [ln for ln in capsys.readouterr().out.splitlines() if " iteration " in ln][-1]
    scalars = read_tensorboard_scalars(str(tmp_path / "tb"))
    per_layer = sorted(name for name in scalars if "_layer_" in name)
    assert per_layer == [
        f"moe/{n}_layer_{i}" for n in ("load_balancing_loss", "z_loss") for i in (1, 2)
    ]
    for name in ("load_balancing_loss", "z_loss"):
        values = [scalars[f"moe/{name}_layer_{i}"][0][1] for i in (1, 2)]
        assert values[0] != values[1]
        logged = float(line.split(f" {name}: ")[1].split(" |")[0])
        assert sum(values) / 2 == pytest.approx(logged, rel=1e-6)
    run_pretrain([*argv, "--tensorboard-dir", str(tmp_path / "tb2")])
    assert not [
        name for name in read_tensorboard_scalars(str(tmp_path / "tb2")) if "_layer_" in name
    ]


@pytest.mark.parametrize(
    "extra, expected",
    [
        # Megatron-LM's defaults (aux_loss, coefficient 0): load_balancing_loss shown as 0
        (["--moe-aux-loss-coeff", "0"], {"load_balancing_loss": 0.0}),
        # "aux_loss" is in "seq_aux_loss" for Megatron-LM's training_log: both are shown
        (
            ["--moe-router-load-balancing-type", "seq_aux_loss"],
            {"load_balancing_loss": 0.0, "seq_load_balancing_loss": None},
        ),
        (["--moe-router-load-balancing-type", "sinkhorn", "--moe-aux-loss-coeff", "0"], {}),
    ],
)
def test_log_line_shows_the_router_losses_megatron_lm_tracks(extra, expected, capsys):
    """training_log tracks its names by the balancing type and the z-loss coefficient, and
    prints a tracked name even where no layer recorded it (as 0)."""
    argv = [a for a in TINY_MOE if a not in ("--moe-z-loss-coeff", "0.001")]
    run_pretrain([*argv, "--train-iters", "1", *extra])
    line = [ln for ln in capsys.readouterr().out.splitlines() if " iteration " in ln][-1]
    fields = _line_fields(line)
    names = list(fields)
    start = names.index("lm loss") + 1
    assert names[start : start + len(expected) + 1] == [*expected, "loss scale"]
    for name, value in expected.items():
        if value is None:  # recorded: near 1 when balanced
            assert float(fields[name]) > 0.5
        else:
            assert float(fields[name]) == value
