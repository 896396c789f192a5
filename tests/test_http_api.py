"""The OpenAI-style HTTP API against a live Triton server (``elastic-export serve``, started once for the
module): the official ``openai`` client (float and base64), LangChain's ``OpenAIEmbeddings`` and
LlamaIndex's ``OpenAIEmbedding`` unmodified, their embeddings equal to ``ElasticRuntime.encode`` at the
served budget; ``/v1/models``; OpenAI-shaped errors; search equal to a brute-force dense search."""

from __future__ import annotations

import base64
import contextlib
import logging
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
from _helpers import ENV, PortInUse, busy_port, link_copy, on_a_free_block, serve_process, stop_process
from test_index import brute_force, corpus_docs, write_jsonl

from elastic_export.targets import tritonserver as TS

TIMEOUT_S = 120.0  # every client request
TEXTS = ["How do I open a file in Python?", "Use the with statement.", "The cat sat on the mat.",
         "Winter light on the mountain", "a"]


@dataclass
class Live:
    directory: Path
    url: str
    grpc: str
    docs: list[dict]
    rt: object

    def encode(self, texts, sparsity):
        return self.rt.encode(texts, sparsity=sparsity)


def start_api(directory: Path, grpc: str, attempts: int = 3) -> tuple[subprocess.Popen, str]:
    """``python -m elastic_export.serving.http_api`` on a free 127.0.0.1 port, polled until ``/health``
    answers (bounded); again on another port when uvicorn says the port was in use."""
    def start(port: int) -> tuple[subprocess.Popen, str]:
        p = subprocess.Popen([sys.executable, "-m", "elastic_export.serving.http_api", str(directory), "--grpc", grpc,
                              "--host", "127.0.0.1", "--port", str(port)], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=ENV, start_new_session=True)
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
        while p.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return p, url
            except httpx.HTTPError:
                time.sleep(0.1)
        out = stop_api(p)
        if busy_port(out):
            raise PortInUse(next(x for x in out.splitlines() if busy_port(x)))
        raise AssertionError("the HTTP API did not start:\n" + out[-2000:])

    return on_a_free_block(start, attempts)


def stop_api(p: subprocess.Popen) -> str:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
    try:
        out, _ = p.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate(timeout=30)
    return out or ""


@pytest.fixture(scope="module")
def live(minilm_small, tmp_path_factory):
    from elastic_export.index.build import build_index
    from elastic_export.serving.runtime import ElasticRuntime

    root = tmp_path_factory.mktemp("http_api")
    d = link_copy(minilm_small, root / "art", ignore=("triton", "index"))
    docs = corpus_docs(200, seed=1)
    build_index(d, write_jsonl(root / "corpus.jsonl", docs), progress=False)
    serve, port, lines = serve_process(d)  # serve starts the API itself, on port + 3
    try:
        url = f"http://127.0.0.1:{port + 3}"
        assert f"OpenAI API {url}/v1" in lines[-1], lines[-1]
        yield Live(d, url, f"127.0.0.1:{port + 1}", docs, ElasticRuntime.from_dir(d))
    finally:
        stop_process(serve)


def test_the_api_also_runs_as_its_own_process(live):
    """``python -m elastic_export.serving.http_api`` in front of a running server: /health and one embedding."""
    api, url = start_api(live.directory, live.grpc)
    try:
        got = httpx.post(url + "/v1/embeddings", json={"model": "elastic@0.5", "input": TEXTS[:1]}, timeout=TIMEOUT_S)
        assert got.status_code == 200 and got.headers["x-elastic-served-sparsity"] == "0.5"
    finally:
        out = stop_api(api)
    assert "ready: OpenAI embeddings API" in out


def _client(live):
    from openai import OpenAI

    return OpenAI(base_url=live.url + "/v1", api_key="x", timeout=TIMEOUT_S, max_retries=0)


def test_openai_client_float_and_base64_equal_the_runtime(live):
    client = _client(live)
    # no encoding_format: the client asks for base64 and decodes it; "base64" asked for: the string itself
    for model, fmt in (("elastic", "float"), ("elastic@0.5", None), ("elastic@0.1", "float"), ("elastic", "base64")):
        extra = {"encoding_format": fmt} if fmt else {}
        raw = client.embeddings.with_raw_response.create(model=model, input=TEXTS, **extra)
        got = raw.parse()
        served = float(raw.headers["x-elastic-served-sparsity"])
        if "@" in model:
            assert served == float(model.split("@")[1])
        vectors = np.array([np.frombuffer(base64.b64decode(e.embedding), "<f4") if fmt == "base64" else e.embedding
                            for e in got.data], dtype=np.float32)
        assert [e.index for e in got.data] == list(range(len(TEXTS))) and got.model == model
        np.testing.assert_allclose(vectors, live.encode(TEXTS, served), atol=1e-5, rtol=0)
        assert got.usage.prompt_tokens == got.usage.total_tokens == sum(
            sum(e.attention_mask) for e in live.rt._text_encoder().tokenizer.encode_batch(TEXTS))
    # base64 on the wire, as the client sends when not told (it decodes float32 little-endian)
    body = httpx.post(live.url + "/v1/embeddings", json={"model": "elastic@0.1", "input": "hello",
                                                          "encoding_format": "base64"}, timeout=TIMEOUT_S).json()
    assert body["served_sparsity"] == 0.1 and body["served_precision"] == "fp32"
    vec = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vec, live.encode(["hello"], 0.1)[0], atol=1e-5, rtol=0)


def test_large_lists_split_in_order_and_token_arrays(live):
    """300 inputs (the router takes 128 a request) come back in order at one budget; token arrays are
    the model's ids as given; the sparsity body field names the budget."""
    texts = [d["text"] for d in live.docs] + TEXTS * 20
    got = _client(live).embeddings.create(model="elastic", input=texts[:300], extra_body={"sparsity": 0.5})
    np.testing.assert_allclose(np.array([e.embedding for e in got.data]), live.encode(texts[:300], 0.5), atol=1e-5)
    feeds = live.rt._text_encoder().encode(TEXTS[:2])
    tokens = [row[mask == 1].tolist() for row, mask in zip(feeds["input_ids"], feeds["attention_mask"])]
    r = httpx.post(live.url + "/v1/embeddings", json={"model": "elastic@0.1", "input": tokens}, timeout=TIMEOUT_S)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == sum(map(len, tokens))
    np.testing.assert_allclose(np.array([e["embedding"] for e in r.json()["data"]]), live.encode(TEXTS[:2], 0.1),
                               atol=1e-5)


def test_langchain_and_llamaindex_unmodified(live):
    from langchain_openai import OpenAIEmbeddings
    from llama_index.embeddings.openai import OpenAIEmbedding

    lc = OpenAIEmbeddings(base_url=live.url + "/v1", api_key="x", model="elastic@0.1", check_embedding_ctx_length=False,
                          timeout=TIMEOUT_S, max_retries=0)
    np.testing.assert_allclose(np.array(lc.embed_documents(TEXTS)), live.encode(TEXTS, 0.1), atol=1e-5)
    np.testing.assert_allclose(np.array(lc.embed_query(TEXTS[0])), live.encode(TEXTS[:1], 0.1)[0], atol=1e-5)
    li = OpenAIEmbedding(model_name="elastic@0.5", api_base=live.url + "/v1", api_key="x", timeout=TIMEOUT_S,
                         max_retries=0)
    np.testing.assert_allclose(np.array(li.get_text_embedding_batch(TEXTS)), live.encode(TEXTS, 0.5), atol=1e-5)
    np.testing.assert_allclose(np.array(li.get_query_embedding(TEXTS[1])), live.encode(TEXTS[1:2], 0.5)[0], atol=1e-5)


def test_langchain_and_llamaindex_stores_dense_documents_and_elastic_queries(live):
    """docs/embeddings_api.md's mapping, with the libraries' own stores and public APIs: the store is filled
    through ``elastic:document`` (dense, the indexing lane: Triton counts its rows), queries go through
    ``elastic:query`` (the router's budget, never the lane) and find their documents."""
    from langchain_core.vectorstores import InMemoryVectorStore
    from langchain_openai import OpenAIEmbeddings
    from llama_index.core import VectorStoreIndex
    from llama_index.core.schema import TextNode
    from llama_index.embeddings.openai import OpenAIEmbedding

    texts = [d["text"] for d in live.docs[:40]]
    common = {"base_url": live.url + "/v1", "api_key": "x", "check_embedding_ctx_length": False, "max_retries": 0}
    before = _lane_count(live)
    store = InMemoryVectorStore.from_texts(texts, OpenAIEmbeddings(model="elastic:document", **common))
    stored = np.array([store.store[k]["vector"] for k in sorted(store.store, key=lambda k: texts.index(
        store.store[k]["text"]))])
    np.testing.assert_allclose(stored, live.encode(texts, 0.0), atol=1e-5)
    queries = OpenAIEmbeddings(model="elastic:query", **common)
    assert store.similarity_search_by_vector(queries.embed_query(texts[7]), k=1)[0].page_content == texts[7]
    assert _lane_count(live) - before == len(texts)  # the documents, not the query
    li = {"api_base": live.url + "/v1", "api_key": "x", "max_retries": 0}
    index = VectorStoreIndex([TextNode(text=t, id_=f"n{i}") for i, t in enumerate(texts)],
                             embed_model=OpenAIEmbedding(model_name="elastic:document", **li))
    retriever = index.as_retriever(similarity_top_k=1, embed_model=OpenAIEmbedding(model_name="elastic:query", **li))
    assert retriever.retrieve(texts[11])[0].node.get_content() == texts[11]
    assert _lane_count(live) - before == 2 * len(texts)


def _lane_count(live) -> int:
    """How many rows the indexing lane's model has run (Triton's own statistics)."""
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(live.grpc) as c:
        stats = c.get_inference_statistics("elastic_index", as_json=True)["model_stats"][0]
    return int(stats.get("inference_count", 0))


def test_documents_are_dense_through_the_indexing_lane(live):
    """A request that states no type, ``input_type: document`` and the model id ``elastic:document`` are
    embedded dense by the indexing lane's model (Triton counts its rows), in input order, equal to the
    dense runtime; queries get their budget; a sparse document is a 400."""
    texts = [d["text"] for d in live.docs] + TEXTS * 10  # 250 rows of many lengths: sorted, batched, restored
    before, metrics = _lane_count(live), httpx.get(live.url + "/metrics", timeout=TIMEOUT_S).text
    for extra in ({}, {"input_type": "document"}, {"model": "elastic:document"}, {"input_type": "search_document"}):
        r = httpx.post(live.url + "/v1/embeddings", json={"model": "elastic", "input": texts, **extra},
                       timeout=TIMEOUT_S)
        body = r.json()
        assert r.status_code == 200 and body["served_sparsity"] == 0.0 and body["input_type"] == "document", r.text
        np.testing.assert_allclose(np.array([e["embedding"] for e in body["data"]]), live.encode(texts, 0.0),
                                   atol=1e-5)
    assert _lane_count(live) - before == 4 * len(texts)  # every document row ran in the lane
    after = httpx.get(live.url + "/metrics", timeout=TIMEOUT_S).text  # the lane's padding, as the API sent it
    sent = {k: _metric(after, k) - _metric(metrics, k) for k in ("elastic_api_documents_batched_total",
            'elastic_api_document_tokens_total{kind="real"}', 'elastic_api_document_tokens_total{kind="padded"}')}
    assert sent["elastic_api_documents_batched_total"] == 4 * len(texts), sent
    assert sent['elastic_api_document_tokens_total{kind="padded"}'] >= sent['elastic_api_document_tokens_total{kind="real"}'] > 0
    r = httpx.post(live.url + "/v1/embeddings", json={"model": "elastic:query", "input": TEXTS, "sparsity": 0.5},
                   timeout=TIMEOUT_S)
    assert r.status_code == 200 and r.json()["served_sparsity"] == 0.5 and r.json()["input_type"] == "query"
    assert _lane_count(live) - before == 4 * len(texts)  # queries never run there
    r = httpx.post(live.url + "/v1/embeddings", json={"model": "elastic@0.5", "input": "a", "input_type": "document"},
                   timeout=TIMEOUT_S)
    assert r.status_code == 400 and r.json()["error"]["code"] == "sparse_document"
    r = httpx.post(live.url + "/v1/search", json={"query": "a", "input_type": "document"}, timeout=TIMEOUT_S)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_type"


def test_queries_are_answered_while_a_corpus_is_indexed(live):
    """One client embeds 1,500 documents in one request; queries sent one after another meanwhile (at
    most 40, each bounded) are all answered, none refused: the lane runs beside the query models at the
    lowest priority instead of ahead of them. The documents come back dense and complete."""
    import threading

    docs = [f"{d['text']} {d['text']}" for d in live.docs] * 8
    done: dict = {}
    base = _lane_count(live)

    def index():
        done["r"] = httpx.post(live.url + "/v1/embeddings", json={"model": "elastic", "input": docs[:1500],
                                                                   "input_type": "document"}, timeout=TIMEOUT_S * 3)

    worker = threading.Thread(target=index)
    worker.start()
    deadline = time.monotonic() + TIMEOUT_S
    while _lane_count(live) == base and worker.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)  # until the lane has run its first batch
    statuses = []
    while worker.is_alive() and len(statuses) < 40:
        q = httpx.post(live.url + "/v1/embeddings", json={"model": "elastic", "input": TEXTS[0], "input_type": "query"},
                       timeout=TIMEOUT_S)
        statuses.append((q.status_code, q.json().get("served_sparsity")))
    worker.join(TIMEOUT_S * 3)
    assert statuses and all(code == 200 for code, _ in statuses), statuses
    r = done["r"]
    assert r.status_code == 200 and r.json()["served_sparsity"] == 0.0 and len(r.json()["data"]) == 1500
    np.testing.assert_allclose(np.array([e["embedding"] for e in r.json()["data"][:200]]),
                               live.encode(docs[:200], 0.0), atol=1e-5)


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_concurrent_queries_are_merged_and_their_padding_is_counted(live):
    """24 queries of different lengths sent at once come back each with its own embedding at one served
    budget per answer; the API's metrics count the router requests that carried them (at most one per query),
    the queries, and the real and padded tokens (padded >= real)."""
    from concurrent.futures import ThreadPoolExecutor

    texts = [d["text"] for d in live.docs[:24]]
    before = httpx.get(live.url + "/metrics", timeout=TIMEOUT_S).text

    def one(text):
        r = httpx.post(live.url + "/v1/embeddings", json={"model": "elastic@0.5", "input": text}, timeout=TIMEOUT_S)
        return r.status_code, r.json()["data"][0]["embedding"]

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, texts))
    assert [code for code, _ in got] == [200] * 24
    np.testing.assert_allclose(np.array([v for _, v in got]), live.encode(texts, 0.5), atol=1e-5)
    after = httpx.get(live.url + "/metrics", timeout=TIMEOUT_S).text
    batches, queries = (_metric(after, n) - _metric(before, n) for n in ("elastic_api_query_batches_total",
                                                                        "elastic_api_queries_batched_total"))
    real, padded = (_metric(after, f'elastic_api_query_tokens_total{{kind="{k}"}}')
                    - _metric(before, f'elastic_api_query_tokens_total{{kind="{k}"}}') for k in ("real", "padded"))
    assert queries == 24 and 1 <= batches <= 24 and 0 < real <= padded


def test_models_list_every_budget(live):
    models = _client(live).models.list()
    ids = [m.id for m in models.data]
    assert ids == ["elastic", "elastic:query", "elastic:document", "elastic@0", "elastic@0.1", "elastic@0.5"]
    types = {m.id: (m.input_type, m.sparsity) for m in models.data}
    assert types["elastic:document"] == ("document", 0.0) and types["elastic@0.5"] == ("query", 0.5)
    one = httpx.get(live.url + "/v1/models/elastic@0.5", timeout=TIMEOUT_S).json()
    assert one["sparsity"] == 0.5 and one["dimensions"] == 384 and one["object"] == "model"
    assert httpx.get(live.url + "/v1/models/other", timeout=TIMEOUT_S).status_code == 404


ERRORS = [
    ({"model": "elastic"}, 400, "input", "'input' is required"),
    ({"model": "elastic", "input": 3}, 400, "input", "must be a string"),
    ({"model": "elastic", "input": ["a", ""]}, 400, "input", "'input'[1] is empty"),
    ({"model": "elastic", "input": ["a", [1, 2]]}, 400, "input", "must be a string"),
    ({"model": "elastic", "input": [[1, 10 ** 9]]}, 400, "input", "vocabulary"),
    ({"model": "elastic", "input": "a", "encoding_format": "int8"}, 400, "encoding_format", "'float' or 'base64'"),
    ({"model": "elastic", "input": "a", "dimensions": 128}, 400, "dimensions", "384 dimensions"),
    ({"model": "elastic", "input": "a", "sparsity": 1.5}, 400, "sparsity", "[0, 1)"),
    ({"model": "elastic@0.1", "input": "a", "sparsity": 0.5}, 400, "sparsity", "names sparsity 0.1"),
    ({"model": "elastic@0.9", "input": "a"}, 400, None, "above the sparsest served budget 0.5"),
    ({"model": "text-embedding-3-small", "input": "a"}, 404, "model", "does not exist"),
    ({"model": "elastic", "input": ["a"] * 2049}, 413, "input", "2049 items"),
]


def test_errors_in_openai_shape(live):
    for body, status, param, message in ERRORS:
        r = httpx.post(live.url + "/v1/embeddings", json=body, timeout=TIMEOUT_S)
        err = r.json()["error"]
        assert r.status_code == status and set(err) == {"message", "type", "param", "code"}, (body, r.text)
        assert message in err["message"] and err["param"] == param and "\n" not in err["message"], (body, err)
        assert err["type"] == "invalid_request_error"
    r = httpx.post(live.url + "/v1/embeddings", content=b"{not json", timeout=TIMEOUT_S)
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
    import openai

    with pytest.raises(openai.NotFoundError) as e:
        _client(live).embeddings.create(model="nope", input="a")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        _client(live).embeddings.create(model="elastic", input="a", dimensions=12)


def test_search_equals_brute_force_dense_and_stays_load_adaptive(live):
    """At sparsity 0 the search's top-10 is a brute-force search with the dense runtime; at 0.5 the
    query is encoded at 0.5 against the same index (never re-embedded)."""
    queries = ["python code file", "a cat and a dog", live.docs[11]["text"]]
    texts = [d["text"] for d in live.docs]
    r = httpx.post(live.url + "/v1/search", json={"query": queries, "top_k": 10, "return_text": True, "sparsity": 0.0},
                   timeout=TIMEOUT_S)
    body = r.json()
    assert r.status_code == 200 and body["served_sparsity"] == 0.0 and r.headers["x-elastic-served-sparsity"] == "0"
    want_pos, want_scores = brute_force(live.rt, texts, queries)
    for hit, pos, scores in zip(body["data"], want_pos, want_scores):
        np.testing.assert_allclose(hit["scores"], scores, atol=1e-5)
        assert hit["ids"] == [live.docs[p]["id"] for p in pos] and hit["texts"] == [texts[p] for p in pos]
    assert body["data"][2]["ids"][0] == live.docs[11]["id"]
    index_file = live.directory / "index" / "index.faiss"
    mtime = index_file.stat().st_mtime_ns
    r = httpx.post(live.url + "/v1/search", json={"query": "python code file", "top_k": 3, "model": "elastic@0.5"},
                   timeout=TIMEOUT_S)
    assert r.status_code == 200 and r.json()["served_sparsity"] == 0.5 and "texts" not in r.json()["data"][0]
    assert len(r.json()["data"][0]["ids"]) == 3 and index_file.stat().st_mtime_ns == mtime
    for bad, param in (({"query": "a", "top_k": 0}, "top_k"), ({"query": "a", "return_text": "yes"}, "return_text"),
                       ({"top_k": 3}, "query")):
        r = httpx.post(live.url + "/v1/search", json=bad, timeout=TIMEOUT_S)
        assert r.status_code == 400 and r.json()["error"]["param"] == param


@contextlib.contextmanager
def _uvicorn_errors():
    """The messages uvicorn logs as errors in the block (a bind failure: ``... address already in use``),
    seen by a filter on its ``uvicorn.error`` logger: uvicorn's logging config, applied by each ``Config``,
    replaces that logger's handlers and leaves its filters."""
    seen: list[str] = []

    class Seen(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            if record.levelno >= logging.ERROR:
                seen.append(record.getMessage())
            return True

    logger, f = logging.getLogger("uvicorn.error"), Seen()
    logger.addFilter(f)
    try:
        yield seen
    finally:
        logger.removeFilter(f)


def test_in_process_entry_point_starts_and_stops(live):
    """``run(create_app(DIR, grpc), host, port)``, what ``serve`` calls: serves, and ``stop()`` frees the port."""
    from elastic_export.serving.http_api import create_app, run

    def start(port: int):
        with _uvicorn_errors() as errors:
            try:
                return run(create_app(live.directory, live.grpc), "127.0.0.1", port)
            except RuntimeError as e:  # "did not start on 127.0.0.1:P" (stopped): why, uvicorn said
                busy = [x for x in errors if busy_port(x)]
                if busy:
                    raise PortInUse(f"{e}: {busy[0]}") from None
                raise

    server = on_a_free_block(start)
    port = server.port
    try:
        r = httpx.post(server.url + "/v1/embeddings", json={"model": "elastic@0.1", "input": TEXTS[:2]},
                       timeout=TIMEOUT_S)
        np.testing.assert_allclose(np.array([e["embedding"] for e in r.json()["data"]]), live.encode(TEXTS[:2], 0.1),
                                   atol=1e-5)
    finally:
        server.stop()
    assert not server.thread.is_alive() and TS.port_free("127.0.0.1", port)


def test_docs_embeddings_api_snippets_run(live, capsys):
    """docs/embeddings_api.md's python blocks, as written, against the live API and server (their URLs
    swapped in)."""
    import ast
    import re

    page = (Path(__file__).resolve().parents[1] / "docs" / "embeddings_api.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", page, re.S | re.M)
    assert len(blocks) == 4
    for block in blocks:
        block = block.replace("http://127.0.0.1:8003/v1", live.url + "/v1").replace("127.0.0.1:8001", live.grpc)
        exec(compile(block, "embeddings_api.md", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("(2, 384) 0.5 ") and out[1] == out[2] == "The cat sat on the mat."
    assert out[3].startswith("0")
    ids = {d["id"] for d in live.docs}  # the Triton search model on the same server: 5 ids of the index, at 0.5
    assert out[4].endswith(" [0.5]") and all(x in ids for x in ast.literal_eval(out[4].rsplit(" [", 1)[0]))
