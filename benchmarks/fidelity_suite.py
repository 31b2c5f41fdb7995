"""The FP8 fidelity suite (issue 41): every FP8 recipe against bf16, paired by seed.

For each corpus x size, trains bf16 and every recipe at each seed with `pretrain_gpt.py`
(the same seed gives the same data order, initial weights and schedule), then reports per
recipe the mean of the paired ratios valid_loss(recipe, seed) / valid_loss(bf16, seed) and its
95% Student t interval (tools/fidelity_stats.py). A recipe is "within 1%" only when the
interval's upper end is below 1.01; the table also gives the ratios' sd and how many seeds an
interval would need at that mean and sd (same-seed reruns on a GPU end up to 1.5% apart, so 3
seeds rarely decide 1%: docs/benchmarks/fidelity_suite_stdlib_128m_h100_2026-12-06.md).
FP8 runs log their FP8 statistics (--log-fp8-stats) halfway and at the end; runs.jsonl keeps
each run's last lines. Writes OUT/runs.jsonl (one line per run), OUT/summary.jsonl
(one line per corpus x size x recipe), OUT/summary.md (the table) and OUT/loss_curves.png (every
run's training loss on one page; needs matplotlib, skipped with a message without it).

    # the H200 job: both corpora, 128M (1,000 steps) and ~350M, 3 seeds, 6 runs at a time
    python3 benchmarks/fidelity_suite.py --out /tmp/fidsuite --corpus stdlib english \
        --size 128m 350m --seeds 1234 1235 1236 --parallel 6
    # one device call's share of a job longer than a call (10 minutes): the logs stay in
    # --out between calls (a carried folder), each call runs the next 5 runs not yet done
    # (plan order is seed by seed, bf16 first: 5 runs are one seed's bf16 and 4 recipes, so
    # each pair runs on one call's card; pairs across cards are not formed, see summarize,
    # but a seed's runs from two calls on cards of one name do pair: records say which call
    # ran which). A run's result is its validation loss at its last iteration
    # (benchmarks/fidelity_results.py); a kept log or checkpoint made by another command is
    # refused (exit 2).
    python3 benchmarks/fidelity_suite.py --out .fid/suite --corpus english \
        --english-dir .fid/english --size 128m --iters 3000 --micro-batch-size 4 --skip-done \
        --max-runs 5 --parallel 5
    # a run longer than one call: each run saves and stops after 8 minutes of training and
    # the next call on the same (warm) machine resumes it from --checkpoint-dir (not carried)
    python3 benchmarks/fidelity_suite.py --out .fid/suite --corpus english \
        --english-dir .fid/english --size 128m --iters 3000 --micro-batch-size 4 --skip-done \
        --max-runs 5 --parallel 5 --checkpoint-dir /tmp/fidckpt --stop-after-mins 8
    # the noise floor beside the recipes: bf16 a second time at each seed (bf16_repeat)
    python3 benchmarks/fidelity_suite.py --out .fid/suite --corpus stdlib --size 128m \
        --seeds 1237 1238 --repeat-control --skip-done --max-runs 6 --parallel 6
    # the CPU smoke run the tests use (tiny model, 3 iterations, no compile)
    python3 benchmarks/fidelity_suite.py --out /tmp/fidsmoke --size smoke --recipes tensorwise
    # model M-small, the MoE fidelity run of issue 38 (acceptance 6), on the quickstart corpus
    python3 benchmarks/fidelity_suite.py --out /tmp/fidmoe --corpus stdlib --size m-small \
        --seeds 1234 1235 1236 --parallel 5

Corpora: "stdlib" (scripts/prepare_quickstart_data.py, byte-level) and "english"
(scripts/prepare_english_corpus.py, BPE; an --english-dir holding english_manifest.json and
the .bin/.idx is used as is, so a machine without `tokenizers` or the package trains on a
corpus built elsewhere: the runs read it with NullTokenizer and the manifest's vocab size).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.fidelity_results import (  # noqa: E402
    CONTROL,
    card_label,
    command_change,
    done,
    markdown_table,
    read_card,
    read_results,
    summarize,
)

RECIPES = ("tensorwise", "delayed", "blockwise", "mxfp8")
# (layers, hidden, ffn, heads, seq, micro-batch, default iterations, eval iterations, split)
SIZES = {
    # 12 x 768, SwiGLU 3584: 127M parameters in the layers (benchmarks/fidelity_125m.sh).
    "128m": dict(layers=12, hidden=768, ffn=3584, heads=12, seq=1024, mbs=16, iters=1000),
    # 24 x 1024, SwiGLU 3072: 327M in the layers, ~360M with the 16K-token BPE embeddings.
    "350m": dict(layers=24, hidden=1024, ffn=3072, heads=16, seq=1024, mbs=16, iters=1000),
    "smoke": dict(layers=2, hidden=64, ffn=128, heads=2, seq=64, mbs=2, iters=3),
    # Model M-small (docs/PERFORMANCE.md; issue 38, acceptance 6): 8 MoE layers of 64
    # experts top-8, moe-ffn 256, hidden 768, GQA 12 heads / 4 groups, seq 2048 (8 x 2,048
    # tokens a step, as many as the dense sizes); the vocabulary is the corpus's.
    "m-small": dict(layers=8, hidden=768, ffn=3072, heads=12, seq=2048, mbs=8, iters=1000),
    "moe-smoke": dict(layers=2, hidden=64, ffn=128, heads=2, seq=64, mbs=2, iters=3),
}
EVAL_ITERS = {"128m": 32, "350m": 32, "smoke": 1, "m-small": 32, "moe-smoke": 1}
SPLIT = {"128m": "98,2,0", "350m": "98,2,0", "smoke": "80,20,0", "m-small": "98,2,0"}
SPLIT["moe-smoke"] = SPLIT["smoke"]


def _moe(experts: int, topk: int, ffn: int, groups: int) -> list[str]:
    """Routed experts in every layer (dropless, grouped GEMM, alltoall at EP 1), GQA, and
    Megatron-LM's aux-loss load balancing at Qwen3-MoE's coefficient (1e-3)."""
    return [
        "--num-experts", str(experts), "--moe-router-topk", str(topk),
        "--moe-ffn-hidden-size", str(ffn), "--moe-grouped-gemm",
        "--moe-token-dispatcher-type", "alltoall", "--moe-router-load-balancing-type", "aux_loss",
        "--moe-aux-loss-coeff", "1e-3",
        "--group-query-attention", "--num-query-groups", str(groups),
    ]  # fmt: skip


MOE_FLAGS = {"m-small": _moe(64, 8, 256, 4), "moe-smoke": _moe(4, 2, 32, 1)}


def _last_line(command: list[str]) -> str:
    result = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, text=True, check=True)
    return result.stdout.strip().splitlines()[-1]


def corpus_flags(corpus: str, args: argparse.Namespace) -> list[str]:
    """--data-path and tokenizer flags of `corpus`, building it when it is not there."""
    if corpus == "stdlib":
        data_dir = args.stdlib_dir or os.path.join(args.out, "data", "stdlib")
        prefix = _last_line(
            [sys.executable, "scripts/prepare_quickstart_data.py", "--output-dir", data_dir]
            + ["--max-mb", str(args.stdlib_mb)]
        )
        return ["--data-path", prefix, "--tokenizer-type", "ByteTokenizer"]
    if corpus == "english":
        data_dir = args.english_dir or os.path.join(args.out, "data", "english")
        manifest_path = os.path.join(data_dir, "english_manifest.json")
        if not os.path.isfile(manifest_path):
            _last_line(
                [sys.executable, "scripts/prepare_english_corpus.py", "--output-dir", data_dir]
                + ["--max-mb", str(args.english_mb)]
            )
        with open(manifest_path, encoding="utf-8") as handle:
            vocab_size = json.load(handle)["vocab_size"]
        prefix = os.path.join(data_dir, "pydocs_text_document")
        return ["--data-path", prefix, "--tokenizer-type", "NullTokenizer"] + [
            "--vocab-size",
            str(vocab_size),
        ]
    raise ValueError(f"unknown corpus {corpus!r}: choose stdlib or english")


OVER_ONE_EPOCH = " (over one: the validation loss also measures memorization; a smaller "
OVER_ONE_EPOCH += "--micro-batch-size or --iters keeps a run within one)"


def epochs_of(data_flags: list[str], size: str, iters: int, mbs: int) -> float:
    """How many passes over the corpus's training split (the --split share of its tokens) a
    run of `iters` steps makes: past 1, the runs see data again and the validation loss
    measures memorization as well. Counted on the corpus where this call runs (a --no-run
    summary elsewhere counts its own copy of the corpus)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix = data_flags[data_flags.index("--data-path") + 1]
    shares = [float(part) for part in SPLIT[size].split(",")]
    train_tokens = IndexedDataset(prefix).num_tokens * shares[0] / sum(shares)
    return iters * mbs * SIZES[size]["seq"] / train_tokens


def model_flags(size: str, iters: int, compile_: bool, mbs: int) -> list[str]:
    """The model, schedule and engine of one size (every run of a job shares them); mbs: the
    micro-batch (= global batch)."""
    s = dict(SIZES[size], mbs=mbs)
    flags = [
        "--num-layers", str(s["layers"]), "--hidden-size", str(s["hidden"]),
        "--ffn-hidden-size", str(s["ffn"]), "--num-attention-heads", str(s["heads"]),
        "--seq-length", str(s["seq"]), "--max-position-embeddings", str(s["seq"]),
        "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
        "--disable-bias-linear", "--hidden-dropout", "0", "--attention-dropout", "0", "--bf16",
        "--micro-batch-size", str(s["mbs"]), "--global-batch-size", str(s["mbs"]),
        "--train-iters", str(iters), "--lr", "6e-4", "--min-lr", "6e-5",
        "--lr-decay-style", "cosine", "--lr-warmup-iters", str(iters // 10),
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--split", SPLIT[size],
        "--log-interval", str(max(1, min(10, iters // 100))), "--eval-interval", str(iters),
        "--eval-iters", str(EVAL_ITERS[size]),
        "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
    ]  # fmt: skip
    flags += MOE_FLAGS.get(size, [])
    return flags + (["--torch-compile"] if compile_ else [])


def recipe_flags(recipe: str, iters: int) -> list[str]:
    """An FP8 run also logs its FP8 statistics halfway and at its last step (saturated and
    underflowing fractions per Linear and role: the evidence a recipe outside 1% is
    investigated with). Eager, they change no loss (test_fp8_stats_logging.py); compiled, those
    two steps run eagerly (docs/FP8_NUMERICS.md), a difference at the FP8 rounding level of
    eager against compiled layers: of the kind that makes same-seed GPU reruns drift apart."""
    if recipe in ("bf16", CONTROL):
        return []
    interval = iters // 2 if iters % 2 == 0 else iters  # a statistics step: step % interval == 0
    stats = ["--log-fp8-stats", "--log-fp8-stats-interval", str(max(1, interval))]
    return ["--fp8-recipe", recipe, "--fp8-format", "hybrid", "--fp8-param-gather", *stats]


def compared_recipes(args: argparse.Namespace) -> list[str]:
    """What is paired with bf16: the control first (--repeat-control), then the recipes."""
    return ([CONTROL] if args.repeat_control else []) + list(args.recipes)


def plan_runs(args: argparse.Namespace) -> list[dict]:
    """Every run of the suite: corpus x size x (bf16 + recipes) x seeds."""
    runs = []
    for corpus in args.corpus:
        data = corpus_flags(corpus, args)
        for size in args.size:
            iters = args.iters or SIZES[size]["iters"]
            mbs = args.micro_batch_size or SIZES[size]["mbs"]
            job = f"{corpus}_{size}_{iters}" + (f"_mbs{mbs}" if args.micro_batch_size else "")
            os.makedirs(os.path.join(args.out, job), exist_ok=True)
            epochs = epochs_of(data, size, iters, mbs)
            note = OVER_ONE_EPOCH if epochs > 1 else ""
            print(f"{job}: {iters} steps of {mbs * SIZES[size]['seq']} tokens, {epochs:.2f} "
                  f"epochs of the corpus's training split{note}")  # fmt: skip
            for seed in args.seeds:
                for recipe in ["bf16", *compared_recipes(args)]:
                    command = [sys.executable, "pretrain_gpt.py", *data]
                    command += model_flags(size, iters, args.compile, mbs)
                    command += ["--seed", str(seed), *recipe_flags(recipe, iters), *args.extra]
                    log = os.path.join(args.out, job, f"{recipe}@{seed}.log")
                    checkpoint = None
                    if args.checkpoint_dir:
                        checkpoint = os.path.join(args.checkpoint_dir, job, f"{recipe}@{seed}")
                        command += ["--save", checkpoint, "--load", checkpoint]
                    if args.stop_after_mins:
                        command += ["--exit-duration-in-mins", str(args.stop_after_mins)]
                    runs.append(
                        dict(
                            job=job,
                            corpus=corpus,
                            size=size,
                            iters=iters,
                            recipe=recipe,
                            seed=seed,
                            epochs=epochs,
                            log=log,
                            command=command,
                            checkpoint=checkpoint,
                        )
                    )
    return runs


def _saved_iteration(run: dict) -> int | None:
    """The iteration of the run's checkpoint under --checkpoint-dir, None without one."""
    if not run.get("checkpoint"):
        return None
    from megatron.training.checkpoint.layout import read_tracker

    return read_tracker(run["checkpoint"])


def _resumable(run: dict, saved: int | None = None) -> bool:
    """Whether the run's checkpoint (its iteration `saved`, read when not given) is one its
    next start goes on from (short of its end)."""
    saved = _saved_iteration(run) if saved is None else saved
    return saved is not None and saved < run["iters"]


def _prepare_checkpoint(run: dict) -> bool:
    """Before a start: keep only the newest save of a resumable checkpoint; remove one that is
    already at the run's end (a stale folder, or a save whose log lost its validation loss),
    so that the run starts afresh. Whether the run resumes."""
    saved = _saved_iteration(run)
    if _resumable(run, saved):
        keep = f"iter_{saved:07d}"
        for name in os.listdir(run["checkpoint"]):
            path = os.path.join(run["checkpoint"], name)
            if os.path.isdir(path) and name != keep:  # older saves, unfinished *.tmp folders
                shutil.rmtree(path, ignore_errors=True)
        return True
    if run.get("checkpoint"):
        shutil.rmtree(run["checkpoint"], ignore_errors=True)
    return False


def card_name(index: int | None) -> str:
    """The GPU a run starts on (nvidia-smi's name of CUDA device `index`, or of the first one
    when index is None), "cpu" on a machine without nvidia-smi. Runs are paired with bf16 only
    on the same card: a chunked suite may get an H100 in one call and an H200 in the next."""
    command = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
    command += ["-i", str(index)] if index is not None else []
    try:
        result = subprocess.run(command, stdout=subprocess.PIPE, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "cpu"
    names = result.stdout.strip().splitlines()
    return names[0].strip() if result.returncode == 0 and names else "cpu"


def execute(runs: list[dict], *, parallel: int, timeout: float, gpus: int) -> None:
    """Run up to `parallel` at once, each under `timeout` seconds, the i-th started on GPU
    i % gpus (CUDA_VISIBLE_DEVICES; gpus 0 leaves it alone); record exit codes."""
    pending, active = list(runs), []
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env["PYTHONUNBUFFERED"] = "1"
    # Runs that start together compile together: each gets its share of the cores for
    # Inductor's compile workers (by default each run starts one per core).
    threads = max(1, (os.cpu_count() or 1) // max(1, parallel))
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(threads))
    started_runs = 0
    shared_card = None if gpus else card_name(None)
    while pending or active:
        while pending and len(active) < parallel:
            run = pending.pop(0)
            if gpus:
                env["CUDA_VISIBLE_DEVICES"] = str(started_runs % gpus)
            card = card_name(started_runs % gpus) if gpus else shared_card
            started_runs += 1
            with open(run["log"] + ".cmd", "w", encoding="utf-8") as handle:
                handle.write(shlex.join(run["command"][1:]) + "\n")
            resuming = _prepare_checkpoint(run)
            earlier = read_card(run["log"]) if resuming else None
            with open(run["log"] + ".card", "w", encoding="utf-8") as handle:
                handle.write(card_label(earlier, card) + "\n")
            log = open(run["log"], "a" if resuming else "w", encoding="utf-8")
            process = subprocess.Popen(
                run["command"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )
            active.append((run, process, log, time.monotonic()))
        time.sleep(0.2)
        for entry in list(active):
            run, process, log, started = entry
            if process.poll() is None and time.monotonic() - started > timeout:
                process.kill()
            if process.poll() is not None:
                log.close()
                run["returncode"], run["seconds"] = process.returncode, time.monotonic() - started
                active.remove(entry)
                if run.get("checkpoint") and done(run):
                    shutil.rmtree(run["checkpoint"], ignore_errors=True)  # kept only to resume
                elif process.returncode == 0 and _resumable(run):
                    run["left"] = True  # stopped by --stop-after-mins: a later call resumes it
                print(f"{run['job']} {run['recipe']}@{run['seed']}: exit {process.returncode}")


def plot_curves(rows: list[dict], output: str) -> str | None:
    """Every run's training loss, one panel per job, on one page; None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print("loss curves skipped: matplotlib is not installed (pip install matplotlib)")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    jobs = list(dict.fromkeys(row["job"] for row in rows))
    figure, axes = pyplot.subplots(len(jobs), 1, figsize=(11, 4 * len(jobs)), squeeze=False)
    recipes = list(dict.fromkeys(row["recipe"] for row in rows))
    colors = {recipe: f"C{i}" for i, recipe in enumerate(recipes)}
    styles = ["-", "--", ":", "-."]
    for axis, job in zip(axes[:, 0], jobs):
        seeds = sorted({row["seed"] for row in rows if row["job"] == job})
        for row in rows:
            if row["job"] == job and row.get("train_losses"):
                style = styles[seeds.index(row["seed"]) % len(styles)]
                label = f"{row['recipe']} seed {row['seed']}"
                axis.plot(
                    row["iterations"],
                    row["train_losses"],
                    style,
                    color=colors[row["recipe"]],
                    label=label,
                    linewidth=0.8,
                )
        axis.set_title(job)
        axis.set_xlabel("iteration")
        axis.set_ylabel("lm loss")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=7, ncol=max(1, len(seeds)))
    figure.tight_layout()
    figure.savefig(output, dpi=100)
    return output


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="/tmp/fidelity_suite")
    parser.add_argument("--corpus", nargs="+", default=["stdlib"], choices=["stdlib", "english"])
    parser.add_argument("--size", nargs="+", default=["128m"], choices=list(SIZES))
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES)
    parser.add_argument("--seeds", nargs="+", type=int, default=[1234, 1235, 1236])
    parser.add_argument("--iters", type=int, default=None, help="default: the size's own")
    parser.add_argument(
        "--micro-batch-size", type=int, default=None, help="sequences a step (default: the size's)"
    )
    parser.add_argument("--parallel", type=int, default=1, help="runs at once (one GPU)")
    parser.add_argument("--gpus", type=int, default=0, help="spread runs over N GPUs")
    parser.add_argument(
        "--no-run",
        dest="run",
        action="store_false",
        help="only summarize the logs already in --out (runs made by earlier "
        "calls, e.g. one call per seed)",
    )
    parser.add_argument(
        "--skip-done",
        action="store_true",
        help="do not rerun a run whose log in --out already has its validation loss",
    )
    parser.add_argument(
        "--max-runs",
        type=int,
        default=None,
        help="start at most N runs this call, in plan order (one device call's share); the "
        "rest are left for a later call with --skip-done",
    )
    parser.add_argument("--run-timeout", type=float, default=3600.0, help="seconds per run")
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        help="each run saves under DIR/<job>/<recipe>@<seed> and starts from its checkpoint "
        "there when one exists (its log appended to; keep --extra the same across calls); "
        "removed once the run has its validation loss. A fresh machine has none: the runs "
        "start again. Each finished run also writes its final save before it is removed",
    )
    parser.add_argument(
        "--stop-after-mins",
        type=float,
        default=None,
        help="each run saves and stops after this many minutes of training "
        "(--exit-duration-in-mins): a run longer than one device call goes on in the next "
        "call with --skip-done on the same machine (needs --checkpoint-dir)",
    )
    parser.add_argument("--tolerance", type=float, default=0.01)
    parser.add_argument(
        "--repeat-control",
        action="store_true",
        help=f"also run bf16 a second time at each seed ({CONTROL}), paired with bf16 like a "
        "recipe: the table's noise floor",
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--torch-compile (default: on, except for --size smoke)",
    )
    parser.add_argument("--stdlib-dir", default=None)
    parser.add_argument("--stdlib-mb", type=float, default=40.0)
    parser.add_argument("--english-dir", default=None)
    parser.add_argument("--english-mb", type=float, default=64.0)
    parser.add_argument(
        "--extra",
        nargs=argparse.REMAINDER,
        default=[],
        help="further pretrain_gpt.py flags for every run (last option)",
    )
    return _checked(parser, parser.parse_args(argv))


def _checked(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """args, or the parser's exit 2 with one line naming the flag and the fix."""
    if args.compile is None:
        args.compile = not any(size.endswith("smoke") for size in args.size)
    if args.max_runs is not None and args.max_runs < 1:
        parser.error(f"--max-runs must be at least 1, got {args.max_runs}")
    if args.stop_after_mins is not None and args.stop_after_mins <= 0:
        parser.error(f"--stop-after-mins must be positive, got {args.stop_after_mins}")
    if (args.stop_after_mins is None) != (args.checkpoint_dir is None):
        parser.error(
            "--stop-after-mins and --checkpoint-dir go together: the runs stopped after that "
            "many minutes save there, and the next call resumes them from there"
        )
    if args.micro_batch_size is not None and args.micro_batch_size < 1:
        parser.error(f"--micro-batch-size must be at least 1, got {args.micro_batch_size}")
    if len(args.seeds) < 2:
        parser.error("--seeds needs at least 2 seeds for an interval (the suite's claim uses 3)")
    return args


def refuse_other_commands(runs: list[dict], args: argparse.Namespace) -> None:
    """Exit 2 where a log this call would keep (skipped as done, or summarized by --no-run) or
    a checkpoint it would resume was made by another command than the run's."""
    for run in runs:
        kept = done(run) and (args.skip_done or not args.run)
        change = command_change(run) if kept or _resumable(run) else None
        if change:
            print(
                f"fidelity_suite.py: {run['log']} was made by another command ({change}): give "
                "the flags it was made with, or another --out and --checkpoint-dir",
                file=sys.stderr,
            )
            sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    runs = plan_runs(args)
    refuse_other_commands(runs, args)
    started = time.monotonic()
    if args.run:
        todo = [run for run in runs if not (args.skip_done and done(run))]
        for run in todo[args.max_runs :] if args.max_runs is not None else []:
            run["left"] = True
        todo = todo[: args.max_runs] if args.max_runs is not None else todo
        print(f"{len(todo)} of {len(runs)} runs start now ({len(runs) - len(todo)} done or left)")
        execute(todo, parallel=args.parallel, timeout=args.run_timeout, gpus=args.gpus)
    rows = read_results(runs)
    summaries = summarize(rows, compared_recipes(args), args.tolerance)
    with open(os.path.join(args.out, "runs.jsonl"), "w", encoding="utf-8") as handle:
        for row in rows:
            kept = {k: v for k, v in row.items() if k not in ("train_losses", "iterations")}
            handle.write(json.dumps(kept) + "\n")
    with open(os.path.join(args.out, "summary.jsonl"), "w", encoding="utf-8") as handle:
        for summary in summaries:
            handle.write(json.dumps(summary) + "\n")
    table = markdown_table(summaries)
    with open(os.path.join(args.out, "summary.md"), "w", encoding="utf-8") as handle:
        handle.write(f"Command: python3 {' '.join(sys.argv)}\n\n{table}")
    print(table)
    plot_curves(rows, os.path.join(args.out, "loss_curves.png"))
    seconds = time.monotonic() - started
    print(f"{len(runs)} runs planned; this call took {seconds:.0f} s; results in {args.out}")
    left = [r for r in rows if r["left"] and r["valid_loss"] is None]
    left = [r for r in left if r["returncode"] in (0, None)]  # a crash is a failure, left or not
    failed = [r for r in rows if r not in left]
    failed = [r for r in failed if r["valid_loss"] is None or r["returncode"] not in (0, None)]
    for row in failed:
        print(f"no validation loss or a failed run: {row['log']}")
    if left:
        print(f"{len(left)} runs left for a later call (--skip-done runs them)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
