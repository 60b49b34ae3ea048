#!/usr/bin/env bash
# The job's rendezvous store on a host of its own (a login node, or a third site that every
# cluster reaches), for jobs launched with --rendezvous-external --master-addr THIS_HOST
# --master-port PORT: the meeting point then does not die with worker 0.
#   bash launch/rendezvous.sh --port 29500 [--host 0.0.0.0]
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
exec .venv/bin/python -m megatron_streaming.job.rendezvous "$@"
