"""benchmarks/plan_link_validation.py without the harness: the sync's own work is read off the
one cell where the link costs the eager method nothing, and the stored repeats of the sweep
give the table docs/RESULTS.md quotes."""

import json
import sys

import pytest

from harness import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import plan_link_validation as validation  # noqa: E402

EAGER = "eager"
SPECS = {validation.CEILING: {"kind": "workers", "flags": ["--no-diloco-sync"]},
         EAGER: {"kind": "workers", "flags": ["--diloco-inner-steps", "40", "--diloco-fragments",
                                              "4", "--diloco-eager"]}}


def _cell(ceiling_ms, eager_ms):
    return {"measured_mbit": 100.0, "measured_rtt_ms": 0.1,
            "methods": {validation.CEILING: {"ms_per_step": ceiling_ms},
                        EAGER: {"ms_per_step": eager_ms}}}


def test_the_sync_cost_is_read_at_the_fastest_rate_without_a_round_trip():
    sweep = {"results_by_rtt": {"0": {"10": _cell(100.0, 130.0), "100": _cell(100.0, 104.0)},
                                "50": {"100": _cell(100.0, 150.0)}}}
    where, seconds = validation.sync_cost(sweep, SPECS)
    assert where == (0.0, 100.0, EAGER)
    assert seconds == pytest.approx(0.004 * 40 / 4)  # 4 ms a step, an exchange every 10
    # faster than the ceiling (the harness's spread) is no work, not negative work
    assert validation.sync_cost({"results_by_rtt": {"0": {"100": _cell(100.0, 97.0)}}},
                                SPECS)[1] == 0.0
    assert validation.sync_cost({"results_by_rtt": {"50": {"100": _cell(100, 104)}}},
                                SPECS) == (None, 0.0)


def test_the_stored_repeats_give_the_quoted_table(tmp_path):
    sweeps = [str(REPO / f"docs/results/slow_link_repeats/rep{i}.json") for i in (1, 2, 3)]
    assert validation.main(["--repeats", "--sweep", *sweeps, "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "link_validation.json").read_text())["rows"]
    assert len(rows) == 36 and sum(r["calibration"] for r in rows) == 1
    checked = [r for r in rows if not r["calibration"]]
    assert sum(abs(r["error_points"]) <= 5 for r in checked) == 32
    assert sum(abs(r["link_only_error_points"]) <= 5 for r in checked) == 23
    assert all(len(r["measured_each"]) == 3 for r in rows)
