"""Models over protobuf's 2 GiB: every ONNX file keeps its weights in ``NAME.onnx.data``.

A real 4B / 8B model is too big for CI, so the tests run the very same code path on tiny models:
``--external-data`` forces it from the CLI, and lowering ``onnx_io.INLINE_LIMIT`` makes the
automatic size decision (and the in-memory checks that must not serialise a big model) take it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest
from conftest import save_tiny
from transformers import BertModel, Qwen3Model

from elastic_export.cli.main import main
from elastic_export.core import onnx_io
from elastic_export.core.manifest import MANIFEST


def _run(args: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(args)
    out, err = capsys.readouterr()
    return e.value.code, out, err


def _model_files(m: dict) -> list[str]:
    entries = [m["dense"], *m["budgets"], m["elastic"]]
    return [e[k] for e in entries for k in ("onnx", "onnx_fp16", "onnx_int8") if e.get(k)]


def _outputs(path: Path, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)


def _feeds(path: Path) -> dict:
    names = [i.name for i in onnx.load(str(path), load_external_data=False).graph.input]
    ids = np.array([[5, 17, 33, 2, 9, 0], [7, 3, 11, 4, 0, 0]], dtype=np.int64)
    mask = (ids > 0).astype(np.int64)
    pool = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids),
            "budget_index": np.array([1], dtype=np.int64)}
    return {n: pool[n] for n in names}


# int8 only for BERT: the random tiny Qwen3's int8 twin misses the 0.95 cosine bound on verify's
# random inputs whatever the file layout (an artefact of random weights, not of external data)
@pytest.mark.parametrize("model_class,precisions", [(BertModel, "fp32,fp16,int8"), (Qwen3Model, "fp32,fp16")],
                         ids=["bert", "qwen3"])
def test_forced_external_data_matches_inline_files(model_class, precisions, tmp_path, capsys, monkeypatch):
    """--external-data: every file (fp32, fp16, int8, elastic) has its .data twin, passes the checker
    by path, runs identically to the inline export of the same ranking, and verify / Triton take it."""
    monkeypatch.chdir(tmp_path)
    save_tiny(model_class, tmp_path / "model")
    common = ["--model", "model", "--budgets", "0.3,0.6", "--method", "magnitude", "--calib-size", "8",
              "--precision", precisions, "--no-report", "--no-quick-eval"]  # neither is read (a failed quick eval only warns)
    rc, _, err = _run(common + ["--out", "inline"], capsys)
    assert rc == 0, err[-2000:]
    rc, _, err = _run(common + ["--out", "ext", "--external-data", "--ranking", "inline/ranking.safetensors"], capsys)
    assert rc == 0, err[-2000:]
    m = json.loads((tmp_path / "ext" / MANIFEST).read_text())
    names = _model_files(m)
    n = precisions.count(",") + 1
    assert len(names) == 3 * n + 2  # dense and two budgets in each precision, the elastic graph in fp32 and fp16
    for name in names:
        ext, inline = tmp_path / "ext" / name, tmp_path / "inline" / name
        assert onnx_io.files(ext) == [ext, ext.with_name(name + ".data")], name
        big = {i.name for i in onnx.load(str(inline)).graph.initializer if len(i.raw_data) >= onnx_io.SIZE_THRESHOLD}
        moved = {i.name for i in onnx.load(str(ext), load_external_data=False).graph.initializer
                 if i.data_location == onnx.TensorProto.EXTERNAL}
        assert big and big == moved, name  # every weight of 1 KiB or more left the protobuf
        onnx.checker.check_model(str(ext), full_check=True)
        feeds = _feeds(inline)
        for a, b in zip(_outputs(inline, feeds), _outputs(ext, feeds)):
            np.testing.assert_array_equal(a, b, err_msg=name)
    rc, out, err = _run(["verify", "ext"], capsys)
    assert rc == 0, (out + err)[-2000:]

    rc, _, err = _run(["build", "--target", "triton", "ext"], capsys)
    assert rc == 0, err[-2000:]
    version = tmp_path / "ext" / "triton" / "elastic_s030" / "1"
    assert sorted(p.name for p in version.iterdir()) == ["budget_s030.onnx.data", "model.onnx"]
    feeds = _feeds(version / "model.onnx")
    np.testing.assert_array_equal(_outputs(version / "model.onnx", feeds)[0],
                                  _outputs(tmp_path / "inline" / "budget_s030.onnx", feeds)[0])


def test_models_over_the_limit_go_external_automatically(tmp_path, capsys, monkeypatch):
    """Without the flag, the size decides: with the limit lowered below a tiny model's weights the main
    job, its in-memory checks (which must not serialise the model) and verify all take the big path."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(onnx_io, "INLINE_LIMIT", 1)
    save_tiny(BertModel, tmp_path / "model")
    rc, _, err = _run(["--model", "model", "--budgets", "0.5", "--method", "magnitude", "--calib-size", "8",
                       "--precision", "fp32,fp16", "--no-report", "--no-quick-eval", "--out", "out"], capsys)
    assert rc == 0, err[-2000:]
    m = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert m["budgets"][0]["max_abs_error"] <= 1e-4 and m["elastic"]["max_abs_error"] <= 1e-4
    assert all(len(onnx_io.files(tmp_path / "out" / n)) == 2 for n in _model_files(m))
    rc, out, err = _run(["verify", "out"], capsys)
    assert rc == 0, (out + err)[-2000:]


def test_ort_optimize_with_external_data_is_refused_before_ranking(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    save_tiny(BertModel, tmp_path / "model")
    rc, out, err = _run(["--model", "model", "--budgets", "0.5", "--external-data", "--ort-optimize",
                         "--out", "out"], capsys)
    assert rc == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith("error:") and "external data" in last and "--ort-optimize" in last, err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_save_graph_streams_big_weights_to_the_data_file(tmp_path):
    """save_graph(external=True): tensors of 1 KiB or more go to NAME.onnx.data at aligned offsets,
    smaller ones stay inline, and the file loads back to the same values."""
    from elastic_export.core.onnx_io import model_skeleton
    from elastic_export.passes.serialize import save_graph

    x = gs.Variable("x", np.float32, (2, 64))
    big = gs.Constant("big", np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32))
    small = gs.Constant("small", np.arange(64, dtype=np.float32))
    t, y = gs.Variable("t", np.float32, None), gs.Variable("y", np.float32, (2, 64))
    g = gs.Graph(inputs=[x], outputs=[y], opset=17,
                 nodes=[gs.Node("MatMul", inputs=[x, big], outputs=[t]), gs.Node("Add", inputs=[t, small], outputs=[y])])
    path = tmp_path / "m.onnx"
    assert save_graph(g, model_skeleton(gs.export_onnx(g)), path, external=True)
    raw = onnx.load(str(path), load_external_data=False)
    where = {i.name: (i.data_location, {e.key: e.value for e in i.external_data}) for i in raw.graph.initializer}
    assert where["small"][0] == onnx.TensorProto.DEFAULT
    assert where["big"][0] == onnx.TensorProto.EXTERNAL and where["big"][1]["location"] == "m.onnx.data"
    assert int(where["big"][1]["offset"]) % 4096 == 0
    loaded = {i.name: onnx.numpy_helper.to_array(i) for i in onnx.load(str(path)).graph.initializer}
    np.testing.assert_array_equal(loaded["big"], big.values)
    np.testing.assert_array_equal(loaded["small"], small.values)
    feeds = {"x": np.ones((2, 64), np.float32)}
    np.testing.assert_allclose(_outputs(path, feeds)[0], feeds["x"] @ big.values + small.values, rtol=1e-5)
