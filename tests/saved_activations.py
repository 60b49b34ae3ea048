"""Bytes of activations one training step keeps for its backward, for a pretrain_gpt.py
configuration: what activation recompute exists to shrink.

    python tests/saved_activations.py flags...      (one process; prints one JSON line)

Every tensor autograd saves during the forward passes through a saved-tensors hook that adds
up its storage bytes (each storage counted once); the peak of that running total is what the
step holds at once, independent of the allocator and of the machine.
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_streaming.cli.arguments import parse_args  # noqa: E402
from megatron_streaming.run.train import Run  # noqa: E402


class SavedBytes:
    def __init__(self):
        self.live, self.peak, self.seen = 0, 0, {}

    def pack(self, tensor):
        key = (tensor.untyped_storage().data_ptr(), tensor.device)
        if key not in self.seen:
            size = tensor.untyped_storage().nbytes()
            self.seen[key] = size
            self.live += size
            self.peak = max(self.peak, self.live)
        return tensor, key

    def unpack(self, packed):
        tensor, key = packed
        size = self.seen.pop(key, 0)
        self.live -= size
        return tensor


def main():
    run = Run(parse_args(sys.argv[1:])).setup()
    iterator = run.data.train_iterator(0)
    run.engine.train_step(iterator, 0)  # warm-up: one-off buffers are not activations
    saved = SavedBytes()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        result = run.engine.train_step(iterator, 1)
    print(json.dumps({"peak_saved_bytes": saved.peak, "loss": result.loss}), flush=True)
    run.close()
    run.stop.close()
    sys.stderr.flush()
    # Out without the interpreter's teardown: a daemon thread caught inside a C++ call there
    # (a heartbeat store call on a loaded machine) aborts the process after its answer.
    os._exit(0)


if __name__ == "__main__":
    main()
