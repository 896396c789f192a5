"""The latency profile (``DIR/latency_profile.json``): measured latency, and optionally quality, per
(sparsity, precision) and batch size; what the runtime's latency-target and load-adaptive policies
read (:mod:`elastic_export.serving.policies`).

File form (``elastic-export bench`` writes it; :func:`elastic_export.measure.timing.measure_profile`
measures one in process)::

    {"backend": "onnxruntime", "provider": "cpu",
     "batches": {"1": {"0.0": {"p50_ms": 4.1, "p90_ms": 4.6, "p99_ms": 5.0}, "0.1": {...}}, "8": {...}},
     "precisions": {"int8": {"1": {"0.0": {...}, ...}, "8": {...}}, "fp16": {...}},
     "quality": {"metric": "fidelity_cosine",
                 "values": {"fp32": {"0.0": 1.0, "0.1": 0.998}, "int8": {"0.0": 0.991, "0.1": 0.990}}},
     "frontier": {"metric": "fidelity_cosine", "stat": "p90_ms", "batches": {"1": [[0.6, "int8"], [0.0, "fp32"]]}}}

* ``batches`` holds the **fp32** rows (batch size -> sparsity -> stats), exactly as every profile
  written before precisions existed, so old profiles load unchanged (precision fp32 implicit) and
  old readers still find the fp32 rows of a new one. It may be empty when only other precisions
  were measured.
* ``precisions`` (optional): the rows of every other precision, in the same form.
* ``quality`` (optional): one figure per (precision, sparsity), higher is better (e.g. embedding
  cosine to the dense fp32 model, or held-out recall@10), with the metric's name. Where a profile
  has none, the policies order the pairs by the default quality order (lower sparsity first,
  then fp32 > fp16 > int8; :func:`elastic_export.serving.policies.quality_order`).
* ``frontier`` (optional): per batch size, the Pareto-optimal pairs over (``stat`` latency,
  quality), fastest first (:mod:`elastic_export.measure.frontier`); for people and tools reading the file,
  the policies compute their own from the rows and quality.

Imports no torch (the runtime runs on numpy, onnx and onnxruntime only).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from elastic_export.core.errors import UserError
from elastic_export.core.manifest import LATENCY_PROFILE
from elastic_export.core.precisions import PRECISIONS

PROFILE = LATENCY_PROFILE  # the file name, defined in elastic_export.core.manifest
STATS = ("p50_ms", "p90_ms", "p99_ms")
PRECISION_ORDER = PRECISIONS  # best first, where no quality figure says otherwise
Pair = tuple[float, str]  # (sparsity, precision)
Rows = dict[int, dict[float, dict[str, float]]]  # batch -> sparsity -> {p50_ms, p90_ms, p99_ms}


def key(s: float) -> float:
    """A sparsity as the runtime and the profile compare it (rounded to 6 decimals)."""
    return round(float(s), 6)


def fmt(values: Iterable[float]) -> str:
    return ", ".join(f"{v:g}" for v in values)


def fmt_pair(pair: Pair) -> str:
    """``0.3`` for fp32 (as before precisions existed), ``0.3 int8`` otherwise."""
    s, p = pair
    return f"{s:g}" if p == "fp32" else f"{s:g} {p}"


@dataclass
class LatencyProfile:
    """Measured latency per batch size and (sparsity, precision), and optional quality figures.

    Args:
        backend: the backend it was measured with.
        provider: the provider (``cpu``, ``cuda``, ``tensorrt``).
        batches: fp32 rows: batch size -> sparsity -> {p50_ms, p90_ms, p99_ms}.
        precisions: the other precisions' rows: precision -> batch size -> sparsity -> stats.
        quality: precision -> sparsity -> quality figure (higher is better); empty: none measured.
        quality_metric: what the quality figures are (e.g. ``fidelity_cosine``, ``recall@10``).
    """

    backend: str
    provider: str
    batches: Rows
    precisions: dict[str, Rows] = field(default_factory=dict)
    quality: dict[str, dict[float, float]] = field(default_factory=dict)
    quality_metric: str | None = None
    frontier: dict = field(default_factory=dict)  # {metric, stat, batches: {batch: [[s, p], ...]}} (measure.frontier)

    def rows(self, precision: str = "fp32") -> Rows:
        """The rows of one precision (empty when it was not measured)."""
        return self.batches if precision == "fp32" else self.precisions.get(precision, {})

    def measured_precisions(self) -> list[str]:
        """Precisions with at least one row, fp32 first."""
        have = ["fp32"] if self.batches else []
        return have + [p for p in self.precisions if p != "fp32" and self.precisions[p]]

    def batch_sizes(self) -> list[int]:
        """Every profiled batch size (any precision), ascending."""
        return sorted({b for p in self.measured_precisions() for b in self.rows(p)})

    def batch_for(self, batch: int) -> int:
        """The profiled batch size used for a request of ``batch`` rows: the smallest profiled one
        that is >= ``batch`` (a conservative estimate), else the largest profiled one."""
        sizes = self.batch_sizes()
        return next((b for b in sizes if b >= batch), sizes[-1])

    def latency(self, batch: int, sparsity: float, stat: str = "p90_ms", precision: str = "fp32") -> float | None:
        """``stat`` in ms at (the profiled batch for) ``batch``, ``sparsity`` and ``precision``;
        None if not measured."""
        row = self.rows(precision).get(self.batch_for(batch), {}).get(key(sparsity))
        return None if row is None else row.get(stat)

    def quality_of(self, sparsity: float, precision: str = "fp32") -> float | None:
        """The quality figure of a pair; None where the profile has none."""
        return self.quality.get(precision, {}).get(key(sparsity))

    def to_json(self) -> dict:
        """The file form (keys as strings)."""
        out: dict[str, Any] = {"backend": self.backend, "provider": self.provider, "batches": _rows_json(self.batches)}
        others = {p: _rows_json(r) for p, r in self.precisions.items() if p != "fp32" and r}
        if others:
            out["precisions"] = others
        if self.quality:
            out["quality"] = {"metric": self.quality_metric,
                              "values": {p: {_skey(s): float(v) for s, v in sorted(q.items())}
                                         for p, q in self.quality.items()}}
        if self.frontier:
            out["frontier"] = self.frontier
        return out


def _skey(s: float) -> str:
    return f"{s:g}" if s else "0.0"


def _rows_json(rows: Rows) -> dict:
    return {str(b): {_skey(s): dict(v) for s, v in sorted(r.items())} for b, r in sorted(rows.items())}


def _parse_rows(raw: Any, where: str) -> Rows:
    """One precision's rows from the file form (raises ValueError / TypeError naming the problem)."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: not an object")
    rows: Rows = {}
    for b, stats_by_s in raw.items():
        if int(b) < 1 or not isinstance(stats_by_s, dict) or not stats_by_s:
            raise ValueError(f"{where}batch {b!r}")
        rows[int(b)] = {}
        for s, stats in stats_by_s.items():
            if not isinstance(stats, dict):
                raise ValueError(f"{where}batch {b}, sparsity {s}")
            vals = {k: float(v) for k, v in stats.items() if k in STATS}
            if not vals:
                raise ValueError(f"{where}batch {b}, sparsity {s}: none of {', '.join(STATS)}")
            rows[int(b)][key(float(s))] = vals
    return rows


def _parse_quality(raw: Any) -> tuple[dict[str, dict[float, float]], str | None]:
    if raw is None:
        return {}, None
    if not isinstance(raw, dict) or not isinstance(raw.get("values"), dict):
        raise ValueError("'quality' needs a 'values' object: precision -> sparsity -> figure")
    values = {}
    for p, q in raw["values"].items():
        if p not in PRECISION_ORDER or not isinstance(q, dict):
            raise ValueError(f"quality of precision {p!r}")
        values[p] = {key(float(s)): float(v) for s, v in q.items()}
    metric = raw.get("metric")
    return values, None if metric is None else str(metric)


def load_profile(path: str | Path) -> LatencyProfile:
    """Read a latency profile (the current form or one written before precisions existed).

    Args:
        path: the JSON file, or an artifact directory (reads ``DIR/latency_profile.json``).

    Raises:
        UserError: missing, unreadable or malformed (one line, naming the problem).
    """
    path = Path(path)
    if path.is_dir():
        path = path / PROFILE
    if not path.is_file():
        raise UserError(f"{path}: no latency profile; measure one first (elastic-export bench, or "
                        f"elastic_export.measure.timing.measure_profile)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: unreadable latency profile ({e})")
    if not isinstance(raw, dict) or not isinstance(raw.get("batches"), dict) \
            or not isinstance(raw.get("precisions", {}), dict) or not (raw["batches"] or raw.get("precisions")):
        raise UserError(f"{path}: a latency profile needs a non-empty 'batches' (or 'precisions') object")
    try:
        batches = _parse_rows(raw["batches"], "")
        others = {}
        for p, rows in raw.get("precisions", {}).items():
            if p not in PRECISION_ORDER or p == "fp32":
                raise ValueError(f"precision {p!r} (fp32 rows go in 'batches'; others: "
                                 f"{', '.join(PRECISION_ORDER[1:])})")
            others[p] = _parse_rows(rows, f"precision {p}, ")
        quality, metric = _parse_quality(raw.get("quality"))
    except (TypeError, ValueError) as e:
        raise UserError(f"{path}: malformed latency profile ({e})")
    frontier = raw.get("frontier") if isinstance(raw.get("frontier"), dict) else {}
    return LatencyProfile(str(raw.get("backend", "onnxruntime")), str(raw.get("provider", "cpu")), batches,
                          others, quality, metric, frontier)


def save_profile(profile: LatencyProfile | dict, directory: str | Path) -> Path:
    """Write ``DIR/latency_profile.json`` atomically.

    Args:
        profile: a :class:`LatencyProfile` or its file form.
        directory: the artifact directory.
    """
    from elastic_export.core.fileio import atomic_write

    data = profile.to_json() if isinstance(profile, LatencyProfile) else profile
    path = Path(directory) / PROFILE
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(data, indent=2) + "\n"))
    return path


def profile_of(rt: Any, rows: dict[str, Rows], quality: Mapping[Pair, float] | None = None,
               quality_metric: str | None = None) -> LatencyProfile:
    """A profile of ``rt``'s backend and provider from measured rows (precision -> batch -> sparsity
    -> stats) and optional quality figures per pair."""
    q: dict[str, dict[float, float]] = {}
    for (s, p), v in (quality or {}).items():
        q.setdefault(p, {})[key(s)] = float(v)
    rows = dict(rows)
    return LatencyProfile(rt.backend, rt.provider, rows.pop("fp32", {}), rows, q, quality_metric)


def profile_from_results(res: Any, metric: str | None = None) -> LatencyProfile:
    """A profile from results in the one schema (:class:`elastic_export.core.results.Results`): its
    speed records' p50 / p90 / p99 per (precision, batch, sparsity), and, with ``metric``, its quality
    records' figure (default: the results' own ``settings.metric`` when it names one).

    So the runtime's latency policies read any ``bench.json``, or a manifest's quick eval, directly.
    """
    rows: dict[str, Rows] = {}
    for r in res.speed():
        if all(isinstance(r.get(s), (int, float)) for s in STATS):
            stats = {s: float(r[s]) for s in STATS}
            rows.setdefault(str(r.get("precision", "fp32")), {}).setdefault(int(r["batch"]), {})[key(r["sparsity"])] = stats
    metric = metric or (res.settings or {}).get("metric")
    quality: dict[str, dict[float, float]] = {}
    for r in res.quality() if metric else ():
        if isinstance(r.get(metric), (int, float)):
            quality.setdefault(str(r.get("precision", "fp32")), {})[key(r["sparsity"])] = float(r[metric])
    meta = res.meta or {}
    return LatencyProfile(str(meta.get("backend") or "onnxruntime"), str(meta.get("provider") or "cpu"),
                          rows.pop("fp32", {}), rows, quality, metric if quality else None)
