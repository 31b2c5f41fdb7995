"""The functional-test runner itself: comparison rules on synthetic metrics, the mismatch table,
golden-file handling, case parsing, and two real runs of a copied case with one numeric flag
changed, which must fail with a table of the right numbers."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import yaml

from tests.functional_tests.cases import (
    CASES_ROOT,
    CaseError,
    current_platform,
    discover_cases,
    find_case,
    load_case,
    model_args_to_argv,
)
from tests.functional_tests.golden import (
    MACHINE_KEY,
    Row,
    Tolerance,
    compare_metrics,
    compare_per_step,
    compare_window,
    format_table,
    read_golden,
    steady_median,
    write_golden,
)
from tests.functional_tests.machine import (
    CROSS_CPU_RELATIVE,
    FINGERPRINT_KEYS,
    cpu_fingerprint,
    golden_tag,
    same_machine,
)
from tests.functional_tests.runner import (
    MissingGoldenError,
    choose_golden,
    main,
    regenerate_target,
    run_case,
)
from tools.plot_losses import parse_log

EXACT = Tolerance(deterministic=True, relative=0.05)
LOOSE = Tolerance(deterministic=False, relative=0.05)


def _copy_case(name: str, root: Path, **changed_args) -> Path:
    """Copy case `name` (with its goldens) under `root`, overriding MODEL_ARGS entries."""
    directory = root / name
    shutil.copytree(CASES_ROOT / name, directory)
    config_path = directory / "model_config.yaml"
    config = yaml.safe_load(config_path.read_text())
    config["MODEL_ARGS"].update({flag.replace("_", "-"): v for flag, v in changed_args.items()})
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    return directory


def _record_this_machine(directory: Path) -> None:
    """Make the copied case's primary golden file this machine's own kind (the other kinds
    removed), so that the run compares exactly whichever CPU runs the test."""
    for path in directory.glob("golden_values_cpu.*.json"):
        path.unlink()
    primary = directory / "golden_values_cpu.json"
    raw = json.loads(primary.read_text())
    raw[MACHINE_KEY] = cpu_fingerprint()
    primary.write_text(json.dumps(raw, indent=2) + "\n")


def _cross_cpu(tolerance: Tolerance) -> Tolerance:
    return dataclasses.replace(
        tolerance,
        deterministic=False,
        relative=CROSS_CPU_RELATIVE["lm loss"],
        grad_norm_relative=CROSS_CPU_RELATIVE["grad norm"],
    )


# --- comparison rules on synthetic metrics ---------------------------------------------------


def test_exact_lm_loss_compares_printed_strings():
    golden = {1: 6.249408, 2: 6.235354, 3: 6.168359}
    # 6.2353541 prints as 6.235354E+00 (equal); 6.168360 differs in the 7th digit.
    actual = {1: 6.249408, 2: 6.2353541, 3: 6.168360}
    report = compare_per_step("lm loss", golden=golden, actual=actual, tolerance=EXACT)
    assert report.rule == "printed values equal"
    assert report.rows == [
        Row(
            step="3",
            golden="6.168359E+00",
            actual="6.168360E+00",
            difference="+1.000E-06",
            relative="+0.000%",
        )
    ]


def test_exact_grad_norm_uses_three_decimals():
    golden = {1: 1.2344, 2: 1.2344}
    actual = {1: 1.2341, 2: 1.2346}  # "1.234" == "1.234"; "1.235" != "1.234"
    report = compare_per_step("grad norm", golden=golden, actual=actual, tolerance=EXACT)
    assert [(row.step, row.golden, row.actual) for row in report.rows] == [("2", "1.234", "1.235")]


def test_tolerance_mode_is_relative():
    golden = {1: 6.0, 2: 6.0, 3: 6.0}
    actual = {1: 6.29, 2: 5.71, 3: 6.4}  # +4.83%, -4.83% pass; +6.67% fails at 5%
    report = compare_per_step("lm loss", golden=golden, actual=actual, tolerance=LOOSE)
    assert report.rule == "within 5% relative"
    assert report.rows == [
        Row(
            step="3",
            golden="6.000000E+00",
            actual="6.400000E+00",
            difference="+4.000E-01",
            relative="+6.667%",
        )
    ]


def test_tolerance_mode_grad_norm_allows_print_resolution():
    # 1% of 0.010 is 0.0001; the printed resolution adds 0.0005: 0.0105 passes, 0.0107 fails.
    tolerance = Tolerance(deterministic=False, relative=0.01)
    report = compare_per_step(
        "grad norm", golden={1: 0.010, 2: 0.010}, actual={1: 0.0105, 2: 0.0107}, tolerance=tolerance
    )
    assert [row.step for row in report.rows] == ["2"]


def test_grad_norm_tolerance_applies_to_grad_norm_only():
    # 8% for grad norm, 5% for lm loss: a 6% grad-norm step passes, a 6% loss step does not.
    tolerance = Tolerance(deterministic=False, relative=0.05, grad_norm_relative=0.08)
    grad_norm = compare_per_step(
        "grad norm", golden={1: 4.0, 2: 4.0}, actual={1: 4.24, 2: 4.4}, tolerance=tolerance
    )
    assert [row.step for row in grad_norm.rows] == ["2"]
    assert grad_norm.rule == "within 8% relative"
    loss = compare_per_step("lm loss", golden={1: 4.0}, actual={1: 4.24}, tolerance=tolerance)
    assert [row.step for row in loss.rows] == ["1"]


def test_missing_and_extra_steps_are_rows():
    report = compare_per_step(
        "lm loss", golden={1: 5.0, 2: 4.0}, actual={1: 5.0, 3: 3.0}, tolerance=EXACT
    )
    assert [(row.step, row.golden, row.actual, row.difference) for row in report.rows] == [
        ("2", "4.000000E+00", "missing", "-"),
        ("3", "missing", "3.000000E+00", "-"),
    ]


def test_iteration_time_steady_window_skips_warmup():
    golden = {step: (10.0 if step <= 5 else 0.1) for step in range(1, 11)}
    slow_start = {step: (100.0 if step <= 5 else 0.25) for step in range(1, 11)}
    assert steady_median(golden, skip=5) == (0.1, "median 6-10")
    passed = compare_window("iteration-time", golden=golden, actual=slow_start, tolerance=EXACT)
    assert passed.rule == "steady median within 3x" and passed.passed
    too_slow = {step: 0.31 for step in range(1, 11)}
    failed = compare_window("iteration-time", golden=golden, actual=too_slow, tolerance=EXACT)
    assert failed.rows == [
        Row(
            step="median 6-10",
            golden="0.1000",
            actual="0.3100",
            difference="+2.100E-01",
            relative="+210.000%",
        )
    ]
    too_fast = {step: 0.03 for step in range(1, 11)}
    assert not compare_window(
        "iteration-time", golden=golden, actual=too_fast, tolerance=EXACT
    ).passed


def test_memory_within_half():
    gib = float(1 << 30)
    golden = {step: gib for step in range(1, 11)}
    within = {step: 1.45 * gib for step in range(1, 11)}
    beyond = {step: 1.55 * gib for step in range(1, 11)}
    assert compare_window(
        "mem-allocated-bytes", golden=golden, actual=within, tolerance=EXACT
    ).passed
    report = compare_window("mem-allocated-bytes", golden=golden, actual=beyond, tolerance=EXACT)
    assert [(row.golden, row.actual, row.relative) for row in report.rows] == [
        ("1073741824", "1664299827", "+55.000%")
    ]


def test_short_run_window_uses_last_step():
    assert steady_median({1: 3.0, 2: 2.0}, skip=5) == (2.0, "median 2-2")
    assert steady_median({}, skip=5) is None


def test_compare_metrics_covers_golden_metrics_in_order():
    golden = {"lm loss": {1: 5.0}, "iteration-time": {1: 0.1}, "grad norm": {1: 1.0}}
    reports = compare_metrics(golden=golden, actual={"lm loss": {1: 5.0}}, tolerance=EXACT)
    assert [(report.metric, report.passed) for report in reports] == [
        ("lm loss", True),
        ("grad norm", False),
        ("iteration-time", False),
    ]


def test_format_table_aligns_columns_and_caps_rows():
    rows = [
        Row(step=str(step), golden="1.0", actual="2.0", difference="+1", relative="+100.000%")
        for step in range(1, 4)
    ]
    assert format_table(rows, max_rows=2).splitlines() == [
        "step  golden  actual  difference   relative",
        "   1     1.0     2.0          +1  +100.000%",
        "   2     1.0     2.0          +1  +100.000%",
        "... 1 more rows",
    ]


# --- golden files and case configs -------------------------------------------------------------


def test_write_golden_refuses_overwrite_without_force(tmp_path: Path):
    path = tmp_path / "golden_values_cpu.json"
    write_golden(path, {"lm loss": {1: 6.25, 2: 6.125}}, force=False)
    before = path.read_bytes()
    with pytest.raises(FileExistsError, match="pass --force"):
        write_golden(path, {"lm loss": {1: 1.0}}, force=False)
    assert path.read_bytes() == before
    assert json.loads(before)["lm loss"] == {
        "start_step": 1,
        "end_step": 2,
        "step_interval": 1,
        "values": {"1": 6.25, "2": 6.125},
    }
    write_golden(path, {"lm loss": {10: 1.5, 20: 1.25}}, force=True)
    assert read_golden(path) == {"lm loss": {10: 1.5, 20: 1.25}}
    assert json.loads(path.read_text())["lm loss"]["step_interval"] == 10


def test_cli_regenerate_refuses_existing_golden(tmp_path: Path, capsys):
    directory = _copy_case("gpt_ddp_bf16", tmp_path / "cases")
    _record_this_machine(directory)
    golden = directory / "golden_values_cpu.json"
    before = golden.read_bytes()
    argv = ["--case", "gpt_ddp_bf16", "--cases-root", str(tmp_path / "cases")]
    argv += ["--platform", "cpu", "--output-dir", str(tmp_path / "out"), "--regenerate"]
    assert main(argv) == 2
    assert f"refusing to overwrite existing golden values without --force:\n  {golden}" in (
        capsys.readouterr().err
    )
    assert golden.read_bytes() == before
    assert not (tmp_path / "out").exists()  # nothing was launched


def test_gpu_case_without_goldens_fails_with_the_regenerate_command(tmp_path: Path):
    recorded = find_case("gpt_h200_fp8_mxfp8_param_gather")
    assert (recorded.platform, recorded.nproc, recorded.deterministic) == ("h200", 1, False)
    assert (recorded.tolerance, recorded.grad_norm_tolerance) == (0.05, 0.10)
    # The same case in a directory without its golden file (the recorded one stays untouched).
    case = dataclasses.replace(recorded, directory=tmp_path / "case")
    assert not case.golden_path().exists()
    with pytest.raises(MissingGoldenError) as raised:
        run_case(case, platform="h200", workdir=tmp_path)
    assert (
        "run `python3 -m tests.functional_tests.runner --case gpt_h200_fp8_mxfp8_param_gather "
        "--platform h200 --regenerate` on a h200 machine" in str(raised.value)
    )
    assert not (tmp_path / "train.log").exists()


def test_case_configs_parse():
    cases = {case.name: case for case in discover_cases()}
    cpu = sorted(name for name, case in cases.items() if case.platform == "cpu")
    assert cpu == [
        "gpt_ddp_bf16",
        "gpt_fp8_blockwise_param_gather",
        "gpt_fp8_delayed_param_gather",
        "gpt_fp8_mxfp8_param_gather",
        "gpt_fp8_tensorwise_param_gather",
        "gpt_fsdp_no_shard",
        "gpt_fsdp_optim",
        "gpt_fsdp_optim_grads",
        "gpt_fsdp_optim_grads_params",
        "gpt_resume_dp_change",
        "gpt_stop_and_resume",
    ]
    # Iteration time: 10x either way on the shared 2-core CPU, 3x on a GPU.
    assert cases["gpt_ddp_bf16"].time_factor == 10.0
    assert cases["gpt_h200_zero3_bf16"].time_factor == 3.0
    resume = cases["gpt_resume_dp_change"].resume
    assert (resume.stop_at, resume.nproc_after) == (10, 1)
    assert cases["gpt_ddp_bf16"].env_vars == {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    assert model_args_to_argv({"bf16": True, "fp8": False, "lr": 0.001, "seq-length": 32}) == [
        "--bf16",
        "--lr",
        "0.001",
        "--seq-length",
        "32",
    ]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"save": "/tmp/x"}, r"may not set \['save'\]"),
        ({"RESUME": {"stop_at": 20}}, "stop_at 20 must lie inside train-iters 20"),
        ({"PLATFORM": "tpu"}, "PLATFORM 'tpu' is not one of"),
        ({"GOLDEN": 1}, r"unknown keys \['GOLDEN'\]"),
    ],
)
def test_bad_case_configs_fail_with_the_reason(tmp_path: Path, change, message):
    directory = _copy_case("gpt_ddp_bf16", tmp_path)
    config_path = directory / "model_config.yaml"
    config = yaml.safe_load(config_path.read_text())
    if "save" in change:
        config["MODEL_ARGS"].update(change)
    else:
        config.update(change)
    config_path.write_text(yaml.safe_dump(config))
    with pytest.raises(CaseError, match=message):
        load_case(directory)


@pytest.mark.parametrize("kind", ["golden_values_cpu.json"])
def test_cpu_goldens_cover_every_step_and_resume_is_exact(kind: str):
    def golden(name: str) -> dict:
        return read_golden(find_case(name).directory / kind)

    for case in discover_cases():
        if case.platform != "cpu" or not (case.directory / kind).is_file():
            continue  # only the primary kind is in every case (_intel_cases)
        raw = json.loads((case.directory / kind).read_text())
        assert sorted(name for name in raw if name != MACHINE_KEY) == sorted(
            ["lm loss", "grad norm", "iteration-time", "mem-allocated-bytes"]
        )
        for name, entry in raw.items():
            if name == MACHINE_KEY:
                continue
            assert (entry["start_step"], entry["end_step"], entry["step_interval"]) == (1, 20, 1)
            assert len(entry["values"]) == 20
    # Resuming on the same ranks reproduces the uninterrupted run's printed numbers exactly.
    resumed, uninterrupted = golden("gpt_stop_and_resume"), golden("gpt_ddp_bf16")
    assert resumed["lm loss"] == uninterrupted["lm loss"]
    assert resumed["grad norm"] == uninterrupted["grad norm"]
    # On one rank instead of two only the reduction order changes: the same through the save,
    # and within a few units in the 7th digit after it.
    resumed = golden("gpt_resume_dp_change")["lm loss"]
    uninterrupted = golden("gpt_fsdp_optim_grads_params")["lm loss"]
    assert [resumed[step] for step in range(1, 11)] == [
        uninterrupted[step] for step in range(1, 11)
    ]
    assert max(abs(resumed[step] / uninterrupted[step] - 1.0) for step in range(11, 21)) < 1e-5


# --- real runs with one numeric detail changed -------------------------------------------------

# These compare against CPU goldens, whose time and memory bands only hold on a CPU machine.
cpu_only = pytest.mark.skipif(
    current_platform() != "cpu", reason="compares against CPU golden values; runs on CPU CI"
)


@cpu_only
def test_changed_seed_fails_with_a_table_of_the_numbers(tmp_path: Path, capsys):
    directory = _copy_case("gpt_ddp_bf16", tmp_path / "cases", seed=4321)
    _record_this_machine(directory)
    argv = ["--case", "gpt_ddp_bf16", "--cases-root", str(tmp_path / "cases")]
    assert main([*argv, "--platform", "cpu", "--output-dir", str(tmp_path / "out")]) == 1
    printed = capsys.readouterr().out
    golden = read_golden(directory / "golden_values_cpu.json")["lm loss"]
    actual_run = parse_log(str(tmp_path / "out" / "gpt_ddp_bf16" / "train.log"))
    actual = dict(zip(actual_run.iterations, actual_run.series["lm loss"]))
    differing = [step for step in golden if f"{golden[step]:.6E}" != f"{actual[step]:.6E}"]
    assert len(differing) >= 15, differing  # a new init moves nearly every step's loss
    assert "lm loss: MISMATCH (printed values equal; golden recorded on this machine's CPU" in (
        printed
    )
    assert f"), {len(differing)} row(s):" in printed
    # The cross-CPU rule, which a machine without its own golden kind gets, fails it too.
    cross = compare_metrics(
        golden=read_golden(directory / "golden_values_cpu.json"),
        actual={"lm loss": actual},
        tolerance=_cross_cpu(EXACT),
    )
    assert len(cross[0].rows) >= 15
    table = printed.split("lm loss: MISMATCH", 1)[1].splitlines()
    assert table[1].split() == ["step", "golden", "actual", "difference", "relative"]
    first = differing[0]
    expected = [
        str(first),
        f"{golden[first]:.6E}",
        f"{actual[first]:.6E}",
        f"{actual[first] - golden[first]:+.3E}",
        f"{100.0 * (actual[first] - golden[first]) / golden[first]:+.3f}%",
    ]
    assert table[2].split() == expected
    assert "FAIL gpt_ddp_bf16" in printed and "0 passed, 1 failed, 0 skipped" in printed


@cpu_only
def test_changed_fp8_margin_fails(tmp_path: Path):
    # Goldens recorded on this very machine first (the unchanged case), so that the comparison
    # is exact on any CPU and only the margin can move the numbers; against another CPU's
    # goldens the cross-CPU rule (5e-4) would hide a margin change this small.
    directory = _copy_case("gpt_fp8_delayed_param_gather", tmp_path)
    for path in directory.glob("golden_values_cpu*.json"):
        path.unlink()
    run_case(load_case(directory), platform="cpu", workdir=tmp_path / "base", regenerate=True)
    config_path = directory / "model_config.yaml"
    config = yaml.safe_load(config_path.read_text())
    config["MODEL_ARGS"]["fp8-margin"] = 2
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    result = run_case(load_case(directory), platform="cpu", workdir=tmp_path / "out")
    by_metric = {report.metric: report for report in result.reports}
    assert not by_metric["lm loss"].passed
    golden = read_golden(result.golden_path)["lm loss"]
    for row in by_metric["lm loss"].rows:
        step = int(row.step)
        assert row.golden == f"{golden[step]:.6E}"
        assert row.actual == f"{result.metrics['lm loss'][step]:.6E}"
        assert row.golden != row.actual
    # The time and memory bands still hold: only the numbers moved.
    assert by_metric["iteration-time"].passed and by_metric["mem-allocated-bytes"].passed


# --- golden kinds per CPU: exact on the recording machine, the cross-CPU rule elsewhere ------

AMD_PRIMARY = "golden_values_cpu.json"
INTEL_KIND = "golden_values_cpu.intel-xeon-processor.json"
XEON_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse2 avx2 fma f16c avx512f avx512bw avx512vl avx512_bf16 amx_bf16 amx_tile

processor\t: 1
vendor_id\t: SomethingElse
"""


def _cpu_cases():
    return [case for case in discover_cases() if case.platform == "cpu"]


# The seven bf16 cases recorded on both CPUs with the code of session 46 (before the
# learning-rate schedule moved to megatron-core's, session 47, and no Intel Xeon was at hand to
# re-record them): the measured cross-CPU difference the rule is set from.
CROSS_CPU = Path(__file__).with_name("cross_cpu")


def _intel_cases():
    """The CPU cases with an Intel kind (none since session 47: an Intel machine compares every
    case against the primary under the cross-CPU rule)."""
    return [case for case in _cpu_cases() if (case.directory / INTEL_KIND).is_file()]


def _max_relative(golden: dict[int, float], actual: dict[int, float]) -> float:
    return max(abs(actual[step] - golden[step]) / abs(golden[step]) for step in golden)


def test_both_golden_kinds_differ_exactly_and_agree_under_the_cross_cpu_rule():
    """The AMD EPYC goldens and the Intel Xeon goldens of every case with both, fed to the
    rules. The rule was set at about 3x the largest AMD-vs-Intel difference over all eleven
    cases before the FP8 cases' Intel kinds were removed (lm loss 1.56e-4, grad norm 9.03e-3,
    both in FP8 cases); the seven bf16 cases left differ by far less."""
    exact_failures, largest = [], {"lm loss": 0.0, "grad norm": 0.0}
    recorded = sorted(CROSS_CPU.iterdir())
    assert len(recorded) == 7 and not any("fp8" in directory.name for directory in recorded)
    for case in recorded:
        amd = read_golden(case / AMD_PRIMARY)
        intel = read_golden(case / INTEL_KIND)
        exact = compare_metrics(golden=amd, actual=intel, tolerance=EXACT)
        cross = compare_metrics(golden=amd, actual=intel, tolerance=_cross_cpu(EXACT))
        per_step = [report for report in cross if report.metric in ("lm loss", "grad norm")]
        assert all(report.passed for report in per_step), (case.name, per_step)
        if not exact[0].passed:
            exact_failures.append(case.name)
        for metric in largest:
            largest[metric] = max(largest[metric], _max_relative(amd[metric], intel[metric]))
    # Every one of them misses the exact rule.
    assert len(exact_failures) == 7
    assert largest["lm loss"] == pytest.approx(2.61e-5, rel=0.02)
    assert largest["grad norm"] == pytest.approx(8.90e-4, rel=0.02)
    for metric, measured in largest.items():
        assert 5.0 * measured < CROSS_CPU_RELATIVE[metric]


def test_cross_cpu_rule_still_catches_a_changed_loss():
    amd = read_golden(find_case("gpt_ddp_bf16").directory / AMD_PRIMARY)["lm loss"]
    moved = dict(amd)
    moved[7] = amd[7] * (1.0 + 2.0 * CROSS_CPU_RELATIVE["lm loss"])
    report = compare_per_step("lm loss", golden=amd, actual=moved, tolerance=_cross_cpu(EXACT))
    assert [row.step for row in report.rows] == ["7"]
    assert report.rule == "within 0.05% relative"


def test_cpu_fingerprint_reads_the_first_processor():
    fingerprint = cpu_fingerprint(XEON_CPUINFO)
    assert sorted(fingerprint) == sorted(FINGERPRINT_KEYS)
    assert fingerprint["cpu_vendor"] == "GenuineIntel"
    assert fingerprint["cpu_model"] == "Intel(R) Xeon(R) Processor"
    assert fingerprint["cpu_isa"] == "avx2 fma f16c avx512f avx512bw avx512vl avx512_bf16 " + (
        "amx_bf16 amx_tile"
    )
    assert golden_tag(fingerprint) == "intel-xeon-processor"
    # Exact only when every field was recorded and equals.
    assert same_machine(fingerprint, dict(fingerprint))
    assert not same_machine({**fingerprint, "torch": "2.12.0"}, fingerprint)
    assert not same_machine(None, fingerprint)


def test_golden_choice_follows_the_machine(tmp_path: Path):
    directory = _copy_case("gpt_ddp_bf16", tmp_path)
    shutil.copy(CROSS_CPU / "gpt_ddp_bf16" / INTEL_KIND, directory / INTEL_KIND)
    case = load_case(directory)
    intel = json.loads((directory / INTEL_KIND).read_text())[MACHINE_KEY]
    # The Xeon that recorded the Intel kind: exact against that kind.
    choice = choose_golden(case, platform="cpu", machine=intel)
    assert choice.path == directory / INTEL_KIND and choice.tolerance.deterministic
    assert regenerate_target(case, platform="cpu", machine=intel) == directory / INTEL_KIND
    # An AMD EPYC of another model than the primary's: the cross-CPU rule, against the kind of
    # its own vendor.
    epyc = {
        "cpu_vendor": "AuthenticAMD",
        "cpu_model": "AMD EPYC 9R14",
        "cpu_isa": "avx2 fma",
        "torch": intel["torch"],
    }
    choice = choose_golden(case, platform="cpu", machine=epyc)
    assert choice.path == directory / AMD_PRIMARY and not choice.tolerance.deterministic
    assert choice.tolerance.relative == CROSS_CPU_RELATIVE["lm loss"]
    assert choice.tolerance.grad_norm_relative == CROSS_CPU_RELATIVE["grad norm"]
    assert "recorded on AMD EPYC (AuthenticAMD), this machine is AMD EPYC 9R14" in (
        choice.tolerance.origin
    )
    # Recording on it writes a third kind and leaves the other two alone.
    target = regenerate_target(case, platform="cpu", machine=epyc)
    assert target == directory / "golden_values_cpu.amd-epyc-9r14.json"
    # Another Intel model: the Intel kind, under the cross-CPU rule.
    other_intel = {**intel, "cpu_model": "Intel(R) Xeon(R) Platinum 8480+"}
    choice = choose_golden(case, platform="cpu", machine=other_intel)
    assert choice.path == directory / INTEL_KIND and not choice.tolerance.deterministic
    # GPU cases are never exact and keep their own tolerance.
    gpu = find_case("gpt_h200_zero3_bf16")
    choice = choose_golden(gpu, platform="h200", machine=intel)
    assert choice.path == gpu.golden_path() and choice.tolerance.relative == gpu.tolerance


def test_every_cpu_golden_kind_records_its_machine():
    intel = {case.name for case in _intel_cases()}
    for case in _cpu_cases():
        kinds = case.golden_kinds("cpu")
        want = [AMD_PRIMARY, INTEL_KIND] if case.name in intel else [AMD_PRIMARY]
        assert [path.name for path in kinds] == want
        for path in kinds:
            recorded = json.loads(path.read_text())[MACHINE_KEY]
            assert sorted(recorded) == sorted(FINGERPRINT_KEYS), path
