"""The Triton router (``elastic_export.targets.triton_router``), a real module copied verbatim as ``model.py``.

Its budget choice is tested directly; the model class is loaded from the ``model.py`` a build wrote, with a
tiny stand-in for Triton's in-server ``triton_python_backend_utils`` (``tests/_triton_fake.py``), initialised
from the JSON of the ``config.pbtxt`` the build wrote, and forwards to the repository's real ONNX budget models
(run in onnxruntime). ``test_triton.py`` does the same on the all-MiniLM-L6-v2 repository.
"""

from __future__ import annotations

import json
import re
import threading
import types
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc.model_config_pb2", reason="needs tritonclient (pip install -e \".[test]\")")

from _triton_fake import Request, execute, load_router, start_router  # noqa: E402
from test_triton import _fake_dir  # noqa: E402

from elastic_export.targets import triton as TR  # noqa: E402
from elastic_export.targets import triton_router  # noqa: E402
from elastic_export.targets.triton_router import BudgetError, RouterConfig, choose_budget, row_sparsities  # noqa: E402

# --- the router's budget choice (pure) ------------------------------------------------------------
SERVED = [0.0, 0.1, 0.3, 0.5]


@pytest.mark.parametrize("requested,served", [
    (None, 0.1),  # nothing asked: the default
    (0.0, 0.0), (0.1, 0.1), (0.5, 0.5),  # exact
    (0.1 + 5e-7, 0.1), (0.3 - 5e-7, 0.3),  # within 1e-6
    (0.1 + 2e-6, 0.3), (0.05, 0.1), (0.2, 0.3), (0.45, 0.5),  # else the next sparser: more savings, never less
    ("0.3", 0.3),  # a numeric string (request parameters may carry one)
])
def test_choose_budget(requested, served):
    assert choose_budget(requested, SERVED, default=0.1) == served


@pytest.mark.parametrize("requested,message", [
    (0.6, "above the sparsest served budget 0.5"), (1.0, "outside [0, 1)"), (-0.1, "outside [0, 1)"),
    (float("nan"), "not a finite number"), ("abc", "not a number"), (True, "not a number"),
])
def test_choose_budget_refuses(requested, message):
    with pytest.raises(BudgetError, match=re.escape(message)):
        choose_budget(requested, SERVED, default=0.0)
    with pytest.raises(BudgetError, match="no budgets"):
        choose_budget(0.1, [], default=0.0)


def test_row_sparsities_input_then_parameter():
    assert row_sparsities(None, None, 2) is None and row_sparsities(None, "", 2) is None
    assert row_sparsities(None, json.dumps({"other": 1}), 2) is None
    assert row_sparsities(None, json.dumps({"sparsity": 0.3}), 2) == [0.3, 0.3]
    assert row_sparsities(None, json.dumps({"sparsity": "0.5"}), 1) == [0.5]
    assert row_sparsities([0.1], json.dumps({"sparsity": 0.5}), 3) == [0.1] * 3  # the input wins; one for all rows
    assert row_sparsities([0.1, 0.5], None, 2) == [0.1, 0.5]  # one per row
    with pytest.raises(BudgetError, match=re.escape("sparsity input has 3 values for a batch of 2; send shape [1, 1]")):
        row_sparsities([0.1, 0.5, 0.3], None, 2)
    with pytest.raises(BudgetError, match="has 0 values"):
        row_sparsities([], None, 2)
    with pytest.raises(BudgetError, match="not a JSON object"):
        row_sparsities(None, "{oops", 2)
    with pytest.raises(BudgetError, match="not a number"):
        row_sparsities(None, json.dumps({"sparsity": [0.1]}), 2)


# --- the file ---------------------------------------------------------------------------------------
def test_model_py_is_the_module_file_verbatim(tmp_path):
    src = TR.router_source()
    assert src == Path(triton_router.__file__).read_text()
    assert src == (resources.files("elastic_export.targets") / "triton_router.py").read_text()  # shipped with the package
    assert src.startswith(TR.ROUTER_HEADER)  # how _check_replaceable knows a triton/ is ours
    assert "{{" not in src and "class TritonPythonModel" in src
    d = _fake_dir(tmp_path / "a")
    TR.build_repository(d)
    assert (d / "triton" / "elastic" / "1" / "model.py").read_text() == src
    TR.build_repository(d, name="again")  # the repository it wrote is recognised and replaced
    assert sorted(p.name for p in (d / "triton").iterdir()) == ["again", "again_s000", "again_s025", "again_s050"]


def test_outside_a_server_the_module_imports_and_the_model_refuses(tmp_path, monkeypatch):
    d = _fake_dir(tmp_path / "a")
    TR.build_repository(d)
    module = load_router(d / "triton" / "elastic" / "1" / "model.py", None, monkeypatch)
    assert module.pb_utils is None and module.choose_budget(0.3, [0.0, 0.5], 0.0) == 0.5
    with pytest.raises(RuntimeError, match="inside Triton's Python backend"):
        module.TritonPythonModel().initialize({"model_config": "{}"})


# --- the model, on the config the build wrote ------------------------------------------------------
def _feeds(batch: int = 2) -> dict[str, np.ndarray]:
    ids = np.arange(batch * 5, dtype=np.int64).reshape(batch, 5)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids)}


def test_router_initialises_from_the_built_config(tmp_path, monkeypatch):
    d = _fake_dir(tmp_path / "a")
    TR.build_repository(d, default_sparsity=0.3)  # mapped as a request is: 0.5
    model, _ = start_router(d / "triton", "elastic", monkeypatch)
    c = model.config
    assert c.models == {0.0: "elastic_s000", 0.25: "elastic_s025", 0.5: "elastic_s050"}
    assert c.sparsities == [0.0, 0.25, 0.5] and c.default == 0.5
    assert c.inputs == ["input_ids", "attention_mask"] and c.outputs == ["last_hidden_state"]
    assert not c.inline and model.sessions is None  # onnxruntime budget models: the router only forwards


def test_router_forwards_each_request_to_its_budget_model(tmp_path, monkeypatch):
    d = _fake_dir(tmp_path / "a")
    TR.build_repository(d, dense=False)
    model, server = start_router(d / "triton", "elastic", monkeypatch)
    server.barrier = threading.Barrier(4)  # every call waits until all four are in progress: no serialising
    feeds = _feeds()
    requests = [Request({**feeds, "sparsity": np.full((2, 1), 0.5, np.float32)}),  # the input
                Request(feeds, {"sparsity": 0.1}),  # the parameter: the next sparser budget
                Request(feeds),  # nothing asked: the densest served
                Request(feeds, {"sparsity": 0.25}, outputs=("served_sparsity",))]
    responses = execute(model, requests)
    assert [r.has_error() for r in responses] == [False] * 4
    served = [float(r.as_dict()["served_sparsity"][0, 0]) for r in responses]
    assert served == [0.5, 0.25, 0.25, 0.25]
    assert all(r.as_dict()["served_sparsity"].shape == (2, 1) for r in responses)
    assert responses[0].as_dict()["served_sparsity"].dtype == np.float64  # 0.5 exactly, also as JSON
    assert responses[0].as_dict()["served_precision"].tolist() == [["fp32"], ["fp32"]]
    assert sorted(name for event, name in server.calls if event == "start") == ["elastic_s025"] * 3 + ["elastic_s050"]
    assert [event for event, _ in server.calls][:4] == ["start"] * 4  # forwarded together, not one by one
    want = server.run("elastic_s050", requests[0].tensors[:2], ["last_hidden_state"]).as_dict()["last_hidden_state"]
    np.testing.assert_array_equal(responses[0].as_dict()["last_hidden_state"], want)
    assert sorted(responses[3].as_dict()) == ["served_sparsity"]  # only what was asked for


def test_an_idle_router_runs_a_request_itself_on_the_budget_models_file(tmp_path, monkeypatch):
    """Python budget models: the router holds a session on each one's ``model.onnx`` and runs a request
    itself when nothing else is in flight (no round trip); with others in flight it forwards (the budget
    model's dynamic batcher gathers them). Both answer what the budget model does."""
    d = _fake_dir(tmp_path / "a")
    TR.build_repository(d, platform="python", dense=False)
    model, server = start_router(d / "triton", "elastic", monkeypatch)
    assert model.config.inline and sorted(model.sessions) == [0.25, 0.5]
    feeds = _feeds()
    (alone,) = execute(model, [Request(feeds, {"sparsity": 0.5})])
    assert server.calls == []
    model.monitor.in_flight += 1  # as if another request were in flight
    (busy,) = execute(model, [Request(feeds, {"sparsity": 0.5})])
    model.monitor.in_flight -= 1
    assert [n for e, n in server.calls if e == "start"] == ["elastic_s050"]
    want = server.run("elastic_s050", Request(feeds).tensors, ["last_hidden_state"]).as_dict()["last_hidden_state"]
    for response in (alone, busy):
        assert not response.has_error() and response.as_dict()["served_sparsity"].tolist() == [[0.5], [0.5]]
        np.testing.assert_allclose(response.as_dict()["last_hidden_state"], want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("request_kw,message", [
    ({"sparsity": 0.9}, "above the sparsest served budget 0.5"),
    ({"sparsity": "x"}, "not a number"),
    ({"rows": [0.1, 0.5, 0.5]}, "sparsity input has 3 values for a batch of 2"),
    ({"rows": [0.1, 0.9]}, "above the sparsest served budget 0.5"),
    ({"drop": "attention_mask"}, "missing input 'attention_mask'"),
    ({"short": "attention_mask"}, "input 'attention_mask' has batch 1, input 'input_ids' has batch 2"),
])
def test_router_refuses_bad_requests(tmp_path, monkeypatch, request_kw, message):
    d = _fake_dir(tmp_path / "a")
    TR.build_repository(d)
    model, server = start_router(d / "triton", "elastic", monkeypatch)
    feeds = _feeds()
    if "rows" in request_kw:
        bad = Request({**feeds, "sparsity": np.array([[v] for v in request_kw["rows"]], np.float32)})
    elif "drop" in request_kw:
        bad = Request({k: v for k, v in feeds.items() if k != request_kw["drop"]})
    elif "short" in request_kw:
        bad = Request({**feeds, request_kw["short"]: feeds[request_kw["short"]][:1]})
    else:
        bad = Request(feeds, request_kw)
    with pytest.raises(ValueError, match=re.escape(message)) as err:  # alone in its call: execute raises (a failure)
        model.execute([bad])
    assert type(err.value).__name__ == "BudgetError" and err.value.__cause__ is None
    assert not hasattr(bad, "response") and server.calls == []  # checked before any budget model is called
    bad_response, good = execute(model, [bad, Request(feeds)])  # beside a valid one: an error response instead
    assert bad_response.has_error() and message in bad_response.error().message()
    assert bad_response.error().code == bad_response.error().INVALID_ARG and bad_response.output_tensors() == []
    assert not good.has_error() and [n for e, n in server.calls if e == "start"] == ["elastic_s000"]


def test_a_budget_model_failure_is_an_error_response(tmp_path, monkeypatch):
    """Found by the worker after ``execute`` returned: answered with an error, never left waiting."""
    import shutil

    d = _fake_dir(tmp_path / "a")
    TR.build_repository(d)
    model, server = start_router(d / "triton", "elastic", monkeypatch)
    shutil.rmtree(d / "triton" / "elastic_s050")  # gone after the router loaded: the fake server answers an error
    (response,) = execute(model, [Request(_feeds(), {"sparsity": 0.5})])
    assert response.has_error() and response.error().message() == "router: no model 'elastic_s050'"


class _Family:
    """A stand-in for pb_utils.MetricFamily: every increment with the thread that made it."""

    COUNTER = "counter"
    updates: list = []

    def __init__(self, name, description, kind):
        self.name = name

    def Metric(self, labels):  # noqa: N802 (Triton's name)
        family = self

        class _Metric:
            def increment(self, value):
                _Family.updates.append((family.name, dict(labels), value, threading.current_thread().name))

        return _Metric()


def test_router_metrics_gather_counts_and_update_from_one_thread(monkeypatch):
    monkeypatch.setattr(triton_router, "pb_utils", types.SimpleNamespace(MetricFamily=_Family))
    monkeypatch.setattr(_Family, "updates", [])
    switches = [0]
    metrics = triton_router.RouterMetrics("elastic", [0.0, 0.5], switches=lambda: switches[0])
    threads = [threading.Thread(target=lambda: [metrics.count("served", [0.5, 0.5]) for _ in range(50)])
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    metrics.count("refused", requests=3)
    switches[0] = 2
    metrics.close()  # the last counts flushed
    totals: dict = {}
    for name, labels, value, thread in _Family.updates:
        key = (name, labels.get("outcome") or labels.get("sparsity"))
        totals[key] = totals.get(key, 0) + value
    assert totals == {("elastic_router_requests_total", "served"): 200, ("elastic_router_requests_total", "refused"): 3,
                      ("elastic_router_rows_total", "0.5"): 400, ("elastic_router_switches_total", None): 2}
    assert len(_Family.updates) < 4 * 50  # gathered, not one update per request
    assert {thread for *_, thread in _Family.updates} <= {"router-metrics", threading.current_thread().name}


@pytest.mark.parametrize("parameters,message", [
    ({}, "no parameter 'budget_models'"),
    ({"budget_models": "{oops"}, "is not JSON"),
    ({"budget_models": "[0.1]"}, "expected [[sparsity, model name], ...]"),
    ({"budget_models": "[]"}, "lists no budget models"),
    ({"budget_models": '[[0.5, "m"]]', "default_sparsity": "0.7"}, "above the sparsest served budget"),
])
def test_router_config_errors(parameters, message):
    config = {"parameters": {k: {"string_value": v} for k, v in parameters.items()}, "input": [], "output": []}
    with pytest.raises(ValueError, match=re.escape(message)):
        RouterConfig(config)


# --- rows of one request on several budgets, readiness, load adaptation ---------------------------
def test_each_row_may_name_its_own_budget(tmp_path, monkeypatch):
    """Rows grouped per budget, each group one call, the outputs back in row order."""
    d = _fake_dir(tmp_path / "a")
    TR.build_repository(d)
    model, server = start_router(d / "triton", "elastic", monkeypatch)
    feeds = _feeds(batch=3)
    rows = np.array([[0.5], [0.0], [0.5]], np.float32)
    (response,) = execute(model, [Request({**feeds, "sparsity": rows})])
    got = response.as_dict()
    assert got["served_sparsity"].ravel().tolist() == [0.5, 0.0, 0.5]
    assert sorted(n for e, n in server.calls if e == "start") == ["elastic_s000", "elastic_s050"]
    for i, name in enumerate(["elastic_s050", "elastic_s000", "elastic_s050"]):
        one = {k: v[i:i + 1] for k, v in feeds.items()}
        want = server.run(name, [triton_fake_tensor(k, v) for k, v in one.items()], ["last_hidden_state"])
        np.testing.assert_array_equal(got["last_hidden_state"][i:i + 1], want.as_dict()["last_hidden_state"])


def triton_fake_tensor(name, array):
    from _triton_fake import Tensor

    return Tensor(name, array)


def test_wait_ready_defers_while_the_server_starts_and_names_missing_models():
    clock = iter(range(1000))
    assert triton_router.wait_ready(["a", "b"], 5, lambda m: True, sleep=lambda s: None, clock=lambda: next(clock))

    def starting(model):
        raise RuntimeError("Failed to check model readiness: Server not ready")

    assert triton_router.wait_ready(["a"], 5, starting, sleep=lambda s: None) is False
    with pytest.raises(RuntimeError, match="budget models not ready after 5 s: b"):
        triton_router.wait_ready(["a", "b"], 5, lambda m: m == "a", sleep=lambda s: None, clock=lambda: next(clock))


def test_router_refuses_to_load_in_front_of_a_missing_budget_model(tmp_path, monkeypatch):
    import shutil

    d = _fake_dir(tmp_path / "a")
    TR.build_repository(d)
    shutil.rmtree(d / "triton" / "elastic_s025")  # the fake server reports it not ready
    cfg = (d / "triton" / "elastic" / "config.pbtxt").read_text().replace('"300.0"', '"0.5"')
    (d / "triton" / "elastic" / "config.pbtxt").write_text(cfg)
    monkeypatch.setattr(triton_router.time, "sleep", lambda s: None)
    with pytest.raises(RuntimeError, match="not ready after .* elastic_s025"):
        start_router(d / "triton", "elastic", monkeypatch)


def test_load_adaptive_routing_steps_to_faster_budgets_under_load_and_back():
    """The project's LoadAdaptivePolicy fed with the router's observations: in-flight requests as the
    queue depth, measured latency against the SLO."""
    config = RouterConfig({"parameters": {"budget_models": {"string_value": json.dumps(
        [[0.0, "d"], [0.3, "a"], [0.6, "b"]])}, "policy": {"string_value": "adaptive"},
        "slo_ms": {"string_value": "50"}}, "input": [], "output": []})
    routing = triton_router.AdaptiveRouting(config, None)
    monitor = triton_router.LoadMonitor(clock=iter(np.arange(0, 100, 0.001)).__next__)
    assert routing.choose(monitor, queue=0) == 0.0  # idle: the densest
    assert routing.policy.up_depth == 8  # with an SLO the measured latency steers too: a longer queue is tolerated
    assert [routing.choose(monitor, queue=7) for _ in range(3)] == [0.0] * 3
    served = [routing.choose(monitor, queue=8) for _ in range(3)]
    assert served == [0.3, 0.6, 0.6]  # 8 in flight: one level per arrival, up to the sparsest
    calm = [routing.choose(monitor, queue=0) for _ in range(routing.policy.down_after * 2)]
    assert calm[-1] == 0.0 and routing.policy.switches == 4  # calm again: back to dense, one level at a time
    assert monitor.arrive() == 0 and monitor.in_flight == 1
    monitor.leave(0.0, 45.0)  # the dense budget now answers near the SLO: treated as a full queue
    assert routing.choose(monitor, queue=0) == 0.3


def test_load_monitor_rate_and_service_times():
    clock = iter([0.0, 0.01, 0.02, 0.03, 0.04]).__next__
    monitor = triton_router.LoadMonitor(half_life_s=0.05, clock=clock)
    assert [monitor.arrive() for _ in range(2)] == [0, 1]  # the second joins one in flight
    monitor.leave(0.3, 30.0, alone=False)
    monitor.leave(0.3, 10.0, alone=True)  # answered with nothing else in flight: a service time
    assert monitor.in_flight == 0 and monitor.service_ms == {0.3: 10.0}
    assert monitor.latency_ms[0.3] == pytest.approx(0.8 * 30.0 + 0.2 * 10.0)
    for _ in range(3):
        monitor.arrive()
    assert 20 < monitor.rate < 100  # arrivals every 10 ms: the estimate climbs towards 100/s


def test_adaptive_routing_reads_service_times_from_a_latency_profile(tmp_path):
    from elastic_export.core.latency_profile import save_profile

    profile = {"backend": "onnxruntime", "provider": "cpu",
               "batches": {"1": {"0.0": {"p50_ms": 4.0, "p90_ms": 5.0}, "0.5": {"p50_ms": 2.0, "p90_ms": 2.5}}}}
    path = save_profile(profile, tmp_path)
    config = RouterConfig({"parameters": {"budget_models": {"string_value": '[[0.0, "d"], [0.5, "b"]]'},
                                          "policy": {"string_value": "adaptive"}}, "input": [], "output": []})
    routing = triton_router.AdaptiveRouting(config, str(path))
    assert routing.policy.service_ms == {(0.0, "fp32"): 4.0, (0.5, "fp32"): 2.0}
    monitor = triton_router.LoadMonitor()
    monitor.rate = 300.0  # 300 requests/s x 4 ms = 1.2: dense cannot keep up; 0.5 (0.6) can
    assert routing.choose(monitor, queue=0) == 0.5
    monitor.service_ms = {0.5: 0.5}  # measured here: 4x faster than the profile says, dense too then
    calm = [routing.choose(monitor, queue=0) for _ in range(routing.policy.down_after)]
    assert calm[-1] == 0.0 and routing.policy.service_ms == {(0.0, "fp32"): 1.0, (0.5, "fp32"): 0.5}


def _adaptive(budgets, slo_ms="50"):
    config = RouterConfig({"parameters": {"budget_models": {"string_value": json.dumps(
        [[s, f"m{i}"] for i, s in enumerate(budgets)])}, "policy": {"string_value": "adaptive"},
        "slo_ms": {"string_value": slo_ms}}, "input": [], "output": []})
    return triton_router.AdaptiveRouting(config, None)


def _arrive(routing, monitor) -> float:
    """One arrival as the router handles it: counted, routed by the policy, counted at its budget."""
    monitor.arrive()
    chosen = routing.choose(monitor)
    monitor.start(chosen)
    return chosen


def test_adaptive_routing_counts_the_queue_at_the_budget_it_serves():
    """A burst at dense steps up once: the requests still in flight at dense do not push every later
    arrival one budget further (each step would put one more budget model to work beside the others)."""
    routing = _adaptive([0.0, 0.3, 0.6])
    monitor = triton_router.LoadMonitor(clock=iter(np.arange(0, 100, 0.001)).__next__)
    assert [_arrive(routing, monitor) for _ in range(8)] == [0.0] * 8
    assert monitor.at == {0.0: 8}
    later = [_arrive(routing, monitor) for _ in range(5)]
    assert later == [0.3] * 5  # 8 ahead at dense: one step; the queue at 0.3 is short: no more
    assert monitor.in_flight == 13 and monitor.at == {0.0: 8, 0.3: 5}
    monitor.leave(0.0, 40.0, budget=0.0)
    assert monitor.at[0.0] == 7 and monitor.in_flight == 12


def test_adaptive_routing_takes_latency_samples_only_since_its_last_switch():
    """A request that arrived before the switch and answers late measures the overload that caused the
    switch, not the budget switched to; one that arrived after it does."""
    routing = _adaptive([0.0, 0.3, 0.6])
    monitor = triton_router.LoadMonitor(clock=iter(np.arange(0, 100, 0.001)).__next__)
    for _ in range(9):
        _arrive(routing, monitor)
    assert routing.policy.select(1)[0] == 0.3 and routing.switched_at == monitor.last_arrival
    monitor.leave(0.3, 45.0, budget=0.3, fresh=False)  # near the SLO, but from before the switch
    assert 0.3 not in monitor.latency_ms and _arrive(routing, monitor) == 0.3
    monitor.leave(0.3, 45.0, budget=0.3, fresh=True)
    assert monitor.latency_ms[0.3] == 45.0 and _arrive(routing, monitor) == 0.6
