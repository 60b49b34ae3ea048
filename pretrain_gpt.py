"""Train a GPT with Megatron-core inside DeepSpeed ZeRO, as one or more DiLoCo workers.

    deepspeed --num_gpus 4 pretrain_gpt.py --mock-data --tensor-model-parallel-size 2 \\
        --diloco-workers 2 --train-iters 50
    torchrun --nproc_per_node 4 pretrain_gpt.py --mock-data --pipeline-model-parallel-size 2

Flags: ``python pretrain_gpt.py --help``. This file only parses flags and calls the library.
"""

import os
import sys
import traceback


def _stop_children() -> None:
    """Helper processes of this one (megatron-core's checkpoint writer keeps a spawned queue
    server) would outlive an ``os._exit`` and hold the launcher's output pipes open."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.terminate()


def main(argv=None, extensions=()) -> int:
    from megatron_streaming import quiet

    quiet.install()  # before deepspeed and megatron are imported: they warn on import
    from megatron_streaming.arguments import parse_args
    from megatron_streaming.errors import JobFailure, UsageError
    from megatron_streaming.train import pretrain

    try:
        pretrain(parse_args(argv), extensions)
    except UsageError as e:  # bad input: a line per problem; bugs keep their traceback
        for line in str(e).splitlines():
            print(f"pretrain_gpt.py: error: {line}", file=sys.stderr, flush=True)
        return 2
    except JobFailure as e:
        # Fatal for this job. A background thread may still sit in a dead collective, and
        # interpreter shutdown would wait for it: leave at once, the launcher stops the rest.
        print(f"pretrain_gpt.py: error: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        _stop_children()
        os._exit(3)
    return 0


def entry(extensions=()) -> None:
    """The command: ``main`` with the process's exit status. ``extensions``: step hooks,
    see ``megatron_streaming.train.Run`` (a drill's fault injection, for one)."""
    try:
        code = main(extensions=extensions)
    except Exception:  # a bug: its traceback, then out, without waiting for busy threads
        traceback.print_exc()
        sys.stderr.flush()
        sys.stdout.flush()
        _stop_children()
        os._exit(1)
    sys.exit(code)


if __name__ == "__main__":
    entry()
