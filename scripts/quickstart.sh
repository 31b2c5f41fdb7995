#!/usr/bin/env bash
# The README's train command: installs what is needed, turns the Python standard library's
# source files into a byte-level corpus (once, cached), and trains a small GPT on CPU.
# Extra arguments are passed to pretrain_gpt.py (e.g. --fp8-recipe tensorwise, --train-iters 50).
#
# Each set of extra arguments gets its own run directory, runs/quickstart/<name>/ (name: the
# arguments, or "default"; RUN_NAME=... overrides), holding checkpoints/ and train.log, so a
# rerun with other flags never resumes from or overwrites another run's checkpoints.
# Resume: the same flags plus `--load runs/quickstart/<name>/checkpoints` continue an
# interrupted run in that run directory; train on past the end with `--train-iters N
# --use-checkpoint-opt_param-scheduler` added (the learning rate stays at the schedule's end).
set -euo pipefail
cd "$(dirname "$0")/.."
# One torch thread unless the user chose: with torch's default of one thread per core, a
# 2-core machine slowed 10-25x per iteration whenever another process took a core (threads
# wait for each other at every op), while one thread stayed within 0.36-0.53 s.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# --load DIR resumes: a run directory's checkpoints/ continue in that run directory (same
# checkpoints/, train.log appended); the run is named by the other flags.
LOAD_DIR="" NAME_ARGS=() prev=""
for arg in "$@"; do
  case "$prev|$arg" in
    --load\|*) LOAD_DIR=$arg ;;
    *\|--load=*) LOAD_DIR=${arg#--load=} ;;
    *\|--load) ;;
    *) NAME_ARGS+=("$arg") ;;
  esac
  prev=$arg
done
if [[ -n $LOAD_DIR && ! -d $LOAD_DIR ]]; then
  echo "quickstart: error: --load $LOAD_DIR: no such directory" >&2
  exit 2
fi

run_name() {
  local name="" arg
  for arg in "$@"; do
    arg=${arg#--}
    name+="${name:+_}${arg//[^A-Za-z0-9.=-]/-}"
  done
  echo "${name:-default}"
}
RUN_NAME=${RUN_NAME:-$(run_name "${NAME_ARGS[@]+"${NAME_ARGS[@]}"}")}
RUN_NAME=${RUN_NAME:0:100}
RUN_DIR=${OUTPUT_DIR:-runs/quickstart}/$RUN_NAME
if [[ -n $LOAD_DIR && $(basename "$LOAD_DIR") == checkpoints ]]; then
  RUN_DIR=$(dirname "$LOAD_DIR")
fi
# A finished or interrupted run is never trained over from scratch: its train.log and checkpoint
# tracker would be replaced (a later --load would resume the new, shorter run).
TRACKER=$RUN_DIR/checkpoints/latest_checkpointed_iteration.txt
if [[ -z $LOAD_DIR && -f $TRACKER ]]; then
  echo "quickstart: error: $RUN_DIR already holds a run (checkpoint of iteration $(cat "$TRACKER")):" \
    "resume it with bash scripts/quickstart.sh ${NAME_ARGS[*]+${NAME_ARGS[*]} }--load" \
    "$RUN_DIR/checkpoints (past its end: add --train-iters N --use-checkpoint-opt_param-scheduler)," \
    "start another with RUN_NAME=<name>, or remove $RUN_DIR" >&2
  exit 2
fi
source scripts/python_env.sh
MEGATRON_EXTRAS=${MEGATRON_EXTRAS:-progress} bash scripts/setup_env.sh
PREFIX=$("$PYTHON" scripts/prepare_quickstart_data.py | tail -n 1)
mkdir -p "$RUN_DIR"
# QUICKSTART_ITERS shortens the run (warmup a tenth of it) without changing the run directory's
# name: tests/unit_tests/ecosystem/test_readme_blocks.py runs the README's commands so.
ITERS=${QUICKSTART_ITERS:-300}
expect="3-4 minutes on 2 CPU cores, longer while other processes compete for them"
[[ $ITERS == 300 ]] || expect="$ITERS iterations of about 0.5 s on 2 CPU cores"
case " $* " in
  *" --fp8-recipe"*) expect="FP8 on CPU emulates its GEMMs (dequantize, then multiply): slower than without FP8" ;;
esac
case " $* " in
  *" --torch-compile "*) echo "quickstart: --torch-compile: the first iteration compiles the layers" \
    "(30-45 s on 2 cores) before any log line" ;;
esac
echo "quickstart: run directory $RUN_DIR (checkpoints/, train.log); OMP_NUM_THREADS=$OMP_NUM_THREADS"
echo "quickstart: training ($ITERS iterations unless --train-iters says otherwise; a log line every 20): $expect"
# -u: unbuffered, so each log line reaches the terminal and train.log as it is printed.
"$PYTHON" -u pretrain_gpt.py \
  --data-path "$PREFIX" --tokenizer-type ByteTokenizer --split 98,2,0 \
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
  --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear \
  --ffn-hidden-size 352 --hidden-dropout 0 --attention-dropout 0 \
  --micro-batch-size 16 --global-batch-size 32 --train-iters "$ITERS" \
  --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters $((ITERS / 10)) \
  --weight-decay 0.1 \
  --clip-grad 1.0 --log-interval $((ITERS < 20 ? 1 : 20)) --eval-interval 100 --eval-iters 4 --seed 1234 \
  --save "$RUN_DIR/checkpoints" \
  "$@" 2>&1 | tee ${LOAD_DIR:+-a} "$RUN_DIR/train.log"
if [[ -d $RUN_DIR/checkpoints ]]; then
  echo "quickstart: log $RUN_DIR/train.log, checkpoints $RUN_DIR/checkpoints" \
    "(resume: bash scripts/quickstart.sh ${NAME_ARGS[*]+${NAME_ARGS[*]} }--load $RUN_DIR/checkpoints)"
else
  echo "quickstart: log $RUN_DIR/train.log (no checkpoint was saved)"
fi
