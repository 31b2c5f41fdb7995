#!/usr/bin/env bash
# Fidelity of the compiled FP8 fast path (issue 19, acceptance 5): a GPT of about 125M
# parameters trained ITERS (1,000) steps with `pretrain_gpt.py --torch-compile` on the
# quickstart corpus (scripts/prepare_quickstart_data.py: the running Python's standard library,
# byte-tokenized; MAX_MB of it), once in bf16 and once per FP8 recipe with FP8 parameters in
# Megatron-FSDP; the same seed, data order and schedule for every run. All runs start together
# on the one GPU (they are small), each under its own timeout.
# Prints (and writes to $OUT/fidelity.jsonl) each run's last train loss, its validation loss
# and the validation loss's ratio to the bf16 run's.
#   OUT=/tmp/fid bash benchmarks/fidelity_125m.sh
# Seeds (the spread of one recipe against the gap between recipes; the summary adds per-recipe
# means): RECIPES="bf16 bf16@2 bf16@3 tensorwise tensorwise@2 tensorwise@3 ..."
# Optimizer moments in other dtypes, paired with fp32 moments at the same seed (issue 37):
#   RECIPES="bf16 bf16+mbf16-bf16 tensorwise tensorwise+mbf16-bf16 tensorwise+mfp8-fp8"
# Smaller (a CPU check of the command lines): LAYERS=2 HIDDEN=128 FFN=384 HEADS=4 SEQ=128 \
#   MBS=2 ITERS=4 EVAL_ITERS=1 COMPILE= RECIPES="bf16 tensorwise" bash benchmarks/fidelity_125m.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fidelity_125m}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
ITERS=${ITERS:-1000}
RECIPES=${RECIPES:-bf16 tensorwise delayed blockwise mxfp8}
PREFIX=$(python3 scripts/prepare_quickstart_data.py --max-mb "${MAX_MB:-16}" \
  --output-dir "${DATA_DIR:-$OUT/data}" | tail -n 1)
# 12 layers, hidden 768, SwiGLU FFN 3584, byte vocabulary: 127.4M parameters in the layers.
MODEL=(
  --data-path "$PREFIX" --tokenizer-type ByteTokenizer --split 98,2,0
  --num-layers "${LAYERS:-12}" --hidden-size "${HIDDEN:-768}" --ffn-hidden-size "${FFN:-3584}"
  --num-attention-heads "${HEADS:-12}" --seq-length "${SEQ:-1024}"
  --max-position-embeddings "${SEQ:-1024}"
  --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
  --hidden-dropout 0 --attention-dropout 0 --bf16
  --micro-batch-size "${MBS:-8}" --global-batch-size "${GBS:-${MBS:-8}}" --train-iters "$ITERS"
  --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --lr-warmup-iters $((ITERS / 10))
  --weight-decay 0.1 --clip-grad 1.0
  --log-interval "${LOG_INTERVAL:-50}" --eval-interval "$ITERS" --eval-iters "${EVAL_ITERS:-32}"
  --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params
  ${COMPILE---torch-compile}
)
# The runs compile together: each gets its share of the cores for Inductor's compile workers.
runs=$(echo $RECIPES | wc -w)
threads=$(( $(nproc) / runs )); [ "$threads" -ge 1 ] || threads=1
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-$threads}
pids=()
for run in $RECIPES; do  # RECIPE[+mM1-M2][@SEED]: +m sets the AdamW moments' dtypes
  spec=${run%@*}  # e.g. tensorwise+mbf16-bf16@2: --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16
  recipe=${spec%%+*}
  seed=1234
  [ "$run" != "$spec" ] && seed=${run#*@}
  flags=(--seed "$seed")
  if [ "$spec" != "$recipe" ]; then
    moments=${spec#*+m}
    flags+=(--use-precision-aware-optimizer --exp-avg-dtype "${moments%-*}" --exp-avg-sq-dtype "${moments#*-}")
  fi
  [ "$recipe" != bf16 ] && flags+=(--fp8-recipe "$recipe" --fp8-format hybrid --fp8-param-gather)
  echo "== $run: pretrain_gpt.py ${MODEL[*]} ${flags[*]}" | tee -a "$OUT/fidelity.cmd"
  # The log's name: the run's with + and @ as _ (a device call returns only such names).
  timeout "${RUN_TIMEOUT:-540}" python3 pretrain_gpt.py "${MODEL[@]}" "${flags[@]}" \
    > "$OUT/$(echo "$run" | tr '+@' '__').log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
python3 - "$OUT" $RECIPES <<'PY' | tee "$OUT/fidelity.jsonl"
import json, os, re, sys
out, recipes = sys.argv[1], sys.argv[2:]
def last(pattern, text):
    found = re.findall(pattern, text)
    return float(found[-1]) if found else None
rows = {}
for recipe in recipes:
    log = recipe.replace("+", "_").replace("@", "_") + ".log"
    text = open(os.path.join(out, log)).read()
    times = [float(t) for t in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", text)]
    rows[recipe] = {
        "run": recipe,
        "train_loss": last(r"lm loss: ([0-9.E+-]+)", text),
        "valid_loss": last(r"lm loss value: ([0-9.E+-]+)", text),
        "iterations_logged": len(times),
        "last_step_ms": times[-1] if times else None,
    }
base = rows.get("bf16", {}).get("valid_loss")
for row in rows.values():
    valid = row["valid_loss"]
    row["valid_vs_bf16"] = round(valid / base, 5) if (valid and base) else None
    print(json.dumps(row))
# Several seeds of a recipe (RECIPE@SEED runs; a plain RECIPE is seed 1234): the mean
# validation loss per recipe, its spread, and the ratio of means to bf16's mean.
by_recipe = {}
for name, row in rows.items():
    if row["valid_loss"] is not None:
        by_recipe.setdefault(name.split("@")[0], []).append(row["valid_loss"])
if any(len(v) > 1 for v in by_recipe.values()):
    base_mean = sum(by_recipe["bf16"]) / len(by_recipe["bf16"]) if "bf16" in by_recipe else None
    for recipe, values in by_recipe.items():
        mean = sum(values) / len(values)
        print(json.dumps({
            "recipe": recipe, "seeds": len(values), "valid_mean": round(mean, 6),
            "valid_min": min(values), "valid_max": max(values),
            "mean_vs_bf16_mean": round(mean / base_mean, 5) if base_mean else None,
        }))
PY
exit $status
