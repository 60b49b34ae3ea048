"""What the held-out-loss benchmarks share: a corpus tokenized into indexed datasets with its
own sentencepiece vocabulary, and runs named by a hash of their command that leave a small
record in the repository, so a sweep resumes where it stopped, from a fresh clone too.

Used by ``benchmarks/quality.py`` (one change at a time, 1200-step runs) and
``benchmarks/protocol.py`` (the DiLoCo scaling-law paper's protocol: tokens per parameter up
to 20, M = 1, 2, 4 workers).
"""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# ---- corpora --------------------------------------------------------------------------------
def tokenize_splits(d: Path, splits: dict, vocab_size: int = 0) -> dict:
    """Write each split's documents to ``d/<split>.jsonl`` and tokenize it into
    ``d/<split>_text_document.bin/.idx`` (end-of-document token appended) with the
    sentencepiece vocabulary ``d/train.model``: trained here on every line of the ``train``
    split's text (``vocab_size`` pieces), or, without ``vocab_size``, the one already there
    (trained otherwise, on the training split only). Returns the tokens per split."""
    import numpy as np

    for name, docs in splits.items():
        with open(d / f"{name}.jsonl", "w") as f:
            for text in docs:
                f.write(json.dumps({"text": text}) + "\n")
    run = [sys.executable, "-m", "megatron_streaming.data", "--append-eod"]
    for name in ["train", *(s for s in splits if s != "train")]:
        vocab = ["--vocab-size", str(vocab_size)] if name == "train" and vocab_size else \
            ["--tokenizer-model", str(d / "train.model")]
        subprocess.run([*run, "--input", str(d / f"{name}.jsonl"), "--output-prefix",
                        str(d / name), *vocab], cwd=REPO, check=True)
    return {name: int(np.fromfile(d / f"{name}_text_document.bin", dtype=np.uint16).size)
            for name in splits}


# ---- runs -----------------------------------------------------------------------------------
# The settings that shape a run's math: the run key holds their resolved values, so a run that
# relies on a library default is redone when that default changes, and no other run is.
KEYED_SETTINGS = ("diloco_sync", "diloco_inner_steps", "diloco_fragments",
                  "diloco_fragment_pattern", "diloco_overlap_steps", "diloco_alpha",
                  "diloco_outer_lr", "diloco_outer_momentum", "diloco_nesterov",
                  "diloco_quantize", "diloco_quant_block", "diloco_error_feedback",
                  "co2_gap_penalty", "co2_clip_threshold")


def resolved_settings(args: list[str]) -> dict:
    """The sync settings of a run (none where it does not sync: data parallel, ``alone``)."""
    from megatron_streaming.cli.arguments import parse_args
    from megatron_streaming.streaming.settings import enabled

    cfg = parse_args(args)
    if not enabled(cfg):
        return {}
    out = {name: getattr(cfg.streaming, name) for name in KEYED_SETTINGS}
    # Settings added later enter the key only away from what runs did before they existed,
    # so earlier records keep their keys.
    if cfg.streaming.diloco_sync_spacing != "steps":
        out["diloco_sync_spacing"] = cfg.streaming.diloco_sync_spacing
    if cfg.streaming.diloco_eager:
        out["diloco_eager"] = True
    return out


def run_key(args: list[str]) -> str:
    return hashlib.sha1(json.dumps([args, resolved_settings(args)]).encode()).hexdigest()[:12]


def launch(args: list[str], out: Path, records: Path, label: str, nproc: int = 2) -> dict:
    """One run of ``nproc`` ranks, or its record when it finished before: ``records/KEY.json``
    holds what the report needs (the summary and the held-out and training curves), small
    enough to keep in the repository, so a sweep resumes from a fresh clone too."""
    key = run_key(args)
    record = records / f"{key}.json"
    if record.exists():
        return json.loads(record.read_text())
    run_dir = out / "runs" / key
    summary, log = run_dir / "summary.json", run_dir / "log.jsonl"
    run_dir.mkdir(parents=True, exist_ok=True)
    if summary.exists() and json.loads(summary.read_text())["stopped_by"] is not None:
        summary.unlink()  # a signal stopped it early (e.g. the machine went down): redo it
    if not (summary.exists() and log.exists()):  # else: finished, its record not yet written
        _train(args, run_dir, summary, log, label, nproc)
    finished = json.loads(summary.read_text())
    if finished["stopped_by"] is not None:
        summary.unlink()
        raise RuntimeError(f"{label} was stopped by {finished['stopped_by']} at iteration "
                           f"{finished['iteration']}; run the sweep again to redo it")
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    result = {"label": label, "args": args, "summary": finished,
              "held_out": [(x["iteration"], round(x["valid/loss"], 4)) for x in lines
                           if "valid/loss" in x],
              "train": [(x["iteration"], round(x["train/loss"], 4)) for x in lines
                        if "train/loss" in x]}
    records.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(result, separators=(",", ":")) + "\n")
    return result


def _train(args, run_dir, summary, log, label, nproc):
    log.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "pretrain_gpt.py", *args, "--summary-json",
           str(summary), "--log-jsonl", str(log)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    (run_dir / "stderr.txt").write_text(done.stderr[-20000:])
    if done.returncode:
        summary.unlink(missing_ok=True)
        raise RuntimeError(f"{label} failed ({run_dir}): {done.stderr[-3000:]}")
