"""Train a GPT with Megatron-core inside DeepSpeed ZeRO, as one or more DiLoCo workers.

    deepspeed --num_gpus 4 pretrain_gpt.py --mock-data --tensor-model-parallel-size 2 \\
        --diloco-workers 2 --train-iters 50
    torchrun --nproc_per_node 4 pretrain_gpt.py --mock-data --pipeline-model-parallel-size 2

Flags: ``python pretrain_gpt.py --help``. This file only parses flags and calls the library.
"""

import sys


def _raised_by_data_package(err: BaseException) -> bool:
    """The data package reports bad input (a file that is no tokenizer, a --split that does not
    parse) as a ValueError naming the flag, raised by its own code. A ValueError raised deeper,
    in a library it calls, is a bug and keeps its traceback."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    module = tb.tb_frame.f_globals.get("__name__", "") if tb is not None else ""
    return module == "megatron_streaming.data" or module.startswith("megatron_streaming.data.")


def main(argv=None) -> int:
    from megatron_streaming.arguments import ConfigError, parse_args
    from megatron_streaming.checkpoint import CheckpointError
    from megatron_streaming.train import pretrain

    cfg = parse_args(argv)
    try:
        pretrain(cfg)
    except (ConfigError, CheckpointError, ValueError) as e:
        if not (isinstance(e, (ConfigError, CheckpointError)) or _raised_by_data_package(e)):
            raise
        print(f"pretrain_gpt.py: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
