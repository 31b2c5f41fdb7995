"""megatron-core's blending order: which dataset serves each draw of a weighted blend.

Draw n goes to the dataset furthest behind its share, argmax_d(w_d * max(n, 1) - served_d), ties
to the lower dataset id (megatron-core's helpers.cpp build_blending_indices). The rule is
sequential, and the order must equal megatron-core's bit for bit, so every choice is made with
the same IEEE double operations (a product, then a difference; no fused multiply-add):

- any number of datasets: a Python loop, about 1 s per million draws;
- two datasets (the common blend): a guess that is almost always right (each dataset's k-th
  draw in the order of k / w_d), checked against the rule for a whole chunk at once with numpy
  and corrected at the first wrong draw; a chunk that needs many corrections falls back to the
  loop. Both give the same arrays (tests/unit_tests/data/test_blending_and_mock.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Draws per vectorized chunk (memory: a few arrays of this length) and corrections per chunk
# before the chunk falls back to the loop.
CHUNK_DRAWS = 1 << 20
MAX_CORRECTIONS = 16


def build_blending_indices(
    weights: Sequence[float], *, size: int, chunk_draws: int = CHUNK_DRAWS
) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16, dataset_sample_index int64) of `size` draws; weights normalized.
    The result does not depend on `chunk_draws`, only the memory does."""
    weight_list = [float(weight) for weight in weights]
    if not np.isclose(sum(weight_list), 1.0):
        raise ValueError(f"blending weights must be normalized (sum 1), got {weight_list}")
    dataset_index = np.zeros(size, dtype=np.int16)
    served = np.zeros(len(weight_list), dtype=np.int64)
    for start in range(0, size, chunk_draws):
        stop = min(size, start + chunk_draws)
        choices = None
        if len(weight_list) == 2:
            choices = _checked_guess(np.asarray(weight_list), served, start=start, stop=stop)
        if choices is None:
            choices = _greedy_loop(weight_list, served.tolist(), start=start, stop=stop)
        dataset_index[start:stop] = choices
        served += np.bincount(choices, minlength=len(weight_list))
    return dataset_index, _sample_indices(dataset_index, len(weight_list))


def _sample_indices(dataset_index: np.ndarray, num_datasets: int) -> np.ndarray:
    """Each draw's sample in its dataset: 0, 1, 2, ... per dataset, in draw order."""
    sample_index = np.zeros(dataset_index.size, dtype=np.int64)
    for dataset_id in range(num_datasets):
        drawn = np.flatnonzero(dataset_index == dataset_id)
        sample_index[drawn] = np.arange(drawn.size, dtype=np.int64)
    return sample_index


def _greedy_loop(weights: list[float], served: list[int], *, start: int, stop: int) -> np.ndarray:
    choices = np.zeros(stop - start, dtype=np.int64)
    for draw in range(start, stop):
        draw_time = float(max(draw, 1))
        chosen, largest_error = 0, weights[0] * draw_time - served[0]
        for dataset_id in range(1, len(weights)):
            error = weights[dataset_id] * draw_time - served[dataset_id]
            if error > largest_error:
                chosen, largest_error = dataset_id, error
        choices[draw - start] = chosen
        served[chosen] += 1
    return choices


def _guess(weights: np.ndarray, served: np.ndarray, count: int) -> np.ndarray:
    """The next `count` choices if dataset d's k-th draw came at k / w_d (ties: lower id)."""
    ids, keys = [], []
    for dataset_id, weight in enumerate(weights):
        picks = served[dataset_id] + np.arange(int(np.ceil(weight * count)) + 2, dtype=np.int64)
        ids.append(np.full(picks.size, dataset_id, dtype=np.int64))
        keys.append(picks / weight)
    ids_all = np.concatenate(ids)
    order = np.lexsort((ids_all, np.concatenate(keys)))[:count]
    return ids_all[order]


def _first_wrong_choice(
    weights: np.ndarray, served: np.ndarray, choices: np.ndarray, *, first_draw: int
) -> tuple[int, int] | None:
    """(offset, right choice) of the first draw the rule decides otherwise, or None."""
    picked = np.zeros((choices.size, weights.size), dtype=np.int64)
    picked[np.arange(choices.size), choices] = 1
    served_before = served[None, :] + np.cumsum(picked, axis=0) - picked
    draw_time = np.maximum(np.arange(first_draw, first_draw + choices.size), 1).astype(np.float64)
    errors = weights[None, :] * draw_time[:, None] - served_before
    rule = np.argmax(errors, axis=1)  # first maximum: ties to the lower id, as megatron-core
    wrong = np.flatnonzero(rule != choices)
    return None if wrong.size == 0 else (int(wrong[0]), int(rule[wrong[0]]))


def _checked_guess(
    weights: np.ndarray, served: np.ndarray, *, start: int, stop: int
) -> np.ndarray | None:
    choices = _guess(weights, served, stop - start)
    checked = 0  # choices[:checked] follow the rule
    for _ in range(MAX_CORRECTIONS + 1):
        served_so_far = served + np.bincount(choices[:checked], minlength=weights.size)
        wrong = _first_wrong_choice(
            weights, served_so_far, choices[checked:], first_draw=start + checked
        )
        if wrong is None:
            return choices
        offset, right = wrong
        position = checked + offset
        choices[position] = right
        served_so_far = served + np.bincount(choices[: position + 1], minlength=weights.size)
        choices[position + 1 :] = _guess(weights, served_so_far, choices.size - position - 1)
        checked = position + 1
    return None
