"""The compute-utilisation simulator: schedules small enough to work out by hand, limits,
monotonicity, and Table 4 of Streaming DiLoCo (arXiv 2501.18512) within 15 % per cell."""

import json
import math

import pytest

from megatron_streaming.plan import simulate as sim

# Two layers, 6 s per step: forward 1 s per layer, backward 2 s per layer. With bits=1,
# 2 workers (ring factor 1) and 1e-9 Gbit/s (1 bit/s), a layer's reduction takes
# params / 2 seconds, so ``_model(c)`` makes each reduction take c seconds.
SLOW = 1e-9


def _model(reduction_seconds, layers=2):
    return sim.ModelSpec(layers=layers, params=layers * reduction_seconds, step_time=3 * layers)


def _util(method, reduction_seconds, layers=2):
    return sim.utilisation(_model(reduction_seconds, layers), method, SLOW)


DP = sim.Method("dp", bits=1)


def test_ring_all_reduce_volume():
    assert sim.Link(1, 2).seconds(1e9, 16) == pytest.approx(16)
    assert sim.Link(1, 4).seconds(1e9, 16) == pytest.approx(24)  # 2(n-1)/n = 1.5
    assert sim.Link(1, 1).seconds(1e9, 16) == 0  # nobody to talk to
    assert sim.Link(0, 2).seconds(1e9, 16) == math.inf


def test_grid_is_the_papers():
    paper = {25: 11.0, 36: 86.8, 37: 104.8, 45: 471.5, 46: 569.0}
    for k, gbps in paper.items():
        assert sim.grid_point(k) == pytest.approx(gbps, abs=0.06)
    assert sim.grid_point(0) == pytest.approx(0.1) and sim.grid_point(49) == pytest.approx(1000)


def test_sync_plan():
    assert sim.sync_plan(4, DP) == (1, {0: [0, 1, 2, 3]})
    assert sim.sync_plan(4, sim.Method("d", 10)) == (10, {9: [0, 1, 2, 3]})
    # 24 layers in 3-layer strided fragments: P = 8, one every 100 // 8 = 12 steps.
    period, plan = sim.sync_plan(24, sim.Method("s", 100, 3))
    assert period == 96 and sorted(plan) == list(range(11, 96, 12))
    assert plan[11] == [0, 8, 16] and plan[95] == [7, 15, 23]
    assert sim.sync_plan(48, sim.Method("s", 100, 3))[0] == 96  # every 6 steps, not 6.25


def test_free_link_costs_nothing():
    assert sim.utilisation(_model(1), DP, math.inf) == 1.0


@pytest.mark.parametrize("c, expected", [
    (1, 6 / 7),      # c < backward of a layer: only layer 0's reduction is exposed
    (3, 6 / 10),     # link-bound: forward (2) + first backward (2) + 2 reductions (6)
])
def test_data_parallel_by_hand(c, expected):
    assert _util(DP, c) == pytest.approx(expected)


def test_diloco_amortises_over_h():
    # Exposed per round: 2 + 2 + 2*3 - 6 = 4 s, once per H steps of 6 s.
    for h in (1, 3, 10):
        assert _util(sim.Method("d", h, bits=1), 3) == pytest.approx(6 * h / (6 * h + 4))
    assert _util(sim.Method("d", 1, bits=1), 3) == _util(DP, 3)


def test_streaming_forward_waits_only_for_its_own_layer():
    # Fragment 0 = layer 0 after step 1, fragment 1 = layer 1 after step 3 (period 4).
    # Layer 0 is ready at the end of backward: its 3 s all show. Layer 1 is ready 2 s before
    # the end and is needed 1 s after the next step starts: 3 s of slack, none shows.
    blocking = sim.Method("s", 4, fragment_layers=1, bits=1)
    assert _util(blocking, 3) == pytest.approx(24 / 27)
    assert _util(blocking, 4) == pytest.approx(24 / 29)  # 4 s + 1 s exposed


def test_overlap_rides_along_tau_steps():
    overlapped = sim.Method("o", 4, fragment_layers=1, overlap_steps=1, bits=1)
    assert _util(overlapped, 3) == 1.0  # one whole step (6 s) hides 3 s
    # 8 s: layer 0's reduction ends 2 s after the step after next should start.
    assert _util(overlapped, 8) == pytest.approx(24 / 26)


def test_bandwidth_limits():
    model, methods = sim.PAPER_MODELS["1B"], sim.paper_methods()
    for method in methods:
        assert sim.utilisation(model, method, 0) == 0
        assert sim.utilisation(model, method, math.inf) == pytest.approx(1.0)
        assert sim.utilisation(model, method, 1e6, workers=1) == pytest.approx(1.0)


@pytest.mark.parametrize("method", sim.paper_methods(), ids=lambda m: m.name)
def test_utilisation_never_falls_as_bandwidth_grows(method):
    model = sim.PAPER_MODELS["10B"]
    utils = [sim.utilisation(model, method, sim.grid_point(k)) for k in range(0, 50, 2)]
    assert all(a <= b + 1e-12 for a, b in zip(utils, utils[1:]))
    assert utils[0] < 0.5 < 0.99 < utils[-1]


def test_bandwidth_for_is_the_smallest_grid_point():
    model, method = sim.PAPER_MODELS["1B"], sim.paper_methods()[2]
    for target in sim.TARGETS:
        gbps = sim.bandwidth_for(target, model, method)
        k = round((math.log10(gbps) + 1) * 49 / 4)
        assert sim.utilisation(model, method, gbps) >= target
        assert sim.utilisation(model, method, sim.grid_point(k - 1)) < target
    assert sim.bandwidth_for(1.0, model, sim.paper_methods()[0]) == math.inf


def test_more_workers_need_more_bandwidth():
    model, method = sim.PAPER_MODELS["1B"], sim.paper_methods()[0]
    assert sim.utilisation(model, method, 150, workers=4) == \
        pytest.approx(sim.utilisation(model, method, 100, workers=2))


def test_invalid_settings_are_refused():
    with pytest.raises(ValueError, match="layers"):
        sim.ModelSpec(layers=0, params=1, step_time=1)
    with pytest.raises(ValueError, match="overlap_steps"):
        sim.Method("x", overlap_steps=-1)
    with pytest.raises(ValueError, match="target"):
        sim.bandwidth_for(0, sim.PAPER_MODELS["1B"], DP)


@pytest.fixture(scope="module")
def table4():
    return sim.compare_with_paper()


# The two cells this model does not reproduce, and why: no single payload and schedule we
# tried meets them together with the other 48 (strict: a fix shows up as XPASS). The bounds
# behind both are worked out in docs/results/simulate.md ("Why the last two cells stay off").
KNOWN_OFF = {
    ("10B", "Data-parallel", 0.99): "with uniform layers only the last layer's reduction is "
    "exposed (99.1 % at 390.7 Gbit/s); the 1B 99 % cell pins that tail to one layer's",
    ("10B", "+ overlap", 0.5): "knife-edge: 50.1 % at 1.39 Gbit/s where the paper has < 50 %; "
    "a payload < 0.4 % larger fixes it but drops 10B DiLoCo 50 % (50.06 % at 1.68) below 50 %",
}


def _cells():
    for (model, rows) in sim.PAPER_TABLE4.items():
        for method in rows:
            for i, target in enumerate(sim.TARGETS):
                reason = KNOWN_OFF.get((model, method, target))
                marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
                yield pytest.param(model, method, i, marks=marks,
                                   id=f"{model}-{method}-{int(target * 100)}")


@pytest.mark.parametrize("model, method, i", list(_cells()))
def test_table4_cell_within_15_percent(table4, model, method, i):
    row = table4[model][method]
    assert abs(row["rel_error"][i]) <= sim.TOLERANCE, (row["ours"][i], row["paper"][i])


def test_cli_prints_table4_and_fails_on_cells_off(capsys, tmp_path, table4):
    out = tmp_path / "t4.json"
    code = sim.main(["--json", str(out)])
    text = capsys.readouterr().out
    assert "Table 4, 1B" in text and "Table 4, 10B" in text and "100B" in text
    result = json.loads(out.read_text())
    assert result["cells_off"] == sim.cells_off(table4)
    assert code == (1 if result["cells_off"] else 0)


def test_cli_any_model(capsys, tmp_path):
    out = tmp_path / "m.json"
    assert sim.main(["--layers", "32", "--hidden", "3072", "--step-time", "0.3",
                     "--bandwidth-gbps", "10", "--workers", "3", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["model"]["params"] == 12 * 32 * 3072 ** 2
    assert set(result["bandwidth_gbps"]) == {m.name for m in sim.paper_methods()}
    assert 0 < result["utilisation_at"]["+ overlap FP4"] <= 1
    assert "util@link" in capsys.readouterr().out


def test_kaplan_step_time():
    # 6 * 1e9 params * 1e6 tokens / (1e16 FLOP/s * 0.6) = 1 s
    assert sim.kaplan_step_time(1e9, 1e6, 1e16, 0.6) == pytest.approx(1.0)
    args = sim.parse_args(["--layers", "24", "--params", "1e9", "--tokens-per-step", "1e6",
                           "--flops", "1e16"])
    assert sim.model_from_args(args).step_time == pytest.approx(1.0)


SPARSE = sim.Wire("sparse")  # --diloco-quantize sparse's defaults: 116 bytes a 4,096 chunk


def test_sparse_all_gather_volume():
    """A layer of 409,600 values is 100 chunks: 100 x 116 + 4 bytes to each of the n-1 other
    workers (the transport's all-gather), 92,832 bits at two workers, three times that at
    four, where the FP4 ring sends 2(n-1)/n of 4.25 bits a value."""
    assert sim.Link(1, 2).seconds(409_600, 4, SPARSE) == pytest.approx(92_832e-9)
    assert sim.Link(1, 4).seconds(409_600, 4, SPARSE) == pytest.approx(3 * 92_832e-9)
    assert sim.Link(1, 1).seconds(409_600, 4, SPARSE) == 0
    assert sim.Link(0, 2).seconds(409_600, 4, SPARSE) == math.inf
    assert sim.Link(1, 2).seconds(409_600, 4, sim.Wire()) == sim.Link(1, 2).seconds(409_600, 4)


def test_sparse_row_is_the_fp4_schedule_on_fewer_bytes():
    """The sparse row runs the FP4 row's schedule; only a reduction's time changes, so at
    bandwidth B it is exactly a 1-bit dense row at B x (values / sparse bits): 1B's layer
    of 35.08M values is 8,566 chunks, 7,949,280 bits to the other worker."""
    model = sim.PAPER_MODELS["1B"]
    rows = sim.paper_methods(sparse=SPARSE)
    assert [m.name for m in rows[:5]] == [m.name for m in sim.paper_methods()]
    fp4, sparse = rows[4], rows[5]
    assert (sparse.name, sparse.wire, sparse.inner_steps, sparse.fragment_layers,
            sparse.overlap_steps) == ("+ overlap sparse", SPARSE, 100, 3, 1)
    values = model.params / model.layers
    bits = 8 * SPARSE.bytes_sent(values, 2)
    assert bits == 8 * (8566 * 116 + 4) == 7_949_280
    one_bit = sim.Method("1 bit", 100, 3, 1, 1)
    for gbps in (0.01, 0.05, 0.2):
        assert sim.utilisation(model, sparse, gbps) == pytest.approx(
            sim.utilisation(model, one_bit, gbps * values / bits))
    # the bandwidth for 99 %: the FP4 row's over the bits a value of each, within a grid step
    ratio = sim.bandwidth_for(0.99, model, fp4) / sim.bandwidth_for(0.99, model, sparse)
    assert 4 * values / bits / 1.21 <= ratio <= 4 * values / bits * 1.21


def test_cli_sparse_row(capsys, tmp_path):
    out = tmp_path / "s.json"
    assert sim.main(["--layers", "24", "--params", "0.842e9", "--step-time", "0.1",
                     "--sparse", "--sparse-k", "32", "--bandwidth-gbps", "1",
                     "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["methods"][-1]["wire"] == {"quantize": "sparse", "bits": 4.25,
                                             "chunk": 4096, "k": 32, "value_bits": 2}
    at = result["utilisation_at"]
    assert at["+ overlap sparse"] >= at["+ overlap FP4"]
    assert "+ overlap sparse" in capsys.readouterr().out
