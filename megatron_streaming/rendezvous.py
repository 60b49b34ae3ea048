"""``python -m megatron_streaming.rendezvous``, kept for existing scripts: the tool is
``megatron_streaming.job.rendezvous``."""

import sys

from .job.rendezvous import main

if __name__ == "__main__":
    sys.exit(main())
