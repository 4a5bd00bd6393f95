#!/usr/bin/env bash
# bash launch.sh RECIPE [key.path=value ...]
# Checks the recipe (exit 2 and one `error:` line if it is wrong, before anything starts),
# takes the process count from it, and runs torchrun. Multi-node: set NNODES, NODE_RANK,
# MASTER_ADDR, MASTER_PORT on every node (defaults: one node, localhost, a free port; with
# NNODES > 1 MASTER_PORT must be given, or each node would wait on a port of its own).
# Elastic: NNODES=MIN:MAX with parallelism.dp=auto and NPROC_PER_NODE (dtensor3d/launch/elastic.py);
# the job keeps training on the nodes it has when one is lost, and takes it back when it returns.
set -euo pipefail
PYTHON=${PYTHON:-python}
if [ $# -lt 1 ]; then
  echo "error: no recipe given; usage: bash launch.sh RECIPE [key.path=value ...], e.g. recipes/3d.yaml" >&2
  exit 2
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
NNODES_MAX=${NNODES##*:}  # NNODES=MIN:MAX: an elastic range
case "$NNODES" in ''|*[!0-9:]*|*:*:*|:*|*:) NNODES_OK=0;; *) NNODES_OK=$((10#${NNODES%%:*} > 0));; esac
if [ "$NNODES_OK" != 1 ]; then
  echo "error: NNODES='$NNODES' must be a positive integer N (the number of nodes) or an elastic range MIN:MAX (e.g. 1:2)" >&2; exit 2
fi
case "$NODE_RANK" in ''|*[!0-9]*) NODE_RANK_OK=0;; *) NODE_RANK_OK=$((10#$NODE_RANK < 10#$NNODES_MAX));; esac
if [ "$NODE_RANK_OK" != 1 ]; then
  echo "error: NODE_RANK='$NODE_RANK' must be an integer in 0..$((10#$NNODES_MAX - 1)) (NNODES=$NNODES)" >&2; exit 2
fi
NPROC_PER_NODE=${NPROC_PER_NODE:-0}
case "$NPROC_PER_NODE" in ''|*[!0-9]*)
  echo "error: NPROC_PER_NODE='$NPROC_PER_NODE' must be a positive integer (processes on each node)" >&2; exit 2;;
esac
if [ -n "${MASTER_PORT:-}" ]; then
  case "$MASTER_PORT" in ''|*[!0-9]*) PORT_OK=0;; *) PORT_OK=$((${#MASTER_PORT} <= 5 && 10#$MASTER_PORT >= 1 && 10#$MASTER_PORT <= 65535));; esac
  if [ "$PORT_OK" != 1 ]; then
    echo "error: MASTER_PORT='$MASTER_PORT' must be a port number in 1..65535 (a free port on node 0)" >&2; exit 2
  fi
elif [ "$((10#$NNODES_MAX))" -gt 1 ]; then  # each node would pick its own port and wait for the others forever
  echo "error: MASTER_PORT is not set but NNODES=$NNODES; with more than one node set the same MASTER_PORT (a free port on node 0, e.g. 29500) and MASTER_ADDR on every node" >&2; exit 2
fi
MAX_RESTARTS=${MAX_RESTARTS:-0}
case "$MAX_RESTARTS" in ''|*[!0-9]*)
  echo "error: MAX_RESTARTS='$MAX_RESTARTS' must be a non-negative integer (restarts after a failed rank; default 0)" >&2; exit 2;;
esac
if [ -n "${RDZV_KEEP_ALIVE_S+set}" ]; then  # multi-node: seconds of silence before the rendezvous drops a lost node
  case "$RDZV_KEEP_ALIVE_S" in ''|*[!0-9]*) KEEP_OK=0;; *) KEEP_OK=$((${#RDZV_KEEP_ALIVE_S} <= 6 && 10#$RDZV_KEEP_ALIVE_S >= 1));; esac
  if [ "$KEEP_OK" != 1 ]; then
    echo "error: RDZV_KEEP_ALIVE_S='$RDZV_KEEP_ALIVE_S' must be a positive integer (seconds of silence before the rendezvous drops a lost node; torch's default: 15)" >&2; exit 2
  fi
fi
if [ "$((10#$NNODES_MAX))" -gt 1 ]; then  # the job's nodes share checkpoint.dir's lock (checkpoint/lock.py)
  export DTENSOR3D_JOB="${RDZV_ID:-${SLURM_JOB_ID:-dtensor3d}}@$MASTER_ADDR:$MASTER_PORT"
fi
nproc=$("$PYTHON" -m dtensor3d validate "$@" --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE") || exit $?
if [ -z "${MASTER_PORT:-}" ]; then
  MASTER_PORT=$("$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
fi
# torch's elastic agent (dtensor3d/supervise.py: torchrun that passes SIGTERM/SIGINT on to the
# ranks, which save and exit 0). c10d rendezvous at MASTER_ADDR:MASTER_PORT (node 0 hosts it);
# a failed or killed rank restarts the job from the newest complete checkpoint, MAX_RESTARTS times;
# a rank exiting 2 (a wrong input, a non-finite step, a failed save) ends it at once.
exec "$PYTHON" -m dtensor3d.launch.supervise --nnodes="$NNODES" --node_rank="$NODE_RANK" \
  --nproc_per_node="$nproc" --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" \
  --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="${RDZV_ID:-${SLURM_JOB_ID:-dtensor3d}}" \
  --max-restarts="$MAX_RESTARTS" -m dtensor3d train "$@"
