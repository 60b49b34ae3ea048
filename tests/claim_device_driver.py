"""``start_processes`` with CUDA faked, up to the job's rendezvous: what happened, in order.

    FAKE_GPUS=2 STAND_IN_IMPORTS=<file> RANK=.. WORLD_SIZE=.. LOCAL_RANK=.. \
        python tests/claim_device_driver.py <flags>

With the stand-in Transformer Engine on ``PYTHONPATH``, ``<file>`` gets, in order: each
``set_device N`` (a recording ``torch.cuda.set_device``), the stand-in's line ``transformer_engine
imported on device N`` (the device current at its import), then ``rendezvous`` where start-up
reaches the job's store (and stops), or ``refused: <message>``.
"""

import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def main() -> int:
    record, current = os.environ["STAND_IN_IMPORTS"], {}

    def note(line: str) -> None:
        with open(record, "a") as f:
            f.write(line + "\n")

    def set_device(device) -> None:
        current["device"] = int(device)
        note(f"set_device {int(device)}")

    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: int(os.environ["FAKE_GPUS"])
    torch.cuda.set_device = set_device
    torch.cuda.current_device = lambda: current.get("device", 0)  # as CUDA: 0 unless set

    from megatron_streaming.cli.arguments import parse_args
    from megatron_streaming.errors import ConfigError
    from megatron_streaming.parallel import distributed
    from megatron_streaming.run.start import start_processes

    def rendezvous(*args, **kwargs):
        note("rendezvous")
        raise SystemExit(0)

    distributed.rendezvous_store = rendezvous
    try:
        start_processes(parse_args(sys.argv[1:]))
    except ConfigError as e:
        note(f"refused: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
