#!/usr/bin/env bash
# SLURM for real, on one host: install Debian's slurm (slurmctld, slurmd, munge) when missing,
# start a one-node cluster on 127.0.0.1 from a configuration written here, and submit
# examples/slurm.sbatch shrunk to this machine (one node, no GPUs, dp 2 on CPU):
#   1. a job trains to the end (`done:` in its output);
#   2. a longer job gets `scancel --signal=TERM` mid-run: one `preempted:` line and a checkpoint
#      at that step; the same script submitted again resumes from it and trains to the end.
#
#   bash bench/slurm_check.sh [WORK_DIR]
# Exit 0: all of it held; 1: something did not (the line says what); 77: this machine cannot run
# slurmd (not root, no apt-get, or the daemons would not start) -- the reason is printed.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${1:-$(mktemp -d /tmp/slurm-check-XXXXXX)}
mkdir -p "$WORK"
PYTHON=${PYTHON:-python}
skip() { echo "skip: $*"; exit 77; }
fail() { echo "FAILED: $*"; tail -n 30 "$WORK"/*.out 2>/dev/null; cleanup; exit 1; }

[ "$(id -u)" = 0 ] || skip "slurmd and munged need root here (this is uid $(id -u))"
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
  command -v apt-get >/dev/null || skip "slurm is not installed and there is no apt-get to install it"
  echo "installing slurmctld, slurmd, slurm-client and munge (apt-get)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge \
    >"$WORK/apt.log" 2>&1 || skip "apt-get could not install slurm (see $WORK/apt.log)"
fi

HOST=$(hostname -s)
CPUS=$(nproc)
MEM=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
CONF="$WORK/slurm.conf"
mkdir -p "$WORK/state" "$WORK/spool" "$WORK/log"
cat >"$CONF" <<EOF
ClusterName=dtensor3d-check
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=16817
SlurmdPort=16818
AuthType=auth/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$WORK/state
SlurmdSpoolDir=$WORK/spool
SlurmctldPidFile=$WORK/slurmctld.pid
SlurmdPidFile=$WORK/slurmd.pid
SlurmctldLogFile=$WORK/log/slurmctld.log
SlurmdLogFile=$WORK/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
JobAcctGatherType=jobacct_gather/none
KillWait=60
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM State=UNKNOWN
PartitionName=check Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
export SLURM_CONF="$CONF"

cleanup() {
  scancel --quiet --user=root 2>/dev/null
  [ -f "$WORK/slurmd.pid" ] && kill "$(cat "$WORK/slurmd.pid")" 2>/dev/null
  [ -f "$WORK/slurmctld.pid" ] && kill "$(cat "$WORK/slurmctld.pid")" 2>/dev/null
  [ -f "$WORK/munged.pid" ] && kill "$(cat "$WORK/munged.pid")" 2>/dev/null
}
trap cleanup EXIT

mkdir -p /run/munge && chown munge:munge /run/munge 2>/dev/null
if ! pgrep -x munged >/dev/null; then
  su -s /bin/sh munge -c "munged --pid-file=$WORK/munged.pid" 2>"$WORK/log/munged.err" \
    || munged --force --pid-file="$WORK/munged.pid" 2>"$WORK/log/munged.err" \
    || skip "munged would not start: $(tail -n 1 "$WORK/log/munged.err")"
fi
slurmctld -f "$CONF" || skip "slurmctld would not start (see $WORK/log/slurmctld.log)"
slurmd -f "$CONF" || skip "slurmd would not start (see $WORK/log/slurmd.log)"
for _ in $(seq 60); do
  sinfo -h -o %T 2>/dev/null | grep -qE "idle|mixed" && break
  scontrol update nodename="$HOST" state=resume >/dev/null 2>&1
  sleep 1
done
sinfo -h -o %T | grep -qE "idle|mixed" || skip "the one-node cluster did not come up: $(sinfo -h 2>&1)"
echo "cluster up: $(sinfo -h -o '%P %D %T %c CPUs')"

# examples/slurm.sbatch, shrunk: one node, no GPUs, this machine's CPUs; dp 2 on CPU.
RECIPE="$ROOT/tests/recipes/parity.yaml"
COMMON=(parallelism.dp=2 training.eval_every=0 training.device=cpu "checkpoint.dir=$WORK/ckpt" checkpoint.interval=2
        "logging.run_dir=$WORK/run")
submit() {  # submit NAME STEPS: the job id
  (cd "$ROOT" && sbatch --parsable --nodes=1 --gpus-per-node=0 --cpus-per-task="$CPUS" --time=30 \
    --export=ALL,PYTHON="$PYTHON",PATH="$PATH",PYTHONPATH="${PYTHONPATH:-}",MASTER_PORT=29731 \
    --job-name="$1" --output="$WORK/$1.out" examples/slurm.sbatch "$RECIPE" "${COMMON[@]}" "training.steps=$2")
}
state() { scontrol show job "$1" 2>/dev/null | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p'; }
wait_done() {  # wait_done JOBID SECONDS (polled every 0.2 s)
  for _ in $(seq "$(($2 * 5))"); do
    case "$(state "$1")" in COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|"") return 0;; esac
    sleep 0.2
  done
  return 1
}

# 1. A job trains to the end.
job=$(submit train 6) || fail "sbatch refused the job"
wait_done "$job" 600 || fail "job $job did not end in 600 s"
grep -q "^done:" "$WORK/train.out" || fail "job $job ($(state "$job")) did not train to the end"
echo "1. sbatch examples/slurm.sbatch: job $job trained 6 steps: $(grep '^done:' "$WORK/train.out")"

# 2. scancel --signal=TERM mid-run, then the same script again.
rm -rf "$WORK/ckpt" "$WORK/run"
job=$(submit preempt 16) || fail "sbatch refused the job"
for _ in $(seq 3000); do grep -qE "^step +4 " "$WORK/preempt.out" 2>/dev/null && break; sleep 0.1; done
grep -qE "^step +4 " "$WORK/preempt.out" || fail "job $job did not reach step 4"
scancel --signal=TERM "$job" || fail "scancel refused"
wait_done "$job" 300 || fail "job $job did not end after SIGTERM"
lines=$(grep -c "^preempted:" "$WORK/preempt.out")
[ "$lines" = 1 ] || fail "expected one preempted: line, got $lines"
stopped=$(sed -n 's/^preempted: .* stopped after step \([0-9]*\);.*/\1/p' "$WORK/preempt.out")
[ -d "$WORK/ckpt/step_$(printf %08d "$stopped")" ] || fail "no checkpoint at step $stopped"
echo "2. scancel --signal=TERM: $(grep '^preempted:' "$WORK/preempt.out")"
job=$(submit resume 16) || fail "sbatch refused the resubmission"
wait_done "$job" 600 || fail "job $job did not end in 600 s"
grep -q "resumed from $WORK/ckpt/step_$(printf %08d "$stopped") at step $stopped" "$WORK/resume.out" \
  || fail "the resubmission did not resume from step $stopped"
grep -q "^done:" "$WORK/resume.out" || fail "the resubmission did not train to the end"
echo "3. resubmitted: $(grep 'resumed from' "$WORK/resume.out"); $(grep '^done:' "$WORK/resume.out")"
echo "slurm check: passed"
