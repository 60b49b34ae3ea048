"""Resident memory of each rank by phase of the first steps: for finding which terms the
planner's memory model (``megatron_streaming/plan/memory.py``) misses.

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node=2 \\
        benchmarks/memory_phases.py <pretrain_gpt.py flags>

``pretrain_gpt.py`` with a step hook that prints, per rank, the resident set (VmRSS) and its
peak so far (VmHWM) from ``/proc/self/status``, in MiB: once the run is set up, after each
step's forward and backward (before the optimizer step) and after each optimizer step. Lines
read ``rank R <phase> rss=... peak=...``. On a GPU the same lines add the caching allocator's
``alloc=`` (held now) and ``max=`` (its peak since the line before: the peak is reset at every
line, so the forward-backward's and the optimizer step's peaks are told apart).

``saved=`` on the "after backward" lines: the bytes autograd saved for the step's backward
(unique storages, the parameters left out), what the activation term of the memory model
counts; the first step also lists them by shape and dtype (``saved`` lines), to tell which
tensor a term misses or counts twice.
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
    line = f"rss={out.get('VmRSS')} peak={out.get('VmHWM')}"
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        line += (f" alloc={torch.cuda.memory_allocated() >> 20}"
                 f" max={torch.cuda.max_memory_allocated() >> 20}")
        torch.cuda.reset_peak_memory_stats()
    return line


class Phases:
    """A step hook (``train.Run`` extensions)."""

    def __init__(self, run):
        import torch

        self.rank = run.topology.rank
        self.step = 0
        self.params = {p.untyped_storage().data_ptr() for p in run.model.parameters()}
        self.saved = {}  # storage -> (bytes, shape, dtype), this step's

        def pack(t):
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in self.params and key not in self.saved:
                self.saved[key] = (storage.nbytes(), tuple(t.shape),
                                   str(t.dtype).replace("torch.", ""))
            return t

        # Entered for good: the main thread's forwards run inside it from here on.
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t).__enter__()
        print(f"rank {self.rank} set up {_status()}", flush=True)

    def before_step(self, step):
        self.step = step
        total = f"{sum(n for n, _, _ in self.saved.values()) / 2**20:.1f}"
        print(f"rank {self.rank} step {step} after backward {_status()} saved={total}",
              flush=True)
        if step == 1:
            by = {}
            for n, shape, dtype in self.saved.values():
                count, size = by.get((shape, dtype), (0, 0))
                by[(shape, dtype)] = (count + 1, size + n)
            for (shape, dtype), (count, size) in sorted(by.items(), key=lambda x: -x[1][1]):
                print(f"rank {self.rank} saved {size / 2**20:10.2f} MiB {count:4d} x {dtype} "
                      f"{list(shape)}", flush=True)
        self.saved = {}

    def after_step(self):
        print(f"rank {self.rank} step {self.step} after optimizer {_status()}", flush=True)


if __name__ == "__main__":
    import pretrain_gpt

    pretrain_gpt.entry(extensions=[Phases])
