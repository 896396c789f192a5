"""``elastic-export bench DIR``: speed of the dense model and every budget of an artifact directory.

For every budget (dense included), every precision the directory has (``--precision``: all by
default, or a list) and every batch size it measures, through one runtime that holds all
(budget, precision) pairs at once:

* **latency** p50 / p90 / p99 (ms) of ``repeats`` timed runs after ``warmup`` untimed ones, and
  **throughput** (inputs / s = batch / p50);
* **switch cost**: the time to switch the runtime's budget and run the first inference right after
  a run at another budget (the budgets are visited round-robin, so each switch comes from the
  previous budget), against the steady-state p50 of the same budget.

Results go to a JSON file (default ``DIR/bench.json``), PNG plots named after its stem
(``<stem>_throughput.png``, ``<stem>_latency.png``, ``<stem>_speedup.png``), a printed table, and
``DIR/latency_profile.json``, the latency table a runtime selector reads for its latency-target
policy::

    {"backend": "onnxruntime", "provider": "cpu",
     "batches": {"1": {"0.0": {"p50_ms": .., "p90_ms": .., "p99_ms": .., "throughput": ..}, ...}, ...}}

(sparsity keys are ``str(float(sparsity))``; the dense model is ``"0.0"``), with the rows of other
precisions under ``"precisions"``, the ``quality`` block kept from the previous profile or the
manifest's ``quick_eval`` entry, and the quality / latency ``frontier`` per batch
(:mod:`elastic_export.measure.frontier`; full form in :mod:`elastic_export.core.latency_profile`).

The runtime is :class:`elastic_export.serving.runtime.ElasticRuntime` (per-budget mode: dense.onnx and every
budget's file, sessions from ``elastic_export.targets.onnxruntime``; or the manifest's TensorRT
engines), so what is timed is what a server built on it runs.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from elastic_export.core import results
from elastic_export.core.errors import UserError
from elastic_export.core.fileio import atomic_write, check_creatable
from elastic_export.core.latency_profile import PRECISION_ORDER, key
from elastic_export.core.manifest import Manifest
from elastic_export.measure.timing import dense_graph, latency_stats, machine, sample_feeds, time_calls
from elastic_export.serving.backends import DEFAULT_BACKEND, backend_names, get_backend
from elastic_export.targets.onnxruntime import PROVIDERS

FORMAT = "elastic-export-bench/1"
PLOTS = ("throughput", "latency", "speedup")


@dataclass(frozen=True)
class BenchConfig:
    """What to measure and how.

    Args:
        backend: a registered backend (:mod:`elastic_export.serving.backends`): ``onnxruntime`` (the ONNX
            files) or ``tensorrt`` (the manifest's engines).
        provider: onnxruntime execution provider: ``cpu``, ``cuda`` or ``tensorrt``.
        batches: batch sizes.
        seq_len: text: tokens per input (None: the manifest's token count N, the one its GFLOPs use).
        repeats: timed runs per (budget, batch), and timed switches per (budget, batch).
        warmup: untimed runs per (budget, batch) before the timed ones.
        threads: onnxruntime intra-op threads (0: onnxruntime's default).
        precision: ``all`` (every precision the directory was exported with; the default) or a comma
            list of ``fp32``, ``fp16``, ``int8`` (their twins; onnxruntime backend).
    """

    backend: str = DEFAULT_BACKEND
    provider: str = "cpu"
    batches: tuple[int, ...] = (1, 32)
    seq_len: int | None = None
    repeats: int = 20
    warmup: int = 3
    threads: int = 0
    precision: str = "all"

    def precisions(self) -> list[str] | None:
        """The precisions asked for; None: every one the directory has (``all``)."""
        if self.precision == "all":
            return None
        asked = [p.strip() for p in self.precision.split(",") if p.strip()]
        return [p for p in PRECISION_ORDER if p in asked]

    def check(self) -> None:
        """Refuse bad values with a one-line :class:`UserError`."""
        if self.backend not in backend_names():
            raise UserError(f"--backend {self.backend}: choose one of {', '.join(backend_names())}")
        if self.provider not in PROVIDERS:
            raise UserError(f"--provider {self.provider}: choose one of {', '.join(PROVIDERS)}")
        if not self.batches or any(b < 1 for b in self.batches):
            raise UserError(f"--batches: give positive integers, got {','.join(map(str, self.batches))}")
        for name, value, low in (("--repeats", self.repeats, 1), ("--warmup", self.warmup, 0),
                                 ("--threads", self.threads, 0)):
            if value < low:
                raise UserError(f"{name} must be >= {low}, got {value}")
        if self.seq_len is not None and self.seq_len < 1:
            raise UserError(f"--seq-len must be a positive integer, got {self.seq_len}")
        asked = [p.strip() for p in self.precision.split(",")] if self.precision != "all" else []
        bad = [p for p in asked if p not in PRECISION_ORDER]
        if bad or (self.precision != "all" and not any(asked)):
            raise UserError(f"--precision {self.precision}: choose all or a comma list of {', '.join(PRECISION_ORDER)}")
        get_backend(self.backend).check_precisions(asked, self.precision, cli=True)


def parse_batches(text: str) -> tuple[int, ...]:
    """``"1,32"`` -> ``(1, 32)`` (duplicates dropped, order kept).

    Args:
        text: comma-separated positive integers.

    Returns:
        The batch sizes.
    """
    try:
        values = [int(t) for t in str(text).split(",") if t.strip()]
    except ValueError:
        raise UserError(f"--batches {text}: give comma-separated positive integers, e.g. 1,32")
    if not values or any(v < 1 for v in values):
        raise UserError(f"--batches {text}: give comma-separated positive integers, e.g. 1,32")
    return tuple(dict.fromkeys(values))


# --- the runtime --------------------------------------------------------------------------------
def preflight(config: BenchConfig) -> None:
    """Refuse (one line) a backend that cannot run here (e.g. an onnxruntime provider this build
    lacks, or no TensorRT), before anything is loaded or measured.

    Args:
        config: backend and provider.
    """
    config.check()
    get_backend(config.backend).check_available(config, cli=True)


def open_runtime(directory: Path, config: BenchConfig):
    """``ElasticRuntime.from_dir`` for this config: every budget (and the dense model) loaded once.

    Args:
        directory: artifact directory.
        config: backend, provider, threads.

    Returns:
        The :class:`elastic_export.serving.runtime.ElasticRuntime`.
    """
    from elastic_export.serving.runtime import ElasticRuntime

    preflight(config)
    options = get_backend(config.backend).bench_options(directory, config)
    return ElasticRuntime.from_dir(directory, backend=config.backend, **options)


# --- measuring ----------------------------------------------------------------------------------
def _graphs(manifest: Manifest) -> list[dict]:
    """Dense first, then every budget: {sparsity, achieved_sparsity, gflops}."""
    rows = [{"sparsity": 0.0, "achieved_sparsity": 0.0, "gflops": float(manifest.dense.gflops)}]
    rows += [{"sparsity": float(b.sparsity), "gflops": float(b.gflops),
              "achieved_sparsity": float(b.sparsity if b.achieved_sparsity is None else b.achieved_sparsity)}
             for b in manifest.budgets]
    return rows


def _measure_batch(runtime, feeds: dict, graphs: list[dict], batch: int, config: BenchConfig,
                   echo: Callable[[str], None]) -> tuple[dict, dict]:
    """Steady-state stats and switch times (s) of every (sparsity, precision) of ``graphs`` at one batch."""
    steady: dict[tuple[float, str], dict] = {}
    for g in graphs:
        pair = (g["sparsity"], g["precision"])
        echo(f"batch {batch}, sparsity {g['sparsity']:g} {g['precision']} ({g['gflops']:.3f} GFLOPs): steady state")
        runtime.set_budget(*pair)
        steady[pair] = latency_stats(time_calls(lambda: runtime.run(feeds), warmup=config.warmup,
                                                repeats=config.repeats), batch)
    switches: dict[tuple[float, str], list[float]] = {pair: [] for pair in steady}
    echo(f"batch {batch}: switch cost ({config.repeats} rounds over {len(graphs)} budget/precision pairs)")
    if len(graphs) > 1:
        runtime.set_budget(graphs[-1]["sparsity"], graphs[-1]["precision"])
        runtime.run(feeds)
        for _ in range(config.repeats):
            for pair in steady:  # each timed switch comes right after a run at the previous pair
                t = time.perf_counter()
                runtime.set_budget(*pair)
                runtime.run(feeds)
                switches[pair].append(time.perf_counter() - t)
    return steady, switches


def run_bench(directory: str | Path, config: BenchConfig, echo: Callable[[str], None] = lambda s: None) -> dict:
    """Measure every budget (dense included) at every batch size and precision.

    Args:
        directory: artifact directory (with ``manifest.json``).
        config: what to measure.
        echo: progress lines.

    Returns:
        The result: ``{"format", "dir", "model", "backend", "provider", "runtime", "settings", "machine",
        "rows": [{sparsity, precision, achieved_sparsity, gflops, flop_ratio, batch, p50_ms, p90_ms, p99_ms,
        mean_ms, min_ms, max_ms, throughput, speedup, switch_ms, switch_p90_ms, switch_overhead_ms}, ...]}``
        (speedup: throughput over the dense fp32 model's, or the first measured pair's).
    """
    config.check()
    directory = Path(directory)
    if not directory.is_dir():
        raise UserError(f"{directory}: no such directory")
    manifest = Manifest.load(directory)
    have = manifest.precisions or ["fp32"]
    missing = [p for p in config.precisions() or [] if p not in have]
    if missing and get_backend(config.backend).supports_precisions:
        raise UserError(f"--precision {config.precision}: {directory} has no {missing[0]} files (exported with "
                        f"{', '.join(have)}); export with --precision {','.join(have + missing)}")
    echo(f"loading {1 + len(manifest.budgets)} models ({config.backend}, {config.provider})")
    runtime = open_runtime(directory, config)
    dense_gflops = float(manifest.dense.gflops)
    by_s = {key(g["sparsity"]): g for g in _graphs(manifest)}
    graphs = [{**by_s[s], "precision": p} for p in runtime.precisions for s, q in runtime.pairs if q == p and s in by_s]
    base = (graphs[0]["sparsity"], graphs[0]["precision"])  # dense fp32, unless the backend has no dense engine
    text = any(spec.name == "input_ids" for spec in manifest.inputs)
    seq_len = (config.seq_len or manifest.tokens) if text else None
    rows: list[dict] = []
    dense = dense_graph(directory, manifest)
    for batch in config.batches:
        feeds = sample_feeds(directory, manifest, batch, config.seq_len, dense)
        steady, switches = _measure_batch(runtime, feeds, graphs, batch, config, echo)
        base_tp = steady[base]["throughput"]
        for g in graphs:
            st = steady[(g["sparsity"], g["precision"])]
            sw = np.asarray(switches[(g["sparsity"], g["precision"])]) * 1e3
            switch_ms = float(np.median(sw)) if sw.size else None  # None: nothing to switch from
            rows.append({**g, "flop_ratio": dense_gflops / g["gflops"], "batch": batch, **st,
                         "speedup": st["throughput"] / base_tp, "switch_ms": switch_ms,
                         "switch_p90_ms": float(np.percentile(sw, 90)) if sw.size else None,
                         "switch_overhead_ms": None if switch_ms is None else switch_ms - st["p50_ms"]})
    return {"format": FORMAT, "dir": str(directory), "model": manifest.model.source,
            "architecture": manifest.model.architecture, "backend": runtime.backend,
            "provider": runtime.provider, "runtime": f"ElasticRuntime ({runtime.mode})", "speedup_over": base[0],
            "speedup_over_precision": base[1],
            "settings": {**asdict(config), "batches": list(config.batches), "seq_len": seq_len,
                         "precisions": list(runtime.precisions), "gflops_tokens": manifest.tokens},
            "machine": machine(), "rows": rows}


# --- outputs ------------------------------------------------------------------------------------
def latency_profile(result: dict, quality: dict | None = None) -> dict:
    """The latency-target table a runtime selector reads (see the module docstring).

    Args:
        result: :func:`run_bench`'s result.
        quality: the profile's ``quality`` block to keep ({metric, values: {precision: {sparsity:
            figure}}}, e.g. from the main job's quick eval: :func:`stored_quality`); None: none.

    Returns:
        ``{"backend", "provider", "batches": {str(batch): {str(float(sparsity)): {p50_ms, p90_ms, p99_ms,
        throughput}}}}`` with the fp32 rows; the rows of other precisions under ``"precisions":
        {precision: {...}}`` (:mod:`elastic_export.core.latency_profile`); ``quality`` as given, and the
        ``frontier`` per batch (:mod:`elastic_export.measure.frontier`; over p90 and the quality figures, or
        the default quality order without them: ``"metric": null``).
    """
    from elastic_export.measure.frontier import profile_frontier
    from elastic_export.serving.policies import quality_order

    tables: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    rows: dict[str, dict[int, dict[float, dict]]] = {}
    name = result.get("backend")
    one_precision = name in backend_names() and not get_backend(name).supports_precisions  # labelled fp32
    for r in result["rows"]:
        prec = r.get("precision", result.get("settings", {}).get("precision", "fp32"))
        prec = "fp32" if one_precision or prec not in PRECISION_ORDER else prec
        stats = {k: float(r[k]) for k in ("p50_ms", "p90_ms", "p99_ms", "throughput")}
        tables.setdefault(prec, {}).setdefault(str(r["batch"]), {})[str(float(r["sparsity"]))] = stats
        rows.setdefault(prec, {}).setdefault(int(r["batch"]), {})[key(r["sparsity"])] = stats
    out: dict[str, Any] = {"backend": result["backend"], "provider": result["provider"],
                           "batches": tables.pop("fp32", {})}
    if tables:
        out["precisions"] = tables
    pairs = [(s, p) for p, by_b in rows.items() for s in {s for t in by_b.values() for s in t}]
    values = {p: {key(float(s)): float(v) for s, v in q.items()} for p, q in ((quality or {}).get("values") or {}).items()}
    figures = {(s, p): values[p][s] for s, p in pairs if s in values.get(p, {})}
    metric = (quality or {}).get("metric") if figures else None
    if figures:
        out["quality"] = {"metric": metric, "values": {p: {str(s): v for s, v in sorted(q.items())}
                                                       for p, q in values.items()}}
    else:  # the default order (lower sparsity first, then fp32 > fp16 > int8) as ranks
        figures = {pair: -float(i) for i, pair in enumerate(quality_order(pairs))}
    out["frontier"] = profile_frontier(rows, figures, metric)
    return out


def stored_quality(directory: Path, manifest: Manifest) -> dict | None:
    """The quality block to keep in a new latency profile: the one ``DIR/latency_profile.json``
    has, else one made from the manifest's ``quick_eval`` entry (None: neither)."""
    from elastic_export.core.latency_profile import load_profile

    try:
        old = load_profile(directory)
        if old.quality:
            return old.to_json()["quality"]
    except UserError:
        pass
    from elastic_export.measure.quick_eval import entry_of

    qe = entry_of(manifest)
    if qe is None or not qe.get("metric"):
        return None
    values: dict[str, dict[float, float]] = {}
    for r in qe["rows"]:
        if isinstance(r, dict) and isinstance(r.get(qe["metric"]), (int, float)):
            values.setdefault(str(r.get("precision", "fp32")), {})[key(r["sparsity"])] = float(r[qe["metric"]])
    return {"metric": qe["metric"], "values": values} if values else None


def series(rows: list[dict]) -> list[tuple[str, list[dict]]]:
    """Rows grouped into one curve per (batch, precision): ``("batch 8 int8", rows)``, the precision
    named only where the rows have more than one."""
    precs = [p for p in PRECISION_ORDER if any(r.get("precision", "fp32") == p for r in rows)]
    out = []
    for batch in sorted({r["batch"] for r in rows}):
        for p in precs:
            mine = [r for r in rows if r["batch"] == batch and r.get("precision", "fp32") == p]
            if mine:
                out.append((f"batch {batch}" + (f" {p}" if len(precs) > 1 else ""), mine))
    return out


def plot_paths(out: str | Path) -> dict[str, Path]:
    """PNG paths named after the JSON's stem: ``<stem>_throughput.png`` etc."""
    out = Path(out)
    return {k: out.with_name(f"{out.stem}_{k}.png") for k in PLOTS}


def write_plots(result: dict, out: str | Path) -> list[Path]:
    """Throughput vs GFLOPs and latency (p50) vs GFLOPs (one line per batch size), and speedup vs
    FLOP ratio with the y = x line (Agg backend, no display needed).

    Args:
        result: :func:`run_bench`'s result.
        out: the JSON path; the PNGs go next to it (:func:`plot_paths`).

    Returns:
        The PNG paths written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    paths = plot_paths(out)
    title = f"{result.get('model') or result['dir']} ({result['backend']}/{result['provider']})"
    specs = {"throughput": ("GFLOPs per input", "throughput (inputs / s)", "gflops", "throughput"),
             "latency": ("GFLOPs per input", "latency p50 (ms)", "gflops", "p50_ms"),
             "speedup": ("FLOP ratio (dense / budget)", "throughput speedup over dense", "flop_ratio", "speedup")}
    written = []
    for kind, (xlabel, ylabel, xkey, ykey) in specs.items():
        fig = Figure(figsize=(5.6, 4.2), layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        for label, rows in series(result["rows"]):
            pts = sorted((r[xkey], r[ykey]) for r in rows)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3.5, label=label)
        if kind == "speedup":
            top = max([1.0] + [r["flop_ratio"] for r in result["rows"]] + [r["speedup"] for r in result["rows"]])
            ax.plot([1.0, top], [1.0, top], linestyle="--", color="gray", label="y = x")
        elif len({r["batch"] for r in result["rows"]}) > 1:  # batch sizes differ by orders of magnitude in latency
            ax.set_yscale("log")
            plain = FuncFormatter(lambda v, _: f"{v:g}")
            ax.yaxis.set_major_formatter(plain)
            ax.yaxis.set_minor_formatter(plain)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize="small")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
        written.append(atomic_write(paths[kind], lambda tmp: fig.savefig(tmp, format="png", dpi=110)))
    return written


def write_json(path: str | Path, data: dict) -> Path:
    """Write a :func:`run_bench` result in the one results schema (:mod:`elastic_export.core.results`), atomically."""
    return results.save(results.from_bench(data), path)


def format_table(result: dict) -> str:
    """The printed table: one row per (batch, budget, precision)."""
    head = ["batch", "budget", "precision", "GFLOPs", "FLOP ratio", "p50 ms", "p90 ms", "p99 ms", "inputs/s", "speedup",
            "switch ms", "switch - p50"]
    rows = [head]
    for r in result["rows"]:
        rows.append([str(r["batch"]), "dense" if r["sparsity"] == 0.0 else f"{r['sparsity']:.2f}",
                     str(r.get("precision", "fp32")), f"{r['gflops']:.3f}", f"{r['flop_ratio']:.2f}",
                     f"{r['p50_ms']:.2f}", f"{r['p90_ms']:.2f}",
                     f"{r['p99_ms']:.2f}", f"{r['throughput']:.1f}", f"{r['speedup']:.2f}",
                     "-" if r["switch_ms"] is None else f"{r['switch_ms']:.2f}",
                     "-" if r["switch_overhead_ms"] is None else f"{r['switch_overhead_ms']:+.2f}"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows)


@dataclass
class BenchOutputs:
    """Where :func:`bench` wrote things.

    Args:
        json: the results JSON.
        plots: the PNGs.
        profile: ``DIR/latency_profile.json`` (None with ``--no-profile``).
    """

    json: Path
    plots: list[Path] = field(default_factory=list)
    profile: Path | None = None


def bench(directory: str | Path, config: BenchConfig, *, out: str | Path | None = None, plot: bool = True,
          profile: bool = True, echo: Callable[[str], None] = lambda s: None) -> tuple[dict, BenchOutputs]:
    """Measure, then write the JSON, the plots and the latency profile.

    Args:
        directory: artifact directory.
        config: what to measure.
        out: results JSON (default ``DIR/bench.json``).
        plot: write the PNGs next to the JSON.
        profile: write ``DIR/latency_profile.json``.
        echo: progress lines.

    Returns:
        (result, where it was written).
    """
    config.check()
    directory = Path(directory)
    if not directory.is_dir():
        raise UserError(f"{directory}: no such directory")
    out_path = Path(out) if out is not None else directory / "bench.json"
    if out_path.is_dir():
        raise UserError(f"--out {out_path}: is a directory; give a file name, e.g. {out_path / 'bench.json'}")
    check_creatable(out_path, "--out")
    preflight(config)
    result = run_bench(directory, config, echo)
    written = BenchOutputs(json=write_json(out_path, result))
    if plot:
        written.plots = write_plots(result, out_path)
    if profile:
        from elastic_export.serving.runtime import save_profile

        quality = stored_quality(directory, Manifest.load(directory))
        written.profile = save_profile(latency_profile(result, quality), directory)
    return result, written
