"""Resident memory of an ElasticRuntime with every budget loaded, by memory mode.

Each configuration is measured in a fresh Python process (so nothing another one allocated is
counted): the resident set (``ElasticRuntime.memory_rss``) right before ``ElasticRuntime.from_dir``
and after it, then after one batch-1 run at every budget, and the load time.

* **per-budget, shared weights** (the default): dense.onnx and every budget file, each its own
  onnxruntime session; initializers that are byte-identical across the files (embeddings, norms,
  layers a budget keeps whole) are held once (``SessionConfig.share_weights``);
* **per-budget, own weights**: the same with ``share_weights=False`` (every file's weights held
  once per file);
* **elastic**: elastic.onnx alone (weights once, sliced at run time; dense 0.0 through the graph's
  dense index where the manifest lists one);
* **budget x precision** (where the directory has fp16 / int8 twins: ``elastic-export --precision
  fp32,fp16,int8``): every (budget, precision) pair loaded at once
  (``ElasticRuntime.from_dir(..., precisions=...)``, shared weights), for fp32+int8, all three
  precisions, and the elastic graph in fp32+fp16; plus a subset (fp32+int8 at 0.0 / 0.3 / 0.6).

Usage:
    python benchmarks/runtime_memory.py [--artifacts DIR ...] [--threads 1]

``--artifacts`` defaults to the serve_sim directory (the embedded all-MiniLM-L6-v2, budgets
0.1..0.6, built on first use). The committed results also have timm ViT-B/16
(``elastic-export --model vit_base_patch16_224 --no-pretrained --method random --align 64
--budgets 0.1..0.6``). Writes benchmarks/results/runtime_memory.{json,md} (``--stem`` another name).
The budget x precision rows (``runtime_memory_precisions.{json,md}``) come from the embedded
MiniLM exported with ``elastic-export --budgets 0.1..0.6 --method magnitude --precision
fp32,fp16,int8`` (``--artifacts DIR --stem runtime_memory_precisions``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from serve_sim import DEFAULT_ARTIFACTS, ensure_artifacts  # noqa: E402

RESULTS = Path(__file__).parent / "results"
CONFIGS = {
    "per-budget, shared weights": {"mode": "per-budget", "share_weights": True},
    "per-budget, own weights": {"mode": "per-budget", "share_weights": False},
    "elastic": {"mode": "elastic", "share_weights": True},
    "per-budget, fp32+int8": {"mode": "per-budget", "share_weights": True, "precisions": "fp32,int8"},
    "per-budget, fp32+fp16+int8": {"mode": "per-budget", "share_weights": True, "precisions": "fp32,fp16,int8"},
    "per-budget, fp32+int8, sparsities 0/0.3/0.6": {"mode": "per-budget", "share_weights": True,
                                                    "precisions": "fp32,int8", "sparsities": "0,0.3,0.6"},
    "elastic, fp32+fp16": {"mode": "elastic", "share_weights": True, "precisions": "fp32,fp16"},
}
KEYS = {"fp32": "onnx", "fp16": "onnx_fp16", "int8": "onnx_int8"}

CHILD = r"""
import json, sys, time
import numpy as np
from elastic_export.measure.bench import sample_feeds
from elastic_export.core.manifest import Manifest
from elastic_export.serving.runtime import ElasticRuntime
from elastic_export.targets.onnxruntime import SessionConfig
from pathlib import Path

d, mode, share, threads = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1", int(sys.argv[4])
precisions = sys.argv[5].split(",")
sparsities = [float(x) for x in sys.argv[6].split(",")] if sys.argv[6] else None
feeds = sample_feeds(d, Manifest.load(d), 1, None)
before = ElasticRuntime.memory_rss()
t0 = time.perf_counter()
rt = ElasticRuntime.from_dir(d, mode=mode, config=SessionConfig(threads=threads, share_weights=share),
                             precisions=precisions, sparsities=sparsities)
load_s = time.perf_counter() - t0
loaded = ElasticRuntime.memory_rss()
for s, p in rt.pairs:
    rt.run(feeds, sparsity=s, precision=p)
ran = ElasticRuntime.memory_rss()
print(json.dumps({"budgets": len(rt.sparsities), "pairs": len(rt.pairs), "load_s": load_s,
                  "loaded_mb": (loaded - before) / 2**20, "after_runs_mb": (ran - before) / 2**20}))
"""


def measure(directory: Path, mode: str, share: bool, threads: int, precisions: str = "fp32",
            sparsities: str = "") -> dict:
    """One configuration in a fresh process."""
    r = subprocess.run([sys.executable, "-c", CHILD, str(directory), mode, "1" if share else "0", str(threads),
                        precisions, sparsities], capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise SystemExit(f"{directory} {mode}: {(r.stderr.strip().splitlines() or ['failed'])[-1]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def available(manifest: dict, cfg: dict) -> bool:
    """Whether the directory has the files a configuration loads (the elastic graph, the twins)."""
    precisions = cfg.get("precisions", "fp32").split(",")
    if cfg["mode"] == "elastic":
        e = manifest.get("elastic") or {}
        return all(e.get(KEYS[p]) for p in precisions)
    return all(entry.get(KEYS[p]) for p in precisions for entry in [manifest["dense"], *manifest["budgets"]])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifacts", type=Path, nargs="+", default=[DEFAULT_ARTIFACTS])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--stem", default="runtime_memory", help="results file names: STEM.json, STEM.md")
    args = ap.parse_args(argv)

    rows = []
    for directory in args.artifacts:
        directory = ensure_artifacts(directory) if directory == DEFAULT_ARTIFACTS else directory
        manifest = json.loads((directory / "manifest.json").read_text())
        files_mb = sum((directory / e["onnx"]).stat().st_size for e in [manifest["dense"], *manifest["budgets"]]) / 2**20
        for name, cfg in CONFIGS.items():
            if not available(manifest, cfg):
                continue
            r = measure(directory, cfg["mode"], cfg["share_weights"], args.threads, cfg.get("precisions", "fp32"),
                        cfg.get("sparsities", ""))
            row = {"model": manifest["model"].get("source") or directory.name, "dir": directory.name, "config": name,
                   "per_budget_files_mb": files_mb, **r}
            rows.append(row)
            print(f"{row['dir']}: {name}: +{r['loaded_mb']:.0f} MB loaded, +{r['after_runs_mb']:.0f} MB after a run "
                  f"at each of {r['pairs']} pairs, load {r['load_s']:.2f} s", file=sys.stderr)

    import onnxruntime as ort

    out = {"onnxruntime": ort.__version__, "threads": args.threads, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.stem}.json").write_text(json.dumps(out, indent=2) + "\n")
    lines = ["# ElasticRuntime resident memory with every budget loaded (onnxruntime CPU)", "",
             f"onnxruntime {ort.__version__}, {args.threads} thread(s); each row a fresh process; "
             "MB = resident set added by `ElasticRuntime.from_dir` (and after one batch-1 run at every budget).", "",
             "| model | mode | budgets | (budget, precision) pairs | fp32 ONNX files MB (dense + budgets) | loaded MB "
             "| after runs MB | load s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['config']} | {r['budgets']} | {r.get('pairs', r['budgets'])} | "
                     f"{r['per_budget_files_mb']:.0f} | {r['loaded_mb']:.0f} | {r['after_runs_mb']:.0f} | {r['load_s']:.2f} |")
    (args.out / f"{args.stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
