"""One test per functional case: train it and compare against golden_values_<platform>.json.

Cases of another platform skip with the reason (the H200 cases on a CPU machine). A case of this
platform without golden values fails and names the --regenerate command that records them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.functional_tests.cases import current_platform, discover_cases
from tests.functional_tests.golden import format_reports
from tests.functional_tests.runner import MissingGoldenError, run_case, skip_reason

PLATFORM = current_platform()
CASES = discover_cases()


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_case_matches_golden_values(case, tmp_path: Path):
    reason = skip_reason(case, PLATFORM)
    if reason is not None:
        pytest.skip(reason)
    try:
        result = run_case(case, platform=PLATFORM, workdir=tmp_path)
    except MissingGoldenError as error:
        pytest.fail(str(error))
    assert [report.metric for report in result.reports] == [
        "lm loss",
        "grad norm",
        "iteration-time",
        "mem-allocated-bytes",
    ]
    assert result.passed, f"{case.name} (log {result.log_path}):\n{format_reports(result.reports)}"
