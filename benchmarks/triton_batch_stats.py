"""What a budget model's batches cost under load, from Triton's own per-batch statistics.

One ``tritonserver`` (the ``serve`` extra's, loopback only) serves the default MiniLM artifacts' repository
(``build triton --budget-backend python``, the router with its SLO policy). Dense's ``S(n)`` is first timed
here in onnxruntime at batch 1, 2, 4 and 8 (as the router times its budgets when it loads). Then seeded
Poisson arrivals at ``--loads`` x dense's closed-loop capacity (8 clients) for ``--seconds`` each, one
128-token request at a time, sent straight to the dense budget model and through the router naming
sparsity 0, in turn; around each, Triton's statistics extension (``/v2/models/M/stats``) gives the dense
model's compute time per batch size and its queue time: the service times the router's latency model
would need, measured under the real contention (the server, the router and the clients on the same cores).

Usage:
    python benchmarks/triton_batch_stats.py [--artifacts DIR] [--loads 0.6,0.8] [--seconds 20] [--seed 0]
        [--sparsity S] [--arms direct,router,adaptive]

``--sparsity``: the budget model measured (default 0, dense; loads stay multiples of dense's capacity);
``--arms``: which senders, in turn (``adaptive``: the router deciding, no sparsity named).
Writes benchmarks/results/triton_batch_stats.{json,md} (``triton_batch_stats_sS.*`` for another budget).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

import serve_triton as st  # noqa: E402

from elastic_export.core.manifest import Manifest  # noqa: E402
from elastic_export.serving import triton_stats  # noqa: E402
from elastic_export.targets import triton_onnx_model as om  # noqa: E402
from elastic_export.targets.triton import build_repository  # noqa: E402
from elastic_export.targets.tritonserver import TritonServer, free_port_block  # noqa: E402


def model_stats(http: str, model: str) -> dict:
    """``model``'s cumulative batches and compute time (ms) per batch size (:mod:`triton_stats`, the router's
    reader, on ``compute_infer`` alone), and (count, ns) of the queue over all its requests."""
    stats = triton_stats.fetch(f"http://{http}", timeout_s=10)
    queue = next(m for m in stats["model_stats"] if m["name"] == model)["inference_stats"]["queue"]
    return {"batches": triton_stats.batch_totals(stats, ("compute_infer",)).get(model, {}),
            "queue": (int(queue["count"]), int(queue["ns"]))}


def difference(before: dict, after: dict, model: str) -> dict:
    """Per batch size the batches run and their mean compute (ms) between two snapshots; the mean queue time."""
    ran = triton_stats.batch_deltas({model: before["batches"]}, {model: after["batches"]}).get(model, [])
    out = {n: {"batches": count, "mean_ms": ms / count} for n, count, ms in ran}
    (q, qns), (q0, qns0) = after["queue"], before["queue"]
    return {"compute": out, "queue_ms": (qns - qns0) / max(1, q - q0) / 1e6}


async def measure(server: TritonServer, t: dict, manifest: Manifest, args) -> tuple[float, list[dict]]:
    """Dense's closed-loop capacity (requests/s) and, per load and arm, latencies and dense's batch statistics."""
    import tritonclient.grpc.aio as aio

    client = aio.InferenceServerClient(server.grpc_url)
    dense, one = st.budget_models(t)[0.0], st.feeds_for(manifest, 1, manifest.tokens)
    measured = st.budget_models(t)[args.sparsity]
    rows = []
    try:
        cap = await st.capacity(client, dense, one, 8, 6.0)
        print(f"dense capacity {cap:.1f} requests/s")
        for load in args.loads:
            times, _ = st.phase_times([load * cap], [args.seconds], args.seed)
            arms = {"direct": (measured, None), "router": (t["router"], args.sparsity), "adaptive": (t["router"], None)}
            for arm in args.arms:
                model, sparsity = arms[arm]
                await asyncio.sleep(2.0)  # the previous arm's queue drains
                before = model_stats(server.http_url, measured)
                rec = await st.open_loop(client, model, times, one, arm != "direct", 30.0, sparsity)
                stats = difference(before, model_stats(server.http_url, measured), measured)
                lat = np.asarray(rec["latency_ms"])
                served = [x for x in rec["sparsity"] if x is not None]
                rows.append({"load": load, "rate": load * cap, "arm": arm, "requests": len(lat),
                             "refused": sum(o == "refused" for o in rec["outcome"]),
                             "served_at_measured": sum(abs(x - args.sparsity) < 1e-6 for x in served) / max(1, len(served)),
                             "latency_ms": {q: float(np.percentile(lat, p)) for q, p in (("p50", 50), ("p90", 90), ("p99", 99))},
                             **stats})
                print(json.dumps(rows[-1]))
    finally:
        await client.close()
    return cap, rows


def report(out: dict) -> str:
    idle = out["idle_ms"]
    name = "Dense" if not out.get("sparsity") else f"Budget {out['sparsity']:g}"
    lines = [f"# {name}'s batches under load, from Triton's statistics", "",
             f"Machine: {out['machine']}, {out['date']}. Dense capacity (8 closed-loop clients): "
             f"{out['dense_capacity_rps']:.1f} requests/s.", "",
             "Timed in onnxruntime with nothing else running: "
             + ", ".join(f"batch {b} {v:.1f} ms" for b, v in idle.items()) + ".", "",
             "| load | arm | requests | latency p50 / p90 / p99 ms | mean queue ms "
             "| batches of n: count, mean compute ms (x idle) |", "|---|---|---|---|---|---|"]
    for r in out["runs"]:
        cells = "; ".join(f"{b}: {c['batches']}, {c['mean_ms']:.1f}"
                          + (f" ({c['mean_ms'] / idle[str(b)]:.2f}x)" if str(b) in idle else "")
                          for b, c in r["compute"].items() if c["batches"] >= 2)
        lat = r["latency_ms"]
        lines.append(f"| {r['load']:g}x | {r['arm']} | {r['requests']} | {lat['p50']:.0f} / {lat['p90']:.0f} / "
                     f"{lat['p99']:.0f} | {r['queue_ms']:.1f} | {cells} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifacts", type=Path, default=st.DEFAULT_ARTIFACTS)
    ap.add_argument("--loads", default="0.6,0.8", help="x dense's closed-loop capacity, comma-separated")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sparsity", type=float, default=0.0, help="the budget model measured")
    ap.add_argument("--arms", default="direct,router", help="direct (the budget model), router (naming it), "
                    "adaptive (the router deciding)")
    args = ap.parse_args(argv)
    args.loads = [float(x) for x in args.loads.split(",")]
    args.arms = args.arms.split(",")
    unknown = sorted(set(args.arms) - {"direct", "router", "adaptive"})
    if unknown:
        ap.error(f"--arms: unknown {', '.join(unknown)} (direct, router, adaptive)")
    d = st.ensure_artifacts(args.artifacts)
    manifest = Manifest.load(d)
    budgets = [0.0] + [b.sparsity for b in manifest.budgets]
    if args.sparsity not in budgets:
        ap.error(f"--sparsity {args.sparsity:g} is not a budget of {d}: {', '.join(f'{s:g}' for s in budgets)}")
    t = build_repository(d, platform="python", kind="cpu", policy="adaptive", slo_ms=250.0, echo=print).triton
    session = om.open_session(str(d / "triton" / st.budget_models(t)[args.sparsity] / "1" / om.MODEL_FILE), {})
    idle = om.service_times({0: session}, manifest.tokens, (1, 2, 4, 8), repeats=9)[0]
    del session
    server = TritonServer(d / "triton", port=free_port_block(), log=Path("/tmp/triton_batch_stats.server.log"))
    try:
        server.start_routed([m["name"] for m in t["models"]], t["router"])
        cap, runs = asyncio.run(measure(server, t, manifest, args))
    finally:
        server.stop()
    out = {"machine": st.machine(), "date": time.strftime("%Y-%m-%d %H:%M"), "idle_ms": {str(k): v for k, v in idle.items()},
           "dense_capacity_rps": cap, "sparsity": args.sparsity, "runs": runs}
    suffix = f"_s{round(args.sparsity * 100):03d}" if args.sparsity else ""
    st.write_results("triton_batch_stats" + suffix, out, report(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
