"""The OpenAI-style API's door, what a server reachable by other machines needs (TEI's and vLLM's
basics): an API key, limits on what one request and all of them together may take, health and
readiness probes, a graceful drain and Prometheus metrics of the API layer.

:class:`Guard` is ASGI middleware in front of :mod:`elastic_export.serving.http_api`'s app:

* ``/health`` answers 200 while the process lives (draining too); ``/ready`` 200 only while Triton answers
  and the router and every budget model are READY and the API is not draining, else 503. Neither asks for
  the key (probes carry none).
* every ``/v1/*`` route and ``GET /metrics`` need ``Authorization: Bearer KEY`` when a key is set (compared
  in constant time, :func:`hmac.compare_digest`): 401 in OpenAI's error shape otherwise;
* draining (:meth:`Guard.drain`, SIGTERM in ``serve``): new ``/v1`` requests get 503 with ``Retry-After``,
  the ones in flight are answered, every response says ``Connection: close``; the listener stays open
  until no ``/v1`` request has come for :data:`DRAIN_QUIET_S` (:meth:`Guard.wait_drained`), so a client
  or load balancer still sending is told to go elsewhere instead of finding the port closed;
* more ``/v1`` requests in flight than ``max_concurrent_requests``: 429 with ``Retry-After``.

The body limit and the inputs per request are checked while the body is read
(:func:`read_limited`, :func:`count_inputs`, used by ``http_api._body``).
"""

from __future__ import annotations

import hmac
import ipaddress
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Sequence

from elastic_export.serving.openai_schema import MAX_INPUTS, ApiError

API_KEY_ENV = "ELASTIC_EXPORT_API_KEY"
PAYLOAD_LIMIT = 16 << 20  # bytes of a request body (TEI: 2 MB; OpenAI's 2048 inputs need more)
MAX_CONCURRENT = 512  # TEI's default
RETRY_AFTER_S = 1
DRAIN_QUIET_S = 2.0  # a drain ends after this long without a /v1 request: 2x Retry-After, a probe period
OPEN_PATHS = ("/health", "/ready")  # no key asked: probes
ROUTES = ("/v1/embeddings", "/v1/search", "/v1/models", "/health", "/ready", "/metrics")  # metric labels
REASONS = ("unauthorized", "payload_too_large", "too_many_inputs", "concurrency", "draining")


@dataclass(frozen=True)
class Limits:
    """What the door lets in (``serve``'s ``--api-key``, ``--payload-limit``, ``--max-client-batch-size``,
    ``--max-concurrent-requests``)."""

    api_key: str | None = None
    payload_limit: int = PAYLOAD_LIMIT
    max_client_batch_size: int = MAX_INPUTS
    max_concurrent_requests: int = MAX_CONCURRENT

    def check(self) -> None:
        """Raises UserError for a limit that is not a positive integer or an empty key."""
        from elastic_export.core.errors import UserError

        for name, value in (("--payload-limit", self.payload_limit), ("--max-client-batch-size", self.max_client_batch_size),
                            ("--max-concurrent-requests", self.max_concurrent_requests)):
            if not value >= 1:
                raise UserError(f"{name} must be at least 1, got {value}")
        if self.api_key is not None and not self.api_key.strip():
            raise UserError(f"the API key is empty: set --api-key or {API_KEY_ENV} to a non-empty secret")


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (127.0.0.0/8, ::1) or ``localhost``."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class ApiMetrics:
    """The API layer's Prometheus metrics, in a registry of their own (one per app)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("elastic_api_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=self.registry)
        self.latency = Histogram("elastic_api_request_duration_seconds", "Time to answer a request, by route",
                                 ["route"], registry=self.registry,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.in_flight = Gauge("elastic_api_in_flight", "/v1 requests being answered", registry=self.registry)
        self.refused = Counter("elastic_api_refused", "Requests refused at the door, by reason", ["reason"],
                               registry=self.registry)
        for reason in REASONS:
            self.refused.labels(reason)

    def watch_batches(self, stats: Callable[[], Any], lane: Callable[[], Any] = lambda: None) -> None:
        """Also expose the merged queries' counts (``stats()``: a :class:`~elastic_export.serving.coalesce.
        BatchStats` or None before the first query): router requests, queries, real and padded tokens (the
        padding waste is 1 - real / padded), queries refused unsent past their deadline; and the indexing
        lane's (``lane()``): its batches, documents, real and padded tokens."""
        self.registry.register(_BatchCollector(stats, lane))

    def exposition(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _BatchCollector:
    """Prometheus counters read from the query batcher's stats at each scrape."""

    def __init__(self, stats: Callable[[], Any], lane: Callable[[], Any]):
        self.stats, self.lane = stats, lane

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        st = self.stats()
        get = (lambda name: 0) if st is None else (lambda name: getattr(st, name))
        yield CounterMetricFamily("elastic_api_query_batches", "Router requests carrying merged queries",
                                  value=get("requests"))
        yield CounterMetricFamily("elastic_api_queries_batched", "Queries sent in merged router requests",
                                  value=get("queries"))
        tokens = CounterMetricFamily("elastic_api_query_tokens", "Tokens of the merged queries: real, and padded "
                                     "(as sent; padding waste = 1 - real / padded)", labels=["kind"])
        tokens.add_metric(["real"], get("tokens"))
        tokens.add_metric(["padded"], get("padded"))
        yield tokens
        yield CounterMetricFamily("elastic_api_queries_late", "Queries refused unsent: they waited past the SLO",
                                  value=get("late"))
        yield CounterMetricFamily("elastic_api_queries_refused", "Queries refused on arrival: predicted past the SLO",
                                  value=get("refused"))
        lane = self.lane()
        if lane is not None:
            yield CounterMetricFamily("elastic_api_document_batches", "Indexing-lane batches sent", value=lane.requests)
            yield CounterMetricFamily("elastic_api_documents_batched", "Documents sent in indexing-lane batches",
                                      value=lane.queries)
            tokens = CounterMetricFamily("elastic_api_document_tokens", "Tokens of the indexing lane's batches: real, "
                                         "and padded (as sent; padding waste = 1 - real / padded)", labels=["kind"])
            tokens.add_metric(["real"], lane.tokens)
            tokens.add_metric(["padded"], lane.padded)
            yield tokens


def route_of(path: str) -> str:
    """The metric label of a path: one of :data:`ROUTES`, ``/v1/models/{id}`` or ``other`` (bounded labels)."""
    if path in ROUTES:
        return path
    return "/v1/models/{id}" if path.startswith("/v1/models/") else "other"


class Guard:
    """ASGI middleware: key, concurrency, drain, ``/ready``, ``/metrics`` (module docstring).

    Args:
        app: the ASGI app behind the door.
        limits: the key and the limits.
        ready: an async check of what serves behind the API: (ready, why not).
    """

    def __init__(self, app, limits: Limits, ready: Callable[[], Awaitable[tuple[bool, str]]] | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        self.app, self.limits, self.ready = app, limits, ready
        self.key = limits.api_key.encode() if limits.api_key else None
        self.metrics = ApiMetrics()
        self.in_flight = 0
        self.draining = False
        self.clock, self.sleep = clock, sleep
        self.last_arrival = clock()  # of a /v1 request, answered or refused

    def drain(self) -> None:
        """Start draining: ``/ready`` 503, new ``/v1`` requests 503, in-flight ones answered."""
        self.draining = True

    def wait_drained(self, timeout_s: float, quiet_s: float = DRAIN_QUIET_S) -> bool:
        """Poll (from another thread) until no ``/v1`` request is in flight and none has arrived for
        ``quiet_s``, or ``timeout_s``; whether every request in flight was answered."""
        deadline = self.clock() + timeout_s
        while self.clock() < deadline and (self.in_flight > 0 or self.clock() - self.last_arrival < quiet_s):
            self.sleep(0.02)
        return self.in_flight == 0

    def refuse(self, reason: str) -> None:
        """Count a refusal (``http_api._body`` counts its own: payload, inputs)."""
        self.metrics.refused.labels(reason).inc()

    def authorized(self, scope) -> bool:
        if self.key is None:
            return True
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, start = scope["path"], time.perf_counter()
        route, status = route_of(path), [500]

        async def counted(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                if self.draining:
                    message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        try:
            await self._dispatch(path, scope, receive, counted)
        finally:
            self.metrics.requests.labels(route, str(status[0])).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - start)

    async def _dispatch(self, path: str, scope, receive, send) -> None:
        """What the door does with one request (after it is counted)."""
        if path == "/ready":
            return await self._ready(send)
        if path in OPEN_PATHS or not (path.startswith("/v1/") or path == "/metrics"):
            return await self.app(scope, receive, send)
        if not self.authorized(scope):
            self.refuse("unauthorized")
            return await _error(send, ApiError(401, "Incorrect or missing API key: send the header "
                                                    "'Authorization: Bearer KEY'", None, "invalid_api_key",
                                               {"www-authenticate": "Bearer"}))
        if path == "/metrics":
            body, kind = self.metrics.exposition()
            return await _send(send, 200, body, kind)
        self.last_arrival = self.clock()
        if self.draining:
            self.refuse("draining")
            return await _error(send, ApiError(503, "the server is draining for a restart; retry on another "
                                                    "replica or later", None, "draining", _retry()))
        if self.in_flight >= self.limits.max_concurrent_requests:
            self.refuse("concurrency")
            return await _error(send, ApiError(429, f"more than {self.limits.max_concurrent_requests} requests "
                                                    "in flight (--max-concurrent-requests); retry later", None,
                                               "too_many_concurrent_requests", _retry()))
        self.in_flight += 1
        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            self.metrics.in_flight.dec()

    async def _ready(self, send) -> None:
        ok, why = (False, "draining") if self.draining else (True, "")
        if ok and self.ready is not None:
            ok, why = await self.ready()
        body = {"status": "ready"} if ok else {"status": "not ready", "reason": why}
        await _send(send, 200 if ok else 503, _dumps(body), "application/json",
                    {} if ok else _retry())


def _retry() -> dict[str, str]:
    return {"retry-after": str(RETRY_AFTER_S)}


def _dumps(body: Any) -> bytes:
    import json

    return json.dumps(body).encode()


async def _error(send, e: ApiError) -> None:
    await _send(send, e.status, _dumps(e.body()), "application/json", e.headers)


async def _send(send, status: int, body: bytes, kind: str, headers: dict[str, str] | None = None) -> None:
    raw = [(b"content-type", kind.encode()), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


# --- the body: read within the limit, inputs counted ---------------------------------------------------
async def read_limited(request, limit: int, guard: "Guard | None" = None) -> bytes:
    """The request's body, read chunk by chunk: ApiError 413 as soon as it passes ``limit`` bytes (a
    declared Content-Length before reading anything), so a huge or chunked body is never held whole."""
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > limit:
        _refused(guard, "payload_too_large")
        raise ApiError(413, f"the request body has {length} bytes, more than {limit} (--payload-limit)", None,
                       "request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            _refused(guard, "payload_too_large")
            raise ApiError(413, f"the request body passed {limit} bytes (--payload-limit)", None, "request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def count_inputs(body: dict[str, Any], fields: Sequence[str] = ("input", "query")) -> tuple[str, int]:
    """(the field, how many inputs it carries): a list of strings or of token lists counts each; a string
    or one token list counts one."""
    for name in fields:
        value = body.get(name)
        if isinstance(value, list) and value and any(isinstance(v, (str, list)) for v in value):
            return name, len(value)
        if value is not None:
            return name, 1
    return fields[0], 0


def check_inputs(body: dict[str, Any], limit: int, guard: "Guard | None" = None) -> None:
    """ApiError 413 for more inputs than ``limit`` (``--max-client-batch-size``)."""
    name, n = count_inputs(body)
    if n > limit:
        _refused(guard, "too_many_inputs")
        raise ApiError(413, f"'{name}' has {n} items, more than {limit} in one request (--max-client-batch-size); "
                            "split it", name, "too_many_inputs")


def _refused(guard: "Guard | None", reason: str) -> None:
    if guard is not None:
        guard.refuse(reason)


# --- readiness: Triton, the router and every budget model READY ---------------------------------------
class TritonReadiness:
    """``/ready``'s check through Triton's gRPC health API (unrestricted): the server and each of
    ``models`` READY, each call bounded by ``timeout_s``. The client is made on the serving loop."""

    def __init__(self, grpc_url: str, models: Sequence[str], timeout_s: float = 1.0):
        self.url, self.models, self.timeout_s = grpc_url, list(models), timeout_s
        self._client = None

    async def __call__(self) -> tuple[bool, str]:
        import tritonclient.grpc.aio as aio

        if self._client is None:
            self._client = aio.InferenceServerClient(self.url)
        try:
            if not await self._client.is_server_ready(client_timeout=self.timeout_s):
                return False, "tritonserver is not ready"
            for m in self.models:
                if not await self._client.is_model_ready(m, client_timeout=self.timeout_s):
                    return False, f"model {m} is not ready"
        except Exception as e:  # noqa: BLE001 - any failure to reach the server means not ready
            return False, f"tritonserver unreachable ({type(e).__name__})"
        return True, ""

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()


def check_exposure(host: str, api_key: str | None, allow_no_api_key: bool) -> None:
    """Refuse an API on a non-loopback ``host`` without a key, unless the operator opted out."""
    from elastic_export.core.errors import UserError

    if api_key is None and not allow_no_api_key and not is_loopback(host):
        raise UserError(f"--host {host} puts the API on the network without a key: set {API_KEY_ENV} (or "
                        "--api-key-file), or pass --allow-no-api-key to serve it open")


@dataclass(frozen=True)
class Exposure:
    """How ``serve`` faces the network: the API's key and limits, Triton's own ports on the network or not
    (``--expose-triton``), an open API on a non-loopback host allowed or not, the drain's bound."""

    limits: Limits = Limits()
    expose_triton: bool = False
    allow_no_api_key: bool = False
    drain_timeout_s: float = 30.0

    def check(self, host: str) -> None:
        """Raises UserError for a bad limit, a drain bound that is not positive, or an open non-loopback API."""
        from elastic_export.core.errors import UserError

        self.limits.check()
        if not self.drain_timeout_s > 0:
            raise UserError(f"--drain-timeout must be positive, got {self.drain_timeout_s:g}")
        check_exposure(host, self.limits.api_key, self.allow_no_api_key)

    def triton_host(self, host: str) -> str:
        """Where Triton's HTTP, gRPC and metrics bind: ``host`` when exposed, else 127.0.0.1."""
        return host if self.expose_triton else "127.0.0.1"


def hide_argument(secret: str, pid: int | str = "self") -> bool:
    """Overwrite ``secret`` in the command line of process ``pid`` (this one, or a child: what ``ps`` and
    ``/proc/PID/cmdline`` show) with ``*``: Linux only; whether it was there and is gone. Before the call it
    was readable (an environment variable or a key file never is)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end: fields 48 and 49
        with open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
            mem.seek(start)
            args = mem.read(end - start)
            needle = secret.encode()
            if not needle or needle not in args:
                return False
            mem.seek(start)
            mem.write(args.replace(needle, b"*" * len(needle)))
    except (OSError, ValueError, IndexError):
        return False
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return secret.encode() not in f.read()
