"""Why the ``python`` budget models have no ``default_queue_policy``: the same dense budget model served
with and without one, at a light Poisson load, measured by the clients and by Triton's own request traces.

Two copies of the default MiniLM artifacts' dense budget model (``build triton --budget-backend python``)
in one temporary repository, one with the queue policy ``build triton`` writes for other backends, one
without; one ``tritonserver`` (loopback, traces of every request at ``level=TIMESTAMPS``) serves both.
Each gets the same seeded Poisson schedule in turn (``--rounds`` alternations). Reported per variant:
the clients' latency p50 / p99 / max, and from the traces each request's *idle wait*: the time it sat in
the queue after the instance had finished everything that started before it arrived (0 for a batcher
that dispatches as soon as the instance is free).

Usage:
    python benchmarks/triton_queue_policy.py [--rate 16] [--seconds 25] [--rounds 2]

Writes benchmarks/results/triton_queue_policy.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

import serve_triton as st  # noqa: E402

from elastic_export.core.manifest import Manifest  # noqa: E402
from elastic_export.targets.triton import build_repository, queue_policy  # noqa: E402
from elastic_export.targets.tritonserver import TritonServer, free_port_block  # noqa: E402

RESULTS = Path(__file__).parent / "results"
VARIANTS = {"no_queue_policy": False, "queue_policy": True}


def make_repository(src: Path, dest: Path, slo_ms: float) -> dict[str, str]:
    """Two copies of the budget model at ``src`` under ``dest`` (hard-linked weights), with and without the
    queue policy; ``{variant: model name}``."""
    names = {}
    for variant, policy in VARIANTS.items():
        model = dest / f"dense_{variant}"
        (model / "1").mkdir(parents=True)
        for f in (src / "1").iterdir():
            if f.is_file():
                os.link(f, model / "1" / f.name) if f.suffix == ".onnx" else shutil.copy(f, model / "1" / f.name)
        config = (src / "config.pbtxt").read_text().replace(f'name: "{src.name}"', f'name: "{model.name}"')
        if "default_queue_policy" in config:
            raise RuntimeError(f"{src}: the built budget model already has a queue policy")
        if policy:
            config = re.sub(r"(  max_queue_delay_microseconds: \d+\n)", lambda m: m.group(1) + queue_policy(128, slo_ms),
                            config, count=1)
        (model / "config.pbtxt").write_text(config)
        names[variant] = model.name
    return names


def idle_waits(trace: Path, model: str) -> np.ndarray:
    """Per traced request of ``model``: ms between its arrival (or the end of the last execution that
    started before it arrived) and its own execution's start."""
    by: dict = {}
    for e in json.loads(trace.read_text()):
        row = by.setdefault(e["id"], {})
        row.update({t["name"]: t["ns"] for t in e.get("timestamps", [])})
        if "model_name" in e:
            row["model"] = e["model_name"]
    rows = [r for r in by.values() if r.get("model") == model and "QUEUE_START" in r and "COMPUTE_START" in r]
    runs = sorted({(r["COMPUTE_START"], r["COMPUTE_END"]) for r in rows if "COMPUTE_END" in r})
    out = []
    for r in rows:
        q = r["QUEUE_START"]
        free = max([b for a, b in runs if a <= q] or [q])
        out.append(max(0.0, (r["COMPUTE_START"] - max(q, free)) / 1e6))
    return np.array(out)


async def drive(url: str, model: str, feeds, rate: float, seconds: float, seed: int) -> tuple[np.ndarray, int]:
    """Latency (ms) of every request, answered or rejected by the queue policy's timeout, and how many were
    rejected; any other error raises."""
    import tritonclient.grpc.aio as aio

    client = aio.InferenceServerClient(url)
    try:
        times = np.cumsum(np.random.default_rng(seed).exponential(1 / rate, int(rate * seconds)))
        rec = await st.open_loop(client, model, times, feeds, False, 30.0)
    finally:
        await client.close()
    if any(o == "lost" for o in rec["outcome"]):
        raise RuntimeError(f"{model}: {sorted(set(e for e in rec['error'] if e))[:2]}")
    return np.array(rec["latency_ms"]), sum(o == "refused" for o in rec["outcome"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifacts", type=Path, default=st.DEFAULT_ARTIFACTS)
    ap.add_argument("--rate", type=float, default=16.0, help="requests/s (about 0.3x the dense capacity here)")
    ap.add_argument("--seconds", type=float, default=25.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--slo-ms", type=float, default=250.0)
    args = ap.parse_args(argv)
    d = st.ensure_artifacts(args.artifacts)
    t = build_repository(d, platform="python", kind="cpu", policy="adaptive", slo_ms=args.slo_ms, echo=print).triton
    dense = d / "triton" / st.budget_models(t)[0.0]
    manifest = Manifest.load(d)
    work = Path(tempfile.mkdtemp(prefix="queue_policy."))
    try:
        names = make_repository(dense, work / "repo", args.slo_ms)
        trace = work / "trace.json"
        server = TritonServer(work / "repo", port=free_port_block(), log=work / "server.log",
                              args=[f"--trace-config=triton,file={trace}", "--trace-config=rate=1",
                                    "--trace-config=level=TIMESTAMPS", "--trace-config=log-frequency=0"])
        feeds = st.feeds_for(manifest, 1, manifest.tokens)
        lat: dict[str, list] = {v: [] for v in names}
        rejected = dict.fromkeys(names, 0)
        try:
            server.start(load=list(names.values()))
            server.wait_ready(models=list(names.values()))
            for r in range(args.rounds):
                for variant, model in names.items():
                    ms, n = asyncio.run(drive(server.grpc_url, model, feeds, args.rate, args.seconds, r))
                    lat[variant].append(ms)
                    rejected[variant] += n
                    print(f"round {r} {variant}: p99 {np.percentile(ms, 99):.0f} ms, {n} rejected")
        finally:
            server.stop()  # flushes the trace file
        out = {"date": time.strftime("%Y-%m-%d"), "machine": st.machine(), "rate_rps": args.rate,
               "seconds": args.seconds, "rounds": args.rounds, "variants": {}}
        for variant, model in names.items():
            ms, idle = np.concatenate(lat[variant]), idle_waits(trace, model)
            out["variants"][variant] = {
                "requests": int(ms.size), "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
                "max_ms": float(ms.max()), "rejected": rejected[variant], "traced": int(idle.size),
                "idle_wait_p99_ms": float(np.percentile(idle, 99)) if idle.size else None,
                "idle_wait_max_ms": float(idle.max()) if idle.size else None,
                "idle_waits_over_20ms": int((idle > 20).sum())}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write(out)
    return 0


def write(out: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "triton_queue_policy.json").write_text(json.dumps(out, indent=1) + "\n")
    lines = [f"# A Python-backend budget model with and without a queue policy ({out['date']})", "",
             f"Machine: {out['machine']}", "",
             f"The dense budget model, one 128-token request at a time, seeded Poisson {out['rate_rps']:g} requests/s "
             f"for {out['seconds']:g} s, {out['rounds']} rounds alternating. Idle wait: time a request sat queued "
             "while the instance had nothing running (Triton's request traces); rejected: the queue policy's timeout "
             "(twice the SLO) expired, UNAVAILABLE.", "",
             ("| variant | requests | rejected | p50 ms | p99 ms | max ms | idle wait p99 ms | idle wait max ms "
              "| idle waits > 20 ms |"),
             "|---|---|---|---|---|---|---|---|---|"]
    for v, r in out["variants"].items():
        lines.append(f"| {v.replace('_', ' ')} | {r['requests']} | {r['rejected']} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | "
                     f"{r['max_ms']:.0f} | "
                     f"{r['idle_wait_p99_ms']:.1f} | {r['idle_wait_max_ms']:.1f} | {r['idle_waits_over_20ms']} |")
    (RESULTS / "triton_queue_policy.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
