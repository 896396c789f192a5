"""The Triton router (``elastic_export.targets.triton_router``), a real module copied verbatim as ``model.py``.

The serving modules it is glue over are tested on their own (``test_router_budgets.py``, ``test_router_config.py``,
``test_router_load.py``, ``test_router_health.py``, ``test_router_metrics.py``). Here: the file as a build writes
it, with those modules copied next to it (and loaded from there by a Python without this package); and the model
class, loaded from the ``model.py`` a build wrote, with a tiny stand-in for Triton's in-server
``triton_python_backend_utils`` (``tests/_triton_fake.py``), initialised from the JSON of the ``config.pbtxt`` the
build wrote, forwarding to the repository's real ONNX budget models (run in onnxruntime). ``test_triton.py`` does
the same on the all-MiniLM-L6-v2 repository.
"""

from __future__ import annotations

import json
import threading
import time
import types
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc.model_config_pb2  # noqa: F401 - the test extra's: an import error fails, never skips
from _triton_fake import Request, execute, load_router, start_router
from test_triton import _fake_dir

from elastic_export.serving import router_load
from elastic_export.targets import triton as TR
from elastic_export.targets import triton_router
from elastic_export.targets.triton_router import RouterConfig


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
    assert sorted(p.name for p in (d / "triton").iterdir()) == ["again", "again_index", "again_s000", "again_s025", "again_s050"]


_STANDALONE = r"""
import json, sys, types
sys.modules["triton_python_backend_utils"] = pb = types.ModuleType("triton_python_backend_utils")
try:
    import elastic_export  # noqa: F401
    raise SystemExit("elastic_export is importable here")
except ImportError:
    pass
import importlib.util
spec = importlib.util.spec_from_file_location("model", sys.argv[1])
model = importlib.util.module_from_spec(spec)
spec.loader.exec_module(model)
config = model.RouterConfig(json.loads(sys.argv[2]))
counted = []

class Family:
    COUNTER, GAUGE = "counter", "gauge"

    def __init__(self, name, description, kind):
        pass

    def Metric(self, labels):
        return types.SimpleNamespace(increment=counted.append, set=lambda v: None)

metrics = model.RouterMetrics("elastic", config.sparsities, family=Family)
metrics.count("served", ([0.5], "forwarded"))
metrics.close()
health = model.BudgetHealth(config.sparsities)
health.mark_down(0.5, 0.0)
try:
    model.choose_budget(0.9, config.sparsities, 0.0)
except model.BudgetError as e:
    refused = str(e)
print(json.dumps({"budget": model.choose_budget(0.3, config.sparsities, 0.0), "default": config.default,
                  "route": config.route(model.row_sparsities(None, '{"sparsity": 0.1}', 2)), "refused": refused,
                  "nearest": health.nearest(0.5), "cost": model.length_cost(config, None, None).nominal,
                  "ready": model.wait_ready(["m"], 1, lambda m: True), "counted": len(counted),
                  "modules": sorted(m.__name__ for m in (model.router_budgets, model.router_load, model.router_load.slo)),
                  "files": sorted(m.__file__.rsplit("/", 1)[0] == sys.argv[1].rsplit("/", 1)[0]
                                  for m in (model.router_budgets, model.router_config, model.router_load))}))
"""


def test_the_built_router_loads_without_the_package(tmp_path):
    """The portability promise: a built repository's router (``model.py`` and the serving modules copied next
    to it, verbatim) imports and works in a Python that has numpy but not this package, as a Triton server's
    may: a clean interpreter (``-S -s``, no site-packages but numpy's) imports the copied ``model.py``,
    reads the built config and matches, routes, refuses, counts, waits and prices as the package does."""
    import subprocess
    import sys

    from _triton_fake import model_config_json

    d = _fake_dir(tmp_path / "a")
    TR.build_repository(d, default_sparsity=0.1)
    version = d / "triton" / "elastic" / "1"
    serving = Path(router_load.__file__).parent
    for module in triton_router.SERVING_MODULES:  # verbatim copies of the package's own files
        assert (version / f"{module}.py").read_text() == (serving / f"{module}.py").read_text(), module
    numpy_only = _numpy_only(tmp_path)
    config = model_config_json(d / "triton" / "elastic" / "config.pbtxt")
    run = subprocess.run([sys.executable, "-S", "-s", "-c", _STANDALONE, str(version / "model.py"), config],
                         env={"PYTHONPATH": str(numpy_only), "PATH": "/usr/bin:/bin"}, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["budget"] == 0.5 and got["default"] == 0.25 and got["route"] == [0.25, 0.25]
    assert got["refused"] == "sparsity 0.9 is above the sparsest served budget 0.5; served budgets: 0, 0.25, 0.5"
    assert got["nearest"] == 0.25 and got["cost"] == 16 and got["ready"] is True and got["counted"] > 0
    assert got["modules"] == ["router_budgets", "router_load", "slo"]  # the copies, not the package's
    assert got["files"] == [True, True, True]


def _numpy_only(tmp_path: Path) -> Path:
    """A folder with numpy and its bundled libraries, nothing else of this environment (a PYTHONPATH)."""
    numpy_only = tmp_path / "site"
    numpy_only.mkdir()
    site = Path(np.__file__).parent.parent
    for name in ("numpy", "numpy.libs"):
        if (site / name).exists():
            (numpy_only / name).symlink_to(site / name)
    return numpy_only


def test_a_built_python_budget_model_imports_without_the_package(tmp_path):
    """A Python-backend budget model's ``model.py`` imports in a Python with numpy only, its serving module
    (``length_groups``) from the copy next to it, and that copy groups rows."""
    import subprocess
    import sys

    d = _fake_dir(tmp_path / "a")
    TR.build_repository(d, platform="python", dense=False)
    version = d / "triton" / "elastic_s050" / "1"
    code = ("import importlib.util, json, sys; spec = importlib.util.spec_from_file_location('m', sys.argv[1]); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            "print(json.dumps([m.length_groups.__file__, m.length_groups.length_groups([5] * 8 + [30] * 8)]))")
    run = subprocess.run([sys.executable, "-S", "-s", "-c", code, str(version / "model.py")],
                         env={"PYTHONPATH": str(_numpy_only(tmp_path)), "PATH": "/usr/bin:/bin"}, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    where, groups = json.loads(run.stdout.strip().splitlines()[-1])
    assert Path(where) == version / "length_groups.py"
    assert groups == [list(range(8)), list(range(8, 16))]


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


def test_router_initialises_from_the_built_config(tmp_path, monkeypatch, routers):
    d = _fake_dir(tmp_path / "a")
    TR.build_repository(d, default_sparsity=0.3)  # mapped as a request is: 0.5
    model, _ = routers(d / "triton", "elastic")
    c = model.config
    assert c.models == {0.0: "elastic_s000", 0.25: "elastic_s025", 0.5: "elastic_s050"}
    assert c.sparsities == [0.0, 0.25, 0.5] and c.default == 0.5
    assert c.inputs == ["input_ids", "attention_mask"] and c.outputs == ["last_hidden_state"]
    assert not c.inline and model.sessions is None  # onnxruntime budget models: the router only forwards


def test_router_forwards_each_request_to_its_budget_model(tmp_path, monkeypatch, routers):
    d = _fake_dir(tmp_path / "a")
    TR.build_repository(d, dense=False)
    model, server = routers(d / "triton", "elastic")
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


def test_a_request_costs_its_padded_shape_in_rows_of_the_nominal_length(tmp_path, monkeypatch, routers):
    """The adaptive router measures a row's cost at a short length beside the nominal one (its inline
    session of the densest budget) and charges each request rows x the weight of its padded length: what
    the policy's rate and the admission's rows in flight count."""
    from elastic_export.serving.cost import LengthCost

    d = _fake_dir(tmp_path / "a")  # nominal tokens: 16
    TR.build_repository(d, platform="python", policy="adaptive")
    model, _ = routers(d / "triton", "elastic")
    assert isinstance(model.cost, LengthCost) and model.cost.nominal == 16
    assert [n for n, _ in model.cost.points] == [8, 16] and model.cost.points[-1][1] == 1.0
    assert 0 < model.cost.points[0][1] <= 1.0  # measured, never above the longer row's
    for length in (5, 16, 40):
        ids = np.ones((3, length), dtype=np.int64)
        job = model._accept(Request({"input_ids": ids, "attention_mask": ids}))
        assert job.work == pytest.approx(3 * model.cost.weight(length))
    assert model._accept(Request(_feeds(4))).work == pytest.approx(4 * model.cost.weight(5))
    ids = np.ones((2, 16), dtype=np.int64)
    before = model.routing.policy.row_weight
    execute(model, [Request({"input_ids": ids, "attention_mask": ids})])
    assert model.routing.policy.row_weight == pytest.approx(before)  # nominal rows leave the weight at 1


def test_an_idle_router_runs_a_request_itself_on_the_budget_models_file(tmp_path, monkeypatch, routers):
    """Python budget models: the router holds a session on each one's ``model.onnx`` and runs a request
    itself when nothing else is in flight (no round trip); with others in flight it forwards (the budget
    model's dynamic batcher gathers them). Both answer what the budget model does."""
    d = _fake_dir(tmp_path / "a")
    TR.build_repository(d, platform="python", dense=False)
    model, server = routers(d / "triton", "elastic")
    assert model.config.inline and sorted(model.sessions) == [0.25, 0.5]
    feeds = _feeds()
    (alone,) = execute(model, [Request(feeds, {"sparsity": 0.5})])
    assert server.calls == []
    model.monitor.in_flight += 1  # as if another request were in flight
    (busy,) = execute(model, [Request(feeds, {"sparsity": 0.5})])
    model.monitor.in_flight -= 1
    assert [n for e, n in server.calls if e == "start"] == ["elastic_s050"]
    rate = model.routing.policy.rate.rate
    model.routing.policy.rate.rate = lambda now=None: 1e6  # idle, but the load says the next one is coming
    (loaded,) = execute(model, [Request(feeds, {"sparsity": 0.5})])
    model.routing.policy.rate.rate = rate
    assert [n for e, n in server.calls if e == "start"] == ["elastic_s050"] * 2  # forwarded
    assert not loaded.has_error()
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
def test_router_refuses_bad_requests(tmp_path, monkeypatch, request_kw, message, routers):
    d = _fake_dir(tmp_path / "a")
    TR.build_repository(d)
    model, server = routers(d / "triton", "elastic")
    feeds = _feeds()

    def bad_request() -> Request:
        if "rows" in request_kw:
            return Request({**feeds, "sparsity": np.array([[v] for v in request_kw["rows"]], np.float32)})
        if "drop" in request_kw:
            return Request({k: v for k, v in feeds.items() if k != request_kw["drop"]})
        if "short" in request_kw:
            return Request({**feeds, request_kw["short"]: feeds[request_kw["short"]][:1]})
        return Request(feeds, request_kw)

    (response,) = execute(model, [bad_request()])  # a client's mistake: an error response with INVALID_ARG (HTTP 400)
    assert response.has_error() and message in response.error().message()
    assert response.error().code == response.error().INVALID_ARG and response.output_tensors() == []
    assert server.calls == [] and model.monitor.in_flight == 0  # checked before any budget model is called
    bad_response, good = execute(model, [bad_request(), Request(feeds)])  # beside a valid one: the same
    assert bad_response.has_error() and message in bad_response.error().message()
    assert not good.has_error() and [n for e, n in server.calls if e == "start"] == ["elastic_s000"]


@pytest.mark.parametrize("rows,message", [(0, "no rows (batch size 0)"), (129, "129 rows, more than the 128")])
def test_empty_and_oversized_requests_are_refused_and_change_nothing(tmp_path, monkeypatch, rows, message, routers):
    """0 rows or more than the budget models' max_batch_size: a 400 before anything is counted or run."""
    d = _fake_dir(tmp_path / "a")
    TR.build_repository(d)
    model, server = routers(d / "triton", "elastic")
    ids = np.ones((rows, 4), np.int64)
    (response,) = execute(model, [Request({"input_ids": ids, "attention_mask": ids})])
    assert response.has_error() and message in response.error().message()
    assert response.error().code == response.error().INVALID_ARG
    assert server.calls == [] and model.monitor.in_flight == 0 and model.monitor.rows_at == {}
    (ok,) = execute(model, [Request(_feeds())])  # the router works as before
    assert not ok.has_error() and model.monitor.in_flight == 0


def test_a_budget_model_that_is_gone_is_routed_around_and_used_again_when_back(tmp_path, monkeypatch, routers):
    """Found by the worker after ``execute`` returned: the rows go to the nearest budget up (served_sparsity
    says so), the budget is down until the probe finds it answering again."""
    import shutil

    d = _fake_dir(tmp_path / "a")
    TR.build_repository(d)
    model, server = routers(d / "triton", "elastic")
    gone = d / "triton" / "elastic_s050"
    shutil.move(gone, tmp_path / "away")  # unloaded after the router loaded: the fake server answers "not found"
    (response,) = execute(model, [Request(_feeds(), {"sparsity": 0.5})])
    assert not response.has_error(), response.error().message()
    assert response.as_dict()["served_sparsity"].ravel().tolist() == [0.25, 0.25]  # the nearest budget up
    assert set(model.health.down) == {0.5}
    (again,) = execute(model, [Request(_feeds(), {"sparsity": 0.5})])  # routed around at once now
    assert again.as_dict()["served_sparsity"].ravel().tolist() == [0.25, 0.25]
    shutil.move(tmp_path / "away", gone)  # back: the probe finds it answering
    deadline = time.monotonic() + 30
    while model.health.down:
        assert time.monotonic() < deadline, "the router did not take the budget back"
        time.sleep(0.05)
    (back,) = execute(model, [Request(_feeds(), {"sparsity": 0.5})])
    assert back.as_dict()["served_sparsity"].ravel().tolist() == [0.5, 0.5]


def test_a_budget_model_error_is_an_error_response(tmp_path, monkeypatch, routers):
    d = _fake_dir(tmp_path / "a")
    TR.build_repository(d)
    model, server = routers(d / "triton", "elastic")
    server.fail = "onnxruntime: invalid dims"
    (response,) = execute(model, [Request(_feeds(), {"sparsity": 0.5})])
    assert response.has_error() and response.error().message() == "router: onnxruntime: invalid dims"
    assert response.error().code == response.error().INTERNAL and not model.health.down


# --- rows of one request on several budgets, readiness, load adaptation ---------------------------
def test_each_row_may_name_its_own_budget(tmp_path, monkeypatch, routers):
    """Rows grouped per budget, each group one call, the outputs back in row order."""
    d = _fake_dir(tmp_path / "a")
    TR.build_repository(d)
    model, server = routers(d / "triton", "elastic")
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


def test_adaptive_routing_reads_service_times_from_a_latency_profile(tmp_path):
    from elastic_export.core.latency_profile import save_profile

    profile = {"backend": "onnxruntime", "provider": "cpu",
               "batches": {"1": {"0.0": {"p50_ms": 4.0}, "0.5": {"p50_ms": 2.0}},
                           "8": {"0.0": {"p50_ms": 32.0}, "0.5": {"p50_ms": 16.0}}}}
    path = save_profile(profile, tmp_path)
    config = RouterConfig({"parameters": {"budget_models": {"string_value": '[[0.0, "d"], [0.5, "b"]]'},
                                          "policy": {"string_value": "adaptive"}}, "input": [], "output": []})
    points = triton_router.service_points(config, None, str(path), 16)
    assert points == {0.0: {1: 4.0, 8: 32.0}, 0.5: {1: 2.0, 8: 16.0}}
    routing = triton_router.SloRouting(config, points)
    assert routing.policy.slo_ms == router_load.DEFAULT_SLO_MS and routing.policy.quantile == 0.99
    assert triton_router.service_points(config, None, str(tmp_path / "none.json"), 16) is None


def test_a_routed_request_that_would_miss_the_slo_goes_to_a_faster_budget_before_it_is_refused(tmp_path, monkeypatch, routers):
    """Rows in flight at dense that have waited past the SLO: the policy's pick moves to the next budget with
    nothing ahead; a request naming dense is refused (503) instead."""
    d = _fake_dir(tmp_path / "a")
    TR.build_repository(d)
    model, _ = routers(d / "triton", "elastic")
    model.monitor.arrive(0.0, 64)  # a long one in flight at dense, arrived 10 s ago
    model.monitor._since[0.0] = {model.monitor.last_ticket: (time.monotonic() - 10.0, 64)}
    routed = triton_router._Job(None, None, None, 2, [0.0, 0.0], ())
    routed.budget, routed.routed = 0.0, True
    model._admit(routed)
    assert routed.budget == 0.25 and routed.served == [0.25, 0.25] and routed.admit_raw > 0
    named = triton_router._Job(None, None, None, 2, [0.0, 0.0], ())
    named.budget = 0.0
    with pytest.raises(Exception, match="exceeds the SLO") as err:
        model._admit(named)
    assert type(err.value).__name__ == "Overload" and err.value.reason == "overload"  # the model file's own class


# --- the server's per-batch statistics, as the router reads them ------------------------------------
def _stats(name: str, batches: dict) -> dict:
    """``GET /v2/models/stats`` as Triton 2.51 answers it (the fields the router reads, counts as numbers)."""
    return {"model_stats": [{"name": name, "version": "1", "batch_stats": [
        {"batch_size": n, "compute_input": {"count": c, "ns": int(ms * 0.1e6)},
         "compute_infer": {"count": c, "ns": int(ms * 0.8e6)}, "compute_output": {"count": c, "ns": int(ms * 0.1e6)}}
        for n, (c, ms) in batches.items()]}]}


def test_batch_totals_and_what_ran_between_two_reads():
    from elastic_export.serving import triton_stats as ts

    first = ts.batch_totals(_stats("elastic_dense", {1: (10, 200.0), 4: (2, 150.0)}))
    assert first == {"elastic_dense": {1: (10, pytest.approx(200.0)), 4: (2, pytest.approx(150.0))}}
    second = ts.batch_totals(_stats("elastic_dense", {1: (13, 262.0), 4: (2, 150.0), 2: (1, 41.0)}))
    assert ts.batch_deltas(first, second) == {"elastic_dense": [(1, 3, pytest.approx(62.0)), (2, 1, pytest.approx(41.0))]}
    assert ts.batch_deltas(second, second) == {}  # nothing ran
    reloaded = ts.batch_totals(_stats("elastic_dense", {1: (2, 40.0)}))  # counts reset: from zero
    assert ts.batch_deltas(second, reloaded) == {"elastic_dense": [(1, 2, pytest.approx(40.0))]}
    assert ts.batch_totals({"model_stats": [{"name": "m", "version": "1"}]}) == {"m": {}}


def test_the_router_gives_the_batches_it_reads_to_the_policy(monkeypatch):
    """Two reads of the server's statistics: what ran between them goes to the policy's service scale of
    the budget that ran it, at the router's precision, its rows in rows of the nominal length (the mean
    row weight lately: short rows cost less); the first read only sets the baseline."""
    from elastic_export.serving import triton_stats as ts

    got = []
    reads = iter([_stats("m0", {1: (5, 100.0)}), _stats("m0", {1: (9, 180.0), 2: (1, 35.0)})])
    monkeypatch.setenv(ts.STATS_URL_ENV, "http://127.0.0.1:1")
    monkeypatch.setattr(ts, "fetch", lambda url, timeout_s=1.0: next(reads))
    model = types.SimpleNamespace(
        routing=types.SimpleNamespace(policy=types.SimpleNamespace(served_batches=lambda pair, b, now: got.append((pair, b)),
                                                                   row_weight=0.25)),
        config=types.SimpleNamespace(models={0.0: "m0", 0.5: "m5"}, precision="fp32"),
        _batches_before=None, _lock=threading.Lock())
    read = triton_router.TritonPythonModel
    read._read_batches(model, read._statistics(model))
    assert got == []
    read._read_batches(model, read._statistics(model))
    assert got == [((0.0, "fp32"), [(0.25, 4, pytest.approx(80.0)), (0.5, 1, pytest.approx(35.0))])]


def test_a_budget_model_missing_from_the_servers_statistics_is_down_and_nothing_asks_the_backend(monkeypatch):
    """Readiness comes from the statistics the prober reads anyway (they list the loaded models), not from
    ``pb_utils.is_model_ready``: called while the server stopped, that crashed it. A budget that is back in
    them and answers is up again."""
    def refuse(**kw):
        raise AssertionError("is_model_ready called")

    monkeypatch.setattr(triton_router, "pb_utils", types.SimpleNamespace(is_model_ready=refuse))
    model = types.SimpleNamespace(
        config=types.SimpleNamespace(models={0.0: "m0", 0.5: "m5"}, precision="fp32"),
        health=triton_router.BudgetHealth([0.0, 0.5]), routing=None, _lock=threading.Lock(),
        _answers=lambda s, feeds: True)
    triton_router.TritonPythonModel._probe(model, {}, _stats("m0", {1: (1, 10.0)}))
    assert set(model.health.down) == {0.5}
    triton_router.TritonPythonModel._probe(model, {}, {"model_stats": _stats("m0", {})["model_stats"]
                                                        + _stats("m5", {})["model_stats"]})
    assert not model.health.down
