#!/usr/bin/env bash
# One node's share of a multi-node run: the deepspeed launcher without ssh.
#   launch/node.sh HOSTFILE NODE_RANK MASTER_ADDR [pretrain_gpt.py flags...]
# HOSTFILE lists "host slots=N" lines in rank order; with --diloco-workers M, each worker is a
# contiguous block of WORLD/M ranks, so list one cluster's nodes together.
set -euo pipefail
cd "$(dirname "$0")/.."
hostfile=$1 node_rank=$2 master=$3
shift 3
exec .venv/bin/deepspeed --hostfile "$hostfile" --no_ssh --node_rank "$node_rank" \
  --master_addr "$master" --master_port "${MASTER_PORT:-29500}" pretrain_gpt.py "$@"
