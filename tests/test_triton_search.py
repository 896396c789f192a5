"""The search model of a Triton repository without a server: its checks and answers as plain Python
(:mod:`elastic_export.index.search`), and what ``build triton`` / ``serve`` write for a directory with an
index. A real server searches in ``test_triton_server.py``."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from _helpers import link_copy
from google.protobuf import text_format
from test_index import corpus_docs, write_jsonl
from tritonclient.grpc import model_config_pb2  # the test extra's: an import error fails, never skips

from elastic_export.core.manifest import load_manifest
from elastic_export.index import search as S
from elastic_export.targets import triton as TR
from elastic_export.targets import tritonserver as TS


def test_top_k_from_the_input_the_parameter_or_the_default():
    assert S.parse_top_k(None, None, 300) == 10 and S.parse_top_k(None, None, 4) == 4  # at most the documents
    assert S.parse_top_k([np.int32(25)], None, 300) == 25 and S.parse_top_k(None, json.dumps({"top_k": 3}), 300) == 3
    assert S.parse_top_k(None, json.dumps({"sparsity": 0.1}), 300) == 10 and S.parse_top_k([1000], None, 5000) == 1000
    for values, params, count, message in (([0], None, 300, "top_k 0 is outside [1, 300] (the index holds 300"),
                                           ([1001], None, 5000, "top_k 1001 is outside [1, 1000] (at most 1000)"),
                                           ([1, 2], None, 300, "top_k has 2 values; send one"),
                                           (None, '{"top_k": true}', 300, "must be an integer"),
                                           (None, '{"top_k": 2.5}', 300, "must be an integer"),
                                           (None, "[1]", 300, "not a JSON object")):
        with pytest.raises(S.SearchError, match=re.escape(message)):
            S.parse_top_k(values, params, count)


def test_texts_rows_and_failure_codes():
    assert S.decode_texts([b"caf\xc3\xa9", "x"]) == ["café", "x"]
    with pytest.raises(S.SearchError, match="text 1 is not valid UTF-8"):
        S.decode_texts([b"a", b"\xff"])
    with pytest.raises(S.SearchError, match="text 0 is empty"):
        S.decode_texts([b" "])
    S.check_rows(128, 128)
    for rows, message in ((0, "no queries"), (129, "129 queries, more than the 128")):
        with pytest.raises(S.SearchError, match=message):
            S.check_rows(rows, 128)
    assert S.failure_code("INVALID_ARG", "x") == "INVALID_ARG" and S.failure_code("UNAVAILABLE", "x") == "UNAVAILABLE"
    assert S.failure_code("INTERNAL", "overloaded: predicted 900 ms ...; retry later") == "UNAVAILABLE"
    assert S.failure_code(None, "Request for unknown model: 'elastic' is not found") == "UNAVAILABLE"
    assert S.failure_code("INTERNAL", "router: division by zero") == "INTERNAL"


def test_settings_round_trip_through_the_config_parameters():
    s = S.SearchSettings("elastic", "sentence_embedding", ("input_ids", "attention_mask"), 64, 2, 8, 30.0, (0.0, 0.5))
    config = {"parameters": {k: {"string_value": v} for k, v in s.parameters().items()}}
    assert S.SearchSettings.from_config(config) == s
    with pytest.raises(ValueError, match="no parameter 'router'"):
        S.SearchSettings.from_config({"parameters": {}})


class _Index:
    """A stand-in for DenseIndex: fixed positions (-1: a place HNSW left empty)."""

    count, ids, texts = 3, ["a", 7, "c"], ["doc a", "doc 7", "doc c"]

    def search(self, queries, k):
        return np.array([[0.9, 0.5, 0.1]])[:, :k], np.array([[1, 2, -1]])[:, :k]


def test_results_are_ids_as_bytes_scores_and_texts():
    settings = S.SearchSettings("elastic", "last_hidden_state", ("input_ids", "attention_mask"))
    searcher = S.Searcher(_Index(), None, settings)
    got = searcher.results(np.ones((1, 4), np.float32), 3, with_text=True)
    assert got["ids"].tolist() == [[b"7", b"c", b""]] and got["texts"].tolist() == [[b"doc 7", b"doc c", b""]]
    assert got["scores"].dtype == np.float32 and got["scores"].tolist()[0][:2] == pytest.approx([0.9, 0.5])
    assert got["scores"][0, 2] == -np.inf and "texts" not in searcher.results(np.ones((1, 4)), 2)
    hidden = np.arange(2 * 3 * 2, dtype=np.float32).reshape(2, 3, 2)  # mean-pooled under the mask
    mask = np.array([[1, 1, 0], [1, 0, 0]])
    pooled = searcher.embeddings({"last_hidden_state": hidden}, {"attention_mask": mask})
    np.testing.assert_allclose(pooled, [[1.0, 2.0], [6.0, 7.0]])


# --- the repository -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def indexed(minilm_small, tmp_path_factory) -> Path:
    """A copy of the small MiniLM export with an index of 40 documents."""
    from elastic_export.index.build import build_index

    root = tmp_path_factory.mktemp("triton_search")
    d = link_copy(minilm_small, root / "art", ignore=("triton", "index"))
    build_index(d, write_jsonl(root / "corpus.jsonl", corpus_docs(40)), progress=False)
    return d


def test_build_adds_the_search_model_with_the_index_files_linked(indexed):
    said: list[str] = []
    entry = TR.build_repository(indexed, platform="python", kind="cpu", echo=said.append).triton
    manifest = load_manifest(indexed)
    assert entry["search"] == {"name": "elastic_search", "count": 40, "index": manifest["index"]}
    assert "+ search 'elastic_search' (40 documents)" in said[-1]
    version = indexed / "triton" / "elastic_search" / "1"
    for name in ("index.faiss", "ids.json", "docs.jsonl"):
        assert os.path.samefile(version / "index" / name, indexed / "index" / name)  # hard links
    assert json.loads((version / "index" / "entry.json").read_text()) == manifest["index"]
    assert (version / "tokenizer" / "tokenizer.json").is_file()
    assert (version / "model.py").read_text() == TR._package_source(TR.SEARCH_FILE)
    config = text_format.Parse((indexed / "triton" / "elastic_search" / "config.pbtxt").read_text(),
                               model_config_pb2.ModelConfig())
    assert [i.name for i in config.input] == ["text", "top_k", "sparsity"] and config.max_batch_size == 0
    assert [o.name for o in config.output] == ["ids", "scores", "served_sparsity", "texts"]
    settings = S.SearchSettings.from_config({"parameters": {k: {"string_value": v.string_value}
                                                            for k, v in config.parameters.items()}})
    assert (settings.router, settings.output, settings.sparsities) == ("elastic", "sentence_embedding", (0.0, 0.1, 0.5))
    searcher = S.Searcher.from_folder(version, settings)  # what the model's initialize opens
    assert searcher.count == 40 and searcher.feeds(["a query"])["input_ids"].shape[0] == 1


def _rewrite(path: Path, obj: dict) -> None:
    """Replace a hard-linked file (never write into it: the fixture's copy shares it)."""
    path.unlink()
    path.write_text(json.dumps(obj))


def test_serve_rebuilds_when_the_index_changes_and_skips_a_broken_one(indexed, tmp_path):
    """A repository built before the index (or with another one) is rebuilt by serve; an index whose files
    are gone is one line, and the rest is served without search."""
    d = link_copy(indexed, tmp_path / "art", ignore=("triton",))
    manifest = json.loads((d / "manifest.json").read_text())
    index = manifest.pop("index")
    _rewrite(d / "manifest.json", manifest)
    said: list[str] = []
    assert TS.ensure_repository(d, "python", None, None, said.append)["search"] is None
    manifest = json.loads((d / "manifest.json").read_text())  # with the repository built without search
    manifest["index"] = index
    _rewrite(d / "manifest.json", manifest)
    said.clear()
    assert TS.ensure_repository(d, "python", None, None, said.append)["search"]["count"] == 40
    assert not any(x.startswith("serving the existing") for x in said)
    said.clear()
    TS.ensure_repository(d, "python", None, None, said.append)
    assert said == [f"serving the existing {d / 'triton'}"]
    (d / "index" / "ids.json").unlink()
    said.clear()
    entry = TR.build_repository(d, platform="python", kind="cpu", echo=said.append).triton
    assert entry["search"] is None and not (d / "triton" / "elastic_search").exists()
    assert any(x.startswith("no search model: index:") and "ids.json is missing" in x for x in said), said


def test_fit_pairs_cut_at_a_word_within_the_tokens(minilm_small):
    """What the live test and benchmarks/elastic_search.py index: each side at most N tokens, cut at a word,
    unchanged when it fits; a pair that repeats an earlier one once cut is dropped."""
    from elastic_export.data.retrieval_data import cut_to_tokens, fit_pairs
    from elastic_export.models.text import TextEncoder

    tok = TextEncoder.from_dir(minilm_small / "tokenizer", ["input_ids"]).tokenizer
    long = "the quick brown fox jumps over the lazy dog " * 10
    cut = cut_to_tokens(tok, long, 16)
    assert long.startswith(cut) and long[len(cut)] == " " and sum(tok.encode(cut).attention_mask) <= 16
    assert sum(tok.encode(long[:len(cut) + 6]).attention_mask) > 16 and cut_to_tokens(tok, "a short one", 16) == "a short one"
    pairs = [{"query": "open a file", "doc": long}, {"query": "open a file", "doc": "other"}, {"query": "q", "doc": long}]
    assert fit_pairs(pairs, tok, 16) == [{"query": "open a file", "doc": cut}]
