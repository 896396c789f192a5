"""onnxruntime speed of the per-budget graphs: timm ViT-B/16 at 224 px, ``--align 64`` vs ``--align 1``.

The pipeline exports a randomly initialised ``vit_base_patch16_224`` (nothing is downloaded here)
at every budget, once per alignment, from one data-free ranking (default ``random``; one ranking
file is shared by all alignments). Speed depends on the graphs' shapes, not on the weights'
values, so random weights give the timings a trained model would give at the same per-layer
widths. The widths do depend on the ranking: ``random`` removes heads and neurons in proportion
(like a real ranking does, roughly), whereas ``magnitude`` on random weights ranks every head
below every neuron (per FLOP) and strips whole attention blocks first, an unrepresentative shape.

Every graph runs in onnxruntime (CPU execution provider by default) at each batch size: warm-up
runs, then ``--repeats`` timed runs; the median latency and the throughput (inputs / s) are
reported, with the throughput gain over the dense model, the FLOP ratio (dense GFLOPs / budget
GFLOPs from the manifest) and their quotient (1.0 = the graph is exactly as much faster as it has
fewer FLOPs). The dense model is timed before and after the budgets; both sets of samples are
pooled, and their drift is reported (a busy machine shows up there).

Check (printed, exit code 1 if it fails): at ``--align 64`` every budget's gain >= 0.95 x its FLOP
ratio, at every batch size.

Usage:
    python benchmarks/ort_speed.py [--model vit_base_patch16_224] [--image-size 224]
        [--budgets 0.1..0.6] [--aligns 64,1] [--method random] [--batches 1,32] [--repeats 20]
        [--warmup 3] [--threads 0] [--provider cpu|cuda] [--opt-level all|extended|basic|disable]
        [--variants plain,fused] [--interleave] [--no-fusion-report] [--seq-len 128]
        [--work DIR] [--rebuild] [--results DIR] [--name ort_speed]

``--model default`` times the embedded all-MiniLM-L6-v2 instead (text, ``--seq-len`` tokens).
A work directory is reused when it holds the requested budgets (or more) with the same model,
alignment and ranking method. ``--interleave`` suits a busy machine (see ``measure_interleaved``).

``--variants fused`` also times the onnxruntime-transformer-optimised copy of every graph
(``elastic_export.precision.ort_optimize``). Writes ``RESULTS/NAME.json`` and ``RESULTS/NAME.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Callable

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from elastic_export.core.budgets import parse_budgets  # noqa: E402
from elastic_export.core.errors import UserError  # noqa: E402
from elastic_export.core.manifest import load_manifest, resolve  # noqa: E402
from elastic_export.measure.timing import busy_warning, machine, time_calls  # noqa: E402
from elastic_export.models.loader import DEFAULT_MODEL  # noqa: E402

RESULTS = Path(__file__).parent / "results"
INTERLEAVED = " (graphs interleaved run by run; no memory arena, no thread spinning)"
OPT_LEVELS = ("disable", "basic", "extended", "all")
NOTE = ("Random-init weights and a data-free ranking: speed depends on the graphs' shapes (per-layer "
        "head and neuron counts), not on the weights' values, so these timings hold for a trained model "
        "with the same per-layer widths.")
FUSION_OPS = ("Attention", "MultiHeadAttention", "SkipLayerNormalization", "EmbedLayerNormalization", "BiasGelu",
              "FastGelu", "Gelu", "FusedMatMul", "FusedGemm", "Gemm", "MatMul", "Add", "LayerNormalization", "Erf",
              "Softmax")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- artifacts ----------------------------------------------------------------------------------
def build_artifacts(out: Path, *, model: str | None, budgets: tuple[float, ...], align: int, method: str,
                    pretrained: bool = False, image_size: int | None = None, seq_len: int = 128,
                    ranking: str | None = None, rebuild: bool = False, verify: bool = False, exact: bool = False,
                    echo: Callable[[str], None] = log) -> Path:
    """Run the pipeline into ``out`` unless it already holds these budgets (or more) at this
    alignment and ranking method (a budget's plan does not depend on the other budgets).

    Args:
        out: artifact directory.
        model: timm name or local path (None: the embedded all-MiniLM-L6-v2).
        budgets: sparsities.
        align: ``--align K``.
        method: ranking method (that of ``ranking`` when it is given).
        pretrained: timm pretrained weights (never available offline; False = random init).
        image_size: timm input resolution.
        seq_len: text token count N.
        ranking: reuse this ranking file (same model, any alignment).
        rebuild: always run the pipeline.
        verify: check every budget against the hard-masked torch model (slow for big models).
        exact: reuse only a directory with exactly these budgets (not a superset).
        echo: progress lines.

    Returns:
        ``out``.
    """
    from elastic_export.pipeline import Options, run

    if not rebuild and (out / "manifest.json").is_file():
        try:
            m = load_manifest(out)
            have = {b["sparsity"] for b in m["budgets"]}
            fits = set(budgets) == have if exact else set(budgets) <= have
            same = (m.get("align") == align and fits and m["ranking"].get("method") == method
                    and m["model"].get("source") == (model or DEFAULT_MODEL))
            if same and image_size and m["model"].get("modality") == "image":
                same = m["inputs"][0]["shape"][-1] == image_size
            if same and m["model"].get("modality") == "text":
                same = m.get("tokens") == seq_len
            if same and ranking is not None:  # the very same ranking file
                same = file_digest(resolve(out, m["ranking"]["file"])) == file_digest(Path(ranking))
        except UserError:
            same = False
        if same:
            echo(f"reusing {out} (align {align}, {len(budgets)} budgets)")
            return out
    echo(f"building {out}: align {align}, budgets {', '.join(f'{b:g}' for b in budgets)}")
    t0 = time.perf_counter()
    run(Options(model=model, pretrained=pretrained, image_size=image_size, seq_len=seq_len, budgets=budgets,
                align=align, method=method, ranking=ranking, out=str(out), overwrite=True, verify=verify,
                checkpoint=str(out.parent / f".{out.name}.ckpt")), echo=lambda s: None)
    echo(f"built {out} in {time.perf_counter() - t0:.0f}s")
    return out


def graphs(directory: Path, only: set[float] | None = None) -> list[dict]:
    """Dense first, then every budget (or those in ``only``): {sparsity, achieved_sparsity, gflops,
    onnx: Path, heads_per_layer, neurons_per_layer}."""
    m = load_manifest(directory)
    rows = [{"sparsity": 0.0, "achieved_sparsity": 0.0, "gflops": m["dense"]["gflops"],
             "onnx": resolve(directory, m["dense"]["onnx"])}]
    rows += [{"sparsity": b["sparsity"], "achieved_sparsity": b["achieved_sparsity"], "gflops": b["gflops"],
              "onnx": resolve(directory, b["onnx"]), "heads_per_layer": b["heads_per_layer"],
              "neurons_per_layer": b["neurons_per_layer"]} for b in m["budgets"]
             if only is None or b["sparsity"] in only]
    return rows


def file_digest(path: Path) -> str:
    h = hashlib.sha1()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def fused_copy(path: Path) -> Path:
    """The onnxruntime-transformer-optimised copy of ``path`` (made once, verified)."""
    from elastic_export.precision.ort_optimize import optimize_onnx, optimized_name

    out = path.with_name(optimized_name(path.name))
    if not out.is_file() or out.stat().st_mtime < path.stat().st_mtime:
        res = optimize_onnx(path, out)
        log(f"  optimised {path.name}: {res.fused} (max abs error {res.max_abs_error:.1e})")
    return out


# --- sessions and timing ------------------------------------------------------------------------
def providers(name: str) -> list:
    """onnxruntime providers for ``cpu`` or ``cuda`` (refuses cuda where it is not available)."""
    import onnxruntime as ort

    if name == "cpu":
        return ["CPUExecutionProvider"]
    if name == "cuda":
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise UserError("--provider cuda: this onnxruntime has no CUDAExecutionProvider "
                            f"(available: {', '.join(ort.get_available_providers())}); install onnxruntime-gpu")
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    raise UserError(f"--provider {name}: choose cpu or cuda")


def make_session(path: Path, provider: str, threads: int, opt_level: str, fusion_report: bool = False,
                 spin: bool = True, arena: bool = True):
    """An onnxruntime session; with ``fusion_report`` also the op counts of the graph it runs.

    Args:
        path: ONNX file.
        provider: ``cpu`` or ``cuda``.
        threads: intra-op threads (0 = onnxruntime's default, one per physical core).
        opt_level: graph optimisation level (``disable``, ``basic``, ``extended``, ``all``).
        fusion_report: save the optimised graph to a temporary file and count its operators.
        spin: let idle intra-op threads spin (onnxruntime's default); off when several sessions take
            turns, so that one session's spinning threads do not steal the next one's cores.
        arena: keep onnxruntime's CPU memory arena (its default). Off when many sessions are held at
            once: each then keeps only its weights between runs instead of its peak activations
            (13 ViT-B/16 sessions at batch 32 do not fit in 23 GB with arenas).

    Returns:
        (session, op counts or None)
    """
    import onnx
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3
    if not spin:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.enable_cpu_mem_arena = arena
    so.graph_optimization_level = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL, "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED, "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[opt_level]
    counts = None
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        if fusion_report:
            so.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        sess = ort.InferenceSession(str(path), so, providers=providers(provider))
        if fusion_report:
            g = onnx.load(so.optimized_model_filepath, load_external_data=False).graph
            c = Counter(n.op_type for n in g.node)
            counts = {op: c[op] for op in FUSION_OPS if c.get(op)}
    if provider == "cuda" and sess.get_providers()[0] != "CUDAExecutionProvider":
        raise UserError(f"{path}: the CUDA execution provider did not load (got {sess.get_providers()})")
    return sess, counts


def make_feeds(manifest: dict, batch: int, seq_len: int | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs of the manifest's input specs: pixels ~ N(0, 1); token ids in [1000, 2000),
    full attention masks, token types 0, at the manifest's token count (or ``seq_len``)."""
    rng = np.random.default_rng(seed)
    tokens = int(seq_len or manifest.get("tokens") or 128)
    dtypes = {"float32": np.float32, "int64": np.int64, "int32": np.int32, "float16": np.float16}
    feeds = {}
    for spec in manifest["inputs"]:
        name, dt = spec["name"], dtypes[spec["dtype"]]
        if name == "pixel_values":
            shape = [batch] + [d if isinstance(d, int) else 224 for d in spec["shape"][1:]]
            feeds[name] = rng.standard_normal(shape).astype(dt)
        elif name == "input_ids":
            feeds[name] = rng.integers(1000, 2000, size=(batch, tokens)).astype(dt)
        elif name == "attention_mask":
            feeds[name] = np.ones((batch, tokens), dtype=dt)
        else:
            feeds[name] = np.zeros((batch, tokens), dtype=dt)
    return feeds


def time_runs(sess, feeds: dict[str, np.ndarray], *, warmup: int, repeats: int, provider: str) -> list[float]:
    """Seconds per run: ``warmup`` untimed runs, then ``repeats`` timed ones. On CUDA, inputs and
    outputs stay on the device (I/O binding), so only the graph is timed."""
    if provider == "cuda":
        import onnxruntime as ort

        io = sess.io_binding()
        for k, v in feeds.items():
            io.bind_ortvalue_input(k, ort.OrtValue.ortvalue_from_numpy(v, "cuda", 0))
        for o in sess.get_outputs():
            io.bind_output(o.name, "cuda")

        def once() -> None:
            sess.run_with_iobinding(io)
    else:
        def once() -> None:
            sess.run(None, feeds)

    return time_calls(once, warmup=warmup, repeats=repeats)


def measure(path: Path, manifest: dict, batch: int, args: argparse.Namespace, fusion_report: bool) -> dict:
    """Latency samples and (optionally) the session's op counts of one graph at one batch size."""
    sess, counts = make_session(path, args.provider, args.threads, args.opt_level, fusion_report)
    feeds = make_feeds(manifest, batch, getattr(args, "seq_len", None))
    samples = time_runs(sess, feeds, warmup=args.warmup, repeats=args.repeats, provider=args.provider)
    del sess
    return {"samples": samples, "ops": counts}


def measure_interleaved(items: list[tuple[Path, dict]], batch: int, args: argparse.Namespace) -> list[dict]:
    """Like :func:`measure` for several graphs at once, one run of each in turn, so that a change
    of machine load hits every graph alike (all sessions are held in memory together)."""
    sessions = []
    for path, manifest in items:
        sess, counts = make_session(path, args.provider, args.threads, args.opt_level, args.fusion_report,
                                    spin=False, arena=False)
        feeds = make_feeds(manifest, batch, getattr(args, "seq_len", None))
        time_runs(sess, feeds, warmup=args.warmup, repeats=0, provider=args.provider)
        sessions.append((sess, feeds, counts))
    samples: list[list[float]] = [[] for _ in sessions]
    for _ in range(args.repeats):
        for i, (sess, feeds, _) in enumerate(sessions):
            samples[i] += time_runs(sess, feeds, warmup=0, repeats=1, provider=args.provider)
    return [{"samples": s, "ops": c} for s, (_, _, c) in zip(samples, sessions)]


def summarise(samples: list[float], batch: int) -> dict:
    med = float(np.median(samples))
    return {"latency_ms": med * 1e3, "latency_ms_min": float(min(samples)) * 1e3,
            "latency_ms_max": float(max(samples)) * 1e3, "throughput": batch / med, "runs": len(samples)}


def _group(dirs: dict[int, Path], variant: str, batch: int, args: argparse.Namespace) -> tuple[dict, list]:
    """Time one (variant, batch): the dense graph (once, shared by directories whose dense files
    are identical) and every budget of every directory. Returns (dense result, budget results)."""
    dense_path, dense_manifest, dense_info = None, None, None
    budgets = []  # (align, item, path, manifest)
    digests = set()
    for align, d in dirs.items():
        manifest = load_manifest(d)
        items = graphs(d, getattr(args, "only_budgets", None))
        digest = file_digest(items[0]["onnx"])
        if dense_path is None:
            dense_path = fused_copy(items[0]["onnx"]) if variant == "fused" else items[0]["onnx"]
            dense_manifest, dense_info = manifest, items[0]
        elif digest not in digests:
            log(f"note: {d} has a different dense graph than {next(iter(dirs.values()))}; gains use the first")
        digests.add(digest)
        for it in items[1:]:
            budgets.append((align, it, fused_copy(it["onnx"]) if variant == "fused" else it["onnx"], manifest))
    tag = f"[{variant} b{batch}]"
    if getattr(args, "interleave", False):
        log(f"{tag} dense + {len(budgets)} budgets, interleaved")
        res = measure_interleaved([(dense_path, dense_manifest)] + [(p, m) for _, _, p, m in budgets], batch, args)
        dense_samples = res[0]["samples"]
        half = len(dense_samples) // 2
        drift = (float(np.median(dense_samples[half:])) / float(np.median(dense_samples[:half])) - 1.0) if half else 0.0
        dense = {"samples": dense_samples, "ops": res[0]["ops"], "drift": drift}
        return dense, [(a, it, r) for (a, it, _, _), r in zip(budgets, res[1:])]
    log(f"{tag} dense ({dense_info['gflops']:.2f} GFLOPs)")
    first = measure(dense_path, dense_manifest, batch, args, fusion_report=args.fusion_report)
    out = []
    for align, it, path, manifest in budgets:
        log(f"{tag} align {align}, sparsity {it['sparsity']:g} ({it['gflops']:.2f} GFLOPs)")
        out.append((align, it, measure(path, manifest, batch, args, fusion_report=args.fusion_report)))
    log(f"{tag} dense again")
    last = measure(dense_path, dense_manifest, batch, args, fusion_report=False)
    drift = float(np.median(last["samples"])) / float(np.median(first["samples"])) - 1.0
    return {"samples": first["samples"] + last["samples"], "ops": first["ops"], "drift": drift}, out


def bench_dirs(dirs: dict[int, Path], batches: list[int], variants: list[str], args: argparse.Namespace) -> dict:
    """Time the dense model and every budget of each directory ({align: dir}).

    Args:
        dirs: artifact directories by alignment (their dense graphs should be the same file).
        batches: batch sizes.
        variants: ``plain`` (the exported graphs) and/or ``fused`` (their ort_optimize copies).
        args: provider, threads, opt_level, warmup, repeats, fusion_report, interleave, seq_len.

    Returns:
        ``{"dense": [...], "rows": [...]}``: one dense row per (variant, batch) and one row per
        (variant, batch, align, budget) with latency, throughput, gain, FLOP ratio, gain/FLOP ratio.
    """
    dense_rows, rows = [], []
    for variant in variants:
        for batch in batches:
            dn, budget_results = _group(dirs, variant, batch, args)
            dense_gflops = load_manifest(next(iter(dirs.values())))["dense"]["gflops"]
            ds = summarise(dn["samples"], batch)
            dense_rows.append({"variant": variant, "batch": batch, "gflops": dense_gflops, **ds,
                               "drift": dn["drift"], "ops": dn["ops"]})
            for align, it, res in budget_results:
                s = summarise(res["samples"], batch)
                ratio = dense_gflops / it["gflops"]
                gain = s["throughput"] / ds["throughput"]
                rows.append({"variant": variant, "batch": batch, "align": align, "sparsity": it["sparsity"],
                             "achieved_sparsity": it["achieved_sparsity"], "gflops": it["gflops"],
                             "flop_ratio": ratio, **s, "gain": gain, "gain_per_flop_ratio": gain / ratio,
                             "ops": res["ops"], "heads_per_layer": it["heads_per_layer"],
                             "neurons_per_layer": it["neurons_per_layer"]})
    return {"dense": dense_rows, "rows": rows}


# --- reporting ----------------------------------------------------------------------------------
def check_rows(rows: list[dict], align: int = 64, factor: float = 0.95,
               variant: str = "plain") -> list[tuple[str, bool]]:
    """At ``align``, every budget's gain >= factor x FLOP ratio (one check per batch size), for the
    exported graphs (``variant``)."""
    checks = []
    groups = sorted({(r["variant"], r["batch"]) for r in rows if r["align"] == align and r["variant"] == variant})
    for variant, batch in groups:
        sel = [r for r in rows if r["align"] == align and r["variant"] == variant and r["batch"] == batch]
        worst = min(sel, key=lambda r: r["gain_per_flop_ratio"])
        ok = all(r["gain"] >= factor * r["flop_ratio"] for r in sel)
        checks.append((f"align {align}, {variant}, batch {batch}: every budget's gain >= {factor} x FLOP ratio "
                       f"(worst: sparsity {worst['sparsity']:g}, gain {worst['gain']:.2f} vs FLOP ratio "
                       f"{worst['flop_ratio']:.2f} = {worst['gain_per_flop_ratio']:.2f})", ok))
    return checks


def table(result: dict, unit: str) -> list[str]:
    """Markdown tables: one per (variant, batch), one column group per alignment."""
    rows, dense = result["rows"], result["dense"]
    lines = []
    for variant, batch in sorted({(r["variant"], r["batch"]) for r in rows}, key=lambda t: (t[0] != "plain", t)):
        sel = [r for r in rows if r["variant"] == variant and r["batch"] == batch]
        aligns = sorted({r["align"] for r in sel}, reverse=True)
        dn = next(d for d in dense if d["variant"] == variant and d["batch"] == batch)
        lines += [f"### {variant}, batch {batch}", "",
                  f"dense: {dn['latency_ms']:.1f} ms, {dn['throughput']:.2f} {unit}/s, {dn['gflops']:.2f} GFLOPs "
                  f"(dense drift during the measurement {dn['drift']:+.1%})", ""]
        head = "| sparsity | " + " | ".join(
            f"K={a} achieved | K={a} GFLOPs | K={a} FLOP ratio | K={a} ms | K={a} {unit}/s | K={a} gain | "
            f"K={a} gain/FLOP"
            for a in aligns) + " |"
        lines += [head, "|---|" + "---|" * (7 * len(aligns))]
        for s in sorted({r["sparsity"] for r in sel}):
            cells = []
            for a in aligns:
                r = next((r for r in sel if r["align"] == a and r["sparsity"] == s), None)
                cells += (["–"] * 7 if r is None else
                          [f"{r['achieved_sparsity']:.3f}", f"{r['gflops']:.2f}", f"{r['flop_ratio']:.2f}",
                           f"{r['latency_ms']:.1f}", f"{r['throughput']:.2f}", f"{r['gain']:.2f}",
                           f"{r['gain_per_flop_ratio']:.2f}"])
            lines.append(f"| {s:.2f} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def fusion_lines(result: dict) -> list[str]:
    """Operators in the graphs onnxruntime actually runs (after its own optimisation), per variant."""
    lines = []
    for variant in sorted({r["variant"] for r in result["rows"]}):
        dn = next((d for d in result["dense"] if d["variant"] == variant and d.get("ops")), None)
        sel = [r for r in result["rows"] if r["variant"] == variant and r.get("ops")]
        if dn is None and not sel:
            continue
        lines += [f"Operators after onnxruntime's graph optimisation ({variant}):", ""]
        if dn is not None:
            lines.append(f"- dense: {', '.join(f'{k} {v}' for k, v in dn['ops'].items())}")
        seen = set()
        for r in sel:
            key = (r["align"], r["sparsity"])
            if key in seen:
                continue
            seen.add(key)
            lines.append(f"- align {r['align']}, sparsity {r['sparsity']:g}: "
                         f"{', '.join(f'{k} {v}' for k, v in r['ops'].items())}")
        lines.append("")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="vit_base_patch16_224",
                    help="timm name (random init), local path, or 'default' (the embedded all-MiniLM-L6-v2)")
    ap.add_argument("--seq-len", type=int, default=128, help="text models: tokens per sequence")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--budgets", default="0.1..0.6")
    ap.add_argument("--aligns", default="64,1", help="comma list of --align values to compare")
    ap.add_argument("--method", default="random",
                    help="data-free ranking method (random: heads and neurons removed in proportion; magnitude "
                         "on random weights removes whole attention first)")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--repeats", type=int, default=20, help="timed runs per graph and batch size")
    ap.add_argument("--warmup", type=int, default=3, help="untimed runs first")
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: onnxruntime default)")
    ap.add_argument("--provider", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--opt-level", default="all", choices=OPT_LEVELS, help="onnxruntime graph optimisation level")
    ap.add_argument("--variants", default="plain", help="plain (exported graphs) and/or fused (ort_optimize copies)")
    ap.add_argument("--interleave", action="store_true",
                    help="time all graphs of a batch size in turn, one run each (robust to a changing machine "
                         "load; holds every session in memory at once, so their CPU memory arenas are off and "
                         "idle threads do not spin)")
    ap.add_argument("--no-fusion-report", dest="fusion_report", action="store_false",
                    help="skip counting the operators of the graphs onnxruntime runs")
    ap.add_argument("--pretrained", action="store_true", help="timm pretrained weights (not available offline)")
    ap.add_argument("--work", default="/tmp/elastic-ort-speed", help="artifact directories go here")
    ap.add_argument("--rebuild", action="store_true", help="re-export even when the work directory matches")
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--name", default="ort_speed", help="results file stem")
    args = ap.parse_args(argv)
    try:
        budgets = tuple(parse_budgets(args.budgets))
        aligns = [int(a) for a in args.aligns.split(",") if a.strip()]
        batches = [int(b) for b in args.batches.split(",") if b.strip()]
        variants = [v for v in args.variants.split(",") if v.strip()]
        if not aligns or not batches or min(batches) < 1 or args.repeats < 1 or args.warmup < 0:
            raise UserError("need at least one --aligns value, batches >= 1, --repeats >= 1, --warmup >= 0")
        if any(v not in ("plain", "fused") for v in variants) or not variants:
            raise UserError("--variants: plain and/or fused")
        providers(args.provider)
    except (UserError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    work, results_dir = Path(args.work), Path(args.results)
    work.mkdir(parents=True, exist_ok=True)
    results_dir.mkdir(parents=True, exist_ok=True)
    host = machine()
    if warning := busy_warning(host):
        log(warning)

    args.only_budgets = set(budgets)
    dirs: dict[int, Path] = {}
    ranking = None
    for k in aligns:
        model = None if args.model in ("default", DEFAULT_MODEL) else args.model
        d = build_artifacts(work / f"align{k}", model=model, budgets=budgets, align=k, method=args.method,
                            pretrained=args.pretrained, image_size=None if model is None else args.image_size,
                            seq_len=args.seq_len, ranking=ranking, rebuild=args.rebuild)
        ranking = ranking or str(d / "ranking.safetensors")  # one ranking for every alignment
        dirs[k] = d
    t0 = time.perf_counter()
    result = bench_dirs(dirs, batches, variants, args)
    manifest = load_manifest(next(iter(dirs.values())))
    result.update({
        "note": NOTE,
        "model": {"source": manifest["model"]["source"], "architecture": manifest["model"]["architecture"],
                  "tokens": manifest["tokens"], "inputs": manifest["inputs"], "ranking": manifest["ranking"]["method"]},
        "settings": {"provider": args.provider, "threads": args.threads, "opt_level": args.opt_level,
                     "interleave": args.interleave,
                     "repeats": args.repeats, "warmup": args.warmup, "batches": batches, "aligns": aligns,
                     "budgets": list(budgets), "variants": variants},
        "machine": host, "seconds": round(time.perf_counter() - t0, 1),
    })
    checks = check_rows(result["rows"]) if 64 in aligns else []
    result["checks"] = [{"check": c, "passed": ok} for c, ok in checks]
    (results_dir / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")

    unit = "img" if any(i["name"] == "pixel_values" for i in manifest["inputs"]) else "seq"
    lines = [f"# onnxruntime speed per budget: {manifest['model']['source']} ({manifest['model']['architecture']})",
             "", NOTE, "",
             f"{args.provider.upper()} execution provider, graph optimisation level {args.opt_level}, "
             f"intra-op threads {args.threads or 'default'}; {args.warmup} warm-up + {args.repeats} timed runs, "
             f"median{INTERLEAVED if args.interleave else ''}. "
             f"Machine: {host['cpu']}, {host['logical_cpus']} logical CPUs, onnxruntime "
             f"{host['onnxruntime']}, load average at start {host['load_average'][0]:.1f}. Ranking: "
             f"{result['model']['ranking']}. gain = throughput / dense throughput; FLOP ratio = dense GFLOPs / "
             "budget GFLOPs; gain/FLOP = 1.0 means the budget is exactly as much faster as it has fewer FLOPs.", ""]
    lines += table(result, unit)
    lines += fusion_lines(result)
    if checks:
        lines += ["Checks:"] + [f"- [{'x' if ok else ' '}] {c}" for c, ok in checks]
    text = "\n".join(lines) + "\n"
    (results_dir / f"{args.name}.md").write_text(text)
    print(text)
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
