"""Functional test cases: one directory per case under test_cases/gpt/, holding

    model_config.yaml          ENV_VARS, MODEL_ARGS, NPROC, optional RESUME, TOLERANCE,
                               GRAD_NORM_TOLERANCE, PLATFORM
    golden_values_<platform>.json

`load_case` reads and checks a case; `current_platform` names the machine the suite runs on, so
each platform keeps its own golden values (numbers differ between a CPU and an H200).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

CASES_ROOT = Path(__file__).resolve().parent / "test_cases" / "gpt"
PLATFORMS = ("cpu", "h200")
PLATFORM_ENV = "MEGATRON_FUNCTIONAL_PLATFORM"
DEFAULT_TOLERANCE = 0.05
# Iteration-time band (a factor either way) by platform: CPU CI shares 2 cores with other jobs,
# which alone slows a step 3x; a GPU owns its device.
DEFAULT_TIME_FACTOR = {"cpu": 10.0, "h200": 3.0}
CONFIG_KEYS = frozenset(
    {
        "ENV_VARS",
        "MODEL_ARGS",
        "NPROC",
        "RESUME",
        "TOLERANCE",
        "GRAD_NORM_TOLERANCE",
        "TIME_FACTOR",
        "PLATFORM",
        "DETERMINISTIC",
    }
)
# Flags the runner owns: a case that set them would fight the stop-and-resume launches.
RUNNER_FLAGS = frozenset({"save", "load", "exit-interval"})


class CaseError(ValueError):
    """A model_config.yaml that the runner cannot use."""


@dataclass(frozen=True, kw_only=True)
class Resume:
    """Stop after `stop_at` iterations (saving a checkpoint), then resume on `nproc_after` ranks."""

    stop_at: int
    nproc_after: int


@dataclass(frozen=True, kw_only=True)
class Case:
    name: str
    directory: Path
    env_vars: dict[str, str]
    model_args: dict[str, Any]
    nproc: int
    platform: str
    tolerance: float
    deterministic: bool
    """lm loss and grad norm must match the printed values exactly (CPU runs are bitwise
    reproducible); otherwise within `tolerance`, relative."""
    grad_norm_tolerance: float | None
    """grad norm's relative tolerance where it needs its own (None: `tolerance`)."""
    time_factor: float
    """The steady-window iteration time may be this factor slower or faster than golden."""
    resume: Resume | None = None

    def golden_path(self, platform: str | None = None) -> Path:
        """The primary golden file of a platform."""
        return self.directory / f"golden_values_{platform or self.platform}.json"

    def golden_kinds(self, platform: str | None = None) -> list[Path]:
        """Every golden file of a platform: the primary one first (where it exists), then those
        recorded on other machines of the platform, golden_values_<platform>.<tag>.json."""
        primary = self.golden_path(platform)
        others = sorted(self.directory.glob(f"golden_values_{platform or self.platform}.*.json"))
        return ([primary] if primary.exists() else []) + others

    @property
    def train_iters(self) -> int:
        return int(self.model_args["train-iters"])


def model_args_to_argv(model_args: dict[str, Any]) -> list[str]:
    """{"bf16": true, "lr": 0.001} -> ["--bf16", "--lr", "0.001"]; false drops the flag."""
    argv: list[str] = []
    for flag, value in model_args.items():
        if value is True:
            argv.append(f"--{flag}")
        elif value is False or value is None:
            continue
        else:
            argv.extend([f"--{flag}", str(value)])
    return argv


def _parse_resume(name: str, *, raw: Any, train_iters: int) -> Resume | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) - {"stop_at", "nproc_after"} or "stop_at" not in raw:
        raise CaseError(f"{name}: RESUME must be {{stop_at: N, nproc_after: M}}, got {raw!r}")
    resume = Resume(stop_at=int(raw["stop_at"]), nproc_after=int(raw.get("nproc_after", 0)))
    if not 0 < resume.stop_at < train_iters:
        raise CaseError(
            f"{name}: RESUME stop_at {resume.stop_at} must lie inside train-iters {train_iters}"
        )
    return resume


def load_case(directory: Path) -> Case:
    """Read <directory>/model_config.yaml; raise CaseError naming the problem."""
    name = directory.name
    config_path = directory / "model_config.yaml"
    raw = yaml.safe_load(config_path.read_text())
    if not isinstance(raw, dict):
        raise CaseError(f"{config_path}: expected a mapping at the top level")
    unknown = set(raw) - CONFIG_KEYS
    if unknown:
        raise CaseError(
            f"{config_path}: unknown keys {sorted(unknown)}; known: {sorted(CONFIG_KEYS)}"
        )
    model_args = dict(raw.get("MODEL_ARGS") or {})
    owned = RUNNER_FLAGS & set(model_args)
    if owned:
        raise CaseError(f"{name}: MODEL_ARGS may not set {sorted(owned)}; the runner sets them")
    if "train-iters" not in model_args:
        raise CaseError(f"{name}: MODEL_ARGS needs train-iters")
    platform = str(raw.get("PLATFORM", "cpu"))
    if platform not in PLATFORMS:
        raise CaseError(f"{name}: PLATFORM {platform!r} is not one of {PLATFORMS}")
    nproc = int(raw.get("NPROC", 1))
    resume = _parse_resume(name, raw=raw.get("RESUME"), train_iters=int(model_args["train-iters"]))
    if resume is not None and resume.nproc_after == 0:
        resume = Resume(stop_at=resume.stop_at, nproc_after=nproc)
    return Case(
        name=name,
        directory=directory,
        env_vars={str(key): str(value) for key, value in (raw.get("ENV_VARS") or {}).items()},
        model_args=model_args,
        nproc=nproc,
        platform=platform,
        tolerance=float(raw.get("TOLERANCE", DEFAULT_TOLERANCE)),
        grad_norm_tolerance=(
            float(raw["GRAD_NORM_TOLERANCE"]) if "GRAD_NORM_TOLERANCE" in raw else None
        ),
        deterministic=bool(raw.get("DETERMINISTIC", platform == "cpu")),
        time_factor=float(raw.get("TIME_FACTOR", DEFAULT_TIME_FACTOR[platform])),
        resume=resume,
    )


def discover_cases(root: Path = CASES_ROOT) -> list[Case]:
    """Every case under `root`, sorted by name."""
    return [load_case(path.parent) for path in sorted(root.glob("*/model_config.yaml"))]


def find_case(name: str, root: Path = CASES_ROOT) -> Case:
    directory = root / name
    if not (directory / "model_config.yaml").is_file():
        known = ", ".join(case.name for case in discover_cases(root))
        raise CaseError(f"no case {name!r} under {root}; known cases: {known}")
    return load_case(directory)


def current_platform() -> str:
    """$MEGATRON_FUNCTIONAL_PLATFORM if set; else "cpu" without CUDA, else the GPU model
    ("NVIDIA H200" -> "h200")."""
    override = os.environ.get(PLATFORM_ENV)
    if override:
        return override
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    device_name = torch.cuda.get_device_name(0)
    match = re.search(r"\b([A-Z]\d{2,4})\b", device_name)
    return match.group(1).lower() if match else re.sub(r"\W+", "_", device_name).lower()
