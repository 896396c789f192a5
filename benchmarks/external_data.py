"""A model over protobuf's 2 GiB, end to end on the CPU: main job + verify with ONNX external data.

A randomly initialised Qwen3-Embedding-0.6B-shaped model (596M parameters, 2.4 GB in fp32: over the
2 GiB one ONNX protobuf holds) is made once by ``benchmarks/rank_scaling.py``'s ``model_path``, then
``elastic-export --method magnitude`` (the export is what is measured, not the ranking) and
``elastic-export verify`` run under ``/usr/bin/time -v``. Writes
``benchmarks/results/external_data.{json,md}``: wall time, peak RSS, file sizes, verify outcome.

Usage: python benchmarks/external_data.py [--spec 0.6b] [--budgets 0.3] [--out /tmp/elastic-external]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from mpnet import _cli, _timed  # noqa: E402
from rank_scaling import machine, model_path  # noqa: E402

RESULTS = HERE / "results"


def _sizes(out: Path) -> dict[str, float]:
    return {p.name: round(p.stat().st_size / 1e6, 1) for p in sorted(out.iterdir()) if "onnx" in p.name}


def _md(res: dict) -> str:
    lines = [f"# Export over 2 GiB: random Qwen3-{res['spec']} shape, ONNX external data", "",
             f"Machine: {res['machine']}.", "",
             "| step | exit | wall s | peak RSS GB |", "|---|---|---|---|"]
    for step in ("main_job", "verify"):
        r = res[step]
        lines.append(f"| {step} | {r['rc']} | {r['wall_s']} | {r['peak_rss_mb'] / 1024:.1f} |")
    lines += ["", "| file | MB |", "|---|---|"] + [f"| {k} | {v} |" for k, v in res["files_mb"].items()]
    lines += ["", f"`{res['main_job']['cmd']}`", "", f"verify: {res['verify_summary']}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", default="0.6b")
    ap.add_argument("--budgets", default="0.3")
    ap.add_argument("--out", default="/tmp/elastic-external")
    ap.add_argument("--results", default=str(RESULTS))
    args = ap.parse_args(argv)
    model = model_path(f"qwen3-{args.spec}")
    out, results = Path(args.out), Path(args.results)
    shutil.rmtree(out, ignore_errors=True)
    results.mkdir(parents=True, exist_ok=True)
    res = {"spec": args.spec, "machine": machine(), "model": model}
    res["main_job"] = _timed([_cli(), "--model", model, "--budgets", args.budgets, "--method", "magnitude",
                              "--no-report", "--out", str(out)], out.with_suffix(".main.log"))
    res["verify"] = _timed([_cli(), "verify", str(out)], out.with_suffix(".verify.log"))
    tail = Path(res["verify"]["log"]).read_text(errors="replace").splitlines()
    res["verify_summary"] = next((ln for ln in tail if "checks" in ln and str(out) in ln), "?")
    res["files_mb"] = _sizes(out) if out.is_dir() else {}
    (results / "external_data.json").write_text(json.dumps(res, indent=2) + "\n")
    (results / "external_data.md").write_text(_md(res))
    print(_md(res))
    return max(res["main_job"]["rc"], res["verify"]["rc"])


if __name__ == "__main__":
    sys.exit(main())
