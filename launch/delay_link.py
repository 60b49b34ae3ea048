"""Adds a fixed one-way delay to every packet routed through a TUN device (user space: this
kernel has no netem). ``launch/slow_link.sh up RATE RTT_MS`` runs it in the router namespace
between the two clusters' namespaces, where policy routing sends every packet that arrives
from either cluster into the TUN device; this process holds each packet for RTT/2 and writes
it back, and the kernel forwards it on to the other cluster. Both directions pass once, so a
round trip takes RTT plus what the link itself adds.

    python3 launch/delay_link.py DEVICE DELAY_MS

Standard library only; one reader thread and one writer, packets in arrival order (one delay
for all, so a FIFO is exact).
"""

import collections
import fcntl
import os
import struct
import sys
import threading
import time

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def main() -> None:
    name, delay = sys.argv[1], float(sys.argv[2]) / 1000.0
    fd = open_tun(name)
    queue = collections.deque()
    ready = threading.Condition()

    def read_packets() -> None:
        while True:
            packet = os.read(fd, 65536)
            with ready:
                queue.append((time.monotonic() + delay, packet))
                ready.notify()

    threading.Thread(target=read_packets, daemon=True).start()
    while True:
        with ready:
            while not queue:
                ready.wait()
            due, packet = queue[0]
            wait = due - time.monotonic()
            if wait > 0:
                ready.wait(wait)  # woken early by a new packet: the head is still first
                continue
            queue.popleft()
        os.write(fd, packet)


if __name__ == "__main__":
    main()
