#!/usr/bin/env bash
# Model A rows of an older tree and of this one in one job, interleaved (old row, then new row, for
# each name in ROWS), so drift of the machine falls on both alike: the "behaviour and speed
# unchanged" check of a restructuring. OLD is the older tree, e.g. made with
#   mkdir .old_tree && git archive 524c418 | tar -x -C .old_tree
# Each tree runs its own benchmarks/model_a_dp1.sh (so each with its own flags: the old one passes
# --torch-compile, this one uses the default). PRE_ROWS run once on this tree first (e.g. fsdp2).
#   OLD=.old_tree ROWS="bf16 tensorwise" PRE_ROWS=fsdp2 ITERS=12 bash benchmarks/model_a_old_vs_new.sh
# BENCH: another row script of the same interface (ROWS, OUT, ITERS; one JSON line per row in a
# .jsonl under OUT), e.g. the DeepSeek model M before and after a change:
#   OLD=.base BENCH=benchmarks/moe_model_m.sh DEEPSEEK=1 PRE_ROWS=bf16 ROWS=blockwise bash benchmarks/model_a_old_vs_new.sh
# Writes $OUT/old/<rows>.jsonl, $OUT/new/<rows>.jsonl and $OUT/old_vs_new.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/model_a_old_vs_new}
OLD=$(cd "${OLD:?set OLD to the older tree}" && pwd)
rm -rf "$OUT/old" "$OUT/new"  # one .jsonl a tree: rows of an earlier job (another BENCH) go
mkdir -p "$OUT/old" "$OUT/new"
BENCH=${BENCH:-benchmarks/model_a_dp1.sh}
[ -n "${PRE_ROWS:-}" ] && ROWS=$PRE_ROWS OUT=$OUT/new bash "$BENCH"
for row in ${ROWS:-bf16 tensorwise delayed blockwise mxfp8}; do
  (cd "$OLD" && ROWS=$row OUT=$OUT/old bash "$BENCH")
  ROWS=$row OUT=$OUT/new bash "$BENCH"
done
python3 - "$OUT" <<'PY' | tee "$OUT/old_vs_new.txt"
import glob, json, sys
def rows(tree):
    (path,) = glob.glob(f"{sys.argv[1]}/{tree}/*.jsonl")
    with open(path) as f:
        return {r.get("row", r.get("engine")): r for r in map(json.loads, f) if r.get("step_ms")}
old, new = rows("old"), rows("new")
print("| row | old step ms | new step ms | new/old | old peak GiB | new peak GiB |")
print("|---|---|---|---|---|---|")
for name in old:
    if name in new:
        o, n = old[name], new[name]
        print(f"| {name} | {o['step_ms']} | {n['step_ms']} | {n['step_ms'] / o['step_ms']:.4f} "
              f"| {o.get('peak_mem_gib')} | {n.get('peak_mem_gib')} |")
# This tree's rows against the compiled FSDP2 bf16 peer of the same job, else our bf16 row.
name = "fsdp2" if "fsdp2" in new else "bf16" if "bf16" in new else None
if name:
    base = new[name]
    print(f"\nnew rows vs {name} ({base['step_ms']} ms, {base['peak_mem_gib']} GiB):")
    for name, n in new.items():
        print(f"  {name}: {base['step_ms'] / n['step_ms']:.3f}x speed, "
              f"{n['peak_mem_gib'] / base['peak_mem_gib']:.3f}x peak")
PY
