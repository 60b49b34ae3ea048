#!/usr/bin/env bash
# The GPU checks in one call of a one-GPU machine (Python with a CUDA torch, no network):
#   bash launch/device_check.sh [LIMIT_S]
# Carry the wheels of what its Python lacks in .whl (megatron-core, deepspeed, pydantic, hjson,
# xxhash; built by `bash launch/device_wheels.sh`) and, for the quality and timeline stages, the
# corpus in .devdata/code. Every stage runs inside what is left of LIMIT_S (default 510: the
# call ends within 9 minutes), checks its budget first ("skipped: N s left" in the log when
# too little is left) and writes its files to $OUT as it ends; $WORK (default /tmp/device_check)
# holds the rest, packed into $OUT/logs.tgz after each stage. $OUT (default runs/device) gets
# at most 8 files from the default sequence, which settles issue 55:
#   env     (always) the carried wheels installed; env.txt: the GPU, the versions (torch's
#           version string exactly), whether the patches' version pins accept them, apex and
#           Transformer Engine;
#   flash   SDPA forced to the flash kernel in bf16 at 4096 tokens (plain causal, grouped-query,
#           grouped-query with dropout) against the unfused attention: outputs, gradients,
#           times (benchmarks/attention.py --flash-check) -> attention_flash.json;
#   syncs   two one-rank workers (NCCL inside, gloo across) at ZeRO-2 with
#           --overlap-grad-reduce, 30 steps under set_sync_debug_mode("warn"): the synchronizing
#           calls by file and line, warm-up (steps 1-9) apart (benchmarks/sync_sites.py)
#           -> sync_sites.json;
#   cuda    the `-m cuda` tests, in what is left -> cuda_tests.log, cuda_tests.xml.
# STAGES="...": other stages by name, in this order:
#   codec        the codec on CUDA against a device copy (benchmarks/micro.py);
#   timeline     two workers' step times and overlap (benchmarks/gpu.py timeline);
#   smoke        three `-m cuda` tests;
#   quality      the 34M quality run with the `-m cuda` tests beside it (benchmarks/gpu.py;
#                VARIANTS=streaming,plain, SLOWDOWN: a concurrent step in quiet timeline steps);
#   environment  the fused attention against the unfused one (2k-8k), the sync's device memory
#                around a send, each rank's GPUs while two workers train (benchmarks/
#                gpu_environment.py), then the `-m cuda` tests (about 6 minutes);
#   plan         the planner's memory and step time against the GPU (benchmarks/plan_device.py);
#   checkpoint   --async-save's blocked time against a synchronous save of a ~1B model.
# REHEARSE=1: the same sequence on a CPU machine (tiny sizes, the CPU's kernels; the sync
# counter counts a deliberate C++ warning per step instead), to try the plumbing out.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/device} W=${WORK:-/tmp/device_check}
mkdir -p "$OUT" "$W"
t0=$(date +%s) limit=${1:-510}
stages=${STAGES:-flash syncs cuda}
rehearse=${REHEARSE:-0}
device=cuda tiny=""
[[ $rehearse == 1 ]] && device=cpu tiny=--tiny
PY=${PYTHON:-python3}  # the device's Python holds its torch; a rehearsal uses .venv's
[[ $rehearse == 1 && -x .venv/bin/python ]] && PY=${PYTHON:-.venv/bin/python}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4

left() { echo $(( limit - ($(date +%s) - t0) )); }
say() { echo "$*" | tee -a "$OUT/check.log"; }
show() { tee -a "$OUT/check.log"; }  # a stage's summary lines, into the log as well
has() { [[ " $stages " == *" $1 "* ]]; }
# budget NAME NEED CAP: T = the seconds the stage may take (at most CAP and what is left);
# false, saying so, when fewer than NEED seconds are left.
budget() {
  local l; l=$(left)
  T=$(( l < $3 ? l : $3 ))
  if (( T < $2 )); then
    say "== $1: skipped: $l s left (it needs $2 s)"
    return 1
  fi
  say "== $1 ($l s left; up to $T s)"
}
# keep: the stage's end: the work folder's logs packed into $OUT (the stage's own files are
# in $OUT already).
keep() {
  tar -C "$W" -czf "$OUT/logs.tgz" --exclude=cache --exclude='*.pt' --exclude='*.bin' . \
    2>/dev/null
  say "   ($(( $(date +%s) - t0 )) s in)"
}
failures() { grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|skipped|^E  " "$1" | head -40 | show; }

say "device check: stages '$stages', limit $limit s, device $device, $(date -u +%FT%TZ)"
if [[ $rehearse != 1 ]] && compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl > "$W/wheels.log" 2>&1 || { say "wheels: failed"; \
    tail -20 "$W/wheels.log" | show; keep; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
  timeout -k 5 120 "$PY" -W ignore::UserWarning - <<'EOF' 2>&1
import sys
from importlib import metadata

import torch

print("python", sys.version.split()[0])
print("torch.__version__", repr(torch.__version__), "| distribution",
      repr(metadata.version("torch")), "| cuda", torch.version.cuda, "| gpu",
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
for name in ("deepspeed", "megatron-core", "transformer-engine", "apex"):
    try:
        print(name, repr(metadata.version(name)))
    except metadata.PackageNotFoundError:
        print(name, "not installed")
try:  # the pins of every patch (torch, megatron-core, DeepSpeed), as a run checks them
    import patches

    print("version pins: accepted; patches applied:", ", ".join(patches.apply()))
except Exception as e:
    print("version pins: refused:", type(e).__name__, str(e).splitlines()[0])
from patches import optional as o

print("used by megatron-streaming: apex", o.have_apex(), "transformer-engine", o.have_te())
EOF
  for mod in transformer_engine apex; do
    "$PY" -c "import $mod; print('$mod', getattr($mod, '__version__', 'importable'))" \
      2>/dev/null || echo "$mod: not importable here"
  done
} > "$OUT/env.txt" 2>&1
show < "$OUT/env.txt"
keep

if has flash && budget flash 30 150; then
  sizes=(); [[ $rehearse == 1 ]] && sizes=(--seq 256 --heads 4 --groups 2 --head-dim 32)
  timeout -k 10 "$T" "$PY" benchmarks/attention.py --flash-check --device $device \
    ${sizes[@]+"${sizes[@]}"} --repeats 5 --out "$OUT/attention_flash.json" \
    > "$W/attention_flash.log" 2>&1
  grep -E "^\|" "$W/attention_flash.log" | show
  [[ -f $OUT/attention_flash.json ]] || tail -5 "$W/attention_flash.log" | show
  keep
fi

if has syncs && budget syncs 60 200; then
  timeout -k 10 "$T" "$PY" benchmarks/sync_sites.py run --out "$W/syncs" --steps 30 \
    --timeout $(( T - 15 )) $([[ $rehearse == 1 ]] && echo --rehearse) \
    > "$W/syncs.out" 2>&1
  echo "exit status $?" >> "$W/syncs.out"
  cp "$W/syncs/sync_sites.json" "$OUT/" 2>/dev/null
  tail -60 "$W/syncs.out" | show
  grep -v -i warn "$W/syncs/sync_sites_training.log" 2>/dev/null | grep -A12 Traceback | head -30 \
    | show
  keep
fi

xdist=$("$PY" -c "import xdist" 2>/dev/null && printf -- "-n 3")
if has codec && budget codec 30 90; then
  timeout -k 10 "$T" "$PY" benchmarks/micro.py --device $device --codec-only --reps 5 \
    --numel $((64 << 20)),$((256 << 10)) --out "$W" > "$W/codec.log" 2>&1
  tail -20 "$W/codec.log" | show
  cp "$W/micro_codec.json" "$OUT/" 2>/dev/null
  keep
fi

step_s=${STEP_S:-0.1}
if has timeline && budget timeline 60 150; then
  timeout -k 10 "$T" "$PY" benchmarks/gpu.py timeline $tiny --out "$W/timeline" \
    --data .devdata/code --steps ${TIMELINE_STEPS:-70} --timeout $(( T - 10 )) \
    > "$W/timeline.out" 2>&1
  tail -3 "$W/timeline.out" | show
  grep -v -i warn "$W/timeline/timeline.log" | grep -B2 -A8 Traceback | head -60 | show
  cp "$W/timeline/timeline.json" "$OUT/" 2>/dev/null
  step_s=$("$PY" -c 'import json,sys
try:
    print(json.load(open(sys.argv[1]))["median_step_s"]["quiet"] or 0.1)
except Exception:
    print(0.1)' "$W/timeline/timeline.json")
  keep
fi

if has smoke && budget smoke 60 $(( $(left) - 10 )); then
  timeout -s INT -k 15 "$T" "$PY" -m pytest -m cuda tests/test_cuda.py $xdist \
    -k "diloco_p1_tau0 or losses_follow or int8" --junitxml="$OUT/cuda_tests.xml" \
    > "$OUT/cuda_tests.log" 2>&1
  failures "$OUT/cuda_tests.log"
  keep
fi

if has quality && budget quality 120 $(( $(left) - 10 )); then
  say "   quiet step ${step_s} s"
  timeout -s INT -k 15 $(( T - 5 )) "$PY" -m pytest -m cuda tests/test_cuda.py $xdist \
    --junitxml="$OUT/cuda_tests.xml" > "$OUT/cuda_tests.log" 2>&1 &
  tests=$!
  "$PY" benchmarks/gpu.py quality $tiny --out "$W/quality" --data .devdata/code \
    --deadline-s $(( T - 25 )) --startup-s 70 --step-s "$step_s" --slowdown ${SLOWDOWN:-3.2} \
    --variants ${VARIANTS:-streaming} > "$W/quality.out" 2>&1
  wait $tests
  say "== cuda tests"; failures "$OUT/cuda_tests.log"
  say "== quality"; tail -12 "$W/quality.out" | show
  cp "$W/quality/quality.json" "$OUT/" 2>/dev/null
  keep
fi

if has environment && budget environment 90 $(( $(left) - 10 )); then
  # Each tool writes into its own folder of $W (gpu_environment.py devices writes the
  # training's log as devices.log there); only the JSONs go to $OUT.
  if budget "environment: attention" 30 150; then
    timeout -k 10 "$T" "$PY" benchmarks/attention.py --device $device \
      --out "$OUT/attention.json" > "$W/attention.log" 2>&1
    tail -12 "$W/attention.log" | show
  fi
  for what in sync-memory devices; do
    if budget "environment: $what" 30 120; then
      timeout -k 10 "$T" "$PY" benchmarks/gpu_environment.py $what --out "$W/$what" \
        $([[ $device == cpu ]] && echo --rehearse) > "$W/$what.out" 2>&1
      tail -14 "$W/$what.out" | show
      cp "$W/$what/$what.json" "$OUT/" 2>/dev/null
    fi
  done
  if budget "environment: cuda tests" 60 $(( $(left) - 10 )); then
    timeout -s INT -k 15 "$T" "$PY" -m pytest -m cuda tests/test_cuda.py $xdist \
      --junitxml="$OUT/cuda_tests.xml" > "$OUT/cuda_tests.log" 2>&1
    failures "$OUT/cuda_tests.log"
  fi
  keep
fi

if has plan && budget plan 120 $(( $(left) - 10 )); then
  timeout -k 10 "$T" "$PY" benchmarks/plan_device.py $tiny --out "$OUT" \
    > "$W/plan_device.log" 2>&1
  grep -v -i warn "$W/plan_device.log" | tail -12 | show
  keep
fi

if has checkpoint && budget checkpoint 120 $(( $(left) - 10 )); then
  models=1B; [[ $device == cpu ]] && models=quickstart
  timeout -k 10 "$T" "$PY" benchmarks/checkpoint_format.py --device-check $device \
    --models $models --out "$W/checkpoint" > "$W/checkpoint.log" 2>&1
  tail -c 3000 "$W/checkpoint.log" | show
  cp "$W/checkpoint/checkpoint_device.json" "$OUT/" 2>/dev/null
  keep
fi

# Last: the `-m cuda` tests in what is left (SIGINT at the limit: pytest still writes its
# summary and the XML of the tests that ended).
if has cuda && budget cuda 45 $(( $(left) - 10 )); then
  timeout -s INT -k 15 "$T" "$PY" -m pytest -m cuda tests/test_cuda.py tests/test_host_reads.py \
    $xdist --junitxml="$OUT/cuda_tests.xml" > "$OUT/cuda_tests.log" 2>&1
  failures "$OUT/cuda_tests.log"
  keep
fi
ls -la "$OUT" | show
say "done in $(( $(date +%s) - t0 )) s"
