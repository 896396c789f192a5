"""GPU check: TensorRT speed of the per-budget engines of timm ViT-B/16 against the paper's A100 figures.

Exports a randomly initialised ``vit_base_patch16_224`` (speed depends on shapes, not values) at
budgets 0.1..0.6 with the ``random`` ranking (``--align 64`` by default, tensor-core friendly widths),
builds one fp16 TensorRT engine per budget plus the dense one (one profile, batch 1..128, tuned for
128; one timing cache shared by all builds) and measures, engine by engine:

* **throughput** at batch 128 (inputs already on the GPU; median of ``--iters`` synchronised runs);
* **latency** at batch 1 (median of ``--latency-iters`` runs);
* **switch cost against dense**: every engine is deserialised up front; a batch-1 request to the
  budget right after one to the dense engine (shapes set, input uploaded, addresses bound, run)
  minus the same request without the switch (medians). The load cost (deserialise + context) is
  reported separately;
* **fidelity**: relative error of each engine against its fp32 ONNX in onnxruntime (CPU), batch 2.

With onnxruntime-gpu installed, the same ONNX files (the fp16 ones where present) are timed on
onnxruntime's CUDA execution provider with I/O binding. The paper's figures ("Your Transformer Is
Secretly Elastic", A100): throughput 1.08x at 10 % sparsity .. 1.80x at 60 %, 1.26x lower
single-query latency at 60 %, 0.46 ms mean budget switch. Results: ``RESULTS/gpu_check.json`` and
``.md``. Exit 1 when no GPU / TensorRT is available (what is missing is printed).

Usage: ``bash scripts/gpu_check.sh [--opt-level 3] [--iters 30] ...`` (or this file directly).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PAPER = {"throughput_gain": {0.1: 1.08, 0.6: 1.80}, "latency_gain_at_0.6": 1.26, "switch_ms": 0.46, "gpu": "A100"}
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def preflight() -> list[str]:
    """What is missing for this check (empty: good to go)."""
    from elastic_export.core.errors import UserError
    from elastic_export.targets.tensorrt import cuda_device_count, import_tensorrt

    missing = []
    try:
        import_tensorrt()
    except UserError as e:
        missing.append(str(e))
    count = cuda_device_count()
    if not count:
        missing.append("no CUDA device visible (cuda-python / torch cannot see a GPU)")
    return missing


def export(work: Path, args: argparse.Namespace, need_fp16_onnx: bool) -> Path:
    """The artifact directory (reused when it holds these budgets at this alignment)."""
    from elastic_export.core.budgets import parse_budgets
    from elastic_export.core.manifest import load_manifest
    from elastic_export.pipeline import Options, run

    out = work / "artifacts"
    budgets = tuple(parse_budgets(args.budgets))
    if (out / "manifest.json").is_file() and not args.rebuild:
        m = load_manifest(out)
        if ({b["sparsity"] for b in m["budgets"]} == set(budgets) and m.get("align") == args.align
                and m["model"].get("source") == args.model
                and (not need_fp16_onnx or m["dense"].get("onnx_fp16"))):
            log(f"reusing {out}")
            return out
    log(f"exporting {args.model} (random init) at {budgets}, align {args.align}")
    run(Options(model=args.model, pretrained=False, budgets=budgets, method=args.method, align=args.align,
                out=str(out), overwrite=True, verify=False, elastic_graph=False,
                precision="fp16" if need_fp16_onnx else "fp32"), echo=log)
    return out


def engines(art: Path, args: argparse.Namespace) -> dict:
    """Build (or reuse) the fp16 engines; returns the manifest."""
    from elastic_export.core.manifest import load_manifest
    from elastic_export.targets.tensorrt import build_engines

    m = load_manifest(art)
    trt_info = m.get("tensorrt") or {}
    prof = (trt_info.get("profiles") or [{}])[0].get("pixel_values", {})
    if (not args.rebuild and trt_info.get("precision") == args.precision and prof.get("max", [0])[0] == args.batch
            and all(e.get("engine") and (art / e["engine"]).is_file() for e in [m["dense"], *m["budgets"]])):
        log("reusing engines")
        return m
    log(f"building {1 + len(m['budgets'])} {args.precision} engines")
    return build_engines(art, precision=args.precision, min_batch=1, opt_batch=args.batch, max_batch=args.batch,
                         workspace_gb=args.workspace_gb, opt_level=args.opt_level, echo=log).to_dict()


def _median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def measure_trt(art: Path, m: dict, args: argparse.Namespace) -> dict[str, dict]:
    from elastic_export.checks.compare import relative_error
    from elastic_export.targets.tensorrt import load_engine

    entries = [("dense", m["dense"])] + [(f"{b['sparsity']:.2f}", b) for b in m["budgets"]]
    name = m["inputs"][0]["name"]
    shape = m["tensorrt"]["profiles"][0][name]["opt"]  # fixed C, H, W after the batch
    rng = np.random.default_rng(0)
    big = {name: rng.standard_normal((args.batch, *shape[1:])).astype(np.float32)}
    one = {name: big[name][:1].copy()}
    two = {name: big[name][:2].copy()}
    runners, res = {}, {}
    for label, e in entries:
        t0 = time.perf_counter()
        runners[label] = load_engine(art / e["engine"])
        res[label] = {"engine": e["engine"], "load_ms": (time.perf_counter() - t0) * 1e3, "gflops": e["gflops"]}
    import onnxruntime as ort

    for label, e in entries:
        r = runners[label]
        t = r.time(big, iters=args.iters, warmup=3)
        res[label]["throughput"] = args.batch / statistics.median(t)
        lat = r.time(one, iters=args.latency_iters, warmup=10)
        res[label]["latency_ms"] = _median_ms(lat)
        res[label]["latency_mean_ms"] = statistics.mean(lat) * 1e3
        sess = ort.InferenceSession(str(art / e["onnx"]), providers=["CPUExecutionProvider"])
        out_names = [o.name for o in sess.get_outputs()]
        want = sess.run(None, two)
        got = r.run(two, outputs=out_names)
        res[label]["rel_error_vs_onnx"] = relative_error(want, [np.asarray(g, np.float32) for g in got])
        log(f"{label}: {res[label]['throughput']:.0f} img/s at {args.batch}, {res[label]['latency_ms']:.3f} ms at 1, "
            f"rel err {res[label]['rel_error_vs_onnx']:.1e}")
    dense = runners["dense"]
    for label, _ in entries[1:]:
        r = runners[label]
        steady = r.time(one, iters=args.switch_pairs, warmup=5, prepare_each=True)
        switched = []
        for _ in range(args.switch_pairs + 5):
            dense.time(one, iters=1, warmup=0, prepare_each=True)
            switched += r.time(one, iters=1, warmup=0, prepare_each=True)
        switched = switched[5:]
        res[label]["request_ms"] = _median_ms(steady)
        res[label]["switch_ms"] = max(0.0, _median_ms(switched) - _median_ms(steady))
        res[label]["switch_mean_ms"] = max(0.0, (statistics.mean(switched) - statistics.mean(steady)) * 1e3)
    for r in runners.values():
        r.close()
    return res


def measure_ort_cuda(art: Path, m: dict, args: argparse.Namespace) -> dict[str, dict] | None:
    """onnxruntime CUDA EP timings (None when onnxruntime-gpu is absent)."""
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        log("onnxruntime CUDA execution provider absent (onnxruntime-gpu not installed): skipped")
        return None
    name = m["inputs"][0]["name"]
    shape = m["tensorrt"]["profiles"][0][name]["opt"]  # fixed C, H, W after the batch
    rng = np.random.default_rng(0)
    res = {}
    for label, e in [("dense", m["dense"])] + [(f"{b['sparsity']:.2f}", b) for b in m["budgets"]]:
        if time.perf_counter() - T0 > args.time_limit:
            log("time limit reached: remaining onnxruntime CUDA timings skipped")
            break
        path = art / (e.get("onnx_fp16") or e["onnx"])
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        sess = ort.InferenceSession(str(path), opts, providers=["CUDAExecutionProvider"])
        out_names = [o.name for o in sess.get_outputs()]

        def timed(batch: int, iters: int) -> list[float]:
            x = ort.OrtValue.ortvalue_from_numpy(rng.standard_normal((batch, *shape[1:])).astype(np.float32), "cuda", 0)
            binding = sess.io_binding()
            binding.bind_ortvalue_input(name, x)
            for o in out_names:
                binding.bind_output(o, "cuda")
            ts = []
            for i in range(iters + 3):
                t0 = time.perf_counter()
                sess.run_with_iobinding(binding)
                binding.synchronize_outputs()
                if i >= 3:
                    ts.append(time.perf_counter() - t0)
            return ts

        res[label] = {"onnx": path.name, "throughput": args.batch / statistics.median(timed(args.batch, args.ort_iters)),
                      "latency_ms": _median_ms(timed(1, args.latency_iters // 2))}
        log(f"ort-cuda {label}: {res[label]['throughput']:.0f} img/s, {res[label]['latency_ms']:.3f} ms")
    return res


def report(m: dict, trt_res: dict, ort_res: dict | None, args: argparse.Namespace, results: Path) -> None:
    d = trt_res["dense"]
    rows = []
    for label, r in trt_res.items():
        s = None if label == "dense" else float(label)
        row = {
            "budget": label, "gflops": r["gflops"], "flop_ratio": d["gflops"] / r["gflops"],
            "trt_throughput": r["throughput"], "trt_gain": r["throughput"] / d["throughput"],
            "paper_gain": PAPER["throughput_gain"].get(round(s, 2)) if s is not None else None,
            "trt_latency_ms": r["latency_ms"], "trt_latency_gain": d["latency_ms"] / r["latency_ms"],
            "paper_latency_gain": PAPER["latency_gain_at_0.6"] if s is not None and round(s, 2) == 0.6 else None,
            "switch_ms": r.get("switch_ms"), "load_ms": r["load_ms"], "rel_error_vs_onnx": r["rel_error_vs_onnx"],
        }
        if ort_res and label in ort_res:
            row["ort_cuda_throughput"] = ort_res[label]["throughput"]
            row["ort_cuda_gain"] = ort_res[label]["throughput"] / ort_res["dense"]["throughput"] if "dense" in ort_res else None
            row["ort_cuda_latency_ms"] = ort_res[label]["latency_ms"]
        rows.append(row)
    switches = [r["switch_ms"] for r in rows if r["switch_ms"] is not None]
    try:
        import tensorrt as trt

        version = trt.__version__
    except Exception:
        version = None
    gpu = None
    try:
        from elastic_export.targets.tensorrt import _cudart

        rt = _cudart()
        if rt is not None:
            err, prop = rt.cudaGetDeviceProperties(0)
            gpu = prop.name.decode() if isinstance(prop.name, bytes) else str(prop.name)
    except Exception:
        pass
    out = {"model": args.model, "gpu": gpu, "tensorrt": version, "precision": args.precision,
           "fp16_mode": m["tensorrt"].get("fp16_mode"), "batch": args.batch, "align": args.align,
           "method": args.method, "paper": {**PAPER, "throughput_gain": {str(k): v for k, v in PAPER["throughput_gain"].items()}},
           "mean_switch_ms": statistics.mean(switches) if switches else None,
           "build_seconds": m["tensorrt"].get("build_seconds"), "rows": rows,
           "ort_cuda": ort_res, "wall_seconds": time.perf_counter() - T0}
    results.mkdir(parents=True, exist_ok=True)
    (results / "gpu_check.json").write_text(json.dumps(out, indent=2) + "\n")

    def f(v, fmt):
        return "—" if v is None else format(v, fmt)

    lines = [f"# GPU check: {args.model} (random init), TensorRT {version} {args.precision} "
             f"({m['tensorrt'].get('fp16_mode') or 'fp32'}), {gpu or 'GPU'}",
             "", f"Throughput at batch {args.batch}, latency at batch 1; paper figures on an A100.", "",
             "| budget | GFLOPs | FLOP ratio | TRT img/s | TRT gain | paper gain | latency ms | latency gain "
             "| paper lat. gain | switch ms | rel err | ORT-CUDA gain | ORT-CUDA lat. ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['budget']} | {r['gflops']:.2f} | {r['flop_ratio']:.2f}x | {r['trt_throughput']:.0f} | "
                     f"{r['trt_gain']:.2f}x | {f(r['paper_gain'], '.2f')} | {r['trt_latency_ms']:.3f} | "
                     f"{r['trt_latency_gain']:.2f}x | {f(r['paper_latency_gain'], '.2f')} | {f(r['switch_ms'], '.3f')} | "
                     f"{r['rel_error_vs_onnx']:.1e} | {f(r.get('ort_cuda_gain'), '.2f')} | "
                     f"{f(r.get('ort_cuda_latency_ms'), '.3f')} |")
    lines += ["", f"Mean switch cost against dense: {f(out['mean_switch_ms'], '.3f')} ms (paper: {PAPER['switch_ms']} ms); "
              f"engine load (deserialise + context): {statistics.mean(r['load_ms'] for r in rows):.1f} ms mean.",
              f"Wall time {out['wall_seconds']:.0f} s."]
    (results / "gpu_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="vit_base_patch16_224")
    p.add_argument("--budgets", default="0.1..0.6")
    p.add_argument("--method", default="random")
    p.add_argument("--align", type=int, default=64)
    p.add_argument("--precision", choices=["fp16", "fp32"], default="fp16")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--latency-iters", type=int, default=200)
    p.add_argument("--switch-pairs", type=int, default=100)
    p.add_argument("--ort-iters", type=int, default=10)
    p.add_argument("--opt-level", type=int, default=None, help="TensorRT builder_optimization_level (default: TensorRT's).")
    p.add_argument("--workspace-gb", type=float, default=8.0)
    p.add_argument("--time-limit", type=float, default=420.0, help="Seconds after which optional parts are skipped.")
    p.add_argument("--work", type=Path, default=Path("/tmp/elastic-gpu-check"), help="Artifact directory parent (reused).")
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--rebuild", action="store_true")
    p.add_argument("--no-ort", action="store_true", help="Skip the onnxruntime CUDA EP timings.")
    args = p.parse_args(argv)

    missing = preflight()
    if missing:
        for line in missing:
            print(f"missing: {line}", file=sys.stderr)
        return 1
    import tensorrt as trt

    from elastic_export.targets.tensorrt import STRONGLY_TYPED, fp16_mode

    need16 = args.precision == "fp16" and fp16_mode(trt, True) == STRONGLY_TYPED
    art = export(args.work, args, need16)
    m = engines(art, args)
    trt_res = measure_trt(art, m, args)
    ort_res = None if args.no_ort else measure_ort_cuda(art, m, args)
    report(m, trt_res, ort_res, args, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
