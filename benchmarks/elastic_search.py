"""Search through a real server under a load spike: what the budget the load allows does to search quality.

One ``elastic-export serve`` (a real Triton server, loopback only, the router's SLO policy with ``--slo-ms``)
serves the default MiniLM artifacts (what ``elastic-export --budgets 0.1..0.6`` writes; built once, shared
with ``benchmarks/serve_triton.py``, served here from a hard-linked copy so that its repository stays as it
is) with an index built by ``elastic-export index`` (timed) over the documents of a retrieval set: the
held-out query -> document pairs ``elastic-export eval`` uses by default (``heldout_pairs``), or ``--pairs
FILE`` (JSONL with ``query`` and ``doc``), each side cut at a word to the model's N tokens so that the index,
the server and ``eval`` see the same text (``fit_pairs``). Then, through the search model (``elastic_search``,
each query encoded by the router):

1. **Recall per budget** (``recall``): every query searched at each served budget (named), recall@10 against
   the known relevant document, beside ``elastic-export eval``'s recall@10 for that budget on the same pairs
   (``evaluate``; queries by the budget's model, documents by the dense one): equal within 0.01 or not.
2. **The spike** (``spike``): the closed-loop search capacity at each budget; then the seeded Poisson
   schedule of ``benchmarks/serve_triton.py`` (0.3x, 0.6x, 1.4x, 0.6x, 0.3x of dense search capacity,
   ``--phase-s`` each, one query per request, queries drawn from the pairs), sent open loop once with the
   router deciding (no sparsity named) and once dense-only (sparsity 0 named: the router's admission then
   refuses what would miss the SLO instead of serving a cheaper budget). Per phase and over time: served
   budget, latency against the SLO, refusals, and recall@10 of the answered queries (beside what eval's
   recall of the budgets served predicts, and the oracle's: the densest budget whose capacity covers 1.25x
   the phase's rate).

Usage:
    python benchmarks/elastic_search.py [--quick] [--artifacts DIR] [--pairs FILE] [--n-pairs 1000]
        [--phase-s 20] [--slo-ms 250] [--seed 0] [--out DIR]
    python benchmarks/elastic_search.py --replot [--out DIR]   # the plot again from the JSON, nothing measured

Writes ``elastic_search.{json,md,png}`` into ``benchmarks/results/`` (``--quick``: short phases, 300 pairs,
written to ``/tmp/elastic_search_quick/`` unless ``--out`` says otherwise: a check that it runs).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

import serve_triton as ST  # noqa: E402  (the artifacts, the spike schedule, the phase summary, the machine line)

from elastic_export.serving.slo import oracle_pair  # noqa: E402
from elastic_export.targets.tritonserver import free_port_block  # noqa: E402

WORK = Path.home() / ".cache" / "elastic-export" / "elastic_search-minilm"
QUICK_OUT = Path("/tmp/elastic_search_quick")
SEARCH = "elastic_search"
TOP_K = 10
RECALL_TOLERANCE = 0.01  # the bound: served recall@10 per budget against eval's
RECALL_WINDOW_S = 2.0  # recall@10 over time: the mean over the answered queries of windows this long
READY_S = 300.0


# --- the directory, the pairs, the index ------------------------------------------------------------
def prepare(artifacts: Path, work: Path) -> Path:
    """A fresh copy of the default artifacts (built when missing) at ``work``: the large files hard links,
    the small ones copies, no ``triton/`` or ``index/`` (this benchmark adds its own)."""
    src = ST.ensure_artifacts(artifacts)
    shutil.rmtree(work, ignore_errors=True)

    def place(a: str, b: str) -> None:
        (os.link if os.path.getsize(a) > 1 << 20 else shutil.copyfile)(a, b)

    shutil.copytree(src, work, copy_function=place, ignore=shutil.ignore_patterns("triton", "index", ".*", "eval.json"))
    return work


def retrieval_pairs(directory: Path, pairs_file: Path | None, n: int) -> tuple[list[dict], str]:
    """The query/document pairs (``--pairs`` or ``heldout_pairs(n)``), cut to the manifest's N tokens."""
    from elastic_export.core.manifest import Manifest
    from elastic_export.data.retrieval_data import fit_pairs, heldout_pairs
    from elastic_export.measure.evaluation import load_pairs
    from elastic_export.models.text import TextEncoder, tokenizer_folder

    manifest = Manifest.load(directory)
    tokenizer = TextEncoder.from_dir(tokenizer_folder(manifest, directory), ["input_ids"]).tokenizer
    raw, source = ((load_pairs(pairs_file, n), str(pairs_file)) if pairs_file else
                   (heldout_pairs(n), f"heldout_pairs(n={n}, seed=0)"))
    pairs = fit_pairs(raw, tokenizer, int(manifest.tokens))
    return pairs, f"{source}, cut to {manifest.tokens} tokens: {len(pairs)} pairs"


def timed_index(directory: Path, corpus: Path) -> tuple[float, str]:
    """``elastic-export index DIR CORPUS --overwrite`` in a fresh process: its wall time (s) and its output."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "elastic_export", "index", str(directory), str(corpus), "--overwrite"],
                       capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"elastic-export index failed: {r.stderr.strip()[-500:]}")
    return seconds, r.stdout.strip()


def build_index(directory: Path, pairs: list[dict]) -> dict:
    """``elastic-export index DIR corpus.jsonl`` over the pairs' documents (id = the pair's number), timed."""
    corpus = directory.parent / f"{directory.name}-corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "text": p["doc"]}) + "\n" for i, p in enumerate(pairs)))
    seconds, output = timed_index(directory, corpus)
    print(output, f"({seconds:.1f} s)")
    return {"documents": len(pairs), "seconds": seconds, "docs_per_s": len(pairs) / seconds,
            "command": f"elastic-export index {directory} {corpus.name} --overwrite", "output": output}


def eval_recall(directory: Path, pairs: list[dict], cache_dir: Path) -> dict[float, float]:
    """``elastic-export eval``'s recall@10 per budget (fp32) on ``pairs`` (``evaluate``), cached by the pairs
    and the model's fingerprint."""
    from elastic_export.core.manifest import Manifest
    from elastic_export.measure.evaluation import evaluate

    key = hashlib.sha256(json.dumps([pairs, Manifest.load(directory).model.fingerprint]).encode()).hexdigest()[:16]
    path = cache_dir / f"elastic_search-eval-{key}.json"
    if not path.is_file():
        print(f"elastic-export eval on {len(pairs)} pairs (cached in {path})")
        res = evaluate([directory], pairs=pairs, precisions=["fp32"], echo=print)
        rows = {round(float(b["sparsity"] or 0.0), 6): float(b["recall@10"]) for b in res["results"][0]["budgets"]}
        path.write_text(json.dumps({str(k): v for k, v in rows.items()}))
    return {float(k): v for k, v in json.loads(path.read_text()).items()}


# --- `elastic-export serve` ---------------------------------------------------------------------
class Served:
    """``elastic-export serve DIR`` in a session of its own, its output read by a thread; :meth:`stop`
    sends SIGTERM (its whole group after a bound)."""

    def __init__(self, directory: Path, slo_ms: float):
        self.port = free_port_block()
        self.lines: list[str] = []
        self.process = subprocess.Popen([sys.executable, "-m", "elastic_export", "serve", str(directory), "--port",
                                         str(self.port), "--slo-ms", f"{slo_ms:g}"], stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip())
            print("serve:", line.rstrip(), flush=True)

    def wait_ready(self, timeout_s: float = READY_S) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready = next((x for x in self.lines if x.startswith("ready:")), None)
            if ready is not None:
                if f"search '{SEARCH}'" not in ready:
                    raise RuntimeError(f"serve offers no search model: {ready}")
                return ready
            if self.process.poll() is not None:
                raise RuntimeError("serve exited: " + " | ".join(self.lines[-5:]))
            time.sleep(0.2)
        raise RuntimeError(f"serve not ready after {timeout_s:g} s")

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.port + 1}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)
        self._reader.join(10)


# --- search requests ------------------------------------------------------------------------------
def search_inputs(texts: list[str], sparsity: float | None) -> list:
    """The search model's inputs: ``text`` (one query per row), ``top_k`` 10, ``sparsity`` when named."""
    import tritonclient.grpc as g

    text = g.InferInput("text", [len(texts)], "BYTES")
    text.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
    k = g.InferInput("top_k", [1], "INT32")
    k.set_data_from_numpy(np.array([TOP_K], dtype=np.int32))
    out = [text, k]
    if sparsity is not None:
        out.append(g.InferInput("sparsity", [1, 1], "FP32"))
        out[-1].set_data_from_numpy(np.full((1, 1), sparsity, np.float32))
    return out


def hits_of(res, relevant: list[int]) -> list[bool]:
    """Whether each query's relevant document (its pair's number) is among the ids returned."""
    return [str(r).encode() in row for r, row in zip(relevant, res.as_numpy("ids"))]


async def recall_per_budget(client, pairs: list[dict], sparsities: list[float], batch: int = 64) -> dict[float, float]:
    """recall@10 of every query searched through the server at each budget (named), ``batch`` queries a request."""
    out = {}
    for s in sparsities:
        hits = []
        for start in range(0, len(pairs), batch):
            chunk = list(range(start, min(start + batch, len(pairs))))
            ms, res, err = await ST.timed(client, SEARCH, search_inputs([pairs[i]["query"] for i in chunk], s),
                                          ["ids", "served_sparsity"], timeout_s=120)
            if err is not None:
                raise RuntimeError(f"search at {s:g}: {err}")
            if set(res.as_numpy("served_sparsity").ravel().tolist()) != {s}:
                raise RuntimeError(f"asked for {s:g}, served {res.as_numpy('served_sparsity').ravel().tolist()}")
            hits += hits_of(res, chunk)
        out[s] = float(np.mean(hits))
        print(f"recall@10 at {s:g} through the server: {out[s]:.4f}")
    return out


async def search_capacity(client, pairs: list[dict], sparsity: float, concurrency: int, seconds: float) -> float:
    """Closed-loop answered searches per second at ``sparsity`` (named), ``concurrency`` clients, one query each."""
    end, done, turn = time.perf_counter() + seconds, 0, iter(range(10**9))

    async def worker():
        nonlocal done
        while time.perf_counter() < end:
            q = pairs[next(turn) % len(pairs)]["query"]
            _, _, err = await ST.timed(client, SEARCH, search_inputs([q], sparsity), ["ids"])
            done += err is None

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.perf_counter() - t0)


async def open_loop(client, times: np.ndarray, queries: np.ndarray, pairs: list[dict], sparsity: float | None,
                    timeout_s: float) -> dict:
    """One search per arrival time (query ``queries[i]``), each sent at its time: latency, served sparsity,
    outcome (``ok``, ``refused``: UNAVAILABLE, ``lost``: any other error) and whether it found its document."""
    t0 = time.perf_counter()
    tasks = []
    for t, q in zip(times, queries):
        delay = t0 + t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(ST.timed(client, SEARCH, search_inputs([pairs[q]["query"]], sparsity),
                                                    ["ids", "served_sparsity"], timeout_s=timeout_s)))
    rec: dict[str, list] = {"arrival": [float(t) for t in times], "query": [int(q) for q in queries], "latency_ms": [],
                            "sparsity": [], "outcome": [], "error": [], "hit": []}
    for q, (ms, res, err) in zip(queries, await asyncio.gather(*tasks)):
        rec["latency_ms"].append(ms)
        rec["error"].append(err)
        rec["outcome"].append("ok" if err is None else "refused" if "UNAVAILABLE" in err else "lost")
        rec["sparsity"].append(None if res is None else float(res.as_numpy("served_sparsity").ravel()[0]))
        rec["hit"].append(None if res is None else hits_of(res, [int(q)])[0])
    return rec


# --- the spike --------------------------------------------------------------------------------------
def phase_row(rec: dict, idx: np.ndarray, phase: int, slo_ms: float, quality: dict, oracle: float | None) -> dict:
    """serve_triton's phase summary (``served_quality``: eval's recall@10 of the budgets served) plus the
    recall@10 the answered queries got."""
    row = ST.phase_summary(rec, idx, phase, slo_ms, quality, oracle)
    hits = [rec["hit"][i] for i in np.flatnonzero(idx == phase) if rec["outcome"][i] == "ok"]
    row["recall@10"] = float(np.mean(hits)) if hits else None
    return row


def windows(rec: dict, key: str, width: float) -> dict:
    """The mean of ``rec[key]`` over the answered requests of windows of ``width`` seconds."""
    ok = [i for i, o in enumerate(rec["outcome"]) if o == "ok"]
    mids, means = ST._rolling([rec["arrival"][i] for i in ok], [float(rec[key][i]) for i in ok], width)
    return {"t": mids.tolist(), key: means.tolist(), "width_s": width}


async def spike(client, pairs: list[dict], sparsities: list[float], quality: dict, args) -> dict:
    """Search capacity per budget, then the spike schedule with the router deciding and dense-only."""
    caps = {}
    for s in sparsities:
        caps[s] = await search_capacity(client, pairs, s, args.concurrency, args.capacity_seconds)
        print(f"search capacity at {s:g}: {caps[s]:.1f} requests/s")
    rates = [m * caps[0.0] for m in ST.PHASES]
    times, idx = ST.phase_times(rates, [args.phase_s] * len(ST.PHASES), args.seed)
    queries = np.random.default_rng(args.seed).integers(0, len(pairs), len(times))
    budget_pairs = [(s, "fp32") for s in sparsities]
    oracles = [oracle_pair({(s, "fp32"): caps[s] for s in sparsities}, r, budget_pairs, ST.HEADROOM)[0] for r in rates]
    runs = {}
    for name, sparsity in (("elastic router", None), ("dense-only", 0.0)):
        await asyncio.sleep(2.0)  # the previous run's tail is gone
        rec = await open_loop(client, times, queries, pairs, sparsity, args.request_timeout)
        phases = [phase_row(rec, idx, i, args.slo_ms, quality, oracles[i] if sparsity is None else None)
                  for i in range(len(ST.PHASES))]
        runs[name] = {"sparsity_named": sparsity, "phases": phases, "records": rec, "phase_of": idx.tolist(),
                      "sparsity_over_time": windows(rec, "sparsity", 1.0),
                      "recall_over_time": windows(rec, "hit", RECALL_WINDOW_S)}
        print(name, json.dumps([{k: p[k] for k in ("offered", "answered", "refused", "lost", "slo_attainment",
                                                   "p99_ms", "mean_sparsity", "recall@10")} for p in phases]))
    return {"capacity_rps": {str(k): v for k, v in caps.items()}, "rates_rps": rates, "oracle_sparsity": oracles,
            "runs": runs}


async def measure(served: Served, pairs: list[dict], sparsities: list[float], quality: dict, args) -> dict:
    import tritonclient.grpc.aio as aio

    client = aio.InferenceServerClient(served.grpc_url)
    try:
        served_recall = await recall_per_budget(client, pairs, sparsities)
        recall = {str(s): {"served": served_recall[s], "eval": quality[s], "difference": served_recall[s] - quality[s],
                           "within_0.01": abs(served_recall[s] - quality[s]) <= RECALL_TOLERANCE} for s in sparsities}
        return {"recall_per_budget": recall, "spike": await spike(client, pairs, sparsities, quality, args)}
    finally:
        await client.close()


# --- the report -------------------------------------------------------------------------------------
def plot(path: Path, spike_out: dict, slo_ms: float, phase_s: float) -> None:
    """Served sparsity (with the oracle's), windowed recall@10 and latency against the SLO over time, both modes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(9, 8.5), sharex=True)
    colors = {"elastic router": "tab:blue", "dense-only": "tab:red"}
    edges = np.arange(len(ST.PHASES) + 1) * phase_s
    for name, run in spike_out["runs"].items():
        sp, rc = run["sparsity_over_time"], run["recall_over_time"]
        ax1.plot(sp["t"], sp["sparsity"], color=colors[name], lw=1.5, label=f"{name}: mean served sparsity (1 s)")
        ax2.plot(rc["t"], rc["hit"], color=colors[name], lw=1.5,
                 label=f"{name}: recall@10 of answered queries ({rc['width_s']:g} s)")
        r = run["records"]
        ok = [i for i, o in enumerate(r["outcome"]) if o == "ok"]
        ax3.scatter([r["arrival"][i] for i in ok], [r["latency_ms"][i] for i in ok], s=3, color=colors[name], label=name)
    oracle = list(spike_out["oracle_sparsity"])
    ax1.step(edges, oracle + oracle[-1:], where="post", color="k", ls="--", lw=1,
             label=f"oracle: densest budget with capacity >= {ST.HEADROOM:g}x the rate")
    top = max([0.1] + oracle + [v for run in spike_out["runs"].values() for v in run["sparsity_over_time"]["sparsity"]])
    ax1.set_ylim(-0.12 * top, 1.3 * top)  # room for the phase labels below the dense line, the legend above
    for m, x in zip(ST.PHASES, edges):
        ax1.text(x + phase_s / 2, 0.02, f"{m:g}x", ha="center", fontsize=8, transform=ax1.get_xaxis_transform())
    for ax in (ax1, ax2, ax3):
        for x in edges[1:-1]:
            ax.axvline(x, color="0.85", lw=0.8, zorder=0)
    ax3.axhline(slo_ms, color="k", ls="--", lw=1, label=f"SLO {slo_ms:g} ms")
    ax3.set_yscale("log")
    for ax, label in ((ax1, "sparsity"), (ax2, "recall@10"), (ax3, "latency (ms)")):
        ax.set_ylabel(label)
        ax.legend(fontsize=7, loc="upper left")
    ax3.set_xlabel("time (s)")
    fig.suptitle("Search through a real Triton server, seeded phases of dense search capacity", fontsize=10)
    fig.tight_layout()
    from _png import save_png

    save_png(fig, path)


def _phase_lines(phases: list[dict], router: bool) -> list[str]:
    rows = []
    for m, p in zip(ST.PHASES, phases):
        ms = "-" if p["mean_sparsity"] is None else f"{p['mean_sparsity']:.2f}"
        dense = "-" if p["dense_share"] is None else f"{100 * p['dense_share']:.0f} %"
        rec = "-" if p["recall@10"] is None else f"{p['recall@10']:.3f}"
        expect = "-" if p["served_quality"] is None else f"{p['served_quality']:.3f}"
        row = (f"| {m:g}x | {p['offered']} | {p['answered']} | {p['refused']} | {p['lost']} | "
               f"{100 * p['slo_attainment']:.1f} % | {p['p50_ms']:.0f} | {p['p99_ms']:.0f} | {ms} | {dense} | {rec} | "
               f"{expect} |")
        if router:
            row += f" {p['oracle_sparsity']:g} ({p['oracle_quality']:.3f}) |"
        rows.append(row)
    return rows


def report_lines(out: dict, args) -> list[str]:
    sp, ix = out["spike"], out["index"]
    head = ("| phase | offered | answered | refused | lost | SLO met | p50 ms | p99 ms | mean sparsity | dense | "
            "recall@10 | eval's recall of the budgets served |")
    rec_rows = [f"| {float(s):g} | {r['served']:.4f} | {r['eval']:.4f} | {r['difference']:+.4f} | "
                f"{'yes' if r['within_0.01'] else 'NO'} |" for s, r in out["recall_per_budget"].items()]
    return [f"# Search under a load spike ({out['date']})", "", f"Machine: {out['machine']}", "",
            f"Retrieval set: {out['pairs']}. Index: `elastic-export index` over the {ix['documents']} documents in "
            f"{ix['seconds']:.1f} s ({ix['docs_per_s']:.0f} documents/s, the command's wall time: Python start-up, "
            f"embedding with the dense model through onnxruntime, FAISS exact inner product).", "",
            "## Recall@10 per budget: through the server against `elastic-export eval` on the same pairs", "",
            "| sparsity | served (search model) | eval | difference | within 0.01 |", "|---" * 5 + "|", *rec_rows, "",
            f"## The spike: SLO p99 {args.slo_ms:g} ms, phases of {args.phase_s:g} s at "
            f"{', '.join(f'{m:g}x' for m in ST.PHASES)} of dense search capacity, one query per request, seed {args.seed}",
            "", "Search capacity per budget, closed loop with " + f"{args.concurrency} clients (requests/s): "
            + ", ".join(f"{'dense' if k == '0.0' else k} {v:.0f}" for k, v in sp["capacity_rps"].items()) + ".", "",
            "### Router deciding (no sparsity named)", "", head + " oracle (its recall) |", "|---" * 13 + "|",
            *_phase_lines(sp["runs"]["elastic router"]["phases"], True), "",
            "### Dense-only (sparsity 0 named: the router refuses what would miss the SLO)", "", head,
            "|---" * 12 + "|", *_phase_lines(sp["runs"]["dense-only"]["phases"], False), "",
            "![search under a load spike](elastic_search.png)", ""]


def write(out: dict, args) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "elastic_search.json").write_text(ST.results_json(out))
    plot(args.out / "elastic_search.png", out["spike"], args.slo_ms, args.phase_s)
    lines = report_lines(out, args)
    (args.out / "elastic_search.md").write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {args.out}/elastic_search.{{json,md,png}}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifacts", type=Path, default=ST.DEFAULT_ARTIFACTS, help="the default main job's artifacts")
    ap.add_argument("--work", type=Path, default=WORK, help="the served copy of the artifacts (replaced)")
    ap.add_argument("--pairs", type=Path, default=None, help="JSONL of query/doc pairs (default: heldout_pairs)")
    ap.add_argument("--n-pairs", type=int, default=None, help="pairs to use (default 1000; --quick 300)")
    ap.add_argument("--phase-s", type=float, default=None, help="seconds of each load phase (default 20; --quick 4)")
    ap.add_argument("--slo-ms", type=float, default=250.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--capacity-seconds", type=float, default=None, help="per budget (default 6; --quick 2)")
    ap.add_argument("--request-timeout", type=float, default=30.0, help="client timeout of every request (s)")
    ap.add_argument("--quick", action="store_true", help="short phases, 300 pairs: a check that it runs")
    ap.add_argument("--out", type=Path, default=None, help="where the results go (default benchmarks/results; "
                                                           f"--quick {QUICK_OUT})")
    ap.add_argument("--replot", action="store_true",
                    help="only redraw OUT/elastic_search.png from OUT/elastic_search.json (nothing measured)")
    args = ap.parse_args(argv)
    for name, full, quick in (("n_pairs", 1000, 300), ("phase_s", 20.0, 4.0), ("capacity_seconds", 6.0, 2.0),
                              ("out", ST.RESULTS, QUICK_OUT)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        out = json.loads((args.out / "elastic_search.json").read_text())
        plot(args.out / "elastic_search.png", out["spike"], out["slo_ms"], out["phase_s"])
        return 0
    d = prepare(args.artifacts, args.work)
    pairs, source = retrieval_pairs(d, args.pairs, args.n_pairs)
    index = build_index(d, pairs)
    from elastic_export.core.manifest import Manifest

    sparsities = sorted([0.0] + [round(float(b.sparsity), 6) for b in Manifest.load(d).budgets])
    quality = eval_recall(d, pairs, args.work.parent)
    served = Served(d, args.slo_ms)
    try:
        ready = served.wait_ready()
        out = asyncio.run(measure(served, pairs, sparsities, quality, args))
    finally:
        served.stop()
    out.update({"date": time.strftime("%Y-%m-%d"), "machine": ST.machine(), "pairs": source, "index": index,
                "ready_line": ready, "slo_ms": args.slo_ms, "phase_s": args.phase_s, "seed": args.seed,
                "quick": args.quick, "artifacts": str(args.artifacts), "served_copy": str(d),
                "eval_recall@10": {str(k): v for k, v in quality.items()}})
    write(out, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
