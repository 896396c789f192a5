"""``benchmarks/serve_triton.py``'s capacity rounds, on scripted figures (no server): a budget's rounds
that disagree get more rounds, so a slow spell of the shared host does not become a budget's capacity."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import numpy as np
import pytest


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("serve_triton", Path(__file__).parents[1] / "benchmarks" / "serve_triton.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _scripted(bench, monkeypatch, figures: dict) -> list:
    """``capacity`` answering each model's figures in turn; the calls made, in order."""
    calls, left = [], {m: list(v) for m, v in figures.items()}

    async def capacity(client, model, feeds, concurrency, seconds, sparsity=None, warmup_s=0.0):
        calls.append(model if sparsity is None else f"{model}@{sparsity:g}")
        return left[calls[-1]].pop(0)

    monkeypatch.setattr(bench, "capacity", capacity)
    return calls


def test_capacity_rounds_that_agree_are_three(bench, monkeypatch):
    calls = _scripted(bench, monkeypatch, {"dense": [75.0, 76.0, 74.0], "s06": [150.0, 152.0, 149.0]})
    caps, rounds = asyncio.run(bench.capacities(None, {0.0: ("dense", None), 0.6: ("s06", None)}, None, 8, 3.0))
    assert caps == {0.0: 75.0, 0.6: 150.0} and rounds[0.0] == [75.0, 76.0, 74.0]
    assert calls == ["dense", "s06", "s06", "dense", "dense", "s06"]  # interleaved, reversed every other round


def test_capacity_rounds_a_slow_spell_slowed_get_more_rounds(bench, monkeypatch, capsys):
    """Run 55's host: dense 76, 57, 39 in three rounds (median 57, no other round within 15 % of it); two
    more rounds at its speed make a majority around 75, the machine's figure. 0.6's one slow round (95 of
    153-155) is outvoted by the median. At most three more rounds."""
    _scripted(bench, monkeypatch, {"dense": [76.0, 57.0, 39.0, 75.0, 77.0], "s06": [155.0, 153.0, 95.0, 150.0, 152.0]})
    caps, rounds = asyncio.run(bench.capacities(None, {0.0: ("dense", None), 0.6: ("s06", None)}, None, 8, 3.0))
    assert len(rounds[0.0]) == 5 and caps == {0.0: 75.0, 0.6: 152.0}
    assert "disagree" in capsys.readouterr().out
    _scripted(bench, monkeypatch, {"dense": [76.0, 57.0, 39.0, 57.0, 76.0, 39.0], "s06": [150.0] * 6})
    caps, rounds = asyncio.run(bench.capacities(None, {0.0: ("dense", None), 0.6: ("s06", None)}, None, 8, 3.0))
    assert len(rounds[0.0]) == 3 + bench.CAPACITY_EXTRA_ROUNDS  # bounded: it never agrees


def test_each_phase_offers_exactly_its_load_at_seeded_times(bench):
    """A phase's count is its rate x span (not a Poisson draw around it); its times lie inside it, sorted;
    the same seed gives the same times, another seed other times."""
    rates, spans = [22.8, 45.6, 106.4], [20.0, 20.0, 10.0]
    times, phase = bench.phase_times(rates, spans, 0)
    assert [int((phase == i).sum()) for i in range(3)] == [456, 912, 1064]
    starts = np.cumsum([0.0] + spans)
    for i in range(3):
        t = times[phase == i]
        assert starts[i] <= t.min() and t.max() < starts[i + 1] and np.all(np.diff(t) >= 0)
    again, _ = bench.phase_times(rates, spans, 0)
    other, _ = bench.phase_times(rates, spans, 1)
    assert np.array_equal(times, again) and not np.allclose(times, other)
    gaps = np.diff(times[phase == 1])  # Poisson-like: exponential gaps, their spread about their mean
    assert 0.8 < gaps.std() / gaps.mean() < 1.2


def test_capacity_paths_measure_each_budget_direct_and_served_through_the_router(bench, monkeypatch):
    """The oracle's capacities are the router's, naming each budget (what a client of the server gets); the
    budget models' own set the phases' rates. Both in the same interleaved rounds."""
    paths = bench.capacity_paths("router", {0.0: "dense", 0.6: "s06"})
    assert paths == {0.0: ("dense", None), (0.0, "served"): ("router", 0.0),
                     0.6: ("s06", None), (0.6, "served"): ("router", 0.6)}
    calls = _scripted(bench, monkeypatch, {"dense": [80.0] * 3, "router@0": [73.0] * 3, "s06": [160.0] * 3,
                                           "router@0.6": [146.0, 150.0, 148.0]})
    caps, rounds = asyncio.run(bench.capacities(None, paths, None, 8, 3.0))
    assert caps == {0.0: 80.0, (0.0, "served"): 73.0, 0.6: 160.0, (0.6, "served"): 148.0}
    assert calls[:4] == ["dense", "router@0", "s06", "router@0.6"] and calls[4:8] == calls[3::-1]


def test_records_are_written_compact_and_read_back(bench):
    """A results file's per-request records: arrival to 0.1 ms, latency to 0.1 ms, each error message once (the
    requests' messages read back in order), gauges as columns; writing the written form again changes nothing."""
    import json

    slow = "[StatusCode.UNAVAILABLE] overloaded: predicted 258 ms at sparsity 0 exceeds the SLO of 250 ms; retry later"
    rec = {"arrival": [0.00601380212, 1.23456789], "latency_ms": [19.60988, 258.04], "sparsity": [0.0, None],
           "outcome": ["ok", "refused"], "error": [None, slow], "hit": [True, None], "t0": 70596.14,
           "gauges": [{"t": 0.2514069, "arrival_rate": 4.88205}, {"t": 0.5035561, "in_flight": 2.0}],
           "client_stalls": {"loop_late_ms": [[73.67546, 52.2076]], "gc_ms": [[41.48764, 30.90239, 2]]}}
    text = bench.results_json({"runs": {"a": {"records": rec, "p99_ms": 74.76794123}}})
    run = json.loads(text)["runs"]["a"]
    got = run["records"]
    assert run["p99_ms"] == 74.76794  # outside the records: 7 significant digits, as before
    assert got["arrival"] == [0.006, 1.2346] and got["latency_ms"] == [19.6, 258.0] and got["sparsity"] == [0.0, None]
    assert got["errors"] == [None, slow] and got["error_id"] == [0, 1] and "error" not in got
    assert bench.error_messages(got) == rec["error"] == bench.error_messages(rec)
    assert got["hit"] == [1, None] and got["outcome"] == rec["outcome"]
    assert got["gauges"] == {"t": [0.251, 0.504], "arrival_rate": [4.882, None], "in_flight": [None, 2.0]}
    assert got["client_stalls"] == {"loop_late_ms": [[73.675, 52.2]], "gc_ms": [[41.488, 30.9, 2]]}
    assert bench.results_json(json.loads(text)) == text
