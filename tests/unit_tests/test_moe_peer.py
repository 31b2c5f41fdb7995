"""benchmarks/moe_peer.py: the torchao row's expert rows padded to 16 (torch's FP8 2d x 2d
weight-gradient GEMM asserts on groups that are not 16 bytes) with the same layer output, and
gradient accumulation over micro-batches (--global-batch-size) equal to one batch."""

from __future__ import annotations

import importlib.util
import pathlib

import torch

REPO = pathlib.Path(__file__).resolve().parents[2]


def _peer():
    spec = importlib.util.spec_from_file_location("moe_peer", REPO / "benchmarks" / "moe_peer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_aligned_groups_pad_each_expert_to_16_rows_with_zeros():
    peer = _peer()
    counts = torch.tensor([3, 0, 17, 16, 1])
    experts = torch.repeat_interleave(torch.arange(5), counts)
    tokens = torch.randn(int(counts.sum()), 4)
    laid_out, offsets, dest = peer.aligned_groups(tokens, experts, counts, 16)
    assert offsets.tolist() == [16, 16, 48, 64, 80] and offsets.dtype == torch.int32
    assert laid_out.shape == (112, 4)  # 37 + 5 x 15 = 112 rows, a multiple of 16
    torch.testing.assert_close(laid_out[dest], tokens, rtol=0, atol=0)
    starts = [0, 16, 16, 48, 64]
    assert dest.tolist() == [s + i for s, c in zip(starts, counts.tolist()) for i in range(c)]
    pad = torch.ones(laid_out.shape[0], dtype=torch.bool)
    pad[dest] = False
    assert pad.sum() == laid_out.shape[0] - 37 and laid_out[pad].abs().sum() == 0


def test_moe_layer_output_and_gradients_do_not_depend_on_the_alignment():
    peer = _peer()
    torch.manual_seed(0)
    layer = peer.MoE(hidden=8, experts=4, topk=2, ffn=6)
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.3)
    x = torch.randn(2, 5, 8)
    results = []
    for align in (1, 16):
        layer.align = align
        layer.zero_grad()
        out = layer(x)
        out.square().sum().backward()
        results.append((out, layer.experts.fc1.grad.clone(), layer.experts.fc2.grad.clone()))
    for plain, aligned in zip(*results):
        torch.testing.assert_close(aligned, plain, rtol=1e-6, atol=1e-6)


def test_accumulated_micro_batches_give_the_gradients_of_one_batch():
    """--global-batch-size 4 --micro-batch-size 2: two backward passes of half the mean loss
    each equal one backward of the batch of 4 (tokens are routed one by one, so a batch's
    split does not change any token's experts)."""
    peer = _peer()
    args = peer.parse_args(["--tiny", "--global-batch-size", "4", "--micro-batch-size", "2"])
    torch.manual_seed(0)
    model = peer.MoEGPT(args)
    peer.init_weights(model, std=0.2)
    tokens = torch.randint(0, args.vocab_size, (4, args.seq_length + 1))
    grads = []
    for batches in ([(tokens[:, :-1], tokens[:, 1:])],
                    [(t[:, :-1], t[:, 1:]) for t in tokens.split(2)]):  # fmt: skip
        model.zero_grad()
        peer.accumulate(model, batches)
        grads.append([p.grad.clone() for p in model.parameters()])
    assert len(grads[0]) == len(list(model.parameters()))
    for whole, accumulated in zip(*grads):
        torch.testing.assert_close(accumulated, whole, rtol=1e-5, atol=1e-7)
    assert any(g.abs().sum() > 0 for g in grads[1])
