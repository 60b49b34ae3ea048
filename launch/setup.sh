#!/usr/bin/env bash
# Creates (or reuses) .venv in the repository root with the pinned dependencies.
# Order matters: torch first (the CPU wheel), then the rest without build isolation, so
# that building deepspeed uses this torch instead of fetching another one.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
stamp=.venv/.requirements.sha256
want=$(sha256sum requirements.txt launch/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/pip install --quiet torch==2.13.0
  # DS_BUILD_OPS=0: DeepSpeed's C++/CUDA ops are built on first use where needed, never here.
  DS_BUILD_OPS=0 .venv/bin/pip install --quiet --no-build-isolation -r requirements.txt
  echo "$want" > "$stamp"
fi
