"""Schedules in real launches: a batch ramp-up in two streaming workers that resumes exactly
mid-ramp, the embedding and output layer at their own lr (logged to TensorBoard-equivalent
JSON lines and to a stand-in W&B), and
--exit-duration-in-mins stopping every rank after the same iteration with a checkpoint."""

import json

import pytest

from harness import REPO, TINY, read_jsonl, run
from megatron_streaming.run.metrics import is_old_name
from megatron_streaming.cli.arguments import parse_args, validate
from seams import lr_at

# Per worker: batch 2, 2, 4, 6, 8, 8, 8, 8 (ramp 2 -> 8 by 2 over 12 samples): 46 samples.
RAMP = [*TINY, "--diloco-workers", "2", "--global-batch-size", "8", "--rampup-batch-size", "2",
        "2", "12", "--train-samples", "46", "--lr-decay-style", "cosine",
        "--lr-warmup-samples", "4", "--eval-iters", "1",
        "--decoupled-lr", "3e-3", "--decoupled-min-lr", "2e-4"]
BATCHES = [2, 2, 4, 6, 8, 8, 8, 8]


def tensorboard_scalars(log_dir) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import (SCALARS,
                                                                        EventAccumulator)

    acc = EventAccumulator(str(log_dir), size_guidance={SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()[SCALARS]}


def _train_records(path):
    return [r for r in read_jsonl(path) if "train/loss" in r]


@pytest.mark.timeout(420)
def test_rampup_in_two_workers_resumes_mid_ramp_exactly(tmp_path):
    ckpt, wandb_calls = tmp_path / "ckpt", tmp_path / "wandb.jsonl"
    fake_wandb = {"PYTHONPATH": str(REPO / "tests" / "fake_wandb"),
                  "FAKE_WANDB_LOG": str(wandb_calls)}
    run(2, [*RAMP, "--save", str(ckpt), "--save-interval", "3", "--log-jsonl",
            str(tmp_path / "full.jsonl"), "--summary-json", str(tmp_path / "full.json"),
            "--wandb-project", "ramp", "--wandb-exp-name", "full",
            "--tensorboard-dir", str(tmp_path / "tb")], extra_env=fake_wandb)
    full = _train_records(tmp_path / "full.jsonl")
    assert [r["iteration"] for r in full] == list(range(1, 9))
    assert [r["train/global_batch_size"] for r in full] == BATCHES
    consumed = [sum(BATCHES[:i]) for i in range(1, 9)]
    assert [r["train/tokens"] for r in full] == [2 * c * 32 for c in consumed]  # 2 workers
    summary = json.loads((tmp_path / "full.json").read_text())
    assert (summary["iteration"], summary["samples"], summary["tokens"]) == (8, 92, 92 * 32)
    cfg = parse_args(RAMP)
    validate(cfg, 2)
    assert [r["train/lr"] for r in full] == [lr_at(i, cfg) for i in range(8)]
    assert [r["train/decoupled_lr"] for r in full] == [
        lr_at(i, cfg, max_lr=3e-3, min_lr=2e-4) for i in range(8)]
    # The same scalars reached W&B, step by step, under Megatron-LM's names (the JSON lines'
    # old names aside), and TensorBoard has the same keys.
    logged = [c for c in read_jsonl(wandb_calls) if c["call"] == "log"]
    train_logged = [c for c in logged if "lm loss" in c["data"]]
    assert [c["step"] for c in train_logged] == list(range(1, 9))
    assert [c["data"] for c in train_logged] == [
        {k: v for k, v in r.items() if k != "iteration" and v is not None
         and not is_old_name(k)} for r in full]
    assert [c["data"]["lm loss"] for c in train_logged] == [r["train/loss"] for r in full]
    assert [c["data"]["batch-size"] for c in train_logged] == BATCHES
    assert [c["data"]["learning-rate"] for c in train_logged] == [r["train/lr"] for r in full]
    assert [c["data"]["samples vs steps"] for c in train_logged] == [2 * c for c in consumed]
    tags = tensorboard_scalars(tmp_path / "tb")
    wandb_keys = {k for c in logged for k in c["data"]} - {"samples vs steps"}
    assert {t for t in tags if not t.endswith(" vs samples")} == wandb_keys
    assert [v for _, v in tags["batch-size"]] == BATCHES
    assert tags["batch-size vs samples"] == [(2 * c, b) for c, b in zip(consumed, BATCHES)]

    # Resume from iteration 3 (mid-ramp): make that checkpoint the latest again.
    (ckpt / "latest_checkpointed_iteration.txt").write_text("3\n")
    run(2, [*RAMP, "--load", str(ckpt), "--log-jsonl", str(tmp_path / "resumed.jsonl"),
            "--summary-json", str(tmp_path / "resumed.json")])
    resumed = _train_records(tmp_path / "resumed.jsonl")
    assert [r["iteration"] for r in resumed] == list(range(4, 9))
    for key in ("train/loss", "train/lr", "train/decoupled_lr", "train/tokens",
                "train/global_batch_size"):
        assert [r[key] for r in resumed] == [r[key] for r in full[3:]], key
    assert json.loads((tmp_path / "resumed.json").read_text())["tokens"] == summary["tokens"]


@pytest.mark.timeout(300)
def test_exit_duration_saves_and_stops_every_rank_at_one_iteration(tmp_path):
    ckpt, summary_path = tmp_path / "ckpt", tmp_path / "summary.json"
    proc = run(2, [*TINY, "--diloco-workers", "2", "--train-iters", "200", "--eval-iters", "1",
                   "--exit-duration-in-mins", "0.0001", "--save", str(ckpt),
                   "--summary-json", str(summary_path)])
    assert proc.returncode == 0
    summary = json.loads(summary_path.read_text())
    assert summary["stopped_by"] == "exit-duration-in-mins"
    assert 1 <= summary["iteration"] < 200
    assert summary["checkpoint_iteration"] == summary["iteration"]
    tracker = (ckpt / "latest_checkpointed_iteration.txt").read_text().strip()
    assert int(tracker) == summary["iteration"]  # one job-wide checkpoint, both workers
    assert "stopping after iteration" in proc.stdout + proc.stderr
