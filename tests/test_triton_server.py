"""A real Triton Inference Server (2.51, CPU, Python backend, from the ``serve`` extra's ``nvidia-pytriton``
wheel) serving what ``elastic-export serve`` builds for the real all-MiniLM-L6-v2, with an index (``elastic-export
index``) over the documents of held-out query/document pairs, so that the same server offers search.

The server binds to 127.0.0.1 only, on a block of three ports the OS reports free (a start that finds one
taken after all is retried on another block), every request is bounded in count and has a client timeout,
and every server is stopped by its own process id (its process group: the Python backend stubs go with it).
Nothing here asserts on time: the head-of-line figure is measured by ``benchmarks/serve_triton.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient  # the test extra's: an import error fails, never skips
import tritonclient.http as httpclient
from _helpers import (
    READY_S,
    PortInUse,
    busy_port,
    link_copy,
    on_a_free_block,
    serve_process,
    stop_process,
    tritonserver_of,
    wait_for_line,
)
from test_index import assert_same_top, brute_force, write_jsonl
from tritonclient.utils import InferenceServerException

from elastic_export.core.errors import UserError
from elastic_export.core.manifest import load_manifest
from elastic_export.targets import tritonserver as TS

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
TIMEOUT_S = 60  # every client call
SETTLE_S = 60.0  # every wait for the router's counts and gauges (flushed every 0.5 s): it bounds a hang, nothing else


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _gone(pids, timeout_s: float = 30.0) -> list[int]:
    """The pids of ``pids`` still alive (or their process group still populated, for a group leader)
    after up to ``timeout_s``, polled."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [pid for pid in pids if TS.alive(pid)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def _assert_server_gone(server_pid: int, serve_pid: int | None = None) -> None:
    """Neither tritonserver (its own session and group: the stubs are in it) nor serve's group runs."""
    assert not _gone([server_pid]), f"tritonserver {server_pid} outlived serve"
    deadline = time.monotonic() + 30  # the stubs exit about 2 s after their server when it was killed
    while _group_alive(server_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _group_alive(server_pid), "a process of tritonserver's group (a stub) is still running"
    assert serve_pid is None or not _group_alive(serve_pid), "a process of serve's group is still running"


def short_pairs(directory: Path, n: int = 300, tokens: int = 30) -> list[dict]:
    """``n`` held-out query/document pairs cut at a word to at most ``tokens`` tokens (``fit_pairs``), so
    that ``elastic-export eval`` (which truncates at the manifest's N, 32 here) and the server (the model's
    own context) see the same tokens."""
    from elastic_export.data.retrieval_data import fit_pairs, heldout_pairs
    from elastic_export.models.text import TextEncoder

    tokenizer = TextEncoder.from_dir(directory / "tokenizer", ["input_ids"]).tokenizer
    return fit_pairs(heldout_pairs(n + 20), tokenizer, tokens)[:n]


@pytest.fixture(scope="module")
def served(minilm_small, tmp_path_factory):
    """``elastic-export serve`` on a copy of the small MiniLM export (the repository built by serve itself)
    with an index over :func:`short_pairs`' documents (ids ``p0`` ...). Its teardown proves that neither
    serve nor its tritonserver (with the stubs) outlives the module."""
    from elastic_export.index.build import build_index

    root = tmp_path_factory.mktemp("served")
    d = link_copy(minilm_small, root / "art", ignore=("triton", "index"))
    pairs = short_pairs(d)
    build_index(d, write_jsonl(root / "corpus.jsonl", [{"id": f"p{i}", "text": p["doc"]} for i, p in enumerate(pairs)]),
                progress=False)
    p, port, lines = serve_process(d)
    info = {"dir": d, "port": port, "lines": lines, "process": p, "server_pid": p.server_pid, "pairs": pairs}
    try:
        assert p.server_pid is not None, "serve's tritonserver not found among its children"
        yield info
    finally:
        regions = TS.shm_regions(p.server_pid) if p.server_pid else []
        code, rest = stop_process(p)
        info["stopped"] = (code, rest)
    assert code == 0 and rest.splitlines()[-1:] == ["stopped"], rest
    _assert_server_gone(p.server_pid, p.pid)
    assert regions and not _left_in_shm(regions), "serve's stop leaves no stub's shared memory behind"


def _scratch(server_pid: int) -> Path:
    """The server's scratch folder (its backends and, for serve, its log), read from its command line."""
    return Path(next(a for a in TS.cmdline(server_pid) if a.startswith("--backend-directory=")).split("=", 1)[1]).parent


def _control_headers(server_pid: int, protocol: str = "http") -> dict[str, str]:
    """The model-repository API's header, read from the server's environment (readable by its own user
    only; serve overwrites it in the server's command line once the server answers)."""
    env = dict(x.split(b"=", 1) for x in Path(f"/proc/{server_pid}/environ").read_bytes().split(b"\0") if b"=" in x)
    key, _, secret = env[TS.STATS_HEADER_ENV.encode()].decode().partition("=")
    assert key == TS.CONTROL_HEADER and secret
    assert not any(secret in a for a in TS.cmdline(server_pid))
    return {(key if protocol == "http" else TS.GRPC_HEADER_PREFIX + key): secret}


def _feeds(batch: int = 3, length: int = 12, seed: int = 0) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(seed).integers(1000, 20000, (batch, length)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[-1, length // 2:] = 0
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}


def _inputs(module, feeds: dict[str, np.ndarray], sparsity: np.ndarray | None = None, text=None) -> list:
    items = []
    for name, arr in feeds.items():
        items.append(module.InferInput(name, list(arr.shape), "INT64"))
        items[-1].set_data_from_numpy(arr)
    if sparsity is not None:
        items.append(module.InferInput("sparsity", list(sparsity.shape), "FP32"))
        items[-1].set_data_from_numpy(sparsity.astype(np.float32))
    if text is not None:
        arr = np.array([t.encode() for t in text], dtype=object)
        items.append(module.InferInput("text", [len(text)], "BYTES"))
        items[-1].set_data_from_numpy(arr)
    return items


def _metric(port: int, name: str, **labels) -> float:
    if name.startswith("elastic_router_"):  # the router "elastic"'s, not a copy's loaded beside it
        labels.setdefault("router", "elastic")
    text = urllib.request.urlopen(f"http://127.0.0.1:{port + 2}/metrics", timeout=TIMEOUT_S).read().decode()
    return _scraped(text, name, **labels)


def _scraped(text: str, name: str, **labels) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no metric {name} {labels}")


def _settled(port: int, name: str, timeout_s: float = SETTLE_S, **labels) -> float:
    """The router's metric with every request answered so far counted in it. The router adds its counts
    every ``RouterMetrics.FLUSH_S``, one counter after another; so polled (bounded) until its requests
    (every outcome) equal Triton's own count of the router's requests (success + BACKEND failure), with
    the metric the same in two scrapes in a row."""
    from elastic_export.targets.triton_router import RouterMetrics

    url, last = f"http://127.0.0.1:{port + 2}/metrics", None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = urllib.request.urlopen(url, timeout=TIMEOUT_S).read().decode()
        router = sum(_scraped(text, "elastic_router_requests_total", router="elastic", outcome=o)
                     for o in RouterMetrics.OUTCOMES)
        triton = (_scraped(text, "nv_inference_request_success", model="elastic")
                  + _scraped(text, "nv_inference_request_failure", model="elastic", reason="BACKEND"))
        value = _scraped(text, name, **({"router": "elastic"} if name.startswith("elastic_router_") else {}), **labels)
        if router == triton and last == value:
            return value
        last = value if router == triton else None
        time.sleep(0.05)
    raise AssertionError(f"the router's counts never caught up with Triton's ({router} != {triton})")


def _metric_reaches(port: int, value: float, name: str, **labels) -> float:
    """The metric once it reaches ``value`` (the router updates it just after it answers), polled until
    :data:`SETTLE_S`."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        got = _metric(port, name, **labels)
        if got >= value or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def test_every_model_is_ready_and_the_endpoints_are_printed(served):
    d, port = served["dir"], served["port"]
    ready = served["lines"][-1]
    assert f"HTTP http://127.0.0.1:{port}" in ready and f"gRPC 127.0.0.1:{port + 1}" in ready
    assert f"metrics http://127.0.0.1:{port + 2}/metrics" in ready
    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=TIMEOUT_S)
    try:
        assert client.is_server_ready()
        index = {m["name"]: m["state"] for m in client.get_model_repository_index(headers=_control_headers(served["server_pid"]))}
        t = load_manifest(d)["triton"]
        assert t["search"]["name"] == "elastic_search" and t["search"]["count"] == len(served["pairs"])
        assert t["index"]["name"] == "elastic_index" and t["index"]["nice"] == 19  # the lane for documents
        assert index == {n: "READY" for n in [t["router"], t["search"]["name"], t["index"]["name"],
                                              *(m["name"] for m in t["models"])]}
        assert f"+ search 'elastic_search' ({len(served['pairs'])} documents);" in ready
        assert {m["platform"] for m in t["models"]} == {"python"}  # this server has no onnxruntime backend
    finally:
        client.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_served_outputs_equal_the_runtime(served, protocol):
    """Every budget, asked for by input, by parameter, per row and by default, answers what
    ElasticRuntime.run answers for the same input (the same ONNX files run by onnxruntime). By default:
    a copy of the router with no load behind it (whatever ran before) serves the dense budget."""
    from elastic_export.serving.runtime import ElasticRuntime

    d, port = served["dir"], served["port"]
    module = httpclient if protocol == "http" else grpcclient
    url = f"127.0.0.1:{port}" if protocol == "http" else f"127.0.0.1:{port + 1}"
    client = (httpclient.InferenceServerClient(url, network_timeout=TIMEOUT_S) if protocol == "http"
              else grpcclient.InferenceServerClient(url))
    rt = ElasticRuntime.from_dir(d)
    feeds = _feeds()
    kw = {} if protocol == "http" else {"client_timeout": TIMEOUT_S}
    try:
        cases = [(np.full((1, 1), 0.5), None, [0.5] * 3), (np.array([[0.1], [0.0], [0.5]]), None, [0.1, 0.0, 0.5]),
                 (None, {"sparsity": 0.3}, [0.5] * 3), (None, None, [0.0] * 3)]
        for sparsity, params, want_served in cases:
            if sparsity is None and params is None:  # the policy's choice: of a router nothing loaded
                with _router_copy(served, f"elastic_idle_{protocol}") as idle:
                    res = client.infer(idle, _inputs(module, feeds), **kw)
            else:
                res = client.infer("elastic", _inputs(module, feeds, sparsity), parameters=params, **kw)
            served_s = res.as_numpy("served_sparsity")
            assert served_s.dtype == np.float64 and served_s.ravel().tolist() == want_served
            assert res.as_numpy("served_precision").ravel().tolist() == [b"fp32"] * 3
            for row, s in enumerate(want_served):
                want = rt.run({k: v[row:row + 1] for k, v in feeds.items()}, sparsity=s)
                for name in ("sentence_embedding", "last_hidden_state"):
                    got = res.as_numpy(name)[row:row + 1]
                    assert np.abs(got - want[name]).max() <= 1e-5, (protocol, sparsity, params, name)
    finally:
        client.close()


def _forwarding_router(repository: Path) -> str:
    """``benchmarks/serve_triton.py``'s copy of the router with ``inline: "0"``, written into ``repository``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("serve_triton", Path(__file__).parents[1] / "benchmarks" / "serve_triton.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.add_bls_router(repository, "elastic")


@contextlib.contextmanager
def _router_copy(served, name: str, service_ms: float | None = None):
    """A copy of serve's router named ``name``, loaded beside it with serve's key and unloaded (its folder
    removed) on leaving: a router with nothing behind it (no load, no scales, no row weight), whatever ran
    on ``served`` before. Serve does not watch it. ``service_ms``: the copy never runs a request itself
    (``inline: "0"``) and its policy starts from a latency profile written next to it, every budget
    ``service_ms`` at batch 8 (so its service model is exactly ``Affine(0, service_ms / 8)``); else it is
    the router as served (inline, its service times measured on its own sessions at load)."""
    from elastic_export.serving import router_config
    from elastic_export.targets import triton_router as R

    repository = served["dir"] / "triton"
    shutil.rmtree(repository / name, ignore_errors=True)
    shutil.copytree(repository / "elastic", repository / name, symlinks=True)
    cfg = repository / name / "config.pbtxt"
    text = cfg.read_text().replace('name: "elastic"', f'name: "{name}"', 1)
    if service_ms is not None:
        inline = f'key: "{router_config.INLINE_PARAMETER}"\n    value {{ string_value: "1" }}'
        assert inline in text, text
        text = text.replace(inline, inline.replace('"1"', '"0"'))
        sparsities = [m["sparsity"] for m in load_manifest(served["dir"])["triton"]["models"]]
        profile = {"backend": "onnxruntime", "provider": "cpu",
                   "batches": {"8": {("0.0" if s == 0 else f"{s:g}"): {"p50_ms": service_ms} for s in sparsities}}}
        (repository / name / "1" / R.PROFILE_FILE).write_text(json.dumps(profile))
    cfg.write_text(text)
    control = _control_headers(served["server_pid"], "grpc")
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{served['port'] + 1}")
    try:
        client.load_model(name, headers=control, client_timeout=READY_S)
        yield name
    finally:
        try:
            client.unload_model(name, headers=control, client_timeout=TIMEOUT_S)
        finally:
            client.close()
            shutil.rmtree(repository / name, ignore_errors=True)


def _router_tokens(served) -> int:
    """The router's nominal tokens (its config's ``warmup_tokens``): a row of that length weighs exactly 1."""
    from elastic_export.serving import router_config

    text = (served["dir"] / "triton" / "elastic" / "config.pbtxt").read_text()
    return int(re.search(rf'key: "{router_config.TOKENS_PARAMETER}"\s*value {{ string_value: "(\d+)" }}', text).group(1))


def test_a_router_that_always_forwards_answers_the_same(served):
    """Idle, the router runs a request itself (the tests above); its copy with ``inline: "0"`` sends every
    request to the budget model (BLS, as with onnxruntime or TensorRT budget models): the same answers,
    and the budget model counts each one."""
    from elastic_export.serving.runtime import ElasticRuntime

    d, port = served["dir"], served["port"]
    name = _forwarding_router(d / "triton")
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port + 1}")

    def budget_successes() -> int:
        stats = client.get_inference_statistics("elastic_s050", as_json=True, client_timeout=TIMEOUT_S)
        return int(stats["model_stats"][0]["inference_stats"]["success"].get("count", 0))

    control = _control_headers(served["server_pid"], "grpc")  # serve's own key: the API is closed to clients
    try:
        client.load_model(name, headers=control, client_timeout=TIMEOUT_S)
        feeds, before = _feeds(), budget_successes()
        res = client.infer(name, _inputs(grpcclient, feeds, np.full((1, 1), 0.5)), client_timeout=TIMEOUT_S)
        want = ElasticRuntime.from_dir(d).run(feeds, sparsity=0.5)
        assert np.abs(res.as_numpy("sentence_embedding") - want["sentence_embedding"]).max() <= 1e-5
        assert res.as_numpy("served_sparsity").ravel().tolist() == [0.5] * 3
        assert budget_successes() == before + 1
    finally:
        try:
            client.unload_model(name, headers=control, client_timeout=TIMEOUT_S)
        finally:
            client.close()
            shutil.rmtree(d / "triton" / name, ignore_errors=True)


def test_text_in_embedding_out(served):
    from elastic_export.serving.runtime import ElasticRuntime

    d, port = served["dir"], served["port"]
    texts = ["How do I read a file in Python?", "The with statement closes it for you."]
    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=TIMEOUT_S)
    try:
        res = client.infer("elastic", _inputs(httpclient, {}, text=texts), parameters={"sparsity": 0.1})
        want = ElasticRuntime.from_dir(d).encode(texts, sparsity=0.1)
        assert np.abs(res.as_numpy("sentence_embedding") - want).max() <= 1e-5
        assert res.as_numpy("served_sparsity").ravel().tolist() == [0.1, 0.1]
        with pytest.raises(Exception, match="either 'text' or the model inputs"):
            client.infer("elastic", _inputs(httpclient, _feeds(2), text=texts))
    finally:
        client.close()


def _triton_counts(port: int, want: tuple[float, float] | None = None) -> tuple[float, float]:
    """Triton's own ``nv_inference_request_success`` / ``_failure`` of the router: once they equal ``want``
    (polled until :data:`SETTLE_S`: Triton counts a failure just after it sends the error), else as they are."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        got = (_metric(port, "nv_inference_request_success", model="elastic"),
               _metric(port, "nv_inference_request_failure", model="elastic", reason="BACKEND"))
        if want is None or got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def _bad_inputs(kind: str) -> tuple[list, dict | None]:
    """A client's mistake of ``kind``: the HTTP inputs and the request parameters."""
    feeds, sparsity, params = _feeds(), None, None
    if kind == "above":
        sparsity = np.full((1, 1), 0.61)
    elif kind == "nan":
        sparsity = np.full((1, 1), np.nan)
    elif kind == "outside":
        params = {"sparsity": 1.5}
    elif kind == "rows":
        sparsity = np.full((2, 1), 0.1)
    elif kind == "missing":
        feeds.pop("attention_mask")
    elif kind == "empty":
        feeds = {k: v[:0] for k, v in feeds.items()}
    elif kind == "oversized":
        feeds = _feeds(batch=129, length=4)
    if kind == "utf8":
        text = httpclient.InferInput("text", [1], "BYTES")
        text.set_data_from_numpy(np.array([b"caf\xe9 \xff"], dtype=object))
        return [text], None
    return _inputs(httpclient, feeds, sparsity), params


@pytest.mark.parametrize("kind,message", [
    ("above", "above the sparsest served budget 0.5"),
    ("nan", "not a finite number"),
    ("outside", "outside [0, 1)"),
    ("rows", "sparsity input has 2 values for a batch of 3"),
    ("missing", "missing input 'attention_mask' (or 'text')"),
    ("empty", "the request has no rows (batch size 0)"),
    ("oversized", "the request has 129 rows, more than the 128 a request may have"),
    ("utf8", "text 0 is not valid UTF-8"),
])
def test_client_mistakes_are_400_with_one_line_and_change_nothing(served, kind, message):
    """A client's mistake: HTTP 400 with the router's one line, counted as refused (bad_request); Triton
    counts the error response as a success (docs/serving.md); nothing stays in flight, the next request
    is served as before."""
    port = served["port"]
    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=TIMEOUT_S)
    try:
        success, failure = _triton_counts(port)
        refused = _settled(port, "elastic_router_refused_total", reason="bad_request")
        inputs, params = _bad_inputs(kind)
        with pytest.raises(InferenceServerException) as err:
            client.infer("elastic", inputs, parameters=params)
        assert err.value.status() == "400" and message in err.value.message(), str(err.value)
        assert "\n" not in err.value.message() and "Traceback" not in err.value.message()
        assert _triton_counts(port, (success + 1, failure)) == (success + 1, failure)
        assert _metric_reaches(port, refused + 1, "elastic_router_refused_total", reason="bad_request") == refused + 1
        res = client.infer("elastic", _inputs(httpclient, _feeds(), np.full((1, 1), 0.5)))
        assert res.as_numpy("served_sparsity").ravel().tolist() == [0.5] * 3
        assert _gauge_settles(port, "elastic_router_in_flight", 0.0) == 0.0
    finally:
        client.close()


def _gauge_settles(port: int, name: str, want: float, **labels) -> float:
    """The router's gauge once it reads ``want`` (set by its metrics thread every 0.5 s), polled until
    :data:`SETTLE_S`."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        try:
            got = _metric(port, name, **labels)
        except AssertionError:  # not set yet
            got = None
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def test_served_requests_are_successes_in_tritons_statistics(served):
    """The statistics extension (gRPC) and the metrics agree: a served request is a success, and so is a
    refused one (an error response: INVALID_ARGUMENT)."""
    port = served["port"]
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port + 1}")

    def counts() -> tuple[int, int]:
        stats = client.get_inference_statistics("elastic", as_json=True, client_timeout=TIMEOUT_S)
        s = stats["model_stats"][0]["inference_stats"]
        return int(s["success"].get("count", 0)), int(s["fail"].get("count", 0))

    try:
        success, failure = counts()
        metrics = _triton_counts(port)
        assert metrics == (success, failure)
        for sparsity in (0.5, 0.1, None):  # served (the policy's choice for None)
            s = None if sparsity is None else np.full((1, 1), sparsity)
            client.infer("elastic", _inputs(grpcclient, _feeds(), s), client_timeout=TIMEOUT_S)
        with pytest.raises(InferenceServerException, match="above the sparsest served budget") as err:
            client.infer("elastic", _inputs(grpcclient, _feeds(), np.full((1, 1), 0.9)), client_timeout=TIMEOUT_S)
        assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
        want = (success + 4, failure)
        assert _triton_counts(port, want) == want
        assert counts() == want
    finally:
        client.close()


def _nominal_feeds(served, batch: int) -> dict[str, np.ndarray]:
    """``batch`` rows of the router's nominal length (each weighs exactly 1 in its row weight), no padding."""
    feeds = _feeds(batch=batch, length=_router_tokens(served))
    feeds["attention_mask"][:] = 1
    return feeds


def _one_flush(port: int, router: str, names: tuple[str, ...]) -> dict[str, float]:
    """The router's gauges ``names`` as one flush set them: scraped until two scrapes in a row agree (a
    scrape while the flush sets them one after another mixes two flushes), bounded by :data:`SETTLE_S`."""
    url, last = f"http://127.0.0.1:{port + 2}/metrics", None
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        text = urllib.request.urlopen(url, timeout=TIMEOUT_S).read().decode()
        got = {n: _scraped(text, f"elastic_router_{n}", router=router) for n in names}
        if got == last:
            return got
        last = got
    raise AssertionError(f"the gauges of {router} never read the same twice in a row: {last}")


SERVICE_MS = 8.0  # a router copy's modelled service time at batch 8 (every budget): 1 ms a row


def test_the_operators_gauges(served):
    """What the policy serves, at what SLO, the budgets up, requests per budget and path: on the metrics
    port (serve's router). The predictions, on a copy of the router with nothing behind it whose service
    model is known exactly (:func:`_router_copy`, SERVICE_MS at batch 8) and whose rows weigh exactly 1
    (the nominal length): with fewer batches than a scale needs (``ServiceScale.min_batches``, 20) both
    corrections are exactly 1; the densest budget's prediction is the overhead plus the queueing model's
    quantile at the arrival rate, the three read from one flush; the overhead (the p90 of each answer's
    time outside the budget model) is at most the measured latency quantile; the prediction for the
    budget served at least one row's modelled service time."""
    from elastic_export.serving.slo import DEFAULT_QUANTILE, ServiceScale, fit_affine, predict_quantile_ms

    port = served["port"]
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port + 1}")
    def per_budget(s: float) -> float:
        return sum(_metric(port, "elastic_router_served_total", sparsity=f"{s:g}", path=p) for p in ("inline", "forwarded"))

    try:
        res = client.infer("elastic", _inputs(grpcclient, _feeds()), client_timeout=TIMEOUT_S)
        served_s = float(res.as_numpy("served_sparsity")[0, 0])
        _settled(port, "elastic_router_requests_total", outcome="served")
        before = per_budget(served_s)
        for _ in range(3):
            res = client.infer("elastic", _inputs(grpcclient, _feeds(), np.full((1, 1), served_s)), client_timeout=TIMEOUT_S)
        assert _gauge_settles(port, "elastic_router_slo_ms", 250.0) == 250.0
        assert _gauge_settles(port, "elastic_router_served_sparsity", served_s) == served_s
        assert _gauge_settles(port, "elastic_router_budget_up", 1.0, sparsity="0.1") == 1.0
        _settled(port, "elastic_router_requests_total", outcome="served")
        assert per_budget(served_s) == before + 3  # the requests the router runs itself counted too

        quantile = load_manifest(served["dir"])["triton"].get("slo_quantile") or DEFAULT_QUANTILE
        with _router_copy(served, "elastic_gauges", service_ms=SERVICE_MS) as name:
            requests = 4
            assert requests < ServiceScale().min_batches
            for _ in range(requests):
                res = client.infer(name, _inputs(grpcclient, _nominal_feeds(served, 2), np.full((1, 1), 0.1)),
                                   client_timeout=TIMEOUT_S)
                assert res.as_numpy("served_sparsity").ravel().tolist() == [0.1, 0.1]
            assert _metric_reaches(port, requests, "elastic_router_requests_total", router=name,
                                   outcome="served") == requests
            g = _one_flush(port, name, ("latency_correction", "densest_latency_correction", "arrival_rate",
                                        "overhead_ms", "densest_predicted_latency_ms", "predicted_latency_ms",
                                        "measured_latency_ms"))
        assert g["latency_correction"] == 1.0 and g["densest_latency_correction"] == 1.0, g
        service = fit_affine({8: SERVICE_MS})
        want = g["overhead_ms"] + predict_quantile_ms(service, g["arrival_rate"], quantile)
        assert g["densest_predicted_latency_ms"] == pytest.approx(want, rel=1e-9), (g, want)
        assert g["arrival_rate"] > 0 and 0 <= g["overhead_ms"] <= g["measured_latency_ms"], g
        assert g["predicted_latency_ms"] >= service.ms(1), g
    finally:
        client.close()


def test_the_router_logs_the_service_times_it_starts_from(served):
    """One line in the server's log: every budget's service times at batch 1 and 8, as measured at start-up
    (what the policy's predictions rest on; a start-up slowed by other work shows there)."""
    log = (_scratch(served["server_pid"]) / "server.log").read_text(errors="replace")
    line = next(ln for ln in log.splitlines() if "router: service times" in ln)
    times = dict(part.split(": ") for part in line.split("8): ", 1)[1].rstrip('"').split("; "))
    budget_models = sorted(int(m.name[-3:]) / 100 for m in (served["dir"] / "triton").glob("elastic_s[0-9][0-9][0-9]"))
    assert sorted(map(float, times)) == budget_models and len(budget_models) >= 2, line
    for one_eight in times.values():
        one, eight = map(float, one_eight.split(" / "))
        assert 0 < one < eight, line


def _batch_ms(port: int, headers: dict[str, str], model: str, rows: int) -> tuple[int, float]:
    """``model``'s batches of ``rows`` rows so far and their time in all (ms), from the server's statistics
    as the router reads them (:func:`~elastic_export.serving.triton_stats.batch_totals`)."""
    from elastic_export.serving import triton_stats

    req = urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/{model}/stats", headers=headers)
    stats = json.loads(urllib.request.urlopen(req, timeout=TIMEOUT_S).read())
    return triton_stats.batch_totals(stats).get(model, {}).get(rows, (0, 0.0))


def test_the_service_scale_is_read_from_the_servers_batch_statistics(served):
    """The router reads its budget models' batch times from the server's statistics (where ``serve`` told
    it through the environment) and scales its service model by them. Forced: a copy of the router with
    nothing behind it whose service model is known exactly (:func:`_router_copy`: the dense budget ``T`` ms
    at batch 8, ``T`` a third of what a batch of 8 takes the dense budget model here), then batches of 8
    rows sent to the dense budget model itself, one at a time (each one's time read from the statistics,
    nothing else run there), until the copy's scale gauge leaves 1 (bounded). The scale is the batches'
    measured time over the modelled, each weighted by its age: every value lies between the least and
    the greatest batch's ratio, within the scale's clamp."""
    from elastic_export.serving.slo import ServiceScale

    port, model = served["port"], "elastic_s000"
    headers = _control_headers(served["server_pid"])
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port + 1}")
    inputs = _inputs(grpcclient, _nominal_feeds(served, 8))

    def one_batch() -> float:
        count, ms = _batch_ms(port, headers, model, 8)
        client.infer(model, inputs, client_timeout=TIMEOUT_S)
        deadline = time.monotonic() + SETTLE_S  # the server counts a batch just after it answers
        while (after := _batch_ms(port, headers, model, 8))[0] == count and time.monotonic() < deadline:
            time.sleep(0.005)
        assert after[0] == count + 1, f"{after[0] - count} batches of 8 ran at the dense budget, not 1"
        return after[1] - ms

    try:
        service_ms = float(np.median([one_batch() for _ in range(5)])) / 3
        lo, hi = ServiceScale().bounds
        ratios, scale, deadline = [], 0.0, time.monotonic() + 120
        with _router_copy(served, "elastic_scale", service_ms=service_ms) as name:
            while scale in (0.0, 1.0):  # 0: no flush yet; 1: fewer than 20 batches read
                assert time.monotonic() < deadline, f"the scale never moved after {len(ratios)} batches"
                ratios += [one_batch() / service_ms for _ in range(10)]
                scale = _metric(port, "elastic_router_latency_correction", router=name)
            densest = _metric(port, "elastic_router_densest_latency_correction", router=name)
        low, high = min(max(min(ratios), lo), hi), min(max(max(ratios), lo), hi)
        assert low * (1 - 1e-9) <= scale <= high * (1 + 1e-9), (scale, low, high, len(ratios))
        assert low * (1 - 1e-9) <= densest <= high * (1 + 1e-9), (densest, low, high)  # the dense budget is the densest
    finally:
        client.close()


def test_overload_is_refused_fast_with_503_and_nothing_is_lost(served):
    """16 dense requests of 128 rows at once (minutes of work for an SLO of 250 ms): each is answered or
    refused with 503 / UNAVAILABLE (retryable), at least one refused as an overload; none fails otherwise,
    nothing stays in flight, and the next request is served."""
    import concurrent.futures as cf

    port = served["port"]
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port + 1}")
    big = _feeds(batch=128, length=32)

    def one(i: int):
        try:
            client.infer("elastic", _inputs(grpcclient, big, np.zeros((1, 1))), client_timeout=120)
            return "ok", ""
        except InferenceServerException as e:
            return e.status(), e.message()

    try:
        overload = _settled(port, "elastic_router_refused_total", reason="overload")
        with cf.ThreadPoolExecutor(16) as pool:
            outcomes = list(pool.map(one, range(16)))
        refused = [m for st, m in outcomes if st == "StatusCode.UNAVAILABLE"]
        assert all(st in ("ok", "StatusCode.UNAVAILABLE") for st, _ in outcomes), outcomes
        assert refused and all("retry later" in m for m in refused), outcomes
        assert any(st == "ok" for st, _ in outcomes)
        assert _metric_reaches(port, overload + 1, "elastic_router_refused_total", reason="overload") >= overload + 1
        assert _gauge_settles(port, "elastic_router_in_flight", 0.0) == 0.0
        res = client.infer("elastic", _inputs(grpcclient, _feeds(), np.full((1, 1), 0.1)), client_timeout=TIMEOUT_S)
        assert res.as_numpy("served_sparsity").ravel().tolist() == [0.1] * 3
    finally:
        client.close()


def test_a_budget_model_failure_counts_on_the_budget_model(served):
    """A token id beyond the vocabulary: onnxruntime fails. The budget model (its ``execute`` raises when
    every request of the call failed) counts it as a failure; through the router the client gets the
    budget model's error and the router counts it as ``failed``, while Triton counts the router's request
    as a success: the router answers it after its ``execute`` returned, and this backend reports a
    request's outcome when ``execute`` returns (docs/serving.md)."""
    port = served["port"]
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port + 1}")
    feeds = _feeds()
    feeds["input_ids"][0, 1] = 10**6
    try:
        budget = _metric(port, "nv_inference_request_failure", model="elastic_s050", reason="BACKEND")
        with pytest.raises(Exception, match="out of") as err:
            client.infer("elastic_s050", _inputs(grpcclient, feeds), client_timeout=TIMEOUT_S)
        assert "StatusCode.INTERNAL" in str(err.value)
        # Triton counts it just after it sends the error
        assert _metric_reaches(port, budget + 1, "nv_inference_request_failure", model="elastic_s050",
                               reason="BACKEND") == budget + 1
        success, failure = _triton_counts(port)
        failed = _settled(port, "elastic_router_requests_total", outcome="failed")
        with pytest.raises(Exception, match="router: .*out of"):
            client.infer("elastic", _inputs(grpcclient, feeds, np.full((1, 1), 0.5)), client_timeout=TIMEOUT_S)
        assert _metric_reaches(port, failed + 1, "elastic_router_requests_total", outcome="failed") == failed + 1
        assert _triton_counts(port) == (success + 1, failure)
    finally:
        client.close()


def test_rows_served_are_counted_per_budget(served):
    port = served["port"]
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port + 1}")
    try:
        before = _settled(port, "elastic_router_rows_total", sparsity="0.5")
        client.infer("elastic", _inputs(grpcclient, _feeds(), np.full((1, 1), 0.5)), client_timeout=TIMEOUT_S)
        assert _metric_reaches(port, before + 3, "elastic_router_rows_total", sparsity="0.5") == before + 3
    finally:
        client.close()


# --- search: the elastic_search model (the index of the served directory) ---------------------------
SEARCH = "elastic_search"


def _search_inputs(module, texts, top_k=None, sparsity=None) -> list:
    """``text`` (one query per row), and ``top_k`` (INT32 [1]) / ``sparsity`` (FP32 [1, 1]) when given."""
    items = [module.InferInput("text", [len(texts)], "BYTES")]
    items[0].set_data_from_numpy(np.array([t if isinstance(t, bytes) else t.encode() for t in texts], dtype=object))
    for name, value, dtype, shape in (("top_k", top_k, "INT32", [1]), ("sparsity", sparsity, "FP32", [1, 1])):
        if value is not None:
            items.append(module.InferInput(name, shape, dtype))
            items[-1].set_data_from_numpy(np.full(shape, value, dtype=np.int32 if dtype == "INT32" else np.float32))
    return items


def _ids(res) -> list[list[str]]:
    return [[x.decode() for x in row] for row in res.as_numpy("ids")]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_search_equals_a_brute_force_dense_search(served, protocol):
    """Through the search model at sparsity 0 (named), every query's top-10 ids and scores are what a numpy
    search over ``ElasticRuntime.encode``'s dense embeddings of the corpus gives (scores within 1e-5); the
    documents' text comes back when asked for; a query that names no budget gets the router's choice."""
    from elastic_export.serving.runtime import ElasticRuntime

    port, docs = served["port"], [p["doc"] for p in served["pairs"]]
    queries = ["open a file and read it", "abstract base class", served["pairs"][7]["query"], docs[11]]
    client = (httpclient.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=TIMEOUT_S) if protocol == "http"
              else grpcclient.InferenceServerClient(f"127.0.0.1:{port + 1}"))
    module, kw = (httpclient, {}) if protocol == "http" else (grpcclient, {"client_timeout": TIMEOUT_S})
    try:
        res = client.infer(SEARCH, _search_inputs(module, queries, 10, 0.0), **kw)
        want_pos, want_scores = brute_force(ElasticRuntime.from_dir(served["dir"], sparsities=(0.0,)), docs, queries)
        got_pos = np.array([[int(x[1:]) for x in row] for row in _ids(res)])
        scores = res.as_numpy("scores")
        assert scores.dtype == np.float32 and scores.shape == (4, 10)
        assert_same_top(got_pos, scores, want_pos, want_scores)
        assert _ids(res)[3][0] == "p11" and res.as_numpy("served_sparsity").ravel().tolist() == [0.0] * 4
        asked = [module.InferRequestedOutput(n) for n in ("ids", "texts", "served_sparsity")]
        res = client.infer(SEARCH, _search_inputs(module, queries[:1], 3), outputs=asked, **kw)
        assert [t.decode() for t in res.as_numpy("texts")[0]] == [docs[int(i[1:])] for i in _ids(res)[0]]
        assert res.as_numpy("scores") is None
        chosen = float(res.as_numpy("served_sparsity").ravel()[0])  # the router's policy's choice: its gauge says so
        assert _gauge_settles(port, "elastic_router_served_sparsity", chosen) == chosen
    finally:
        client.close()


@pytest.mark.parametrize("kind,message", [
    ("top_k 0", "top_k 0 is outside [1, 300]"),
    ("top_k 1001", "top_k 1001 is outside [1, 300] (the index holds 300 documents)"),
    ("above", "above the sparsest served budget 0.5"),
    ("utf8", "text 0 is not valid UTF-8"),
    ("empty", "text 1 is empty"),
    ("oversized", "the request has 129 queries, more than the 128 a request may have"),
])
def test_search_mistakes_are_400_with_one_line(served, kind, message):
    """A bad top_k (or sparsity, text, rows) is HTTP 400 with one line, gRPC INVALID_ARGUMENT; the next
    request is answered."""
    port = served["port"]
    texts, top_k, sparsity = ["a query"], None, None
    if kind.startswith("top_k"):
        top_k = int(kind.split()[1])
    elif kind == "above":
        sparsity = 0.61
    elif kind in ("utf8", "empty"):
        texts = [b"caf\xe9 \xff"] if kind == "utf8" else ["fine", "  "]
    else:
        texts = ["q"] * 129
    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=TIMEOUT_S)
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{port + 1}")
    try:
        with pytest.raises(InferenceServerException) as err:
            client.infer(SEARCH, _search_inputs(httpclient, texts, top_k, sparsity))
        assert err.value.status() == "400" and message in err.value.message(), str(err.value)
        assert "\n" not in err.value.message() and "Traceback" not in err.value.message()
        with pytest.raises(InferenceServerException) as err:
            grpc.infer(SEARCH, _search_inputs(grpcclient, texts, top_k, sparsity), client_timeout=TIMEOUT_S)
        assert err.value.status() == "StatusCode.INVALID_ARGUMENT" and message in err.value.message()
        res = client.infer(SEARCH, _search_inputs(httpclient, ["a query"], 2, 0.5))
        assert res.as_numpy("ids").shape == (1, 2) and res.as_numpy("served_sparsity").ravel().tolist() == [0.5]
    finally:
        client.close()
        grpc.close()


def test_search_recall_per_budget_matches_eval(served):
    """recall@10 of every query of the pairs, searched through the server at each budget (named), is what
    ``elastic-export eval`` reports for that budget on the same pairs (queries by the budget's model, the
    documents by the dense one), within 0.01; every answer served at the budget named."""
    from elastic_export.measure.evaluation import evaluate

    pairs = served["pairs"]
    want = {b["sparsity"]: b["recall@10"] for b in evaluate([served["dir"]], pairs=pairs, precisions=["fp32"])
            ["results"][0]["budgets"]}
    assert sorted(want) == [0.0, 0.1, 0.5]
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{served['port'] + 1}")
    got = {}
    try:
        for s in sorted(want):
            hits = []
            for start in range(0, len(pairs), 100):
                chunk = pairs[start:start + 100]
                res = client.infer(SEARCH, _search_inputs(grpcclient, [p["query"] for p in chunk], 10, s),
                                   client_timeout=TIMEOUT_S)
                assert res.as_numpy("served_sparsity").ravel().tolist() == [s] * len(chunk)
                hits += [f"p{start + i}" in row for i, row in enumerate(_ids(res))]
            got[s] = float(np.mean(hits))
    finally:
        client.close()
    assert all(abs(got[s] - want[s]) <= 0.01 for s in want), (got, want)
    assert got[0.0] > got[0.5]  # the budgets differ: the check is not vacuous


def test_search_overload_is_unavailable(served):
    """16 dense searches of 128 queries at once: the router's overload refusals reach the client as
    UNAVAILABLE (retryable, 'retry later'), every other request is answered; then a search is served."""
    import concurrent.futures as cf

    port = served["port"]
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port + 1}")
    queries = [p["doc"] for p in served["pairs"][:128]]

    def one(i: int):
        try:
            client.infer(SEARCH, _search_inputs(grpcclient, queries, 10, 0.0), client_timeout=120)
            return "ok", ""
        except InferenceServerException as e:
            return e.status(), e.message()

    try:
        with cf.ThreadPoolExecutor(16) as pool:
            outcomes = list(pool.map(one, range(16)))
        refused = [m for st, m in outcomes if st == "StatusCode.UNAVAILABLE"]
        assert all(st in ("ok", "StatusCode.UNAVAILABLE") for st, _ in outcomes), outcomes
        assert refused and all("retry later" in m for m in refused) and any(st == "ok" for st, _ in outcomes)
        assert _gauge_settles(port, "elastic_router_in_flight", 0.0) == 0.0
        res = client.infer(SEARCH, _search_inputs(grpcclient, ["a query"], 1, 0.1), client_timeout=TIMEOUT_S)
        assert res.as_numpy("served_sparsity").ravel().tolist() == [0.1]
    finally:
        client.close()


# --- serve's errors: one line, exit 2, nothing left running ----------------------------------------
def _serve_once(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "elastic_export", "serve", *args], capture_output=True, text=True,
                          env=ENV, timeout=READY_S + 120)


def _serve_on_a_free_block(*args: str, attempts: int = 3) -> subprocess.CompletedProcess:
    """``serve ARGS --port P`` on a free port block; again on another block (:func:`_helpers.on_a_free_block`)
    when serve's error says one of its ports was taken between the check and its bind."""
    def once(port: int) -> subprocess.CompletedProcess:
        r = _serve_once(*args, "--port", str(port))
        busy = [x for x in r.stderr.splitlines() if busy_port(x)] if r.returncode == 2 else []
        if busy:
            raise PortInUse(busy[0])
        return r

    return on_a_free_block(once, attempts)


def _one_error_line(r: subprocess.CompletedProcess) -> str:
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    return lines[0]


def test_serve_refuses_a_busy_port(minilm_small):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        line = _one_error_line(_serve_once(str(minilm_small), "--port", str(port)))
    assert f"port {port} on 127.0.0.1 (HTTP) is in use" in line


@pytest.mark.parametrize("option,value,message", [
    ("--slo-quantile", "1.5", "--slo-quantile must be in (0, 1), e.g. 0.99, got 1.5"),
    ("--max-sparsity", "-0.1", "--max-sparsity must be in [0, 1), got -0.1"),
    ("--slo-ms", "0", "--slo-ms must be positive, got 0"),
])
def test_serve_refuses_serving_settings_out_of_range(tmp_path, option, value, message):
    """Checked before anything is read or started (the directory does not even exist)."""
    assert _one_error_line(_serve_once(str(tmp_path / "none"), option, value)) == f"error: {message}"


def test_serve_refuses_a_directory_without_manifest(tmp_path):
    assert "no manifest.json" in _one_error_line(_serve_on_a_free_block(str(tmp_path)))


def test_a_budget_model_that_fails_to_load_is_one_error_line(minilm_small, tmp_path):
    from elastic_export.targets.triton import build_repository

    d = link_copy(minilm_small, tmp_path / "art")
    build_repository(d, platform="python", kind="cpu")
    served_file = d / "triton" / "elastic_s050" / "1" / "model.onnx"
    served_file.unlink()
    served_file.write_bytes(b"not an onnx file")
    line = _one_error_line(_serve_on_a_free_block(str(d), "--ready-timeout", "120"))
    assert "elastic_s050" in line and "UNAVAILABLE" in line, line


def test_the_router_does_not_load_in_front_of_a_missing_budget_model(minilm_small, tmp_path):
    """Budget model 0.5 is never loaded: the router waits for it, then refuses to load (never READY)."""
    from elastic_export.targets.triton import build_repository

    d = link_copy(minilm_small, tmp_path / "art")
    build_repository(d, platform="python", kind="cpu")
    cfg = d / "triton" / "elastic" / "config.pbtxt"
    cfg.write_text(cfg.read_text().replace('"300.0"', '"2.0"'))  # the router's wait for its budget models

    def start(port: int) -> TS.TritonServer:
        server = TS.TritonServer(d / "triton", port=port, log=tmp_path / "server.log")
        try:
            server.start(load=["elastic_s000", "elastic_s010"])
            server.wait_ready(READY_S, models=["elastic_s000", "elastic_s010"])
        except BaseException as e:
            server.stop()
            if isinstance(e, UserError) and busy_port(str(e)):
                (tmp_path / "server.log").unlink(missing_ok=True)  # the next start's log alone
                raise PortInUse(str(e)) from None
            raise
        return server

    server = on_a_free_block(start)
    try:
        with pytest.raises(UserError, match="'elastic' failed to load.*not ready after 2 s: elastic_s050"):
            server.load("elastic", timeout_s=READY_S)
        assert server.model_states().get("elastic") != "READY"
    finally:
        pid = server.process.pid if server.process else None
        regions = TS.shm_regions(pid) if pid else []
        server.stop()
    assert pid is None or not _group_alive(pid)
    assert not server.scratch.exists() and (tmp_path / "server.log").is_file(), "stop() leaves its scratch folder only"
    assert len(regions) == 2 and not _left_in_shm(regions), "stop() leaves no stub's shared memory behind"


def _left_in_shm(regions: list[str]) -> list[str]:
    """Those of the named Python backend regions still in /dev/shm."""
    return [r for r in regions if Path("/dev/shm", r).exists()]


# --- the stub's environment ------------------------------------------------------------------------
def test_the_server_python_has_numpy_1():
    """The serve extra pins numpy<2 (this server's Python backend answers empty outputs with numpy 2)."""
    import numpy

    env = TS.server_env(TS.find_server())
    assert TS.check_stub_python(env) == numpy.__version__ and int(numpy.__version__.split(".")[0]) == 1


def test_numpy_2_in_the_server_python_is_refused(tmp_path):
    fake = tmp_path / "site" / "numpy"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('__version__ = "2.1.0"\n')
    env = {**TS.server_env(TS.find_server()), "PYTHONPATH": str(tmp_path / "site")}
    with pytest.raises(UserError, match="has numpy 2.1.0.*install numpy<2 there"):
        TS.check_stub_python(env)


def test_the_python_stub_backend_folder(tmp_path):
    install = TS.find_server()
    folder = TS.backend_dir(install, tmp_path / "backends")
    stub = folder / "python" / TS.STUB
    assert stub.is_file() and os.access(stub, os.X_OK) and (folder / "python" / "libtriton_python.so").is_file()
    assert shutil.which("python3", path=TS.server_env(install)["PATH"]) == str(Path(sys.executable).parent / "python3")


def test_manifest_entry_after_serve(served):
    t = load_manifest(served["dir"])["triton"]
    assert t["policy"] == "adaptive" and t["text_input"] is True
    assert json.loads(json.dumps(t)) == t


# --- the docs' and examples' clients, against the same server ---------------------------------------
ROOT = Path(__file__).resolve().parents[1]


def test_docs_serving_python_snippets_run(served):
    """Every python block of docs/serving.md (text in, embeddings out; search), run against this server (its
    gRPC address substituted)."""
    text = (ROOT / "docs" / "serving.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks
    searched = False
    for code in blocks:
        code = code.replace("127.0.0.1:8001", f"127.0.0.1:{served['port'] + 1}")
        scope: dict = {}
        exec(compile(code, "docs/serving.md", "exec"), scope)
        if "res" in scope:  # 0.3 asked: served by 0.5 here (this directory's budgets are 0.1 and 0.5)
            assert scope["res"].as_numpy("served_sparsity").ravel().tolist() == [0.5, 0.5]
            assert scope["res"].as_numpy("sentence_embedding").shape == (2, 384)
        if "hits" in scope:  # the search example: the index of this directory (short_pairs' documents)
            hits, query = scope["hits"], re.search(r'np\.array\(\[b"([^"]+)"\]', code).group(1)
            chosen = float(hits.as_numpy("served_sparsity").ravel()[0])
            assert hits.as_numpy("ids").shape == (1, 5) and hits.as_numpy("scores").shape == (1, 5)
            assert_same_top(np.array([[int(x.decode()[1:]) for x in hits.as_numpy("ids")[0]]]),
                            hits.as_numpy("scores"), *_searched(served, [query], chosen, 5))
            searched = True
    assert searched, "no search block in docs/serving.md"


def _searched(served, queries: list[str], sparsity: float, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions, scores) of the top ``k`` of :func:`short_pairs`' documents (dense embeddings) for
    ``queries`` embedded at ``sparsity``, by ElasticRuntime: what the search model answers."""
    from elastic_export.serving.runtime import ElasticRuntime

    def unit(x):
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    rt = ElasticRuntime.from_dir(served["dir"], sparsities=sorted({0.0, sparsity}))
    scores = unit(rt.encode(queries, sparsity=sparsity)) @ unit(rt.encode([p["doc"] for p in served["pairs"]],
                                                                           sparsity=0.0)).T
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return order, np.take_along_axis(scores, order, axis=1)


def test_example_06_triton_client(served):
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "06_triton_client.py"), "How do I open a file?",
                        "Use the with statement.", "--url", f"127.0.0.1:{served['port'] + 1}"],
                       capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("policy's choice: embeddings (2, 384)") and "(fp32)" in lines[0]
    assert lines[1].endswith("served sparsity [0.5, 0.5] (fp32)"), lines[1]  # 0.3 asked; budgets 0.1, 0.5 here
    assert lines[2].endswith("served sparsity [0.0, 0.5] (fp32)"), lines[2]


def test_sigterm_while_starting_stops_the_server(minilm_small, tmp_path):
    """SIGTERM before the server is ready (the server already started): serve stops it, by its process
    group, and exits as interrupted; nothing is left running. Forced: the server is held (SIGSTOP) from
    the moment serve started it, so it cannot be ready when the SIGTERM lands, and let go once serve's
    stop has signalled it (its SIGTERM pending) or killed it."""
    d = link_copy(minilm_small, tmp_path / "art")

    def start(port: int) -> tuple[subprocess.Popen, int | None]:
        p = subprocess.Popen([sys.executable, "-m", "elastic_export", "serve", str(d), "--port", str(port)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, start_new_session=True)
        server = None
        try:
            deadline = time.monotonic() + 120
            while server is None and p.poll() is None and time.monotonic() < deadline:  # until serve started tritonserver
                server = tritonserver_of(p.pid)  # its child named tritonserver (not the numpy probe before it)
                time.sleep(0.05)
        except BaseException:
            _kill_serve(p)
            raise
        if server is None and p.poll() is not None:  # serve ended before starting one: a port taken?
            _, err = p.communicate(timeout=30)
            busy = [x for x in err.splitlines() if busy_port(x)]
            if busy:
                raise PortInUse(busy[0])
        return p, server

    p, server = on_a_free_block(start)
    try:
        assert server is not None, "serve never started a server"
        os.kill(server, signal.SIGSTOP)
        try:
            p.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 120
            while TS.alive(server) and not _pending(server, signal.SIGTERM):
                assert time.monotonic() < deadline, "serve never stopped its server"
                time.sleep(0.05)
        finally:
            if TS.alive(server):
                os.kill(server, signal.SIGCONT)
        _, err = p.communicate(timeout=TS.STOP_TIMEOUT_S + 30)
    finally:
        _kill_serve(p)
        if server is not None and TS.alive(server):
            os.killpg(server, signal.SIGKILL)
    assert p.returncode == 130 and err.strip().splitlines()[-1:] == ["interrupted"], (p.returncode, err[-1000:])
    _assert_server_gone(server, p.pid)
    assert not _serving(d / "triton"), "a server of this repository is still running"


def _kill_serve(p: subprocess.Popen) -> None:
    """SIGKILL to serve's process group (by its pid), if serve still runs."""
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(30)


def _pending(pid: int, sig: int) -> bool:
    """Whether ``sig`` is pending for process ``pid`` (sent to the process, not yet delivered: it is stopped)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # gone
        return False
    mask = int(re.search(r"^ShdPnd:\s*([0-9a-f]+)", status, flags=re.M).group(1), 16)
    return bool(mask >> (sig - 1) & 1)


def _serving(repository: Path) -> list[int]:
    """Processes whose command line names ``repository`` (a tritonserver or its Python stubs)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(repository) in cmdline.read_bytes().decode(errors="replace"):
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


# --- the closed control API and serve's supervision (issue 29) --------------------------------------
def _repository_post(port: int, path: str, headers: dict | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v2/repository/{path}", data=b"{}", method="POST",
                                 headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _budget_answer(client, model: str = "elastic_s050") -> np.ndarray:
    return client.infer(model, _inputs(grpcclient, _feeds()), client_timeout=TIMEOUT_S).as_numpy("sentence_embedding")


def _router_serves(client, sparsity: float, timeout_s: float = READY_S):
    """The router's answer at ``sparsity`` once it serves that budget again (a budget it routed around
    comes back after its next health check), polled: at most one request every 0.25 s until ``timeout_s``."""
    deadline, served_s = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        res = client.infer("elastic", _inputs(grpcclient, _feeds(), np.full((1, 1), sparsity)), client_timeout=TIMEOUT_S)
        served_s = res.as_numpy("served_sparsity").ravel().tolist()
        if served_s == [sparsity] * len(served_s):
            return res
        time.sleep(0.25)
    raise AssertionError(f"the router still serves {served_s} for {sparsity} after {timeout_s:g} s")


def test_the_model_control_api_is_closed_to_clients(served):
    """serve's server refuses the model-repository API to a client without serve's key: HTTP 403 for
    unload, load and the index, gRPC UNAVAILABLE (Triton 2.51's answer for a restricted protocol); the
    model stays READY and answers what the runtime does; serve's own key opens it (the index)."""
    from elastic_export.serving.runtime import ElasticRuntime

    port = served["port"]
    for path in ("models/elastic_s050/unload", "models/elastic_s050/load", "index"):
        status, body = _repository_post(port, path)
        assert status == 403 and b"This API is restricted" in body, (path, status, body)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port + 1}")
    try:
        with pytest.raises(InferenceServerException) as err:
            client.unload_model("elastic_s050", client_timeout=TIMEOUT_S)
        assert err.value.status() == "StatusCode.UNAVAILABLE" and "restricted" in err.value.message()
        assert client.is_model_ready("elastic_s050") and client.is_model_ready("elastic")
        want = ElasticRuntime.from_dir(served["dir"]).run(_feeds(), sparsity=0.5)["sentence_embedding"]
        assert np.abs(_budget_answer(client) - want).max() <= 1e-5
        index = client.get_model_repository_index(headers=_control_headers(served["server_pid"], "grpc"),
                                                  as_json=True, client_timeout=TIMEOUT_S)
        assert {m["name"]: m.get("state") for m in index["models"]}["elastic_s050"] == "READY"
    finally:
        client.close()
    status, _ = _repository_post(port, "index", _control_headers(served["server_pid"]))
    assert status == 200


def _named_until(client, p, port: int, start: int, line: str, sparsity: float = 0.5) -> tuple[list, list]:
    """Requests naming ``sparsity``, one every 0.1 s, until serve prints ``line`` (bounded by READY_S): the
    served sparsity of each (an error fails the test) and the router's budget_up gauge for it meanwhile."""
    served_s, up = [], []
    deadline = time.monotonic() + READY_S
    while not any(line in x for x in p.lines[start:]):
        assert time.monotonic() < deadline, f"serve never printed {line!r}"
        res = client.infer("elastic", _inputs(grpcclient, _feeds(), np.full((1, 1), sparsity)), client_timeout=TIMEOUT_S)
        served_s.extend(res.as_numpy("served_sparsity").ravel().tolist())
        up.append(_metric(port, "elastic_router_budget_up", sparsity=f"{sparsity:g}"))
        time.sleep(0.1)
    return served_s, up


def _routed_around(client, sparsity: float = 0.5) -> list[float]:
    """Rounds of requests naming ``sparsity`` at once (one of 128 rows in flight, so the router forwards
    the others to the budget model rather than run them itself), until one is served by another budget
    (bounded by READY_S): the served sparsity of every row answered. An error fails the test; an overload
    refusal (UNAVAILABLE, retryable) is allowed."""
    import concurrent.futures as cf

    small, big = _feeds(), _feeds(batch=128, length=32)

    def one(feeds) -> list[float]:
        try:
            res = client.infer("elastic", _inputs(grpcclient, feeds, np.full((1, 1), sparsity)),
                               client_timeout=TIMEOUT_S)
        except InferenceServerException as e:
            assert e.status() == "StatusCode.UNAVAILABLE" and "retry later" in e.message(), str(e)
            return []
        return res.as_numpy("served_sparsity").ravel().tolist()

    served_s: list[float] = []
    deadline = time.monotonic() + READY_S
    with cf.ThreadPoolExecutor(4) as pool:
        while not any(s != sparsity for s in served_s):
            assert time.monotonic() < deadline, f"never routed around {sparsity}: {served_s}"
            for rows in pool.map(one, [big, small, small, small]):
                served_s += rows
    return served_s


def test_a_budget_model_whose_stub_dies_is_reloaded(served):
    """SIGKILL to elastic_s050's Python backend stub (Triton 2.51 does not restart it, and the model stays
    READY while its requests fail 'Stub process ... is not healthy'), with serve held (SIGSTOP) so that
    the model stays down until the test lets serve go: requests naming 0.5 that the router forwards fail
    over to 0.1 and it reports 0.5 down. Let go, serve logs it, reloads the model through the repository
    API with its key and logs when it is READY; meanwhile every request naming 0.5 is answered (by it or
    by 0.1); the model then answers as before, from a new stub, and so does the router at 0.5."""
    p, port = served["process"], served["port"]
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port + 1}")
    try:
        before = _budget_answer(client)
        stubs = TS.stubs_of(served["server_pid"])["elastic_s050"]
        assert len(stubs) == 1
        dead_region = TS.regions_of(stubs)
        start = len(p.lines)
        os.kill(p.pid, signal.SIGSTOP)  # serve held: it cannot reload the model yet
        try:
            os.kill(stubs[0], signal.SIGKILL)
            deadline = time.monotonic() + 60
            while TS.alive(stubs[0]):  # gone (reaped by tritonserver at once)
                assert time.monotonic() < deadline, "the stub outlived SIGKILL"
                time.sleep(0.01)
            routed = _routed_around(client)
            assert set(routed) == {0.5, 0.1} or set(routed) == {0.1}, routed  # routed around while it was down
            # and reported so (the prober keeps it down: the dead stub does not answer)
            assert _gauge_settles(port, "elastic_router_budget_up", 0.0, sparsity="0.5") == 0.0
            assert not any("elastic_s050" in x for x in p.lines[start:])  # serve held: not reloaded yet
        finally:
            os.kill(p.pid, signal.SIGCONT)
        wait_for_line(p, "budget model elastic_s050: stub died; reloading", timeout_s=READY_S, start=start)
        served_s, up = _named_until(client, p, port, start, "budget model elastic_s050: READY again")
        assert set(served_s) <= {0.5, 0.1}  # every request naming it answered: by it or its neighbour
        wait_for_line(p, "budget model elastic_s050: READY again", timeout_s=READY_S, start=start)
        new = TS.stubs_of(served["server_pid"]).get("elastic_s050", [])
        assert len(new) == 1 and new != stubs and TS.alive(new[0])
        deadline = time.monotonic() + SETTLE_S  # the dead instance is released after its reload
        while _left_in_shm(dead_region) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert dead_region and not _left_in_shm(dead_region), "the dead stub's shared memory was left behind"
        assert client.is_model_ready("elastic_s050")
        assert np.abs(_budget_answer(client) - before).max() <= 1e-6
        res = _router_serves(client, 0.5)
        assert np.abs(res.as_numpy("sentence_embedding") - before).max() <= 1e-5
        assert _gauge_settles(port, "elastic_router_budget_up", 1.0, sparsity="0.5") == 1.0
    finally:
        client.close()


def test_serve_exits_2_with_one_line_when_tritonserver_dies(served):
    """tritonserver SIGKILLed under a running serve (here with ``--allow-model-control``: a client's unload
    is accepted, and serve leaves the unloaded model alone): serve prints one line naming it, exits 2,
    and leaves nothing running."""
    p, port, lines = serve_process(served["dir"], "--allow-model-control")
    server, lines = p.server_pid, p.lines  # p.lines: the lines serve prints later too
    try:
        assert any("open to every client (--allow-model-control)" in x for x in lines)
        start = len(lines)
        assert _repository_post(port, "models/elastic_s050/unload")[0] == 200
        wait_for_line(p, "budget model elastic_s050: unloaded (not by serve); no longer watched", timeout_s=30,
                      start=start)
        assert TS.stubs_of(server).get("elastic_s050") is None and not any("stub died" in x for x in lines[start:])
        regions = TS.shm_regions(server)
        os.kill(server, signal.SIGKILL)
        p.wait(TS.STOP_TIMEOUT_S + 30)
    finally:
        stop_process(p)
    after = lines[start:]
    assert p.returncode == 2 and after[-1] == f"error: tritonserver (pid {server}) died: killed by SIGKILL", after
    assert sum(x.startswith("error:") for x in after) == 1 and not any("Traceback" in x for x in after), after
    _assert_server_gone(server, p.pid)
    assert regions and not _left_in_shm(regions), "a dead server's stubs' shared memory was left behind"


def test_tritonserver_dies_with_a_serve_killed_by_sigkill(served):
    """serve SIGKILLed (no chance to stop anything): its tritonserver goes with it (PR_SET_PDEATHSIG), and
    serve's watchdog (a process of its own session, at the EOF of a pipe only serve held) kills the rest
    of the server's group, the Python backend stubs (the router's was seen to outlive its server), and
    exits."""
    p, _, _ = serve_process(served["dir"])
    server = p.server_pid
    stubs = [pid for pids in TS.stubs_of(server).values() for pid in pids]
    watchdog = [c for c in TS.children(p.pid) if c != server]
    scratch = _scratch(server)
    try:
        t = load_manifest(served["dir"])["triton"]
        assert server is not None and sorted(TS.stubs_of(server)) == sorted([t["router"], t["search"]["name"],
                                                                             t["index"]["name"],
                                                                             *(m["name"] for m in t["models"])])
        assert len(watchdog) == 1 and "killpg" in " ".join(TS.cmdline(watchdog[0]))
        regions = TS.shm_regions(server)
        p.kill()
        p.wait(30)
        assert not _gone([server], 60), "tritonserver outlived a serve killed by SIGKILL"
        assert not _gone(stubs, 60), "a stub outlived serve"
        assert not _gone(watchdog, 60), "the watchdog outlived what it guards"
        assert scratch.name.startswith("elastic-export-triton.") and not scratch.exists(), "the server's scratch was left"
        assert len(regions) == len(stubs) and not _left_in_shm(regions), "the stubs' shared memory was left behind"
    finally:
        stop_process(p)
        if server is not None and _group_alive(server):
            os.killpg(server, signal.SIGKILL)
    _assert_server_gone(server, p.pid)


def test_serve_passes_the_slo_quantile_and_the_quality_floor_to_the_repository(minilm_small, tmp_path):
    """``--slo-quantile`` / ``--max-sparsity`` reach ``build_repository`` and its manifest entry; the same
    settings again serve the existing repository, another quantile rebuilds it (no server started)."""
    d = link_copy(minilm_small, tmp_path / "art")
    said: list[str] = []
    entry = TS.ensure_repository(d, "python", None, None, said.append, slo_quantile=0.9, max_sparsity=0.1)
    assert (entry["slo_quantile"], entry["max_sparsity"]) == (0.9, 0.1)
    said.clear()
    TS.ensure_repository(d, "python", None, None, said.append, slo_quantile=0.9, max_sparsity=0.1)
    assert said == [f"serving the existing {d / 'triton'}"]
    said.clear()
    entry = TS.ensure_repository(d, "python", None, None, said.append, slo_quantile=0.95)
    assert not any(x.startswith("serving the existing") for x in said)
    assert load_manifest(d)["triton"]["slo_quantile"] == 0.95 == entry["slo_quantile"]


def test_a_repository_of_another_versions_model_files_is_built_anew(minilm_small, tmp_path):
    """A repository whose router or budget ``model.py`` (or a serving module copied beside it) is not this
    package's text (built by another elastic-export) is rebuilt, in one line saying why, rather than served
    with its old files over this version's modules; as built, it is served as it is (no server started)."""
    from elastic_export.targets.triton import stale_model_files

    d = link_copy(minilm_small, tmp_path / "art")
    said: list[str] = []
    entry = TS.ensure_repository(d, "python", None, None, said.append)
    assert stale_model_files(d / "triton", entry) == []
    for changed in ("elastic/1/model.py", "elastic_s050/1/length_groups.py"):
        path = d / "triton" / changed
        path.write_text(path.read_text() + "\n# from another version\n")
        assert stale_model_files(d / "triton", load_manifest(d)["triton"]) == [changed]
        said.clear()
        TS.ensure_repository(d, "python", None, None, said.append)
        assert said[0] == f"rebuilding {d / 'triton'}: {changed} not this elastic-export's"
        assert "# from another version" not in path.read_text()
    said.clear()
    TS.ensure_repository(d, "python", None, None, said.append)
    assert said == [f"serving the existing {d / 'triton'}"]
