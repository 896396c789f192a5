"""The elastic ranking's cost against its quality, one setting at a time, on a real model (default the
embedded all-MiniLM-L6-v2): each setting ranks (timed), exports budgets 0.4 / 0.5 / 0.6 (no checks,
graph, quick eval or report) and is evaluated like ``benchmarks/ranking_quality.py`` (held-out pairs,
asymmetric recall@10 against the dense index, fidelity). This is how the default steps / targets per
step / learning rate / calibration size were chosen (issue 31: the main job's ranking cheaper, quality
within 0.005 of the 64-step default's at 40 / 50 / 60 %).

Usage:
    python benchmarks/ranking_settings.py [NAME=JSON ...] [--work DIR] [--model DIR --name NAME] [--pairs N]
        e.g. 's64x4={"steps": 64, "targets_per_step": 4, "lr": 0.02}' 's24x2={"steps": 24, "lr": 0.05}'
        'calib192={"calib_size": 192}'

A setting's keys are fields of the main job's ``Options`` (calib_size, batch_size, seed: the calibration
draw, the fisher projections and the batch order) or else of ``ElasticConfig`` (steps, targets_per_step,
lr, ...). Writes benchmarks/results/ranking_settings[_NAME].{json,md}; a setting already in the JSON is
not run again. All-mpnet-base-v2: ``python benchmarks/mpnet.py fetch`` prints its directory; ``--model``
that directory ``--name mpnet --pairs 800`` (ranking_quality_mpnet's pairs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import fields
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from elastic_export.data.retrieval_data import heldout_pairs  # noqa: E402
from elastic_export.measure.evaluation import evaluate  # noqa: E402
from elastic_export.models.inventory import build_inventory  # noqa: E402
from elastic_export.models.loader import load_encoder  # noqa: E402
from elastic_export.pipeline import Options, run  # noqa: E402
from elastic_export.ranking.driver import rank_encoder  # noqa: E402
from elastic_export.ranking.file import save_ranking  # noqa: E402
from elastic_export.ranking.soft_ranking import ElasticConfig  # noqa: E402

RESULTS = Path(__file__).parent / "results"
BUDGETS = (0.4, 0.5, 0.6)


def measure(name: str, overrides: dict, work: Path, encoder, inventory, pairs: list, model: str | None = None) -> dict:
    """Rank with ``overrides`` on the default ElasticConfig / Options, export, evaluate; one result row."""
    d = work / name
    d.mkdir(parents=True, exist_ok=True)
    job = {f.name for f in fields(Options)}  # the main job's (seed: calibration, projections, batch order)
    opts = Options(model=model, budgets=BUDGETS, out=str(d / "art"), overwrite=True, verify=False, elastic_graph=False,
                   quick_eval=False, report=False,
                   elastic=ElasticConfig(**{k: v for k, v in overrides.items() if k not in job}),
                   **{k: v for k, v in overrides.items() if k in job})
    t0 = time.perf_counter()
    ranking = rank_encoder(encoder, inventory, opts, echo=lambda s: print(s, file=sys.stderr))
    seconds = time.perf_counter() - t0
    save_ranking(ranking, d / "ranking.safetensors")
    opts.ranking = str(d / "ranking.safetensors")
    run(opts, echo=lambda s: None)
    res = evaluate([d / "art"], pairs=pairs, echo=lambda s: None)["results"][0]["budgets"]
    return {"name": name, "overrides": overrides, "rank_s": round(seconds, 1),
            "recall@10": {f"{b['sparsity']:g}": round(b["recall@10"], 4) for b in res},
            "fidelity": {f"{b['sparsity']:g}": round(b["fidelity_cosine"], 4) for b in res}}


def table(rows: list[dict]) -> list[str]:
    lines = ["| setting | overrides | R@10 40 % | R@10 50 % | R@10 60 % | fidelity 40 / 50 / 60 % | ranking s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        rec, fid = r["recall@10"], r["fidelity"]
        secs = f"{r['rank_s']:.1f}" if r.get("rank_s") is not None else "-"
        lines.append(f"| {r['name']} | `{json.dumps(r['overrides'])}` | {rec['0.4']:.3f} | {rec['0.5']:.3f} | "
                     f"{rec['0.6']:.3f} | {fid['0.4']:.3f} / {fid['0.5']:.3f} / {fid['0.6']:.3f} | {secs} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("settings", nargs="*", help="NAME=JSON overrides of ElasticConfig / Options")
    ap.add_argument("--work", default="/tmp/elastic-ranking-settings")
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--model", default=None, help="model directory (default: the embedded all-MiniLM-L6-v2)")
    ap.add_argument("--name", default="", help="results go to ranking_settings_NAME.* (default ranking_settings.*)")
    ap.add_argument("--pairs", type=int, default=0, help="held-out pairs (0: all)")
    a = ap.parse_args(argv)
    stem = "ranking_settings" + (f"_{a.name}" if a.name else "")
    path = Path(a.results) / f"{stem}.json"
    done = json.loads(path.read_text()) if path.is_file() else {"rows": []}
    have = {r["name"] for r in done["rows"]}
    todo = [(s.split("=", 1)[0], json.loads(s.split("=", 1)[1])) for s in a.settings]
    if any(n not in have for n, _ in todo):
        encoder = load_encoder(a.model)
        inventory, pairs = build_inventory(encoder), heldout_pairs(a.pairs or 10**9)
        done.update(model=Path(str(encoder.source)).name, pairs=len(pairs))  # a local model: its folder's name
        for name, overrides in todo:
            if name not in have:
                done["rows"].append(measure(name, overrides, Path(a.work) / (a.name or "minilm"), encoder,
                                            inventory, pairs, a.model))
                path.write_text(json.dumps(done, indent=2) + "\n")
    dense = next((r["recall@10"].get("0") for r in done["rows"] if "0" in r["recall@10"]), None)
    md = [f"# The elastic ranking's settings: cost against quality ({done.get('model', 'all-MiniLM-L6-v2')})", "",
          f"{done.get('pairs', 1360)} held-out pairs, asymmetric recall@10 against the dense index"
          + (f" (dense {dense:.3f})" if dense is not None else "") + "; ranking seconds measured with other work "
          "on the machine unless noted (read them as a ratio of the steps x targets per step, not as a time).", "",
          *table(done["rows"]), "", *done.get("notes", [])]
    (Path(a.results) / f"{stem}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
