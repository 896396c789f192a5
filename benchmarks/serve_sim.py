"""Serving simulation: dense-only vs the load-adaptive ElasticRuntime under a load spike.

Requests arrive as a (non-homogeneous) Poisson process whose rate follows a profile of multiples
of the dense model's measured capacity (default: 0.5x, rising to 1.5x, falling back to 0.5x), into
a FIFO queue (``--queue-limit``; arrivals beyond it are dropped) served by ``--workers`` workers.
Both servers see the *same* seeded arrival sequence. Every served request is real onnxruntime
inference on the artifact directory (batch 1, ``--seq-len`` tokens) and its measured time is its
service time on a simulated clock, so the simulation needs no sleeping and both servers face the
same offered load however busy the machine is (the service times themselves are real, so a loaded
machine makes both slower alike).

* **dense-only**: ``rt.set_budget(0.0)`` for every request.
* **load-adaptive**: :class:`elastic_export.serving.runtime.LoadAdaptivePolicy` with the measured p50
  service times; at every dispatch the server reports the queue depth and the arrival rate over
  the last ``--rate-window`` seconds (``rt.observe``), and the request runs at the policy's budget
  (``--high-utilization`` / ``--low-utilization``, the hysteresis band: the policy's own
  defaults, 0.85 / 0.6, unless given).

Latency = queueing + service. Reported per server: served, dropped, late (latency > the p99
target), p50/p99 latency, mean sparsity, budget switches. Also the median ``set_budget`` cost.

Usage:
    python benchmarks/serve_sim.py [--artifacts DIR] [--duration 60] [--profile 0:0.5,0.25:0.5,...]
        [--target-ms MS] [--queue-limit 64] [--workers 1] [--threads 1] [--seq-len 128] [--seed 0]

``--artifacts`` defaults to ``~/.cache/elastic-export/serve_sim-minilm-fisher``, built on first
use from the embedded all-MiniLM-L6-v2 (``--method fisher``, budgets 0.1..0.6; about a minute).
Writes benchmarks/results/serve_sim.{json,md,png}.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import inspect
import json
import os
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from elastic_export.measure.timing import measure_profile  # noqa: E402
from elastic_export.serving.runtime import ElasticRuntime, LoadAdaptivePolicy, measure_switch_cost  # noqa: E402
from elastic_export.targets.onnxruntime import SessionConfig  # noqa: E402

RESULTS = Path(__file__).parent / "results"
POLICY_DEFAULTS = inspect.signature(LoadAdaptivePolicy).parameters
DEFAULT_ARTIFACTS = Path.home() / ".cache" / "elastic-export" / "serve_sim-minilm-fisher"
DEFAULT_PROFILE = "0:0.5,0.2:0.5,0.4:1.5,0.65:1.5,0.85:0.5,1:0.5"


def parse_profile(text: str) -> list[tuple[float, float]]:
    """``"t0:m0,t1:m1,..."`` (time as a fraction of the duration, rate as a multiple of dense capacity).

    Args:
        text: the profile; times ascending from 0 to 1, multiples >= 0; linear in between.
    """
    pts = [tuple(float(x) for x in p.split(":")) for p in text.split(",")]
    ts = [t for t, _ in pts]
    if ts[0] != 0 or ts[-1] != 1 or ts != sorted(ts) or any(m < 0 for _, m in pts):
        raise SystemExit(f"--profile {text}: times must rise from 0 to 1 and multiples be >= 0")
    return pts


def arrivals(profile: list[tuple[float, float]], capacity: float, duration: float, seed: int) -> np.ndarray:
    """Arrival times (s) of a Poisson process with rate ``capacity x profile(t / duration)``, by thinning.

    Args:
        profile: (fraction of duration, multiple of capacity) points.
        capacity: requests per second the dense model serves.
        duration: seconds.
        seed: random seed.
    """
    rng = np.random.default_rng(seed)
    ts, ms = zip(*profile)
    peak = max(ms) * capacity
    n = rng.poisson(peak * duration)
    cand = np.sort(rng.uniform(0, duration, n))
    rate = np.interp(cand / duration, ts, ms) * capacity
    return cand[rng.uniform(0, peak, n) < rate]


def simulate(rt: ElasticRuntime, times: np.ndarray, feeds: list[dict], adaptive: bool, queue_limit: int,
             workers: int, rate_window: float) -> dict:
    """One server over the arrival sequence; returns per-request records and the summary inputs.

    Args:
        rt: the runtime (dense-only: budget 0.0, no policy; adaptive: its installed policy).
        times: arrival times (s), ascending.
        feeds: request inputs, used round-robin.
        adaptive: report the load to the policy at every dispatch.
        queue_limit: waiting requests beyond which an arrival is dropped.
        workers: servers taking from the one queue.
        rate_window: seconds over which the arrival rate is measured.
    """
    free = [0.0] * workers  # when each worker is next free
    heapq.heapify(free)
    queue: deque[int] = deque()
    i, n = 0, len(times)
    rec = {"arrival": [], "latency": [], "sparsity": [], "dropped": []}
    while True:
        tw = free[0]
        nxt = times[i] if i < n else float("inf")
        if queue and tw <= nxt:
            k = queue.popleft()
            start = max(tw, times[k])
            if adaptive:
                lo = bisect.bisect_right(times, start - rate_window, 0, i)
                rate = (i - lo) / rate_window
                rt.observe(len(queue), rate)
            s = rt.choose(1)
            t0 = time.perf_counter()
            rt.run(feeds[k % len(feeds)], sparsity=s)
            service = time.perf_counter() - t0
            heapq.heapreplace(free, start + service)
            rec["arrival"].append(float(times[k]))
            rec["latency"].append((start + service - times[k]) * 1e3)
            rec["sparsity"].append(s)
        elif i < n:
            if len(queue) >= queue_limit:
                rec["dropped"].append(float(times[i]))
            else:
                queue.append(i)
            i += 1
        else:
            return rec


def summarize(rec: dict, target_ms: float, offered: int) -> dict:
    lat = np.array(rec["latency"])
    return {"offered": offered, "served": len(lat), "dropped": len(rec["dropped"]),
            "late": int((lat > target_ms).sum()),
            "late_or_dropped_pct": 100.0 * (int((lat > target_ms).sum()) + len(rec["dropped"])) / max(offered, 1),
            "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
            "max_ms": float(lat.max()), "mean_sparsity": float(np.mean(rec["sparsity"])),
            "switches": int(np.count_nonzero(np.diff(rec["sparsity"]))),
            "meets_p99_target": bool(np.percentile(lat, 99) <= target_ms and not rec["dropped"])}


def plot(path: Path, results: dict, profile, capacity: float, duration: float, target_ms: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    t = np.linspace(0, duration, 400)
    ts, ms = zip(*profile)
    ax[0].plot(t, np.interp(t / duration, ts, ms) * capacity, label="offered rate")
    ax[0].axhline(capacity, ls="--", c="gray", label="dense capacity")
    ax[0].set_ylabel("requests / s")
    ax[0].legend(loc="upper left")
    for name, rec in results.items():
        a, lat = np.array(rec["arrival"]), np.array(rec["latency"])
        bins = np.arange(0, duration + 1, 1.0)
        idx = np.digitize(a, bins)
        p99 = [np.percentile(lat[idx == j], 99) if np.any(idx == j) else np.nan for j in range(1, len(bins))]
        ax[1].plot(bins[:-1] + 0.5, p99, label=f"{name}: p99 per second")
        if rec["dropped"]:
            ax[1].plot(rec["dropped"], [target_ms * 0.5] * len(rec["dropped"]), "x", ms=3, label=f"{name}: dropped")
    ax[1].axhline(target_ms, ls="--", c="red", label=f"target {target_ms:.0f} ms")
    ax[1].set_yscale("log")
    ax[1].set_ylabel("latency (ms)")
    ax[1].legend(loc="upper left", fontsize=8)
    rec = results["load-adaptive"]
    ax[2].step(rec["arrival"], rec["sparsity"], where="post", label="load-adaptive")
    ax[2].set_ylabel("sparsity")
    ax[2].set_xlabel("time (s, simulated)")
    ax[2].legend(loc="upper left")
    fig.tight_layout()
    from _png import save_png

    save_png(fig, path)


def ensure_artifacts(path: Path, budgets: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6)) -> Path:
    """The artifact directory, built from the embedded MiniLM (fisher, ``budgets``) when missing."""
    if (path / "manifest.json").is_file():
        return path
    from elastic_export.pipeline import Options, run

    print(f"building artifacts in {path} (about a minute)")
    run(Options(budgets=budgets, method="fisher", out=str(path)), echo=print)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifacts", type=Path, default=DEFAULT_ARTIFACTS)
    ap.add_argument("--duration", type=float, default=60.0, help="simulated seconds")
    ap.add_argument("--profile", default=DEFAULT_PROFILE, help="time fraction:multiple of dense capacity, ...")
    ap.add_argument("--target-ms", type=float, default=None, help="p99 latency target (default: 5x dense p50)")
    ap.add_argument("--queue-limit", type=int, default=64)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--rate-window", type=float, default=1.0)
    ap.add_argument("--high-utilization", type=float, default=POLICY_DEFAULTS["high_utilization"].default,
                    help="policy: go sparser above this (default: the policy's)")
    ap.add_argument("--low-utilization", type=float, default=POLICY_DEFAULTS["low_utilization"].default,
                    help="policy: go denser only below this (default: the policy's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

    t_start = time.time()
    rt = ElasticRuntime.from_dir(ensure_artifacts(args.artifacts), config=SessionConfig(threads=args.threads))
    rng = np.random.default_rng(args.seed)
    feeds = []
    for _ in range(8):
        ids = rng.integers(1000, 30000, (1, args.seq_len), dtype=np.int64)
        feeds.append({"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)})
    prof = measure_profile(rt, {1: feeds[0]}, repeats=15, warmup=3)
    service = {s: v["p50_ms"] for s, v in prof.batches[1].items()}
    capacity = args.workers * 1e3 / service[0.0]
    target = args.target_ms or 5 * service[0.0]
    profile = parse_profile(args.profile)
    times = arrivals(profile, capacity, args.duration, args.seed)
    print(f"dense p50 {service[0.0]:.1f} ms -> capacity {capacity:.1f} req/s; {len(times)} arrivals over "
          f"{args.duration:.0f} s; p99 target {target:.0f} ms")

    results = {}
    rt.set_budget(0.0)
    results["dense-only"] = simulate(rt, times, feeds, False, args.queue_limit, args.workers, args.rate_window)
    rt.set_policy(LoadAdaptivePolicy(service_ms=service, high_utilization=args.high_utilization,
                                     low_utilization=args.low_utilization))
    results["load-adaptive"] = simulate(rt, times, feeds, True, args.queue_limit, args.workers, args.rate_window)
    switch_ms = measure_switch_cost(rt)
    summary = {k: summarize(v, target, len(times)) for k, v in results.items()}

    args.out.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    data = {"config": {**config, "target_ms": target, "dense_capacity_rps": capacity},
            "service_p50_ms": {f"{s:g}": v for s, v in service.items()},
            "set_budget_median_ms": switch_ms, "summary": summary,
            "wall_s": time.time() - t_start}
    (args.out / "serve_sim.json").write_text(json.dumps(data, indent=2) + "\n")
    head = ("| server | offered | served | dropped | late (> target) | late or dropped | p50 ms | p99 ms "
            "| mean sparsity | switches |")
    rows = [head, "|" + "---|" * 10]
    for k, v in summary.items():
        rows.append(f"| {k} | {v['offered']} | {v['served']} | {v['dropped']} | {v['late']} | "
                    f"{v['late_or_dropped_pct']:.1f} % | {v['p50_ms']:.0f} | {v['p99_ms']:.0f} | "
                    f"{v['mean_sparsity']:.2f} | {v['switches']} |")
    md = [f"# serve_sim: dense-only vs load-adaptive ({args.artifacts.name})", "",
          f"Poisson arrivals, rate profile `{args.profile}` (x dense capacity {capacity:.1f} req/s), "
          f"{args.duration:.0f} simulated s, seed {args.seed}, {args.workers} worker(s), {args.threads} thread(s), "
          f"batch 1 x {args.seq_len} tokens, queue limit {args.queue_limit}, p99 target {target:.0f} ms "
          f"(5x dense p50 unless given); load-adaptive policy utilisation band {args.high_utilization:g} / "
          f"{args.low_utilization:g} (high / low).", "",
          *rows, "",
          "Service p50 (ms) per sparsity: " + ", ".join(f"{s:g}: {v:.1f}" for s, v in service.items()) + ".",
          f"Median set_budget cost: {switch_ms * 1e3:.2f} µs.", ""]
    (args.out / "serve_sim.md").write_text("\n".join(md))
    plot(args.out / "serve_sim.png", results, profile, capacity, args.duration, target)
    print("\n".join(rows))
    print(f"set_budget median {switch_ms * 1e3:.2f} µs; wall {time.time() - t_start:.0f} s")
    ok = summary["load-adaptive"]["meets_p99_target"] and not summary["dense-only"]["meets_p99_target"]
    print("load-adaptive holds the p99 target that dense-only misses:", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
