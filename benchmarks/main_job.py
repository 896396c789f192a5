"""The main job's wall time, stage by stage, as a user runs it: ``elastic-export --budgets 0.1..0.6``.

Each run is a fresh process (the CLI's own imports counted), timed from its start to its exit; inside
it, every stage entry point of :mod:`elastic_export.pipeline` is wrapped in a timer, so the table says
where the time goes (imports, load, ranking, export, slicing, checks, elastic graph, quick eval,
report, the rest). The ranking's quality is :mod:`benchmarks.ranking_quality`'s business; this one
only times.

Usage:
    python benchmarks/main_job.py [--model DIR --name NAME] [--runs 1] [--out DIR] [--profile] [-- EXTRA CLI ARGS]

Writes benchmarks/results/main_job_NAME.{json,md} (default NAME: minilm) and prints the table.
``--profile``: one more run under cProfile (not timed: the profiler's own cost), whose functions by
cumulative time go to main_job_NAME_profile.md (where inside the stages the time goes). All-mpnet-base-v2:
``python benchmarks/mpnet.py fetch`` prints its directory; ``--model`` that directory ``--name mpnet``.
Quote it with the machine line, measured on a quiet machine (nothing else running).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
PROFILE_ENV = "ELASTIC_EXPORT_MAIN_JOB_PROFILE"  # the child's cProfile dump, when set
PROFILE_ROWS = 40
BUDGETS = "0.1..0.6"
# (label, module, attribute): the pipeline's stage entry points, as the pipeline module names them
STAGES = [
    ("load", "elastic_export.pipeline", "_load"),
    ("ranking", "elastic_export.pipeline", "rank_or_reuse"),
    ("plans", "elastic_export.pipeline", "make_plans"),
    ("dense export", "elastic_export.export.stage", "export_ranked"),
    ("slicing", "elastic_export.export.stage", "slice_budgets"),
    ("torch references", "elastic_export.precision.stage", "reference_outputs"),
    ("checks", "elastic_export.precision.stage", "check_budgets"),
    ("elastic graph", "elastic_export.pipeline", "write_elastic"),
    ("manifest", "elastic_export.report.stage", "build_manifest"),
    ("quick eval", "elastic_export.report.stage", "quick_eval_or_warn"),
    ("report", "elastic_export.report.stage", "write_report_or_warn"),
]


def _child(args: list[str], record: Path) -> int:
    """In the timed process: import the CLI, wrap the stages in timers, run it, write the timings."""
    t0 = time.perf_counter()
    import importlib

    from elastic_export.cli.main import main as cli_main

    modules = {module: importlib.import_module(module) for _, module, _ in STAGES}  # what the job imports first
    times: dict[str, float] = {"imports": time.perf_counter() - t0}

    def timed(label: str, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                times[label] = times.get(label, 0.0) + time.perf_counter() - t
        return wrapper

    for label, module, attr in STAGES:
        setattr(modules[module], attr, timed(label, getattr(modules[module], attr)))
    profiler = None
    if os.environ.get(PROFILE_ENV):
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    try:
        cli_main(args)
        rc = 0
    except SystemExit as e:
        rc = int(e.code or 0)
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(os.environ[PROFILE_ENV])
    times["total in process"] = time.perf_counter() - t0
    record.write_text(json.dumps({"stages": times, "rc": rc}))
    return rc


def _run_once(model: str | None, out: Path, extra: list[str], profile: Path | None = None) -> dict:
    """One main job in a fresh process: its wall time from start to exit, and its stage timings
    (``profile``: the process runs under cProfile and writes its statistics there)."""
    args = ["--budgets", BUDGETS, "--out", str(out), "--overwrite", *(["--model", model] if model else []), *extra]
    env = {k: v for k, v in os.environ.items() if k != PROFILE_ENV}  # a timed run never runs under the profiler
    if profile:
        env[PROFILE_ENV] = str(profile)
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "stages.json"
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, __file__, "--child", str(record), "--", *args],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        wall = time.perf_counter() - t0
        if p.returncode != 0 or not record.is_file():
            sys.stderr.write(p.stdout[-3000:])
            raise SystemExit(f"the main job failed (exit {p.returncode})")
        child = json.loads(record.read_text())
    stages = child["stages"]
    named = sum(v for k, v in stages.items() if k != "total in process")
    stages["the rest (interpreter start-up, calibration text, temp dir, moves)"] = max(0.0, wall - named)
    peak_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB on Linux: the largest child so far
    return {"wall_s": wall, "peak_rss_gb": round(peak_gb, 2), "stages": stages,
            "command": "elastic-export " + " ".join(args)}


def _table(runs: list[dict]) -> list[str]:
    labels = list(runs[0]["stages"])
    lines = ["| stage | " + " | ".join(f"run {i + 1} (s)" for i in range(len(runs))) + " |",
             "|---|" + "---|" * len(runs)]
    for label in labels:
        if label == "total in process":
            continue
        lines.append(f"| {label} | " + " | ".join(f"{r['stages'].get(label, 0.0):.1f}" for r in runs) + " |")
    lines.append("| **wall, start to exit** | " + " | ".join(f"**{r['wall_s']:.1f}**" for r in runs) + " |")
    lines.append("| peak RSS (GB) | " + " | ".join(f"{r['peak_rss_gb']:.2f}" for r in runs) + " |")
    return lines


def profile_table(stats_path: Path, top: int = PROFILE_ROWS) -> list[str]:
    """The functions of a cProfile dump that took the most cumulative time (at least 1 % of the run's),
    as a markdown table: where inside the stages the time goes. A chain of wrappers (each with the
    same cumulative time as the one listed before it, within 0.5 % of the run, and no time of its own)
    shows as its first link."""
    import pstats

    st = pstats.Stats(str(stats_path))
    total = max(v[3] for v in st.stats.values())  # the outermost call's cumulative time
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][3])
    lines = ["| function | calls | cumulative s | share | own s |", "|---|---|---|---|---|"]
    last = None
    for (path, line, name), (_, calls, own, cum, _) in rows:
        if len(lines) - 2 >= top or cum < 0.01 * total:
            break
        if last is not None and last - cum < 0.005 * total and own < 0.005 * total:
            continue
        last = cum
        where = path.split("site-packages/")[-1].split("/main/")[-1] if path != "~" else "(builtin)"
        lines.append(f"| `{name}` ({where}:{line}) | {calls} | {cum:.1f} | {cum / total:.0%} | {own:.1f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help="model directory or id (default: the embedded all-MiniLM-L6-v2)")
    ap.add_argument("--name", default="minilm")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--out", default=None, help="artifact directory (default: a temporary one)")
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--profile", action="store_true", help="one more run under cProfile: main_job_NAME_profile.md")
    a = ap.parse_args(argv)
    if a.child:
        return _child(extra, Path(a.child))
    from elastic_export.measure.timing import machine

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(a.out) if a.out else Path(tmp) / "elastic-out"
        runs = [_run_once(a.model, out, extra) for _ in range(a.runs)]
    res = {"model": a.model or "all-MiniLM-L6-v2 (embedded default)", "command": runs[0]["command"],
           "runs": runs, "best_wall_s": min(r["wall_s"] for r in runs), "machine": machine(),
           "date": time.strftime("%Y-%m-%d")}
    results = Path(a.results)
    results.mkdir(parents=True, exist_ok=True)
    (results / f"main_job_{a.name}.json").write_text(json.dumps(res, indent=2) + "\n")
    m = res["machine"]
    features = " ".join(m.get("cpu_features", [])) or "no AVX2"
    md = [f"# Main job: {res['model']}", "", f"`{res['command']}` (a fresh process each run, timed start to exit)",
          "", f"Machine: {m['cpu']} ({features}), {m['logical_cpus']} logical CPUs, load average before {m['load_average']}, "
          f"onnxruntime {m['onnxruntime']}, {res['date']}.", "", *_table(runs), ""]
    (results / f"main_job_{a.name}.md").write_text("\n".join(md))
    print("\n".join(md))
    if a.profile:
        with tempfile.TemporaryDirectory() as tmp:
            run = _run_once(a.model, Path(tmp) / "elastic-out", extra, Path(tmp) / "main.prof")
            md = [f"# Main job under cProfile: {res['model']}", "", f"`{res['command']}`; {m['cpu']}, "
                  f"{m['logical_cpus']} logical CPUs, {res['date']}; {run['wall_s']:.1f} s under the profiler "
                  "(its own cost included). Functions by cumulative time, at least 1 % of the run:", "",
                  *profile_table(Path(tmp) / "main.prof"), ""]
        (results / f"main_job_{a.name}_profile.md").write_text("\n".join(md))
        print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
