# Sourced by the benchmark row scripts (model_a_dp1.sh, moe_model_m.sh). Set OUT, WARMUP and
# ROWS_NAME (the base name of the job's log and JSON lines under $OUT) first.
#   row NAME CMD...   runs CMD (at most ${RUN_TIMEOUT:-240} s) into $OUT/NAME.log, noting it in
#                     $OUT/$ROWS_NAME.log
#   summarize NAME    appends {row, step_ms (median logged iteration after WARMUP), mean_ms,
#                     steps, peak_mem_gib} of $OUT/NAME.log to $OUT/$ROWS_NAME.jsonl
#   CLOCKS=1          also samples the GPU's power and clocks each second while a row runs
#                     (`nvidia-smi dmon -s pc`) into $OUT/NAME.dmon: a row whose later steps slow
#                     down can then be read against the SM clock
row() {
  local name=$1 dmon=""; shift
  echo "== $name: $*" | tee -a "$OUT/$ROWS_NAME.log"
  if [ "${CLOCKS:-0}" = 1 ] && command -v nvidia-smi > /dev/null; then
    nvidia-smi dmon -s pc -d 1 -o T > "$OUT/$name.dmon" 2>&1 &
    dmon=$!
  fi
  timeout "${RUN_TIMEOUT:-240}" "$@" > "$OUT/$name.log" 2>&1
  local status=$?
  [ -n "$dmon" ] && kill "$dmon" 2> /dev/null
  echo "exit $status ($name)" | tee -a "$OUT/$ROWS_NAME.log"
}
summarize() {
  python3 - "$OUT/$1.log" "$1" "$WARMUP" <<'PY' | tee -a "$OUT/$ROWS_NAME.jsonl"
import json, re, statistics, sys
text = open(sys.argv[1]).read()
times = [float(t) for t in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", text)]
mem = [float(m) for m in re.findall(r"max allocated: ([0-9.]+)", text)]
steady = times[int(sys.argv[3]):]
print(json.dumps({"row": sys.argv[2], "step_ms": round(statistics.median(steady), 1) if steady else None,
                  "mean_ms": round(statistics.mean(steady), 1) if steady else None,
                  "steps": len(steady), "peak_mem_gib": max(mem) if mem else None}))
PY
}
