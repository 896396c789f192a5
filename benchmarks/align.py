"""What ``--align K`` costs in quality and buys in speed: all-MiniLM-L6-v2, K in {1, 8, 64}.

One ranking (default ``fisher``, built once on the default calibration text, or ``--ranking FILE``)
is exported with every alignment K: each layer's kept neuron count becomes a multiple of K (heads
are never aligned). For every budget:

* **quality** from the exported ONNX files (``elastic_export.measure.evaluation.evaluate``, default
  held-out pairs from standard-library docstrings, not the calibration text): fidelity (mean
  cosine of the budget's sentence embedding to the dense one) and recall@10 of queries encoded by
  the budget against a dense index;
* **speed**: onnxruntime CPU throughput (sequences / s) at ``--speed-batch`` x N tokens (median of
  ``--repeats`` runs after ``--warmup``), and the gain over dense.

Usage:
    python benchmarks/align.py [--aligns 1,8,64] [--budgets 0.1..0.6] [--method fisher] [--ranking FILE]
        [--pairs 600] [--speed-batch 32] [--repeats 10] [--warmup 2] [--threads 0] [--interleave] [--no-speed]
        [--work DIR] [--rebuild] [--results DIR]

Writes benchmarks/results/align.{json,md} and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from ort_speed import bench_dirs, build_artifacts, busy_warning, log, machine  # noqa: E402

from elastic_export.core.budgets import parse_budgets  # noqa: E402
from elastic_export.core.errors import UserError  # noqa: E402
from elastic_export.data.retrieval_data import heldout_pairs  # noqa: E402
from elastic_export.measure.evaluation import evaluate  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def make_ranking(work: Path, method: str, given: str | None, rebuild: bool) -> tuple[str, str]:
    """(ranking file, its method): ``given``, or one built once with ``method`` on MiniLM."""
    from elastic_export.models.inventory import build_inventory
    from elastic_export.models.loader import load_encoder
    from elastic_export.pipeline import Options
    from elastic_export.ranking.driver import rank_encoder
    from elastic_export.ranking.file import load_ranking, save_ranking

    if given:
        return given, str(load_ranking(given).meta.get("method"))
    path = work / f"ranking-{method}.safetensors"
    if path.is_file() and not rebuild:
        log(f"reusing {path}")
        return str(path), method
    encoder = load_encoder(None)
    inventory = build_inventory(encoder)
    t0 = time.perf_counter()
    ranking = rank_encoder(encoder, inventory, Options(method=method, checkpoint=str(work / f".{method}.ckpt")),
                           echo=log)
    save_ranking(ranking, path)
    log(f"ranking ({method}) built in {time.perf_counter() - t0:.1f}s")
    return str(path), method


def merge(quality: dict, speed: dict | None, dirs: dict[int, Path]) -> list[dict]:
    """One row per (K, sparsity) with quality and speed; sparsity 0 is the dense model."""
    by_dir = {r["dir"]: r for r in quality["results"]}
    rows = []
    for k, d in dirs.items():
        for b in by_dir[str(d)]["budgets"]:
            row = {"align": k, "sparsity": b["sparsity"], "achieved_sparsity": b["achieved_sparsity"],
                   "gflops": b["gflops"], "fidelity": b["fidelity_cosine"], "recall@10": b["recall@10"],
                   "recall@1": b["recall@1"], "throughput": None, "gain": None}
            if speed is not None:
                if b["sparsity"] == 0.0:
                    dn = speed["dense"][0]
                    row.update(throughput=dn["throughput"], gain=1.0, latency_ms=dn["latency_ms"])
                else:
                    s = next(r for r in speed["rows"] if r["align"] == k and r["sparsity"] == b["sparsity"])
                    row.update(throughput=s["throughput"], gain=s["gain"], latency_ms=s["latency_ms"],
                               neurons_per_layer=s["neurons_per_layer"], heads_per_layer=s["heads_per_layer"])
            rows.append(row)
    return rows


def markdown(rows: list[dict], aligns: list[int], budgets: tuple[float, ...], header: list[str]) -> str:
    lines = header + ["| K | sparsity | achieved | GFLOPs | fidelity | R@10 | throughput (seq/s) | gain |",
                      "|---|---|---|---|---|---|---|---|"]
    dense = next(r for r in rows if r["sparsity"] == 0.0)
    fmt = lambda v, f: "–" if v is None else format(v, f)  # noqa: E731
    lines.append(f"| – | 0 (dense) | 0 | {dense['gflops']:.3f} | 1.000 | {dense['recall@10']:.3f} | "
                 f"{fmt(dense['throughput'], '.1f')} | 1.00 |")
    for s in budgets:
        for k in aligns:
            r = next(r for r in rows if r["align"] == k and r["sparsity"] == s)
            lines.append(f"| {k} | {s:.2f} | {r['achieved_sparsity']:.4f} | {r['gflops']:.3f} | {r['fidelity']:.3f} | "
                         f"{r['recall@10']:.3f} | {fmt(r['throughput'], '.1f')} | {fmt(r['gain'], '.2f')} |")
    # per-K means over the budgets, relative to K=1
    lines += ["", "Mean over the budgets (difference to K=1 in brackets):", "",
              "| K | mean fidelity | mean R@10 | mean gain |", "|---|---|---|---|"]
    base = None
    for k in aligns:
        sel = [r for r in rows if r["align"] == k and r["sparsity"] > 0]
        fid = sum(r["fidelity"] for r in sel) / len(sel)
        r10 = sum(r["recall@10"] for r in sel) / len(sel)
        gains = [r["gain"] for r in sel if r["gain"] is not None]
        gain = sum(gains) / len(gains) if gains else None
        if base is None:
            base = (fid, r10, gain)
        d = lambda v, b, f: "" if b is None or v is None or k == aligns[0] else f" ({v - b:+{f}})"  # noqa: E731
        lines.append(f"| {k} | {fid:.3f}{d(fid, base[0], '.3f')} | {r10:.3f}{d(r10, base[1], '.3f')} | "
                     f"{fmt(gain, '.2f')}{d(gain, base[2], '.2f')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--aligns", default="1,8,64")
    ap.add_argument("--budgets", default="0.1..0.6")
    ap.add_argument("--method", default="fisher", help="ranking method, built once (ignored with --ranking)")
    ap.add_argument("--ranking", default=None, help="reuse this ranking file for every K")
    ap.add_argument("--pairs", type=int, default=600, help="held-out query/doc pairs")
    ap.add_argument("--max-length", type=int, default=128, help="token cap for the quality evaluation")
    ap.add_argument("--speed-batch", type=int, default=32, help="batch size for the throughput measurement")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence for speed (default: manifest N)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: onnxruntime default)")
    ap.add_argument("--opt-level", default="all", choices=("disable", "basic", "extended", "all"))
    ap.add_argument("--interleave", action="store_true", help="time the graphs in turn, one run each")
    ap.add_argument("--no-speed", dest="speed", action="store_false", help="quality only")
    ap.add_argument("--work", default="/tmp/elastic-align")
    ap.add_argument("--rebuild", action="store_true")
    ap.add_argument("--results", default=str(RESULTS))
    args = ap.parse_args(argv)
    try:
        budgets = tuple(parse_budgets(args.budgets))
        aligns = [int(a) for a in args.aligns.split(",") if a.strip()]
        if not aligns or min(aligns) < 1 or args.pairs < 2 or args.speed_batch < 1 or args.repeats < 1:
            raise UserError("need --aligns >= 1, --pairs >= 2, --speed-batch >= 1, --repeats >= 1")
    except (UserError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    work, results_dir = Path(args.work), Path(args.results)
    work.mkdir(parents=True, exist_ok=True)
    results_dir.mkdir(parents=True, exist_ok=True)
    host = machine()
    if args.speed and (warning := busy_warning(host)):
        log(warning)

    ranking, method = make_ranking(work, args.method, args.ranking, args.rebuild)
    dirs = {k: build_artifacts(work / f"align{k}", model=None, budgets=budgets, align=k, method=method,
                               ranking=ranking, rebuild=args.rebuild, exact=True) for k in aligns}
    t0 = time.perf_counter()
    pairs = heldout_pairs(args.pairs)
    quality = evaluate([str(d) for d in dirs.values()], pairs=pairs, max_length=args.max_length, echo=log)
    log(f"quality evaluated in {time.perf_counter() - t0:.0f}s")
    speed = None
    if args.speed:
        ns = argparse.Namespace(provider="cpu", threads=args.threads, opt_level=args.opt_level, warmup=args.warmup,
                                repeats=args.repeats, fusion_report=False, seq_len=args.seq_len,
                                interleave=args.interleave)
        speed = bench_dirs(dirs, [args.speed_batch], ["plain"], ns)
    rows = merge(quality, speed, dirs)
    dense_speed = speed["dense"][0] if speed else None
    result = {
        "model": "all-MiniLM-L6-v2", "ranking": {"file": ranking, "method": method},
        "datasets": quality["datasets"],
        "settings": {"aligns": aligns, "budgets": list(budgets), "max_length": args.max_length,
                     "speed": None if not speed else {"provider": "cpu", "batch": args.speed_batch,
                                                      "tokens": args.seq_len or 128, "threads": args.threads,
                                                      "opt_level": args.opt_level, "repeats": args.repeats,
                                                      "warmup": args.warmup, "interleave": args.interleave,
                                                      "dense_drift": dense_speed["drift"]}},
        "machine": host, "rows": rows,
    }
    (results_dir / "align.json").write_text(json.dumps(result, indent=2) + "\n")
    speed_text = ("no speed measurement" if not speed else
                  f"onnxruntime CPU throughput, batch {args.speed_batch} x {args.seq_len or 128} tokens, "
                  f"graph optimisation {args.opt_level}, threads {args.threads or 'default'}, median of "
                  f"{args.repeats} runs after {args.warmup} warm-up (dense drift during the measurement "
                  f"{dense_speed['drift']:+.1%}); {host['logical_cpus']} logical CPUs ({host['cpu']}), "
                  f"load average at start {host['load_average'][0]:.1f}")
    header = [f"# --align K on all-MiniLM-L6-v2 ({method} ranking)", "",
              f"Quality: {len(pairs)} held-out query/doc pairs (standard-library docstrings), fidelity = mean "
              "cosine to the dense sentence embedding, R@10 = recall@10 of budget queries against a dense index. "
              f"Speed: {speed_text}.", ""]
    text = markdown(rows, aligns, budgets, header)
    (results_dir / "align.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
