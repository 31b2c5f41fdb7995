"""Which CPU a golden file was recorded on, and which comparison rule that allows.

CPU runs are bitwise reproducible on one CPU, not across CPU vendors: with ATen, MKL and oneDNN
all pinned to AVX2 (runner.PINNED_CPU_KERNELS), an Intel Xeon (AVX-512-BF16, AMX) still missed
the goldens recorded on an AMD EPYC from iteration 2-15 on, by up to 1.6e-4 relative in lm loss
and 9.0e-3 in grad norm (gpt_fp8_tensorwise_param_gather, 2026-12-01). MKL takes another code
path on a non-Intel CPU even under MKL_CBWR=AVX2 (MKL_CBWR=COMPATIBLE moves the numbers on the
Xeon from iteration 5 on, so MKL is in the path), and one differently rounded sum is enough.

So every CPU golden file records the fingerprint of the machine that wrote it. A run compares
exactly (printed strings equal) against a golden file whose fingerprint equals this machine's,
and otherwise within CROSS_CPU_RELATIVE of the case's primary golden file.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

# The ISA extensions that change which float kernels run (the pinned libraries still read
# some of them, e.g. for bf16 conversions), plus the vendor and model that MKL dispatches on.
ISA_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_bf16",
    "amx_tile",
)
FINGERPRINT_KEYS = ("cpu_vendor", "cpu_model", "cpu_isa", "torch")

# Cross-CPU rule, relative to the golden value: about 3x the largest AMD-vs-Intel difference
# measured over the 11 CPU cases (lm loss 1.56e-4, grad norm 9.03e-3, both in
# gpt_fp8_tensorwise_param_gather; the bf16 cases 1.9e-5 and 8.9e-4). A changed seed moves the
# first step's loss by about 1e-3 relative and later ones by far more, so the rule still
# catches a real change; tests/functional_tests/test_runner.py holds both facts.
CROSS_CPU_RELATIVE = {"lm loss": 5e-4, "grad norm": 3e-2}


def _cpuinfo_fields(text: str) -> dict[str, str]:
    """The first processor's `key: value` lines of /proc/cpuinfo."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_fingerprint(cpuinfo: str | None = None) -> dict[str, str]:
    """{cpu_vendor, cpu_model, cpu_isa, torch} of this machine (or of the given cpuinfo text)."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.exists() else ""
    fields = _cpuinfo_fields(cpuinfo)
    flags = set(fields.get("flags", "").split())
    return {
        "cpu_vendor": fields.get("vendor_id", "unknown"),
        "cpu_model": fields.get("model name", "unknown"),
        "cpu_isa": " ".join(flag for flag in ISA_FLAGS if flag in flags),
        "torch": torch.__version__,
    }


def same_machine(recorded: dict[str, str] | None, current: dict[str, str]) -> bool:
    """Exact comparison is allowed only when every fingerprint field was recorded and equals
    this machine's."""
    if not recorded:
        return False
    return all(recorded.get(key) == current.get(key) for key in FINGERPRINT_KEYS)


def describe(fingerprint: dict[str, str] | None) -> str:
    if not fingerprint:
        return "an unrecorded machine"
    return f"{fingerprint.get('cpu_model', '?')} ({fingerprint.get('cpu_vendor', '?')})"


def golden_tag(fingerprint: dict[str, str]) -> str:
    """A file-name tag for this machine's golden kind: golden_values_cpu.<tag>.json."""
    words = re.sub(r"\((R|TM)\)", "", fingerprint["cpu_model"], flags=re.IGNORECASE)
    slug = re.sub(r"[^a-z0-9]+", "-", words.lower()).strip("-")
    return slug[:48] or "cpu"
