"""Scalar metrics to TensorBoard and Weights & Biases, from one rank.

Both backends are optional packages, imported only when their flag is given. Metric names are
a public interface (docs/STYLE.md rule 8): `METRIC_NAMES` lists them (`METRIC_PREFIXES` the
families named by the model) and `log_scalars` rejects any other name, so a renamed metric fails
loudly instead of starting a new, empty curve.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from megatron.core.environment import get_env

METRIC_NAMES: tuple[str, ...] = (
    "lm loss",
    "learning-rate",
    "grad-norm",
    "iteration-time",
    "throughput/tflops-per-gpu",
    "throughput/tokens-per-sec-per-gpu",
    "mem-allocated-bytes",
    "mem-max-allocated-bytes",
    "batch-size",
    "skipped-iterations",
    "nan-iterations",
    "lm loss validation",
    "lm loss validation ppl",
    "samples vs steps",
)
# Series written only when a flag asks for them (Megatron-LM's names): --fp16's loss scale,
# --log-params-norm, --log-num-zeros-in-grad, --log-timers-to-tensorboard; MoE models' router
# losses and --moe-expert-capacity-factor's dropped tokens (moe_training.interval_moe_fields).
OPTIONAL_METRIC_NAMES: tuple[str, ...] = (
    "loss-scale",
    "params-norm",
    "num-zeros",
    "forward-backward-time",
    "optimizer-time",
    "load_balancing_loss",
    "seq_load_balancing_loss",
    "z_loss",
    "dropped_token_fraction",
)
# Families of series named by the model (--log-fp8-stats: fp8-stats/<linear>/<role>/<what>;
# MoE: moe/layer_<L>/expert_<E>_load; --moe-per-layer-logging: moe/<name>_layer_<i>).
METRIC_PREFIXES: tuple[str, ...] = ("fp8-stats/", "moe/")
# Series that TensorBoard also gets against consumed samples, as "<name> vs samples" (the
# names Megatron-LM gives them); W&B gets "samples vs steps" to plot them against instead.
VS_SAMPLES_NAMES: tuple[str, ...] = (
    "lm loss",
    "learning-rate",
    "grad-norm",
    "batch-size",
    "lm loss validation",
    "lm loss validation ppl",
)


def _import_summary_writer() -> Any:
    try:
        # torch.utils.tensorboard itself raises ImportError when the tensorboard package is absent.
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise ImportError(
            "--tensorboard-dir needs the tensorboard package: run `pip install tensorboard` "
            f"or drop --tensorboard-dir ({error})"
        ) from error
    return SummaryWriter


def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError as error:
        raise ImportError(
            "--wandb-project needs the wandb package: run `pip install wandb` "
            f"or drop --wandb-project ({error})"
        ) from error
    return wandb


def wandb_mode() -> str:
    """W&B mode: online when WANDB_API_KEY is set, else offline (sync later with `wandb sync`)."""
    return "online" if get_env("WANDB_API_KEY") else "offline"


def check_logger_settings(
    *,
    tensorboard_dir: str | None,
    wandb_project: str | None,
    wandb_exp_name: str | None,
    wandb_save_dir: str | None,
) -> None:
    """Fail with the fix when the logging flags cannot work: call it at parse time on every
    rank, so that a bad flag stops all ranks before training instead of only the logging one."""
    if tensorboard_dir and importlib.util.find_spec("tensorboard") is None:
        _import_summary_writer()  # raises the ImportError that names the pip install
    if not wandb_project:
        return
    if not wandb_exp_name:
        raise ValueError("--wandb-project is set but --wandb-exp-name is not; give the run a name")
    if not wandb_save_dir:
        raise ValueError(
            "--wandb-project is set but --wandb-save-dir is not; give a directory for the "
            "W&B run files (Megatron-LM uses <--save>/wandb)"
        )
    if importlib.util.find_spec("wandb") is None:
        _import_wandb()


class MetricsLogger:
    """Writes scalars to TensorBoard and/or W&B; a no-op unless `enabled`.

    The caller passes `enabled=True` on exactly one rank (Megatron-LM uses the last rank), so
    every other rank never imports either package.
    """

    def __init__(
        self,
        *,
        tensorboard_dir: str | None,
        wandb_project: str | None,
        wandb_exp_name: str | None,
        wandb_save_dir: str | None,
        run_config: dict,
        enabled: bool,
    ) -> None:
        self.enabled = enabled
        self._tensorboard_writer: Any = None
        self._wandb_run: Any = None
        self._last_wandb_step: int | None = None
        self._samples_step: int | None = None
        if not enabled:
            return
        check_logger_settings(
            tensorboard_dir=tensorboard_dir,
            wandb_project=wandb_project,
            wandb_exp_name=wandb_exp_name,
            wandb_save_dir=wandb_save_dir,
        )
        if tensorboard_dir:
            summary_writer_class = _import_summary_writer()
            os.makedirs(tensorboard_dir, exist_ok=True)
            self._tensorboard_writer = summary_writer_class(log_dir=tensorboard_dir)
        if wandb_project:
            self._wandb_run = self._init_wandb(
                project=wandb_project,
                exp_name=wandb_exp_name,
                save_dir=wandb_save_dir,
                run_config=run_config,
            )

    @staticmethod
    def _init_wandb(
        *, project: str, exp_name: str | None, save_dir: str | None, run_config: dict
    ) -> Any:
        wandb = _import_wandb()
        os.makedirs(save_dir, exist_ok=True)
        return wandb.init(
            project=project, name=exp_name, dir=save_dir, config=run_config, mode=wandb_mode()
        )

    def log_scalars(
        self, step: int, scalars: dict[str, float], *, samples: int | None = None
    ) -> None:
        """Record every (name, value) of `scalars` at iteration `step`.

        `samples` (consumed training samples at `step`), when given, adds "samples vs steps"
        at `step` and, in TensorBoard, "<name> vs samples" at x = samples for the names in
        VS_SAMPLES_NAMES. Steps must not decrease: W&B silently drops points logged at an
        earlier step, so this raises instead. Logging several dicts at the same step (train,
        then validation) is fine.
        """
        if not self.enabled:
            return
        known = set(METRIC_NAMES) | set(OPTIONAL_METRIC_NAMES)
        unknown = sorted(n for n in scalars if n not in known and not n.startswith(METRIC_PREFIXES))
        if unknown:
            raise ValueError(
                f"unknown metric name(s) {unknown}; metric names are a public interface: use one "
                f"of {list(METRIC_NAMES)} or add the new name to METRIC_NAMES with a test update"
            )
        if self._last_wandb_step is not None and step < self._last_wandb_step:
            raise ValueError(
                f"log_scalars step {step} is before the last logged step {self._last_wandb_step}; "
                "log iterations in increasing order"
            )
        self._last_wandb_step = step
        values = {name: float(value) for name, value in scalars.items()}
        if samples is not None and step != self._samples_step:
            values["samples vs steps"] = float(samples)  # once per step (train, then eval)
            self._samples_step = step
        if self._tensorboard_writer is not None:
            for name, value in values.items():
                self._tensorboard_writer.add_scalar(name, value, global_step=step)
                if samples is not None and name in VS_SAMPLES_NAMES:
                    self._tensorboard_writer.add_scalar(
                        f"{name} vs samples", value, global_step=samples
                    )
        if self._wandb_run is not None:
            self._wandb_run.log(values, step=step)

    def close(self) -> None:
        """Flush and close both backends; safe to call twice."""
        if self._tensorboard_writer is not None:
            self._tensorboard_writer.close()
            self._tensorboard_writer = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
