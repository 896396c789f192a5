"""The default ranking against the 64-step ranking on a small image encoder at 50-90 % sparsity.

Offline and self-contained, on :mod:`target_coverage`'s model and data: a small timm ViT trained here
on synthetic drawn shapes (classifier dropped), 256 unlabelled calibration images, a held-out labelled
folder. Each arm is the main job as a user runs it (``--budgets 0.5..0.9``, so the targets extend to
0.9) with the arm's ranking options; ``elastic-export eval --images`` measures leave-one-out k-NN
accuracy of every budget. Arms:

* **default**: the main job's ranking options as shipped (past the default targets: the deep schedule);
* **40 x 2 given**: ``--steps 40``, the 40 x 2 default given on the command line, so kept past 0.7;
* **64 x 4 fp32**: ``--steps 64 --targets-per-step 4 --lr 0.02 --ranking-compute fp32`` (the
  ranking before the default was cut to 40 x 2);
* more with ``--arm 'NAME=OPTIONS'``.

Usage:
    python benchmarks/vit_ranking.py [--seeds 0,1,2] [--arm 'name=--steps 48'] [--work DIR] [--reuse]

Writes benchmarks/results/vit_ranking.{json,md} and prints the table.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from rank_scaling import machine  # noqa: E402
from target_coverage import MODEL_ARGS, RESULTS, _run, _versions, make_folder, train_encoder  # noqa: E402

ARMS = {"default": [], "40 x 2 given": ["--steps", "40"],
        "64 x 4 fp32": ["--steps", "64", "--targets-per-step", "4", "--lr", "0.02", "--ranking-compute", "fp32"]}
METRICS = ("knn@1", "knn@10", "fidelity_cosine")


def run_seed(model: Path, calib: Path, evalset: Path, work: Path, seed: int, arms: dict[str, list[str]],
             reuse: bool = False) -> dict:
    """Every arm at one calibration seed: k-NN and fidelity per budget, and the main job's seconds (None: an
    arm's earlier output reused, ``reuse``: its ranking is deterministic on one machine)."""
    common = ["--model", str(model), "--calib", str(calib), "--seed", str(seed), "--budgets", "0.5..0.9",
              "--no-quick-eval", "--no-report", "--no-elastic-graph", "--overwrite"]
    out, dirs = {"seed": seed, "seconds": {}, "arms": {}}, {}
    for name, extra in arms.items():
        dirs[name] = work / f"{name.replace(' ', '_')}-s{seed}"
        t0, done = time.time(), (dirs[name] / "manifest.json").is_file() and reuse
        if not done:
            _run([*common, *extra, "--out", str(dirs[name])])
        out["seconds"][name] = None if done else round(time.time() - t0, 1)
    res_file = work / f"eval-s{seed}.json"
    _run(["eval", *map(str, dirs.values()), "--images", str(evalset), "--out", str(res_file)])
    records = json.loads(res_file.read_text())["records"]
    for name, path in dirs.items():
        out["arms"][name] = {f"{r['sparsity']:.2f}": {k: r[k] for k in METRICS}
                             for r in records if r["dir"] == str(path) and r["precision"] == "fp32"}
    return out


def _mean(runs: list[dict], arm: str, budget: str, metric: str) -> float:
    return sum(r["arms"][arm][budget][metric] for r in runs) / len(runs)


def write(res: dict) -> str:
    """Write RESULTS/vit_ranking.{json,md}; the markdown."""
    runs, arms = res["runs"], list(res["arms"])
    budgets = [b for b in runs[0]["arms"][arms[0]] if float(b) > 0]
    lines = ["# The default ranking against the 64-step ranking: k-NN of a small image encoder (vit_ranking)", "",
             f"Machine: {res['machine']}; {res['versions']}.", "", f"Model: {res['model']}. "
             f"Evaluation: leave-one-out k-NN on {res['eval_images']} held-out labelled images, onnxruntime CPU. "
             f"Calibration: 256 unlabelled images. Seeds {', '.join(str(r['seed']) for r in runs)}: "
             "figures are the mean over them.", "",
             "Command: `python benchmarks/vit_ranking.py " + res["command"] + "`", "",
             "| arm | options | " + " | ".join(f"knn@1 {b}" for b in budgets) + " | knn@10 0.90 | fidelity 0.90 "
             "| main job s (timed runs) |", "|---" * (len(budgets) + 5) + "|"]
    for a in arms:
        timed = [r["seconds"][a] for r in runs if r["seconds"][a] is not None]
        secs = f"{sum(timed) / len(timed):.1f}" if timed else "- (reused)"
        lines.append(f"| {a} | `{' '.join(res['arms'][a]) or '(none)'}` | "
                     + " | ".join(f"{_mean(runs, a, b, 'knn@1'):.3f}" for b in budgets)
                     + f" | {_mean(runs, a, '0.90', 'knn@10'):.3f} | {_mean(runs, a, '0.90', 'fidelity_cosine'):.3f}"
                     f" | {secs} |")
    lines += ["", "knn@1 at 0.90 per seed: " + "; ".join(
        f"seed {r['seed']}: " + ", ".join(f"{a} {r['arms'][a]['0.90']['knn@1']:.3f}" for a in arms) for r in runs)
        + ".", ""]
    md = "\n".join(lines)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "vit_ranking.json").write_text(json.dumps(res, indent=2) + "\n")
    (RESULTS / "vit_ranking.md").write_text(md)
    return md


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="/tmp/elastic-vit-ranking", type=Path)
    ap.add_argument("--seeds", default="0,1,2", help="calibration / ranking seeds, comma list")
    ap.add_argument("--arm", action="append", default=[], metavar="NAME=OPTIONS",
                    help="one more arm: a name and the main job's options for it")
    ap.add_argument("--train-steps", type=int, default=1500)
    ap.add_argument("--reuse", action="store_true", help="keep an arm's output from an earlier run of the same name")
    args = ap.parse_args(argv)
    arms = dict(ARMS)
    for spec in args.arm:
        name, _, opts = spec.partition("=")
        arms[name.strip()] = shlex.split(opts)
    work = args.work
    calib = make_folder(work / "calib", 26, seed=2000, labelled=False)  # 260 unlabelled images
    evalset = make_folder(work / "eval", 50, seed=3000)
    trained = train_encoder(work / "vit", args.train_steps, seed=0, model_args=MODEL_ARGS)
    runs = [run_seed(work / "vit", calib, evalset, work, int(s), arms, args.reuse) for s in args.seeds.split(",")]
    res = {"machine": machine(), "versions": _versions(), "command": " ".join(argv if argv is not None
                                                                             else sys.argv[1:]),
           "model": (f"timm VisionTransformer {MODEL_ARGS}, trained here for {trained['steps']} steps on "
                     f"{trained['train_images']} fresh synthetic shape images (train accuracy "
                     f"{trained['last_100_steps_train_accuracy']:.3f}), classifier dropped"),
           "eval_images": 500, "training": trained, "arms": arms, "runs": runs}
    print(write(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
