#!/usr/bin/env bash
# Launch pretrain_gpt.py with torchrun on one node or many. Every argument goes to
# pretrain_gpt.py; the topology comes from the environment:
#
#   NPROC_PER_NODE  processes on this node (default: number of GPUs, or 1 without GPUs)
#   NNODES          number of nodes (default 1)
#   NODE_RANK       this node's index, 0..NNODES-1 (default 0)
#   MASTER_ADDR     address of node 0, reachable from every node (default localhost)
#   MASTER_PORT     a free TCP port on node 0 (default 29500)
#   PYTHON          interpreter (default python3)
#   MEGATRON_ENTRY  script to run (default pretrain_gpt.py; tests point it at a probe)
#
#   single node:  bash scripts/launch_torchrun.sh --mock-data --num-layers 2 ...
#   two nodes:    on each node, NNODES=2 NODE_RANK=<0|1> MASTER_ADDR=node0 \
#                     bash scripts/launch_torchrun.sh <same arguments>
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
ENTRY=${MEGATRON_ENTRY:-pretrain_gpt.py}

gpu_count() {
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
  else
    echo 0
  fi
}

if [ -z "${NPROC_PER_NODE:-}" ]; then
  NPROC_PER_NODE=$(gpu_count)
  [ "$NPROC_PER_NODE" -ge 1 ] || NPROC_PER_NODE=1
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}

for name in NPROC_PER_NODE NNODES NODE_RANK MASTER_PORT; do
  if ! [[ ${!name} =~ ^[0-9]+$ ]]; then
    echo "$name=${!name} must be a non-negative integer" >&2
    exit 1
  fi
done
if [ "$NPROC_PER_NODE" -lt 1 ] || [ "$NNODES" -lt 1 ] || [ "$NODE_RANK" -ge "$NNODES" ]; then
  echo "need NPROC_PER_NODE >= 1, NNODES >= 1 and 0 <= NODE_RANK < NNODES;" \
    "got NPROC_PER_NODE=$NPROC_PER_NODE NNODES=$NNODES NODE_RANK=$NODE_RANK" >&2
  exit 1
fi
if [ ! -f "$ENTRY" ]; then
  echo "$ENTRY not found in $(pwd); set MEGATRON_ENTRY or run from a full checkout" >&2
  exit 1
fi

echo "torchrun: node $NODE_RANK of $NNODES, $NPROC_PER_NODE processes per node," \
  "master $MASTER_ADDR:$MASTER_PORT"
# Each process is one rank; more intra-op threads than cores per rank only oversubscribe.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PYTHON" -m torch.distributed.run \
  --nnodes="$NNODES" \
  --node_rank="$NODE_RANK" \
  --nproc_per_node="$NPROC_PER_NODE" \
  --master_addr="$MASTER_ADDR" \
  --master_port="$MASTER_PORT" \
  "$ENTRY" "$@"
