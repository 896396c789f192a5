"""Ranking time and peak memory against model size (docs/large_models.md, "Measured").

Each model is ranked in a fresh child process (so its peak memory is its own) with the elastic
method as the pipeline runs it: Fisher initial scores over the calibration set, then ``--steps``
soft-mask optimisation steps. The child reports the time of each phase, seconds per step, peak
resident memory (``ru_maxrss``) and, on CUDA, peak allocated GPU memory. The parent fits the
scaling exponent ``a`` of seconds per step against parameter count (``t ∝ P^a``, least squares in
log-log) and writes ``RESULTS/rank_scaling.{json,md}``.

Models (``--models``, comma separated):

* ``minilm``: the embedded all-MiniLM-L6-v2 (22M);
* ``mpnet``: all-mpnet-base-v2 (110M) assembled by ``benchmarks/mpnet.py`` (skipped when absent);
* ``qwen3-0.6b``, ``qwen3-4b``, ``qwen3-8b``: randomly initialised ``Qwen3Model`` with the published
  Qwen3-Embedding sizes (speed and memory depend on shapes, not values), saved once to a cache
  folder in bf16 and loaded like any model directory.

Usage:
    python benchmarks/rank_scaling.py --models minilm,mpnet,qwen3-0.6b --steps 4 --calib-size 16
    python benchmarks/rank_scaling.py --models qwen3-4b --device cuda --weights-dtype bf16 --name rank_scaling_gpu
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
CACHE = Path(os.environ.get("ELASTIC_EXPORT_CACHE", Path.home() / ".cache" / "elastic-export"))

# published Qwen3-Embedding configurations (config.json of each size)
QWEN3 = {
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, vocab_size=151669, tie_word_embeddings=True),
    "qwen3-4b": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=9728, vocab_size=151665, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=12288, vocab_size=151665, tie_word_embeddings=False),
}


def model_path(spec: str) -> str | None:
    """What ``--model`` gets for ``spec`` (None: the embedded default); builds a Qwen3 directory once."""
    if spec == "minilm":
        return None
    if spec == "mpnet":
        from mpnet import find_model  # benchmarks/mpnet.py, beside this file

        return str(find_model(CACHE / "all-mpnet-base-v2" / "model"))  # assembled by `python benchmarks/mpnet.py fetch`
    if spec in QWEN3:
        path = CACHE / f"random-{spec}"
        if not (path / "config.json").is_file():
            import torch
            from transformers import Qwen3Config, Qwen3Model

            cfg = Qwen3Config(**QWEN3[spec], max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1e6)
            torch.manual_seed(0)
            with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # random init is fast there
                Qwen3Model(cfg).to(torch.bfloat16).save_pretrained(path)
        return str(path)
    raise ValueError(f"unknown model {spec!r}")


def child(args: argparse.Namespace) -> dict:
    """Rank one model in this process; return the measurements."""
    import torch

    from elastic_export.data.calibration import load_calibration
    from elastic_export.models.inventory import build_inventory
    from elastic_export.models.loader import load_encoder
    from elastic_export.ranking import distributed as ddp
    from elastic_export.ranking.options import ElasticConfig
    from elastic_export.ranking.scoring import METHODS
    from elastic_export.ranking.soft_ranking import optimise_ranking

    t0 = time.perf_counter()
    enc = load_encoder(model_path(args.child), seq_len=args.seq_len)
    inv = build_inventory(enc)
    ddp.cast_weights(enc.module, args.weights_dtype)
    enc.module.to(args.device)
    calib = load_calibration(enc, None, size=args.calib_size, batch_size=args.batch_size)
    load_s = time.perf_counter() - t0
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    with ddp.checkpointed(enc.blocks(), args.checkpoint_activations):
        t0 = time.perf_counter()
        initial = METHODS["fisher"](enc, inv, calib, seed=0)
        sync()
        fisher_s = time.perf_counter() - t0
        config = ElasticConfig(steps=args.steps, checkpoint_every=0)
        t0 = time.perf_counter()
        optimise_ranking(enc, inv, calib, initial, config)
        sync()
        steps_s = time.perf_counter() - t0
    out = {"model": args.child, "params": inv.total_params, "layers": len(inv.layers), "width": inv.width,
           "tokens": inv.tokens, "device": args.device, "weights_dtype": args.weights_dtype,
           "checkpoint_activations": args.checkpoint_activations, "calib_size": args.calib_size,
           "batch_size": args.batch_size, "steps": args.steps, "load_s": load_s, "fisher_s": fisher_s,
           "steps_s": steps_s, "s_per_step": steps_s / args.steps,
           "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    if args.device.startswith("cuda"):
        out["peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 2**30
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


def fit_exponent(rows: list[dict]) -> float | None:
    """Least-squares slope of log(seconds per step) against log(parameters)."""
    pts = [(math.log(r["params"]), math.log(r["s_per_step"])) for r in rows if r.get("s_per_step")]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    var = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / var if var else None


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM"


def write(rows: list[dict], args: argparse.Namespace) -> None:
    res = {"machine": machine(), "torch_threads": os.environ.get("OMP_NUM_THREADS"), "rows": rows,
           "exponent_s_per_step_vs_params": fit_exponent(rows)}
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / f"{args.name}.json").write_text(json.dumps(res, indent=2) + "\n")
    lines = [f"# Ranking time and memory against size ({res['machine']})", "",
             "| model | params | layers | N | device | weights | ckpt | calib | steps | Fisher s | s / step "
             "| peak RSS GB | peak GPU GB |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | — | — | — | {args.device} | — | — | — | — | failed: {r['error']} | | | |")
            continue
        gpu = f"{r['peak_gpu_gb']:.1f}" if "peak_gpu_gb" in r else "—"
        lines.append(f"| {r['model']} | {r['params'] / 1e6:,.0f}M | {r['layers']} | {r['tokens']} | {r.get('gpu', r['device'])} "
                     f"| {r['weights_dtype']} | {'yes' if r['checkpoint_activations'] else 'no'} | {r['calib_size']}"
                     f"×{r['batch_size']} | {r['steps']} | {r['fisher_s']:.1f} | {r['s_per_step']:.2f} "
                     f"| {r['peak_rss_gb']:.1f} | {gpu} |")
    a = res["exponent_s_per_step_vs_params"]
    lines += ["", f"Fitted exponent of seconds per step against parameters: {a:.2f}" if a is not None
              else "Fitted exponent: needs two or more models."]
    (args.results / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="minilm,mpnet,qwen3-0.6b")
    p.add_argument("--device", default="cpu")
    p.add_argument("--weights-dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--checkpoint-activations", action="store_true")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--calib-size", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--timeout", type=int, default=3600, help="seconds per model")
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--name", default="rank_scaling")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return 0
    rows = []
    passthrough = [a for a in (argv if argv is not None else sys.argv[1:])]
    for spec in args.models.split(","):
        print(f"[{time.strftime('%H:%M:%S')}] ranking {spec} ...", file=sys.stderr, flush=True)
        try:
            r = subprocess.run([sys.executable, __file__, *passthrough, "--child", spec], capture_output=True,
                               text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            rows.append({"model": spec, "error": f"over {args.timeout} s"})
            continue
        hit = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
        if r.returncode != 0 or not hit:
            tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
            rows.append({"model": spec, "error": tail[:200]})
            continue
        rows.append(json.loads(hit[-1][len("RESULT "):]))
        print(f"  {rows[-1]['s_per_step']:.2f} s/step, peak RSS {rows[-1]['peak_rss_gb']:.1f} GB", file=sys.stderr)
    write(rows, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
