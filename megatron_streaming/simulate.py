"""``python -m megatron_streaming.simulate``, kept for existing scripts: the tool is
``megatron_streaming.plan.simulate``."""

import sys

from .plan.simulate import main

if __name__ == "__main__":
    sys.exit(main())
