"""elastic_export.serving.runtime and elastic_export.targets.onnxruntime on real tiny artifacts (no mocks)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from conftest import tiny_encoder

from elastic_export.core.errors import UserError
from elastic_export.core.manifest import Manifest
from elastic_export.measure.timing import measure_profile
from elastic_export.serving.runtime import (
    ElasticRuntime,
    FixedPolicy,
    LatencyProfile,
    LatencyTargetPolicy,
    LoadAdaptivePolicy,
    load_profile,
    make_policy,
    measure_switch_cost,
    save_profile,
)
from elastic_export.targets.onnxruntime import Runner, SessionConfig, available_providers, make_session

BUDGETS = (0.2, 0.5, 0.8)


def _export(tmp_path_factory, budgets: tuple[float, ...], **options) -> Path:
    """Export a tiny BERT (magnitude ranking, no verification: fast) and return its directory."""
    from elastic_export import pipeline

    root = tmp_path_factory.mktemp("rt")
    model = root / "tiny-bert"
    tiny_encoder("hf-bert").module.save_pretrained(model)
    out = root / "out"
    pipeline.run(pipeline.Options(model=str(model), budgets=budgets, out=str(out), seq_len=16, method="magnitude",
                                  verify=False, **options), echo=lambda s: None)
    return out


@pytest.fixture(scope="module")
def art(tmp_path_factory) -> Path:
    """A tiny BERT artifact directory: dense + 3 budgets + elastic.onnx (no quick eval or report: not read here)."""
    return _export(tmp_path_factory, BUDGETS, quick_eval=False, report=False)


@pytest.fixture(scope="module")
def feeds() -> dict[str, np.ndarray]:
    ids = np.array([[5, 17, 300, 9, 2, 0, 0, 0], [7, 8, 9, 10, 11, 12, 13, 14]], dtype=np.int64)
    return {"input_ids": ids, "attention_mask": (ids > 0).astype(np.int64), "token_type_ids": np.zeros_like(ids)}


@pytest.fixture(scope="module")
def expected(art, feeds) -> dict[float, list[np.ndarray]]:
    """Each budget's own ONNX file (plain onnxruntime session), sparsity 0.0 = dense.onnx."""
    m = json.loads((art / "manifest.json").read_text())
    files = {0.0: m["dense"]["onnx"], **{b["sparsity"]: b["onnx"] for b in m["budgets"]}}
    return {s: ort.InferenceSession(str(art / f), providers=["CPUExecutionProvider"]).run(None, feeds)
            for s, f in files.items()}


@pytest.fixture(scope="module")
def rt(art) -> ElasticRuntime:
    return ElasticRuntime.from_dir(art, config=SessionConfig(threads=1))


def _err(got: dict, want: list) -> float:
    assert len(got) == len(want)
    return max(float(np.abs(a - b).max()) for a, b in zip(got.values(), want))


def test_per_budget_mode_matches_each_budget_file(rt, feeds, expected):
    assert rt.sparsities == [0.0, *BUDGETS] and rt.budget == 0.0 and rt.mode == "per-budget"
    assert list(rt.run(feeds)) == [o.name for o in rt.manifest.outputs]
    for s in rt.sparsities:
        assert _err(rt.run(feeds, sparsity=s), expected[s]) == 0.0  # the same file, the same session options
        rt.set_budget(s)
        assert rt.budget == s and _err(rt.run(feeds), expected[s]) == 0.0
    rt.set_budget(0.0)
    assert rt.file(0.0) == "dense.onnx" and rt.file(0.5).startswith("budget_")


def test_elastic_mode_matches_each_budget_file(art, feeds, expected, tmp_path):
    el = ElasticRuntime.from_dir(art, mode="elastic", providers=["CPUExecutionProvider"])
    assert el.sparsities == [0.0, *BUDGETS]  # the elastic graph serves the dense model too
    for s in el.sparsities:
        assert _err(el.run(feeds, sparsity=s), expected[s]) <= 1e-4
    assert el.file(0.0) == "elastic.onnx" and el.memory_rss() > 0
    # a directory written before the dense index (no dense_index in the manifest) still loads: budgets only
    old_dir = _without_dense_index(art, tmp_path)
    old = ElasticRuntime.from_dir(old_dir, mode="elastic", config=SessionConfig(threads=1))
    assert old.sparsities == list(BUDGETS)
    old.set_budget(0.0)  # no dense model here: the router's rule serves the smallest budget at least as sparse
    assert old.budget == BUDGETS[0]
    for s in BUDGETS:
        assert _err(old.run(feeds, sparsity=s), expected[s]) <= 1e-4


def _without_dense_index(art: Path, tmp_path: Path) -> Path:
    """A copy of ``art`` whose manifest has no elastic ``dense_index`` (as written before it existed)."""
    old = tmp_path / "old"
    shutil.copytree(art, old)
    m = json.loads((old / "manifest.json").read_text())
    del m["elastic"]["dense_index"]
    (old / "manifest.json").write_text(json.dumps(m))
    return old


def _forbidden(what: str):
    def call(*args, **kwargs):
        raise AssertionError(f"a budget switch {what}")
    return call


def test_set_budget_follows_the_routers_rule_and_is_cheap(rt, feeds, expected, monkeypatch):
    """A requested sparsity means what the router makes of it (router_budgets.choose_budget): a loaded one,
    else the smallest loaded one at least as sparse; sparser than the sparsest, outside [0, 1) or not a
    number is one line naming the loaded ones. Cheap, without timing anything: a switch creates no
    onnxruntime session and runs none (both raise here), through every loaded pair and measure_switch_cost."""
    from elastic_export.serving.router_budgets import choose_budget

    for asked in (0.0, 0.1, 0.2, 0.35, 0.5, 0.50000001, 0.79):
        rt.set_budget(asked)
        assert rt.budget == choose_budget(asked, rt.sparsities, 0.0)
    rt.set_budget(0.35)
    assert rt.budget == 0.5 and rt.file(0.35) == rt.file(0.5)
    s, out = rt.serve(feeds, sparsity=0.35)  # this call only: served by 0.5, and serve says so
    assert s == 0.5 and _err(out, expected[0.5]) == 0.0
    for bad, match in ((0.95, r"^sparsity 0.95 is above the sparsest served budget 0.8; served budgets: 0, 0.2, 0.5, 0.8$"),
                       (1.0, r"^sparsity 1 is outside \[0, 1\); served budgets: 0, 0.2, 0.5, 0.8$"),
                       (-0.1, "outside"), ("abc", "'abc' is not a number"), (True, "not a number")):
        with pytest.raises(UserError, match=match):
            rt.set_budget(bad)
        with pytest.raises(UserError, match=match):
            rt.run(feeds, sparsity=bad)
    assert rt.budget == 0.5  # a refused switch leaves the current pair
    monkeypatch.setattr(ort.InferenceSession, "run", _forbidden("ran a session"))
    monkeypatch.setattr(ort, "InferenceSession", _forbidden("created a session"))
    for pair in rt.pairs:
        rt.set_budget(*pair)
        assert rt.pair == pair
    rt.set_budget(0.5000000001)  # float noise from JSON round trips is tolerated (6 decimals)
    assert rt.budget == 0.5
    cost = measure_switch_cost(rt, n=2000)
    assert np.isfinite(cost) and cost >= 0.0  # a number; no assertion on wall-clock time
    assert rt.budget == 0.5  # measure_switch_cost restores the current pair
    monkeypatch.undo()
    rt.set_budget(0.0)


def test_concurrent_runs_at_different_budgets(rt, feeds, expected):
    errors: list[str] = []

    def worker(s: float) -> None:
        for _ in range(15):
            if _err(rt.run(feeds, sparsity=s), expected[s]) != 0.0:
                errors.append(f"sparsity {s}")

    def switcher() -> None:
        for i in range(300):
            rt.set_budget(rt.sparsities[i % 4])

    threads = [threading.Thread(target=worker, args=(s,)) for s in rt.sparsities] + [threading.Thread(target=switcher)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    rt.set_budget(0.0)


def _profile(p90: dict[float, float], p90_b8: dict[float, float] | None = None) -> LatencyProfile:
    batches = {1: {s: {"p50_ms": v * 0.8, "p90_ms": v, "p99_ms": v * 1.2} for s, v in p90.items()}}
    if p90_b8:
        batches[8] = {s: {"p50_ms": v * 0.8, "p90_ms": v, "p99_ms": v * 1.2} for s, v in p90_b8.items()}
    return LatencyProfile("onnxruntime", "cpu", batches)


def test_latency_target_policy_picks_lowest_sparsity_meeting_p90(rt, tmp_path, feeds, expected):
    prof = _profile({0.0: 10.0, 0.2: 8.0, 0.5: 5.0, 0.8: 3.0}, {0.0: 40.0, 0.2: 30.0, 0.5: 18.0, 0.8: 11.0})
    save_profile(prof, tmp_path)
    raw = json.loads((tmp_path / "latency_profile.json").read_text())
    assert raw["batches"]["1"]["0.0"]["p90_ms"] == 10.0 and raw["batches"]["8"]["0.5"]["p90_ms"] == 18.0
    prof = load_profile(tmp_path)
    pol = LatencyTargetPolicy(prof, target_ms=8.5)
    rt.set_policy(pol)
    assert rt.choose(1) == 0.2  # 10 > 8.5 >= 8
    assert rt.choose(4) == 0.8  # batch 4 -> the profiled batch 8: nothing meets 8.5 -> the sparsest
    assert pol.missed == 1
    assert rt.choose(64) == 0.8  # beyond the largest profiled batch: the largest
    rt.set_policy(LatencyTargetPolicy(prof, target_ms=20.0))
    assert rt.choose(1) == 0.0 and rt.choose(8) == 0.5
    small = {k: v[:1] for k, v in feeds.items()}
    assert _err(rt.run(small), [a[:1] for a in expected[0.0]]) <= 1e-5  # batch 1 -> dense
    assert _err(rt.run(feeds), expected[0.5]) == 0.0  # batch 2 -> profiled batch 8 -> 0.5
    rt.set_policy(FixedPolicy(0.8))
    assert rt.choose(1) == 0.8
    rt.set_budget(0.0)  # drops the policy
    assert rt.policy is None and rt.choose(8) == 0.0
    with pytest.raises(UserError, match="no p90_ms for sparsity 0.8"):
        rt.set_policy(LatencyTargetPolicy(_profile({0.0: 1.0, 0.2: 1.0, 0.5: 1.0}), target_ms=5))
    rt.set_policy(FixedPolicy(0.3))  # as the router's --policy fixed maps its default: 0.3 -> 0.5
    assert rt.choose(1) == 0.5
    with pytest.raises(UserError, match="above the sparsest served budget 0.8"):
        rt.set_policy(FixedPolicy(0.9))


def test_adaptive_policy_counts_every_request_the_runtime_serves(rt, feeds):
    """make_policy("adaptive") (the router's --policy adaptive, tests/test_policies.py) on the runtime: every
    request it serves is an arrival, named budget or not, as at the router; a light rate is served dense, a
    rate past dense's capacity sparser (service times given, a manual clock)."""
    clock = [0.0]
    points = {s: {1: 10.0 * (1 - s), 8: 80.0 * (1 - s)} for s in rt.sparsities}
    rt.set_policy(make_policy("adaptive", slo_ms=250, points=points, clock=lambda: clock[0]))
    one = {k: v[:1] for k, v in feeds.items()}
    for i in range(40):  # 20 rows/s
        clock[0] = i * 0.05
        s, _ = rt.serve(one)
    assert s == 0.0 and rt.policy.last.rate == pytest.approx(20, rel=0.1)
    for i in range(450):  # 150 rows/s, each naming 0.8: counted all the same
        clock[0] = 2 + (i + 1) / 150
        assert rt.serve(one, sparsity=0.8)[0] == 0.8
    assert rt.policy.last.rate > 100 and rt.choose(1) > 0.0 and rt.serve(one)[0] == rt.policy.last.pair[0]
    rt.set_budget(0.0)


def test_measure_profile_round_trips(rt, feeds, tmp_path):
    prof = measure_profile(rt, {1: {k: v[:1] for k, v in feeds.items()}, 2: feeds}, repeats=3, warmup=1)
    assert sorted(prof.batches) == [1, 2] and sorted(prof.batches[2]) == rt.sparsities
    assert all(set(v) == {"p50_ms", "p90_ms", "p99_ms"} for v in prof.batches[1].values())
    back = load_profile(save_profile(prof, tmp_path))
    assert back.batches == prof.batches and back.provider == "cpu"


def test_bad_profiles_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="no latency profile"):
        load_profile(tmp_path)
    (tmp_path / "latency_profile.json").write_text("{not json")
    with pytest.raises(UserError, match="unreadable"):
        load_profile(tmp_path)
    (tmp_path / "latency_profile.json").write_text(json.dumps({"batches": {"1": {"0.0": {"mean": 3}}}}))
    with pytest.raises(UserError, match="malformed"):
        load_profile(tmp_path)


def test_load_adaptive_policy_with_hysteresis(rt):
    pol = LoadAdaptivePolicy(up_depth=4, down_depth=1, down_after=3)
    rt.set_policy(pol)
    assert rt.observe(0) == 0.0
    assert rt.observe(3) == 0.0  # between the thresholds: stay
    assert rt.observe(5) == 0.2 and rt.observe(6) == 0.5 and rt.observe(9) == 0.8 and rt.observe(12) == 0.8
    # flapping load between the thresholds never moves it down; calm must last down_after observations
    for depth in (2, 3, 1, 2, 1, 1, 3):
        assert rt.observe(depth) == 0.8
    assert rt.observe(0) == 0.8 and rt.observe(0) == 0.8 and rt.observe(1) == 0.5
    assert [rt.observe(0) for _ in range(6)] == [0.5, 0.5, 0.2, 0.2, 0.2, 0.0]
    switches = pol.switches
    for depth in [3, 2, 3, 2] * 10:  # oscillating load inside the band: no switches
        rt.observe(depth)
    assert pol.switches == switches and rt.budget == 0.0

    # arrival-rate driven: service ms per level -> utilisation; jumps straight to the level that fits
    svc = {0.0: 10.0, 0.2: 8.0, 0.5: 5.0, 0.8: 3.0}
    pol = LoadAdaptivePolicy(service_ms=svc, down_after=2, high_utilization=0.85, low_utilization=0.6)
    rt.set_policy(pol)
    assert rt.observe(0, arrival_rate=50) == 0.0  # 0.5 utilisation at dense
    assert rt.observe(0, arrival_rate=150) == 0.5  # 1.5 dense, 1.2 at 0.2, 0.75 at 0.5
    assert rt.observe(0, arrival_rate=100) == 0.5  # 0.2 would be 0.8 > low 0.6: stay (hysteresis)
    assert rt.observe(0, arrival_rate=70) == 0.5 and rt.observe(0, arrival_rate=70) == 0.2  # 0.56 <= 0.6, 2 calm
    assert rt.observe(0, arrival_rate=70) == 0.2 and rt.observe(0, arrival_rate=70) == 0.2  # dense 0.7 > 0.6
    rt.set_budget(0.0)
    with pytest.raises(UserError, match="service_ms lacks"):
        rt.set_policy(LoadAdaptivePolicy(service_ms={0.0: 1.0}))
    with pytest.raises(UserError, match="up_depth > down_depth"):
        LoadAdaptivePolicy(up_depth=1, down_depth=1)


def test_bad_input_is_user_error(art, tmp_path, feeds):
    with pytest.raises(UserError, match="no such artifact directory"):
        ElasticRuntime.from_dir(tmp_path / "nope")
    with pytest.raises(UserError, match="no manifest.json"):
        ElasticRuntime.from_dir(tmp_path)
    with pytest.raises(UserError, match="mode 'fast'"):
        ElasticRuntime.from_dir(art, mode="fast")
    with pytest.raises(UserError, match="backend 'openvino'"):
        ElasticRuntime.from_dir(art, backend="openvino")
    assert "cpu" in available_providers() and "cuda" not in available_providers()  # this CPU-only build
    with pytest.raises(UserError, match=r"'cuda' .*not available.*available: cpu") as e:
        ElasticRuntime.from_dir(art, providers=["CUDAExecutionProvider"])
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="'tensorrt' .*not available"):
        make_session(art / "dense.onnx", SessionConfig(provider="tensorrt", fp16=True))
    with pytest.raises(UserError, match="opt_level"):
        make_session(art / "dense.onnx", SessionConfig(opt_level="max"))
    with pytest.raises(UserError, match="no such ONNX file"):
        make_session(art / "missing.onnx")
    with pytest.raises(UserError, match="(?i)tensorrt"):  # no TensorRT here, and no engines in the manifest
        ElasticRuntime.from_dir(art, backend="tensorrt")
    rt = ElasticRuntime.from_dir(art, config=SessionConfig(threads=1, opt_level="basic", memory_arena=False))
    with pytest.raises(UserError, match="above the sparsest served budget 0.8"):
        rt.run(feeds, sparsity=0.85)
    with pytest.raises(UserError, match="missing input 'attention_mask'"):
        rt.run({"input_ids": feeds["input_ids"]})
    broken = tmp_path / "broken"
    shutil.copytree(art, broken)
    m = json.loads((broken / "manifest.json").read_text())
    m["elastic"] = None
    (broken / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(UserError, match="no elastic graph"):
        ElasticRuntime.from_dir(broken, mode="elastic")
    (broken / m["budgets"][0]["onnx"]).unlink()
    with pytest.raises(UserError, match="no such ONNX file"):
        ElasticRuntime.from_dir(broken)


def test_tensorrt_ep_gets_the_manifest_shape_range(art, tmp_path):
    """onnxruntime's TensorRT EP gets explicit profiles (one engine for every batch / length) and
    caches engines and timings together; the elastic graph adds its fixed budget input."""
    from elastic_export.targets.ort_backend import tensorrt_ep_profile

    m = Manifest.load(art)
    names = [i.name for i in m.inputs]
    profile = tensorrt_ep_profile(m)
    opts = dict(SessionConfig(provider="tensorrt", trt_profile=profile, engine_cache_dir=str(tmp_path / "c"))
                .providers()[0][1])
    assert opts["trt_profile_min_shapes"] == ",".join(f"{n}:1x1" for n in names)
    assert opts["trt_profile_opt_shapes"] == ",".join(f"{n}:32x16" for n in names)
    assert opts["trt_profile_max_shapes"] == ",".join(f"{n}:128x16" for n in names)
    assert opts["trt_timing_cache_enable"] and opts["trt_timing_cache_path"] == opts["trt_engine_cache_path"]
    elastic = tensorrt_ep_profile(m, elastic=True, max_batch=8, opt_batch=8, max_tokens=64, opt_tokens=64)
    opts = elastic.ort_tensorrt_options()
    assert opts["trt_profile_max_shapes"] == ",".join([f"{n}:8x64" for n in names] + ["budget_index:1"])
    assert opts["trt_profile_min_shapes"].endswith(",budget_index:1")
    assert "trt_profile_min_shapes" not in dict(SessionConfig(provider="tensorrt").providers()[0][1])
    m.tokens = None  # nothing to bound the token axis with: no explicit profile, the EP picks
    assert tensorrt_ep_profile(m) is None


def test_shared_initializers_hold_identical_weights_once(art, tmp_path, feeds, expected):
    """Weights byte-identical across the budget files (embeddings, norms, biases) become one OrtValue
    used by every session; sliced weights and matmul weights (pre-packed per session) are not
    shared; the outputs do not change."""
    import onnx

    from elastic_export.targets.onnxruntime import PREPACKED_OPS, shared_initializers

    m = json.loads((art / "manifest.json").read_text())
    files = [m["dense"]["onnx"]] + [b["onnx"] for b in m["budgets"]]
    shared = shared_initializers([art / f for f in files], min_bytes=0, min_total=0)
    assert len(shared) == len(files)
    dense_model, sparsest_model = onnx.load(str(art / files[0])), onnx.load(str(art / files[-1]))
    packed = {i for n in dense_model.graph.node if n.op_type in PREPACKED_OPS for i in n.input}
    dense = {t.name: t for t in dense_model.graph.initializer}
    sparsest = {t.name: t for t in sparsest_model.graph.initializer}
    same = {n for n in dense if n in sparsest and dense[n].dims == sparsest[n].dims and n not in packed
            and dense[n].raw_data == sparsest[n].raw_data and dense[n].raw_data}
    sliced = {n for n in dense if n in sparsest and dense[n].dims != sparsest[n].dims}
    assert same and sliced and packed  # embeddings / norms kept whole; FFN / attention cut at 0.8
    assert any("embeddings" in n for n in same)
    assert same <= set(shared[0]) and same <= set(shared[-1])
    assert all(shared[0][n] is shared[-1][n] for n in same)  # one object, not one copy per session
    assert not packed & set(shared[0])  # matmul weights stay the session's own
    assert all(shared[-1][n] is not shared[0].get(n) for n in sliced & set(shared[-1]))  # other bytes: other value
    # too little to share in the first file: nothing is read further, nothing shared
    assert shared_initializers([art / f for f in files], min_bytes=0) == [{} for _ in files]
    # a file that is not ONNX shares nothing (make_session reports it), the others still share
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not onnx")
    again = shared_initializers([art / files[0], bad, art / files[1]], min_bytes=0, min_total=0)
    assert again[1] == {} and again[0] and again[0].keys() == again[2].keys()
    assert all(again[0][n] is again[2][n] for n in again[0])
    with pytest.raises(UserError, match="onnxruntime cannot load it"):
        make_session(bad, SessionConfig(), initializers=again[1])
    # sessions built with shared weights compute exactly what plain sessions compute
    for f, init in zip(files, shared):
        sess = make_session(art / f, SessionConfig(threads=1), initializers=init)
        assert sess.shared_initializers.keys() == init.keys()
        s = 0.0 if f == files[0] else next(b["sparsity"] for b in m["budgets"] if b["onnx"] == f)
        assert _err(dict(enumerate(sess.run(None, feeds))), expected[s]) == 0.0
    plain = ElasticRuntime.from_dir(art, config=SessionConfig(threads=1, share_weights=False))
    for s in plain.sparsities:
        assert _err(plain.run(feeds, sparsity=s), expected[s]) < 1e-6


def test_runtime_shares_a_large_vocabulary(tmp_path_factory, feeds):
    """End to end: a model whose embedding table is worth sharing (9 MB here, as MiniLM's 45 MB) is
    loaded with that table shared by every session; outputs equal the plain sessions'."""
    from transformers import BertConfig, BertModel

    from elastic_export import pipeline

    root = tmp_path_factory.mktemp("vocab")
    BertModel(BertConfig(vocab_size=36000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=128, max_position_embeddings=64)).save_pretrained(root / "bert")
    out = root / "out"
    pipeline.run(pipeline.Options(model=str(root / "bert"), budgets=(0.5,), out=str(out), seq_len=16,
                                  method="magnitude", verify=False, elastic_graph=False, quick_eval=False,
                                  report=False), echo=lambda s: None)
    shared = ElasticRuntime.from_dir(out, config=SessionConfig(threads=1))
    plain = ElasticRuntime.from_dir(out, config=SessionConfig(threads=1, share_weights=False))
    names = shared.shared_weights()
    assert all(any("word_embeddings" in n for n in v) for v in names.values()), names
    assert names[0.0] == names[0.5] and all(v == () for v in plain.shared_weights().values())
    for s in shared.sparsities:
        a, b = shared.run(feeds, sparsity=s), plain.run(feeds, sparsity=s)
        assert all(np.array_equal(a[k], b[k]) for k in a)


def test_runner_plain_and_bound(art, feeds, expected):
    cfg = SessionConfig(threads=1)
    runner = Runner(make_session(art / "dense.onnx", cfg), cfg)
    assert _err(dict(enumerate(runner.run(feeds))), expected[0.0]) == 0.0
    runner.bind(feeds)
    runner.run_bound()
    assert _err(dict(enumerate(runner.outputs())), expected[0.0]) == 0.0
    with pytest.raises(UserError, match="missing input"):
        runner.bind({})


def test_sessions_without_spinning_give_the_same_outputs(art, feeds, expected):
    cfg = SessionConfig(threads=2, spin=False)
    so = cfg.session_options()
    assert so.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    runner = Runner(make_session(art / "dense.onnx", cfg), cfg)
    assert _err(dict(enumerate(runner.run(feeds))), expected[0.0]) == 0.0


def test_runtime_imports_and_runs_without_torch(art):
    """runtime.py and targets/onnxruntime.py must not need torch (edge boxes without it)."""
    code = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        import numpy as np
        from elastic_export.serving.runtime import ElasticRuntime
        from elastic_export.targets.onnxruntime import SessionConfig
        rt = ElasticRuntime.from_dir({str(art)!r}, config=SessionConfig(threads=1))
        ids = np.array([[5, 17, 300, 9]], dtype=np.int64)
        out = rt.run({{"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}},
                     sparsity=0.5)
        assert "torch" not in [m for m in sys.modules if sys.modules[m] is not None]
        print("ok", list(out), out["last_hidden_state"].shape)
    """)
    root = Path(__file__).parent.parent  # the repository root
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.startswith("ok ['last_hidden_state'")


@pytest.fixture(scope="module")
def art16(tmp_path_factory) -> Path:
    """A tiny BERT directory exported with --precision fp16 (fp16 twins of every file)."""
    return _export(tmp_path_factory, (0.3, 0.6), precision="fp16", quick_eval=False, report=False)


@pytest.mark.parametrize("mode", ["per-budget", "elastic"])
def test_fp16_precision_serves_the_fp16_files(art16, feeds, mode):
    from elastic_export.checks.compare import relative_error

    m = json.loads((art16 / "manifest.json").read_text())
    rt16 = ElasticRuntime.from_dir(art16, mode=mode, precision="fp16", config=SessionConfig(threads=1))
    rt32 = ElasticRuntime.from_dir(art16, mode=mode, config=SessionConfig(threads=1))
    assert rt16.sparsities == rt32.sparsities == [0.0, 0.3, 0.6]  # elastic mode too: the graph's dense index
    for b in [{**m["dense"], "sparsity": 0.0}, *m["budgets"]]:
        s = b["sparsity"]
        if mode == "per-budget":
            assert rt16.file(s) == b["onnx_fp16"]
            alone = ort.InferenceSession(str(art16 / b["onnx_fp16"]), providers=["CPUExecutionProvider"]).run(None, feeds)
            assert _err(rt16.run(feeds, sparsity=s), alone) == 0.0
        else:
            assert rt16.file(s) == m["elastic"]["onnx_fp16"]
        got16, got32 = rt16.run(feeds, sparsity=s), rt32.run(feeds, sparsity=s)
        assert 0 < relative_error(list(got32.values()), list(got16.values())) <= 1e-2


def test_fp16_precision_needs_fp16_files(art):
    with pytest.raises(UserError, match="--precision fp16"):
        ElasticRuntime.from_dir(art, precision="fp16")
    with pytest.raises(UserError, match="--precision fp16"):
        ElasticRuntime.from_dir(art, mode="elastic", precision="fp16")
    with pytest.raises(UserError, match="precision 'int8'"):
        ElasticRuntime.from_dir(art, precision="int8")


def test_encode_texts_with_the_directory_tokenizer(minilm_small, tmp_path):
    """encode(): the artifact directory's own tokenizer (no model folder needed), equal to running the
    budget on the tokenized inputs; sentence-transformers on the source model agrees at dense."""
    import shutil

    from _helpers import link_copy

    from elastic_export.core.errors import UserError
    from elastic_export.core.manifest import load_manifest
    from elastic_export.models.text import TextEncoder
    from elastic_export.serving.runtime import ElasticRuntime

    d = link_copy(minilm_small, tmp_path / "art")
    m = load_manifest(d)
    assert m["preprocess"] == {"library": "tokenizers", "tokenizer": "tokenizer/tokenizer.json", "max_length": 256}
    rt = ElasticRuntime.from_dir(d)
    texts = ["How do I read a file?", "The with statement closes it for you, even when an exception is raised."]
    emb = rt.encode(texts, sparsity=0.5)
    feeds = TextEncoder.from_dir(d / "tokenizer", rt.input_names).encode(texts)
    np.testing.assert_array_equal(emb, rt.run(feeds, sparsity=0.5)["sentence_embedding"])
    assert feeds["attention_mask"][0].sum() < feeds["attention_mask"][1].sum()  # padded to the longest
    from sentence_transformers import SentenceTransformer

    from elastic_export.models.text import model_folder

    st = SentenceTransformer(str(model_folder(m["model"]["source"])), device="cpu")
    assert np.abs(rt.encode(texts, sparsity=0.0) - st.encode(texts)).max() < 1e-4
    with pytest.raises(UserError, match="no texts"):
        rt.encode([])
    with pytest.raises(UserError, match="must be strings"):
        rt.encode([1, 2])
    shutil.rmtree(d / "tokenizer")  # the model's source folder is the fallback
    assert np.abs(ElasticRuntime.from_dir(d).encode(texts, sparsity=0.5) - emb).max() < 1e-6


def test_machine_line_names_the_cpus_vector_extensions():
    """Benchmarks quote the CPU's int8 / bf16 extensions (they decide which kernels run), read from its flags."""
    from elastic_export.measure.timing import CPU_FEATURES, machine

    flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    host = machine()
    assert host["cpu_features"] == [f for f in CPU_FEATURES if f in flags.split(":", 1)[1].split()]
    assert host["cpu"] and host["logical_cpus"] >= 1
