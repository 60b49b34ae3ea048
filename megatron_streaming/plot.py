"""``python -m megatron_streaming.plot``, kept for existing scripts: the tool is
``megatron_streaming.cli.plot``."""

import sys

from .cli.plot import main

if __name__ == "__main__":
    sys.exit(main())
