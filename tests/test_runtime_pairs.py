"""The runtime over (budget, precision) pairs: the frontier choice of the policies, the profile
format with precisions and quality, subsets, and every pair's output against its own ONNX file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from conftest import tiny_encoder

from elastic_export.core.errors import UserError
from elastic_export.measure.timing import measure_profile
from elastic_export.serving.runtime import (
    ElasticRuntime,
    FixedPolicy,
    LatencyProfile,
    LatencyTargetPolicy,
    LoadAdaptivePolicy,
    frontier,
    load_profile,
    measure_switch_cost,
    quality_order,
    save_profile,
)
from elastic_export.targets.onnxruntime import SessionConfig

BUDGETS = (0.3, 0.6)
ONE = SessionConfig(threads=1)


@pytest.fixture(scope="module")
def art(tmp_path_factory) -> Path:
    """A tiny BERT with fp16 and int8 twins of every file (no verification: fast)."""
    from elastic_export import pipeline

    root = tmp_path_factory.mktemp("pairs")
    tiny_encoder("hf-bert").module.save_pretrained(root / "bert")
    out = root / "out"
    pipeline.run(pipeline.Options(model=str(root / "bert"), budgets=BUDGETS, out=str(out), seq_len=16,
                                  method="magnitude", verify=False, report=False, precision="fp32,fp16,int8"),
                 echo=lambda s: None)
    return out


@pytest.fixture(scope="module")
def feeds() -> dict[str, np.ndarray]:
    ids = np.array([[5, 17, 300, 9, 2, 0, 0, 0], [7, 8, 9, 10, 11, 12, 13, 14]], dtype=np.int64)
    return {"input_ids": ids, "attention_mask": (ids > 0).astype(np.int64), "token_type_ids": np.zeros_like(ids)}


def _plain(path: Path, feeds: dict, index: int | None = None) -> list[np.ndarray]:
    """The file run through a plain onnxruntime session (same thread count as the runtime's)."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    extra = {} if index is None else {"budget_index": np.array([index], np.int64)}
    return sess.run(None, {**feeds, **extra})


def _same(got: dict, want: list) -> bool:
    return len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got.values(), want))


# --- a synthetic profile: three sparsities x two precisions ---------------------------------
FP32 = {0.0: 10.0, 0.3: 7.0, 0.6: 4.0}  # p90 ms at batch 1
INT8 = {0.0: 6.0, 0.3: 4.5, 0.6: 2.5}


def _rows(p90: dict[float, float], scale: float = 1.0) -> dict:
    return {s: {"p50_ms": v * scale * 0.8, "p90_ms": v * scale, "p99_ms": v * scale * 1.2} for s, v in p90.items()}


def _profile(quality: dict | None = None) -> LatencyProfile:
    return LatencyProfile("onnxruntime", "cpu", {1: _rows(FP32), 8: _rows(FP32, 4)},
                          {"int8": {1: _rows(INT8), 8: _rows(INT8, 4)}}, quality or {}, "fidelity_cosine" if quality else None)


PAIRS = [(s, p) for s in (0.0, 0.3, 0.6) for p in ("fp32", "int8")]


def test_quality_order_and_frontier():
    assert quality_order(PAIRS) == [(0.0, "fp32"), (0.0, "int8"), (0.3, "fp32"), (0.3, "int8"), (0.6, "fp32"),
                                    (0.6, "int8")]
    ms = {**{(s, "fp32"): v for s, v in FP32.items()}, **{(s, "int8"): v for s, v in INT8.items()}}
    # (0.3, fp32) at 7 ms is slower than (0.0, int8) at 6 ms, which ranks above it: off the frontier
    assert frontier(PAIRS, ms) == [(0.0, "fp32"), (0.0, "int8"), (0.3, "int8"), (0.6, "fp32"), (0.6, "int8")]
    q = {(0.0, "fp32"): 1.0, (0.3, "fp32"): 0.97, (0.0, "int8"): 0.95, (0.3, "int8"): 0.93, (0.6, "fp32"): 0.90,
         (0.6, "int8"): 0.85}
    assert quality_order(PAIRS, q)[:3] == [(0.0, "fp32"), (0.3, "fp32"), (0.0, "int8")]
    assert quality_order(PAIRS, {(0.0, "fp32"): 0.5}) == quality_order(PAIRS)  # partial figures: the default order


def test_latency_target_policy_picks_the_frontier_pair():
    """Two precisions, default quality order: the highest-quality pair whose p90 meets the target."""
    pol = LatencyTargetPolicy(_profile(), target_ms=8.0)
    pol.bind_pairs(PAIRS, "fp32")
    assert pol.select(1) == (0.0, "int8")  # 6 <= 8; (0.3, fp32) at 7 also meets it but ranks lower
    for target, want in ((10.0, (0.0, "fp32")), (5.0, (0.3, "int8")), (4.0, (0.6, "fp32")), (3.0, (0.6, "int8"))):
        pol = LatencyTargetPolicy(_profile(), target_ms=target)
        pol.bind_pairs(PAIRS, "fp32")
        assert pol.select(1) == want, target
        assert pol.missed == 0
    # nothing meets 2 ms: the fastest pair, counted as missed; batch 8 (x4 slower) misses 3 ms too
    pol = LatencyTargetPolicy(_profile(), target_ms=2.0)
    pol.bind_pairs(PAIRS, "fp32")
    assert pol.select(1) == (0.6, "int8") and pol.select(5) == (0.6, "int8") and pol.missed == 2
    # limited to fp32: the old single-precision choice
    pol = LatencyTargetPolicy(_profile(), target_ms=8.0, precisions=("fp32",))
    pol.bind_pairs(PAIRS, "fp32")
    assert pol.select(1) == (0.3, "fp32")


def test_latency_target_policy_follows_quality_figures(tmp_path):
    """With a quality figure per pair (saved and loaded with the profile), the order is by quality."""
    q = {"fp32": {0.0: 1.0, 0.3: 0.97, 0.6: 0.90}, "int8": {0.0: 0.95, 0.3: 0.93, 0.6: 0.85}}
    back = load_profile(save_profile(_profile(q), tmp_path))
    raw = json.loads((tmp_path / "latency_profile.json").read_text())
    assert raw["batches"]["1"]["0.3"]["p90_ms"] == 7.0 and raw["precisions"]["int8"]["8"]["0.6"]["p90_ms"] == 10.0
    assert raw["quality"] == {"metric": "fidelity_cosine", "values": {"fp32": {"0.0": 1.0, "0.3": 0.97, "0.6": 0.9},
                                                                       "int8": {"0.0": 0.95, "0.3": 0.93, "0.6": 0.85}}}
    assert back == _profile(q)
    for target, want in ((8.0, (0.3, "fp32")), (5.0, (0.3, "int8")), (4.2, (0.6, "fp32"))):
        pol = LatencyTargetPolicy(back, target_ms=target)
        pol.bind_pairs(PAIRS, "fp32")
        assert pol.select(1) == want, target
    partial = _profile({"fp32": {0.0: 1.0}})
    with pytest.raises(UserError, match="quality figures for some pairs but not for 0 int8"):
        LatencyTargetPolicy(partial, target_ms=5).bind_pairs(PAIRS, "fp32")


def test_old_profiles_load_as_fp32(tmp_path):
    """A profile written before precisions (sparsity keys only) loads with fp32 implicit; a runtime
    with int8 loaded too then chooses among its fp32 pairs only."""
    (tmp_path / "latency_profile.json").write_text(json.dumps(
        {"backend": "onnxruntime", "provider": "cpu",
         "batches": {"1": {"0.0": {"p50_ms": 9, "p90_ms": 10, "p99_ms": 11, "throughput": 100},
                           "0.3": {"p50_ms": 6, "p90_ms": 7, "p99_ms": 8}, "0.6": {"p90_ms": 4}}}}))
    prof = load_profile(tmp_path)
    assert prof.precisions == {} and prof.quality == {} and prof.measured_precisions() == ["fp32"]
    assert prof.latency(1, 0.3) == 7.0 and prof.latency(1, 0.3, precision="int8") is None
    pol = LatencyTargetPolicy(prof, target_ms=8)
    pol.bind_pairs(PAIRS, "int8")
    assert pol.select(1) == (0.3, "fp32")
    with pytest.raises(UserError, match="measured precision fp32; the runtime loaded int8"):
        LatencyTargetPolicy(prof, target_ms=8).bind_pairs([(0.0, "int8")], "int8")
    (tmp_path / "latency_profile.json").write_text(json.dumps({"batches": {}, "precisions": {"int4": {}}}))
    with pytest.raises(UserError, match="malformed.*int4"):
        load_profile(tmp_path)


def test_load_adaptive_policy_walks_the_frontier():
    pol = LoadAdaptivePolicy.from_profile(_profile(), up_depth=2, down_depth=0, down_after=1)
    pol.bind_pairs(PAIRS, "fp32")
    levels = [(0.0, "fp32"), (0.0, "int8"), (0.3, "int8"), (0.6, "fp32"), (0.6, "int8")]  # p50 frontier at batch 1
    assert pol.levels == levels
    seen = [pol.select(1)]
    for depth in (2, 2, 2, 2, 2, 0, 0):
        pol.observe(depth)
        seen.append(pol.select(1))
    assert seen == levels + [levels[-1], levels[-2], levels[-3]]
    # sparsity-keyed service times (as before precisions): the current precision's budgets, all of them
    pol = LoadAdaptivePolicy(service_ms={0.0: 3.0, 0.3: 2.0, 0.6: 1.0})
    pol.bind_pairs(PAIRS, "int8")
    assert pol.levels == [(0.0, "int8"), (0.3, "int8"), (0.6, "int8")]


def test_every_pair_equals_its_own_file(art, feeds):
    """Per-budget mode with every precision loaded: each pair's outputs are exactly its ONNX file's."""
    m = json.loads((art / "manifest.json").read_text())
    rt = ElasticRuntime.from_dir(art, precisions="all", config=ONE)
    assert rt.precisions == ["fp32", "fp16", "int8"] and rt.sparsities == [0.0, *BUDGETS]
    assert len(rt.pairs) == 9 and rt.pair == (0.0, "fp32")
    entries = {0.0: m["dense"], **{b["sparsity"]: b for b in m["budgets"]}}
    for s, p in rt.pairs:
        rel = entries[s][{"fp32": "onnx", "fp16": "onnx_fp16", "int8": "onnx_int8"}[p]]
        want = _plain(art / rel, feeds)
        assert rt.file(s, p) == rel
        assert _same(rt.run(feeds, sparsity=s, precision=p), want), (s, p)
        rt.set_budget(s, precision=p)
        assert rt.pair == (s, p) and _same(rt.run(feeds), want)
        assert rt.serve_pair(feeds)[0] == (s, p)
    rt.set_budget(0.3)  # keeps the current precision (int8 after the loop)
    assert rt.pair == (0.3, "int8")
    rt.set_policy(FixedPolicy(0.6, "fp16"))
    assert rt.choose_pair(4) == (0.6, "fp16") and rt.serve(feeds)[0] == 0.6
    assert measure_switch_cost(rt, n=500) >= 0.0 and rt.pair == (0.3, "int8") and rt.policy is not None
    # the frontier policy on the real runtime, from a profile measured on it
    prof = measure_profile(rt, {2: feeds}, repeats=2, warmup=0)
    assert sorted(prof.rows("fp32")[2]) == [0.0, *BUDGETS] and sorted(prof.precisions) == ["fp16", "int8"]
    rt.set_policy(LatencyTargetPolicy(prof, target_ms=1e6))
    assert rt.choose_pair(2) == (0.0, "fp32")


def test_elastic_mode_pairs_equal_the_elastic_files(art, feeds):
    """Elastic mode, fp32 and fp16: each pair is its elastic graph at its index, dense included."""
    m = json.loads((art / "manifest.json").read_text())
    e = m["elastic"]
    rt = ElasticRuntime.from_dir(art, mode="elastic", precisions="all", config=ONE)
    assert rt.precisions == ["fp32", "fp16"] and rt.sparsities == [0.0, *BUDGETS]
    index = {**{s: i for i, s in enumerate(e["budgets"])}, 0.0: e["dense_index"]}
    for s, p in rt.pairs:
        rel = e["onnx" if p == "fp32" else "onnx_fp16"]
        assert rt.file(s, p) == rel and _same(rt.run(feeds, sparsity=s, precision=p), _plain(art / rel, feeds, index[s]))
    dense = _plain(art / "dense.onnx", feeds)
    assert max(float(np.abs(a - b).max()) for a, b in zip(rt.run(feeds, sparsity=0.0).values(), dense)) <= 1e-4


def test_subsets_and_bad_pairs(art, feeds):
    rt = ElasticRuntime.from_dir(art, precisions=("fp32", "int8"), sparsities=(0.0, 0.6), config=ONE)
    assert rt.pairs == [(0.0, "fp32"), (0.0, "int8"), (0.6, "fp32"), (0.6, "int8")]
    assert rt.shared_weights("int8").keys() == {0.0, 0.6}
    with pytest.raises(UserError, match=r"precision 'fp16' is not loaded; loaded: fp32, int8") as e:
        rt.set_budget(0.6, precision="fp16")
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="precision 'fp16' is not loaded"):
        rt.run(feeds, sparsity=0.0, precision="fp16")
    with pytest.raises(UserError, match=r"^sparsity 0.7 is above the sparsest served budget 0.6; served budgets: "
                                        r"0, 0.6 \(at fp32\)$"):
        rt.set_budget(0.7)
    with pytest.raises(UserError, match=r"precision 'fp16' is not loaded; loaded: fp32, int8"):
        rt.set_policy(FixedPolicy(0.6, "fp16"))
    assert rt.pair == (0.0, "fp32")
    rt.set_budget(0.3, precision="int8")  # matched among the sparsities loaded at int8, as the router's rule does
    assert rt.pair == (0.6, "int8") and rt.serve_pair(feeds, sparsity=0.1, precision="fp32")[0] == (0.6, "fp32")
    rt = ElasticRuntime.from_dir(art, precision="int8", precisions="fp32,int8", config=ONE)
    assert rt.pair == (0.0, "int8") and rt.precisions == ["fp32", "int8"]
    for kwargs, match in (({"sparsities": (0.35,)}, "sparsities 0.35: not listed budgets; listed: 0, 0.3, 0.6"),
                          ({"precisions": ("fp32", "int4")}, "precision 'int4': unknown"),
                          ({"precision": "fp16", "precisions": ("fp32",)}, "'fp16' is not among precisions fp32"),
                          ({"mode": "elastic", "precisions": "all", "sparsities": ()}, "sparsities"),
                          ({"mode": "elastic", "precisions": ("fp32", "int8")}, "no int8 twin")):
        with pytest.raises(UserError, match=match):
            ElasticRuntime.from_dir(art, config=ONE, **kwargs)


def test_docs_runtime_pairs_snippet(art, tmp_path, monkeypatch):
    """docs/runtime.md, "Budget × precision": its snippet run literally on a directory with twins."""
    import re

    monkeypatch.chdir(tmp_path)
    (tmp_path / "elastic-out-pairs").symlink_to(art)
    doc = (Path(__file__).parents[1] / "docs" / "runtime.md").read_text()
    code = re.findall(r"```python\n(.*?)```", doc.split("## Budget × precision")[1], re.S)[0]
    ns: dict = {}
    exec(compile(code, "docs/runtime.md", "exec"), ns)
    assert ns["rtp"].pairs[:2] == [(0.0, "fp32"), (0.0, "int8")] and ns["small"].sparsities == [0.0, BUDGETS[-1]]
