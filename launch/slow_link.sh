#!/usr/bin/env bash
# Emulates two clusters joined by a slow link on one machine (root, iproute2 with tc):
# two network namespaces, one veth pair between them, a token-bucket rate limit on both ends.
#   launch/slow_link.sh up [RATE] [RTT_MS]  # RATE for tc tbf, default 50mbit; with RTT_MS > 0
#       the namespaces meet in a third, ms-router, whose launch/delay_link.py holds every
#       packet for RTT_MS/2 in each direction (user space: no netem here); worker 1's address
#       is then 10.213.78.1
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
ROUTER=ms-router
PIDFILE=/run/ms-delay-link.pid
case "${1:-}" in
  up)
    rate=${2:-50mbit}
    rtt=${3:-0}
    "$0" down
    for i in 0 1; do ip netns add "${NS[$i]}"; done
    if [ "$rtt" = 0 ]; then
      ip link add "${DEV[0]}" netns "${NS[0]}" type veth peer name "${DEV[1]}" netns "${NS[1]}"
      for i in 0 1; do ip -n "${NS[$i]}" addr add "${ADDR[$i]}/24" dev "${DEV[$i]}"; done
    else
      # Each cluster on its own subnet behind the router; every packet the router receives
      # from a cluster goes to the TUN device (table 100), comes back delayed, and is routed
      # on by the main table.
      ip netns add "$ROUTER"
      ip -n "$ROUTER" link set lo up
      for i in 0 1; do
        net=10.213.$((77 + i))
        ip link add "${DEV[$i]}" netns "${NS[$i]}" type veth peer name "ms-r$i" netns "$ROUTER"
        ip -n "${NS[$i]}" addr add "$net.1/24" dev "${DEV[$i]}"
        ip -n "$ROUTER" addr add "$net.254/24" dev "ms-r$i"
        ip -n "$ROUTER" link set "ms-r$i" up
        ip -n "$ROUTER" rule add iif "ms-r$i" table 100
      done
      ip netns exec "$ROUTER" sysctl -qw net.ipv4.ip_forward=1 net.ipv4.conf.all.rp_filter=0 \
        net.ipv4.conf.default.rp_filter=0
      ip -n "$ROUTER" tuntap add dev ms-delay mode tun
      ip netns exec "$ROUTER" sysctl -qw net.ipv4.conf.ms-delay.rp_filter=0
      ip -n "$ROUTER" link set ms-delay up
      ip -n "$ROUTER" route add default dev ms-delay table 100
      ip netns exec "$ROUTER" python3 launch/delay_link.py ms-delay "$(awk "BEGIN {print $rtt / 2}")" \
        >/dev/null 2>&1 &
      echo $! > "$PIDFILE"
    fi
    for i in 0 1; do
      ip -n "${NS[$i]}" link set "${DEV[$i]}" up
      ip -n "${NS[$i]}" link set lo up
      if [ "$rtt" != 0 ]; then
        ip -n "${NS[$i]}" route add default via "10.213.$((77 + i)).254"
      fi
      # A 32 kbit bucket keeps the rate honest on a short time scale (one TCP stream gets
      # 96 % of RATE from 10 to 300mbit here); latency bounds the queue, one FIFO per direction.
      ip netns exec "${NS[$i]}" tc qdisc add dev "${DEV[$i]}" root tbf rate "$rate" \
        burst "${BURST:-32kbit}" latency 400ms
    done ;;
  down)
    if [ -f "$PIDFILE" ]; then kill "$(cat "$PIDFILE")" 2>/dev/null || true; rm -f "$PIDFILE"; fi
    for ns in "${NS[@]}" "$ROUTER"; do
      if ip netns list | grep -qw "$ns"; then ip netns del "$ns"; fi
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
    sed -n '2,15p' "$0"; exit 2 ;;
esac
