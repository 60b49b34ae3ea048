"""Two network namespaces joined by a veth pair: two "clusters" whose link a test can cut.

Needs root and ``ip`` (iproute2); ``available()`` says whether this machine has them. The
addresses live only inside the namespaces, so concurrent tests do not collide.
"""

import os
import shutil
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def available() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    name = f"msprobe{os.getpid()}"
    if _ip("netns", "add", name, check=False).returncode != 0:
        return False
    try:  # and veth pairs (a kernel without them refuses here)
        return _ip("-n", name, "link", "add", "pa", "type", "veth", "peer", "name", "pb",
                   check=False).returncode == 0
    finally:
        _ip("netns", "del", name, check=False)


@dataclass
class Link:
    names: tuple      # the two namespaces
    addresses: tuple  # each side's address on the veth pair
    devices: tuple    # each side's veth device (for GLOO_SOCKET_IFNAME)

    def run_in(self, side: int, command: list) -> list:
        """``command`` run inside side ``side``'s namespace."""
        return ["ip", "netns", "exec", self.names[side], *command]

    def cut(self, state: str = "down") -> None:
        """Take both ends of the link down: packets are dropped, no connection is reset."""
        for side in (0, 1):
            _ip("-n", self.names[side], "link", "set", self.devices[side], state)

    def restore(self) -> None:
        """Bring the link back up (the addresses stay; the routes come back)."""
        self.cut("up")


@contextmanager
def two_namespaces():
    tag = f"{os.getpid() % 100000}"
    names = (f"ms{tag}a", f"ms{tag}b")
    devices = (f"v{tag}a", f"v{tag}b")
    addresses = ("10.77.0.1", "10.77.0.2")
    try:
        for n in names:
            _ip("netns", "add", n)
            _ip("-n", n, "link", "set", "lo", "up")
        _ip("link", "add", devices[0], "type", "veth", "peer", "name", devices[1])
        for side in (0, 1):
            _ip("link", "set", devices[side], "netns", names[side])
            _ip("-n", names[side], "addr", "add", f"{addresses[side]}/24", "dev",
                devices[side])
            _ip("-n", names[side], "link", "set", devices[side], "up")
        yield Link(names, addresses, devices)
    finally:
        for n in names:  # deleting a namespace deletes its end of the veth pair, and the pair
            _ip("netns", "del", n, check=False)
