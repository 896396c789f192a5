"""The HTTP API without a Triton server: a router that cannot be reached is a 503 with Retry-After in
OpenAI's error shape, gRPC statuses map to HTTP ones, search without an index is a 404, and importing
the module loads neither FastAPI nor FAISS nor torch."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from _helpers import ENV, link_copy

from elastic_export.serving.openai_schema import ApiError


@pytest.fixture(scope="module")
def client(minilm_small, tmp_path_factory):
    from fastapi.testclient import TestClient

    from elastic_export.serving.http_api import create_app

    d = link_copy(minilm_small, tmp_path_factory.mktemp("api_offline") / "art", ignore=("triton", "index"))
    with socket.socket() as nobody:  # bound and never listening: refused, and no other server can take it meanwhile
        nobody.bind(("127.0.0.1", 0))
        with TestClient(create_app(d, f"127.0.0.1:{nobody.getsockname()[1]}", max_batch=8, timeout_s=5)) as c:
            yield c


def test_unreachable_router_is_503_retry_after(client):
    r = client.post("/v1/embeddings", json={"model": "elastic", "input": ["a", "b"]})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "server_error"
    assert err["code"] == "overloaded" and "\n" not in err["message"]


def test_search_without_index_and_bad_bodies(client):
    r = client.post("/v1/search", json={"query": "a"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "no_index"
    assert "elastic-export index" in r.json()["error"]["message"]
    for content, status in ((b"[1, 2]", 400), (b"", 400), (b"x" * (17 << 20), 413)):
        r = client.post("/v1/embeddings", content=content)
        assert r.status_code == status and "error" in r.json(), r.text
    assert client.get("/nothing").status_code == 404 and "error" in client.get("/nothing").json()
    assert client.get("/v1/embeddings").status_code == 405


class _GrpcError(Exception):
    def __init__(self, status: str, message: str):
        self._s, self._m = status, message

    def status(self):
        return self._s

    def message(self):
        return self._m


@pytest.mark.parametrize("status, message, http", [
    ("StatusCode.UNAVAILABLE", "overloaded: predicted 740 ms at sparsity 0.5 exceeds the SLO", 503),
    ("StatusCode.INVALID_ARGUMENT", "sparsity 0.7 is above the sparsest served budget 0.5", 400),
    ("StatusCode.INTERNAL", "BudgetError: sparsity 0.61 is above the sparsest served budget 0.6", 400),
    ("StatusCode.DEADLINE_EXCEEDED", "Deadline Exceeded", 504),
    ("StatusCode.INTERNAL", "router: boom", 502),
])
def test_grpc_status_to_http(status, message, http):
    from elastic_export.serving.router_client import _api_error

    e = _api_error(_GrpcError(status, message))
    assert isinstance(e, ApiError) and e.status == http and message in e.message
    assert (e.headers.get("Retry-After") == "1") == (http == 503)


def test_import_is_light():
    code = ("import sys, elastic_export, elastic_export.serving.http_api, elastic_export.index.store, "
            "elastic_export.cli.main; print(sorted(m for m in ('torch', 'fastapi', 'uvicorn', 'faiss', "
            "'tritonclient') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr[-2000:]
