"""Targets that cover the budgets (issue 22, item 3): k-NN of a small image encoder at budget 0.9.

Offline and self-contained: a small timm ViT (6 blocks, width 128, 4 heads, 32 px, 8 px patches: 16
patches and a class token) is trained here (1500 steps of 64 fresh images) to classify synthetic
drawn shapes (10 classes, random light-on-dark colours, sizes, positions and noise); its classifier
is dropped and it is saved as a timm directory, as a user's ``--model`` would be. Then, through the command line as a user would:

* **old default**: ``elastic-export rank`` with the default ``--targets`` (0.05..0.7:0.05), reused by
  the main job with ``--ranking`` at ``--budgets 0.5..0.9`` (the run's warning line is recorded);
* **extended**: the main job at ``--budgets 0.5..0.9`` with the default targets, which it extends
  to 0.05..0.9:0.05 (the run's ``targets:`` line is recorded);

both on the same calibration folder (256 unlabelled images, ``--calib``), and ``elastic-export eval
--images`` measures leave-one-out k-NN accuracy (knn@1, knn@10) of every budget on a held-out
labelled folder the ranking never saw.

Usage:
    python benchmarks/target_coverage.py [--seeds 0,1,2] [--work /tmp/elastic-target-coverage]
        [--patch-size 8 --embed-dim 128 --num-heads 4 --name target_coverage]

Writes benchmarks/results/NAME.{json,md} (default target_coverage) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))

from rank_scaling import machine  # noqa: E402

CLASSES = ("disc", "ring", "square", "frame", "triangle", "cross", "x", "hbar", "vbar", "diamond")
SIZE = 32
MODEL_ARGS = dict(img_size=SIZE, patch_size=8, embed_dim=128, depth=6, num_heads=4, mlp_ratio=4.0)


def _colour(rng: random.Random, lo: int, hi: int) -> tuple[int, int, int]:
    return tuple(rng.randrange(lo, hi) for _ in range(3))


def draw(cls: str, rng: random.Random):
    """One 32 px image of shape ``cls``: random colours (light on dark), size, position and pixel noise."""
    import numpy as np
    from PIL import Image, ImageDraw

    bg, fg = _colour(rng, 0, 100), _colour(rng, 150, 256)  # random colours, a dark ground, a light shape
    img = Image.new("RGB", (SIZE, SIZE), bg)
    d = ImageDraw.Draw(img)
    s = rng.randrange(12, 23)
    x, y = rng.randrange(1, SIZE - s), rng.randrange(1, SIZE - s)
    box, w = (x, y, x + s, y + s), max(2, s // 5)
    mid_x, mid_y = x + s // 2, y + s // 2
    if cls == "disc":
        d.ellipse(box, fill=fg)
    elif cls == "ring":
        d.ellipse(box, outline=fg, width=w)
    elif cls == "square":
        d.rectangle(box, fill=fg)
    elif cls == "frame":
        d.rectangle(box, outline=fg, width=w)
    elif cls == "triangle":
        d.polygon([(mid_x, y), (x, y + s), (x + s, y + s)], fill=fg)
    elif cls == "cross":
        d.rectangle((mid_x - w // 2, y, mid_x + w // 2, y + s), fill=fg)
        d.rectangle((x, mid_y - w // 2, x + s, mid_y + w // 2), fill=fg)
    elif cls == "x":
        d.line((x, y, x + s, y + s), fill=fg, width=w)
        d.line((x, y + s, x + s, y), fill=fg, width=w)
    elif cls == "hbar":
        d.rectangle((0, mid_y - w, SIZE - 1, mid_y + w), fill=fg)
    elif cls == "vbar":
        d.rectangle((mid_x - w, 0, mid_x + w, SIZE - 1), fill=fg)
    else:  # diamond
        d.polygon([(mid_x, y), (x + s, mid_y), (mid_x, y + s), (x, mid_y)], fill=fg)
    noise = np.random.default_rng(rng.randrange(2**32)).normal(0, 12, (SIZE, SIZE, 3))
    return Image.fromarray(np.clip(np.asarray(img, dtype=np.float64) + noise, 0, 255).astype(np.uint8))


def make_folder(root: Path, per_class: int, seed: int, labelled: bool = True) -> Path:
    """``root/<class>/<i>.png`` (``labelled``) or ``root/<class>_<i>.png``; kept when already complete."""
    done = root / ".complete"
    if done.is_file():
        return root
    rng = random.Random(seed)
    for cls in CLASSES:
        folder = root / cls if labelled else root
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            draw(cls, rng).save(folder / (f"{i:04d}.png" if labelled else f"{cls}_{i:04d}.png"))
    done.touch()
    return root


def _save(model, path: Path, model_args: dict) -> None:
    from timm.models import save_for_hf

    path.mkdir(parents=True, exist_ok=True)
    save_for_hf(model, str(path), model_args={**model_args, "num_classes": model.num_classes},
                safe_serialization=True)


def _batch(prep, rng: random.Random, n: int = 64):
    """``n`` fresh images of random classes, preprocessed as the tool does (``prep``), and their labels."""
    import torch

    labels = [rng.randrange(len(CLASSES)) for _ in range(n)]
    return torch.stack([prep(draw(CLASSES[y], rng)) for y in labels]), torch.tensor(labels)


def train_encoder(path: Path, steps: int, seed: int, model_args: dict) -> dict:
    """Train the small ViT to classify fresh shape images (64 a step), drop its head, save it to ``path``;
    a summary."""
    import timm
    import torch

    from elastic_export.models.loader import load_encoder
    from elastic_export.models.preprocess import transform

    if (path / ".trained.json").is_file():
        return json.loads((path / ".trained.json").read_text())
    torch.manual_seed(seed)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=len(CLASSES), **model_args)
    model.pretrained_cfg = {**model.pretrained_cfg, "input_size": (3, SIZE, SIZE), "crop_pct": 1.0,
                            "mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5)}
    _save(model, path, model_args)  # first untrained: the tool's own preprocessing then makes the training images
    prep, rng = transform(load_encoder(str(path)).data_config), random.Random(1000 + seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=steps, pct_start=0.05)
    t0, model, hits = time.time(), model.train(), []
    for step in range(steps):
        x, y = _batch(prep, rng)
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        hits.append(float((logits.argmax(-1) == y).float().mean()))
        if (step + 1) % 100 == 0:
            print(f"train step {step + 1}/{steps}: accuracy {sum(hits[-100:]) / 100:.3f} ({time.time() - t0:.0f}s)",
                  file=sys.stderr)
    model.reset_classifier(0)
    _save(model.eval(), path, model_args)
    summary = {"steps": steps, "batch": 64, "train_images": 64 * steps,
               "last_100_steps_train_accuracy": round(sum(hits[-100:]) / len(hits[-100:]), 4),
               "seconds": round(time.time() - t0, 1)}
    (path / ".trained.json").write_text(json.dumps(summary))
    return summary


def _cli() -> list[str]:
    exe = Path(sys.executable).with_name("elastic-export")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "elastic_export"]


def _run(args: list[str]) -> list[str]:
    """Run ``elastic-export ARGS``; its stderr lines (progress bars dropped), echoed to ours."""
    print("$ elastic-export " + " ".join(args), file=sys.stderr)
    r = subprocess.run([*_cli(), *args], capture_output=True, text=True)
    lines = [x.strip() for x in r.stderr.replace("\r", "\n").splitlines() if x.strip() and "it/s" not in x
             and "%|" not in x]
    print("\n".join(f"  {x}" for x in lines[-12:]), file=sys.stderr)
    if r.returncode != 0:
        raise SystemExit(f"elastic-export {args[0]} failed with code {r.returncode}")
    return lines


def run_seed(model: Path, calib: Path, evalset: Path, work: Path, seed: int, budgets: str) -> dict:
    """Both arms at one calibration seed: their k-NN per budget and the lines the runs printed."""
    common = ["--model", str(model), "--calib", str(calib), "--seed", str(seed)]
    export = ["--budgets", budgets, "--no-quick-eval", "--no-report", "--no-elastic-graph", "--overwrite"]
    old_file = work / f"old-default-s{seed}.safetensors"
    arms = {"old default": work / f"old-default-s{seed}", "extended": work / f"extended-s{seed}"}
    t0 = time.time()
    if not old_file.is_file():
        _run(["rank", *common, "--out", str(old_file)])
    old_lines = _run([*common, *export, "--ranking", str(old_file), "--out", str(arms["old default"])])
    new_lines = _run([*common, *export, "--out", str(arms["extended"])])
    seconds = time.time() - t0
    res_file = work / f"eval-s{seed}.json"
    _run(["eval", *map(str, arms.values()), "--images", str(evalset), "--out", str(res_file)])
    res = json.loads(res_file.read_text())
    out = {"seed": seed, "seconds_rank_and_export": round(seconds, 1),
           "warning": next((x for x in old_lines if x.startswith("warning:")), None),
           "targets_line": next((x for x in new_lines if x.startswith("targets:")), None), "arms": {}}
    for name, path in arms.items():
        out["arms"][name] = {f"{r['sparsity']:.2f}": {k: r[k] for k in ("knn@1", "knn@10", "fidelity_cosine", "gflops")}
                             for r in res["records"] if r["dir"] == str(path) and r["precision"] == "fp32"}
    out["images"] = res["datasets"]["images"]
    return out


def _versions() -> str:
    import onnxruntime
    import timm
    import torch

    return (f"python {platform.python_version()}, torch {torch.__version__}, onnxruntime {onnxruntime.__version__}, "
            f"timm {timm.__version__}")


def _mean(runs: list[dict], arm: str, budget: str, metric: str) -> float:
    return sum(r["arms"][arm][budget][metric] for r in runs) / len(runs)


def write(res: dict, name: str) -> str:
    """Write RESULTS/NAME.{json,md}; the markdown."""
    runs, budgets = res["runs"], list(res["runs"][0]["arms"]["extended"])
    n = len(runs)
    lines = [f"# Targets that cover the budgets: k-NN of a small image encoder ({name})", "",
             f"Machine: {res['machine']}; {res['versions']}.", "",
             f"Model: {res['model']}. Evaluation: {res['eval']}. Calibration: {res['calib']}. "
             f"{n} calibration seed(s) ({', '.join(str(r['seed']) for r in runs)}); figures are the mean over them.", "",
             "| budget | GFLOPs | knn@1 old default | knn@1 extended | knn@10 old default | knn@10 extended "
             "| fidelity old | fidelity extended |", "|---|---|---|---|---|---|---|---|"]
    for b in budgets:
        cells = [f"{_mean(runs, a, b, m):.3f}" for m in ("knn@1", "knn@10", "fidelity_cosine")
                 for a in ("old default", "extended")]
        lines.append(f"| {'dense' if float(b) == 0 else b} | {runs[0]['arms']['extended'][b]['gflops']:.3f} | "
                     + " | ".join(cells) + " |")
    if n > 1:
        per_seed = ", ".join(f"seed {r['seed']}: {r['arms']['old default']['0.90']['knn@1']:.3f} vs "
                             f"{r['arms']['extended']['0.90']['knn@1']:.3f}" for r in runs)
        lines += ["", f"knn@1 at 0.90 per seed (old default vs extended): {per_seed}."]
    lines += ["", "Old default: `elastic-export rank` (targets 0.05..0.7:0.05), reused with `--ranking`; it warned:",
              "", f"    {runs[0]['warning']}", "", "Extended: the main job with the default targets said:", "",
              f"    {runs[0]['targets_line']}", ""]
    md = "\n".join(lines)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(res, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(md)
    return md


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="/tmp/elastic-target-coverage", type=Path)
    ap.add_argument("--seeds", default="0", help="calibration / ranking seeds, comma list")
    ap.add_argument("--budgets", default="0.5..0.9")
    ap.add_argument("--train-steps", type=int, default=1500)
    ap.add_argument("--eval-per-class", type=int, default=50)
    ap.add_argument("--patch-size", type=int, default=MODEL_ARGS["patch_size"])
    ap.add_argument("--embed-dim", type=int, default=MODEL_ARGS["embed_dim"])
    ap.add_argument("--num-heads", type=int, default=MODEL_ARGS["num_heads"])
    ap.add_argument("--name", default="target_coverage")
    args = ap.parse_args(argv)
    model_args = {**MODEL_ARGS, "patch_size": args.patch_size, "embed_dim": args.embed_dim, "num_heads": args.num_heads}
    work = args.work
    calib = make_folder(work / "calib", 26, seed=2000, labelled=False)  # 260 unlabelled images
    evalset = make_folder(work / "eval", args.eval_per_class, seed=3000)
    trained = train_encoder(work / "vit", args.train_steps, seed=0, model_args=model_args)
    runs = [run_seed(work / "vit", calib, evalset, work, int(s), args.budgets) for s in args.seeds.split(",")]
    res = {"machine": f"{machine()}", "versions": _versions(),
           "model": (f"timm VisionTransformer {model_args}, trained here for {trained['steps']} steps on "
                     f"{trained['train_images']} fresh synthetic shape images ({len(CLASSES)} classes; train "
                     f"accuracy {trained['last_100_steps_train_accuracy']:.3f} over the last 100 steps), "
                     "classifier dropped"),
           "eval": (f"leave-one-out k-NN on {runs[0]['images'].get('count')} held-out labelled images "
                    f"({args.eval_per_class} per class, other seed), onnxruntime CPU"),
           "calib": "260 unlabelled synthetic images (--calib DIR, 256 used: --calib-size default)",
           "budgets": args.budgets, "training": trained, "runs": runs}
    print(write(res, args.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
