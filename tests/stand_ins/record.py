"""Shared by the stand-ins: note once per process that a stand-in kernel ran."""

import os

_seen = set()


def ran(name: str) -> None:
    path = os.environ.get("STAND_IN_RECORD")
    if path and name not in _seen:
        _seen.add(name)
        with open(path, "a") as f:
            f.write(f"{name} {os.getpid()}\n")
