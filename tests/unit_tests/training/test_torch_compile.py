"""`pretrain_gpt.py --torch-compile` on CPU: each transformer layer's forward is compiled
(regional compile, one graph shared by identical layers) and the losses equal eager training's,
within 1e-5 for fp32 and 1e-3 for FP8 parameters under Megatron-FSDP (Inductor fuses the bf16
elementwise code around the FP8 ops, which rounds a few intermediates differently)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from megatron.core.fp8 import compile as fp8_compile
from tests.unit_tests.training.common import (
    NO_DROPOUT,
    TINY_GPT,
    eager_and_compiled,
    eager_and_compiled_on_rank,
    run_pretrain,
)

STEPS = 8
FSDP_FP8 = ["--bf16", "--use-megatron-fsdp", "--fp8-format", "hybrid", "--fp8-param-gather"]
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
RECOMPUTE += ["--recompute-num-layers", "1"]
SELECTIVE_MLP = ["--recompute-activations", "--recompute-modules", "core_attn", "mlp"]


def _losses(argv: list[str]) -> list[float]:
    result = run_pretrain([*TINY_GPT, *NO_DROPOUT, "--train-iters", str(STEPS), *argv])
    return [result.losses[step] for step in range(1, STEPS + 1)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, tolerance",
    [
        ([], 1e-5),
        ([*FSDP_FP8, "--fp8-recipe", "tensorwise"], 1e-3),
        ([*FSDP_FP8, "--fp8-recipe", "blockwise"], 1e-3),
        ([*FSDP_FP8, "--fp8-recipe", "delayed"], 1e-3),
        (["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "delayed"], 1e-3),
        # Activation recompute: the recomputed forward is a second graph (the hooks tell it
        # that it is a recompute), still without a break.
        ([*FSDP_FP8, "--fp8-recipe", "delayed", *RECOMPUTE], 1e-3),
        ([*FSDP_FP8, "--fp8-recipe", "tensorwise", *SELECTIVE_MLP], 1e-3),
        # Compiled by default on CUDA, so every engine compiles: FSDP2, FP8 under DDP.
        (["--bf16", "--use-torch-fsdp2"], 1e-3),
        (["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"], 1e-3),
    ],
    ids=[
        "fp32",
        "fp8-tensorwise-fsdp",
        "fp8-blockwise-fsdp",
        "fp8-delayed-fsdp",
        "fp8-delayed",
        "fp8-delayed-fsdp-recompute",
        "fp8-tensorwise-fsdp-selective-mlp",
        "fsdp2-bf16",
        "fp8-tensorwise-ddp",
    ],
)
def test_compiled_training_matches_eager(flags: list[str], tolerance: float, monkeypatch):
    eager = _losses(flags)
    torch._dynamo.reset()
    counters.clear()
    lookups = []
    find_weight = fp8_compile.stand_in_weight
    monkeypatch.setattr(
        fp8_compile, "stand_in_weight", lambda stand_in: lookups.append(1) or find_weight(stand_in)
    )
    try:
        compiled = _losses([*flags, "--torch-compile"])
        # The layers really went through dynamo: frames were compiled, and the two identical
        # layers did not each compile their own graph for every call.
        assert counters["stats"]["unique_graphs"] >= 1
        assert counters["stats"]["calls_captured"] >= 1
        # and each layer is one graph: no graph break, delayed scaling's included.
        assert not counters["graph_break"], dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()
    if "--fp8-param-gather" in flags:
        # FP8 parameters ran inside the compiled graph through their stand-ins: in each of
        # the 4 micro-batches of a step (global batch 8, micro-batch 2), 4 Linears x 2 layers
        # read their weight in fprop and in dgrad and hand over one wgrad; full recompute's
        # layers read all 4 again in the recomputed fprop (a graph of its own), a selectively
        # recomputed MLP only fc1 (the partitioner drops the recomputed fc2, whose output no
        # backward reads).
        recomputed = 4 if "--recompute-granularity" in flags else ("mlp" in flags)
        assert len(lookups) == STEPS * 4 * 2 * (4 * 3 + recomputed), len(lookups)
    else:
        assert not lookups
    relative = [abs(c - e) / abs(e) for c, e in zip(compiled, eager)]
    assert max(relative) <= tolerance, list(zip(eager, compiled))
    assert len(compiled) == STEPS and all(loss == loss for loss in compiled)  # no NaN


@pytest.mark.slow
def test_compiled_delayed_scaling_runs_a_recomputed_mlp_eager() -> None:
    """Delayed scaling's amax records are side effects a compiled checkpoint cannot hold: a
    selectively recomputed MLP breaks the graph at its checkpoint (one break per layer) and
    runs eager, as the run's log note says; the losses equal eager training's."""
    flags = [*FSDP_FP8, "--fp8-recipe", "delayed", *SELECTIVE_MLP]
    eager = _losses(flags)
    torch._dynamo.reset()
    counters.clear()
    try:
        compiled = _losses([*flags, "--torch-compile"])
        kinds = {reason.split("\n")[0]: n for reason, n in counters["graph_break"].items()}
    finally:
        torch._dynamo.reset()
    assert kinds == {"HOP: Unsafe side effect": 2}, kinds
    relative = [abs(c - e) / abs(e) for c, e in zip(compiled, eager)]
    assert len(compiled) == STEPS and max(relative) <= 1e-3, list(zip(eager, compiled))


# --- GPU: the compiled FP8 training step against eager, every recipe ---------------------------

GPU_GPT = [
    *TINY_GPT,
    *NO_DROPOUT,
    "--hidden-size",
    "256",
    "--ffn-hidden-size",
    "512",
    "--seq-length",
    "128",
    "--max-position-embeddings",
    "128",
    "--vocab-size",
    "1024",
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--disable-bias-linear",
    "--position-embedding-type",
    "rope",
    "--train-iters",
    str(STEPS),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "blockwise", "mxfp8"])
def test_compiled_fp8_params_training_matches_eager_on_gpu(recipe: str):
    """The grad norm of every step and the losses of compiled training with FP8 parameters
    follow eager training's: a compiled backward that lost the FP8 weights' grads (their wgrad
    GEMMs) shows as a much smaller grad norm and a loss that stops falling."""
    flags = [*GPU_GPT, *FSDP_FP8, "--fp8-recipe", recipe]
    eager = run_pretrain(flags)
    torch._dynamo.reset()
    counters.clear()
    try:
        compiled = run_pretrain([*flags, "--torch-compile"])
        # Each layer compiled as one graph, FP8 parameters and delayed scaling included.
        assert not counters["graph_break"], dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()
    for step in range(1, STEPS + 1):
        norm_eager, norm_compiled = eager.grad_norms[step], compiled.grad_norms[step]
        assert abs(norm_compiled - norm_eager) <= 0.05 * norm_eager, (
            step,
            norm_eager,
            norm_compiled,
        )
        loss_eager, loss_compiled = eager.losses[step], compiled.losses[step]
        assert abs(loss_compiled - loss_eager) <= 1e-2 * loss_eager, (
            step,
            loss_eager,
            loss_compiled,
        )
    assert eager.losses[STEPS] < eager.losses[1] - 0.05  # the run learns at all


# --- MoE: FP8 expert parameters through the grouped function, compiled -------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe, engine",
    [
        ("tensorwise", FSDP_FP8),
        ("blockwise", FSDP_FP8),
        ("blockwise", ["--bf16", "--fp8-format", "hybrid"]),
    ],
    ids=["tensorwise-fp8-params", "blockwise-fp8-params", "blockwise-ddp"],
)
def test_compiled_moe_with_fp8_experts_is_one_graph_per_layer(recipe: str, engine) -> None:
    """The tiny MoE GPT (a dense first layer, an MoE layer) with FP8 experts, FP8 parameters
    under Megatron-FSDP (read through the stand-in op) or high-precision weights, trains
    compiled within FP8's 1e-3 of eager with no graph break: the grouped FP8 function takes
    the token counts on the device (the dispatcher's, at EP 1), so each layer is one graph,
    and the loss a third. Before (counts read on the host with .tolist()): 10 graphs, 4
    breaks."""
    from tests.unit_tests.training.test_fp8_resume_layouts import MOE_GPT

    argv = [*MOE_GPT, *engine, "--fp8-recipe", recipe, "--moe-grouped-gemm"]
    argv += ["--train-iters", "3"]
    run = eager_and_compiled(argv)
    eager, compiled, breaks = run["eager"], run["compiled"], run["breaks"]
    assert breaks == {} and run["graphs"] == 3, (run["graphs"], breaks)  # 2 layers, the loss
    assert sorted(compiled) == sorted(eager) == [1, 2, 3]
    for step, loss in eager.items():
        assert abs(compiled[step] - loss) <= 1e-3 * abs(loss), (step, loss, compiled[step], breaks)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_compiled_moe_with_fp8_expert_params_is_one_graph_per_layer_on_gpu(recipe: str) -> None:
    """The CPU test above on CUDA: the grouped FP8 GEMMs are torch._scaled_grouped_mm and the
    Triton kernels with schedules built from the token counts on the GPU; no graph break (a
    graph per layer and the loss's), and the losses follow eager training's (within 1e-2:
    bf16 activations, fast accumulation)."""
    from tests.unit_tests.training.test_fp8_resume_layouts import MOE_GPT

    argv = [*MOE_GPT, *FSDP_FP8, "--fp8-recipe", recipe, "--moe-grouped-gemm", "--train-iters", "4"]
    run = eager_and_compiled(argv)
    assert run["breaks"] == {} and run["graphs"] == 3, (run["graphs"], run["breaks"])
    assert sorted(run["compiled"]) == sorted(run["eager"]) == [1, 2, 3, 4]
    for step, loss in run["eager"].items():
        assert abs(run["compiled"][step] - loss) <= 1e-2 * abs(loss), (step, loss, run)


def _moe_log_fields(capsys, argv: list[str]) -> tuple[dict, list[dict]]:
    """Losses and each iteration's log fields of one run."""
    capsys.readouterr()
    losses = run_pretrain(argv).losses
    lines = [line for line in capsys.readouterr().out.splitlines() if " iteration " in line]
    fields = [
        dict(part.strip().split(": ", 1) for part in line.split("|") if ": " in part.strip())
        for line in lines
    ]
    return losses, fields


@pytest.mark.slow
@pytest.mark.parametrize(
    "recompute",
    [[], RECOMPUTE, ["--recompute-activations", "--recompute-modules", "moe", "shared_experts"]],
    ids=["no-recompute", "full-recompute", "selective-moe"],
)
def test_compiled_moe_layer_breaks_only_for_host_token_counts(capsys, recompute) -> None:
    """The tiny MoE GPT in fp32 with every router record (aux loss, z-loss, expert bias),
    compiled: the losses and the logged router losses equal eager training's within 1e-5, and
    the only graph breaks are the token counts the experts read on the host (.tolist()). The
    router asks whether a forward is a recompute in the layer's eager pre-hook and counts its
    records in the post-hook (a question in the graph was a break, and skipping the counting
    in a recompute traced another graph than the checkpointed forward's); dropless top-k
    finds the routed rows at a static count (nonzero and a boolean mask were breaks)."""
    from tests.unit_tests.training.test_moe_training import TINY_MOE

    argv = [*TINY_MOE, "--train-iters", "3", "--moe-grouped-gemm"]
    argv += ["--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid"]
    argv += recompute
    eager, eager_fields = _moe_log_fields(capsys, argv)
    torch._dynamo.reset()
    counters.clear()
    try:
        compiled, compiled_fields = _moe_log_fields(capsys, [*argv, "--torch-compile"])
        breaks = dict(counters["graph_break"])
        graphs = counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    assert sorted(compiled) == sorted(eager) == [1, 2, 3]
    for step, loss in eager.items():
        assert abs(compiled[step] - loss) <= 1e-5 * abs(loss), (step, loss, compiled[step])
    assert len(eager_fields) == len(compiled_fields) == 3
    for ours, theirs in zip(compiled_fields, eager_fields):
        for name in ("load_balancing_loss", "z_loss"):
            assert float(ours[name]) == pytest.approx(float(theirs[name]), rel=1e-5), name
    # A recomputed MoE layer breaks the graph at its checkpoint and runs eager, untraced (the
    # router's records are side effects; flags/recompute.py's log note says so).
    kinds = {reason.split("\n")[0] for reason in breaks}
    eager_moe = "moe" in recompute
    assert kinds == {"HOP: Unsafe side effect" if eager_moe else "Data dependent operator"}, breaks
    # Before: 29 graphs (router 8 breaks, nonzero 4, the boolean mask and .tolist() 4).
    assert graphs <= 12, (graphs, breaks)


@pytest.mark.slow
def test_compiled_moe_at_expert_parallel_2_matches_eager() -> None:
    """Expert parallelism under --torch-compile (the CUDA default), 2 gloo ranks, EP 2, fp32:
    the all-to-all dispatch compiles around the host split sizes (the only breaks), and the
    losses equal eager training's within 1e-5 on each rank."""
    from tests.unit_tests.dist_utils import run_distributed
    from tests.unit_tests.training.test_moe_training import TINY_MOE

    argv = [*TINY_MOE, "--train-iters", "3", "--moe-grouped-gemm"]
    argv += ["--expert-model-parallel-size", "2"]
    for rank, result in enumerate(run_distributed(eager_and_compiled_on_rank, 2, argv)):
        eager, compiled = result["eager"], result["compiled"]
        assert sorted(eager) == sorted(compiled) == [1, 2, 3], rank
        for step, loss in eager.items():
            assert abs(compiled[step] - loss) <= 1e-5 * abs(loss), (rank, step, result)
        breaks = result["breaks"]
        assert breaks and all("Data dependent operator" in k for k in breaks), (rank, breaks)


@pytest.mark.slow
def test_compiled_mtp_layer_matches_eager(monkeypatch) -> None:
    """The multi-token prediction depth's transformer layer is compiled like the decoder's
    (it ran eagerly before: an eager FP8 MoE layer every step of the DeepSeek model M): the
    tiny MoE GPT with MTP 1 and FP8 expert parameters trains compiled within FP8's 1e-3 of
    eager with no graph break, and torch.compile got the 2 decoder layers, the MTP's and the
    per-token cross-entropy (the main loss's and the MTP loss's)."""
    from megatron.training import model_setup
    from tests.unit_tests.training.test_fp8_resume_layouts import MOE_GPT

    compiled_layers, compile_ = [], torch.compile

    def recording_compile(fn=None, *args, **kwargs):
        # Only what compile_layers hands over: layers' bound forwards and the loss function.
        owner = getattr(fn, "__self__", None)
        if isinstance(owner, torch.nn.Module) or getattr(fn, "__name__", "").endswith("entropy"):
            compiled_layers.append(type(owner).__name__ if owner is not None else fn.__name__)
        return compile_(fn, *args, **kwargs)

    monkeypatch.setattr(model_setup.torch, "compile", recording_compile)
    argv = [*MOE_GPT, *FSDP_FP8, "--fp8-recipe", "tensorwise", "--moe-grouped-gemm"]
    argv += ["--mtp-num-layers", "1", "--train-iters", "3"]
    run = eager_and_compiled(argv)
    assert compiled_layers == ["TransformerLayer"] * 3 + ["per_token_cross_entropy"]
    assert run["breaks"] == {}, run["breaks"]
    assert sorted(run["compiled"]) == sorted(run["eager"]) == [1, 2, 3]
    for step, loss in run["eager"].items():
        assert abs(run["compiled"][step] - loss) <= 1e-3 * abs(loss), (step, loss, run)


@pytest.mark.slow
def test_compiled_per_token_cross_entropy_equals_eager() -> None:
    """The per-token loss --torch-compile compiles (bf16 logits upcast inside): values and the
    logits' gradient equal eager's within fp32 reduction order (and the gradient's bf16
    rounding), masked tokens included."""
    from megatron.core.models.gpt.gpt_model import per_token_cross_entropy

    generator = torch.Generator().manual_seed(7)
    logits = (4 * torch.randn(2, 16, 384, generator=generator)).to(torch.bfloat16)
    labels = torch.randint(0, 384, (2, 16), generator=generator)
    mask = (torch.arange(16) % 3 != 0).float().expand(2, 16)
    results = []
    for function in (per_token_cross_entropy, torch.compile(per_token_cross_entropy)):
        leaf = logits.clone().requires_grad_()
        loss = function(leaf, labels)
        (loss * mask).sum().backward()
        results.append((loss.detach(), leaf.grad))
    torch._dynamo.reset()
    (eager, eager_grad), (compiled, compiled_grad) = results
    assert eager.dtype == compiled.dtype == torch.float32 and eager.shape == (2, 16)
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
    assert compiled_grad.dtype == torch.bfloat16
    torch.testing.assert_close(compiled_grad.float(), eager_grad.float(), rtol=8e-3, atol=1e-6)
    assert eager_grad[:, ::3].abs().max() == 0  # masked tokens get no gradient
