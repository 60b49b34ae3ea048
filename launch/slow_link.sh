#!/usr/bin/env bash
# Emulates two clusters joined by a slow link on one machine (root, iproute2 with tc):
# two network namespaces, one veth pair between them, a token-bucket rate limit on both ends.
#   launch/slow_link.sh up [RATE]      # RATE for tc tbf, default 50mbit
#   launch/slow_link.sh down           # removes both namespaces (and the veth pair with them)
#   launch/slow_link.sh exec W CMD...  # runs CMD inside namespace W (0 or 1)
#   launch/slow_link.sh run W NPROC [pretrain_gpt.py flags...]
#       starts worker W's NPROC ranks (torchrun inside namespace W) as its own launch
#       (--diloco-worker-index W), joining worker 0's first rank at 10.213.77.1:MASTER_PORT.
#       Run it once per worker with the same flags, e.g. --diloco-workers 2.
# Inside a namespace, ranks talk over its own address (local, not rate limited); everything
# between the two namespaces crosses the limited veth pair. benchmarks/slow_link.py drives it.
set -euo pipefail
cd "$(dirname "$0")/.."
NS=(ms-cluster0 ms-cluster1)
DEV=(ms-veth0 ms-veth1)
ADDR=(10.213.77.1 10.213.77.2)
case "${1:-}" in
  up)
    rate=${2:-50mbit}
    "$0" down
    for i in 0 1; do ip netns add "${NS[$i]}"; done
    ip link add "${DEV[0]}" netns "${NS[0]}" type veth peer name "${DEV[1]}" netns "${NS[1]}"
    for i in 0 1; do
      ip -n "${NS[$i]}" addr add "${ADDR[$i]}/24" dev "${DEV[$i]}"
      ip -n "${NS[$i]}" link set "${DEV[$i]}" up
      ip -n "${NS[$i]}" link set lo up
      # A 32 kbit bucket keeps the rate honest on a short time scale (one TCP stream gets
      # 96 % of RATE from 10 to 300mbit here); latency bounds the queue, one FIFO per direction.
      ip netns exec "${NS[$i]}" tc qdisc add dev "${DEV[$i]}" root tbf rate "$rate" \
        burst "${BURST:-32kbit}" latency 400ms
    done ;;
  down)
    for i in 0 1; do
      if ip netns list | grep -qw "${NS[$i]}"; then ip netns del "${NS[$i]}"; fi
    done ;;
  exec)
    node=$2
    shift 2
    exec ip netns exec "${NS[$node]}" env GLOO_SOCKET_IFNAME="${DEV[$node]}" \
      OMP_NUM_THREADS=1 "$@" ;;
  run)
    node=$2 nproc=$3
    shift 3
    exec "$0" exec "$node" .venv/bin/python -m torch.distributed.run --standalone \
      --nproc-per-node "$nproc" pretrain_gpt.py --diloco-worker-index "$node" \
      --master-addr "${ADDR[0]}" --master-port "${MASTER_PORT:-29500}" "$@" ;;
  *)
    sed -n '2,12p' "$0"; exit 2 ;;
esac
