"""The HTTP API's way to the Triton router: tritonclient's asyncio gRPC client, the router's limits
read from its config, a request of any size split into batches the router takes (sent concurrently,
answered in order), and gRPC errors turned into OpenAI-shaped ones."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from elastic_export.serving.openai_schema import ApiError, Tokens, feeds

DEFAULT_MAX_ROWS = 128
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
    """

    def __init__(self, url: str, router: str, input_names: Sequence[str], output: str, pad_id: int,
                 max_rows: int | None = None, timeout_s: float = 60.0):
        self.url, self.router, self.input_names, self.output = url, router, list(input_names), output
        self.pad_id, self.timeout_s, self._max_rows = pad_id, timeout_s, max_rows
        self._client: Any = None
        self._info: RouterInfo | None = None

    def _grpc(self):
        if self._client is None:  # created on the serving loop: grpc.aio channels belong to one loop
            import tritonclient.grpc.aio as aio

            self._client = aio.InferenceServerClient(self.url)
        return self._client

    async def close(self) -> None:
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
            self._info = RouterInfo(rows, sorted(float(s) for s, _ in models))
        return self._info

    async def embed(self, rows: Sequence[Tokens], sparsity: float | None) -> Served:
        """Every row's embedding: the first batch as asked (the router's policy picks the budget when
        ``sparsity`` is None), the others one after another at the budget it served, so that one response
        holds embeddings of one budget (one after another: sent at once, each would queue behind the
        others and the router's admission would refuse them as late)."""
        size = (await self.info()).max_rows
        chunks = [rows[i:i + size] for i in range(0, len(rows), size)]
        first = await self._infer(chunks[0], sparsity)
        rest = [await self._infer(c, first.sparsity) for c in chunks[1:]]
        vectors = np.concatenate([first.vectors, *(r.vectors for r in rest)]) if rest else first.vectors
        return Served(vectors, first.sparsity, first.precision)

    async def _infer(self, rows: Sequence[Tokens], sparsity: float | None) -> Served:
        import tritonclient.grpc as grpcclient

        arrays = feeds(rows, self.input_names, self.pad_id)
        if sparsity is not None:
            arrays[SPARSITY_INPUT] = np.array([[sparsity]], dtype=np.float32)
        inputs = []
        for name, a in arrays.items():
            t = grpcclient.InferInput(name, list(a.shape), "FP32" if a.dtype == np.float32 else "INT64")
            t.set_data_from_numpy(a)
            inputs.append(t)
        outputs = [grpcclient.InferRequestedOutput(n) for n in (self.output, SERVED, PRECISION)]
        try:
            got = await self._grpc().infer(self.router, inputs, outputs=outputs, client_timeout=self.timeout_s)
        except Exception as e:
            raise _api_error(e) from None
        vectors = got.as_numpy(self.output)
        if self.output == "last_hidden_state":
            from elastic_export.models.text import mean_pool

            vectors = mean_pool(vectors, arrays["attention_mask"])
        served, precision = got.as_numpy(SERVED).reshape(-1), got.as_numpy(PRECISION).reshape(-1)
        p = precision[0].decode() if isinstance(precision[0], bytes) else str(precision[0])
        return Served(np.asarray(vectors, dtype=np.float32), float(served[0]), p)


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
