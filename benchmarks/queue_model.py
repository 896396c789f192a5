"""The router's queueing estimate against the queue it models, and three ways to correct it from answers.

The load-adaptive router (``elastic_export.serving.slo``) predicts the latency quantile of a budget model
under Poisson arrivals with a mean-value estimate of a bulk-service queue (each batch holds the previous
cycle's arrivals; ``predict_quantile_ms``), then fits a scale on ``S(n) = a + c·n`` to the answers' median.
This script measures how far that estimate is from the queue itself, and what each correction would predict:

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
    python benchmarks/queue_model.py [--artifacts DIR] [--runs benchmarks/results/serve_triton_amd.json ...]

Writes benchmarks/results/queue_model.{json,md}. The service times are measured when the script runs, not
when the runs were recorded: on a host whose speed moves, read part 2 as the shape of each correction's
error, not as its size.
"""

from __future__ import annotations

import argparse
import bisect
import functools
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any, Sequence, Tuple

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from elastic_export.serving import slo  # noqa: E402

RESULTS = Path(__file__).parent / "results"
MODEL_LOADS = (0.3, 0.45, 0.6, 0.7, 0.8, 0.9)
QUANTILES = (0.5, 0.9, 0.99)
SEEDS, ARRIVALS = (1, 2, 3), 40000
D0_MS = 3.0  # the fixed cost per batch of the third correction
#: the queue's table (:func:`bulk_queue_table`): shapes ``c / S(1)`` from SHAPES[0] to 1, loads ``λc`` from 0 to
#: LOAD_MAX (denser towards both ends), QUEUE_ARRIVALS seeded arrivals at each, the latency at every
#: 1 / QUANTILE_STEPS quantile
SHAPES = (0.01, 0.025) + tuple(round(0.05 * i, 2) for i in range(1, 21))
LOADS = (0.0, 0.002, 0.005, 0.01, 0.02, 0.035) + tuple(round(0.05 + 0.92 * (1 - (1 - k / 27) ** 2), 4)
                                                     for k in range(28))
LOAD_MAX = LOADS[-1]
QUEUE_ARRIVALS, QUANTILE_STEPS = 10000, 1000


def queue_latencies(a: float, c: float, rate: float, n: int = ARRIVALS, seed: int = 1) -> np.ndarray:
    """Latencies (ms) of ``n`` Poisson arrivals (``rate`` per s) at a server that, when it frees, takes every
    row waiting and serves them in ``a + c·n`` ms (a batch of one at once when idle)."""
    t = np.cumsum(np.random.default_rng(seed).exponential(1e3 / rate, n))
    lat, i, end = np.empty(n), 0, 0.0
    while i < n:
        start = max(end, t[i])
        j = max(i + 1, int(np.searchsorted(t, start, side="right")))
        end = start + a + c * (j - i)
        lat[i:j] = end - t[i:j]
        i = j
    return lat


def queue_quantiles(f: slo.Affine, rate: float, quantiles=QUANTILES, seeds=SEEDS, n: int = ARRIVALS) -> list[float]:
    if rate * f.c / 1e3 >= LOAD_MAX:
        return [float("inf")] * len(quantiles)
    lat = np.concatenate([queue_latencies(f.a, f.c, rate, n, s) for s in seeds])
    return [float(np.quantile(lat, q)) for q in quantiles]


def model_against_queue(f: slo.Affine) -> list[dict]:
    rows = []
    for load in MODEL_LOADS:
        rate = load * 1e3 / f.c
        rows.append({"load": load, "rate": rate,
                     "router": [slo.predict_quantile_ms(f, rate, q) for q in QUANTILES],
                     "table": [table_quantile_ms(f, rate, q) for q in QUANTILES],
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


def _bulk_latencies(t: Any, shape: Any) -> Any:
    """Latencies (units of ``S(1)``) of arrivals at times ``t`` (one row per cell) at a server whose batch of
    ``n`` takes ``(1 - shape) + shape·n`` (``shape``: one per cell), arrival by arrival for all cells at once:
    an arrival that finds the server idle starts a batch of one; one that finds it busy joins the batch
    waiting for it, which starts when the server frees, with every row that arrived by then."""
    import numpy as np

    cells, n = t.shape
    ends = np.zeros((cells, n + 1))  # per batch id (from 1), its end
    batch = np.zeros((cells, n), dtype=np.int64)  # per arrival, its batch id
    busy_end, waiting, ids, rows = np.zeros(cells), np.zeros(cells), np.zeros(cells, dtype=np.int64), np.arange(cells)
    for j in range(n):
        now = t[:, j]
        start = (waiting > 0) & (now >= busy_end)  # the waiting batch started when the server freed
        busy_end = np.where(start, busy_end + (1 - shape) + shape * waiting, busy_end)
        ends[rows[start], ids[start]] = busy_end[start]
        waiting[start] = 0
        idle = now >= busy_end
        ids = ids + (idle | (waiting == 0))  # a batch of its own, or the first row of the next waiting one
        busy_end = np.where(idle, now + 1.0, busy_end)
        ends[rows[idle], ids[idle]] = busy_end[idle]
        waiting = np.where(idle, waiting, waiting + 1)
        batch[:, j] = ids
    last = waiting > 0
    ends[rows[last], ids[last]] = busy_end[last] + (1 - shape[last]) + shape[last] * waiting[last]
    return np.take_along_axis(ends, batch, axis=1) - t


@functools.lru_cache(maxsize=1)
def bulk_queue_table() -> Any:
    """The simulated bulk-service queue (:func:`_bulk_latencies`): latency quantiles (units of ``S(1)``)
    indexed ``[shape, load, quantile]`` over :data:`SHAPES` x :data:`LOADS` x ``0, 1/QUANTILE_STEPS, ..., 1``,
    non-decreasing in the load. Every cell serves the same seeded Poisson stream of
    :data:`QUEUE_ARRIVALS` (common random numbers: the cells differ by their parameters, not by their
    noise); batches are as large as the queue (the budget models' ``max_batch_size`` of 128 is past any
    batch at a load the SLO allows). About 1.4 s once per process on this project's 2-CPU machine."""
    import numpy as np

    shape = np.repeat(np.asarray(SHAPES), len(LOADS) - 1)  # one cell per (shape, load > 0)
    load = np.tile(np.asarray(LOADS[1:]), len(SHAPES))
    stream = np.cumsum(np.random.default_rng(0).exponential(1.0, QUEUE_ARRIVALS))
    lat = np.sort(_bulk_latencies(stream[None, :] * (shape / load)[:, None], shape), axis=1)
    at = np.clip(np.ceil(np.linspace(0, 1, QUANTILE_STEPS + 1) * QUEUE_ARRIVALS).astype(int) - 1, 0, None)
    table = lat[:, at].reshape(len(SHAPES), len(LOADS) - 1, QUANTILE_STEPS + 1)
    table = np.concatenate([np.ones((len(SHAPES), 1, QUANTILE_STEPS + 1)), table], axis=1)
    return np.maximum.accumulate(table, axis=1)


def _bracket(grid: Sequence[float], x: float) -> Tuple[int, float]:
    """The index ``i`` with ``grid[i] <= x <= grid[i + 1]`` (clamped to the grid) and ``x``'s weight on ``i + 1``."""
    x = min(max(x, grid[0]), grid[-1])
    i = min(max(bisect.bisect_right(grid, x) - 1, 0), len(grid) - 2)
    return i, (x - grid[i]) / (grid[i + 1] - grid[i])


def table_quantile_ms(service: slo.Affine, rate: float, quantile: float = 0.99) -> float:
    """The ``quantile`` of the latency (ms) at ``rate`` arrivals/s of one row each (module docstring): the
    table :func:`bulk_queue_table`, interpolated in the shape and the load (a shape below
    ``SHAPES[0]`` is read as it); ``inf`` at or past :data:`LOAD_MAX` of the saturation rate."""
    one = service.ms(1)
    load = rate * service.c / 1e3  # λc: the share of the saturation rate 1 / c
    if load >= LOAD_MAX:
        return math.inf
    if load <= 0:
        return one
    table = bulk_queue_table()
    i, u = _bracket(SHAPES, service.c / max(one, 1e-12))
    k, w = _bracket(LOADS, load)
    q = min(QUANTILE_STEPS, max(0, math.ceil(quantile * QUANTILE_STEPS - 1e-9)))
    lo = table[i, k, q] ** (1 - w) * table[i, k + 1, q] ** w  # geometric in the load: the queue's convex
    hi = table[i + 1, k, q] ** (1 - w) * table[i + 1, k + 1, q] ** w  # growth, not a chord above it
    return one * float(lo + u * (hi - lo))


def corrections(f: slo.Affine, run: Path) -> list[dict]:
    data = json.loads(run.read_text())["acceptance"]
    dense = data["runs"]["dense-only"]
    arrival, latency = np.asarray(dense["records"]["arrival"]), np.asarray(dense["records"]["latency_ms"])
    phase_of, seconds = np.asarray(dense["phase_of"]), json.loads(run.read_text()).get("phase_s", 20.0)
    forms = {
        "scale a, c (router's estimate)": (lambda k: slo.Affine(f.a * k, f.c * k), slo.predict_quantile_ms, 0.5, 4.0),
        "scale a, c (queue)": (lambda k: slo.Affine(f.a * k, f.c * k), table_quantile_ms, 0.5, 4.0),
        "cost per batch (queue)": (lambda d: slo.Affine(f.a + d, f.c), table_quantile_ms, 0.0, 200.0),
        f"d0 {D0_MS:g} ms + scale c (queue)": (lambda k: slo.Affine(f.a + D0_MS, f.c * k), table_quantile_ms, 0.5, 4.0),
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
    ap.add_argument("--runs", type=Path, nargs="*", default=[RESULTS / "serve_triton_amd.json"])
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
