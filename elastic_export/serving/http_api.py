"""OpenAI's embeddings API (``POST /v1/embeddings``, ``GET /v1/models``) and index search
(``POST /v1/search``) in front of the Triton router, so that the ``openai`` client, LangChain and
LlamaIndex work unmodified and every request is load-adaptive.

Entry points (``serve`` calls them once the Triton server is READY)::

    app = create_app(directory, "127.0.0.1:8001")      # a FastAPI app
    server = run(app, "127.0.0.1", 8003)               # uvicorn in a thread, started; server.stop()

or a process of its own: ``python -m elastic_export.serving.http_api DIR --grpc 127.0.0.1:8001 --port 8003``.

Extensions: the body field ``input_type`` (``query`` / ``document``, as Cohere, Voyage and Jina spell it;
model ids ``NAME:query`` / ``NAME:document`` for clients that cannot add a field): documents are embedded
dense through the indexing lane, queries at the budget the load allows; a request that states no type is a
document unless it names a budget. The body field ``sparsity`` and model ids ``NAME@S`` (listed by
``/v1/models``) name a query's budget; the served one is in the ``x-elastic-served-sparsity`` header and the
body's ``served_sparsity``.
FastAPI and uvicorn are imported by :func:`create_app` / :func:`run` only.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_export.serving import openai_schema as oa
from elastic_export.serving.openai_schema import ApiError

MAX_BODY_BYTES = 16 << 20
SPARSITY_HEADER, PRECISION_HEADER = "x-elastic-served-sparsity", "x-elastic-served-precision"
MAX_TOP_K = 1000
KEEP_ALIVE_S = 75  # an idle connection is closed after this (uvicorn's 5 s is shorter than clients' and balancers'
# idle timeouts: the server closed connections a client was reusing, which that client saw as a dropped request)


@dataclass
class ApiState:
    """What the routes share: the model's name, tokenizer and dims, the router client, the index
    (:class:`~elastic_export.index.store.LiveIndex`: one whole build at a time, reloaded when rebuilt)."""

    name: str
    encoder: Any
    max_len: int
    vocab: int
    dims: int | None
    router: Any
    index: Any = None
    created: int = field(default_factory=lambda: int(time.time()))


def load_state(directory: str | Path, grpc_url: str, model_name: str | None = None, max_batch: int | None = None,
               timeout_s: float = 60.0) -> ApiState:
    """Read DIR's manifest, tokenizer and index (if any) for :func:`create_app`.

    Raises:
        UserError: not a text encoder's directory, no tokenizer, a broken index.
    """
    from elastic_export.core.errors import UserError
    from elastic_export.core.manifest import Manifest
    from elastic_export.index.store import LiveIndex
    from elastic_export.models.text import TextEncoder, tokenizer_folder
    from elastic_export.serving.router_client import RouterClient

    root = Path(directory)
    manifest = Manifest.load(root)
    inputs = [v.name for v in manifest.inputs]
    folder = tokenizer_folder(manifest, root) if "input_ids" in inputs else None
    if folder is None:
        raise UserError(f"{root}: the embeddings API needs a text encoder with its tokenizer")
    encoder = TextEncoder.from_dir(folder, inputs)
    outputs = {v.name: v for v in manifest.outputs}
    output = "sentence_embedding" if "sentence_embedding" in outputs else "last_hidden_state"
    shape = outputs[output].shape or []
    dims = shape[-1] if shape and isinstance(shape[-1], int) else None
    triton = manifest.triton or {}
    router_name = triton.get("router", "elastic")
    pad_id = (encoder.tokenizer.padding or {}).get("pad_id", 0)
    lane = (triton.get("index") or {}).get("name")
    client = RouterClient(grpc_url, router_name, inputs, output, pad_id, max_batch, timeout_s, lane)
    return ApiState(model_name or router_name, encoder, encoder.max_len, encoder.tokenizer.get_vocab_size(), dims,
                    client, LiveIndex.load(root))


def create_app(directory: str | Path, triton_grpc_url: str, model_name: str | None = None, max_batch: int | None = None,
               timeout_s: float = 60.0, limits=None):
    """The FastAPI app serving DIR's model through the router at ``triton_grpc_url`` (``host:port``).

    Args:
        directory: the artifact directory (its manifest, tokenizer and ``index/``).
        triton_grpc_url: the Triton server's gRPC address.
        model_name: the model id clients name (default: the router's name).
        max_batch: the most rows per router request (default: the router config's ``max_rows``).
        timeout_s: bound of each call to the router.
        limits: the API key and the limits at the door (:class:`~elastic_export.serving.api_guard.Limits`;
            default: no key, the default limits). ``app.state.guard`` is the door (:class:`Guard`).
    """
    from contextlib import asynccontextmanager

    from fastapi import FastAPI

    from elastic_export.serving.api_guard import Guard, Limits, TritonReadiness

    state = load_state(directory, triton_grpc_url, model_name, max_batch, timeout_s)
    ready = TritonReadiness(triton_grpc_url, _watched_models(directory))
    guard = Guard(None, limits or Limits(), ready)

    @asynccontextmanager
    async def lifespan(app):
        yield
        await state.router.close()
        await ready.close()

    app = FastAPI(title="elastic-export embeddings", lifespan=lifespan)
    app.state.api, app.state.guard = state, guard
    guard.metrics.watch_batches(lambda: state.router.batch_stats, lambda: state.router.lane_stats)
    app.add_middleware(_Door, guard=guard)
    _routes(app, state)
    return app


class _Door:
    """Starlette's middleware slot for the :class:`~elastic_export.serving.api_guard.Guard` made before the app."""

    def __init__(self, app, guard):
        guard.app, self.guard = app, guard

    async def __call__(self, scope, receive, send):
        await self.guard(scope, receive, send)


def _watched_models(directory: str | Path) -> list[str]:
    """What ``/ready`` asks Triton about: the router and every budget model of DIR's repository."""
    from elastic_export.core.manifest import Manifest

    triton = Manifest.load(Path(directory)).triton or {}
    return [m["name"] for m in triton.get("models", [])] + ([triton["router"]] if triton.get("router") else [])


def _routes(app, state: ApiState) -> None:
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    async def api_error(request, e: ApiError):
        return _json(e.body(), e.status, e.headers)

    async def http_error(request, e: HTTPException):
        return _json(ApiError(e.status_code, str(e.detail), None, None).body(), e.status_code)

    async def validation_error(request, e: RequestValidationError):
        return _json(ApiError(400, f"invalid request: {e.errors()[:1]}", None, "invalid_request").body(), 400)

    async def health():
        return {"status": "ok"}

    async def models():
        return {"object": "list", "data": await _models(state)}

    async def model(model_id: str):
        found = [m for m in await _models(state) if m["id"] == model_id]
        if not found:
            raise ApiError(404, f"The model '{model_id}' does not exist", "model", "model_not_found")
        return found[0]

    async def embeddings(request):
        return await _embeddings(state, await _body(request), request.is_disconnected)

    async def search(request):
        return await _search(state, await _body(request))

    for handler in (embeddings, search):  # the module's postponed annotations name no class FastAPI can resolve
        handler.__annotations__["request"] = Request
    model.__annotations__["model_id"] = str
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id}", model, methods=["GET"])
    app.add_api_route("/v1/embeddings", embeddings, methods=["POST"])
    app.add_api_route("/v1/search", search, methods=["POST"])


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None):
    from fastapi.responses import JSONResponse

    return JSONResponse(body, status_code=status, headers=headers)


async def _body(request) -> dict[str, Any]:
    """The request's JSON object, read within the door's limits: ApiError 413 past ``--payload-limit`` bytes
    (while reading) or ``--max-client-batch-size`` inputs, 400 when not a JSON object."""
    import json

    from elastic_export.serving.api_guard import Limits, check_inputs, read_limited

    guard = getattr(request.app.state, "guard", None)
    limits = guard.limits if guard is not None else Limits(payload_limit=MAX_BODY_BYTES)
    raw = await read_limited(request, limits.payload_limit, guard)
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise ApiError(400, f"the request body is not JSON ({e})", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", None, "invalid_json")
    check_inputs(body, limits.max_client_batch_size, guard)
    return body


async def _models(state: ApiState) -> list[dict[str, Any]]:
    info = await state.router.info()
    own = {"object": "model", "created": state.created, "owned_by": "elastic-export", "dimensions": state.dims}
    listed = [{"id": state.name, **own, "sparsity": None, "input_type": None}]
    listed += [{"id": f"{state.name}{oa.TYPE_SEP}{t}", **own, "sparsity": 0.0 if t == oa.DOCUMENT else None,
                "input_type": t} for t in (oa.QUERY, oa.DOCUMENT)]
    return listed + [{"id": f"{state.name}{oa.SEP}{s:g}", **own, "sparsity": s, "input_type": oa.QUERY}
                     for s in info.sparsities]


async def _encode(state: ApiState, body: dict[str, Any], field_name: str, gone=None, search: bool = False):
    """(served embeddings, prompt tokens, input type) of ``body[field_name]``: a query at the budget ``model`` /
    ``sparsity`` name (else the router's pick), a document dense through the indexing lane
    (:func:`~elastic_export.serving.openai_schema.resolve_request`); a search's text is a query."""
    if field_name not in body:
        raise ApiError(400, f"'{field_name}' is required", field_name, "missing_required_parameter")
    asked = oa.resolve_request(body.get("model", state.name), state.name, body.get("sparsity"), body.get("input_type"),
                               oa.QUERY if search else None)
    if search and asked.input_type != oa.QUERY:
        raise ApiError(400, "a search's text is a query: 'input_type' must be 'query' or absent", "input_type",
                       "invalid_input_type")
    items = oa.input_items(body[field_name], field_name)
    rows = oa.tokenize(state.encoder, items, state.max_len, state.vocab)
    if asked.input_type == oa.DOCUMENT:
        served = await state.router.embed_documents(rows, gone)
    else:
        served = await state.router.embed(rows, asked.sparsity)
    return served, sum(len(r.ids) for r in rows), asked.input_type


def _served_headers(served) -> dict[str, str]:
    return {SPARSITY_HEADER: f"{served.sparsity:g}", PRECISION_HEADER: served.precision}


async def _embeddings(state: ApiState, body: dict[str, Any], gone=None):
    fmt = oa.encoding_format(body.get("encoding_format"))
    oa.check_dimensions(body.get("dimensions"), state.dims)
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise ApiError(400, "'user' must be a string", "user", "invalid_user")
    served, tokens, kind = await _encode(state, body, "input", gone)
    out = {"object": "list", "data": oa.embedding_data(served.vectors, fmt), "model": body.get("model", state.name),
           "usage": {"prompt_tokens": tokens, "total_tokens": tokens}, "input_type": kind,
           "served_sparsity": served.sparsity, "served_precision": served.precision}
    return _json(out, 200, _served_headers(served))


async def _search(state: ApiState, body: dict[str, Any]):
    index = await _current_index(state)
    top_k = body.get("top_k", 10)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= MAX_TOP_K:
        raise ApiError(400, f"'top_k' must be an integer in [1, {MAX_TOP_K}], got {top_k!r}", "top_k", "invalid_top_k")
    with_text = body.get("return_text", False)
    if not isinstance(with_text, bool):
        raise ApiError(400, "'return_text' must be true or false", "return_text", "invalid_return_text")
    served, tokens, _ = await _encode(state, body, "query", search=True)
    scores, positions = await asyncio.to_thread(index.search, served.vectors, top_k)
    hits = index.hits(scores, positions, with_text)  # the build that searched: its ids and texts
    out = {"object": "list", "data": [{"object": "search_result", "index": i, **h} for i, h in enumerate(hits)],
           "model": body.get("model", state.name), "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
           "served_sparsity": served.sparsity, "served_precision": served.precision}
    return _json(out, 200, _served_headers(served))


async def _current_index(state: ApiState):
    """The build this search answers from, taken once (an index built after start is read here first)."""
    live = state.index
    index = live.current() if live is not None else None
    if index is None and live is not None:
        await asyncio.to_thread(live.reload)
        index = live.build
    if index is None:
        raise ApiError(404, "no index: build one with `elastic-export index DIR CORPUS`", None, "no_index")
    return index


# --- running it -------------------------------------------------------------------------------------
class ApiServer:
    """uvicorn serving ``app`` in a thread of this process; :meth:`stop` ends it (bounded)."""

    def __init__(self, app, host: str, port: int, log_level: str = "warning"):
        import uvicorn

        self.host, self.port, self.app = host, port, app
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                                    timeout_keep_alive=KEEP_ALIVE_S))
        self.thread = threading.Thread(target=self.server.run, name="http-api", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> "ApiServer":
        """Start and wait until it accepts connections; RuntimeError if it does not in time (a busy port)."""
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the HTTP API did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        return self

    def drain(self, timeout_s: float) -> bool:
        """Drain (``/ready`` 503, new ``/v1`` requests 503 with Retry-After), wait up to ``timeout_s`` for the
        requests in flight to be answered and the senders to go quiet, then stop; whether every one was
        answered."""
        guard = getattr(self.app.state, "guard", None)
        idle = True
        if guard is not None:
            guard.drain()
            idle = guard.wait_drained(timeout_s)
        self.stop(max(1.0, min(10.0, timeout_s)))
        return idle

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask uvicorn to exit (open connections get ``timeout_s``) and join its thread."""
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout_s)
        if self.thread.is_alive():
            self.server.force_exit = True
            self.thread.join(timeout_s)


def run(app, host: str = "127.0.0.1", port: int = 8003, timeout_s: float = 30.0) -> ApiServer:
    """Serve ``app`` with uvicorn in a background thread; returns the started :class:`ApiServer`."""
    return ApiServer(app, host, port).start(timeout_s)


def main(argv: list[str] | None = None) -> int:
    """``python -m elastic_export.serving.http_api DIR --grpc HOST:PORT [--host H] [--port P]``: the API
    in the foreground (SIGTERM / Ctrl-C stop it); prints one ``ready:`` line. The API key comes from
    ``ELASTIC_EXPORT_API_KEY`` (never the command line)."""
    import argparse
    import os
    import sys

    import uvicorn

    from elastic_export.core.errors import UserError
    from elastic_export.serving.api_guard import API_KEY_ENV, Limits, check_exposure

    ap = argparse.ArgumentParser(prog="python -m elastic_export.serving.http_api")
    ap.add_argument("directory")
    ap.add_argument("--grpc", required=True, help="the Triton server's gRPC address, host:port")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8003)
    ap.add_argument("--model-name", default=None)
    ap.add_argument("--max-batch", type=int, default=None)
    ap.add_argument("--allow-no-api-key", action="store_true", help=f"serve a non-loopback --host without {API_KEY_ENV}")
    a = ap.parse_args(argv)
    try:
        limits = Limits(api_key=os.environ.get(API_KEY_ENV) or None)
        check_exposure(a.host, limits.api_key, a.allow_no_api_key)
        app = create_app(a.directory, a.grpc, a.model_name, a.max_batch, limits=limits)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    server = uvicorn.Server(uvicorn.Config(app, host=a.host, port=a.port, log_level="warning",
                                           timeout_keep_alive=KEEP_ALIVE_S))
    loop_started = server.startup

    async def startup(sockets=None):
        await loop_started(sockets)
        if server.started:
            print(f"ready: OpenAI embeddings API http://{a.host}:{a.port}/v1 (search: "
                  f"{'yes' if app.state.api.index.build is not None else 'no index'})", flush=True)

    server.startup = startup
    server.run()
    return 0 if server.started else 2


if __name__ == "__main__":
    raise SystemExit(main())
