#!/usr/bin/env bash
# What launch/device_check.sh needs on a one-GPU machine whose Python (3.12, CUDA torch) has
# no network: wheels of the packages its image lacks, in .whl; with --corpus also the quality
# corpus in .devdata/code (benchmarks/quality.py's code corpus, built here if missing), which
# only the timeline and quality stages read. Both folders are ignored by git; carry them with
# the call (.whl about 10 MiB; what travels, the working tree included, must stay under 64 MiB:
# the sizes are printed last).
#   bash launch/device_wheels.sh [--corpus]
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/pip ] || bash launch/setup.sh  # only pip (and torch, for deepspeed) are used
mkdir -p .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64; do
  platforms+=(--platform "$p")
done
for pkg in megatron-core==0.16.1 pydantic==2.14.3 pydantic_core==2.50.4 annotated-types==0.8.0 \
           typing-inspection==0.4.5 hjson==3.1.0 xxhash==4.1.0; do
  .venv/bin/pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d .whl "$pkg"
done
# DeepSpeed ships as a source archive: a pure-Python wheel, its ops built on first use there.
ls .whl/deepspeed-0.19.8-*.whl > /dev/null 2>&1 || DS_BUILD_OPS=0 .venv/bin/pip wheel -q \
  --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
for d in /.whl/ /.devdata/; do
  grep -qx "$d" "$exclude" 2>/dev/null || echo "$d" >> "$exclude"
done
if [[ ${1:-} == --corpus ]]; then
  code=runs/quality/data/code
  [ -f "$code/train_text_document.bin" ] || .venv/bin/python -c '
import sys; from pathlib import Path; sys.path.insert(0, "benchmarks"); import quality
quality.corpus_flags("code", Path("runs/quality"))'
  mkdir -p .devdata/code
  cp "$code"/{train,heldout}_text_document.{bin,idx} "$code"/{train.model,meta.json} .devdata/code/
fi
du -sh .whl $([ -d .devdata ] && echo .devdata)
# The working tree as it travels: tracked files and untracked ones git does not ignore.
git ls-files -z --cached --others --exclude-standard | du -ch --files0-from=- 2>/dev/null |
  tail -1 | sed 's/total$/the working tree (tracked and untracked, not ignored)/'
