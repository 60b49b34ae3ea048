"""torchrun's job for the tests' launches, from one process that imports what every rank imports
once and forks the ranks from it.

    python tests/preloaded_launcher.py NPROC SCRIPT [ARGS...]
    python tests/preloaded_launcher.py NPROC -m MODULE [ARGS...]

does what ``python -m torch.distributed.run --standalone --nproc-per-node NPROC SCRIPT ARGS``
does for this package's scripts: NPROC ranks of SCRIPT on this host, each with RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT (a free port on the
loopback; rank 0 hosts the store, as under any launcher without an agent store), the
launcher's output streams, the first failed rank stopping the others (SIGTERM, SIGKILL 30 s
later) and the launch exiting 1, SIGTERM and SIGINT passed on to the ranks. Only the start
differs: torch, DeepSpeed, megatron-core and this package are imported here, before the fork,
instead of in every rank (about 6 of a rank's 8 s of start-up on 2 cores). Each rank names
itself ``rank<LOCAL_RANK>`` (``/proc/<pid>/comm``), since a forked process keeps the
launcher's environment in ``/proc/<pid>/environ``.

Tests of the launchers themselves (torchrun, the deepspeed launcher, srun) run those.
"""

import os
import runpy
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GRACE_SECONDS = 30.0

# What a rank imports before its first step (the package imports lazily, inside functions).
PRELOAD = (
    "megatron_streaming.run.train", "megatron_streaming.run.start", "megatron_streaming.run.build",
    "megatron_streaming.run.metrics", "megatron_streaming.run.report",
    "megatron_streaming.job.elastic", "megatron_streaming.job.lifecycle",
    "megatron_streaming.worker.engine", "megatron_streaming.worker.model",
    "megatron_streaming.streaming.builder", "megatron_streaming.streaming.sync",
    "megatron_streaming.checkpoint", "megatron_streaming.checkpoint.job",
    "megatron_streaming.data.inputs", "megatron_streaming.cli.arguments",
    "deepspeed", "deepspeed.runtime.engine", "deepspeed.runtime.zero.stage_1_and_2",
    "megatron.core.models.gpt", "megatron.core.transformer.transformer_layer",
    "megatron.core.tensor_parallel", "megatron.core.pipeline_parallel",
    "megatron.core.dist_checkpointing", "megatron.core.datasets.blended_megatron_dataset_builder",
    "megatron.core.datasets.gpt_dataset", "megatron.core.transformer.moe.moe_layer",
    "torch.distributed.checkpoint", "torch.utils.tensorboard", "torch._dynamo",
    "megatron.core.tokenizers",
)


def _preload() -> None:
    import importlib

    sys.path.insert(0, str(REPO))
    from megatron_streaming.run import quiet

    quiet.install()  # as pretrain_gpt.main: before deepspeed and megatron-core warn on import
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001  an optional piece: the rank imports what it needs
            pass
    # What the imports made is kept out of the garbage collector's reach: a forked rank's
    # collections, its exit's last one above all (2.5 s of each launch's end at 4 ranks),
    # would otherwise walk those objects and so copy every page they live on.
    import gc

    gc.collect()
    gc.freeze()


def _run_rank(rank: int, nproc: int, port: int, script: str, args: list) -> None:
    """In the forked child: become rank ``rank`` of ``nproc`` (one: a lone process, its
    environment as given, no rank variables added) and run ``script`` as ``python script``
    would; its SystemExit ends this process (never returns to the launcher's code)."""
    from megatron_streaming.run import quiet

    if nproc > 1:
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank),
                           "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
                           "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "preloaded",
                           "TORCHELASTIC_RESTART_COUNT": "0"})
        try:
            with open("/proc/self/comm", "w") as f:
                f.write(f"rank{rank}")
        except OSError:
            pass
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
    if quiet._FILTER is not None:  # expected warnings: once per job, on rank 0 (quiet.py)
        quiet._FILTER.rank = quiet.launch_rank()
    if script == "-m":  # ``python -m MODULE ARGS``: the working directory first on the path
        sys.argv = [*args]
        sys.path[0] = os.getcwd()
        runpy.run_module(args[0], run_name="__main__", alter_sys=True)
    else:
        path = os.path.abspath(script)
        sys.argv = [script, *args]
        sys.path[0] = os.path.dirname(path)
        runpy.run_path(path, run_name="__main__")
    sys.exit(0)


def launch(nproc: int, script: str, args: list, client=None) -> int:
    """Fork the launch's processes from this (preloaded) one and wait for them: NPROC ranks
    as torchrun would start them, or, for 1, the script as a lone process. The exit status:
    1 if a rank failed, else 0 (a lone process's own status). ``client``: a socket whose end
    (EOF) means the launch was killed: its processes are killed too (``tests/zygote.py``)."""
    import select

    from harness import free_port

    port = int(os.environ.get("MASTER_PORT") or free_port()) if nproc > 1 else 0
    sys.stdout.flush()
    sys.stderr.flush()
    children = {}

    def stop(sig, _frame=None):
        for pid in list(children):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    # A signal that comes while the ranks are being forked waits until every one is known
    # (a rank may be running its script, seen by the test, before the last fork returns):
    # blocked here, the handlers in place, then let through. A rank unblocks its own once
    # its handlers are the defaults again, and does not hold the client's socket, so that a
    # launch that dies is seen by its client.
    forwarded = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, forwarded)
    signal.signal(signal.SIGTERM, lambda s, f: stop(signal.SIGTERM))
    signal.signal(signal.SIGINT, lambda s, f: stop(signal.SIGINT))
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            if client is not None:
                client.close()
            _run_rank(rank, nproc, port, script, args)
        children[pid] = rank
    signal.pthread_sigmask(signal.SIG_UNBLOCK, forwarded)
    failed, deadline, code = False, None, 0
    while children:
        if deadline is not None and time.monotonic() > deadline:
            stop(signal.SIGKILL)
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if client is not None and select.select([client], [], [], 0.05)[0] \
                    and not client.recv(1):  # the client is gone: so is the launch
                stop(signal.SIGKILL)
                client, deadline = None, time.monotonic()
            elif client is None:
                time.sleep(0.05)
            continue
        if pid not in children:
            continue
        del children[pid]
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and not failed:
            failed, deadline = True, time.monotonic() + GRACE_SECONDS
            stop(signal.SIGTERM)  # torchrun's agent: the others are stopped
    if nproc == 1:
        return code
    return 1 if failed else 0


def main() -> int:
    nproc, script, args = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    _preload()
    return launch(nproc, script, args)


if __name__ == "__main__":
    sys.exit(main())
