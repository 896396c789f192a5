"""The one results schema: every measurement (``eval``, the main job's quick eval, ``bench``) as records.

A results file (``DIR/eval.json``, ``DIR/bench.json``, the manifest's ``quick_eval`` entry)::

    {"format": "elastic-export-results/1", "kind": "eval" | "quick_eval" | "bench",
     "settings": {...}, "machine": {"cpu", "logical_cpus", "onnxruntime", ...}, "datasets": {...},
     "samples": {label: {metric: n}}, "meta": {...},
     "records": [{"dir", "label", "method", "model", "modality", "sparsity", "precision", "batch",
                  "gflops", "achieved_sparsity", <figures>, "ci95": {metric: [low, high]}}, ...]}

One record per model x budget x precision x batch. A **quality** record has ``batch`` None (the
batch size does not change a quality figure): ``fidelity_cosine``, ``recall@10``, ``knn@1``,
``neighbour_overlap@10``, ... with their bootstrap bands under ``ci95``. A **speed** record has a
batch size: ``p50_ms``, ``p90_ms``, ``p99_ms``, ``throughput`` (inputs / s at the p50), and from
``bench`` also ``speedup`` and the switch cost. ``meta`` holds what else the writer states
(``bench``: backend, provider, the runtime, what the speedup is over).

:func:`load` / :func:`parse` read this format and every older one (``eval`` results with
``results[].budgets``, ``elastic-export-bench/1`` files with ``rows``, and quick-eval entries whose
rows nest their speed per batch), so old files still load. :meth:`Results.eval_view` and
:meth:`Results.bench_view` give the per-curve and per-row forms the report and the plots draw.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_export.core.errors import UserError

FORMAT = "elastic-export-results/1"
KINDS = ("eval", "quick_eval", "bench")
BENCH_FORMAT = "elastic-export-bench/1"  # bench files written before the one schema (still read)
CI_KEY = "ci95"  # a record's {metric: [low, high]}: the bootstrap band of every quality figure
SAMPLES_KEY = "samples"  # {label: {metric: how many queries / inputs each figure averages}}
IDENTITY = ("dir", "label", "method", "model", "modality")  # which artifacts a record measures
BATCH = "batch"  # None on quality records


@dataclass
class Results:
    """Records of one measurement run, with its settings and machine."""

    kind: str
    records: list[dict] = field(default_factory=list)
    settings: dict = field(default_factory=dict)
    machine: dict = field(default_factory=dict)
    datasets: dict = field(default_factory=dict)
    samples: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    def quality(self) -> list[dict]:
        """The quality records (batch None)."""
        return [r for r in self.records if r.get(BATCH) is None]

    def speed(self) -> list[dict]:
        """The speed records (one per batch size)."""
        return [r for r in self.records if r.get(BATCH) is not None]

    def to_json(self) -> dict:
        return {"format": FORMAT, "kind": self.kind, "settings": self.settings, "machine": self.machine,
                "datasets": self.datasets, SAMPLES_KEY: self.samples, "meta": self.meta, "records": self.records}

    def eval_view(self) -> dict:
        """The quality records as curves: ``{"datasets", "settings", "results": [{"dir", "label",
        "method", "model", "samples", "budgets": [row, ...]}]}``, one curve per (dir, label)."""
        curves: dict[tuple, dict] = {}
        for r in self.quality():
            ident = tuple(r.get(k) for k in IDENTITY)
            curve = curves.setdefault(ident, {**dict(zip(IDENTITY, ident)),
                                              SAMPLES_KEY: self.samples.get(str(r.get("label")), {}), "budgets": []})
            curve["budgets"].append({k: v for k, v in r.items() if k not in IDENTITY and k != BATCH})
        return {"datasets": self.datasets, "settings": self.settings, "results": list(curves.values())}

    def bench_view(self) -> dict:
        """The speed records as rows: ``{"format", "backend", "provider", "runtime", "machine",
        "settings", "rows": [row, ...]}`` (the ``meta`` fields at the top level)."""
        rows = [{k: v for k, v in r.items() if k not in IDENTITY} for r in self.speed()]
        settings = {**self.settings, **_dict(self.settings.get("speed"))}  # the quick eval nests its speed settings
        return {"format": BENCH_FORMAT, **self.meta, "settings": settings, "machine": self.machine, "rows": rows}


def _dict(raw: Any) -> dict:
    return raw if isinstance(raw, dict) else {}


def from_eval(data: dict) -> Results:
    """``elastic-export eval`` results (``{"datasets", "settings", "results": [{..., "budgets"}]}``)."""
    records, samples = [], {}
    for res in data.get("results") or []:
        if not isinstance(res, dict):
            continue
        ident = {k: res.get(k) for k in IDENTITY}
        samples[str(res.get("label"))] = _dict(res.get(SAMPLES_KEY))
        records += [{**ident, **b, BATCH: None} for b in res.get("budgets") or [] if isinstance(b, dict)]
    return Results("eval", records, _dict(data.get("settings")), _dict(data.get("machine")), _dict(data.get("datasets")),
                   samples)


def from_bench(data: dict) -> Results:
    """An ``elastic-export bench`` result (``{"format": "elastic-export-bench/1", ..., "rows"}``)."""
    meta = {k: v for k, v in data.items() if k not in ("format", "settings", "machine", "rows")}
    ident = {"dir": data.get("dir"), "label": None, "method": None, "model": data.get("model"), "modality": None}
    records = [{**ident, **r} for r in data.get("rows") or [] if isinstance(r, dict)]
    return Results("bench", records, _dict(data.get("settings")), _dict(data.get("machine")), meta=meta)


def from_quick_eval(entry: dict, directory: str = ".", method: str | None = None, model: str | None = None) -> Results:
    """Quick-eval rows (one per pair, nesting ``speed`` per batch size; how the main job measures them,
    and how its manifest entry looked before the one schema) as records."""
    ident = {"dir": directory, "label": "quick eval", "method": method, "model": model, "modality": None}
    records, speed = [], []
    for r in entry.get("rows") or []:
        if not isinstance(r, dict):
            continue
        base = {k: v for k, v in r.items() if k != "speed"}
        records.append({**ident, **base, BATCH: None})
        pair = {k: r.get(k) for k in ("sparsity", "precision", "gflops")}
        speed += [{**ident, **pair, BATCH: int(b), **st} for b, st in _dict(r.get("speed")).items()]
    held = _dict(entry.get("heldout"))
    sp = _dict(entry.get("speed"))
    settings = {"heldout": held, "metric": entry.get("metric"), "bootstrap": entry.get("bootstrap"),
                "speed": {k: v for k, v in sp.items() if k != "machine"}, "seconds": entry.get("seconds")}
    samples = {"quick eval": _dict(entry.get(SAMPLES_KEY))}
    datasets = {"held-out": {"source": held.get("source"), "count": held.get("samples")}}
    meta = {"backend": "onnxruntime", "provider": sp.get("provider"), "runtime": "the main job's quick eval"}
    return Results("quick_eval", records + _speedups(speed), settings, _dict(sp.get("machine")), datasets, samples, meta)


def _speedups(speed: list[dict]) -> list[dict]:
    """Speed records with ``speedup`` (throughput over the dense fp32 model's at the same batch) and
    ``flop_ratio`` (dense GFLOPs over the record's)."""
    dense = {r[BATCH]: r for r in speed if r.get("sparsity") == 0.0 and r.get("precision", "fp32") == "fp32"}
    dense_gflops = next((r.get("gflops") for r in speed if r.get("sparsity") == 0.0 and r.get("gflops")), None)
    out = []
    for r in speed:
        base, tp, gf = dense.get(r[BATCH]), r.get("throughput"), r.get("gflops")
        out.append({**r, "speedup": tp / base["throughput"] if base and tp and base.get("throughput") else None,
                    "flop_ratio": float(dense_gflops) / float(gf) if dense_gflops and gf else None})
    return out


def parse(raw: Any, where: str = "results") -> Results:
    """Results in this schema or any older one.

    Raises:
        UserError: not a results document.
    """
    if isinstance(raw, dict) and raw.get("format") == FORMAT:
        if raw.get("kind") not in KINDS or not isinstance(raw.get("records"), list):
            raise UserError(f"{where}: kind must be one of {', '.join(KINDS)} with a list of records")
        return Results(raw["kind"], [r for r in raw["records"] if isinstance(r, dict)], _dict(raw.get("settings")),
                       _dict(raw.get("machine")), _dict(raw.get("datasets")), _dict(raw.get(SAMPLES_KEY)),
                       _dict(raw.get("meta")))
    if isinstance(raw, dict) and raw.get("format") == BENCH_FORMAT and isinstance(raw.get("rows"), list):
        return from_bench(raw)
    if (isinstance(raw, dict) and isinstance(raw.get("results"), list) and raw["results"]
            and all(isinstance(r, dict) and isinstance(r.get("budgets"), list) for r in raw["results"])):
        return from_eval(raw)
    if isinstance(raw, dict) and isinstance(raw.get("rows"), list) and "heldout" in raw:
        return from_quick_eval(raw)
    raise UserError(f"{where}: not an eval, quick-eval or bench result")


def load(path: str | Path) -> Results:
    """Read a results file (any format :func:`parse` takes).

    Raises:
        UserError: unreadable, not JSON, or not results.
    """
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: cannot read results ({type(e).__name__})") from e
    return parse(raw, str(path))


def save(results: Results, path: str | Path) -> Path:
    """Write ``results`` as JSON atomically."""
    from elastic_export.core.fileio import atomic_write

    text = json.dumps(results.to_json(), indent=2) + "\n"
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text))
