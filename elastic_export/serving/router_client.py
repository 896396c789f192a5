"""The HTTP API's way to the Triton server: tritonclient's asyncio gRPC client, the router's limits
read from its config, queries sent through the router (split into batches it takes), documents sent
dense through the indexing lane (sorted by length into token-bounded batches, a few in flight, answered
in order), and gRPC errors turned into OpenAI-shaped ones."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Sequence

import numpy as np

from elastic_export.serving.coalesce import QUEUED_PARAMETER, BatchStats
from elastic_export.serving.openai_schema import ApiError, Tokens, feeds

DEFAULT_MAX_ROWS = 128
DEFAULT_SLO_MS = 250.0  # the router's, where its config names none
DEADLINE_SHARE = 0.95  # a query still waiting in the API past this share of the SLO is refused, not sent
INDEX_BATCH_TOKENS = 4096  # padded tokens in one indexing-lane batch (TEI's --max-batch-tokens)
INDEX_IN_FLIGHT = 2  # indexing-lane batches in flight at once, over every request: one runs, one is ready
FEW_DOCUMENTS = (4, 1024)  # at most these rows and padded tokens: a request of documents someone waits for
SPARSITY_INPUT, SERVED, PRECISION = "sparsity", "served_sparsity", "served_precision"


@dataclass
class Served:
    """The embeddings of a request (in input order) and the budget that served them."""

    vectors: np.ndarray
    sparsity: float
    precision: str


@dataclass
class RouterInfo:
    """What the router's config says: its largest request and the budgets it serves."""

    max_rows: int
    sparsities: list[float]
    precision: str = "fp32"
    slo_ms: float | None = None  # the adaptive policy's SLO (None: a fixed policy, no deadline)


def document_batches(lengths: Sequence[int], max_rows: int, max_tokens: int = INDEX_BATCH_TOKENS) -> list[list[int]]:
    """Row indices in batches for the indexing lane: longest first, so that rows of similar length pad
    together; each batch at most ``max_rows`` rows and ``max_tokens`` padded tokens (a row longer than
    that alone)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and len(batches[-1]) < max_rows and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def few_documents(rows: Sequence[Tokens]) -> bool:
    """Whether documents this few and short are served beside the queries (:data:`FEW_DOCUMENTS`), not
    in the indexing lane."""
    most_rows, most_tokens = FEW_DOCUMENTS
    return len(rows) <= most_rows and len(rows) * max((len(r.ids) for r in rows), default=0) <= most_tokens


def padding_waste(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> float:
    """The fraction of the padded tokens of ``batches`` that are padding."""
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    return 1.0 - sum(lengths) / padded if padded else 0.0


class RouterClient:
    """Embeddings from the router ``router`` at gRPC ``url`` (``host:port``).

    Args:
        url: the server's gRPC address.
        router: the router model's name.
        input_names: the model inputs to send (``input_ids``, ``attention_mask``, ...).
        output: the output to ask for: ``sentence_embedding``, or ``last_hidden_state`` (mean-pooled here).
        pad_id: the tokenizer's padding id.
        max_rows: the largest batch to send (None: the router config's ``max_rows``).
        timeout_s: the bound on each gRPC call.
        index_model: the indexing lane's model (None: documents go through the router at sparsity 0).
    """

    def __init__(self, url: str, router: str, input_names: Sequence[str], output: str, pad_id: int,
                 max_rows: int | None = None, timeout_s: float = 60.0, index_model: str | None = None):
        self.url, self.router, self.input_names, self.output = url, router, list(input_names), output
        self.pad_id, self.timeout_s, self._max_rows, self.index_model = pad_id, timeout_s, max_rows, index_model
        self._client: Any = None
        self._info: RouterInfo | None = None
        self._lane: asyncio.Semaphore | None = None
        self._batcher: Any = None  # QueryBatcher, made on the serving loop
        self._lag: Any = None  # its LoopLag
        self.lane_stats = BatchStats()  # the indexing lane's batches: requests = batches, queries = documents

    def _grpc(self):
        if self._client is None:  # created on the serving loop: grpc.aio channels belong to one loop
            import tritonclient.grpc.aio as aio

            self._client = aio.InferenceServerClient(self.url)
        return self._client

    async def close(self) -> None:
        if self._lag is not None:
            await self._lag.stop()
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def info(self) -> RouterInfo:
        """The router's limits and budgets (read once from its config)."""
        if self._info is None:
            try:
                cfg = (await self._grpc().get_model_config(self.router, as_json=True, client_timeout=self.timeout_s))["config"]
            except Exception as e:
                raise _api_error(e) from None
            params = {k: v.get("string_value") for k, v in cfg.get("parameters", {}).items()}
            rows = self._max_rows or int(params.get("max_rows") or DEFAULT_MAX_ROWS)
            models = json.loads(params.get("budget_models") or "[]")
            slo = float(params.get("slo_ms") or DEFAULT_SLO_MS) if params.get("policy") == "adaptive" else None
            self._info = RouterInfo(rows, sorted(float(s) for s, _ in models), params.get("precision") or "fp32", slo)
        return self._info

    async def embed(self, rows: Sequence[Tokens], sparsity: float | None) -> Served:
        """Every row's embedding: the first batch as asked (the router's policy picks the budget when
        ``sparsity`` is None), the others one after another at the budget it served, so that one response
        holds embeddings of one budget (one after another: sent at once, each would queue behind the
        others and the router's admission would refuse them as late)."""
        info = await self.info()
        size = info.max_rows
        if len(rows) < size:  # a query: merged with the others waiting (coalesce.QueryBatcher)
            return await self.batcher(info).embed(rows, sparsity)
        chunks = [rows[i:i + size] for i in range(0, len(rows), size)]
        first = await self._infer(chunks[0], sparsity)
        rest = [await self._infer(c, first.sparsity) for c in chunks[1:]]
        vectors = np.concatenate([first.vectors, *(r.vectors for r in rest)]) if rest else first.vectors
        return Served(vectors, first.sparsity, first.precision)

    async def embed_documents(self, rows: Sequence[Tokens],
                              gone: Callable[[], Awaitable[bool]] | None = None) -> Served:
        """Every row's embedding, dense, through the indexing lane: rows sorted by length into batches of
        at most :data:`INDEX_BATCH_TOKENS` padded tokens, at most :data:`INDEX_IN_FLIGHT` batches in flight
        over every request (the lane's model runs at the lowest priority: queries come first). A batch
        whose client has gone (``gone()``) is not sent: ApiError 499. A request of :data:`FEW_DOCUMENTS` (a
        document someone uploads and waits for, not an indexing batch) goes through the router at sparsity 0
        instead, beside the queries and counted in their admission, unless the router answers it sparser (its
        dense model down): then the lane."""
        info = await self.info()
        if self.index_model is None:
            return await self.embed(rows, 0.0)
        if few_documents(rows):  # its own request, now: beside the merged queries, not waiting for their slot
            served = await self._infer(rows, 0.0)
            if served.sparsity == 0.0:
                return served
        if self._lane is None:  # created on the serving loop
            self._lane = asyncio.Semaphore(INDEX_IN_FLIGHT)
        out: list[Any] = [None] * len(rows)

        async def run(batch: list[int]) -> None:
            async with self._lane:
                if gone is not None and await gone():
                    raise ApiError(499, "the client closed the request; its remaining documents were not run",
                                   None, "client_closed")
                self.lane_stats.count(len(batch), [len(rows[i].ids) for i in batch])
                got = await self._infer([rows[i] for i in batch], None, self.index_model)
            for i, v in zip(batch, got.vectors):
                out[i] = v

        tasks = [asyncio.ensure_future(run(b)) for b in document_batches([len(r.ids) for r in rows], info.max_rows)]
        try:
            await asyncio.gather(*tasks)
        except BaseException:  # the first failure (or the client's cancellation) cancels the rest
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return Served(np.stack(out), 0.0, info.precision)

    @property
    def batch_stats(self) -> Any:
        """The query batcher's :class:`~elastic_export.serving.coalesce.BatchStats` (None before a query)."""
        return None if self._batcher is None else self._batcher.stats

    def batcher(self, info: RouterInfo) -> Any:
        """The :class:`~elastic_export.serving.coalesce.QueryBatcher` that merges concurrent queries (made once,
        from the router's ``info``); a query predicted past :data:`DEADLINE_SHARE` of the SLO (on arrival, or
        its wait and the next round trip) is refused (503) instead of sent."""
        if self._batcher is None:
            slo_ms = info.slo_ms
            from elastic_export.serving.coalesce import LoopLag, QueryBatcher

            def late(ms: float) -> ApiError:
                return ApiError(503, f"overloaded: the query would be answered in about {ms:.0f} ms, past "
                                     f"the SLO of {slo_ms:g} ms; retry later", None, "overloaded", {"Retry-After": "1"})

            self._lag = LoopLag()
            self._lag.start()
            self._batcher = QueryBatcher(lambda rows, sparsity, queued_ms: self._infer(rows, sparsity, None, queued_ms),
                                         info.max_rows, deadline_ms=None if slo_ms is None else DEADLINE_SHARE * slo_ms,
                                         late=late, lag_ms=self._lag.ms)
        return self._batcher

    async def _infer(self, rows: Sequence[Tokens], sparsity: float | None, model: str | None = None,
                     queued_ms: float = 0.0) -> Served:
        """One batch through the router (``model`` None) or straight to ``model`` (dense, no sparsity);
        ``queued_ms``: how long its oldest query waited in the API (the router's admission counts it)."""
        import tritonclient.grpc as grpcclient

        arrays = feeds(rows, self.input_names, self.pad_id)
        if sparsity is not None:
            arrays[SPARSITY_INPUT] = np.array([[sparsity]], dtype=np.float32)
        inputs = []
        for name, a in arrays.items():
            t = grpcclient.InferInput(name, list(a.shape), "FP32" if a.dtype == np.float32 else "INT64")
            t.set_data_from_numpy(a)
            inputs.append(t)
        wanted = (self.output,) if model is not None else (self.output, SERVED, PRECISION)
        outputs = [grpcclient.InferRequestedOutput(n) for n in wanted]
        try:
            params = {QUEUED_PARAMETER: round(queued_ms, 3)} if queued_ms > 0 and model is None else None
            got = await self._grpc().infer(model or self.router, inputs, outputs=outputs, client_timeout=self.timeout_s,
                                           parameters=params)
        except Exception as e:
            raise _api_error(e) from None
        vectors = got.as_numpy(self.output)
        if self.output == "last_hidden_state":
            from elastic_export.models.text import mean_pool

            vectors = mean_pool(vectors, arrays["attention_mask"])
        vectors = np.asarray(vectors, dtype=np.float32)
        if model is not None:
            return Served(vectors, 0.0, "")
        served, precision = got.as_numpy(SERVED).reshape(-1), got.as_numpy(PRECISION).reshape(-1)
        p = precision[0].decode() if isinstance(precision[0], bytes) else str(precision[0])
        return Served(vectors, float(served[0]), p)


def _api_error(e: Exception) -> ApiError:
    """A gRPC failure as the HTTP API answers it: UNAVAILABLE (the router refused for overload, or the
    server is not reachable) 503 with Retry-After, INVALID_ARGUMENT 400, DEADLINE_EXCEEDED 504, else 502."""
    status = str(e.status()) if hasattr(e, "status") and callable(e.status) else ""
    message = e.message() if hasattr(e, "message") and callable(e.message) else str(e)
    message = " ".join(str(message).split())
    if "UNAVAILABLE" in status:
        text = message if message.startswith("overloaded") else f"the model server is unavailable: {message}"
        return ApiError(503, text, None, "overloaded", {"Retry-After": "1"})
    if "INVALID_ARGUMENT" in status or "BudgetError" in message:
        return ApiError(400, message, None, "invalid_request")
    if "DEADLINE_EXCEEDED" in status:
        return ApiError(504, f"the model server did not answer in time: {message}", None, "timeout")
    if "NOT_FOUND" in status:
        return ApiError(502, f"the model server does not serve the router: {message}", None, "upstream_error")
    return ApiError(502, f"the model server failed: {message}", None, "upstream_error")
