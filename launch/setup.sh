#!/usr/bin/env bash
# Creates (or reuses) .venv in the repository root with the pinned dependencies:
#   bash launch/setup.sh [--container] [--wheels DIR]
# Alone: an isolated venv. Order matters: torch first (the CPU wheel), then the rest without
# build isolation, so that building deepspeed uses this torch instead of fetching another one.
# --container, inside NVIDIA's PyTorch containers: a venv over the container's Python (python3
# on PATH, or PYTHON) with --system-site-packages, so that its torch, apex, Transformer Engine
# and NCCL build stay the ones that run; torch is never installed, and of requirements.txt only
# what the container lacks goes into .venv (launch/container.py says what and why).
# --wheels DIR: install from the wheels in DIR only, no package index (an air-gapped cluster).
# The options are remembered in .venv: quickstart.sh, test.sh and a later call without options
# set up the same way, again whenever requirements.txt changes.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
die() { echo "setup.sh: $*" >&2; exit 2; }
options=.venv/.setup-options  # one a line
container=0 wheels=""
parse() {
  while (( $# )); do
    case $1 in
      --container) container=1 ;;
      --wheels) wheels=${2:-}; (( $# > 1 )) && shift ;;
      *) die "unknown option $1 (--container, --wheels DIR)" ;;
    esac
    shift
  done
}
[ -f "$options" ] && { mapfile -t remembered < "$options"; parse "${remembered[@]}"; }
made_container=$container
parse "$@"
[[ -z $wheels || -d $wheels ]] || die "--wheels '$wheels': no such directory"
[ -z "$wheels" ] || wheels=$(cd "$wheels" && pwd)
if [ -x .venv/bin/python ] && (( container && ! made_container )); then
  die ".venv is an isolated venv (made without --container): remove it (rm -rf .venv) to" \
      "make a container one"
fi
pip_from=()
[ -n "$wheels" ] && pip_from=(--no-index --find-links "$wheels")
stamp=.venv/.requirements.sha256
if (( container )); then
  if [ ! -x .venv/bin/python ]; then
    "$PYTHON" launch/container.py --check > /dev/null  # no torch: one line, no venv made
    # Without pip: the container's own pip serves the venv (Debian's Pythons lack ensurepip).
    "$PYTHON" -m venv --system-site-packages --without-pip .venv
  fi
  made_with=$(.venv/bin/python launch/container.py --check)  # torch and Python versions
else
  [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
  made_with=torch==2.13.0
fi
{ (( container )) && echo --container; [ -n "$wheels" ] && printf '%s\n' --wheels "$wheels"; } \
  > "$options" || true
# New pins, or a new container image (another torch or Python): install again.
want=$(cat requirements.txt launch/setup.sh launch/container.py <(echo "$made_with") |
       sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  if (( container )); then
    .venv/bin/python launch/container.py ${wheels:+--wheels "$wheels"}
  else
    .venv/bin/pip install --quiet "${pip_from[@]}" torch==2.13.0
    # DS_BUILD_OPS=0: DeepSpeed's C++/CUDA ops are built on first use where needed, never here.
    DS_BUILD_OPS=0 .venv/bin/pip install --quiet --no-build-isolation "${pip_from[@]}" \
      -r requirements.txt
  fi
  echo "$want" > "$stamp"
fi
