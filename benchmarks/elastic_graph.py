"""Cost of the one elastic graph against one graph per budget, on the real all-MiniLM-L6-v2 (CPU).

The artifact directory (dense, per-budget and elastic ONNX) is made with the pipeline on the
embedded default model, or reused with ``--artifacts DIR``; onnxruntime's CPU execution provider
then measures, for every budget:

* **throughput** at ``--batch`` (default 32) sequences of ``--seq-len`` tokens: sequences / s,
  from the median time of ``--repeats`` runs after ``--warmup`` runs, per-budget graph and elastic
  graph at that budget index, runs interleaved so that drift of a shared machine hits both alike;
* **latency** at batch 1: median ms, the same way;
* **switch cost**: elastic graph, the time of the first run (batch ``--switch-batch``) right after a
  run at another budget, against that budget's steady-state time; per-budget graphs, the session
  load time and the first run after loading (``--load-repeats`` fresh sessions), and the first run
  of an already loaded session right after another budget's session ran (all budgets kept in
  memory, i.e. every weight stored once per budget);
* **file size** of each graph, and of the elastic graph against all per-budget files together.

Usage:
    python benchmarks/elastic_graph.py [--artifacts DIR] [--budgets 0.1..0.6] [--method elastic]
        [--batch 32] [--seq-len 128] [--repeats 20] [--warmup 3] [--switch-repeats 10]
        [--load-repeats 3] [--threads 0]

Writes benchmarks/results/elastic_graph.{json,md} (``--results DIR``) and prints the table.
Quick check on a busy machine: ``--batch 4 --seq-len 32 --repeats 3 --warmup 1 --switch-repeats 2
--load-repeats 1 --method initial``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402

from elastic_export.core.budgets import parse_budgets  # noqa: E402
from elastic_export.core.fileio import atomic_write  # noqa: E402
from elastic_export.core.manifest import load_manifest, resolve  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def make_artifacts(work: Path, budgets: tuple[float, ...], method: str, seq_len: int) -> Path:
    """Run the pipeline on the embedded default model (all-MiniLM-L6-v2) into ``work``."""
    from elastic_export.pipeline import Options, run

    run(Options(model=None, budgets=budgets, method=method, seq_len=seq_len, out=str(work), overwrite=True,
                checkpoint=str(work.parent / f".{work.name}.checkpoint")), echo=lambda s: print(s, file=sys.stderr))
    return work


def elastic_path(directory: Path, manifest: dict) -> tuple[Path, str]:
    """The directory's elastic graph, or one built now from its dense ONNX and budget tables."""
    if manifest.get("elastic"):
        return resolve(directory, manifest["elastic"]["onnx"]), manifest["elastic"]["budget_input"]
    from elastic_export.passes import build_elastic_model

    dense = onnx.load(str(resolve(directory, manifest["dense"]["onnx"])))
    model = build_elastic_model(dense, [b["heads_per_layer"] for b in manifest["budgets"]],
                                [b["neurons_per_layer"] for b in manifest["budgets"]])
    path = Path(tempfile.mkdtemp(prefix="elastic-bench-")) / "elastic.onnx"
    onnx.save(model, str(path))
    return path, "budget_index"


def make_feeds(manifest: dict, batch: int, seq_len: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs of the manifest's interface: token ids, an all-ones mask, zero token types, or images."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for spec in manifest["inputs"]:
        shape = [batch if d == "batch" else seq_len if isinstance(d, str) or d is None else d for d in spec["shape"]]
        name = spec["name"]
        if spec["dtype"] in ("int64", "int32"):
            dtype = np.int64 if spec["dtype"] == "int64" else np.int32
            if "mask" in name:
                feeds[name] = np.ones(shape, dtype)
            elif "type" in name:
                feeds[name] = np.zeros(shape, dtype)
            else:
                feeds[name] = rng.integers(1000, 2000, size=shape).astype(dtype)
        else:
            feeds[name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def session(path: Path, threads: int) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def steady(pairs: list[tuple[str, callable]], repeats: int, warmup: int) -> dict[str, float]:
    """Median seconds of each callable, runs interleaved round-robin."""
    for _ in range(warmup):
        for _, fn in pairs:
            fn()
    times: dict[str, list[float]] = {k: [] for k, _ in pairs}
    for _ in range(repeats):
        for k, fn in pairs:
            times[k].append(timed(fn))
    return {k: statistics.median(v) for k, v in times.items()}


def measure(directory: Path, args: argparse.Namespace) -> dict:
    m = load_manifest(directory)
    budgets = m["budgets"]
    el_path, budget_input = elastic_path(directory, m)
    feeds_b = make_feeds(m, args.batch, args.seq_len)
    feeds_1 = make_feeds(m, 1, args.seq_len)
    feeds_s = make_feeds(m, args.switch_batch, args.seq_len)
    idx = [np.array([b], dtype=np.int64) for b in range(len(budgets))]
    paths = [resolve(directory, b["onnx"]) for b in budgets]

    print(f"loading {len(budgets)} per-budget sessions and the elastic one ...", file=sys.stderr)
    loads = {i: [] for i in range(len(budgets))}
    firsts = {i: [] for i in range(len(budgets))}
    for _ in range(args.load_repeats):
        for i, p in enumerate(paths):
            t = time.perf_counter()
            s = session(p, args.threads)
            loads[i].append(time.perf_counter() - t)
            firsts[i].append(timed(lambda: s.run(None, feeds_s)))
    el_loads, el_firsts = [], []
    for _ in range(args.load_repeats):
        t = time.perf_counter()
        el = session(el_path, args.threads)
        el_loads.append(time.perf_counter() - t)
        el_firsts.append(timed(lambda: el.run(None, {**feeds_s, budget_input: idx[0]})))
    sessions = [session(p, args.threads) for p in paths]

    rows = []
    for i, b in enumerate(budgets):
        print(f"budget {b['sparsity']}: throughput and latency ...", file=sys.stderr)
        s = sessions[i]
        tp = steady([("budget", lambda: s.run(None, feeds_b)),
                     ("elastic", lambda: el.run(None, {**feeds_b, budget_input: idx[i]}))], args.repeats, args.warmup)
        lat = steady([("budget", lambda: s.run(None, feeds_1)),
                      ("elastic", lambda: el.run(None, {**feeds_1, budget_input: idx[i]}))], args.repeats, args.warmup)
        rows.append({"sparsity": b["sparsity"], "gflops": b["gflops"], "onnx": b["onnx"],
                     "file_mb": paths[i].stat().st_size / 1e6,
                     "load_ms": 1e3 * statistics.median(loads[i]), "first_run_ms": 1e3 * statistics.median(firsts[i]),
                     "budget_seq_per_s": args.batch / tp["budget"], "elastic_seq_per_s": args.batch / tp["elastic"],
                     "budget_latency_ms": 1e3 * lat["budget"], "elastic_latency_ms": 1e3 * lat["elastic"]})

    print("switch cost ...", file=sys.stderr)
    B = len(budgets)
    for i, row in enumerate(rows):
        other = (i + 1) % B if B > 1 else i
        steady_t = steady([("elastic", lambda: el.run(None, {**feeds_s, budget_input: idx[i]})),
                           ("budget", lambda: sessions[i].run(None, feeds_s))], args.switch_repeats, args.warmup)
        el_sw, pre_sw = [], []
        for _ in range(args.switch_repeats):
            el.run(None, {**feeds_s, budget_input: idx[other]})
            el_sw.append(timed(lambda: el.run(None, {**feeds_s, budget_input: idx[i]})))
            sessions[other].run(None, feeds_s)
            pre_sw.append(timed(lambda: sessions[i].run(None, feeds_s)))
        row.update(elastic_steady_ms=1e3 * steady_t["elastic"], elastic_switch_ms=1e3 * statistics.median(el_sw),
                   budget_steady_ms=1e3 * steady_t["budget"], preloaded_switch_ms=1e3 * statistics.median(pre_sw))

    return {
        "model": m["model"]["source"], "artifacts": str(directory), "elastic_onnx": str(el_path),
        "settings": {"batch": args.batch, "seq_len": args.seq_len, "repeats": args.repeats, "warmup": args.warmup,
                     "switch_batch": args.switch_batch, "switch_repeats": args.switch_repeats,
                     "load_repeats": args.load_repeats, "threads": args.threads,
                     "onnxruntime": ort.__version__, "cpus": os.cpu_count(),
                     "machine": platform.processor() or platform.machine()},
        "elastic": {"file_mb": el_path.stat().st_size / 1e6, "load_ms": 1e3 * statistics.median(el_loads),
                    "first_run_ms": 1e3 * statistics.median(el_firsts)},
        "dense_file_mb": resolve(directory, m["dense"]["onnx"]).stat().st_size / 1e6,
        "budget_files_mb": sum(r["file_mb"] for r in rows),
        "budgets": rows,
    }


COLUMNS = [
    ("sparsity", "budget", "{:.2f}"), ("gflops", "GFLOPs", "{:.3f}"), ("file_mb", "file MB", "{:.1f}"),
    ("budget_seq_per_s", "b{B} seq/s graph", "{:.1f}"), ("elastic_seq_per_s", "b{B} seq/s elastic", "{:.1f}"),
    ("tp_ratio", "elastic/graph", "{:.2f}"),
    ("budget_latency_ms", "b1 ms graph", "{:.2f}"), ("elastic_latency_ms", "b1 ms elastic", "{:.2f}"),
    ("lat_ratio", "elastic/graph", "{:.2f}"),
    ("elastic_steady_ms", "elastic steady ms", "{:.2f}"), ("elastic_switch_ms", "elastic switch ms", "{:.2f}"),
    ("load_ms", "graph load ms", "{:.0f}"), ("first_run_ms", "graph 1st run ms", "{:.2f}"),
    ("preloaded_switch_ms", "preloaded switch ms", "{:.2f}"),
]


def table(result: dict) -> list[list[str]]:
    B = result["settings"]["batch"]
    rows = [[h.format(B=B) for _, h, _ in COLUMNS]]
    for r in result["budgets"]:
        r = dict(r, tp_ratio=r["elastic_seq_per_s"] / r["budget_seq_per_s"],
                 lat_ratio=r["elastic_latency_ms"] / r["budget_latency_ms"])
        rows.append([f.format(r[k]) for k, _, f in COLUMNS])
    return rows


def summary(result: dict) -> list[str]:
    e, s = result["elastic"], result["settings"]
    return [
        f"model {result['model']}, onnxruntime {s['onnxruntime']} CPU, {s['cpus']} cores, threads={s['threads'] or 'default'}; "
        f"batch {s['batch']} x {s['seq_len']} tokens, medians of {s['repeats']} runs ({s['warmup']} warm-up), "
        f"switch runs at batch {s['switch_batch']} x {s['switch_repeats']}, {s['load_repeats']} session loads",
        f"elastic graph: {e['file_mb']:.1f} MB (dense {result['dense_file_mb']:.1f} MB; all {len(result['budgets'])} "
        f"per-budget files {result['budget_files_mb']:.1f} MB), session load {e['load_ms']:.0f} ms, "
        f"first run {e['first_run_ms']:.2f} ms",
    ]


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def write(result: dict, results: Path) -> None:
    results.mkdir(parents=True, exist_ok=True)
    atomic_write_text(results / "elastic_graph.json", json.dumps(result, indent=2) + "\n")
    rows = table(result)
    md = ["# Elastic graph vs per-budget graphs (onnxruntime CPU)", "", *[f"- {line}" for line in summary(result)], "",
          "| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    md += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    md += ["", "`graph`: the budget's own ONNX; `elastic`: elastic.onnx at that budget index. "
           "`elastic switch ms`: first run right after a run at another budget index (compare `elastic steady ms`); "
           "`graph load ms` + `graph 1st run ms`: switching by loading that budget's session; "
           "`preloaded switch ms`: first run of an already loaded session after another budget's session ran."]
    atomic_write_text(results / "elastic_graph.md", "\n".join(md) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifacts", default=None, help="artifact directory to measure (default: made in --work)")
    ap.add_argument("--work", default="/tmp/elastic-graph-bench", help="where the artifacts are made")
    ap.add_argument("--budgets", default="0.1..0.6")
    ap.add_argument("--method", default="elastic", help="ranking method when making the artifacts")
    ap.add_argument("--batch", type=int, default=32, help="batch of the throughput runs")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    ap.add_argument("--repeats", type=int, default=20, help="timed runs per measurement (median)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--switch-batch", type=int, default=1, help="batch of the switch-cost runs")
    ap.add_argument("--switch-repeats", type=int, default=10)
    ap.add_argument("--load-repeats", type=int, default=3, help="fresh session loads per graph")
    ap.add_argument("--threads", type=int, default=0, help="onnxruntime intra-op threads (0: its default)")
    ap.add_argument("--results", default=str(RESULTS))
    args = ap.parse_args(argv)
    for k in ("batch", "seq_len", "repeats", "switch_batch", "switch_repeats", "load_repeats"):
        if getattr(args, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be at least 1")

    if args.artifacts:
        directory = Path(args.artifacts)
    else:
        directory = Path(args.work) / f"minilm-{args.method}"
        wanted = list(parse_budgets(args.budgets))
        have = None
        if (directory / "manifest.json").is_file():
            have = load_manifest(directory)
        if have is None or [b["sparsity"] for b in have["budgets"]] != wanted or have["tokens"] != args.seq_len:
            directory.parent.mkdir(parents=True, exist_ok=True)
            make_artifacts(directory, tuple(wanted), args.method, args.seq_len)
    result = measure(directory, args)
    for line in summary(result):
        print(line)
    rows = table(result)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
    write(result, Path(args.results))
    print(f"wrote {Path(args.results) / 'elastic_graph.json'} and elastic_graph.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
