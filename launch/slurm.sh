#!/usr/bin/env bash
#SBATCH --job-name=megatron-streaming
#SBATCH --ntasks-per-node=1
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@300
# The SLURM batch script. Submit from the repository root (.venv set up by launch/setup.sh);
# the arguments are pretrain_gpt.py's flags, relative paths in them are from the submit dir.
#
# One job holding all M workers (one cluster):
#   sbatch --nodes=4 --gpus-per-node=8 --exclusive launch/slurm.sh --diloco-workers 2 ...
# The allocation's nodes (SLURM_JOB_NODELIST, in SLURM's order) split into M contiguous
# blocks, one job step per worker. With fewer nodes than workers, M/N workers share each
# node, each with its own GPUS_PER_NODE/(M/N) devices (the launcher's --include). Global
# rank 0 (the first node) hosts the rendezvous at --master-port, default MASTER_PORT or
# 20000 + job id % 20000.
#
# One job per cluster, one worker each, against a common rendezvous:
#   sbatch --nodes=2 ... launch/slurm.sh --diloco-workers 2 --diloco-worker-index 0 \
#       --master-addr HOST --master-port PORT ...
# and the same on the other cluster with --diloco-worker-index 1. HOST:PORT must be
# reachable from every cluster; it is worker 0's first node (global rank 0 hosts the store).
#
# GPUS_PER_NODE: ranks per node (default SLURM_GPUS_ON_NODE, else 1; on CPU nodes, CPU
# processes). USR1 (from --signal=B:USR1@300, 300 s before the time limit, or
# `scancel --signal=USR1 --batch JOB`) stops the run: SIGTERM to the job's steps, where
# pretrain_gpt.py checkpoints to --save and exits, then the job requeues itself (REQUEUE=0:
# it only stops) and the rerun resumes when --load is --save.
set -euo pipefail
die() { echo "slurm.sh: $*" >&2; exit 2; }

flag() {  # flag NAME ARGS...: the value of NAME in ARGS ("NAME V" or "NAME=V"; last wins)
  local name=$1 value=""
  shift
  while (( $# )); do
    case $1 in
      "$name") value=${2:-}; (( $# > 1 )) && shift ;;
      "$name"=*) value=${1#*=} ;;
    esac
    shift
  done
  echo "$value"
}

repo=${STREAMING_REPO:-${SLURM_SUBMIT_DIR:-.}}
[[ -x $repo/launch/worker.sh ]] ||
  die "no launch/worker.sh in $repo: submit from the repository root or set STREAMING_REPO"
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
slots=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}
workers=$(flag --diloco-workers "$@")
workers=${workers:-1}
index=$(flag --diloco-worker-index "$@")

declare -A steps=()  # srun pid -> worker index
start_step() {  # start_step WORKER NODES DEVICES [flags...]: one worker as one job step
  local worker=$1 step_nodes=$2 devices=$3
  shift 3
  srun --overlap --nodelist="$step_nodes" --nodes="$(tr , '\n' <<< "$step_nodes" | wc -l)" \
    --ntasks-per-node=1 --kill-on-bad-exit=1 \
    "$repo/launch/worker.sh" "$slots" "$devices" "$@" &
  steps[$!]=$worker
  echo "slurm.sh: worker $worker on $step_nodes (devices: $devices), step pid $!"
}

if [[ -n $index ]]; then
  [[ -n $(flag --master-addr "$@") && -n $(flag --master-port "$@") ]] ||
    die "--diloco-worker-index needs --master-addr and --master-port, the rendezvous" \
        "common to all workers' jobs (worker 0's first node)"
  start_step "$index" "$(IFS=,; echo "${nodes[*]}")" all "$@"
else
  addr=$(flag --master-addr "$@")
  port=$(flag --master-port "$@")
  rendezvous=(--master-addr "${addr:-${nodes[0]}}"
              --master-port "${port:-${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}}")
  n=${#nodes[@]}
  if (( n >= workers )); then
    (( n % workers == 0 )) || die "$n nodes do not split into $workers workers"
    per=$((n / workers))
    for ((w = 0; w < workers; w++)); do
      block=("${nodes[@]:w * per:per}")
      start_step "$w" "$(IFS=,; echo "${block[*]}")" all "$@" --diloco-worker-index "$w" \
        "${rendezvous[@]}"
    done
  else
    share=$((workers / n))
    (( workers % n == 0 && slots % share == 0 )) ||
      die "$workers workers do not share $n nodes of $slots devices evenly"
    each=$((slots / share))
    for ((w = 0; w < workers; w++)); do
      first=$(((w % share) * each))
      start_step "$w" "${nodes[w / share]}" "$(seq -s, "$first" $((first + each - 1)))" \
        "$@" --diloco-worker-index "$w" "${rendezvous[@]}"
    done
  fi
fi

stopping=0
on_usr1() {
  stopping=1
  echo "slurm.sh: USR1: SIGTERM to the job's steps (checkpoint to --save and exit)" >&2
  scancel --signal=TERM "$SLURM_JOB_ID"  # the steps only: without --batch/--full, not this shell
}
trap on_usr1 USR1

# Wait for every step. A failed one ends the job at once (ending the other workers' steps,
# which would only block at their next sync), unless the steps are being stopped on purpose.
while (( ${#steps[@]} )); do
  for pid in "${!steps[@]}"; do
    kill -0 "$pid" 2>/dev/null && continue
    wait "$pid" && rc=0 || rc=$?
    echo "slurm.sh: worker ${steps[$pid]}'s step exited with $rc"
    unset "steps[$pid]"
    (( rc == 0 || stopping )) || exit "$rc"
  done
  sleep 2 & wait $! || true  # in the background, so that USR1 is handled at once
done
if (( stopping )) && [[ ${REQUEUE:-1} != 0 ]]; then
  echo "slurm.sh: requeueing job $SLURM_JOB_ID" >&2
  scontrol requeue "$SLURM_JOB_ID"
fi
