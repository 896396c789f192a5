"""The router's arrival-rate estimate replayed on a load test's recorded arrivals, per longest window.

Reads a ``benchmarks/serve_triton.py`` result (its router run's arrival times, phase of each arrival
and each phase's true rate), feeds every arrival to :class:`elastic_export.serving.slo.RateEstimator`
as the router does (one row each, the estimate read at each arrival) and reports, per window: the
estimate against the true rate in the steady part of each phase (from 2 s after its start; 1st, 50th,
99th and 99.9th percentiles of estimate / rate), the steps it detected, and how long after each change
of phase the estimate first reached halfway to the new rate. Nothing is timed: the arrivals are the
recorded ones, the clock is theirs.

Usage:
    python benchmarks/rate_window.py [--json benchmarks/results/serve_triton.json] [--windows 2,4,8]

Writes benchmarks/results/rate_window.{json,md}.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from elastic_export.serving.slo import RateEstimator

RESULTS = Path(__file__).parent / "results"


def replay(arrivals: np.ndarray, window_s: float) -> tuple[np.ndarray, list[float]]:
    """The estimate at each arrival, and the times the estimator moved its origin (detected steps)."""
    est = RateEstimator(window_s=window_s)
    rates, steps, origin = [], [], None
    for t in arrivals:
        est.arrive(float(t))
        rates.append(est.rate(float(t)))
        if est.origin != origin and origin is not None and est.origin > arrivals[0]:
            steps.append(round(float(est.origin), 3))
        origin = est.origin
    return np.array(rates), steps


def summarise(arrivals: np.ndarray, phase: np.ndarray, rates_true: list[float], phase_s: float, window_s: float) -> dict:
    est, steps = replay(arrivals, window_s)
    out = {"window_s": window_s, "detected_steps_at_s": steps, "phases": []}
    for p, rate in enumerate(rates_true):
        start = p * phase_s
        steady = (phase == p) & (arrivals >= start + 2.0)
        ratio = est[steady] / rate
        row = {"rate_rps": rate, **{f"p{q}": float(np.percentile(ratio, q)) for q in (1, 50, 99, 99.9)}}
        if p > 0:  # time until the estimate is halfway from the previous rate to this one
            half = (rates_true[p - 1] + rate) / 2
            after = (arrivals >= start) & ((est >= half) if rate > rates_true[p - 1] else (est <= half))
            row["halfway_after_s"] = float(arrivals[after][0] - start) if after.any() else None
        out["phases"].append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=RESULTS / "serve_triton.json")
    ap.add_argument("--windows", default="2,4,8")
    args = ap.parse_args(argv)
    data = json.loads(args.json.read_text())
    acc, phase_s = data["acceptance"], float(data["phase_s"])
    run = acc["runs"]["elastic router"]
    arrivals, phase = np.array(run["records"]["arrival"]), np.array(run["phase_of"])
    rows = [summarise(arrivals, phase, acc["rates_rps"], phase_s, float(w)) for w in args.windows.split(",")]
    out = {"source": str(args.json), "source_date": data.get("date"), "machine": data.get("machine"), "windows": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "rate_window.json").write_text(json.dumps(out, indent=1) + "\n")
    md = [f"# The arrival-rate estimate replayed on {args.json.name} ({data.get('date')})", "",
          "Estimate / true rate at each arrival in the steady part of each phase (from 2 s in), percentiles; "
          "halfway: seconds after the change of phase until the estimate is halfway to the new rate.", "",
          "| window | phase (rate) | p1 | p50 | p99 | p99.9 | halfway s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        for i, ph in enumerate(r["phases"]):
            half = ph.get("halfway_after_s")
            md.append(f"| {r['window_s']:g} s | {i} ({ph['rate_rps']:.1f}/s) | {ph['p1']:.2f} | {ph['p50']:.2f} | "
                      f"{ph['p99']:.2f} | {ph['p99.9']:.2f} | {'-' if half is None else f'{half:.2f}'} |")
    md += ["", "Detected steps (s): " + "; ".join(f"{r['window_s']:g} s window: {r['detected_steps_at_s']}" for r in rows)]
    (RESULTS / "rate_window.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
