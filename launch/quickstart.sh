#!/usr/bin/env bash
# Sets up .venv, builds a small corpus from this Python's own standard library (no download),
# and trains a GPT as 2 DiLoCo workers of 2 tensor-parallel ranks each, on CPU, with the
# deepspeed launcher. The workers sync through Streaming DiLoCo: 2 fragments, each exchanged
# every 20 steps as FP4, overlapped with 1 step of training. Extra arguments go to
# pretrain_gpt.py (they override the defaults).
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
out=${QUICKSTART_DIR:-runs/quickstart}
data=.cache/quickstart/stdlib
mkdir -p "$out" "$(dirname "$data")"
if [ ! -f "$data.idx" ]; then
  stdlib=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
  .venv/bin/python -m megatron_streaming.data --input "$stdlib"/[a-f]*.py \
    --output-prefix "$data" --vocab-size 1024
fi
rm -rf "$out/tensorboard" "$out/checkpoints"
exec .venv/bin/deepspeed --num_gpus 4 pretrain_gpt.py \
  --data-path "$data" --tokenizer-model "$data.model" \
  --diloco-workers 2 --tensor-model-parallel-size 2 \
  --diloco-inner-steps 20 --diloco-fragments 2 --diloco-overlap-steps 1 --diloco-quantize fp4-e2m1 \
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
  --micro-batch-size 4 --global-batch-size 8 --train-iters 100 \
  --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 10 --lr-decay-style cosine --adam-beta2 0.95 \
  --hidden-dropout 0 --attention-dropout 0 --eval-interval 50 --eval-iters 4 \
  --log-interval 10 --tensorboard-dir "$out/tensorboard" --save "$out/checkpoints" \
  --summary-json "$out/summary.json" "$@"
