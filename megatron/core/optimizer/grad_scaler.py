"""Loss scaling for fp16 training (Megatron-LM's ConstantGradScaler and DynamicGradScaler).

fp16 grads underflow below 6e-8, so the loss is multiplied by `scale` before backward and the
optimizer divides the grads by it again. The dynamic scaler starts high, halves after
`hysteresis` overflowing steps (whose updates are skipped) and doubles after `growth_interval`
clean steps in a row.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GradScaler:
    """A constant scale (dynamic=False) or Megatron-LM's dynamic one."""

    scale: float
    dynamic: bool = True
    min_scale: float = 1.0
    growth_interval: int = 1000
    hysteresis: int = 2
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_tracker: int = 0
    hysteresis_tracker: int = 2

    def __post_init__(self) -> None:
        self.hysteresis_tracker = self.hysteresis

    def update(self, *, found_inf: bool) -> None:
        """After a step: back off on overflow (after hysteresis), grow after a clean window."""
        if not self.dynamic:
            return
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis
            self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "growth_tracker": self.growth_tracker,
            "hysteresis_tracker": self.hysteresis_tracker,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])
