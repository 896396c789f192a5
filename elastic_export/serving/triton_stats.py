"""Triton's per-batch statistics (``GET /v2/models/stats``) as the router's service scales read them:
per model and batch size, how many batches ran and how long they took (the time to gather the inputs,
run and hand back the outputs, not the queue), and what ran between two reads.

``serve`` tells the router where the server's HTTP endpoint is through :data:`STATS_URL_ENV` (its
Python stubs inherit the server's environment); without it the router reads no statistics.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

STATS_URL_ENV = "ELASTIC_EXPORT_TRITON_HTTP"  # e.g. http://127.0.0.1:8000
STATS_HEADER_ENV = "ELASTIC_EXPORT_TRITON_HEADER"  # NAME=VALUE: the header a restricted statistics API asks for
PHASES = ("compute_input", "compute_infer", "compute_output")

Totals = Dict[str, Dict[int, Tuple[int, float]]]  # model -> batch size -> (batches, ms in all)


def fetch(url: str, timeout_s: float = 1.0) -> Dict[str, Any]:
    """Every model's statistics from the server at ``url`` (``http://host:port``)."""
    import os

    name, _, value = os.environ.get(STATS_HEADER_ENV, "").partition("=")
    request = urllib.request.Request(f"{url.rstrip('/')}/v2/models/stats", headers={name: value} if value else {})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def batch_totals(stats: Mapping[str, Any], phases: Sequence[str] = PHASES) -> Totals:
    """Per model (every version summed) and batch size: batches run and their total time (ms) in
    ``phases``."""
    out: Totals = {}
    for model in stats.get("model_stats", []):
        per = out.setdefault(str(model.get("name")), {})
        for b in model.get("batch_stats", []) or []:
            n = int(b.get("batch_size", 0))
            count = int((b.get("compute_infer") or {}).get("count", 0))
            ms = sum(int((b.get(k) or {}).get("ns", 0)) for k in phases) / 1e6
            c0, m0 = per.get(n, (0, 0.0))
            per[n] = (c0 + count, m0 + ms)
    return out


def batch_deltas(before: Optional[Totals], after: Totals) -> Dict[str, List[Tuple[int, int, float]]]:
    """What ran between two :func:`batch_totals`: per model, ``(rows, batches, total ms)`` for each batch
    size that ran (a model reloaded in between, its counts reset, counts from zero)."""
    out: Dict[str, List[Tuple[int, int, float]]] = {}
    for model, per in after.items():
        old = (before or {}).get(model, {})
        rows = []
        for n, (count, ms) in sorted(per.items()):
            c0, m0 = old.get(n, (0, 0.0))
            if count < c0:  # reset
                c0, m0 = 0, 0.0
            if count > c0 and ms > m0:
                rows.append((n, count - c0, ms - m0))
        if rows:
            out[model] = rows
    return out
