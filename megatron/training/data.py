"""Datasets from the flags, and the deterministic global-sample order every rank slices.

Sample order is a function of the global sample index only: iteration k's global batch is
samples [k * global_batch, (k + 1) * global_batch). Each micro-batch step takes
micro_batch x dp consecutive samples and rank r takes its r-th slice of micro_batch samples, as
Megatron's pretraining sampler does. So the set of samples in a step never depends on the
data-parallel size, and a resumed run continues with exactly the samples it would have seen.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset


@dataclass(frozen=True)
class Datasets:
    train: Dataset
    valid: Dataset | None
    test: Dataset | None


def build_tokenizer_from_args(args: argparse.Namespace):
    from megatron.core.tokenizer import build_tokenizer

    return build_tokenizer(
        tokenizer_type=args.tokenizer_type,
        vocab_size=args.vocab_size,
        tokenizer_model=args.tokenizer_model,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        tiktoken_pattern=args.tiktoken_pattern,
        tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
        tiktoken_special_tokens=args.tiktoken_special_tokens,
    )


def requested_num_samples(args: argparse.Namespace) -> tuple[int, int, int]:
    """(train, valid, test) samples asked of the datasets, as Megatron-LM counts them.

    The sample order depends on these counts (megatron-core shuffles all the epochs a count
    needs), so they follow Megatron-LM for a run to see the samples a Megatron-LM run sees:
    valid is sized for every evaluation of the run, test for one.
    """
    train = args.train_samples or args.train_iters * args.global_batch_size
    evaluations = args.train_iters // args.eval_interval + 1
    valid = evaluations * args.eval_iters * args.global_batch_size
    return train, valid, args.eval_iters * args.global_batch_size


def build_datasets_from_args(args: argparse.Namespace, *, tokenizer) -> Datasets:
    """Build (and validate) train/valid/test before any model exists."""
    from megatron.core.datasets import GPTDatasetConfig, build_gpt_datasets

    config = GPTDatasetConfig(
        seq_length=args.seq_length,
        seed=args.seed,
        data_path=None if args.mock_data else list(args.data_path),
        split=args.split,
        mock=args.mock_data,
        vocab_size=tokenizer.vocab_size,
        eod_id=tokenizer.eod,
        path_to_cache=args.data_cache_path,
        reset_position_ids=args.reset_position_ids,
        eod_mask_loss=args.eod_mask_loss,
    )
    train, valid, test = build_gpt_datasets(config, num_samples=requested_num_samples(args))
    if train is None:
        raise SystemExit(
            f"--split {args.split} leaves no training documents; give the first share a "
            "positive weight."
        )
    return Datasets(train=train, valid=valid, test=test)


def get_micro_batch(
    dataset: Dataset,
    *,
    first_sample: int,
    micro_batch_size: int,
    rank: int,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """This rank's micro-batch of a micro-batch step that starts at global sample first_sample."""
    start = first_sample + rank * micro_batch_size
    items = [dataset[index] for index in range(start, start + micro_batch_size)]
    return {
        key: torch.stack([torch.as_tensor(item[key]) for item in items]).to(device)
        for key in ("tokens", "labels", "loss_mask", "position_ids")
    }
