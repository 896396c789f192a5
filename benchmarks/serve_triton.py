"""The acceptance load test of the served elastic router: a real Triton server, real clients, seeded load.

One ``tritonserver`` (the ``serve`` extra's, loopback only) serves the default MiniLM artifacts' repository
(``build triton --budget-backend python``, the router's SLO policy with ``--slo-ms``). Then:

1. **Router overhead** (``overhead``): rounds of batch-1 requests through the router (sparsity 0.6: idle,
   it runs the request itself), through a copy that forwards every request (``<router>_bls``), through a
   bare BLS forwarder (``bls_floor``) and straight to the 0.6 budget model, order shuffled; the median of
   each one's differences to the direct request is what it adds.
2. **Head-of-line** (``head-of-line``): a batch-1 request at 0.6 sent while a dense 64-row request runs.
3. **Under load** (``under-load``): the router's own cost at 0.6x of dense capacity, where it should serve
   dense: the same seeded arrivals straight to the dense model and through the router naming sparsity 0,
   alternately, twice each; per arm p50 / p90 / p99, refusals and SLO attainment, and per arrival what
   the router adds (its latency minus the direct one of the same round), and how many it refused that
   direct answered within the SLO.
4. **Acceptance** (``acceptance``): the closed-loop capacity of every budget model, called directly and
   through the router naming it (served); then seeded
   Poisson phases of ``--phase-s`` seconds at 0.3x, 0.6x, 1.4x, 0.6x, 0.3x of dense capacity (served: through
   the router naming 0), sent
   open loop (each request at its arrival time) once to the
   router naming no sparsity (the policy decides) and once to the dense model (dense-only); then a 3x
   overload burst of 15 s and 10 s at 0.3x. Per phase: offered, answered, refused (UNAVAILABLE), lost
   (any other error), SLO attainment (answered within the SLO over offered), p50 / p99, mean served
   sparsity, the share served dense, and the served quality (recall@10 per budget from
   ``elastic-export eval``) against the oracle's (the densest budget whose served capacity is >= 1.25x
   the phase's rate); for the burst: refusal latency, Triton's own success + failure counts, and the time
   to answer within the SLO again. Also budget 0.6's served capacity against dense beside its FLOP ratio
   and its ONNX file's own speed ratio, and where the difference goes.

The client shares the machine's cores with the server, alike for both runs.

Usage:
    python benchmarks/serve_triton.py [--artifacts DIR] [--phase-s 20] [--slo-ms 250] [--seed 0]
        [--parts overhead,head-of-line,under-load,acceptance]
    python benchmarks/serve_triton.py --replot   # the plot again from results/serve_triton.json, nothing measured

``--artifacts`` defaults to ``~/.cache/elastic-export/serve_triton-minilm`` (what ``elastic-export --budgets
0.1..0.6`` writes, built on first use). Writes benchmarks/results/serve_triton.{json,md,png} when the
acceptance part runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))


from elastic_export.core.manifest import Manifest  # noqa: E402
from elastic_export.serving.router_config import INLINE_PARAMETER  # noqa: E402
from elastic_export.serving.slo import oracle_pair  # noqa: E402
from elastic_export.targets.triton import build_repository  # noqa: E402
from elastic_export.targets.tritonserver import TritonServer, free_port_block  # noqa: E402

RESULTS = Path(__file__).parent / "results"
DEFAULT_ARTIFACTS = Path.home() / ".cache" / "elastic-export" / "serve_triton-minilm"
BUDGETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6)
SMALL = 0.6  # the sparsity of the added-latency and head-of-line requests
PARTS = ("overhead", "head-of-line", "under-load", "acceptance")
UNDER_LOAD = 0.6  # x dense capacity: the under-load part's arrivals (the load at which the router should serve dense)
FLOOR = "bls_floor"  # the least a Python-backend model that forwards a request adds, measured beside the router
FLOOR_MODEL = '''"""Forwards each request to one model (BLS) and returns its answer: no checks, no policy, no threads."""
import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.target = json.loads(args["model_config"])["parameters"]["target"]["string_value"]

    def execute(self, requests):
        out = []
        for r in requests:
            inputs = [t for t in r.inputs() if t.name() != "sparsity"]
            res = pb_utils.InferenceRequest(model_name=self.target, inputs=inputs,
                                            requested_output_names=list(r.requested_output_names())).exec()
            out.append(pb_utils.InferenceResponse(output_tensors=res.output_tensors(),
                                                  error=res.error() if res.has_error() else None))
        return out
'''


def add_floor_model(repository: Path, router: str, target: str) -> str:
    """A ``bls_floor`` model beside the router (its inputs and outputs) forwarding to ``target``."""
    config = (repository / router / "config.pbtxt").read_text()
    config = config.replace(f'name: "{router}"', f'name: "{FLOOR}"', 1)
    config = config[:config.index("parameters [")] + (
        f'parameters [\n  {{\n    key: "target"\n    value {{ string_value: "{target}" }}\n  }}\n]\n')
    (repository / FLOOR / "1").mkdir(parents=True, exist_ok=True)
    (repository / FLOOR / "config.pbtxt").write_text(config)
    (repository / FLOOR / "1" / "model.py").write_text(FLOOR_MODEL)
    return FLOOR


def add_bls_router(repository: Path, router: str) -> str:
    """A copy of the router (``<router>_bls``) that never runs a request itself: every one goes to its
    budget model (BLS), as in a repository of onnxruntime or TensorRT budget models."""
    name = f"{router}_bls"
    shutil.rmtree(repository / name, ignore_errors=True)
    shutil.copytree(repository / router, repository / name, symlinks=True)
    config = (repository / name / "config.pbtxt").read_text().replace(f'name: "{router}"', f'name: "{name}"', 1)
    inline = f'key: "{INLINE_PARAMETER}"\n    value {{ string_value: "1" }}'
    if inline not in config:
        raise RuntimeError(f"{router}'s config has no {INLINE_PARAMETER!r} parameter")
    (repository / name / "config.pbtxt").write_text(config.replace(inline, inline.replace('"1"', '"0"')))
    return name


def budget_models(triton: dict) -> dict[float, str]:
    """Served sparsity -> budget model name, from the manifest's ``triton`` entry."""
    return {m["sparsity"]: m["name"] for m in triton["models"]}


def feeds_for(manifest: Manifest, batch: int, tokens: int, seed: int = 0) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(seed).integers(1000, 20000, (batch, tokens)).astype(np.int64)
    names = [v.name for v in manifest.inputs]
    base = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
    return {n: base[n] for n in names}


def grpc_inputs(feeds: dict[str, np.ndarray], sparsity: float | None = None) -> list:
    import tritonclient.grpc as g

    out = []
    for name, arr in feeds.items():
        out.append(g.InferInput(name, list(arr.shape), "INT64"))
        out[-1].set_data_from_numpy(arr)
    if sparsity is not None:
        out.append(g.InferInput("sparsity", [1, 1], "FP32"))
        out[-1].set_data_from_numpy(np.full((1, 1), sparsity, np.float32))
    return out


async def timed(client, model: str, inputs: list, outputs: list[str] | None = None, timeout_s: float = 30.0):
    """(latency ms, response or None, error or None) of one request."""
    import tritonclient.grpc as g

    wanted = [g.InferRequestedOutput(n) for n in outputs] if outputs else None
    t0 = time.perf_counter()
    try:
        res = await client.infer(model, inputs, outputs=wanted, client_timeout=timeout_s)
        return (time.perf_counter() - t0) * 1e3, res, None
    except Exception as e:  # a failed request is a result here
        return (time.perf_counter() - t0) * 1e3, None, str(e).splitlines()[0][:200]


def median_ci(values: np.ndarray) -> tuple[float, float]:
    """A distribution-free 95 % confidence interval of the median: the order statistics n/2 -+ 0.98 sqrt(n)
    (the binomial(n, 1/2)'s normal approximation)."""
    v = np.sort(values)
    half = 0.98 * np.sqrt(len(v))
    lo, hi = int(np.floor(len(v) / 2 - half)), int(np.ceil(len(v) / 2 + half))
    return float(v[max(lo, 0)]), float(v[min(hi, len(v) - 1)])


async def router_overhead(client, router: str, budget_model: str, feeds, n: int) -> dict:
    """``n`` rounds, each one request through the router (sparsity 0.6; idle, it runs the request itself),
    one through its copy that always forwards (:func:`add_bls_router`), one through the BLS floor model
    (:data:`FLOOR_MODEL`) and one straight to the budget model, back to back, the order shuffled (seeded)
    from round to round; what each forwarder adds is the median of its differences to the direct request
    of the same round, so that what the machine does meanwhile (slower or faster minutes) falls on every
    side of a round alike."""
    import random

    paths = {"router": (router, grpc_inputs(feeds, SMALL)), "bls_router": (f"{router}_bls", grpc_inputs(feeds, SMALL)),
             "floor": (FLOOR, grpc_inputs(feeds, SMALL)), "direct": (budget_model, grpc_inputs(feeds))}
    for _ in range(20):  # warm every path
        for model, inputs in paths.values():
            await timed(client, model, inputs, ["sentence_embedding"])
    ms: dict[str, list[float]] = {k: [] for k in paths}
    order, rng = list(paths), random.Random(0)
    for _ in range(n):
        rng.shuffle(order)
        for name in order:
            model, inputs = paths[name]
            latency, _, err = await timed(client, model, inputs, ["sentence_embedding"])
            if err is not None:
                raise RuntimeError(f"{model}: {err}")
            ms[name].append(latency)
    direct = np.array(ms["direct"])
    out = {"rounds": n, "direct_p50_ms": float(np.median(direct))}
    for name, key in (("router", "added"), ("bls_router", "bls_added"), ("floor", "floor_added")):
        added = np.array(ms[name]) - direct
        out.update({f"{name}_p50_ms": float(np.median(ms[name])), f"{key}_p50_ms": float(np.median(added)),
                    f"{key}_p50_ci95_ms": list(median_ci(added)),
                    f"{key}_p25_p75_ms": [float(np.percentile(added, 25)), float(np.percentile(added, 75))]})
    return out


def _arm_summary(rec: dict, slo_ms: float) -> dict:
    ok = np.array([o == "ok" for o in rec["outcome"]])
    ms = np.array(rec["latency_ms"])
    q = {f"p{p}_ms": float(np.percentile(ms[ok], p)) for p in (50, 90, 99)} if ok.any() else {}
    return {"offered": len(ms), "refused": int((~ok).sum()), **q, "slo_met": float(np.mean(ok & (ms <= slo_ms)))}


async def under_load(client, router: str, dense: str, feeds, args) -> dict:
    """The router's own cost under load: the same seeded Poisson arrivals at :data:`UNDER_LOAD` x dense's
    measured capacity sent straight to the dense budget model and through the router naming sparsity 0,
    alternately, twice each; per arm the latency quantiles, refusals and SLO attainment, and per arrival
    the router's latency minus the direct one of the same round (the machine's minutes fall on both)."""
    cap = await capacity(client, dense, feeds, args.concurrency, args.capacity_seconds * args.capacity_rounds,
                         warmup_s=CAPACITY_WARMUP_S)
    times, _ = phase_times([UNDER_LOAD * cap], [args.phase_s], args.seed)
    rounds = []
    for _ in range(2):
        pair = {}
        for arm, model, sparsity in (("direct", dense, None), ("router", router, 0.0)):
            await asyncio.sleep(2.0)  # the previous arm's queue drains
            pair[arm] = await open_loop(client, model, times, feeds, arm == "router", args.request_timeout, sparsity)
        rounds.append(pair)
    out = {"dense_capacity_rps": cap, "rate_rps": UNDER_LOAD * cap, "seconds": args.phase_s, "arrivals": len(times),
           "rounds": [{arm: _arm_summary(rec, args.slo_ms) for arm, rec in pair.items()} for pair in rounds]}
    diffs, refused_not_late = [], 0
    for pair in rounds:
        d, r = pair["direct"], pair["router"]
        for i in range(len(times)):
            if d["outcome"][i] == r["outcome"][i] == "ok":
                diffs.append(r["latency_ms"][i] - d["latency_ms"][i])
            elif r["outcome"][i] != "ok" and d["outcome"][i] == "ok" and d["latency_ms"][i] <= args.slo_ms:
                refused_not_late += 1
    diffs = np.array(diffs)
    out.update(added_p50_ms=float(np.median(diffs)), added_p90_ms=float(np.percentile(diffs, 90)),
               added_p99_ms=float(np.percentile(diffs, 99)), refused_where_direct_met_the_slo=refused_not_late)
    return out


async def head_of_line(client, router: str, manifest: Manifest, tokens: int, trials: int = 5) -> dict:
    small = grpc_inputs(feeds_for(manifest, 1, tokens), SMALL)
    big = grpc_inputs(feeds_for(manifest, 64, tokens, seed=1), 0.0)
    alone = [(await timed(client, router, small, ["sentence_embedding"]))[0] for _ in range(20)]
    alone_ms = float(np.median(alone))
    rows = []
    for _ in range(trials):
        big_task = asyncio.ensure_future(timed(client, router, big, ["sentence_embedding"]))
        await asyncio.sleep(0.05)  # the dense 64 x N request is running
        small_ms, _, err = await timed(client, router, small, ["sentence_embedding"])
        big_done_when_small_returned = big_task.done()
        big_ms = (await big_task)[0]
        rows.append({"small_ms": small_ms, "big_ms": big_ms, "big_done_first": big_done_when_small_returned,
                     "error": err})
    worst = max(r["small_ms"] for r in rows)
    bound = max(50.0, 5 * alone_ms)
    return {"small_alone_p50_ms": alone_ms, "trials": rows, "worst_small_ms": worst, "bound_ms": bound,
            "met": worst <= bound and not any(r["big_done_first"] for r in rows)}


async def triton_counts(client, model: str) -> tuple[int, int]:
    """Triton's own count of the model's successful and failed requests (its statistics extension)."""
    stats = await client.get_inference_statistics(model, as_json=True)
    s = stats["model_stats"][0]["inference_stats"]
    return int(s["success"].get("count", 0)), int(s["fail"].get("count", 0))


async def capacity(client, model: str, feeds, concurrency: int, seconds: float, sparsity: float | None = None,
                   warmup_s: float = 0.0) -> float:
    """Closed-loop answered requests per second with ``concurrency`` clients (the model's batcher batches), counted
    over ``seconds`` after ``warmup_s`` (the loop already running: the previous model's work is drained)."""
    inputs = grpc_inputs(feeds, sparsity)
    start = time.perf_counter() + warmup_s
    end = start + seconds
    done = 0

    async def worker():
        nonlocal done
        while time.perf_counter() < end:
            _, res, err = await timed(client, model, inputs, ["sentence_embedding"])
            done += err is None and time.perf_counter() >= start

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.perf_counter() - start)


# --- the acceptance load test (issue: the best quality the load allows) ---------------------------
PHASES = (0.3, 0.6, 1.4, 0.6, 0.3)  # x dense capacity, PHASE_S each
OVERLOAD = 3.0  # x dense capacity for OVERLOAD_S, then OVERLOAD_TAIL at 0.3x to see it recover
OVERLOAD_S, OVERLOAD_TAIL_S = 15.0, 10.0
CAPACITY_WARMUP_S = 0.5  # each capacity round's closed loop runs this long before it counts
CAPACITY_AGREE = 1.15  # a round agrees with its budget's median within this factor
CAPACITY_EXTRA_ROUNDS = 3  # at most this many more rounds while they do not
HEADROOM = 1.25  # the oracle's: the densest budget whose served capacity is >= HEADROOM x the phase's rate


def ensure_artifacts(path: Path) -> Path:
    """The default main job's artifacts (``elastic-export --budgets 0.1..0.6 --out PATH``), built when missing."""
    if not (path / "manifest.json").is_file():
        from elastic_export.pipeline import Options, run

        print(f"building {path} (the default main job, about a minute)")
        run(Options(budgets=BUDGETS, out=str(path)), echo=print)
    return path


def phase_times(rates: list[float], seconds: list[float], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded arrival times (s) through consecutive phases and the phase index of each.

    Each phase offers exactly ``round(rate x span)`` requests at uniform random times: a Poisson process
    conditioned on its count, so its clumps are Poisson's but its load is the phase's, not a draw that may
    land 3 standard deviations off it (a 0.6x phase once offered 0.66x). Phase ``i`` draws from its own
    stream (``seed``, ``i``), so a capacity measured a little higher or lower changes a phase's count by
    a few requests, not every later phase's draws."""
    times, phase, start = [], [], 0.0
    for i, (rate, span) in enumerate(zip(rates, seconds)):
        n = int(round(rate * span))
        unit = np.random.default_rng([seed, i]).random(n)
        times.append(start + span * np.sort(unit))
        phase.append(np.full(n, i))
        start += span
    return np.concatenate(times), np.concatenate(phase)


async def capacities(client, paths: dict, feeds, concurrency: int, seconds: float,
                     rounds: int = 3) -> tuple[dict, dict]:
    """Closed-loop answered requests/s of every path (``{key: (model, sparsity named or None)}``): the median of
    ``rounds`` interleaved rounds of ``seconds`` each (the paths in turn, the order reversed every other round),
    so a slow spell of the shared host lands on one round of several paths rather than on all of one path's
    measurement; while no majority of some path's rounds lies within :data:`CAPACITY_AGREE` of their median,
    up to :data:`CAPACITY_EXTRA_ROUNDS` more (a spell long enough to slow two rounds of three would otherwise
    be the median). Returns the medians and every round's figures."""
    order, runs = list(paths), {k: [] for k in paths}

    def agree(v: list) -> int:
        m = np.median(v)
        return sum(1 for x in v if max(x, m) <= CAPACITY_AGREE * min(x, m))

    r, unsettled = 0, []
    while r < rounds or (unsettled and r < rounds + CAPACITY_EXTRA_ROUNDS):
        for k in (order if r % 2 == 0 else order[::-1]):
            model, sparsity = paths[k]
            runs[k].append(await capacity(client, model, feeds, concurrency, seconds, sparsity=sparsity,
                                          warmup_s=CAPACITY_WARMUP_S))
        r += 1
        unsettled = [k for k in order if 2 * agree(runs[k]) <= len(runs[k])] if r >= rounds else []
        extra = f" (rounds of {', '.join(map(_key, unsettled))} disagree)" if unsettled else ""
        print(f"capacity round {r}/{rounds}: " + ", ".join(f"{_key(k)} {runs[k][-1]:.1f}" for k in order) + extra)
    return {k: float(np.median(runs[k])) for k in order}, {k: runs[k] for k in order}


def _key(k) -> str:
    """A capacity path's name in a line: ``0.5`` (the budget model) or ``0.5 served`` (through the router)."""
    return " ".join(f"{x:g}" if isinstance(x, float) else str(x) for x in (k if isinstance(k, tuple) else (k,)))


def capacity_paths(router: str, by_s: dict) -> dict:
    """Each budget model called directly (``s``: what its batcher sustains) and through the router naming its
    sparsity (``(s, "served")``: what a client of this server gets at that budget, the router's checks and
    hand-offs and their CPU on the shared cores included; the oracle's, and dense's sets the phases' rates).
    Through the router a closed loop's excess is refused, not queued: its figure counts answers."""
    paths = {}
    for s in sorted(by_s):
        paths[s] = (by_s[s], None)
        paths[(s, "served")] = (router, s)
    return paths


async def open_loop(client, model: str, times: np.ndarray, feeds, sparsity_output: bool, timeout_s: float,
                    sparsity: float | None = None) -> dict:
    """One request per arrival time, each sent at its time (never waiting for earlier answers): latency,
    served sparsity, and the outcome (``ok``, ``refused``: UNAVAILABLE, retryable; ``lost``: any other error);
    ``sparsity``: the one every request names (None: none)."""
    inputs = grpc_inputs(feeds, sparsity)
    outputs = ["sentence_embedding"] + (["served_sparsity"] if sparsity_output else [])
    t0 = time.perf_counter()
    tasks = []
    for t in times:
        delay = t0 + t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(timed(client, model, inputs, outputs, timeout_s=timeout_s)))
    rec = {"arrival": [float(t) for t in times], "latency_ms": [], "sparsity": [], "outcome": [], "error": [],
           "t0": t0}
    for ms, res, err in await asyncio.gather(*tasks):
        rec["latency_ms"].append(ms)
        rec["error"].append(err)
        rec["outcome"].append("ok" if err is None else "refused" if "UNAVAILABLE" in err else "lost")
        s = float(res.as_numpy("served_sparsity").ravel()[0]) if (res is not None and sparsity_output) else 0.0
        rec["sparsity"].append(s if res is not None else None)
    return rec


class ClientStalls:
    """The load generator's own stalls while it runs: its event loop late by more than ``min_ms`` on a
    ``tick_ms`` ticker, and its garbage collections longer than ``min_ms`` (times on the client's clock). A
    latency measured across such a stall holds the client's delay, not only the server's."""

    def __init__(self, tick_ms: float = 10.0, min_ms: float = 30.0):
        self.tick_ms, self.min_ms, self.late, self.gc = tick_ms, min_ms, [], []
        self._gc_start = None

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None:
            ms = (time.perf_counter() - self._gc_start) * 1e3
            if ms >= self.min_ms:
                self.gc.append((self._gc_start, ms, info.get("generation")))

    async def _tick(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(self.tick_ms / 1e3)
            late = (time.perf_counter() - t) * 1e3 - self.tick_ms
            if late >= self.min_ms:
                self.late.append((t, late))

    async def __aenter__(self) -> "ClientStalls":
        import gc

        gc.callbacks.append(self._on_gc)
        self._task = asyncio.ensure_future(self._tick())
        return self

    async def __aexit__(self, *exc) -> None:
        import gc

        self._task.cancel()
        gc.callbacks.remove(self._on_gc)

    def relative_to(self, t0: float) -> dict:
        return {"loop_late_ms": [(t - t0, ms) for t, ms in self.late],
                "gc_ms": [(t - t0, ms, g) for t, ms, g in self.gc]}


class GaugePoller:
    """The router's gauges (``elastic_router_*`` on the metrics port) every ``period_s`` in a thread of its own,
    timed on the client's clock: what the policy saw and predicted beside what the clients measured."""

    def __init__(self, metrics_url: str, period_s: float = 0.25):
        import threading

        self.url, self.period_s, self.samples = metrics_url, period_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "GaugePoller":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        import urllib.request

        while not self._stop.wait(self.period_s):
            try:
                text = urllib.request.urlopen(self.url, timeout=2).read().decode()
            except OSError:
                continue
            row = {"t": time.perf_counter()}
            for line in text.splitlines():
                if line.startswith("elastic_router_") and "{" in line and "_total" not in line:
                    name, value = line.split("{", 1)[0], line.rsplit(" ", 1)[1]
                    if "budget_up" not in name:
                        row[name[len("elastic_router_"):]] = float(value)
            self.samples.append(row)

    def relative_to(self, t0: float) -> dict[str, list]:
        """The samples as columns (:func:`gauge_columns`), ``t`` in seconds after ``t0``."""
        return gauge_columns([{**r, "t": r["t"] - t0} for r in self.samples])


def phase_summary(rec: dict, idx: np.ndarray, phase: int, slo_ms: float, quality: dict, oracle: float | None) -> dict:
    """Offered, answered, refused, lost, SLO attainment (answered within the SLO over offered), p50 / p99 of the
    answered, refusal p99, mean served sparsity, dense share, served quality against the oracle's. ``rec``:
    records in memory or as written (:func:`compact_records`)."""
    rows = [i for i in np.flatnonzero(idx == phase)]
    errors = error_messages(rec)
    ok = [i for i in rows if rec["outcome"][i] == "ok"]
    refused = [i for i in rows if rec["outcome"][i] == "refused"]
    lat = np.array([rec["latency_ms"][i] for i in ok]) if ok else np.array([np.nan])
    sp = [rec["sparsity"][i] for i in ok]
    q = [quality[s] for s in sp if s in quality]
    served_q = float(np.mean(q)) if q else None
    out = {"offered": len(rows), "answered": len(ok), "refused": len(refused),
           "lost": sum(rec["outcome"][i] == "lost" for i in rows),
           "slo_attainment": float(np.sum(lat <= slo_ms) / max(len(rows), 1)) if ok else 0.0,
           "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
           "refusal_p99_ms": float(np.percentile([rec["latency_ms"][i] for i in refused], 99)) if refused else None,
           "mean_sparsity": float(np.mean(sp)) if sp else None,
           "dense_share": float(np.mean([s == 0.0 for s in sp])) if sp else None,
           "served_quality": served_q, "errors": sorted({errors[i] for i in rows if errors[i]})[:3]}
    if oracle is not None:
        out.update(oracle_sparsity=oracle, oracle_quality=quality[oracle],
                   quality_vs_oracle=None if served_q is None else served_q - quality[oracle])
    return out


def recovery_s(rec: dict, end_s: float, slo_ms: float) -> float | None:
    """Seconds after ``end_s`` (the burst's end) until every later request is answered within the SLO."""
    late = [t for t, o, ms in zip(rec["arrival"], rec["outcome"], rec["latency_ms"])
            if t >= end_s and (o != "ok" or ms > slo_ms)]
    return max(0.0, max(late) - end_s) if late else 0.0


def quality_per_budget(directory: Path, sparsities: list[float]) -> tuple[str, dict]:
    """recall@10 per budget from ``elastic-export eval`` (DIR/eval.json, run when missing)."""
    from elastic_export.core.results import load as load_results

    path = directory / "eval.json"
    if not path.is_file():
        import subprocess

        subprocess.run([sys.executable, "-m", "elastic_export", "eval", str(directory), "--precision", "fp32"],
                       check=True)
    res = load_results(path)
    out = {}
    for r in res.quality():
        if r.get("precision", "fp32") == "fp32" and "recall@10" in r:
            out[round(float(r["sparsity"] or 0.0), 6)] = float(r["recall@10"])
    missing = [s for s in sparsities if s not in out]
    if missing:
        raise RuntimeError(f"{path}: no recall@10 for sparsity {missing}")
    return "recall@10", out


async def acceptance(client, router: str, by_s: dict, one, args, quality: dict, metrics_url: str) -> dict:
    """Capacities, then the schedule (router deciding / dense-only), then the overload burst."""
    sparsities = sorted(by_s)
    measured, rounds = await capacities(client, capacity_paths(router, by_s), one, args.concurrency,
                                        args.capacity_seconds, args.capacity_rounds)
    caps = {s: measured[s] for s in sparsities}  # direct: the budget models' own
    served = {s: measured[(s, "served")] for s in sparsities}  # through the router: the oracle's
    dense = served[0.0]  # the "dense capacity": a closed loop naming sparsity 0 through the server
    rates = [m * dense for m in PHASES]
    times, idx = phase_times(rates, [args.phase_s] * len(PHASES), args.seed)
    pairs = [(s, "fp32") for s in sparsities]
    cap_pairs = {(s, "fp32"): served[s] for s in sparsities}
    oracles = [oracle_pair(cap_pairs, r, pairs, HEADROOM)[0] for r in rates]
    runs = {}
    for name, model, flag in (("elastic router", router, True), ("dense-only", by_s[0.0], False)):
        await asyncio.sleep(2.0)  # the previous run's tail is gone
        before = await triton_counts(client, model)
        async with ClientStalls() as stalls:
            with GaugePoller(metrics_url) as gauges:
                rec = await open_loop(client, model, times, one, flag, args.request_timeout)
        rec["gauges"] = gauges.relative_to(rec["t0"]) if flag else {}
        rec["client_stalls"] = stalls.relative_to(rec["t0"])
        print(name, "client stalls (s, ms):", json.dumps({k: [[round(x, 2) for x in e[:2]] for e in v]
                                                         for k, v in rec["client_stalls"].items()}))
        after = await triton_counts(client, model)
        phases = [phase_summary(rec, idx, i, args.slo_ms, quality, oracles[i] if flag else None)
                  for i in range(len(PHASES))]
        runs[name] = {"model": model, "phases": phases, "records": rec, "phase_of": idx.tolist(),
                      "triton_success": after[0] - before[0], "triton_failure": after[1] - before[1]}
        print(name, json.dumps([{k: p[k] for k in ("offered", "answered", "refused", "lost", "slo_attainment",
                                                   "p99_ms", "mean_sparsity", "dense_share")} for p in phases]))
    await asyncio.sleep(2.0)
    o_times, o_idx = phase_times([OVERLOAD * dense, PHASES[0] * dense], [OVERLOAD_S, OVERLOAD_TAIL_S], args.seed + 1)
    before = await triton_counts(client, router)
    async with ClientStalls() as stalls:
        rec = await open_loop(client, router, o_times, one, True, args.request_timeout)
    rec["client_stalls"] = stalls.relative_to(rec["t0"])
    print("overload client stalls (s, ms):", json.dumps({k: [[round(x, 2) for x in e[:2]] for e in v]
                                                        for k, v in rec["client_stalls"].items()}))
    after = await triton_counts(client, router)
    burst = phase_summary(rec, o_idx, 0, args.slo_ms, quality, None)
    overload = {"rate_rps": OVERLOAD * dense, "seconds": OVERLOAD_S, "burst": burst,
                "tail": phase_summary(rec, o_idx, 1, args.slo_ms, quality, None),
                "recovery_s": recovery_s(rec, OVERLOAD_S, args.slo_ms), "records": rec, "phase_of": o_idx.tolist(),
                "triton_success": after[0] - before[0], "triton_failure": after[1] - before[1]}
    print("overload", json.dumps({k: v for k, v in overload.items() if k not in ("records", "phase_of")}))
    return {"capacity_rps": {str(s): caps[s] for s in sparsities},
            "capacity_rounds_rps": {str(s): rounds[s] for s in sparsities},
            "served_capacity_rps": {str(s): served[s] for s in sparsities},
            "served_capacity_rounds_rps": {str(s): rounds[(s, "served")] for s in sparsities},
            "rates_rps": rates, "oracle_sparsity": oracles, "runs": runs, "overload": overload}


def verdict(acc: dict, slo_ms: float) -> dict:
    """The issue's done criteria, each with the figure it is judged on."""
    router, dense = acc["runs"]["elastic router"]["phases"], acc["runs"]["dense-only"]["phases"]
    burst, o = acc["overload"]["burst"], acc["overload"]
    light = [p for m, p in zip(PHASES, router) if m <= 0.6]
    answered_refused = o["burst"]["answered"] + o["burst"]["refused"] + o["tail"]["answered"] + o["tail"]["refused"]
    return {
        "slo_attainment_ge_99pct_every_phase": min(p["slo_attainment"] for p in router) >= 0.99,
        "quality_within_0.005_of_oracle_every_phase": min(p["quality_vs_oracle"] for p in router) >= -0.005,
        "dense_ge_90pct_at_0.3x_and_0.6x": min(p["dense_share"] for p in light) >= 0.9,
        "dense_only_misses_the_slo_at_1.4x": dense[PHASES.index(1.4)]["slo_attainment"] < 0.99,
        "overload_0_lost": burst["lost"] + o["tail"]["lost"] == 0,
        "overload_refusals_p99_lt_50ms": (burst["refusal_p99_ms"] or 0.0) < 50.0,
        "overload_answered_p99_within_slo": burst["p99_ms"] <= slo_ms,
        "overload_triton_counts_equal_answered_plus_refused": o["triton_success"] + o["triton_failure"] == answered_refused,
        "overload_recovers_within_5s": o["recovery_s"] <= 5.0,
    }


def _rolling(t: list[float], v: list[float], width: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Mean of ``v`` over windows of ``width`` seconds of ``t``."""
    t, v = np.asarray(t), np.asarray(v)
    edges = np.arange(0.0, (t.max() if len(t) else 0.0) + width, width)
    mids, means = [], []
    for lo in edges:
        sel = (t >= lo) & (t < lo + width)
        if sel.any():
            mids.append(lo + width / 2)
            means.append(v[sel].mean())
    return np.array(mids), np.array(means)


def plot(path: Path, acc: dict, slo_ms: float, phase_s: float) -> None:
    """Served sparsity against the oracle's over time (router), latency against the SLO (both runs), and
    the router's own gauges (its predicted and measured SLO-quantile latency, its service-time scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    rec = acc["runs"]["elastic router"]["records"]
    ok = [i for i, o in enumerate(rec["outcome"]) if o == "ok"]
    mids, means = _rolling([rec["arrival"][i] for i in ok], [rec["sparsity"][i] for i in ok])
    ax1.plot(mids, means, color="tab:blue", lw=1.5, label="router: mean served sparsity (1 s windows)")
    edges = np.arange(len(PHASES) + 1) * phase_s
    ax1.step(edges, list(acc["oracle_sparsity"]) + [acc["oracle_sparsity"][-1]], where="post", color="k", ls="--",
             lw=1, label=f"oracle: densest budget with served capacity >= {HEADROOM:g}x the rate")
    ax1.set_ylabel("sparsity")
    ax1.legend(fontsize=8, loc="upper left")
    for m, x in zip(PHASES, edges):
        ax1.text(x + phase_s / 2, ax1.get_ylim()[1] * 0.92, f"{m:g}x", ha="center", fontsize=8)
    for name, color in (("dense-only", "tab:red"), ("elastic router", "tab:blue")):
        r = acc["runs"][name]["records"]
        ok = [i for i, o in enumerate(r["outcome"]) if o == "ok"]
        ax2.scatter([r["arrival"][i] for i in ok], [r["latency_ms"][i] for i in ok], s=3, color=color, label=name)
    ax2.axhline(slo_ms, color="k", ls="--", lw=1, label=f"SLO {slo_ms:g} ms")
    ax2.set_yscale("log")
    ax2.set_ylabel("latency (ms)")
    ax2.legend(fontsize=8, loc="upper left")
    _plot_gauges(ax3, rec.get("gauges") or {}, slo_ms)
    ax3.set_xlabel("time (s)")
    fig.suptitle("Real Triton server, seeded phases of dense capacity: served sparsity vs the oracle", fontsize=10)
    fig.tight_layout()
    from _png import save_png

    save_png(fig, path)


def _plot_gauges(ax, gauges: dict[str, list], slo_ms: float) -> None:
    """The router's gauges as scraped during its run (columns, :func:`gauge_columns`): predicted and measured
    latency quantile, and the scale on its modelled service times (right axis)."""
    t = gauges.get("t", [])

    def column(key: str) -> list:
        return [np.nan if v is None else v for v in gauges.get(key, [None] * len(t))]

    for key, color, label in (("predicted_latency_ms", "tab:purple", "router: predicted p99 at the served budget"),
                              ("measured_latency_ms", "tab:green", "router: measured p99 of its recent answers")):
        ax.plot(t, column(key), color=color, lw=1, label=label)
    ax.axhline(slo_ms, color="k", ls="--", lw=1)
    ax.set_yscale("log")
    ax.set_ylabel("router gauges (ms)")
    ax.legend(fontsize=8, loc="upper left")
    twin = ax.twinx()
    twin.plot(t, column("latency_correction"), color="tab:orange", lw=1)
    twin.set_ylabel("service-time scale", color="tab:orange", fontsize=8)


def where_it_goes(directory: Path, manifest: Manifest, sparsity: float, tokens: int, caps: dict) -> dict:
    """Budget ``sparsity``'s served capacity against dense, beside its FLOP ratio and the ONNX files' own
    speed ratio in this process (batch 8, onnxruntime, no server): the gap between the last two is the
    per-request cost that does not shrink with the model (server, router, client, tokens on the wire)."""
    from elastic_export.targets.onnxruntime import make_session

    budget = next(b for b in manifest.budgets if abs(b.sparsity - sparsity) < 1e-6)
    per_row = {}
    for name, file in (("dense", manifest.dense.onnx), ("budget", budget.onnx)):
        sess = make_session(directory / file)
        feeds = feeds_for(manifest, 8, tokens)
        sess.run(None, feeds)
        runs = []
        for _ in range(10):
            t0 = time.perf_counter()
            sess.run(None, feeds)
            runs.append((time.perf_counter() - t0) * 1e3 / 8)
        per_row[name] = float(np.median(runs))
    served = caps[str(sparsity)] / caps["0.0"]
    cost = {k: 1e3 / caps[k] for k in ("0.0", str(sparsity))}  # ms per answered request, served
    return {"sparsity": sparsity, "served_capacity_ratio": served, "flop_ratio": manifest.dense.gflops / budget.gflops,
            "onnx_speed_ratio_b8": per_row["dense"] / per_row["budget"], "onnx_ms_per_row_b8": per_row,
            "served_ms_per_request": cost,
            "fixed_ms_per_request": {k: cost[k] - per_row["dense" if k == "0.0" else "budget"] for k in cost}}


def machine() -> str:
    """The host line of the results: CPU with the vector extensions that decide onnxruntime's kernels (hosts
    of one CPU name differ: some have AVX-512, some only AVX2), cores, versions."""
    from elastic_export.measure.timing import machine as host

    h = host()
    return (f"{h['cpu']} ({', '.join(h['cpu_features']) or 'no AVX2'}), {h['logical_cpus']} logical CPUs, Python "
            f"{platform.python_version()}, onnxruntime {h['onnxruntime']}, Triton 2.51 (nvidia-pytriton wheel, CPU, "
            f"Python backend)")


async def measure(server: TritonServer, directory: Path, manifest: Manifest, t: dict, args) -> dict:
    import tritonclient.grpc.aio as aio

    client = aio.InferenceServerClient(server.grpc_url)
    tokens = args.seq_len or manifest.tokens
    one = feeds_for(manifest, 1, tokens)
    router, by_s = t["router"], budget_models(t)
    out = {"tokens": tokens}
    try:
        if "overhead" in args.parts:
            out["router_overhead"] = await router_overhead(client, router, by_s[SMALL], one, args.overhead_rounds)
            print("router overhead", json.dumps(out["router_overhead"]))
        if "head-of-line" in args.parts:
            out["head_of_line"] = await head_of_line(client, router, manifest, tokens)
            print("head of line", {k: v for k, v in out["head_of_line"].items() if k != "trials"})
        if "under-load" in args.parts:
            out["under_load"] = await under_load(client, router, by_s[0.0], one, args)
            print("under load", json.dumps(out["under_load"]))
        if "acceptance" in args.parts:
            metric, quality = quality_per_budget(directory, sorted(by_s))
            acc = await acceptance(client, router, by_s, one, args, quality, server.metrics_url)
            acc.update(quality_metric=metric, quality=quality, verdict=verdict(acc, args.slo_ms),
                       sparsest=where_it_goes(directory, manifest, max(by_s), tokens, acc["served_capacity_rps"]))
            out["acceptance"] = acc
        return out
    finally:
        await client.close()


def _phase_rows(phases: list[dict], with_oracle: bool) -> list[str]:
    rows = []
    for m, p in zip(PHASES, phases):
        ms = "-" if p["mean_sparsity"] is None else f"{p['mean_sparsity']:.2f}"
        dense = "-" if p["dense_share"] is None else f"{100 * p['dense_share']:.0f} %"
        row = (f"| {m:g}x | {p['offered']} | {p['answered']} | {p['refused']} | {p['lost']} | "
               f"{100 * p['slo_attainment']:.1f} % | {p['p50_ms']:.0f} | {p['p99_ms']:.0f} | {ms} | {dense} |")
        if with_oracle:
            row += (f" {p['served_quality']:.4f} | {p['oracle_sparsity']:g} ({p['oracle_quality']:.4f}) | "
                    f"{p['quality_vs_oracle']:+.4f} |")
        rows.append(row)
    return rows


def _capacity_line(acc: dict, args) -> str:
    """Each budget's capacity, direct and served through the router: the median of its rounds, with their
    range when there are several."""
    rounds = acc.get("capacity_rounds_rps", {})

    def one(k: str, v: float, rounds: dict) -> str:
        r = rounds.get(k, [])
        spread = f" ({min(r):.0f}-{max(r):.0f})" if len(r) > 1 else ""
        return f"{'dense' if k == '0.0' else k} {v:.0f}{spread}"

    how = (f"the median of {len(next(iter(rounds.values())))} interleaved rounds of {args.capacity_seconds:g} s, "
           "their range in brackets" if rounds else "one round")
    line = (f"Capacity of each budget model, closed loop with {args.concurrency} clients ({how}; requests/s): "
            + ", ".join(one(k, v, rounds) for k, v in acc["capacity_rps"].items()) + ".")
    if "served_capacity_rps" in acc:
        served = acc.get("served_capacity_rounds_rps", {})
        line += (" Served through the router naming each budget (the oracle's; the router's checks and hand-offs "
                 "on the same cores): " + ", ".join(one(k, v, served) for k, v in acc["served_capacity_rps"].items())
                 + ".")
    return line


def _stalls_line(acc: dict) -> str:
    """The load generator's own stalls in each run (:class:`ClientStalls`)."""
    def one(name: str, records: dict) -> str:
        st = records.get("client_stalls") or {}
        late, gc = st.get("loop_late_ms", []), st.get("gc_ms", [])
        worst = max([ms for _, ms in late] + [ms for _, ms, _ in gc], default=0.0)
        return (f"{name}: {len(late)} event-loop delays and {len(gc)} garbage collections of 30 ms or more "
                f"(longest {worst:.0f} ms)")
    runs = [(n, acc["runs"][n]["records"]) for n in acc["runs"]] + [("overload", acc["overload"]["records"])]
    return "The client's own stalls: " + "; ".join(one(n, r) for n, r in runs) + "."


def report_lines(out: dict, args) -> list[str]:
    acc = out["acceptance"]
    head = "| phase | offered | answered | refused | lost | SLO met | p50 ms | p99 ms | mean sparsity | dense |"
    lines = [f"# Real Triton load test ({out['date']})", "", f"Machine: {out['machine']}", "",
             f"SLO p99 {args.slo_ms:g} ms; one {out['tokens']}-token text per request; seeded phases of "
             f"{args.phase_s:g} s (each exactly its rate x span requests at Poisson times) at "
             f"{', '.join(f'{m:g}x' for m in PHASES)} of dense's served capacity (a closed loop naming sparsity 0 "
             f"through the router); seed {args.seed}.", "",
             _capacity_line(acc, args), "",
             f"## Elastic router (no sparsity named); quality: {acc['quality_metric']} from `elastic-export eval`", "",
             head + " served quality | oracle (quality) | vs oracle |", "|---" * 13 + "|",
             *_phase_rows(acc["runs"]["elastic router"]["phases"], True), "",
             "## Dense-only (the dense budget model, direct)", "", head, "|---" * 10 + "|",
             *_phase_rows(acc["runs"]["dense-only"]["phases"], False), "", _stalls_line(acc), ""]
    o = acc["overload"]
    b, tail = o["burst"], o["tail"]
    lines += [f"## Overload: {OVERLOAD:g}x dense capacity ({o['rate_rps']:.0f} requests/s) for {OVERLOAD_S:g} s, "
              f"then {PHASES[0]:g}x", "",
              f"Burst: {b['offered']} offered, {b['answered']} answered (p50 {b['p50_ms']:.0f} ms, p99 {b['p99_ms']:.0f} "
              f"ms), {b['refused']} refused (UNAVAILABLE, p99 {b['refusal_p99_ms'] or 0:.1f} ms), {b['lost']} lost. "
              f"After it: {tail['offered']} offered, {tail['refused']} refused, {tail['lost']} lost; answering within the "
              f"SLO again {o['recovery_s']:.2f} s after the burst. Triton's own count: {o['triton_success']} successes + "
              f"{o['triton_failure']} failures = {o['triton_success'] + o['triton_failure']} (answered + refused "
              f"{b['answered'] + b['refused'] + tail['answered'] + tail['refused']}).", ""]
    w = acc["sparsest"]
    lines += [f"Budget {w['sparsity']:g} served {w['served_capacity_ratio']:.2f}x dense's capacity; its FLOP ratio is "
              f"{w['flop_ratio']:.2f}x and its ONNX file alone runs {w['onnx_speed_ratio_b8']:.2f}x dense's speed here "
              f"(batch 8, onnxruntime in process). The rest is per-request cost that does not shrink with the model: "
              f"{w['fixed_ms_per_request']['0.0']:.1f} ms of the {w['served_ms_per_request']['0.0']:.1f} ms a dense "
              f"request costs served, {w['fixed_ms_per_request'][str(w['sparsity'])]:.1f} ms of "
              f"{w['served_ms_per_request'][str(w['sparsity'])]:.1f} ms at {w['sparsity']:g} (server, router, client "
              f"and the two cores they share).", "",
              "Done criteria: " + "; ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in acc["verdict"].items()) + ".",
              ""]
    if "router_overhead" in out:
        o, h = out["router_overhead"], out["head_of_line"]
        lo, hi = o["added_p50_ci95_ms"]
        lines += [f"Router added latency at batch 1: {o['added_p50_ms']:.2f} ms (95 % CI {lo:.2f}..{hi:.2f}; idle, it "
                  f"runs the request itself); forwarding every request (BLS) {o['bls_added_p50_ms']:.2f} ms, a bare BLS "
                  f"forwarder {o['floor_added_p50_ms']:.2f} ms ({o['rounds']} shuffled rounds against the {SMALL:g} "
                  f"budget model direct). Head-of-line: batch-1 at {SMALL:g} behind a dense 64-row request: worst "
                  f"{h['worst_small_ms']:.1f} ms, bound {h['bound_ms']:.1f} ms: {'met' if h['met'] else 'NOT met'}.", ""]
    return lines + ["![load test](serve_triton.png)", ""]


def _significant(value, digits: int = 7):
    """``value`` with every float cut to ``digits`` significant digits (microseconds at a minute's arrival
    times; the per-request records stay the bulk of a run's file)."""
    if isinstance(value, dict):
        return {k: _significant(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_significant(v, digits) for v in value]
    if isinstance(value, (float, np.floating)):
        return float(f"{float(value):.{digits}g}")
    if isinstance(value, np.integer):
        return int(value)
    return value


def _rounded(values, decimals: int) -> list:
    return [None if v is None else round(float(v), decimals) for v in values]


def _sig4(values) -> list:
    return [None if v is None else float(f"{float(v):.4g}") for v in values]


def gauge_columns(rows: list[dict]) -> dict[str, list]:
    """Gauge samples (a dict each) as columns, each gauge named once (None: not scraped in that sample)."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return {k: [r.get(k) for r in rows] for k in keys}


def compact_records(rec: dict) -> dict:
    """A run's per-request records as a results file holds them: ``arrival`` to 0.1 ms (``rate_window.py``
    replays it through the rate estimator, which 1 ms ties would change), the gauges' and the client stalls'
    times to 1 ms, latencies to 0.1 ms, served sparsity to 4 decimals, gauge values to 4 significant
    digits, the gauges as columns (:func:`gauge_columns`), ``hit`` as 1 / 0, and each distinct error message
    once: ``errors`` lists them after a leading None, ``error_id`` is each request's index into it (0: no
    error; :func:`error_messages` reads them back). Records already compact come back as they are."""
    out = {}
    for key, v in rec.items():
        if key == "error":
            errors = list(dict.fromkeys([None, *v]))
            at = {e: i for i, e in enumerate(errors)}
            out["error_id"], out["errors"] = [at[e] for e in v], errors
        elif key == "hit":
            out[key] = [None if h is None else int(h) for h in v]
        elif key == "arrival":
            out[key] = _rounded(v, 4)
        elif key == "latency_ms":
            out[key] = _rounded(v, 1)
        elif key == "sparsity":
            out[key] = _rounded(v, 4)
        elif key == "gauges":
            cols = gauge_columns(v) if isinstance(v, list) else v
            out[key] = {k: _rounded(c, 3) if k == "t" else _sig4(c) for k, c in cols.items()}
        elif key == "client_stalls":
            out[key] = {k: [[round(e[0], 3), round(e[1], 1), *e[2:]] for e in events] for k, events in v.items()}
        else:
            out[key] = v
    return out


def error_messages(rec: dict) -> list:
    """Each request's error message (None: none), from records in memory or as written (:func:`compact_records`)."""
    if "error" in rec:
        return list(rec["error"])
    return [rec["errors"][i] for i in rec["error_id"]]


def _compact(value):
    """``value`` with every ``records`` dict (a run's per-request columns) compacted (:func:`compact_records`)."""
    if isinstance(value, dict):
        return {k: compact_records(v) if k == "records" and isinstance(v, dict) else _compact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_compact(v) for v in value]
    return value


def results_json(out: dict) -> str:
    """A results file's JSON: compact, per-request records compacted (:func:`compact_records`), other floats to
    7 significant digits (:func:`_significant`)."""
    return json.dumps(_significant(_compact(out)), separators=(",", ":"), default=float) + "\n"


def write_results(name: str, out: dict, text: str) -> None:
    """``results/NAME.json`` (``out``, :func:`results_json`) and ``results/NAME.md`` (``text``), and the text printed."""
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(results_json(out))
    (RESULTS / f"{name}.md").write_text(text)
    print(text)


def write(out: dict, args) -> None:
    write_results("serve_triton", out, "\n".join(report_lines(out, args)))
    plot(RESULTS / "serve_triton.png", out["acceptance"], args.slo_ms, args.phase_s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifacts", type=Path, default=DEFAULT_ARTIFACTS)
    ap.add_argument("--phase-s", type=float, default=20.0, help="seconds of each load phase")
    ap.add_argument("--slo-ms", type=float, default=250.0)
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per request (default: the manifest's N)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--capacity-seconds", type=float, default=3.0, help="seconds of each capacity round per budget")
    ap.add_argument("--capacity-rounds", type=int, default=3,
                    help="interleaved capacity rounds; each budget's capacity is their median")
    ap.add_argument("--overhead-rounds", type=int, default=300,
                    help="rounds (router, BLS floor, direct) of the added latency")
    ap.add_argument("--parts", default=",".join(PARTS),
                    help="what to measure (comma-separated); the results files are written when acceptance runs")
    ap.add_argument("--server-log", type=Path, default=Path("/tmp/serve_triton.server.log"),
                    help="the server's output (kept)")
    ap.add_argument("--request-timeout", type=float, default=30.0, help="client timeout of every request (s)")
    ap.add_argument("--partial-json", type=Path, default=None, help="without acceptance: write what was measured here")
    ap.add_argument("--replot", action="store_true",
                    help="only redraw results/serve_triton.png from results/serve_triton.json (nothing measured)")
    args = ap.parse_args(argv)
    if args.replot:
        out = json.loads((RESULTS / "serve_triton.json").read_text())
        plot(RESULTS / "serve_triton.png", out["acceptance"], out["slo_ms"], out["phase_s"])
        return 0
    args.parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    unknown = args.parts - set(PARTS)
    if unknown or not args.parts:
        ap.error(f"--parts: choose among {', '.join(PARTS)}")
    d = ensure_artifacts(args.artifacts)
    t = build_repository(d, platform="python", kind="cpu", policy="adaptive", slo_ms=args.slo_ms, echo=print).triton
    manifest = Manifest.load(d)
    server = TritonServer(d / "triton", port=free_port_block(), log=args.server_log)
    try:
        server.start_routed([m["name"] for m in t["models"]], t["router"])
        if "overhead" in args.parts:
            server.load(add_floor_model(d / "triton", t["router"], budget_models(t)[SMALL]))
            server.load(add_bls_router(d / "triton", t["router"]))
        out = asyncio.run(measure(server, d, manifest, t, args))
    finally:
        server.stop()
    out.update({"date": time.strftime("%Y-%m-%d"), "machine": machine(), "slo_ms": args.slo_ms,
                "phase_s": args.phase_s, "seed": args.seed, "artifacts": str(d)})
    if "acceptance" in args.parts:
        write(out, args)
    else:
        print(f"only {', '.join(sorted(args.parts))} measured: {RESULTS / 'serve_triton.*'} left as they are")
        if args.partial_json:
            args.partial_json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
