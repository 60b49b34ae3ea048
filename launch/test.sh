#!/usr/bin/env bash
# Sets up .venv (see setup.sh) and runs the whole test suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
exec .venv/bin/python -m pytest tests "$@"
