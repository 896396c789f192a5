"""Queries and documents without a server: how a request's input type and budget are read
(``openai_schema.resolve_request``) and how the indexing lane batches documents
(``router_client.document_batches``)."""

from __future__ import annotations

import pytest

from elastic_export.serving import openai_schema as oa
from elastic_export.serving.router_client import document_batches, padding_waste

NAME = "elastic"


@pytest.mark.parametrize("model, sparsity, input_type, expected", [
    (NAME, None, None, oa.Asked("document", None)),  # no type, no budget: a document (dense)
    (NAME, None, "query", oa.Asked("query", None)),  # the router's pick
    (NAME, 0.4, None, oa.Asked("query", 0.4)),  # a named budget: a query
    (f"{NAME}@0.4", None, None, oa.Asked("query", 0.4)),
    (f"{NAME}:query", None, None, oa.Asked("query", None)),
    (f"{NAME}:document", None, None, oa.Asked("document", None)),
    (f"{NAME}:document", 0.0, None, oa.Asked("document", 0.0)),  # dense named: still a document
    (f"{NAME}@0.5:query", None, "search_query", oa.Asked("query", 0.5)),
    (NAME, None, "search_document", oa.Asked("document", None)),  # Cohere's spelling
    (NAME, None, "retrieval.passage", oa.Asked("document", None)),  # Jina's
    (NAME, None, "retrieval.query", oa.Asked("query", None)),
    (NAME, None, "clustering", oa.Asked("document", None)),
])
def test_input_type_and_budget(model, sparsity, input_type, expected):
    assert oa.resolve_request(model, NAME, sparsity, input_type) == expected


def test_search_defaults_to_a_query():
    assert oa.resolve_request(NAME, NAME, None, None, oa.QUERY) == oa.Asked("query", None)


@pytest.mark.parametrize("model, sparsity, input_type, status, code", [
    (NAME, 0.4, "document", 400, "sparse_document"),  # documents are dense
    (f"{NAME}@0.4", None, "document", 400, "sparse_document"),
    (f"{NAME}:document", 0.3, None, 400, "sparse_document"),
    (f"{NAME}:query", None, "document", 400, "conflicting_input_type"),
    (NAME, None, "passage-ish", 400, "invalid_input_type"),
    (NAME, None, 3, 400, "invalid_input_type"),
    (f"{NAME}:passage", None, None, 404, "model_not_found"),
    ("other:query", None, None, 404, "model_not_found"),
    (NAME, 1.5, None, 400, "invalid_sparsity"),
])
def test_bad_input_types_are_one_line_4xx(model, sparsity, input_type, status, code):
    with pytest.raises(oa.ApiError) as e:
        oa.resolve_request(model, NAME, sparsity, input_type)
    assert (e.value.status, e.value.code) == (status, code) and "\n" not in e.value.message


def test_document_batches_sort_by_length_and_bound_tokens():
    lengths = [5, 300, 12, 7, 250, 30, 6, 128]
    batches = document_batches(lengths, max_rows=3, max_tokens=600)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))  # every row once
    for b in batches:
        assert len(b) <= 3 and len(b) * max(lengths[i] for i in b) <= 600
        assert [lengths[i] for i in b] == sorted((lengths[i] for i in b), reverse=True)
    assert batches == [[1, 4], [7, 5, 2], [3, 6, 0]]
    assert padding_waste(lengths, batches) == pytest.approx(1 - sum(lengths) / (2 * 300 + 3 * 128 + 3 * 7))
    assert padding_waste(lengths, [[i] for i in range(len(lengths))]) == 0.0


def test_document_batches_take_an_overlong_row_alone():
    assert document_batches([5000, 3, 3], max_rows=8, max_tokens=4096) == [[0], [1, 2]]


def test_documents_of_a_client_that_has_gone_are_not_run():
    """The indexing lane checks before each batch whether the client is still there: gone, nothing is
    sent (no gRPC client is even made) and the request ends as a 499."""
    import asyncio

    from elastic_export.serving.openai_schema import Tokens
    from elastic_export.serving.router_client import RouterClient, RouterInfo

    client = RouterClient("127.0.0.1:1", "elastic", ["input_ids", "attention_mask"], "sentence_embedding", 0,
                          index_model="elastic_index")
    client._info = RouterInfo(8, [0.0, 0.5])
    asked = []

    async def gone() -> bool:
        asked.append(True)
        return True

    with pytest.raises(oa.ApiError) as e:
        asyncio.run(client.embed_documents([Tokens([1, 2, 3], [0, 0, 0])] * 20, gone))
    assert e.value.status == 499 and e.value.code == "client_closed" and asked and client._client is None


def test_a_few_short_documents_go_beside_the_queries_the_rest_to_the_lane():
    """At most 4 documents and 1,024 padded tokens (someone waits for them) go to the router at sparsity 0, as
    their own request (not merged with the queries, whose one request in flight they would wait for); more,
    or longer, go to the indexing lane; so do a few the router answers sparser (dense model down)."""
    import asyncio

    import numpy as np

    from elastic_export.serving.openai_schema import Tokens
    from elastic_export.serving.router_client import RouterClient, RouterInfo, Served

    class Recorded(RouterClient):  # the two ways out, recorded instead of sent
        async def embed(self, rows, sparsity):
            raise AssertionError("documents never go through the query batcher")

        async def _infer(self, rows, sparsity, model=None, queued_ms=0.0):
            if model is None:  # the router
                assert sparsity == 0.0
                self.calls.append(("router", len(rows), sparsity))
                return Served(np.zeros((len(rows), 2)), self.router_serves, "fp32")
            self.calls.append(("lane", len(rows), model))
            return Served(np.ones((len(rows), 2)), 0.0, "fp32")

    def ways(n: int, tokens: int, router_serves: float = 0.0) -> list:
        client = Recorded("127.0.0.1:1", "elastic", ["input_ids"], "sentence_embedding", 0, index_model="elastic_index")
        client._info, client.calls, client.router_serves = RouterInfo(8, [0.0, 0.5]), [], router_serves
        served = asyncio.run(client.embed_documents([Tokens([1] * tokens, [0] * tokens)] * n))
        assert served.sparsity == 0.0 and len(served.vectors) == n
        return [c[0] for c in client.calls]

    assert ways(1, 30) == ["router"] and ways(4, 256) == ["router"]
    assert set(ways(5, 30)) == {"lane"} and set(ways(2, 600)) == {"lane"}
    assert ways(1, 30, router_serves=0.5) == ["router", "lane"]
