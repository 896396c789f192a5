"""``benchmarks/replicas.py``'s pure parts, without a server: how a request's outcome is counted (answered, 503,
refused at connect once the listener closed, lost), the requests in flight at a signal, a window's latency."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def bench():
    path = Path(__file__).parents[1] / "benchmarks" / "replicas.py"
    spec = importlib.util.spec_from_file_location("replicas_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rec(t: float, end: float, outcome: str) -> dict:
    return {"t": t, "end": end, "ms": (end - t) * 1e3, "outcome": outcome}


RECS = [rec(0.1, 0.3, "200"), rec(0.9, 1.2, "200"), rec(0.95, 1.1, "503 draining"), rec(0.5, 30.5, "ReadTimeout"),
        rec(0.8, 0.8, "ConnectError"), rec(1.5, 1.5, "ConnectError"), rec(2.0, 2.1, "502")]


def test_counts_split_answered_503_closed_and_lost(bench):
    assert bench.counts(RECS, closed_at=1.0) == {"offered": 7, "answered": 2, "503": 1, "closed": 1, "lost": 3}
    assert bench.counts(RECS)["closed"] == 0  # without a closed listener a refused connection is lost
    assert bench.kind("503 html", 5.0, None) == "503"


def test_in_flight_at_the_signal(bench):
    f = bench.in_flight(RECS, 1.0)
    assert f["n"] == 3 and f["outcomes"] == {"200": 1, "503 draining": 1, "ReadTimeout": 1}
    assert not f["all_answered"] and f["lost"] == 1
    assert bench.in_flight(RECS[:2], 1.0) == {"n": 1, "outcomes": {"200": 1}, "all_answered": True, "lost": 0}


def test_window_latency_and_an_empty_window(bench):
    w = bench.window(RECS, 0.9, 1.0)
    assert w["n"] == 3 and w["not_200"] == 2 and w["max_ms"] == pytest.approx(300.0)
    assert bench.window(RECS, 10.0, 5.0) == {"n": 0, "p50_ms": None, "p99_ms": None, "max_ms": None, "not_200": 0}
