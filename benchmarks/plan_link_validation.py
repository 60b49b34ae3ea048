"""The planner's link model against the slow-link harness's measured compute utilisation.

    .venv/bin/python benchmarks/plan_link_validation.py \
        [--sweep docs/results/slow_link_rtt_sweep.json [LATER.json ...]] [--repeats] \
        [--out docs/results/plan]

For every cell of the sweep (link rate x round trip, ``benchmarks/slow_link.py --rtts``) and
every sync method in it, the utilisation the planner predicts (``plan.search.link_utilisation``
with ``plan.search.steady_exchange_seconds``: the outer gradients' bytes from the parameter
count and the wire format, over the link's rate (``link_mbit``), plus the measured round trips
and TCP's slow start from the window the gap between exchanges leaves; the step of the run
without a sync, measured beside it) against the utilisation measured there (that step
over the method's). One term is read off each sweep: the sync's own work per exchange on the
harness's two shared cores (``sync_cost``: the eager method at the fastest rate without a
round trip, where the link costs it nothing); that cell is left out of the count, and every
row also shows the prediction without the term ("link alone"). The rest of the model's inputs
are the run's flags and what the harness measured of the link and of the compute alone. With
``--repeats`` the sweeps are repeats of the same cells: each row compares the medians. Writes
OUT/link_validation.json and prints the table (docs/RESULTS.md, "Planner models").
"""

import argparse
import json
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_streaming.plan.search import link_utilisation, steady_exchange_seconds
from megatron_streaming.comm.codec import make_codec  # noqa

CEILING = "ceiling (no cross-worker sync)"


def method_of(flags):
    """(H, P, tau, eager, bits per value) of a method's flags."""
    def value(name, default):
        return type(default)(flags[flags.index(name) + 1]) if name in flags else default

    values = 1 << 20  # bits per value on the wire, as the codec counts them
    bits = make_codec(value("--diloco-quantize", "fp4")).wire_bytes(values) * 8 / values
    return (value("--diloco-inner-steps", 100), value("--diloco-fragments", 1),
            value("--diloco-overlap-steps", 0), "--diloco-eager" in flags, bits)


def link_mbit(sweep, rate, cell) -> float:
    """The link's rate for an exchange, which sends as many bytes each way at once: one TCP
    stream each way, measured without a round trip at the same nominal rate
    (``measured_mbit_both_ways``; tbf's rate does not depend on the round trip, and a probe
    over one measures its own slow start too, which the model adds itself). Sweeps without
    it: the cell's one-way probe."""
    still = sweep["results_by_rtt"].get("0", {}).get(rate, {})
    return still.get("measured_mbit_both_ways") or cell["measured_mbit"]


def predict(cell, rtt, spec, parameters, sync_seconds, mbit) -> tuple:
    """(exchange seconds, predicted utilisation, the same without the sync's own work) of one
    method in one measured cell over a link of ``mbit``."""
    h, p, tau, eager, bits = method_of(spec["flags"])
    step = cell["methods"][CEILING]["ms_per_step"] / 1e3
    # one-rank workers: one connection, Linux's default slow start after idle, the window
    # each exchange starts with restarted after the gap since the last one
    exchange = steady_exchange_seconds(step, h, tau, eager, sync_seconds, parameters=parameters,
                                       bits=bits, workers=2, fragments=p,
                                       gbit_per_s=mbit / 1e3,
                                       rtt_ms=cell.get("measured_rtt_ms", float(rtt)))
    return (exchange, link_utilisation(step, exchange, h, p, tau, eager, sync_seconds),
            link_utilisation(step, exchange, h, p, tau, eager))


def sync_cost(sweep, specs) -> tuple:
    """((round trip, rate, method) of the calibration cell, seconds per exchange): the sync's
    own work on the harness's two shared cores, read where the link costs nothing: the eager
    method (whose exchanges have a whole round) at the sweep's fastest rate without a round
    trip, its step over the ceiling's, times H/P steps per exchange. (None, 0.0) without it."""
    eager = [n for n, spec in specs.items() if "--diloco-eager" in spec["flags"]]
    cells = sweep["results_by_rtt"].get("0", {})
    if not eager or not cells:
        return None, 0.0
    rate = max(cells, key=float)
    methods = cells[rate]["methods"]
    if eager[0] not in methods:
        return None, 0.0
    h, p, *_ = method_of(specs[eager[0]]["flags"])
    extra = methods[eager[0]]["ms_per_step"] - methods[CEILING]["ms_per_step"]
    return (0.0, float(rate), eager[0]), max(0.0, extra / 1e3 * h / p)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", nargs="+",
                    default=[os.path.join(REPO, "docs/results/slow_link_rtt_sweep.json")],
                    help="sweeps; a later one's cells (round trip, rate) replace an earlier's")
    ap.add_argument("--repeats", action="store_true",
                    help="the sweeps measured the same cells again: compare the median of "
                         "the predictions with the median of the measurements, per cell")
    ap.add_argument("--out", default=os.path.join(REPO, "docs/results/plan"))
    args = ap.parse_args(argv)
    cells, specs, calibrations = {}, {}, set()
    for path in args.sweep:
        with open(path) as f:
            sweep = json.load(f)
        specs.update(sweep["methods"])
        where, sync_s = sync_cost(sweep, sweep["methods"])
        calibrations.add(where)
        print(f"{os.path.relpath(path, REPO)}: the sync's own work {sync_s * 1e3:.0f} ms an "
              f"exchange (from {where})")
        for rtt, by_rate in sweep["results_by_rtt"].items():
            for rate, cell in by_rate.items():
                key = (float(rtt), float(rate))
                runs = cells.setdefault(key, [])
                if not args.repeats:
                    runs.clear()  # the later sweep's cell replaces the earlier's
                runs.append((rtt, cell, sync_s, link_mbit(sweep, rate, cell)))
    rows = []
    for key in sorted(cells):
        for name, spec in specs.items():
            runs = [run for run in cells[key] if name in run[1]["methods"]]
            if spec["kind"] != "workers" or name == CEILING or not runs:
                continue
            exchange, predicted, link_only = zip(*(
                predict(cell, rtt, spec, cell["methods"][name]["parameters"], sync_s, mbit)
                for rtt, cell, sync_s, mbit in runs))
            measured = [cell["methods"][name]["utilisation"] for _, cell, *_ in runs]
            predicted, link_only, median = map(statistics.median,
                                               (predicted, link_only, measured))
            rows.append({"rtt_ms": key[0], "rate_mbit": key[1],
                         "measured_mbit": statistics.median(c["measured_mbit"]
                                                            for _, c, *_ in runs),
                         "link_mbit": statistics.median(run[3] for run in runs),
                         "method": name, "exchange_s": statistics.median(exchange),
                         "step_s": statistics.median(c["methods"][CEILING]["ms_per_step"] / 1e3
                                                     for _, c, *_ in runs),
                         "predicted": predicted, "measured": median,
                         "measured_each": measured,
                         "error_points": 100 * (predicted - median),
                         "link_only_predicted": link_only,
                         "link_only_error_points": 100 * (link_only - median),
                         "calibration": (*key, name) in calibrations})
    for r in rows:
        print(f"{r['rtt_ms']:5.0f} ms {r['rate_mbit']:5.0f} Mbit/s  {r['method'][:48]:48s} "
              f"predicted {r['predicted']:6.1%} (link alone {r['link_only_predicted']:6.1%})  "
              f"measured {r['measured']:6.1%}  {r['error_points']:+5.1f} points"
              + ("  [calibration]" if r["calibration"] else "")
              + (f"  (runs {min(r['measured_each']):.1%} .. {max(r['measured_each']):.1%})"
                 if len(r["measured_each"]) > 1 else ""))
    checked = [r for r in rows if not r["calibration"]]
    for label, key in (("with the sync's own work", "error_points"),
                       ("the link alone", "link_only_error_points")):
        errors = [abs(r[key]) for r in checked]
        print(f"{label}: {sum(e <= 5 for e in errors)} of {len(checked)} within 5 points "
              f"(the calibration cells left out); median {statistics.median(errors):.1f}, "
              f"worst {max(errors):.1f} points")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "link_validation.json"), "w") as f:
        json.dump({"sweep": [os.path.relpath(p, REPO) for p in args.sweep],
                   "repeats": args.repeats, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
