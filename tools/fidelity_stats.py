"""Paired-seed statistics of the fidelity suite (benchmarks/fidelity_suite.py, issue 41).

For one FP8 recipe and the bf16 baseline run at the same seeds (same data order, init and
schedule), the paired ratios r_i = loss_fp8(seed_i) / loss_bf16(seed_i) are summarised by their
mean and a two-sided Student t confidence interval:

    mean = sum(r_i) / n,  s^2 = sum((r_i - mean)^2) / (n - 1),
    interval = mean -+ t_{(1 + c) / 2, n - 1} * s / sqrt(n).

The t quantile inverts the t distribution's CDF, written with the regularized incomplete beta
function: for t >= 0, F(t) = 1 - I_{df / (df + t^2)}(df / 2, 1 / 2) / 2, I evaluated by its
continued fraction (modified Lentz), the quantile found by bisection. Standard library only.
A recipe is "within 1%" only when the interval's upper end is below 1 + tolerance.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

_TINY = 1e-300


def _beta_continued_fraction(x: float, a: float, b: float) -> float:
    """The continued fraction of I_x(a, b) (modified Lentz), converging for x < (a+1)/(a+b+2)."""
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > _TINY else _TINY)
    result = d
    for m in range(1, 1000):
        # Even step, then odd step, of the fraction's coefficients.
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > _TINY else _TINY)
            c = 1.0 + numerator / c
            c = c if abs(c) > _TINY else _TINY
            result *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return result


def regularized_incomplete_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b) for 0 <= x <= 1 and a, b > 0."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"x must be in [0, 1], got {x}")
    if x in (0.0, 1.0):
        return x
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_continued_fraction(x, a, b) / a
    # Symmetry I_x(a, b) = 1 - I_{1-x}(b, a), where the fraction converges.
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(1.0 - x, b, a) / b


def student_t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with df degrees of freedom."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    tail = 0.5 * regularized_incomplete_beta(df / (df + t * t), df / 2.0, 0.5)
    return 1.0 - tail if t >= 0 else tail


def student_t_quantile(p: float, df: int) -> float:
    """The t with student_t_cdf(t, df) == p (0.5 <= p < 1), by bisection to 1e-12."""
    if not 0.5 <= p < 1.0:
        raise ValueError(f"p must be in [0.5, 1), got {p}")
    low, high = 0.0, 1.0
    while student_t_cdf(high, df) < p:
        high *= 2.0
    while high - low > 1e-12 * max(1.0, high):
        middle = 0.5 * (low + high)
        if student_t_cdf(middle, df) < p:
            low = middle
        else:
            high = middle
    return 0.5 * (low + high)


def sample_sd(values: Sequence[float]) -> float:
    """The sample standard deviation (n - 1 in the denominator) of >= 2 values."""
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _half_width(sd: float, n: int, confidence: float) -> float:
    """Half the two-sided Student t interval of a mean of n values with this sd."""
    return student_t_quantile((1.0 + confidence) / 2.0, n - 1) * sd / math.sqrt(n)


def mean_confidence_interval(
    values: Sequence[float], confidence: float = 0.95
) -> tuple[float, float, float]:
    """(mean, low, high): the two-sided Student t interval of the mean of >= 2 values."""
    n = len(values)
    if n < 2:
        raise ValueError(f"a confidence interval needs at least 2 values, got {n}")
    mean = sum(values) / n
    half = _half_width(sample_sd(values), n, confidence)
    return mean, mean - half, mean + half


def seeds_for_verdict(
    mean: float, sd: float, *, confidence: float = 0.95, tolerance: float = 0.01, most: int = 1000
) -> int | None:
    """The fewest seeds n >= 2 whose interval, if their ratios kept this mean and standard
    deviation, would end below 1 + tolerance: mean + t_{n-1} * sd / sqrt(n) < 1 + tolerance.
    None when the mean itself is not below 1 + tolerance (or is below 1 - tolerance), or more
    than `most` would be needed.
    A planning figure (the next seeds move the mean and sd), not a verdict."""
    margin = 1.0 + tolerance - mean
    if margin <= 0.0 or mean < 1.0 - tolerance:  # the latter: no "within" verdict to reach
        return None
    for n in range(2, most + 1):
        if _half_width(sd, n, confidence) < margin:
            return n
    return None


def _verdict(low: float, high: float, tolerance: float) -> str:
    percent = f"{tolerance * 100:g}%"
    if high < 1.0 - tolerance:  # better than bf16 by more than the tolerance: not "within"
        upper = f"{(high - 1.0) * 100:+.2f}%"
        return f"below bf16 by more than {percent} (whole interval, upper end {upper})"
    if high < 1.0 + tolerance:
        return f"within {percent}"
    if low >= 1.0 + tolerance:
        return f"above {percent} (whole interval, lower end {(low - 1.0) * 100:+.2f}%)"
    return f"not shown within {percent} (upper end {(high - 1.0) * 100:+.2f}%)"


def paired_ratio_summary(
    fp8: Mapping[int, float],
    bf16: Mapping[int, float],
    *,
    confidence: float = 0.95,
    tolerance: float = 0.01,
) -> dict:
    """Summary of fp8[seed] / bf16[seed] over the seeds both have (missing runs are skipped).

    verdict: "within 1%" when the interval's upper end < 1 + tolerance (and not below
    1 - tolerance: then "below bf16 by more than 1%", a gain that large is itself to explain);
    "above 1%" when its
    lower end is not below 1 + tolerance; otherwise "not shown within 1%", with how far the
    upper end reaches; "undetermined" with fewer than 2 pairs. sd is the ratios' sample
    standard deviation, seeds_needed the seeds_for_verdict planning figure.
    """
    seeds = sorted(seed for seed in fp8 if seed in bf16 and fp8[seed] and bf16[seed])
    ratios = [fp8[seed] / bf16[seed] for seed in seeds]
    summary = {"seeds": seeds, "ratios": ratios, "confidence": confidence}
    if len(ratios) < 2:
        mean = ratios[0] if ratios else None
        return {
            **summary,
            **dict(mean=mean, low=None, high=None, sd=None, seeds_needed=None),
            "verdict": "undetermined",
        }
    mean, low, high = mean_confidence_interval(ratios, confidence)
    sd = sample_sd(ratios)
    needed = seeds_for_verdict(mean, sd, confidence=confidence, tolerance=tolerance)
    return {
        **summary,
        **dict(mean=mean, low=low, high=high, sd=sd, seeds_needed=needed),
        "verdict": _verdict(low, high, tolerance),
    }
