"""Ranking quality on the real all-MiniLM-L6-v2: every ranking method, sparsity 0.05..0.60.

For each method the ranking is built on the default calibration text (the Python reference,
``pydoc_data.topics``), the artifacts are exported, and ``elastic_export.measure.evaluation`` evaluates the
ONNX files on a held-out retrieval set built from standard-library docstrings (not the calibration
text): asymmetric recall@1/@10 against a dense index, symmetric recall, fidelity (cosine to dense).

Usage:
    python benchmarks/ranking_quality.py [--pairs 0] [--methods elastic,initial,...] [--work DIR]
        [--model DIR --name NAME [--lean]]

Writes benchmarks/results/ranking_quality.{json,md,png} (``--name``: ranking_quality_NAME.*; another
model: ``--model``, e.g. all-mpnet-base-v2 through ``benchmarks/mpnet.py ranking``) and prints the table and the checks of
issue 3 (elastic beats every other method at 40/50/60 %, keeps >= 98 % of dense R@10 at 10 %,
no budget more than 1 point below the line between its neighbours).
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

from elastic_export.core.budgets import parse_budgets  # noqa: E402
from elastic_export.data.retrieval_data import heldout_pairs  # noqa: E402
from elastic_export.measure.evaluation import evaluate, plot_results, write_results  # noqa: E402
from elastic_export.models.inventory import build_inventory  # noqa: E402
from elastic_export.models.loader import load_encoder  # noqa: E402
from elastic_export.pipeline import Options, run  # noqa: E402
from elastic_export.ranking.driver import rank_encoder  # noqa: E402
from elastic_export.ranking.file import save_ranking  # noqa: E402

METHODS = ["elastic", "initial", "fisher", "activation", "variance", "magnitude", "random"]
RESULTS = Path(__file__).parent / "results"


def _checks(rows: dict[str, dict[float, float]], dense: float) -> list[tuple[str, bool]]:
    checks = []
    el = rows.get("elastic")
    if el is None:
        return checks
    for s in (0.4, 0.5, 0.6):
        others = {m: r[s] for m, r in rows.items() if m != "elastic" and s in r}
        best = max(others.values()) if others else float("nan")
        checks.append((f"elastic R@10 at {s:.0%} ({el[s]:.3f}) beats every other method (best {best:.3f})",
                       all(el[s] > v for v in others.values())))
    checks.append((f"elastic keeps >= 98% of dense R@10 at 10% ({el[0.1]:.3f} vs {dense:.3f}: "
                   f"{el[0.1] / dense:.1%})", el[0.1] >= 0.98 * dense))
    xs = sorted(el)
    worst = 0.0
    for a, b, c in zip(xs, xs[1:], xs[2:]):
        line = el[a] + (el[c] - el[a]) * (b - a) / (c - a)
        worst = max(worst, line - el[b])
    checks.append((f"smooth: no budget more than 1 point below its neighbours' line (worst {worst * 100:.2f} points)",
                   worst <= 0.01))
    return checks


def _rank_cached(encoder, inventory, opts: Options, work: Path) -> float:
    """Rank with ``opts.method`` into ``work/METHOD.safetensors`` (seconds it took); a ranking already
    there with its ``.seconds`` file is reused, so a rerun after an interruption skips it."""
    file, timing = work / f"{opts.method}.safetensors", work / f"{opts.method}.seconds"
    if file.is_file() and timing.is_file():
        print(f"{opts.method}: reusing {file}", file=sys.stderr)
        return float(timing.read_text())
    t0 = time.perf_counter()
    ranking = rank_encoder(encoder, inventory, opts, echo=lambda s: print(s, file=sys.stderr))
    seconds = time.perf_counter() - t0
    save_ranking(ranking, file)
    timing.write_text(f"{seconds:.1f}\n")
    return seconds


def _build(encoder, inventory, method: str, budgets: tuple, work: Path, lean: bool,
           model: str | None = None) -> tuple[float, Path]:
    """Ranking of ``method`` (seconds it took) and its artifact directory (no elastic graph when lean)."""
    opts = Options(model=model, method=method, budgets=budgets, out=str(work / method), overwrite=True, verify=False,
                   checkpoint=str(work / f".{method}.checkpoint"), elastic_graph=not lean)
    seconds = _rank_cached(encoder, inventory, opts, work)
    opts.ranking = str(work / f"{method}.safetensors")
    run(opts, echo=lambda s: None)
    print(f"{method}: ranking built in {seconds:.1f}s", file=sys.stderr)
    return seconds, work / method


def _lean_method(encoder, inventory, method: str, budgets: tuple, work: Path, pairs: list,
                 model: str | None = None) -> tuple[float, dict]:
    """Build, evaluate and delete one method's ONNX files; the result is cached in ``work`` (a rerun
    after an interruption skips the methods already done)."""
    cached = work / f"{method}.eval.json"
    key = {"pairs": len(pairs), "budgets": [round(b, 4) for b in budgets]}
    if cached.is_file():
        done = json.loads(cached.read_text())
        if done.get("key") == key:
            print(f"{method}: cached in {cached}", file=sys.stderr)
            return done["seconds"], done["result"]
        print(f"{method}: {cached} was made with other pairs or budgets; evaluating again", file=sys.stderr)
    seconds, d = _build(encoder, inventory, method, budgets, work, lean=True, model=model)
    res = evaluate([d], pairs=pairs, echo=lambda s: print(s, file=sys.stderr))
    cached.write_text(json.dumps({"seconds": seconds, "result": res, "key": key}))
    for f in d.glob("*.onnx*"):
        f.unlink()
    return seconds, res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=0,
                    help="held-out query/doc pairs (0: all of them, about 1,400; more pairs, less noise)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--budgets", default="0.05..0.6:0.05")
    ap.add_argument("--work", default="/tmp/elastic-ranking-quality", help="artifact directories go here")
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--model", default=None, help="model directory (default: the embedded all-MiniLM-L6-v2)")
    ap.add_argument("--name", default="", help="results go to ranking_quality_NAME.* (default ranking_quality.*)")
    ap.add_argument("--lean", action="store_true",
                    help="large models: no elastic graph, each method evaluated then its ONNX files deleted, "
                         "results cached per method in --work (a rerun resumes)")
    args = ap.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    budgets = tuple(parse_budgets(args.budgets))
    work, results_dir = Path(args.work), Path(args.results)
    work.mkdir(parents=True, exist_ok=True)
    results_dir.mkdir(parents=True, exist_ok=True)
    stem = "ranking_quality" + (f"_{args.name}" if args.name else "")

    encoder = load_encoder(args.model)
    inventory = build_inventory(encoder)
    pairs = heldout_pairs(args.pairs or 10**9)
    timings, dirs, parts = {}, [], []
    for method in methods:
        if args.lean:
            timings[method], one = _lean_method(encoder, inventory, method, budgets, work, pairs, args.model)
            parts.append(one)
        else:
            timings[method], d = _build(encoder, inventory, method, budgets, work, lean=False, model=args.model)
            dirs.append(d)
    if args.lean:
        res = {**parts[0], "results": [r for p in parts for r in p["results"]]}
    else:
        res = evaluate(dirs, pairs=pairs, echo=lambda s: print(s, file=sys.stderr))
    res["ranking_seconds"] = {m: round(t, 1) for m, t in timings.items()}
    res["machine"] = f"{os.cpu_count()} CPU cores, onnxruntime CPU"
    res["model"] = encoder.source
    rows: dict[str, dict[float, float]] = {}
    dense_r10 = None
    for r in res["results"]:
        for b in r["budgets"]:
            if b["sparsity"] == 0.0:
                dense_r10 = b["recall@10"]
            else:
                rows.setdefault(r["method"], {})[b["sparsity"]] = b["recall@10"]
    checks = _checks(rows, dense_r10)
    res["checks"] = [{"check": c, "passed": ok} for c, ok in checks]
    write_results(results_dir / f"{stem}.json", res)
    plot_results(res, results_dir / f"{stem}.png")
    from _png import palette_png

    palette_png(results_dir / f"{stem}.png", results_dir / f"{stem}.png")

    title = Path(encoder.source).name if args.model else "all-MiniLM-L6-v2"
    lines = [f"# Ranking quality: {title}, held-out stdlib-docstring retrieval",
             "",
             f"{len(pairs)} query/doc pairs; asymmetric recall@10 (queries by the pruned model, documents by the "
             f"dense model); dense R@10 = {dense_r10:.3f}.",
             "",
             "| sparsity | " + " | ".join(rows) + " |",
             "|---|" + "---|" * len(rows)]
    for s in budgets:
        lines.append(f"| {s:.2f} | " + " | ".join(f"{rows[m].get(s, float('nan')):.3f}" for m in rows) + " |")
    lines += ["", "Ranking time (s): " + ", ".join(f"{m} {t:.1f}" for m, t in timings.items()), "", "Checks:"]
    lines += [f"- [{'x' if ok else ' '}] {c}" for c, ok in checks]
    text = "\n".join(lines) + "\n"
    (results_dir / f"{stem}.md").write_text(text)
    print(text)
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
