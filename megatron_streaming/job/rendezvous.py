"""A standalone rendezvous store: the job's meeting point on a host of its own, so that it does
not die with any one worker.

    python -m megatron_streaming.job.rendezvous --port 29500           # launch/rendezvous.sh

By default global rank 0 hosts the job's store (``distributed.rendezvous_store``), so losing
worker 0's first node ends the job's rendezvous with it. With ``--rendezvous-external`` no
rank hosts it: every rank connects to ``--master-addr/--master-port``, where this process
serves it (a login node, or a third site both clusters reach). The store carries the door,
membership, the cross-worker groups' set-up (each worker's own world meets on a store of the
worker's) and the heartbeats; once training runs, losing it does not stop training (the
heartbeats reconnect when it is back, and the job stops only when it stays away longer than
``--distributed-timeout-minutes``). A restarted store starts empty, which is
enough for that: what it held was only needed at start-up.
"""

from __future__ import annotations

import argparse
import datetime
import signal
import sys
import threading


def serve(host: str, port: int, stop: threading.Event) -> None:
    """Serve a TCPStore on ``host:port`` until ``stop`` is set (SIGTERM / SIGINT)."""
    import torch.distributed as dist

    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    print(f"rendezvous store listening on {host}:{store.port}", flush=True)
    stop.wait()
    del store


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_streaming.job.rendezvous",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="0.0.0.0", help="address to listen on")
    ap.add_argument("--port", type=int, required=True,
                    help="port to listen on (the jobs' --master-port)")
    opts = ap.parse_args(argv)
    stop = threading.Event()
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: stop.set())
    try:
        serve(opts.host, opts.port, stop)
    except Exception as e:  # e.g. the port is taken
        print(f"{ap.prog}: error: cannot serve on {opts.host}:{opts.port}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
