"""GPU speed of the physically sliced budgets in PyTorch: the GPU check where TensorRT is missing.

``scripts/gpu_check.sh`` measures TensorRT engines. On a CUDA machine without TensorRT (or for a
second opinion) this measures the same budgets as sliced PyTorch modules: the model (default timm
ViT-B/16, random init: speed depends on shapes, not values) is ranked (``random``), planned at the
budgets with ``--align`` (default 64, tensor-core friendly widths) exactly as the exporter plans
them, and every budget is built as a physically sliced copy of the rank-permuted model
(``elastic_export.ranking.reference.sliced_copy``, the torch twin of the per-budget ONNX; the test suite
checks the two agree within 1e-4). All modules are loaded at once, in ``--dtype`` (fp16 default),
and measured one by one:

* **throughput** at ``--batch`` (median of ``--iters`` synchronised runs);
* **latency** at batch 1 (median of ``--latency-iters``), replayed from a CUDA graph with
  ``--cuda-graphs`` (default on CUDA: no per-kernel launch cost, as in a compiled engine);
* **switch cost against dense**: a batch-1 request to the budget right after one to the dense
  module, minus the same request after one to itself (medians);
* **fidelity**: relative error of each budget's output in ``--dtype`` on the device against the
  same sliced module in fp32 on the CPU (batch 2).

Not TensorRT: there is no cross-layer kernel fusion beyond what cuBLAS / SDPA give, so the gains
are a lower bound on what an engine gets from the same widths. Paper figures ("Your Transformer
Is Secretly Elastic", A100, TensorRT-style compilation): 1.08x..1.80x throughput at 10..60 %
sparsity, 1.26x lower single-query latency at 60 %, 0.46 ms mean switch.

Usage:
    python benchmarks/gpu_torch.py [--model vit_base_patch16_224] [--budgets 0.1..0.6] [--batch 128]
        [--dtype fp16|bf16|fp32] [--device cuda] [--no-cuda-graphs] [--iters 30] [--latency-iters 200]

Writes ``RESULTS/gpu_torch.{json,md}``. ``--device cpu`` runs the same code path (slowly) where
there is no GPU, for testing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from gpu_check import PAPER, T0, log  # noqa: E402  (the paper's A100 figures, timestamped progress)

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


class Model:
    """One budget's sliced module on the device, with a static batch-1 input (and its CUDA graph)."""

    def __init__(self, module, feeds: dict, device: str, dtype, cuda_graphs: bool) -> None:
        import torch

        self.torch = torch
        self.device = device
        self.module = module.to(device=device, dtype=dtype).eval()
        self.names = list(feeds)
        self.dtype = dtype
        self.one = [self._cast(feeds[n][:1]).to(device) for n in self.names]
        self.graph = None
        if cuda_graphs:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.no_grad():
                for _ in range(3):  # warm up (cuBLAS handles, SDPA kernel choice) off the capture
                    self.module(*self.one)
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph), torch.no_grad():
                self.static_out = self.module(*self.one)

    def _cast(self, t):
        return t.to(self.dtype) if t.is_floating_point() else t

    def sync(self) -> None:
        if self.device.startswith("cuda"):
            self.torch.cuda.synchronize()

    def run(self, inputs: list) -> None:
        with self.torch.no_grad():
            self.module(*inputs)

    def request(self) -> None:
        """One batch-1 request (graph replay where captured)."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self.run(self.one)

    def times(self, fn, iters: int, warmup: int) -> list[float]:
        out = []
        for i in range(warmup + iters):
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            if i >= warmup:
                out.append(time.perf_counter() - t0)
        return out


def build(args: argparse.Namespace):
    """(encoder, [(label, plan-or-None, sliced module)]) for the dense model and every budget."""
    import torch

    from elastic_export.core.budgets import parse_budgets
    from elastic_export.export.dense import permuted_module
    from elastic_export.models.adapters import find_blocks
    from elastic_export.models.inventory import build_inventory
    from elastic_export.models.loader import load_encoder
    from elastic_export.ranking.file import Ranking
    from elastic_export.ranking.plans import make_plans
    from elastic_export.ranking.reference import prefix_keep, sliced_copy
    from elastic_export.ranking.scoring import METHODS

    torch.manual_seed(args.seed)
    enc = load_encoder(args.model, pretrained=False, seq_len=args.seq_len)
    inv = build_inventory(enc)
    heads, neurons = METHODS["random"](enc, inv, None, seed=args.seed)
    rk = Ranking(heads, neurons, {"method": "random"})
    plans = make_plans(rk, inv, [0.0, *parse_budgets(args.budgets)], align=args.align)
    perm = permuted_module(enc, rk)
    out = []
    for plan in plans:
        module = enc.export_module(sliced_copy(perm, find_blocks, prefix_keep(plan)))
        out.append(("dense" if plan.sparsity == 0.0 else f"{plan.sparsity:.2f}", plan, module))
    return enc, out


def measure(args: argparse.Namespace) -> dict:
    import torch

    from elastic_export.checks.compare import relative_error

    dtype = getattr(torch, DTYPES[args.dtype])
    cuda_graphs = args.device.startswith("cuda") and args.cuda_graphs
    enc, built = build(args)
    big = enc.sample_inputs(batch=args.batch, seed=1, seq_len=args.seq_len)
    two = {k: v[:2] for k, v in big.items()}
    models, res = {}, {}
    for label, plan, module in built:
        with torch.no_grad():
            want = [t.numpy() for t in module(*two.values())]  # fp32, CPU: the reference
        t0 = time.perf_counter()
        m = models[label] = Model(module, big, args.device, dtype, cuda_graphs)
        with torch.no_grad():
            got = [t.float().cpu().numpy() for t in m.module(*(m._cast(v).to(args.device) for v in two.values()))]
        res[label] = {"gflops": plan.gflops, "heads_per_layer": plan.heads_per_layer,
                      "neurons_per_layer": plan.neurons_per_layer, "load_ms": (time.perf_counter() - t0) * 1e3,
                      "rel_error_vs_fp32": relative_error(want, got)}
    inputs = {label: [m._cast(v).to(args.device) for v in big.values()] for label, m in models.items()}
    for label, m in models.items():
        t = m.times(lambda: m.run(inputs[label]), args.iters, warmup=3)
        res[label]["throughput"] = args.batch / statistics.median(t)
        lat = m.times(m.request, args.latency_iters, warmup=10)
        res[label]["latency_ms"] = statistics.median(lat) * 1e3
        log(f"{label}: {res[label]['gflops']:.2f} GFLOPs, {res[label]['throughput']:.0f}/s at {args.batch}, "
            f"{res[label]['latency_ms']:.3f} ms at 1, rel err {res[label]['rel_error_vs_fp32']:.1e}")
    dense = models["dense"]
    for label, m in models.items():
        if label == "dense":
            continue
        steady = m.times(m.request, args.switch_pairs, warmup=5)
        switched = []
        for _ in range(args.switch_pairs):
            dense.request()
            switched += m.times(m.request, 1, warmup=0)
        res[label]["switch_ms"] = max(0.0, (statistics.median(switched) - statistics.median(steady)) * 1e3)
    return res


def report(res: dict, args: argparse.Namespace) -> dict:
    import torch

    d = res["dense"]
    rows = []
    for label, r in res.items():
        s = None if label == "dense" else round(float(label), 2)
        rows.append({
            "budget": label, "gflops": r["gflops"], "flop_ratio": d["gflops"] / r["gflops"],
            "throughput": r["throughput"], "gain": r["throughput"] / d["throughput"],
            "paper_gain": PAPER["throughput_gain"].get(s) if s is not None else None,
            "latency_ms": r["latency_ms"], "latency_gain": d["latency_ms"] / r["latency_ms"],
            "paper_latency_gain": PAPER["latency_gain_at_0.6"] if s == 0.6 else None,
            "switch_ms": r.get("switch_ms"), "rel_error_vs_fp32": r["rel_error_vs_fp32"],
        })
    switches = [r["switch_ms"] for r in rows if r["switch_ms"] is not None]
    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "CPU"
    out = {"model": args.model, "device": gpu, "torch": torch.__version__, "dtype": args.dtype,
           "cuda_graphs": args.device.startswith("cuda") and args.cuda_graphs, "batch": args.batch,
           "align": args.align, "budgets": args.budgets,
           "paper": {**PAPER, "throughput_gain": {str(k): v for k, v in PAPER["throughput_gain"].items()}},
           "mean_switch_ms": statistics.mean(switches) if switches else None, "rows": rows,
           "wall_seconds": time.perf_counter() - T0}
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / f"{args.name}.json").write_text(json.dumps(out, indent=2) + "\n")

    def f(v, fmt):
        return "—" if v is None else format(v, fmt)

    lines = [f"# Sliced budgets in PyTorch: {args.model} (random init), {args.dtype}, {gpu}", "",
             f"torch {torch.__version__}; throughput at batch {args.batch}, latency at batch 1"
             f"{' (CUDA graph replay)' if out['cuda_graphs'] else ''}; paper figures: TensorRT on an A100.", "",
             "| budget | GFLOPs | FLOP ratio | per s | gain | paper gain | latency ms | latency gain "
             "| paper lat. gain | switch ms | rel err vs fp32 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['budget']} | {r['gflops']:.3g} | {r['flop_ratio']:.2f}x | {r['throughput']:.0f} | "
                     f"{r['gain']:.2f}x | {f(r['paper_gain'], '.2f')} | {r['latency_ms']:.3f} | "
                     f"{r['latency_gain']:.2f}x | {f(r['paper_latency_gain'], '.2f')} | {f(r['switch_ms'], '.3f')} | "
                     f"{r['rel_error_vs_fp32']:.1e} |")
    lines += ["", f"Mean switch cost against dense: {f(out['mean_switch_ms'], '.3f')} ms (paper: {PAPER['switch_ms']} ms; "
              "every budget stays loaded, so a switch is calling another module). "
              f"Wall time {out['wall_seconds']:.0f} s."]
    (args.results / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="vit_base_patch16_224")
    p.add_argument("--budgets", default="0.1..0.6")
    p.add_argument("--align", type=int, default=64)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=None, help="text models: tokens per input")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--latency-iters", type=int, default=200)
    p.add_argument("--switch-pairs", type=int, default=100)
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="replay batch-1 requests from CUDA graphs (CUDA only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--name", default="gpu_torch", help="result file stem")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("missing: a CUDA GPU visible to torch (use --device cpu to test the code path)", file=sys.stderr)
        return 1
    if args.dtype != "fp32" and args.device == "cpu":
        log(f"{args.dtype} on the CPU is slow; it only tests the code path")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 rows compute in fp32, as the engines' --no-tf32 default
    report(measure(args), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
