"""The typed manifest (issue 15 item 1): one ``Manifest.load`` that checks, one ``to_json`` that writes
the format as it was read (key order kept, unknown keys kept), typed entries for the dense model,
budgets, the elastic graph and engines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastic_export.core.errors import UserError
from elastic_export.core.manifest import MANIFEST, Budget, Dense, Elastic, Manifest, load_manifest, write_manifest

GOLDEN = Path(__file__).parent / "golden" / "minilm_magnitude.json"


def _minimal(**over) -> dict:
    m = {"format": "elastic-export/1", "model": {"source": "x"}, "inputs": [{"name": "input_ids"}],
         "outputs": [{"name": "y"}], "dense": {"onnx": "dense.onnx"},
         "budgets": [{"sparsity": 0.5, "onnx": "b.onnx"}], "ranking": {}}
    return {**m, **over}


def _write_raw(tmp_path: Path, manifest: dict) -> Path:
    (tmp_path / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return tmp_path


def test_the_main_jobs_manifest_round_trips_byte_for_byte(tmp_path):
    golden = json.loads(GOLDEN.read_text())["manifest"]
    golden["ranking"]["seconds"] = 0.4
    text = json.dumps(golden, indent=2) + "\n"
    (tmp_path / MANIFEST).write_text(text)
    m = Manifest.load(tmp_path)
    assert m.to_json() == text
    write_manifest(tmp_path, m)
    assert (tmp_path / MANIFEST).read_text() == text


def test_entries_are_typed(tmp_path):
    golden = json.loads(GOLDEN.read_text())["manifest"]
    m = Manifest.load(_write_raw(tmp_path, golden))
    assert isinstance(m.dense, Dense) and isinstance(m.elastic, Elastic)
    assert all(isinstance(b, Budget) for b in m.budgets)
    assert m.sparsities == [0.3, 0.6]
    assert m.budgets[0].file("fp32") == "budget_s030.onnx"
    assert m.budgets[0].file("int8-qdq") == "budget_s030.int8-qdq.onnx"
    assert m.budgets[1].precisions() == ["fp32", "fp16", "int8", "int8-qdq"]
    assert m.elastic_indices() == [(0.3, 0), (0.6, 1), (0.0, 2)]
    assert m.path(m.dense.onnx) == (tmp_path / "dense.onnx").resolve()
    assert m.model.source == "all-MiniLM-L6-v2" and m.inputs[0].name == "input_ids"


def test_an_old_directory_loads_and_writes_back_unchanged(tmp_path):
    """No tool, precisions, tokens, dense_index or twins: absent fields stay absent."""
    raw = _minimal(elastic={"onnx": "elastic.onnx"}, custom={"kept": [1, 2]})
    raw["budgets"][0]["note"] = "kept too"
    m = Manifest.load(_write_raw(tmp_path, raw))
    assert m.to_dict() == raw and list(m.to_dict()) == list(raw)
    assert m.extra == {"custom": {"kept": [1, 2]}} and m.budgets[0].extra == {"note": "kept too"}
    assert m.precisions is None and m.elastic.dense_index is None
    assert m.elastic_indices() == [(0.5, 0)]
    assert load_manifest(tmp_path) == raw


def test_fields_set_later_go_after_the_written_ones_as_in_a_dict(tmp_path):
    m = Manifest.load(_write_raw(tmp_path, _minimal()))
    m.budgets[0].engine = "b.plan"
    m.tensorrt = {"version": "10"}
    m.triton = {"dir": "triton"}
    d = m.to_dict()
    assert list(d)[-2:] == ["tensorrt", "triton"]
    assert list(d["budgets"][0]) == ["sparsity", "onnx", "engine"]


def test_a_new_manifest_leaves_out_optional_entries_until_set():
    m = Manifest(tool="t", budgets=[Budget(sparsity=0.5, onnx="b.onnx")])
    d = m.to_dict()
    assert "triton" not in d and "quick_eval" not in d and "tower" not in d["model"]
    assert "onnx_optimized" not in d["budgets"][0] and d["budgets"][0]["engine"] is None
    m.quick_eval = {"rows": []}
    assert list(m.to_dict())[-1] == "quick_eval"


def test_entries_are_typed_only(tmp_path):
    """Fields are attributes (no mapping access); a plain dict is not a manifest until converted."""
    m = Manifest.load(_write_raw(tmp_path, _minimal()))
    assert m.budgets[0].sparsity == 0.5 and m.elastic is None
    for entry in (m, m.dense, m.budgets[0]):
        assert not hasattr(entry, "get") and not hasattr(entry, "keys")
        with pytest.raises(TypeError):
            entry["onnx"]
    assert m != m.to_dict() and m == Manifest.from_dict(m.to_dict())
    assert write_manifest(tmp_path, m) and Manifest.load(tmp_path) == m
    with pytest.raises(TypeError):
        write_manifest(tmp_path, m.to_dict())


@pytest.mark.parametrize("broken, message", [
    ({"format": "other"}, "format is not"),
    ({"budgets": {}}, "'budgets' must be a list"),
    ({"budgets": [{"sparsity": 0.5, "onnx": "b.onnx"}, {"sparsity": 0.5, "onnx": "c.onnx"}]}, "listed twice"),
    ({"dense": {"onnx": "../x.onnx"}}, "leaves the artifact directory"),
    ({"elastic": []}, "'elastic' must be an object or null"),
])
def test_load_refuses_a_broken_manifest_in_one_line(tmp_path, broken, message):
    with pytest.raises(UserError, match=message) as e:
        Manifest.load(_write_raw(tmp_path, _minimal(**broken)))
    assert "\n" not in str(e.value)
