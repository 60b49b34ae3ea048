#!/usr/bin/env bash
# Every GPU check in one call of a one-GPU machine (Python with a CUDA torch, no network):
#   bash launch/device_check.sh [LIMIT_S]
# Carry the wheels of what its Python lacks in .whl (megatron-core, deepspeed, pydantic, hjson,
# xxhash; built by `bash launch/device_wheels.sh`) and the quality corpus in .devdata/code. In order,
# each inside what is left of LIMIT_S (default 500): the environment (and whether Transformer
# Engine and apex import), the codec on CUDA against a device copy, the two-worker timeline
# (overlap, step times, bytes), then the 34M quality run with the `-m cuda` tests beside it.
# Work in $WORK (default /tmp/device_check); at most 8 files land in $OUT (default runs/device).
# VARIANTS=streaming,plain: the quality run's streaming runs (benchmarks/gpu.py --variants), with
# SLOWDOWN (default 3.2) the cost of a step of the concurrent runs in quiet timeline steps.
# STAGES="plan": the planner's memory and step time against the GPU (benchmarks/plan_device.py,
# four launches of 1.28B and 0.85B models, about 5 minutes), its JSON and log into $OUT.
# STAGES="environment": what docs/gpu_clusters.md says is untested on a GPU: the fused attention
# against the unfused one (bf16, 2k-8k), the sync's device memory around a send, each rank's
# GPUs while two workers train (nvidia-smi), then the `-m cuda` tests; about 6 minutes.
# STAGES="checkpoint": --async-save's blocked time against a synchronous save of a ~1B model
# (benchmarks/checkpoint_format.py --device-check: two launches, about 12 GiB a checkpoint on
# the device's disk, at most two at once), its JSON and log into $OUT.
# REHEARSE=1: the same sequence on a CPU machine (tiny model, codec on the CPU), to try it out.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/device} W=${WORK:-/tmp/device_check}
mkdir -p "$OUT" "$W"
t0=$(date +%s) limit=${1:-500}
left() { echo $(( limit - ($(date +%s) - t0) )); }
device=cuda tiny=""
[[ ${REHEARSE:-0} == 1 ]] && device=cpu tiny=--tiny
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
if [[ ${REHEARSE:-0} != 1 ]] && compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import sys, torch, deepspeed, megatron.core as m
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "deepspeed", deepspeed.__version__, "megatron-core", m.__version__,
      "gpu", torch.cuda.get_device_name(0))'
  for mod in transformer_engine apex; do
    python3 -c "import $mod; print('$mod', getattr($mod, '__version__', 'importable'))" \
      2>/dev/null || echo "$mod: not importable here"
  done
  python3 -c 'from patches import optional as o
print("used by megatron-streaming: apex", o.have_apex(), "transformer-engine", o.have_te())' 2>&1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

stages=${STAGES:-codec timeline quality}  # "timeline smoke": a first, short call
has() { [[ " $stages " == *" $1 "* ]]; }

if has codec; then
  echo "== codec on CUDA ($(left) s left)"
  timeout 90 python3 benchmarks/micro.py --device $device --codec-only --reps 5 \
    --numel $((64 << 20)),$((256 << 10)) --out "$W" > "$OUT/codec.log" 2>&1
  tail -20 "$OUT/codec.log"
fi

step_s=${STEP_S:-0.1}
if has timeline; then
  echo "== timeline: two workers on the GPU ($(left) s left)"
  timeout 150 python3 benchmarks/gpu.py timeline $tiny --out "$W/timeline" --data .devdata/code \
    --steps ${TIMELINE_STEPS:-70} > "$W/timeline.out" 2>&1
  tail -3 "$W/timeline.out"
  grep -v -i warn "$W/timeline/timeline.log" | grep -B2 -A8 Traceback | head -60
  step_s=$(python3 -c 'import json,sys
try:
    print(json.load(open(sys.argv[1]))["median_step_s"]["quiet"] or 0.1)
except Exception:
    print(0.1)' "$W/timeline/timeline.json")
fi

xdist=$(python3 -c "import xdist" 2>/dev/null && printf -- "-n 3")
if has smoke; then
  echo "== two cuda tests ($(left) s left)"
  timeout $(( $(left) - 10 )) python3 -m pytest -m cuda tests/test_cuda.py $xdist -q \
    -k "diloco_p1_tau0 or losses_follow or int8" --junitxml="$OUT/cuda_tests.xml" \
    > "$OUT/cuda_tests.log" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed|^E  " "$OUT/cuda_tests.log" | head -40
fi

if has quality; then
  echo "== quality at 34M and the cuda tests beside it ($(left) s left, quiet step ${step_s} s)"
  deadline=$(( $(left) - 25 ))
  timeout $(( deadline + 20 )) python3 -m pytest -m cuda tests/test_cuda.py $xdist -q \
    --junitxml="$OUT/cuda_tests.xml" > "$OUT/cuda_tests.log" 2>&1 &
  tests=$!
  python3 benchmarks/gpu.py quality $tiny --out "$W/quality" --data .devdata/code \
    --deadline-s "$deadline" --startup-s 70 --step-s "$step_s" --slowdown ${SLOWDOWN:-3.2} \
    --variants ${VARIANTS:-streaming} \
    > "$W/quality.out" 2>&1
  wait $tests
  echo "== cuda tests"; grep -E "^(FAILED|ERROR)|passed|failed|^E  " "$OUT/cuda_tests.log" | head -40
  echo "== quality"; tail -12 "$W/quality.out"
fi
if has environment; then
  echo "== the GPU environment: attention, the sync's memory, each rank's GPU ($(left) s left)"
  timeout 150 python3 benchmarks/attention.py --device $device --out "$OUT/attention.json" \
    > "$OUT/attention.log" 2>&1; tail -12 "$OUT/attention.log"
  for what in sync-memory devices; do
    timeout 120 python3 benchmarks/gpu_environment.py $what --out "$OUT" \
      $([[ $device == cpu ]] && echo --rehearse) > "$OUT/$what.log" 2>&1
    tail -14 "$OUT/$what.log"
  done
  timeout $(( $(left) - 10 )) python3 -m pytest -m cuda tests/test_cuda.py $xdist -q \
    --junitxml="$OUT/cuda_tests.xml" > "$OUT/cuda_tests.log" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed|^E  " "$OUT/cuda_tests.log" | head -40
fi
if has plan; then
  echo "== the planner against the GPU ($(left) s left)"
  timeout $(( $(left) - 10 )) python3 benchmarks/plan_device.py $tiny --out "$OUT" \
    > "$OUT/plan_device.log" 2>&1
  grep -v -i warn "$OUT/plan_device.log" | tail -12
fi
if has checkpoint; then
  echo "== --async-save against a synchronous save ($(left) s left)"
  models=1B; [[ $device == cpu ]] && models=quickstart
  timeout $(( $(left) - 10 )) python3 benchmarks/checkpoint_format.py --device-check $device \
    --models $models --out "$W/checkpoint" > "$OUT/checkpoint.log" 2>&1
  tail -c 3000 "$OUT/checkpoint.log"
  cp "$W/checkpoint/checkpoint_device.json" "$OUT/" 2>/dev/null
fi
cp "$W/quality/quality.json" "$W/timeline/timeline.json" "$W/micro_codec.json" "$OUT/" \
  2>/dev/null
tar -C "$W" -czf "$OUT/logs.tgz" --exclude=cache --exclude='*.pt' . 2>/dev/null
ls -la "$OUT"
echo "done in $(( $(date +%s) - t0 )) s"
