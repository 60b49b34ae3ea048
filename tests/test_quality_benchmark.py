"""benchmarks/quality.py and benchmarks/protocol.py without training: their corpora keep
training and held-out text apart, every run's flags parse, the protocol's choices read the
validation split only, and the tables give each gap against the right baseline."""

import json
import sys

import pytest

from harness import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import protocol  # noqa: E402
import protocol_report  # noqa: E402
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
        if name == "dp" or name in quality.ONE_WORKER:  # one worker: dp's ranks and batch
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


# ---- benchmarks/protocol.py: the scaling-law paper's protocol ------------------------------


def test_protocol_corpus_dedups_and_splits_by_path(tmp_path):
    for rel, text in [("a/x.py", "x = 1\n"), ("b/x.py", "x = 1\n"), ("c/empty.py", "\n"),
                      ("d/y.py", "y = 2\n"), ("e/notes.txt", "z")]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    docs = list(protocol.venv_documents(tmp_path))
    assert [(path, text) for path, _, text in docs] == [("a/x.py", "x = 1\n"),
                                                         ("d/y.py", "y = 2\n")]
    # Held out and validation: one file in 50 each, by a hash of the path alone.
    paths = [f"lib/pkg{i}/mod{j}.py" for i in range(40) for j in range(50)]
    shares = {s: sum(protocol.split_of(p) == s for p in paths) / len(paths)
              for s in ("heldout", "validation", "train")}
    assert 0.012 < shares["heldout"] < 0.03 and 0.012 < shares["validation"] < 0.03, shares
    assert [protocol.split_of(p) for p in paths] == [protocol.split_of(p) for p in paths]


def test_protocol_runs_share_tokens_batch_and_held_out_samples():
    from megatron_streaming.cli.arguments import parse_args

    # All parameters, embeddings included: what the runs' summaries reported (1,089,024).
    assert protocol.parameters() == 1_089_024
    data = ["--mock-data", "--vocab-size", "4096"]
    for workers, outer_lr in [(0, None), (1, 0.6), (2, None), (2, 0.6), (4, 0.8)]:
        j = protocol.job(20, workers, outer_lr, 4e-3, 32, 2)
        args, ranks = protocol.run_args(j, data, 256)
        cfg = parse_args(args)
        t, s = cfg.training, cfg.streaming
        per_worker = t.global_batch_size
        assert per_worker * max(1, workers) == 32 and ranks == max(2, workers), j
        assert t.eval_iters * per_worker == 256, j  # the same held-out sequences
        # Whole rounds of H=30; evaluations every tenth of the run, at round boundaries.
        assert t.train_iters % 30 == 0 and t.eval_interval % 30 == 0
        assert abs(t.eval_interval * 10 - t.train_iters) <= 150
        tokens = t.train_iters * 32 * 256
        assert abs(tokens / protocol.parameters() - 20) < 0.5
        assert (s.diloco_workers, cfg.training.seed) == (max(1, workers), 2)
        if workers > 1:
            assert (s.diloco_inner_steps, s.diloco_fragments, s.diloco_overlap_steps,
                    s.diloco_quantize) == (30, 3, 1, "fp4-e2m1")
            assert (s.diloco_outer_lr, s.diloco_outer_momentum) == (
                (1.0, 0.0) if outer_lr is None else (outer_lr, 0.9))
        if workers == 1:
            assert s.diloco_quantize == "none"  # nothing crosses a wire
    assert protocol.parse_label(protocol.label(j)) == j


def _row(rung, workers, outer_lr, lr, batch, seed, validation, held_out):
    j = protocol.job(rung, workers, outer_lr, lr, batch, seed)
    return {**j, "summary": {"test_loss": validation, "valid_loss": held_out},
            "held_out": [(10, held_out + 1), (20, held_out)]}


def test_protocol_tuning_reads_validation_never_held_out_and_widens_at_an_edge():
    class Opts:
        tune_rung, rungs, batches, lrs = 5, [2.5, 5, 20], [16, 32, 64], [2e-3, 4e-3, 8e-3]
        outer_lrs, workers, seeds = [0.4, 0.8], [2, 4], [1, 2]

    # 8e-3 is best on validation (held-out says 2e-3): the grid widens to 1.6e-2 first.
    rows = [_row(5, 0, None, lr, 32, 1, v, h)
            for lr, v, h in [(2e-3, 3.2, 2.0), (4e-3, 3.1, 3.0), (8e-3, 3.0, 3.0)]]
    jobs, final = protocol.phase_jobs("tune", Opts, rows)
    assert not final and [j["lr"] for j in jobs] == [2e-3, 4e-3, 8e-3, 1.6e-2]
    rows.append(_row(5, 0, None, 1.6e-2, 32, 1, 3.05, 3.0))
    jobs, final = protocol.phase_jobs("tune", Opts, rows)
    assert final and [(j["lr"], j["batch"]) for j in jobs[4:]] == [
        (8e-3, 16), (4e-3, 16), (8e-3, 64), (1.6e-2, 64)]
    rows.append(_row(5, 0, None, 4e-3, 16, 1, 2.9, 9.0))
    assert protocol.best_dp(rows, 5) == (4e-3, 16)
    # The outer lr: least validation per M, at data parallel's held lr and batch.
    rows += [_row(5, 2, 0.4, 4e-3, 16, 1, 3.0, 1.0), _row(5, 2, 0.8, 4e-3, 16, 1, 2.95, 5.0),
             _row(5, 2, 0.4, 2e-3, 16, 1, 1.0, 1.0)]
    assert protocol.best_outer_lr(rows, 5, 2, (4e-3, 16)) == 0.8
    top = protocol.phase_jobs("top", Opts, rows + [_row(5, 4, 0.4, 4e-3, 16, 1, 3, 3)])[0]
    assert {(j["workers"], j["outer_lr"], j["seed"], j["rung"]) for j in top} == {
        (m, o, s, 20) for m, o in [(2, 0.8), (2, None), (4, 0.4), (4, None)] for s in (1, 2)}


def test_protocol_gap_pairs_seeds_and_follows_the_run():
    dp = (4e-3, 32)
    rows = [_row(20, 0, None, *dp, 1, 0, 2.0), _row(20, 0, None, *dp, 2, 0, 2.2),
            _row(20, 2, None, *dp, 1, 0, 2.1), _row(20, 2, 0.6, *dp, 3, 0, 2.3)]
    cells = {c["method"]: c for c in protocol_report.cells(rows, dp, {2: 0.6})}
    assert cells["m2-plain"]["gap"] == pytest.approx(5.0) and cells["m2-plain"]["paired"]
    assert cells["m2-plain"]["gap_along"] == [(0.5, 3.33), (1.0, 5.0)]  # 3.1 / 3.0, 2.1 / 2.0
    # No seed in common: against data parallel's mean, and said so.
    assert cells["m2-nesterov0.6"]["gap"] == pytest.approx(100 * (2.3 / 2.1 - 1))
    assert not cells["m2-nesterov0.6"]["paired"]
    assert cells["m2-plain"]["outer_steps"] == protocol.steps_of(20, 32) // 30


def test_protocol_ablations_change_one_flag_of_m2_plain_and_keep_their_labels():
    from megatron_streaming.cli.arguments import parse_args

    for change, (_, flags, factor) in protocol.ABLATIONS.items():
        # Against M=2 plain at the same global batch (b2x: each worker 16, half the steps).
        plain, _ = protocol.run_args(protocol.job(5, 2, None, 4e-3, 16 * factor, 1),
                                     ["--mock-data"], 256)
        j = protocol.job(5, 2, None, 4e-3, 16 * factor, 1, change)
        assert protocol.parse_label(protocol.label(j)) == j
        args, ranks = protocol.run_args(j, ["--mock-data"], 256)
        assert ranks == 2 and len(args) == len(plain)
        differ = {plain[i - 1]: a for i, a in enumerate(args) if a != plain[i]}
        assert differ == flags, change
        parse_args(args)


def test_protocol_sizes_scale_the_model_and_its_steps_and_compose_with_other_changes():
    from megatron_streaming.cli.arguments import parse_args

    assert protocol.parameters(change="l4d64") == 478_592
    assert protocol.parameters(change="l8d128+sparse64-olr2") == 2_143_488
    for change in ["l4d64", "l8d128+sparse64-olr2", "l4d64+lr2x"]:
        for workers in (0, 2):
            j = protocol.job(5, workers, None, 4e-3, 16, 1, change)
            assert protocol.parse_label(protocol.label(j)) == j
            cfg = parse_args(protocol.run_args(j, ["--mock-data"], 256)[0])
            layers, d, heads = protocol.model_of(change)
            m = cfg.model
            assert (m.num_layers, m.hidden_size, m.num_attention_heads) == (layers, d, heads)
            tokens = cfg.training.train_iters * 16 * 256
            assert abs(tokens / protocol.parameters(change=change) - 5) < 0.2
            if "sparse" in change and workers:
                assert cfg.streaming.diloco_quantize == "sparse"
                assert cfg.streaming.diloco_outer_lr == 2
            if "lr2x" in change:
                assert cfg.optimizer.lr == 0.008
    assert protocol.label(protocol.job(5, 0, None, 4e-3, 16, 1, "l4d64")) == \
        "tpp5/dp+l4d64/lr0.004/b16/seed1"


def test_protocol_size_table_reads_each_run_against_data_parallel_of_its_size():
    def row(workers, change, held_out, seed=1):
        j = protocol.job(5, workers, None, 4e-3, 16, seed, change)
        return {**j, "summary": {"test_loss": held_out, "valid_loss": held_out},
                "held_out": [(10, held_out)]}
    rows = [row(0, None, 3.0), row(2, None, 3.3), row(0, "l4d64", 4.0), row(2, "l4d64", 4.6),
            row(2, "l4d64+sparse64-olr2", 5.0), row(0, "l4d64+lr2x", 3.5),
            row(2, "l4d64+lr2x", 3.85), row(2, "l8d128", 9.9, seed=2)]
    sized = [r for r in rows if r["change"] and "l" in r["change"][:1]]
    lines = protocol_report.size_table(sized, rows, 5, (4e-3, 16))
    text = "\n".join(lines)
    # Each against data parallel of its own size and inner lr; the exchange is not a size.
    assert "| 2 | dense FP4 | 3.300 | +10.00 % |" in text
    assert "| 2 | dense FP4 | 4.600 | +15.00 % |" in text
    assert "| 2 | sparse 64 of 4,096, outer lr 2 | 5.000 | +25.00 % |" in text
    assert "| 2 | inner lr doubled (0.008, min 0.0008) | 3.850 | +10.00 % |" in text
    assert "| 478,592 | 570 | 1 | data parallel | - | 4.000 |  |" in text
    assert len([x for x in lines if x.startswith("| ") and "---" not in x]) == 1 + 8
    assert "| 9.900 |  |" in text  # seed 2's lone run has no data parallel: no gap


def test_protocol_size_phase_runs_each_size_at_its_rung_beside_data_parallel():
    class Opts:
        tune_rung, rungs, workers, size_seeds = 5, [5, 20], [2, 4], [1]
        sizes, size_sparse, size_rung = ["l4d64"], ["sparse64-olr2"], 20

    rows = [_row(5, 0, None, 4e-3, 16, 1, 3.0, 3.0)]
    jobs, final = protocol.phase_jobs("size", Opts, rows)
    assert final and [protocol.label(j) for j in jobs] == [
        f"tpp20/{m}/lr0.004/b16/seed1" for m in (
            "dp+l4d64", "m2-plain+l4d64", "m4-plain+l4d64", "m2-plain+l4d64+sparse64-olr2",
            "m4-plain+l4d64+sparse64-olr2")]
    Opts.size_rung = None
    assert {j["rung"] for j in protocol.phase_jobs("size", Opts, rows)[0]} == {5}
