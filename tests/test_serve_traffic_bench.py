"""``benchmarks/serve_traffic.py``'s pure parts, without a server: traces built from real text (lengths in the
model's tokens, seeded), the oracle's rule, a step's figures and issue 53's verdicts on scripted steps."""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
import time
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def bench():
    path = Path(__file__).parents[1] / "benchmarks" / "serve_traffic.py"
    spec = importlib.util.spec_from_file_location("serve_traffic", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["serve_traffic"] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def encoder():
    from elastic_export.models.text import TextEncoder, model_folder

    folder = model_folder("all-MiniLM-L6-v2", None)  # the embedded default model's tokenizer
    return TextEncoder.from_dir(folder, ["input_ids", "attention_mask", "token_type_ids"])


@pytest.fixture(scope="module")
def corpus(bench, encoder):
    return bench.build_corpus(encoder)


def _lengths(bench, encoder, texts):
    return [len(e.ids) for e in bench._raw_tokenizer(encoder).encode_batch(texts)]


def test_texts_have_the_lengths_each_trace_promises_in_model_tokens(bench, encoder, corpus):
    """Short queries 5-30 tokens, documents up to the context (and not all one length), 128-token texts exactly
    128: counted by re-encoding each text with the model's tokenizer, specials included."""
    assert len(corpus.queries) > 1000 and len(corpus.documents) > 200 and len(corpus.long) > 200
    q = _lengths(bench, encoder, corpus.queries)
    assert q == corpus.query_tokens and min(q) >= 5 and max(q) <= 30
    d = _lengths(bench, encoder, corpus.documents)
    assert d == corpus.document_tokens and min(d) >= bench.MIN_DOC_TOKENS and max(d) <= encoder.max_len
    assert max(d) > encoder.max_len - 16 and min(d) < encoder.max_len // 2  # realistic: up to the context, varied
    assert set(_lengths(bench, encoder, corpus.long)) == {128}


def test_traces_are_seeded_and_mix_sends_one_document_in_five(bench, corpus):
    for trace in ("short", "mix", "t128"):
        a = bench.trace_requests(corpus, trace, 500, 0)
        assert a == bench.trace_requests(corpus, trace, 500, 0) and a != bench.trace_requests(corpus, trace, 500, 1)
    short = bench.trace_requests(corpus, "short", 500, 0)
    assert {k for _, k, _ in short} == {"query"} and all(5 <= n <= 30 for _, _, n in short)
    assert all(k == "query" and n == 128 for _, k, n in bench.trace_requests(corpus, "t128", 200, 0))
    mix = bench.trace_requests(corpus, "mix", 2000, 0)
    docs = [n for _, k, n in mix if k == "document"]
    assert 0.17 < len(docs) / len(mix) < 0.23 and all(n >= bench.MIN_DOC_TOKENS for n in docs)
    assert all(5 <= n <= 30 for _, k, n in mix if k == "query")
    idx = bench.index_requests(corpus, 3, 0)
    assert [len(b) for b in idx] == [64] * 3 and idx == bench.index_requests(corpus, 3, 0)
    assert set(idx[0]) <= set(corpus.documents) and idx != bench.index_requests(corpus, 3, 1)


def test_ideal_batches_hold_texts_of_about_one_length(bench):
    lengths = [30, 5, 17, 5, 29, 12, 8, 30, 6]
    batches = bench.ideal_batches(lengths, size=4)
    assert [len(b) for b in batches] == [4, 4, 1] and sorted(sum(batches, [])) == list(range(9))
    flat = [lengths[i] for b in batches for i in b]
    assert flat == sorted(lengths)


def test_the_oracle_is_the_densest_budget_whose_compute_and_cpu_fit_in_80_percent(bench):
    """rate x (1/ref(s) + 2 ms / cores) <= 0.8; the sparsest when none fits."""
    ref = {0.0: 100.0, 0.3: 150.0, 0.6: 250.0}
    # 2 cores: 1 ms of CPU per request. dense at 72/s: 72 x (0.01 + 0.001) = 0.792 fits; at 73/s 0.803 does not
    assert bench.oracle_budget(72.0, ref, 2) == 0.0
    assert bench.oracle_budget(73.0, ref, 2) == 0.3
    assert bench.oracle_budget(107.0, ref, 2) == 0.6  # 107 x (1/150 + 0.001) = 0.820
    assert bench.oracle_budget(400.0, ref, 2) == 0.6  # nothing fits: the sparsest
    assert bench.oracle_budget(72.0, ref, 1) == 0.3  # one core: 72 x 0.012 = 0.864


def _rec(kind="query", outcome="ok", ms=10.0, sparsity=0.0):
    return {"type": kind, "outcome": outcome, "ms": ms, "sparsity": sparsity if outcome == "ok" else None}


def test_a_step_counts_refusals_as_misses_and_quality_over_answered_queries(bench):
    quality = {0.0: 0.70, 0.6: 0.60}
    recs = ([_rec(ms=20.0)] * 6 + [_rec(ms=300.0, sparsity=0.6)] * 2 + [_rec(outcome="refused", ms=3.0)]
            + [_rec(outcome="lost", ms=30000.0)])
    s = bench.summarise(recs, 250.0, quality, 0.0)
    assert (s["offered"], s["answered"], s["refused"], s["lost"]) == (10, 8, 1, 1)
    assert s["slo_attainment"] == pytest.approx(0.6) and s["refusal_p99_ms"] == pytest.approx(3.0)
    assert s["dense_share"] == pytest.approx(0.75) and s["mean_sparsity"] == pytest.approx(0.15)
    assert s["served_quality"] == pytest.approx(0.675) and s["quality_vs_oracle"] == pytest.approx(-0.025)
    mixed = bench.summarise([_rec()] * 4 + [_rec("document", ms=400.0)], 250.0, quality, 0.0)
    assert mixed["documents"]["all_dense"] and mixed["documents"]["slo_attainment"] == 0.0
    assert mixed["slo_attainment"] == pytest.approx(0.8) and mixed["query_slo_attainment"] == 1.0


def _step(m, slo=1.0, p99=100.0, refusal=None, q=0.70, oracle_q=0.70, dense=1.0):
    return {"multiple": m, "slo_attainment": slo, "p99_ms": p99, "refusal_p99_ms": refusal, "served_quality": q,
            "oracle_quality": oracle_q, "dense_share": dense, "refused": 0}


def test_verdicts_as_issue_53_states_them(bench):
    good = [_step(0.25), _step(0.5), _step(1.0, q=0.696, dense=0.2), _step(1.25, slo=0.995, dense=0.0),
            _step(2.0, slo=0.6, refusal=12.0, p99=240.0, q=0.5, oracle_q=0.6)]
    assert all(bench.verdict("short", good, 250.0).values())
    v = bench.verdict("mix", good, 250.0)  # mix promises 99 % only up to 1x: 1.25x is judged as past it
    assert all(v.values())
    bad = {"short: >= 99 % within the SLO up to 1.25x": [_step(1.25, slo=0.98)],
           "short: past 1.25x refusals' p99 < 50 ms": [_step(1.5, refusal=60.0)],
           "short: past 1.25x answered p99 <= SLO": [_step(1.5, p99=300.0)],
           "short: quality within 0.005 of the oracle up to 1x": [_step(0.75, q=0.69)],
           "short: >= 90 % dense at <= 0.5x": [_step(0.5, dense=0.85)]}
    for key, steps in bad.items():
        v = bench.verdict("short", good + steps, 250.0)
        assert v[key] is False and sum(x is False for x in v.values()) == 1, key
    assert bench.verdict("short", [_step(2.0, refusal=10.0)], 250.0)["short: >= 90 % dense at <= 0.5x"] is None
    idx = {**_step(0.25, slo=0.995), "index": {"refused": 0, "fraction_of_reference": 0.4, "all_dense": True}}
    assert all(bench.verdict("index", [idx], 250.0).values())
    for change in ({"refused": 1}, {"fraction_of_reference": 0.3}, {"all_dense": False}):
        assert not all(bench.verdict("index", [{**idx, "index": {**idx["index"], **change}}], 250.0).values())
    assert not all(bench.verdict("index", [{**idx, "refused": 2}], 250.0).values())


def test_refusals_are_told_apart_by_where_they_happened(bench):
    """The API's counters say how many were refused on arrival and late; the rest of a step's refusals were
    the router's. The table shows the three beside the total."""
    metrics = {"elastic_api_queries_refused_total": (130.0, 100.0), "elastic_api_queries_late_total": (25.0, 5.0)}
    assert bench.refused_where(70, metrics) == {"arrival": 30, "late": 20, "router": 20}
    assert bench.refused_where(3, {}) == {"arrival": 0, "late": 0, "router": 3}
    step = {**_step(1.5), "rate_rps": 900.0, "offered": 100, "answered": 30, "refused": 70, "lost": 0, "p50_ms": 50.0,
            "mean_sparsity": 0.6, "refused_where": bench.refused_where(70, metrics)}
    assert "| 70 (30 / 20 / 20) |" in bench.table_lines("short", [step])[-1]
    assert "| 1.5x | 900.0 | n/a |" in bench.table_lines("short", [step])[-1]  # no reference before it
    line = bench.table_lines("short", [{**step, "reference_now": 720.0}])[-1]
    assert "| 1.5x | 900.0 | 1.25x of 720.0 |" in line and line.count("|") == 18


def test_the_reference_measured_again_after_the_load_shows_the_hosts_drift(bench):
    before = {"short": {0.0: 500.0, 0.6: 1200.0}, "t128": {0.0: 80.0}, "index_docs_per_s": 47.0}
    drift = bench.reference_drift(before, {"short": 600.0, "t128": 80.0})
    assert drift["short"] == {"before": 500.0, "after": 600.0, "change": pytest.approx(0.2)}
    assert drift["t128"]["change"] == 0.0 and set(drift) == {"short", "t128"}


def test_a_padding_counter_counts_its_increase_over_the_step(bench):
    assert bench._step_value("elastic_api_padded_tokens_total", 900.0, 400.0) == 500.0
    assert bench._step_value("elastic_padding_waste", 0.25, 0.5) == 0.25  # a gauge: its value at the end
    assert bench._step_value("x_padded_total", 7.0, None) == 7.0


def test_cpu_by_part_reads_the_servers_process_tree_from_proc(bench):
    """A real process tree: the root counts as the API, its child running a stub's command line as the budget
    model it names, the lane's and the router's likewise; the CPU a child burns shows up in its part."""
    import subprocess

    stub = "import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ntime.sleep(30)"
    tree = ("import subprocess, sys, time\n"
            "kids = [subprocess.Popen([sys.executable, '-c', sys.argv[1], f'/r/triton/{m}/1/model.py'])\n"
            "        for m in ('elastic_s030', 'elastic_index', 'elastic')]\n"
            "print('up', flush=True); time.sleep(30)")
    root = subprocess.Popen([sys.executable, "-c", tree, stub], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)  # its group: killed whole by its pid below
    try:
        assert root.stdout.readline().strip() == "up"
        deadline = time.monotonic() + 20
        while True:  # until every stub has burnt its 0.3 s (bounded)
            got = bench.cpu_by_part(root.pid)
            if all(got.get(p, 0) >= 0.25 for p in ("budget models", "lane", "router")) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        os.killpg(root.pid, signal.SIGKILL)
        root.wait(timeout=10)
    assert set(got) == {"api", "budget models", "lane", "router", "client"}
    assert all(got[p] >= 0.25 for p in ("budget models", "lane", "router")), got
    assert got["client"] > 0  # this process's own CPU so far


def test_cpu_use_and_its_table(bench):
    use = bench.cpu_use({"api": 1.0, "client": 2.0}, {"api": 1.5, "client": 2.2, "router": 0.1}, 2.0, 100)
    assert use["cores"] == pytest.approx({"api": 0.25, "client": 0.1, "router": 0.05})
    assert use["ms_per_request"] == pytest.approx({"api": 5.0, "client": 2.0, "router": 1.0})
    lines = bench.cpu_lines([{"multiple": 0.5, "cpu": use}, {"multiple": 1.0}])
    assert lines[2] == "| rate | api | router | client | cores busy |"
    assert lines[4] == "| 0.5x | 5.00 | 1.00 | 2.00 | 0.40 |"
    assert bench.cpu_lines([{"multiple": 1.0}]) == []
