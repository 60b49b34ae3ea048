#!/usr/bin/env bash
# One node's share of one DiLoCo worker under SLURM: the deepspeed launcher without ssh.
# launch/slurm.sh runs it on every node of the worker's job step (srun --ntasks-per-node=1):
#   launch/worker.sh SLOTS DEVICES [pretrain_gpt.py flags...]
# SLOTS: devices per node (GPUs; CPU processes on a CPU node). DEVICES: the ones this worker
# uses on each node, "all" or a comma list (workers sharing a node get disjoint lists).
# The hostfile is the step's nodes in SLURM's order and this node's --node_rank its place in
# it, so the worker's ranks are node-major, as in any hostfile run. The flags carry
# --diloco-worker-index and the common --master-addr/--master-port, which take the
# launcher's local ranks to global ones; the launcher's own --master_addr then names only the
# host of the worker's own store (``distributed.join_worker_launch``).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
slots=$1 devices=$2
shift 2
nodelist=${SLURM_STEP_NODELIST:-$SLURM_JOB_NODELIST}
# SLURM's expansion of its host list where its tools are; inside a container (a step of
# pyxis/enroot, as in NVIDIA's images) they usually are not: the package's parser of the list.
if command -v scontrol > /dev/null; then
  mapfile -t hosts < <(scontrol show hostnames "$nodelist")
else
  mapfile -t hosts < <(cd "$repo" && .venv/bin/python -c 'import sys
from megatron_streaming.parallel.slurm import expand_hostlist
try:
    print(*expand_hostlist(sys.argv[1]), sep="\n")
except ValueError as e:
    sys.exit(f"worker.sh: {e}")' "$nodelist")
fi
if (( ${#hosts[@]} == 0 )); then
  echo "worker.sh: cannot read the step's nodes from '$nodelist'" >&2
  exit 2
fi
hostfile=$(mktemp "${TMPDIR:-/tmp}/hostfile.XXXXXX")
trap 'rm -f "$hostfile"' EXIT
node_rank=-1 include=""
for i in "${!hosts[@]}"; do
  echo "${hosts[$i]} slots=$slots" >> "$hostfile"
  [[ ${hosts[$i]} == "${SLURMD_NODENAME:-$(hostname -s)}" ]] && node_rank=$i
  include+="${include:+@}${hosts[$i]}:$devices"
done
if (( node_rank < 0 )); then
  echo "worker.sh: this node (${SLURMD_NODENAME:-$(hostname -s)}) is not in the step's" \
       "nodes ${hosts[*]}" >&2
  exit 2
fi
[[ $devices == all ]] && include=""
# SLURM signals every process of the step. The launcher here must outlive its ranks, which
# checkpoint on SIGTERM, so it ignores TERM; its child (deepspeed.launcher.launch) installs
# its own handler, passes TERM on to the ranks and kills them 30 s later.
trap '' TERM
"$repo/.venv/bin/deepspeed" --hostfile "$hostfile" ${include:+--include "$include"} --no_ssh \
  --node_rank "$node_rank" --master_addr "${hosts[0]}" "$repo/pretrain_gpt.py" "$@"
