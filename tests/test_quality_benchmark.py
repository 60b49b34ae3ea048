"""benchmarks/quality.py without training: its corpora keep training and held-out text apart,
every variant's flags parse, and its tables give each gap against the right baseline."""

import json
import sys

import pytest

from harness import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import quality  # noqa: E402


@pytest.mark.parametrize("corpus", ["code", "wiki"])
def test_corpora_hold_out_whole_documents(corpus):
    train, held = quality._split_documents(corpus)
    assert len(held) >= 10 and len(train) >= 4 * len(held)
    assert not set(train) & set(held)
    # The held-out share is a small part of the text, not a few stray lines.
    share = sum(map(len, held)) / sum(map(len, train + held))
    assert 0.02 < share < 0.3, share


def test_every_variant_is_a_valid_command_line():
    from megatron_streaming.cli.arguments import parse_args

    class Opts:
        global_batch, steps, eval_interval, eval_samples = 16, 1200, 100, 256

    for name in quality.VARIANTS:
        flags, per_iter = quality.run_flags(name, Opts, 2e-3)
        cfg = parse_args([*quality.COMMON, *quality.SIZES["small"], "--mock-data", *flags])
        assert cfg.training.eval_iters * per_iter == 256, name  # the same held-out samples
        if name == "dp":
            assert cfg.streaming.diloco_workers == 1 and cfg.training.global_batch_size == 16
        else:
            assert cfg.streaming.diloco_workers == 2 and cfg.training.global_batch_size == 8
    h1 = parse_args([*quality.COMMON, "--mock-data", *quality.run_flags("h1", Opts, 1e-3)[0]])
    s = h1.streaming
    assert (s.diloco_inner_steps, s.diloco_outer_lr, s.diloco_outer_momentum,
            s.diloco_alpha, s.diloco_quantize) == (1, 1.0, 0.0, 0.0, "none")


def test_tables_compare_with_data_parallel_at_its_best_lr_and_average_seeds():
    def row(variant, lr, loss, seed=1):
        return {"corpus": "code", "size": "small", "variant": variant, "lr": lr,
                "seed": seed, "test_loss": loss}

    rows = [row("dp", 1e-3, 3.0), row("dp", 2e-3, 2.0), row("h30", 1e-3, 2.1),
            row("h30", 2e-3, 2.2, 1), row("h30", 2e-3, 2.4, 2)]
    text = quality.tables(rows, ["dp", "h30"])
    at_dp_best, own_best = text.split("Each method at its own best")
    assert "code small (lr 0.002)" in at_dp_best
    assert "2.300 ±0.100 (2 seeds) (+15.0 %)" in at_dp_best
    assert "2.100 @ 0.001 (+5.0 %)" in own_best


def test_a_longer_run_is_a_cell_of_its_own():
    job = {"corpus": "code", "size": "small", "variant": "dp", "lr": 2e-3, "seed": 1}
    assert quality.run_label(job, 1200) == "code/small/dp/lr0.002/seed1"
    assert quality.run_label(job, 2400) == "code/small@2400/dp/lr0.002/seed1"
    rows = [{**job, "test_loss": 2.5}, {**job, "size": "small@2400", "test_loss": 2.0},
            {**job, "variant": "h30", "size": "small@2400", "test_loss": 2.2}]
    text = quality.tables(rows, ["dp", "h30"])
    assert "| code small (lr 0.002) | code small@2400 (lr 0.002) |" in text
    assert "| - | 2.200 (+10.0 %) |" in text


def test_the_report_reads_every_record_and_skips_those_of_changed_defaults(tmp_path):
    class Opts:
        global_batch, steps, eval_interval, eval_samples = 16, 1200, 100, 256

    def record(variant, key=None):
        args = [*quality.COMMON, *quality.SIZES["small"], "--mock-data",
                *quality.run_flags(variant, Opts, 2e-3)[0]]
        r = {"label": f"code/small/{variant}/lr0.002/seed1", "args": args,
             "summary": {"test_loss": 2.5, "train_loss": 2.4, "parameters": 1,
                         "cross_worker_bytes": 0, "wall_seconds": 1.0},
             "held_out": [(100, 3.0), (1200, 2.5)], "train": []}
        (tmp_path / f"{key or quality.run_key(args)}.json").write_text(json.dumps(r))

    record("dp")
    record("defaults")
    record("defaults", key="0123456789ab")  # ran under other library defaults
    rows = quality.recorded_rows(tmp_path, 16)
    assert sorted((r["variant"], r["lr"], r["seed"]) for r in rows) == [
        ("defaults", 2e-3, 1), ("dp", 2e-3, 1)]
    assert rows[0]["curve"] == [(100 * 16 * 128, 3.0), (1200 * 16 * 128, 2.5)]
    # Data parallel and a worker alone do not sync: no library default is in their key.
    dp = [*quality.COMMON, "--mock-data", *quality.run_flags("dp", Opts, 2e-3)[0]]
    assert quality.resolved_settings(dp) == {}
