#!/usr/bin/env bash
# SLURM entry point: one deepspeed launcher per node, each starting GPUS_PER_NODE ranks.
#   sbatch --nodes=4 --ntasks-per-node=1 --gpus-per-node=8 launch/slurm.sh \
#       --diloco-workers 2 --tensor-model-parallel-size 8 --data-path ... [flags]
# Nodes are ranked in SLURM's order, so worker w gets the w-th block of NODES/M nodes:
# allocate each cluster's nodes contiguously. Set .venv up first (launch/setup.sh).
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
gpus=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
hostfile=${HOSTFILE:-runs/hostfile.$SLURM_JOB_ID}
mkdir -p "$(dirname "$hostfile")"
for node in "${nodes[@]}"; do echo "$node slots=$gpus"; done > "$hostfile"
export MASTER_PORT=${MASTER_PORT:-29500}
srun --ntasks-per-node=1 bash -c \
  'exec launch/node.sh "$0" "$SLURM_NODEID" "$1" "${@:2}"' "$hostfile" "${nodes[0]}" "$@"
