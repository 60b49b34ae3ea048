#!/usr/bin/env bash
# Emulates two clusters joined by a slow link on one machine (root, iproute2 with tc):
# two network namespaces, one veth pair between them, a token-bucket rate limit on both ends.
#   launch/slow_link.sh up [RATE]     # RATE for tc tbf, default 50mbit
#   launch/slow_link.sh down
#   launch/slow_link.sh run W NNODES NPROC [pretrain_gpt.py flags...]
#       runs node W (0 or 1) of a torchrun job inside namespace W; node 0 is the master.
# Inside a namespace, ranks of the same node talk over its own address (not rate limited);
# everything between the two namespaces crosses the limited veth pair.
set -euo pipefail
cd "$(dirname "$0")/.."
NS=(ms-cluster0 ms-cluster1)
DEV=(ms-veth0 ms-veth1)
ADDR=(10.213.77.1 10.213.77.2)
case "${1:-}" in
  up)
    rate=${2:-50mbit}
    "$0" down 2>/dev/null || true
    for i in 0 1; do ip netns add "${NS[$i]}"; done
    ip link add "${DEV[0]}" netns "${NS[0]}" type veth peer name "${DEV[1]}" netns "${NS[1]}"
    for i in 0 1; do
      ip -n "${NS[$i]}" addr add "${ADDR[$i]}/24" dev "${DEV[$i]}"
      ip -n "${NS[$i]}" link set "${DEV[$i]}" up
      ip -n "${NS[$i]}" link set lo up
      ip netns exec "${NS[$i]}" tc qdisc add dev "${DEV[$i]}" root tbf rate "$rate" \
        burst 32kbit latency 400ms
    done ;;
  down)
    for i in 0 1; do ip netns del "${NS[$i]}" 2>/dev/null || true; done ;;
  run)
    node=$2 nnodes=$3 nproc=$4
    shift 4
    exec ip netns exec "${NS[$node]}" env GLOO_SOCKET_IFNAME="${DEV[$node]}" \
      OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --nnodes "$nnodes" \
      --node-rank "$node" --nproc-per-node "$nproc" --master-addr "${ADDR[0]}" \
      --master-port "${MASTER_PORT:-29500}" pretrain_gpt.py "$@" ;;
  *)
    sed -n '2,10p' "$0"; exit 2 ;;
esac
