"""The planner's link model against the slow-link harness's measured compute utilisation.

    .venv/bin/python benchmarks/plan_link_validation.py \
        [--sweep docs/results/slow_link_rtt_sweep.json [LATER.json ...]] [--out docs/results/plan]

For every cell of the sweep (link rate x round trip, ``benchmarks/slow_link.py --rtts``) and
every sync method in it, the utilisation the planner predicts (``plan.search.link_utilisation``
with ``plan.search.exchange_seconds``: the outer gradients' bytes from the parameter count and
the wire format, over the measured link rate, plus two measured round trips; the step of the
run without a sync, measured beside it) against the utilisation measured there (that step
over the method's). Nothing here is fitted: the model's inputs are the run's flags and what
the harness measured of the link and of the compute alone. Writes OUT/link_validation.json and
prints the table (docs/RESULTS.md, "Planner models").
"""

import argparse
import json
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_streaming.plan.search import FP4_BITS, exchange_seconds, link_utilisation  # noqa

CEILING = "ceiling (no cross-worker sync)"


def method_of(flags):
    """(H, P, tau, eager, bits per value) of a method's flags."""
    def value(name, default):
        return type(default)(flags[flags.index(name) + 1]) if name in flags else default

    bits = {"fp4": FP4_BITS, "int8": 8 + 32 / 128, "bf16": 16, "none": 32}[
        value("--diloco-quantize", "fp4")]
    return (value("--diloco-inner-steps", 100), value("--diloco-fragments", 1),
            value("--diloco-overlap-steps", 0), "--diloco-eager" in flags, bits)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", nargs="+",
                    default=[os.path.join(REPO, "docs/results/slow_link_rtt_sweep.json")],
                    help="sweeps; a later one's cells (round trip, rate) replace an earlier's")
    ap.add_argument("--out", default=os.path.join(REPO, "docs/results/plan"))
    args = ap.parse_args(argv)
    cells, specs = {}, {}
    for path in args.sweep:
        with open(path) as f:
            sweep = json.load(f)
        specs.update(sweep["methods"])
        for rtt, by_rate in sweep["results_by_rtt"].items():
            for rate, cell in by_rate.items():
                cells[(float(rtt), float(rate))] = (rtt, rate, cell)
    rows = []
    for rtt, rate, cell in (cells[k] for k in sorted(cells)):
        methods = cell["methods"]
        step = methods[CEILING]["ms_per_step"] / 1e3
        for name, spec in specs.items():
            if spec["kind"] != "workers" or name == CEILING or name not in methods:
                continue
            h, p, tau, eager, bits = method_of(spec["flags"])
            m = methods[name]
            # one-rank workers: one connection, Linux's default slow start after idle
            exchange = exchange_seconds(m["parameters"], bits, 2, p,
                                        cell["measured_mbit"] / 1e3,
                                        cell.get("measured_rtt_ms", float(rtt)))
            predicted = link_utilisation(step, exchange, h, p, tau, eager)
            rows.append({"rtt_ms": float(rtt), "rate_mbit": float(rate),
                         "measured_mbit": cell["measured_mbit"], "method": name,
                         "exchange_s": exchange, "step_s": step,
                         "predicted": predicted, "measured": m["utilisation"],
                         "error_points": 100 * (predicted - m["utilisation"])})
    for r in rows:
        print(f"{r['rtt_ms']:5.0f} ms {r['rate_mbit']:5.0f} Mbit/s  {r['method'][:48]:48s} "
              f"predicted {r['predicted']:6.1%}  measured {r['measured']:6.1%}  "
              f"{r['error_points']:+5.1f} points")
    errors = [abs(r["error_points"]) for r in rows]
    within = sum(e <= 5 for e in errors)
    print(f"{within} of {len(rows)} within 5 points; median {statistics.median(errors):.1f}, "
          f"worst {max(errors):.1f} points")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "link_validation.json"), "w") as f:
        json.dump({"sweep": [os.path.relpath(p, REPO) for p in args.sweep], "rows": rows}, f,
                  indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
