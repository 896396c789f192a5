"""``elastic-export report DIR``: one self-contained HTML page that shows an artifact directory.

``DIR/report.html`` is a static page (no script, no network: a Content-Security-Policy allows only
inline styles and ``data:`` images; every figure is an inline base64 PNG) with

* the **budget table** from the manifest (sparsity, achieved, GFLOPs, params, files, engines);
* **which pair to deploy**: for quality floors (the fastest pair within 1 % / 5 % of the dense fp32
  quality) and latency targets (the best pair under 50 % / 75 % of the dense fp32 p50), at the
  smallest and largest batch size, read from the frontier below (:func:`elastic_export.measure.frontier.recommend`),
  each pick with its quality band, p50 and speedup;
* **quality vs GFLOPs** of every ``elastic-export eval`` result found in DIR (``*.json`` results
  files, :mod:`elastic_export.core.results`, any of its formats; e.g. ``DIR/eval.json``, which
  ``eval DIR`` writes by default), one curve per
  method with its 95 % bootstrap band and sample count, the dense model marked; metrics under the
  names of :data:`elastic_export.measure.evaluation.METRIC_LABELS` (the quick eval's "neighbour overlap@10
  (vs dense)" is never called recall);
* **where sparsity goes**: the kept fraction of MLP neurons and of attention heads per block at each
  budget, for the directory's ranking and, side by side, for every other ranking file in DIR
  (``*.safetensors``; their plans are made with the same budgets and ``align``);
* **speed vs budget** from ``elastic-export bench`` results in DIR (e.g. ``DIR/bench.json``);
* **quality vs speed**: quality against measured latency p50 (each batch size) and throughput, one
  curve per precision, the Pareto frontier ringed (:mod:`elastic_export.measure.frontier`);
* without eval / bench results in DIR, the quality and speed sections show the manifest's
  ``quick_eval`` entry (the main job measures it by default: :mod:`elastic_export.measure.quick_eval`);
* the rankings' **provenance** (method, calibration data, hyperparameters, time taken) from the
  ranking files' metadata and the manifest.

A section whose data is absent says so in one line. Figures use matplotlib's Agg canvas.
"""

from __future__ import annotations

import base64
import html
import io
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from elastic_export.core import results
from elastic_export.core.errors import UserError
from elastic_export.core.fileio import atomic_write, check_creatable
from elastic_export.core.manifest import LATENCY_PROFILE, MANIFEST, REPORT, Budget, Dense, Manifest, resolve
from elastic_export.core.precisions import PRECISIONS
from elastic_export.measure.evaluation import CI_KEY, EVAL_RESULTS, NEIGHBOUR_OVERLAP, SAMPLES_KEY, metric_label

QUALITY_METRICS = ("fidelity_cosine", NEIGHBOUR_OVERLAP, "recall@1", "recall@10", "sym_recall@1", "sym_recall@10",
                   "knn@1", "knn@10")
_CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"
_STYLE = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px auto;max-width:1200px;
     color:#222;line-height:1.45;padding:0 16px}
h1{font-size:1.5em;margin-bottom:.2em} h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
h3{font-size:1.05em;margin-bottom:.3em}
table{border-collapse:collapse;font-size:.88em;margin:.6em 0}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:right;vertical-align:top}
.n{white-space:nowrap}
th{background:#f4f4f4} td.l,th.l{text-align:left}
code{font-size:.92em;background:#f6f6f6;padding:0 3px;border-radius:3px}
img{max-width:100%;height:auto;display:block;margin:.6em 0}
.absent{color:#777;font-style:italic} .meta{color:#555;font-size:.92em}
nav a{margin-right:1em} dl{display:grid;grid-template-columns:max-content auto;gap:2px 14px;font-size:.9em}
dt{font-weight:600} dd{margin:0}
"""


@dataclass
class ReportRanking:
    """One ranking shown in the report: where it came from and what each budget keeps per block."""

    label: str
    file: str
    meta: dict
    heads: list[list[int]]  # per budget, kept heads per block
    neurons: list[list[int]]
    head_totals: list[int]
    neuron_totals: list[int]
    seconds: float | None = None
    main: bool = False


@dataclass
class Found:
    """Data discovered in an artifact directory, and files that looked relevant but were skipped."""

    evals: list[tuple[Path, dict]] = field(default_factory=list)
    benches: list[tuple[Path, dict]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


# --- discovery ----------------------------------------------------------------------------------
def find_results(directory: Path) -> Found:
    """``elastic-export eval`` and ``bench`` result JSON files directly inside ``directory``.

    Args:
        directory: the artifact directory.

    Returns:
        The eval results, the bench results, and the names of files skipped (unreadable JSON).
    """
    found = Found()
    for path in sorted(directory.glob("*.json")):
        if path.name in (MANIFEST, LATENCY_PROFILE) or not path.is_file():
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            found.skipped.append(f"{path.name} ({type(e).__name__})")
            continue
        try:
            res = results.parse(data, path.name)
        except UserError:  # another JSON file: not a result
            continue
        if res.quality():
            found.evals.append((path, res.eval_view()))
        if res.speed():
            found.benches.append((path, res.bench_view()))
    return found


def add_quick_eval(found: Found, manifest: Manifest, name: str = ".") -> None:
    """Where the directory has no eval (bench) result, show the manifest's quick eval as one
    (``name``: the directory as the page names it)."""
    from elastic_export.measure.quick_eval import results_of

    label, res = Path(f"{MANIFEST} (quick eval)"), results_of(manifest, name)
    if res is not None and not found.evals:
        found.evals.append((label, res.eval_view()))
    if res is not None and not found.benches:
        found.benches.append((label, res.bench_view()))


def _totals(heads: list[np.ndarray], neurons: list[np.ndarray]) -> tuple[list[int], list[int]]:
    return [len(h) for h in heads], [len(n) for n in neurons]


def _plans_for(ranking, manifest: Manifest):
    """Per-budget kept heads / neurons per block for another ranking file, with the manifest's
    budgets and alignment (the inventory is rebuilt from the ranking's metadata)."""
    from elastic_export.models.inventory import Inventory, LayerInventory
    from elastic_export.ranking.plans import make_plans

    units = ranking.meta.get("units")
    if not isinstance(units, list) or len(units) != ranking.num_layers:
        raise ValueError("its metadata has no per-layer unit costs")
    layers = [LayerInventory(index=i, heads=int(u["heads"]), head_dim=0, neurons=int(u["neurons"]), swiglu=False,
                             head_cost=int(u["head_cost"]), neuron_cost=int(u["neuron_cost"]), head_params=0,
                             neuron_params=0, kv_heads=int(u.get("kv_heads", 0)), kv_cost=int(u.get("kv_cost", 0)),
                             kv_index=tuple(int(x) for x in u.get("kv_index", ())))
              for i, u in enumerate(units)]
    inv = Inventory(layers, int(ranking.meta["tokens"]), 0, 0, 0)
    align = manifest.align if isinstance(manifest.align, int) else 1
    plans = make_plans(ranking, inv, [float(s) for s in manifest.sparsities], align=align)
    return [p.heads_per_layer for p in plans], [p.neurons_per_layer for p in plans]


def find_rankings(directory: Path, manifest: Manifest) -> tuple[list[ReportRanking], list[str]]:
    """The directory's ranking (kept counts from the manifest) and every other ranking file in it.

    Args:
        directory: the artifact directory.
        manifest: its manifest.

    Returns:
        (rankings, notes): the manifest's ranking first; a note for each file that was skipped.
    """
    from elastic_export.ranking.file import load_ranking

    out, notes = [], []
    main_path = resolve(directory, manifest.ranking.file)
    main_totals, main_meta = None, {}
    if main_path is not None and main_path.is_file():
        try:
            rk = load_ranking(main_path)
            ht, nt = _totals(rk.heads, rk.neurons)
            main_totals, main_meta = (ht, nt), rk.meta
            out.append(ReportRanking(
                label=str(rk.meta.get("method") or manifest.ranking.method), file=main_path.name,
                meta=rk.meta, heads=[list(b.heads_per_layer) for b in manifest.budgets],
                neurons=[list(b.neurons_per_layer) for b in manifest.budgets], head_totals=ht,
                neuron_totals=nt, seconds=manifest.ranking.seconds, main=True))
        except UserError as e:
            notes.append(f"{main_path.name}: {e}")
    elif main_path is not None:
        notes.append(f"the manifest's ranking file {manifest.ranking.file} is missing")
    for path in sorted(directory.glob("*.safetensors")):
        if main_path is not None and path.resolve() == main_path.resolve():
            continue
        try:
            rk = load_ranking(path)
            ht, nt = _totals(rk.heads, rk.neurons)
            if main_totals is not None and (ht, nt) != main_totals:
                raise ValueError("its unit counts differ from the directory's model")
            for key, what in (("fingerprint", "another model"), ("tokens", "another token count")):
                if main_meta.get(key) is not None and rk.meta.get(key) not in (None, main_meta[key]):
                    raise ValueError(f"it was made for {what}")
            heads, neurons = _plans_for(rk, manifest)
        except (UserError, ValueError, KeyError, TypeError) as e:
            notes.append(f"{path.name}: skipped ({e})")
            continue
        out.append(ReportRanking(label=str(rk.meta.get("method")), file=path.name, meta=rk.meta, heads=heads,
                               neurons=neurons, head_totals=ht, neuron_totals=nt))
    labels = [r.label for r in out]
    for r in out:  # two rankings of one method: tell them apart by file
        if labels.count(r.label) > 1:
            r.label = f"{r.label} ({r.file})"
    return out, notes


# --- figures ------------------------------------------------------------------------------------
def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _png(fig, alt: str) -> str:
    """An ``<img>`` with the figure as a base64 PNG data URI."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def sparsity_figure(rankings: list[ReportRanking], sparsities: list[float]):
    """Heatmaps of the kept fraction (budget x block), neurons on top, heads below, one column per ranking."""
    n_budgets, n_layers = len(sparsities), len(rankings[0].head_totals)
    cols = len(rankings)
    fig = _figure(max(4.6, 0.45 * n_layers + 1.8) * cols + 0.8, 2 * (0.34 * n_budgets + 1.3))
    grid = fig.add_gridspec(2, cols)
    annotate = n_layers <= 16 and n_budgets <= 16
    image = None
    for c, r in enumerate(rankings):
        for row, (kind, kept, totals) in enumerate((("MLP neurons", r.neurons, r.neuron_totals),
                                                    ("attention heads", r.heads, r.head_totals))):
            ax = fig.add_subplot(grid[row, c])
            frac = np.array([[k / t if t else 0.0 for k, t in zip(b, totals)] for b in kept], dtype=np.float64)
            image = ax.imshow(frac, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
            ax.set_title(f"{r.label}: kept {kind}", fontsize="medium")
            ax.set_xticks(range(n_layers))
            ax.set_xticklabels([str(i) for i in range(n_layers)], fontsize="small")
            ax.set_yticks(range(n_budgets))
            ax.set_yticklabels([f"{s:g}" for s in sparsities], fontsize="small")
            ax.set_xlabel("block")
            ax.set_ylabel("sparsity")
            if annotate:
                for (i, j), v in np.ndenumerate(frac):
                    ax.text(j, i, f"{100 * v:.0f}", ha="center", va="center", fontsize=7,
                            color="white" if v < 0.55 else "black")
    fig.colorbar(image, ax=fig.axes, shrink=0.8, label="kept fraction")
    return fig


def _spans_decade(values: list[float]) -> bool:
    positive = [v for v in values if v > 0]
    return bool(positive) and max(positive) / min(positive) > 10


def speed_figure(result: dict):
    """Throughput and latency p50 vs sparsity (one line per batch), speedup vs FLOP ratio with y = x."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    from elastic_export.measure.bench import series

    rows = [r for r in result["rows"] if isinstance(r, dict)]
    fig = _figure(13.0, 3.6)
    specs = (("sparsity (budget)", "throughput (inputs / s)", "sparsity", "throughput"),
             ("sparsity (budget)", "latency p50 (ms)", "sparsity", "p50_ms"),
             ("FLOP ratio (dense / budget)", "speedup over dense", "flop_ratio", "speedup"))
    for i, (xlabel, ylabel, xkey, ykey) in enumerate(specs):
        ax = fig.add_subplot(1, 3, i + 1)
        for label, mine in series(rows):
            pts = sorted((float(r[xkey]), float(r[ykey])) for r in mine if isinstance(r.get(ykey), (int, float)))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3.5, label=label)
        if ykey == "speedup":
            top = max([1.0] + [float(r["flop_ratio"]) for r in rows]
                      + [float(r["speedup"]) for r in rows if isinstance(r.get("speedup"), (int, float))])
            ax.plot([1.0, top], [1.0, top], linestyle="--", color="gray", label="y = x (FLOP ratio)")
        elif _spans_decade([float(r[ykey]) for r in rows]):  # e.g. latency at batch 1 and 32
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    return fig


# --- HTML ---------------------------------------------------------------------------------------
def _e(value: Any) -> str:
    return html.escape(str(value))


def _table(head: list[str], rows: list[list[str]], left: tuple[int, ...] = (0,)) -> str:
    """An HTML table of ready-made (escaped) cells; the columns in ``left`` are left-aligned."""
    th = "".join(f'<th class="l">{_e(h)}</th>' if i in left else f"<th>{_e(h)}</th>" for i, h in enumerate(head))
    body = "".join("<tr>" + "".join(f'<td class="l">{c}</td>' if i in left else f"<td>{c}</td>"
                                    for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def _absent(text: str) -> str:
    return f'<p class="absent">{_e(text)}</p>'


def _num(v: Any, fmt: str) -> str:
    return "-" if not isinstance(v, (int, float)) or isinstance(v, bool) else format(v, fmt)


def _gflops(v: Any) -> str:
    return _num(v, ".3f" if not isinstance(v, (int, float)) or abs(v) >= 0.1 else ".3g")


def _files(entry: Dense | Budget) -> str:
    names = [entry.file(p) for p in PRECISIONS] + [entry.onnx_optimized]
    return " ".join(f"<code>{_e(n)}</code>" for n in names if n) or "-"


def section_budgets(manifest: Manifest) -> str:
    """The budget table (dense first), the elastic graph and the precisions."""
    d = manifest.dense
    head = ["budget", "achieved", "GFLOPs", "params", "max abs err", "files", "engine"]
    rows = [["dense", _num(0.0, ".4f"), _gflops(d.gflops), _num((d.params or 0) / 1e6, ".2f") + "M",
             "-", _files(d), f"<code>{_e(d.engine)}</code>" if d.engine else "-"]]
    for b in manifest.budgets:
        rows.append([_num(b.sparsity, ".2f"), _num(b.achieved_sparsity, ".4f"),
                     _gflops(b.gflops), _num((b.params or 0) / 1e6, ".2f") + "M",
                     _num(b.max_abs_error, ".1e"), _files(b),
                     f"<code>{_e(b.engine)}</code>" if b.engine else "-"])
    out = [_table(head, rows, left=(0, 5, 6))]
    e = manifest.elastic
    if e is not None and e.onnx:
        out.append(f'<p class="meta">Elastic graph: <code>{_e(e.onnx)}</code>, input <code>{_e(e.budget_input)}'
                   f'</code> = index into the budgets above'
                   + (f', {_e(e.dense_index)} = dense' if e.dense_index is not None else "")
                   + f', max abs err {_num(e.max_abs_error, ".1e")}.</p>')
    else:
        out.append(_absent("No elastic graph in this directory."))
    if manifest.tensorrt:
        t = manifest.tensorrt
        out.append(f'<p class="meta">TensorRT {_e(t.get("version"))}, precision {_e(t.get("precision"))}.</p>')
    return "\n".join(out)


def eval_curves(found: Found) -> list[dict]:
    """One curve per eval result of the directory (label, file, method, dir, budgets); a label that two
    results share gets its file name added."""
    curves = [{"label": str(r.get("label") or r.get("method") or r.get("dir")), "file": path.name,
               "method": r.get("method"), "dir": r.get("dir"), "budgets": r["budgets"],
               SAMPLES_KEY: r.get(SAMPLES_KEY) if isinstance(r.get(SAMPLES_KEY), dict) else {}}
              for path, data in found.evals for r in data["results"]]
    labels = [c["label"] for c in curves]
    for c in curves:
        if labels.count(c["label"]) > 1:
            c["label"] = f"{c['label']} ({c['file']})"
    return curves


METRIC_NOTES = {
    NEIGHBOUR_OVERLAP: "the share of the dense model's own 10 nearest held-out neighbours of each text that the "
                       "pair finds (1.0 for dense by construction; not retrieval recall, and it falls much faster "
                       "with the budget)",
    "recall@10": "each query's own document among the 10 best of an index encoded by the dense model",
    "fidelity_cosine": "mean cosine between the pair's embedding and the dense fp32 model's",
}


def _with_band(row: dict, metric: str) -> str:
    """``0.875 [0.853, 0.897]``: the figure and its bootstrap band where the row has one (fidelity
    to 4 decimals, the rest to 3)."""
    v, band = row.get(metric), (row.get(CI_KEY) or {}).get(metric)
    fmt = ".4f" if metric == "fidelity_cosine" else ".3f"
    if isinstance(band, list) and len(band) == 2 and all(isinstance(x, (int, float)) for x in band):
        return (f"<span class=\"n\">{_num(v, fmt)} <span class=\"meta\">[{_num(band[0], fmt)}, "
                f"{_num(band[1], fmt)}]</span></span>")
    return _num(v, fmt)


def _samples_of(curves: list[dict], metric: str) -> str:
    ns = list(dict.fromkeys(str(c[SAMPLES_KEY][metric]) for c in curves if isinstance(c[SAMPLES_KEY].get(metric), int)))
    return f" (n = {' / '.join(ns)})" if ns else ""


def _quality_meta(found: Found, metrics: list[str]) -> str:
    """The caption: sources, data sets, what the metrics mean, how the bands are made."""
    sources = ", ".join(f"<code>{_e(p.name)}</code>" for p, _ in found.evals)
    sets = []
    for _, data in found.evals:
        for name, ds in (data.get("datasets") or {}).items():
            if isinstance(ds, dict):
                sets.append(f"{_e(name)}: {_e(ds.get('source'))}" + (f" ({_e(ds['count'])})" if ds.get("count") else ""))
    notes = "; ".join(f"<b>{_e(metric_label(m))}</b>: {_e(METRIC_NOTES[m])}" for m in metrics if m in METRIC_NOTES)
    return (f'<p class="meta">From {sources}. Data: {"; ".join(sets) or "-"}. {notes}. Bands and bracketed ranges: '
            f"95 % percentile bootstrap over the figure's own queries / inputs (1,000 resamples, seed 0, the same "
            f"resamples for every budget); n = how many each figure averages. The dense fp32 model is starred, its "
            f"value dotted: a budget above that line whose band reaches it is noise, not a gain.</p>")


def section_quality(found: Found) -> str:
    """Quality vs GFLOPs of every eval result in the directory, one curve per method, with bands."""
    from elastic_export.measure.evaluation import by_precision, quality_figure

    if not found.evals:
        return _absent(f"No evaluation results in this directory (run: elastic-export eval DIR; it writes "
                       f"DIR/{EVAL_RESULTS}).")
    curves = eval_curves(found)
    metrics = [m for m in QUALITY_METRICS if any(isinstance(b, dict) and isinstance(b.get(m), (int, float))
                                                 for c in curves for b in c["budgets"])]
    if not metrics:
        return _absent("Evaluation results were found but hold no metric.")
    out = [_png(quality_figure(by_precision(curves), metrics, width=4.2, height=3.4), "quality vs GFLOPs"),
           _quality_meta(found, metrics)]
    head = ["method", "directory", "budget", "precision", "GFLOPs"] + [metric_label(m) + _samples_of(curves, m)
                                                                      for m in metrics]
    rows = []
    for c in curves:
        for b in c["budgets"]:
            if not isinstance(b, dict):
                continue
            s = b.get("sparsity")
            rows.append([_e(c["label"]), _e(c["dir"]), "dense" if s == 0.0 else _num(s, ".2f"),
                         _e(b.get("precision", "fp32")), _gflops(b.get("gflops"))]
                        + [_with_band(b, m) for m in metrics])
    out.append(_table(head, rows, left=(0, 1, 3)))
    return "\n".join(out)


def section_sparsity(manifest: Manifest, rankings: list[ReportRanking], notes: list[str]) -> str:
    """Where sparsity goes: kept fractions per block and budget, rankings side by side."""
    if not manifest.budgets:
        return _absent("No budgets in the manifest.")
    if not rankings:
        return _absent("No readable ranking file, so the per-block unit counts are unknown"
                       + (f" ({'; '.join(notes)})." if notes else "."))
    sparsities = [float(s) for s in manifest.sparsities]
    out = [_png(sparsity_figure(rankings, sparsities), "kept fraction per block and budget")]
    main = rankings[0]
    init = (main.meta.get("hyperparameters") or {}).get("init") if main.main else None
    text = ("Percent of each block's MLP neurons and attention heads kept at each budget (rows). "
            + ("Rankings side by side: " + ", ".join(f"<b>{_e(r.label)}</b> (<code>{_e(r.file)}</code>"
                                                     + (", this directory's" if r.main else "")
                                                     + (", the initial scores of the optimised ranking"
                                                        if init and r.meta.get("method") == init and not r.main
                                                        else "") + ")" for r in rankings) + "."
               if len(rankings) > 1 else
               "Only this directory's ranking is present; put another ranking file (*.safetensors) in the "
               "directory to compare."))
    out.append(f'<p class="meta">{text}</p>')
    if notes:
        out.append(f'<p class="meta">Skipped: {_e("; ".join(notes))}.</p>')
    return "\n".join(out)


def _machine_line(res: dict) -> str:
    """``Machine: CPU, N logical CPUs (load average L), onnxruntime V; R timed runs per point, ...``."""
    m, settings = res.get("machine") or {}, res.get("settings") or {}
    load = m.get("load_average")
    load = f" (load average {load[0]:.1f} when measured)" if isinstance(load, list) and load else ""
    host = (f"Machine: {_e(m.get('cpu'))}, {_e(m.get('logical_cpus'))} logical CPUs{load}, onnxruntime "
            f"{_e(m.get('onnxruntime'))}" if m else "Machine: not recorded (a result written before it was)")
    runs = settings.get("repeats")
    runs = (", ".join(f"{_e(v)} at batch {_e(b)}" for b, v in runs.items()) if isinstance(runs, dict) else _e(runs))
    schedule = settings.get("schedule")
    return (f"{host}; timed runs per point: {runs}" + (f" ({_e(schedule)})" if schedule else "")
            + f", {_e(settings.get('seq_len') or '-')} tokens, threads {_e(settings.get('threads'))}.")


def section_speed(found: Found) -> str:
    """Speed vs budget of every bench result in the directory."""
    if not found.benches:
        return _absent("No speed measurements in this directory (run: elastic-export bench DIR).")
    out = []
    for path, res in found.benches:
        rows = [r for r in res["rows"] if isinstance(r, dict)]
        if not rows:
            out.append(_absent(f"{path.name}: no measurements."))
            continue
        out.append(f"<h3><code>{_e(path.name)}</code>: {_e(res.get('backend'))} / {_e(res.get('provider'))}, "
                   f"{_e(res.get('runtime', ''))}</h3>")
        out.append(_png(speed_figure(res), f"speed vs budget ({path.name})"))
        out.append(f'<p class="meta">{_machine_line(res)} Speedup is throughput over the dense model\'s; the dashed '
                   f'line is the FLOP ratio.</p>')
        head = ["batch", "budget", "precision", "GFLOPs", "FLOP ratio", "p50 ms", "p90 ms", "p99 ms", "inputs/s", "speedup",
                "switch ms"]
        cells = [[_e(r.get("batch")), "dense" if r.get("sparsity") == 0.0 else _num(r.get("sparsity"), ".2f"),
                  _e(r.get("precision", "fp32")), _gflops(r.get("gflops")), _num(r.get("flop_ratio"), ".2f"),
                  _num(r.get("p50_ms"), ".2f"),
                  _num(r.get("p90_ms"), ".2f"), _num(r.get("p99_ms"), ".2f"), _num(r.get("throughput"), ".1f"),
                  _num(r.get("speedup"), ".2f"), _num(r.get("switch_ms"), ".2f")] for r in rows]
        out.append(_table(head, cells, left=(1, 2)))
    return "\n".join(out)


FRONTIER_METRICS = ("recall@10", "knn@10", NEIGHBOUR_OVERLAP, "fidelity_cosine")  # the quality axis: the first present
FRONTIER_STAT = "p50_ms"  # the latency the report's frontier and recommendations are over


@dataclass
class FrontierData:
    """What the frontier and the recommendations read: one quality figure (and band) per (sparsity,
    precision) from the first eval result, the speed rows of the first bench result."""

    metric: str
    quality: dict[tuple[float, str], float]
    bands: dict[tuple[float, str], list]
    samples: int | None
    rows: list[dict]
    sources: str
    quick: bool  # quality from the quick eval (no elastic-export eval result in the directory)


def _pair_of(row: dict) -> tuple[float, str]:
    return round(float(row["sparsity"]), 6), str(row.get("precision", "fp32"))


def frontier_inputs(found: Found) -> FrontierData | None:
    """The frontier's data: the first eval result's and the first bench result's (the quick eval's
    where the directory has none); None without both or without a metric."""
    if not found.evals or not found.benches:
        return None
    (qpath, qdata), (bpath, bdata) = found.evals[0], found.benches[0]
    result = qdata["results"][0]
    budgets = [b for b in result["budgets"] if isinstance(b, dict)]
    metric = next((m for m in FRONTIER_METRICS if any(isinstance(b.get(m), (int, float)) for b in budgets)), None)
    if metric is None:
        return None
    quality = {_pair_of(b): float(b[metric]) for b in budgets if isinstance(b.get(metric), (int, float))}
    bands = {_pair_of(b): (b.get(CI_KEY) or {}).get(metric) for b in budgets if _pair_of(b) in quality}
    rows = [r for r in bdata["rows"] if isinstance(r, dict) and _pair_of(r) in quality]
    samples = (result.get(SAMPLES_KEY) or {}).get(metric)
    return FrontierData(metric, quality, bands, samples if isinstance(samples, int) else None, rows,
                        f"quality from {qpath.name}, speed from {bpath.name}", qpath.name.endswith("(quick eval)"))


def _frontier_axes(ax, pts: list[tuple[float, float, tuple[float, str]]], lower_is_better: bool) -> list:
    """One curve per precision (points by sparsity) and the Pareto frontier over (x, quality) ringed
    and joined; returns the frontier's pairs, cheapest first."""
    from elastic_export.measure.frontier import pareto_frontier

    for prec in dict.fromkeys(p for _, _, (_, p) in sorted(pts, key=lambda t: t[2][1])):
        mine = sorted((pair[0], x, q) for x, q, pair in pts if pair[1] == prec)
        ax.plot([m[1] for m in mine], [m[2] for m in mine], marker="o", markersize=4, label=prec)
    idx = pareto_frontier([(x if lower_is_better else -x, q) for x, q, _ in pts])
    ax.plot([pts[i][0] for i in idx], [pts[i][1] for i in idx], linestyle="--", color="black", marker="o",
            markersize=9, markerfacecolor="none", label="Pareto frontier", zorder=4)
    return [pts[i][2] for i in idx]


def frontier_figure(quality: dict, metric: str, rows: list[dict]):
    """Quality vs latency p50 at each batch size and vs throughput at the largest, one curve per
    precision, the Pareto frontier marked; returns (figure, {batch: frontier pairs by latency})."""
    batches = sorted({int(r["batch"]) for r in rows})
    fig = _figure(4.4 * (len(batches) + 1), 3.6)
    fronts = {}
    for i, batch in enumerate(batches + [batches[-1]]):
        ax = fig.add_subplot(1, len(batches) + 1, i + 1)
        mine = [r for r in rows if int(r["batch"]) == batch]
        stat = FRONTIER_STAT if i < len(batches) else "throughput"
        pts = [(float(r[stat]), quality[_pair_of(r)], (float(r["sparsity"]), str(r.get("precision", "fp32"))))
               for r in mine if isinstance(r.get(stat), (int, float))]
        front = _frontier_axes(ax, pts, lower_is_better=stat == FRONTIER_STAT)
        if stat == FRONTIER_STAT:
            fronts[batch] = front
        ax.set_xlabel(f"latency p50 (ms), batch {batch}" if stat == FRONTIER_STAT
                      else f"throughput (inputs / s), batch {batch}")
        ax.set_ylabel(metric_label(metric))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    return fig, fronts


def _pair_name(pair: tuple[float, str]) -> str:
    return f"{'dense' if pair[0] == 0.0 else f'{pair[0]:g}'} {pair[1]}"


def section_frontier(found: Found) -> str:
    """Quality vs measured latency and throughput per (budget, precision), with the Pareto frontier."""
    data = frontier_inputs(found)
    if data is None:
        return _absent("Needs quality and speed figures (the main job's quick eval, or elastic-export eval and bench).")
    if not data.rows:
        return _absent(f"No (budget, precision) has both a quality and a speed figure ({data.sources}).")
    fig, fronts = frontier_figure(data.quality, data.metric, data.rows)
    out = [_png(fig, "quality vs latency and throughput, Pareto frontier")]
    out.append(f'<p class="meta">Quality: {_e(metric_label(data.metric))}. One curve per precision, points from '
               f'dense to the sparsest budget; ringed and joined: the Pareto frontier (no other pair is both faster '
               f'and better). {_e(data.sources[:1].upper() + data.sources[1:])}.</p>')
    cells = [[_e(b), " → ".join(_e(_pair_name(pair)) for pair in front)] for b, front in fronts.items()]
    out.append(_table(["batch", "frontier, fastest to best"], cells, left=(1,)))
    return "\n".join(out)


def _recommend_rows(data: FrontierData, batch: int) -> list[list[str]]:
    """The recommendation table's rows at one batch size (quality floors, then latency targets)."""
    from elastic_export.measure.frontier import DENSE, recommend

    cost = {_pair_of(r): float(r[FRONTIER_STAT]) for r in data.rows
            if int(r["batch"]) == batch and isinstance(r.get(FRONTIER_STAT), (int, float))}
    if DENSE not in cost or DENSE not in data.quality:
        return []
    rows = []
    for rec in recommend(cost, data.quality):
        if rec.kind == "quality":
            goal = f"fastest pair within {rec.share * 100:g} % of dense quality (≥ {rec.threshold:.4f})"
        else:
            goal = f"best quality under {rec.threshold:.1f} ms ({rec.share * 100:g} % of dense fp32's {cost[DENSE]:.1f} ms)"
        if rec.pair is None:
            fastest = min(cost, key=cost.get)
            rows.append([_e(goal), _e(batch), f"none: the fastest pair, {_e(_pair_name(fastest))}, takes "
                         f"{cost[fastest]:.1f} ms", "-", "-", "-"])
            continue
        pick = {"sparsity": rec.pair[0], CI_KEY: {data.metric: data.bands.get(rec.pair)}, data.metric: data.quality[rec.pair]}
        rows.append([_e(goal), _e(batch), f"<b>{_e(_pair_name(rec.pair))}</b>", _with_band(pick, data.metric),
                     _num(cost[rec.pair], ".1f"), f"{cost[DENSE] / cost[rec.pair]:.2f}×"])
    return rows


def section_recommend(found: Found) -> str:
    """Which (budget, precision) to deploy for a quality floor or a latency target, read from the frontier."""
    data = frontier_inputs(found)
    if data is None or not data.rows:
        return _absent("Needs quality and speed figures (the main job's quick eval, or elastic-export eval and bench).")
    batches = sorted({int(r["batch"]) for r in data.rows})
    rows = [r for b in dict.fromkeys([batches[0], batches[-1]]) for r in _recommend_rows(data, b)]
    if not rows:
        return _absent(f"The dense fp32 model has no quality and speed figure to measure the goals against ({data.sources}).")
    n = f", n = {data.samples}" if data.samples else ""
    out = [f'<p class="meta">Read from the frontier below: quality is <b>{_e(metric_label(data.metric))}</b>'
           f'{_e(n)} with its 95 % bootstrap band; latency is p50 ms; "within 1 %" means at least 99 % of the dense '
           f'fp32 figure. A pick whose band reaches below the floor may miss it on other data. '
           f'{_e(data.sources[:1].upper() + data.sources[1:])}.</p>']
    if data.quick:
        out.append(f'<p class="meta">Quality here is the quick eval\'s proxy on {_e(data.samples or "few")} held-out '
                   f'samples; for task quality run <code>elastic-export eval DIR</code> (it writes '
                   f'<code>DIR/{_e(EVAL_RESULTS)}</code>), then <code>elastic-export report DIR</code> again.</p>')
    out.append(_table(["goal", "batch", "deploy", "quality [95 % band]", "p50 ms", "vs dense fp32"], rows,
                      left=(0, 2)))
    return "\n".join(out)


def _dl(items: list[tuple[str, Any]]) -> str:
    def show(v: Any) -> str:
        if isinstance(v, dict):
            return ", ".join(f"{_e(k)} <code>{_e(json.dumps(x) if isinstance(x, (list, dict)) else x)}</code>"
                             for k, x in sorted(v.items())) or "-"
        return _e("-" if v is None else v)

    return "<dl>" + "".join(f"<dt>{_e(k)}</dt><dd>{show(v)}</dd>" for k, v in items) + "</dl>"


def section_provenance(manifest: Manifest, rankings: list[ReportRanking], notes: list[str]) -> str:
    """Method, calibration data, hyperparameters and time taken of every ranking."""
    if not rankings:
        r = manifest.ranking
        return _absent(f"No readable ranking file (manifest: method {r.method}, file {r.file}).")
    out = []
    for r in rankings:
        calib = r.meta.get("calibration") or {}
        seconds = r.seconds if isinstance(r.seconds, (int, float)) else None
        taken = (f"{seconds:.1f} s" if seconds is not None else
                 "not recorded in the manifest (a ranking reused with --ranking, or an older manifest)" if r.main else
                 "not recorded (the ranking file holds no timings, so its bytes stay deterministic)")
        out.append(f"<h3>{_e(r.label)}: <code>{_e(r.file)}</code>{' (this directory’s ranking)' if r.main else ''}</h3>")
        out.append(_dl([("method", r.meta.get("method")), ("tool", r.meta.get("tool")),
                        ("model fingerprint", r.meta.get("fingerprint")), ("tokens N", r.meta.get("tokens")),
                        ("calibration data", calib),
                        ("hyperparameters", r.meta.get("hyperparameters")), ("time taken", taken)]))
    if notes:
        out.append(f'<p class="meta">Skipped: {_e("; ".join(notes))}.</p>')
    return "\n".join(out)


def _guarded(render: Callable[[], str], what: str) -> str:
    """Render one section; a failure becomes one line in the page rather than no page."""
    try:
        return render()
    except Exception as e:  # noqa: BLE001 - a malformed result file must not cost the whole report
        return _absent(f"The {what} section could not be drawn ({type(e).__name__}: {e}).")


def render_report(directory: str | Path, name: str | None = None) -> str:
    """The report page of an artifact directory as one HTML string.

    Args:
        directory: the artifact directory (with ``manifest.json``).
        name: the directory's name as shown on the page (default: ``directory``).

    Raises:
        UserError: no directory, or a missing or broken manifest.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise UserError(f"{directory}: no such directory")
    manifest = Manifest.load(directory)
    found = find_results(directory)
    add_quick_eval(found, manifest, str(name or directory))
    rankings, notes = find_rankings(directory, manifest)
    model, d = manifest.model, manifest.dense
    title = f"elastic-export report: {model.source}"
    summary = (f"{_e(model.architecture)}, {_e(model.modality or '-')}, N = {_e(manifest.tokens)} "
               f"tokens; dense {_gflops(d.gflops)} GFLOPs ({_gflops(manifest.prunable_gflops)} "
               f"prunable), {_num((d.params or 0) / 1e6, '.2f')}M params; {len(manifest.budgets)} budgets; "
               f"precisions {_e(', '.join(manifest.precisions or ['fp32']))}; align "
               f"{_e(manifest.align or 1)}; ranking {_e(manifest.ranking.method)}; "
               f"{_e(manifest.tool or '')}")
    sections = [
        ("budgets", "Budgets", lambda: section_budgets(manifest)),
        ("recommend", "Which pair to deploy", lambda: section_recommend(found)),
        ("quality", "Quality vs GFLOPs", lambda: section_quality(found)),
        ("sparsity", "Where sparsity goes", lambda: section_sparsity(manifest, rankings, notes)),
        ("speed", "Speed vs budget", lambda: section_speed(found)),
        ("frontier", "Quality vs speed: the frontier", lambda: section_frontier(found)),
        ("provenance", "Ranking provenance", lambda: section_provenance(manifest, rankings, notes)),
    ]
    body = [f"<h1>{_e(title)}</h1>",
            f'<p class="meta">Directory <code>{_e(name or directory)}</code>: {summary}</p>',
            "<nav>" + "".join(f'<a href="#{a}">{_e(t)}</a>' for a, t, _ in sections) + "</nav>"]
    for anchor, heading, render in sections:
        body.append(f'<section id="{anchor}"><h2>{_e(heading)}</h2>\n{_guarded(render, heading)}\n</section>')
    if found.skipped:
        body.append(f'<p class="meta">Unreadable JSON files ignored: {_e(", ".join(found.skipped))}.</p>')
    return ("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n"
            f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">\n'
            '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{_e(title)}</title><style>{_STYLE}</style></head>\n<body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def write_report(directory: str | Path, out: str | Path | None = None, name: str | None = None,
                 echo: Callable[[str], None] = lambda s: None) -> Path:
    """Write the report page (atomically: a temporary file, then a rename).

    Args:
        directory: the artifact directory.
        out: the HTML file (default ``DIR/report.html``).
        name: the directory's name as shown on the page (default: ``directory``).
        echo: progress lines.

    Returns:
        The path written.

    Raises:
        UserError: bad directory or manifest, or an ``out`` that cannot be written.
    """
    t0 = time.time()
    path = Path(out) if out is not None else Path(directory) / REPORT
    if path.is_dir():
        raise UserError(f"--out {path}: is a directory; give a file name, e.g. {path / REPORT}")
    check_creatable(path, "--out")
    page = render_report(directory, name)
    atomic_write(path, lambda tmp: Path(tmp).write_text(page, encoding="utf-8"))
    echo(f"report {path} in {time.time() - t0:.1f}s")
    return path
