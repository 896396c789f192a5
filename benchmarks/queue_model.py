"""The router's queueing estimate against the queue it models, and three ways to correct it from answers.

Until the evening of 2026-12-04 the load-adaptive router (``elastic_export.serving.slo``) predicted the latency quantile of a
budget model under Poisson arrivals with a mean-value estimate of a bulk-service queue (each batch holds the
previous cycle's arrivals; :func:`mean_value_quantile_ms` here), then fitted a scale on ``S(n) = a + c·n`` to
the answers' median; it now reads the queue's simulated table (``slo.predict_quantile_ms``, "table" below).
This script measures how far each estimate is from the queue itself, and what each correction would predict:

1. **Model against queue**: dense's ``S(1)`` and ``S(8)`` measured here in onnxruntime (as the router
   measures them when it loads), ``S(n) = a + c·n`` fitted; at loads ``λc`` of 0.3 to 0.9 the router's
   p50 / p90 / p99 against the same queue simulated (Poisson arrivals, a server that takes every row waiting
   when it frees; 3 seeds of 40,000 arrivals).
2. **Corrections fitted to answers** (``--runs``: ``serve_triton.py`` JSON files): each run's dense-only
   answers at 0.3x and 0.6x, their arrival rates as the router's ``RateEstimator`` reads them; three
   corrections fitted at the median, each then predicting p50 / p90 / p99 at the phase's rate (and p99
   at a rate estimate 10 % high, what a noisy estimate asks of it):
   ``scale a, c`` (the router's, on its mean-value estimate and on the simulated queue), ``cost per batch``
   (``a + d``, ``c`` as measured) and ``d0 + scale c`` (a fixed 3 ms per batch, the per-row time scaled).

Usage:
    python benchmarks/queue_model.py [--artifacts DIR] [--runs benchmarks/results/serve_triton.json ...]

Writes benchmarks/results/queue_model.{json,md}. The service times are measured when the script runs, not
when the runs were recorded: on a host whose speed moves, read part 2 as the shape of each correction's
error, not as its size.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from elastic_export.serving import slo  # noqa: E402

RESULTS = Path(__file__).parent / "results"
MODEL_LOADS = (0.3, 0.45, 0.6, 0.7, 0.8, 0.9)
QUANTILES = (0.5, 0.9, 0.99)
SEEDS, ARRIVALS = (1, 2, 3), 40000
D0_MS = 3.0  # the fixed cost per batch of the third correction
def queue_quantiles(f: slo.Affine, rate: float, quantiles=QUANTILES, seeds=SEEDS, n: int = ARRIVALS) -> list[float]:
    if rate * f.c / 1e3 >= slo.LOAD_MAX:
        return [float("inf")] * len(quantiles)
    lat = np.concatenate([slo.queue_latencies(f.a, f.c, rate, n, s) for s in seeds])
    return [float(np.quantile(lat, q)) for q in quantiles]


def model_against_queue(f: slo.Affine) -> list[dict]:
    rows = []
    for load in MODEL_LOADS:
        rate = load * 1e3 / f.c
        rows.append({"load": load, "rate": rate,
                     "router": [mean_value_quantile_ms(f, rate, q) for q in QUANTILES],
                     "table": [slo.predict_quantile_ms(f, rate, q) for q in QUANTILES],
                     "queue": queue_quantiles(f, rate)})
    return rows


def estimated_rates(arrivals: np.ndarray) -> np.ndarray:
    est = slo.RateEstimator(clock=lambda: 0.0)
    out = []
    for t in arrivals:
        est.arrive(float(t))
        out.append(est.rate(float(t)))
    return np.asarray(out)


def fit_median(make, rates: np.ndarray, lat: np.ndarray, predict, lo: float, hi: float) -> float:
    """The parameter of ``make`` (bisection in ``[lo, hi]``) under which half the answers are above the
    predicted median at the rate each arrived at (answers binned by rate to 1 row/s)."""
    bins: dict[int, list[float]] = {}
    for r, x in zip(rates, lat):
        bins.setdefault(int(round(r)), []).append(x)

    def above(p: float) -> int:
        f = make(p)
        return sum(sum(x > predict(f, r, 0.5) for x in xs) for r, xs in bins.items())

    for _ in range(18):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if above(mid) > len(lat) / 2 else (lo, mid)
    return (lo + hi) / 2


def poisson_quantile(mean: float, q: float) -> int:
    """The smallest ``k`` with ``P(Poisson(mean) <= k) >= q`` (normal approximation past a mean of 200)."""
    if mean <= 0:
        return 0
    if mean > 200:
        from statistics import NormalDist

        return int(math.ceil(mean + NormalDist().inv_cdf(q) * math.sqrt(mean)))
    term = cdf = math.exp(-mean)
    k = 0
    while cdf < q:
        k += 1
        term *= mean / k
        cdf += term
    return k


def mean_value_quantile_ms(service: slo.Affine, rate: float, quantile: float = 0.99) -> float:
    """The router's estimate until 2026-12-04: in steady state each batch holds the arrivals of the previous
    cycle, so a cycle lasts ``T = a / (1 - λc)``; an arrival finds the server busy with probability
    ``min(1, λT)``, waits a residual uniform on ``[0, T]``, and its batch holds ``Poisson(λT)`` other rows at
    that quantile. Kept here as what the table replaced."""
    lam = rate / 1e3
    if lam * service.c >= 1.0:
        return math.inf
    cycle = service.a / (1.0 - lam * service.c) if service.a > 0 else service.c
    busy = min(1.0, lam * cycle)
    wait = cycle * max(0.0, 1.0 - (1.0 - quantile) / busy) if busy > 0 else 0.0
    return wait + service.ms(1 + poisson_quantile(lam * cycle, quantile))


def corrections(f: slo.Affine, run: Path) -> list[dict]:
    data = json.loads(run.read_text())["acceptance"]
    dense = data["runs"]["dense-only"]
    arrival, latency = np.asarray(dense["records"]["arrival"]), np.asarray(dense["records"]["latency_ms"])
    phase_of, seconds = np.asarray(dense["phase_of"]), json.loads(run.read_text()).get("phase_s", 20.0)
    forms = {
        "scale a, c (router's estimate)": (lambda k: slo.Affine(f.a * k, f.c * k), mean_value_quantile_ms, 0.5, 4.0),
        "scale a, c (queue)": (lambda k: slo.Affine(f.a * k, f.c * k), slo.predict_quantile_ms, 0.5, 4.0),
        "cost per batch (queue)": (lambda d: slo.Affine(f.a + d, f.c), slo.predict_quantile_ms, 0.0, 200.0),
        f"d0 {D0_MS:g} ms + scale c (queue)": (lambda k: slo.Affine(f.a + D0_MS, f.c * k), slo.predict_quantile_ms, 0.5, 4.0),
    }
    out = []
    for phase, name in ((0, "0.3x"), (1, "0.6x")):
        m = phase_of == phase
        rates, lat = estimated_rates(arrival[m]), latency[m]
        rate = m.sum() / seconds
        row = {"run": run.name, "phase": name, "rate": float(rate),
               "measured": [float(np.quantile(lat, q)) for q in QUANTILES], "fits": {}}
        for label, (make, predict, lo, hi) in forms.items():
            p = fit_median(make, rates[40:], lat[40:], predict, lo, hi)
            g = make(p)
            row["fits"][label] = {"parameter": p, "predicted": [predict(g, rate, q) for q in QUANTILES],
                                  "p99_at_rate_plus_10pct": predict(g, 1.1 * rate, 0.99)}
        out.append(row)
        print(name, run.name, json.dumps(row["fits"], default=float)[:400])
    return out


def dense_service(artifacts: Path) -> dict[int, float]:
    from serve_triton import ensure_artifacts

    from elastic_export.targets import triton_onnx_model as om

    d = ensure_artifacts(artifacts)
    triton = d / "triton"
    name = "elastic_s000" if (triton / "elastic_s000").is_dir() else None
    path = triton / name / "1" / "model.onnx" if name else d / "model.onnx"
    return om.service_times(om.open_session(str(path), {}), 128, (1, 8), repeats=9)


def _ms(v: float) -> str:
    return "inf" if not np.isfinite(v) else f"{v:.0f}"


def report(out: dict) -> str:
    f = out["service"]
    lines = ["# The router's queueing estimate against the queue", "",
             f"Machine: {out['machine']}, {out['date']}. Dense `S(n)` measured here in onnxruntime "
             f"(128 tokens): S(1) {out['points']['1']:.1f} ms, S(8) {out['points']['8']:.1f} ms, so a = {f['a']:.2f}, "
             f"c = {f['c']:.2f} ms.", "", "## Model against queue", "",
             "| load λc | rate /s | router p50 / p90 / p99 ms | table p50 / p90 / p99 ms | queue p50 / p90 / p99 ms |",
             "|---|---|---|---|---|"]
    for r in out["model_against_queue"]:
        lines.append(f"| {r['load']:.2f} | {r['rate']:.1f} | {' / '.join(map(_ms, r['router']))} | "
                     f"{' / '.join(map(_ms, r['table']))} | {' / '.join(map(_ms, r['queue']))} |")
    lines += ["", "## Corrections fitted at the median to dense-only answers", "",
              "| run | phase | rate /s | measured p50 / p90 / p99 | correction | parameter | predicted p50 / p90 / p99 | "
              "p99 at +10 % rate |", "|---|---|---|---|---|---|---|---|"]
    for r in out["corrections"]:
        for label, fit in r["fits"].items():
            lines.append(f"| {r['run']} | {r['phase']} | {r['rate']:.1f} | {' / '.join(map(_ms, r['measured']))} | "
                         f"{label} | {fit['parameter']:.2f} | {' / '.join(map(_ms, fit['predicted']))} | "
                         f"{_ms(fit['p99_at_rate_plus_10pct'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from serve_triton import DEFAULT_ARTIFACTS, machine, write_results

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifacts", type=Path, default=DEFAULT_ARTIFACTS)
    ap.add_argument("--runs", type=Path, nargs="*", default=[RESULTS / "serve_triton.json"])
    args = ap.parse_args(argv)
    points = dense_service(args.artifacts)
    f = slo.fit_affine(points)
    out = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M"), "python": platform.python_version(),
           "points": {str(k): v for k, v in points.items()}, "service": {"a": f.a, "c": f.c},
           "model_against_queue": model_against_queue(f),
           "corrections": [row for run in args.runs for row in corrections(f, run)]}
    write_results("queue_model", out, report(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
