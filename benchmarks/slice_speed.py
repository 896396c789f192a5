"""How long the passes take to write every budget's ONNX, against one torch export of the model.

Issue 4's target: producing all budgets from the dense ONNX costs less than one torch export. For
each model (the real all-MiniLM-L6-v2 and a randomly initialised timm ViT-B/16 at 224 px; speed
depends on shapes, not values) this script ranks with ``magnitude`` (instant; the ranking does
not change the work of the passes), then measures, as medians of ``--repeats`` runs:

* **torch export**: ``export_dense`` (torch.onnx export of the rank-permuted dense model + save);

every run writes into a new, empty directory, as the pipeline does;
* **passes, fast path**: :class:`~elastic_export.passes.BudgetSlicer` writing every budget's
  file (what the pipeline runs);
* **passes, model path**: ``slice_model`` + ``onnx.save`` per budget (the in-memory API, for
  comparison).

Files go to a temporary directory on the same disk as ``--work`` (default: the system temp).

Usage:
    python benchmarks/slice_speed.py [--models minilm,vit_base_patch16_224] [--budgets 0.1..0.6]
        [--repeats 5] [--work DIR]

Writes benchmarks/results/slice_speed.{json,md} (``--results DIR``) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import onnx  # noqa: E402

from elastic_export.core.budgets import budget_tag, parse_budgets  # noqa: E402
from elastic_export.core.fileio import atomic_write  # noqa: E402
from elastic_export.export.dense import export_dense  # noqa: E402
from elastic_export.measure.timing import machine  # noqa: E402
from elastic_export.models.inventory import build_inventory  # noqa: E402
from elastic_export.models.loader import load_encoder  # noqa: E402
from elastic_export.passes import BudgetSlicer, slice_model  # noqa: E402
from elastic_export.pipeline import Options  # noqa: E402
from elastic_export.ranking.driver import rank_encoder  # noqa: E402
from elastic_export.ranking.plans import make_plans  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def _median_seconds(fn, repeats: int, work: Path) -> float:
    """Median wall time of ``fn(directory)``, each run writing into a new, empty directory (as the
    pipeline does: new files cost more than overwriting old ones); removed after each run."""
    import shutil

    times = []
    for i in range(repeats):
        d = work / f"run{i}"
        d.mkdir()
        t0 = time.perf_counter()
        fn(d)
        times.append(time.perf_counter() - t0)
        shutil.rmtree(d)
    return statistics.median(times)


def measure(model: str, budgets: list[float], repeats: int, work: Path) -> dict:
    """Median seconds of the three ways to get ``model``'s files, in one process."""
    encoder = load_encoder(None if model == "minilm" else model, pretrained=False)
    inventory = build_inventory(encoder)
    ranking = rank_encoder(encoder, inventory, Options(method="magnitude"), echo=lambda s: None)
    plans = make_plans(ranking, inventory, budgets)
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        d = Path(tmp)
        dense = export_dense(encoder, ranking, d / "dense.onnx")  # warm-up (first export traces slowly)
        dense_mb = (d / "dense.onnx").stat().st_size / 1e6
        export_s = _median_seconds(lambda out: export_dense(encoder, ranking, out / "dense.onnx"), repeats, d)

        def fast(out: Path) -> None:
            slicer = BudgetSlicer(dense)
            for p in plans:
                slicer.save(p.heads_per_layer, p.neurons_per_layer, out / f"budget_{budget_tag(p.sparsity)}.onnx")

        def model_path(out: Path) -> None:
            for p in plans:
                onnx.save(slice_model(dense, p.heads_per_layer, p.neurons_per_layer, full_check=False),
                          str(out / f"budget_{budget_tag(p.sparsity)}.onnx"))

        fast(d)  # warm-up; its files give the sizes
        sizes = sum((d / f"budget_{budget_tag(p.sparsity)}.onnx").stat().st_size for p in plans)
        fast_s = _median_seconds(fast, repeats, d)
        model_s = _median_seconds(model_path, repeats, d)
    return {"model": model, "architecture": encoder.architecture, "budgets": len(plans),
            "dense_mb": round(dense_mb, 1),
            "budget_files_mb": round(sizes / 1e6, 1), "torch_export_s": round(export_s, 3),
            "passes_fast_s": round(fast_s, 3), "passes_model_path_s": round(model_s, 3),
            "fast_over_export": round(fast_s / export_s, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="minilm,vit_base_patch16_224")
    ap.add_argument("--budgets", default="0.1..0.6")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--work", default=None, help="Where the temporary files go (default: the system temp).")
    ap.add_argument("--results", default=str(RESULTS))
    args = ap.parse_args(argv)
    budgets = list(parse_budgets(args.budgets))
    work = Path(args.work or tempfile.gettempdir())
    rows = []
    for model in args.models.split(","):
        print(f"measuring {model} ...", file=sys.stderr)
        rows.append(measure(model, budgets, args.repeats, work))
    lines = ["| model | budgets | budget files (MB) | torch export (s) | passes, fast path (s) | passes / export "
             "| passes, slice_model + onnx.save (s) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['budgets']} | {r['budget_files_mb']} | {r['torch_export_s']:.2f} "
                     f"| {r['passes_fast_s']:.2f} | {r['fast_over_export']:.2f} | {r['passes_model_path_s']:.2f} |")
    table = "\n".join(lines)
    print(table)
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    info = {"machine": machine(), "repeats": args.repeats, "budgets": budgets, "rows": rows}
    m = info["machine"]
    where = (f"{m.get('cpu')}, {m.get('logical_cpus')} logical CPUs, load average at start "
             f"{(m.get('load_average') or [0])[0]:.1f}, onnxruntime {m.get('onnxruntime')}")
    md = f"Medians of {args.repeats} runs; {where}.\n\n{table}\n"
    atomic_write(out / "slice_speed.json", lambda tmp: Path(tmp).write_text(json.dumps(info, indent=2) + "\n"))
    atomic_write(out / "slice_speed.md", lambda tmp: Path(tmp).write_text(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
