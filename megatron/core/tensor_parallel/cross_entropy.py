"""Cross-entropy over logits whose vocabulary is split across the tensor-parallel group.

Each rank holds logits [..., V/tp] for vocabulary rows [r V/tp, (r+1) V/tp). The loss is
log(sum_v exp(z_v - m)) - (z_target - m) with m the maximum over the whole vocabulary: three
all-reduces of [...]-sized tensors (max, target logit, sum of exponentials), never the full
logits. The gradient is softmax - one_hot(target), each rank its own columns.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.mappings import count_collective


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group):
        logits = logits.float()
        local_vocab = logits.shape[-1]
        start = dist.get_rank(group) * local_vocab
        logits_max = logits.max(dim=-1).values
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        count_collective("all_reduce", logits_max)
        shifted = logits - logits_max.unsqueeze(-1)
        outside = (target < start) | (target >= start + local_vocab)
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(outside, 0.0)
        dist.all_reduce(target_logit, group=group)
        count_collective("all_reduce", target_logit)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        count_collective("all_reduce", sum_exp)
        loss = sum_exp.log() - target_logit
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax.clone()
        hit = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1))
        return grad * grad_loss.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, group: dist.ProcessGroup
) -> torch.Tensor:
    """Per-token loss [...] in fp32 from this rank's vocabulary slice of logits [..., V/tp]
    and the global target ids [...]; equals F.cross_entropy(full logits, target,
    reduction="none") up to the order of the sums."""
    return _VocabParallelCrossEntropy.apply(logits, target, group)
