"""Train a GPT with Megatron-core inside DeepSpeed ZeRO, as one or more DiLoCo workers.

    deepspeed --num_gpus 4 pretrain_gpt.py --mock-data --tensor-model-parallel-size 2 \\
        --diloco-workers 2 --train-iters 50
    torchrun --nproc_per_node 4 pretrain_gpt.py --mock-data --pipeline-model-parallel-size 2

Flags: ``python pretrain_gpt.py --help``. This file only parses flags and calls the library.
"""

import os
import sys
import traceback


EXIT_GRACE_SECONDS = 30.0


def _leave(code: int) -> None:
    """Exit with ``code`` after a failure, the normal way (the run has closed itself). Helper
    processes still running (a checkpoint writer's) are stopped so they do not hold the
    launcher's pipes open. Interpreter shutdown should not block (the
    cross-worker thread is a daemon); should something upstream still wait on a dead peer
    there, a watchdog ends the process after ``EXIT_GRACE_SECONDS``."""
    import multiprocessing
    import threading
    import time

    for child in multiprocessing.active_children():
        child.terminate()
    sys.stdout.flush()
    sys.stderr.flush()

    def watchdog():
        time.sleep(EXIT_GRACE_SECONDS)
        os._exit(code)

    threading.Thread(target=watchdog, name="exit-watchdog", daemon=True).start()
    sys.exit(code)


def main(argv=None, extensions=()) -> int:
    from megatron_streaming.run import quiet

    quiet.install()  # before deepspeed and megatron are imported: they warn on import
    from megatron_streaming.cli.arguments import parse_args
    from megatron_streaming.errors import JobFailure, UsageError
    from megatron_streaming.run.train import pretrain
    from patches import UpstreamVersionError

    try:
        pretrain(parse_args(argv), extensions)
    except (UsageError, UpstreamVersionError) as e:  # bad input or an unsupported torch (one
        # line per problem, before any training); bugs keep their traceback
        for line in str(e).splitlines():
            print(f"pretrain_gpt.py: error: {line}", file=sys.stderr, flush=True)
        return 2
    except JobFailure as e:  # fatal for this job: the launcher stops the rest
        print(f"pretrain_gpt.py: error: {e}", file=sys.stderr, flush=True)
        return 3
    return 0


def entry(extensions=()) -> None:
    """The command: ``main`` with the process's exit status. ``extensions``: step hooks,
    see ``megatron_streaming.run.train.Run`` (a drill's fault injection, for one)."""
    try:
        code = main(extensions=extensions)
    except Exception:  # a bug: its traceback, then out
        traceback.print_exc()
        code = 1
    if code:
        _leave(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
