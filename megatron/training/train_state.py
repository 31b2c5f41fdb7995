"""The counters of a run that a checkpoint restores besides weights and optimizer state."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainState:
    """What a checkpoint restores besides weights and optimizer state."""

    iteration: int = 0
    """Optimizer steps completed (skipped ones included)."""
    consumed_train_samples: int = 0
    """Global samples the run has trained on; the next step starts at this sample."""
    skipped_iterations: int = 0
    """Steps whose update was skipped (a NaN/Inf grad, or an fp16 overflow)."""
    nan_iterations: int = 0
    """Skipped steps whose loss was NaN/Inf (Megatron-LM's count)."""
