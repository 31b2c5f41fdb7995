"""tools/fidelity_stats.py: Student t quantiles and paired-ratio intervals, against values
computed by hand (mean, s, s / sqrt(n)) and published t tables (issue 41)."""

import math

import pytest

from tools.fidelity_stats import (
    mean_confidence_interval,
    paired_ratio_summary,
    regularized_incomplete_beta,
    seeds_for_verdict,
    student_t_cdf,
    student_t_quantile,
)


@pytest.mark.parametrize(
    "df, expected",
    [(1, 12.706205), (2, 4.302653), (3, 3.182446), (4, 2.776445), (10, 2.228139), (30, 2.042272)],
)
def test_t_quantile_matches_table(df, expected):
    assert student_t_quantile(0.975, df) == pytest.approx(expected, abs=1e-6)


def test_t_cdf_and_incomplete_beta_closed_forms():
    # df = 1 is Cauchy: F(t) = 1/2 + atan(t) / pi. df = 2: F(t) = 1/2 + t / (2 sqrt(2 + t^2)).
    for t in (-3.0, -0.5, 0.0, 0.7, 5.0):
        assert student_t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)
        assert student_t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-12)
    # I_x(a, 1) = x^a and I_x(1, b) = 1 - (1 - x)^b.
    assert regularized_incomplete_beta(0.3, 2.5, 1.0) == pytest.approx(0.3**2.5, abs=1e-12)
    assert regularized_incomplete_beta(0.3, 1.0, 4.0) == pytest.approx(1 - 0.7**4, abs=1e-12)


def test_interval_by_hand():
    # Ratios 1.00, 1.01, 1.02: mean 1.01, s = 0.01, s / sqrt(3) = 0.0057735,
    # half width = 4.302653 * 0.0057735 = 0.0248414.
    mean, low, high = mean_confidence_interval([1.00, 1.01, 1.02])
    assert mean == pytest.approx(1.01, abs=1e-12)
    assert low == pytest.approx(0.9851586, abs=1e-6)
    assert high == pytest.approx(1.0348414, abs=1e-6)


def test_paired_summary_verdicts():
    bf16 = {1: 0.80, 2: 0.90, 3: 1.00, 4: 2.00}
    # Ratios 1.001, 1.002, 1.003 (seed 4 has no fp8 run): mean 1.002, s 0.001,
    # half width 4.302653 * 0.001 / sqrt(3) = 0.0024841; upper end 1.0044841 < 1.01.
    good = paired_ratio_summary({1: 0.8008, 2: 0.9018, 3: 1.003}, bf16)
    assert good["seeds"] == [1, 2, 3]
    assert good["mean"] == pytest.approx(1.002, abs=1e-12)
    assert good["high"] == pytest.approx(1.0044841, abs=1e-6)
    assert good["verdict"] == "within 1%"
    # Ratios 0.99, 1.00, 1.01: mean 1.00, upper end 1.0248414 -> not shown within 1%; sd 0.01,
    # so 7 seeds would be needed (test_seeds_for_verdict_by_hand).
    wide = paired_ratio_summary({1: 0.792, 2: 0.90, 3: 1.01}, bf16)
    assert wide["high"] == pytest.approx(1.0248414, abs=1e-6)
    assert wide["verdict"] == "not shown within 1% (upper end +2.48%)"
    assert wide["sd"] == pytest.approx(0.01, abs=1e-12) and wide["seeds_needed"] == 7
    # Ratios 1.05, 1.06, 1.07: lower end 1.06 - 0.0248414 = 1.0351586 >= 1.01 -> above 1%.
    above = paired_ratio_summary({1: 0.84, 2: 0.954, 3: 1.07}, bf16)
    assert above["verdict"] == "above 1% (whole interval, lower end +3.52%)"
    assert above["seeds_needed"] is None
    one = paired_ratio_summary({1: 0.88}, bf16)
    assert one["verdict"] == "undetermined" and one["mean"] == pytest.approx(1.1)
    # Ratios 0.967, 0.970, 0.973: upper end 0.970 + 0.003 * 4.302653 / sqrt(3) = 0.9774524,
    # under 0.99: FP8 better by more than 1% over the whole interval is not "within 1%".
    below = paired_ratio_summary({1: 0.7736, 2: 0.873, 3: 0.973}, bf16)
    assert below["high"] == pytest.approx(0.9774524, abs=1e-6)
    assert below["verdict"] == "below bf16 by more than 1% (whole interval, upper end -2.25%)"
    assert below["seeds_needed"] is None  # no "within" verdict to plan seeds for
    # Just under 0.99 at the upper end and the interval reaching past it is "within" again.
    edge = paired_ratio_summary({1: 0.7920, 2: 0.8910, 3: 1.0}, bf16)
    assert edge["high"] > 0.99 and edge["verdict"] == "within 1%"


def test_seeds_for_verdict_by_hand():
    # mean 1.00, sd 0.01, margin 0.01: t_{n-1} / sqrt(n) must fall below 1.
    # n=6: 2.570582 / 2.449490 = 1.0494; n=7: 2.446912 / 2.645751 = 0.9248 -> 7.
    assert seeds_for_verdict(1.0, 0.01) == 7
    # mean 1.0057, sd 0.0024 (margin 0.0043): n=3 gives 4.302653 * 0.0024 / 1.732051 = 0.00596,
    # n=4 gives 3.182446 * 0.0024 / 2 = 0.00382 -> 4.
    assert seeds_for_verdict(1.0057, 0.0024) == 4
    assert seeds_for_verdict(1.0, 0.0) == 2
    assert seeds_for_verdict(1.01, 0.001) is None  # the mean is not below 1 + tolerance
    assert seeds_for_verdict(1.0099, 0.05, most=50) is None
