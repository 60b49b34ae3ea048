"""Resident memory of each rank by phase of the first steps: for finding which terms the
planner's memory model (``megatron_streaming/plan/memory.py``) misses.

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node=2 \\
        benchmarks/memory_phases.py <pretrain_gpt.py flags>

``pretrain_gpt.py`` with a step hook that prints, per rank, the resident set (VmRSS) and its
peak so far (VmHWM) from ``/proc/self/status``, in MiB: once the run is set up, after each
step's forward and backward (before the optimizer step) and after each optimizer step. Lines
read ``rank R <phase> rss=... peak=...``.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _status() -> str:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) // 1024
    return f"rss={out.get('VmRSS')} peak={out.get('VmHWM')}"


class Phases:
    """A step hook (``train.Run`` extensions)."""

    def __init__(self, run):
        self.rank = run.topology.rank
        self.step = 0
        print(f"rank {self.rank} set up {_status()}", flush=True)

    def before_step(self, step):
        self.step = step
        print(f"rank {self.rank} step {step} after backward {_status()}", flush=True)

    def after_step(self):
        print(f"rank {self.rank} step {self.step} after optimizer {_status()}", flush=True)


if __name__ == "__main__":
    import pretrain_gpt

    pretrain_gpt.entry(extensions=[Phases])
