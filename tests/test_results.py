"""The one results schema (``elastic_export.core.results``): records, its views, and every older format loading."""

from __future__ import annotations

import json

import pytest

from elastic_export.core import results
from elastic_export.core.errors import UserError

EVAL = {"datasets": {"pairs": {"count": 8}}, "settings": {"batch_size": 4}, "machine": {"cpu": "x"},
        "results": [{"dir": "a", "method": "magnitude", "label": "a", "modality": "text", "model": "m",
                     "samples": {"recall@10": 8},
                     "budgets": [{"sparsity": 0.0, "precision": "fp32", "gflops": 2.0, "recall@10": 1.0,
                                  "ci95": {"recall@10": [1.0, 1.0]}},
                                 {"sparsity": 0.5, "precision": "fp32", "gflops": 1.0, "recall@10": 0.75,
                                  "ci95": {"recall@10": [0.5, 1.0]}}]}]}
BENCH = {"format": "elastic-export-bench/1", "dir": "a", "model": "m", "backend": "onnxruntime", "provider": "cpu",
         "runtime": "ElasticRuntime (per-budget)", "settings": {"repeats": 5}, "machine": {"cpu": "x"},
         "rows": [{"sparsity": s, "precision": "fp32", "gflops": g, "batch": b, "p50_ms": g / 2, "throughput": b * 2 / g}
                  for b in (1, 8) for s, g in ((0.0, 2.0), (0.5, 1.0))]}
QUICK = {"heldout": {"source": "built-in", "samples": 16}, "metric": "fidelity_cosine",
         "samples": {"fidelity_cosine": 16}, "speed": {"provider": "cpu", "batches": [1], "machine": {"cpu": "x"}},
         "rows": [{"sparsity": 0.0, "precision": "fp32", "gflops": 2.0, "fidelity_cosine": 1.0,
                   "speed": {"1": {"p50_ms": 2.0, "throughput": 500.0}}}]}


def test_eval_round_trips_through_the_schema(tmp_path):
    res = results.parse(EVAL)
    assert res.kind == "eval" and len(res.records) == 2 and all(r["batch"] is None for r in res.records)
    ident = {"dir": "a", "label": "a", "method": "magnitude", "model": "m", "modality": "text"}
    assert res.records[1] == {**ident, **EVAL["results"][0]["budgets"][1], "batch": None}
    path = results.save(res, tmp_path / "eval.json")
    raw = json.loads(path.read_text())
    assert raw["format"] == results.FORMAT and raw["kind"] == "eval" and raw["machine"] == {"cpu": "x"}
    view = results.load(path).eval_view()
    assert view["results"][0]["budgets"] == EVAL["results"][0]["budgets"]
    assert view["results"][0]["samples"] == {"recall@10": 8} and view["datasets"] == EVAL["datasets"]


def test_bench_round_trips_through_the_schema(tmp_path):
    res = results.parse(BENCH)
    assert res.kind == "bench" and len(res.speed()) == 4 and not res.quality()
    view = results.load(results.save(res, tmp_path / "bench.json")).bench_view()
    assert view["rows"] == BENCH["rows"] and view["backend"] == "onnxruntime" and view["machine"] == {"cpu": "x"}


def test_old_quick_eval_entry_splits_into_quality_and_speed_records():
    res = results.parse(QUICK)
    assert res.kind == "quick_eval" and res.machine == {"cpu": "x"}
    assert [r["fidelity_cosine"] for r in res.quality()] == [1.0]
    assert [(r["batch"], r["p50_ms"]) for r in res.speed()] == [(1, 2.0)]
    assert res.bench_view()["rows"][0]["throughput"] == 500.0


@pytest.mark.parametrize("junk", [[], {"rows": []}, {"results": []}, {"format": results.FORMAT, "kind": "x", "records": []}])
def test_not_results_is_one_error(junk):
    with pytest.raises(UserError):
        results.parse(junk, "f.json")


def test_unreadable_file_is_one_error(tmp_path):
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(UserError, match="bad.json: cannot read results"):
        results.load(tmp_path / "bad.json")


def test_latency_policies_read_results_directly():
    """A bench result (any format) becomes the profile the runtime's latency-target policy reads."""
    from elastic_export.core.latency_profile import profile_from_results
    from elastic_export.serving.policies import LatencyTargetPolicy

    rows = [{**r, "p90_ms": r["p50_ms"] * 1.1, "p99_ms": r["p50_ms"] * 1.2} for r in BENCH["rows"]]
    prof = profile_from_results(results.parse({**BENCH, "rows": rows}))
    assert prof.batch_sizes() == [1, 8] and prof.latency(8, 0.5, "p50_ms") == pytest.approx(0.5)
    assert prof.quality == {} and prof.backend == "onnxruntime" and prof.provider == "cpu"
    quick = profile_from_results(results.parse(QUICK))  # no p90 / p99 there: no rows, the quality block only
    assert quick.quality == {"fp32": {0.0: 1.0}} and quick.quality_metric == "fidelity_cosine"
    policy = LatencyTargetPolicy(prof, target_ms=0.6)  # only the 0.5 budget's p90 (0.55 ms) meets it
    policy.bind_pairs([(0.0, "fp32"), (0.5, "fp32")], "fp32")
    assert policy.select(1) == (0.5, "fp32") and policy.missed == 0
