"""Triton model repository (``elastic_export.targets.triton``) and ``elastic-export build --target triton``.

Runs everywhere: the repository built for real all-MiniLM-L6-v2 artifacts with every
``config.pbtxt`` parsed by Triton's own ``ModelConfig`` protobuf schema (``tritonclient``), the
served files against the directory's ONNX, the manifest entry, re-runs, the CLI's errors, and the
router's ``model.py`` as written, run on its ``config.pbtxt`` with a stand-in for Triton's server
API (the router itself: ``test_triton_router.py``). A real Triton server serves it in
``test_triton_server.py``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from _helpers import link_copy  # noqa: E402
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2  # the test extra's: an import error fails, never skips

from elastic_export.core.errors import UserError
from elastic_export.core.manifest import FORMAT, load_manifest
from elastic_export.targets import triton as TR

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
BUDGETS = (0.1, 0.5)


def _parse(path: Path):
    """A config.pbtxt parsed with Triton's ModelConfig schema (raises on any unknown field / bad value)."""
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "elastic_export", *args], capture_output=True, text=True,
                          env=ENV, timeout=300)


def _tree(d: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(d.rglob("*"))}


# --- config text ----------------------------------------------------------------------------------
def test_dims_and_types():
    assert TR.triton_dims(["batch", "sequence"], "x") == [-1]
    assert TR.triton_dims(["batch", "sequence", 384], "x") == [-1, 384]
    assert TR.triton_dims(["batch", 3, "height", "width"], "x") == [3, -1, -1]
    assert TR.triton_dims(["batch", 3, 224, 224], "x") == [3, 224, 224]
    with pytest.raises(UserError, match="no symbolic batch dim"):
        TR.triton_dims([1, 3, 224, 224], "input 'pixel_values'")
    assert [TR.triton_type(t, "x") for t in ("float32", "int64", "float16")] == ["TYPE_FP32", "TYPE_INT64",
                                                                                 "TYPE_FP16"]
    with pytest.raises(UserError, match="no Triton type"):
        TR.triton_type("complex64", "x")


# --- the real MiniLM ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def art(minilm_small, tmp_path_factory) -> Path:
    """A hard-linked copy of the session's small MiniLM export (this module adds a triton/ to it)."""
    return link_copy(minilm_small, tmp_path_factory.mktemp("triton") / "out")


@pytest.fixture(scope="module")
def repo(art) -> Path:
    r = _cli("build", "--target", "triton", str(art), "--triton-default-sparsity", "0.1",
             "--triton-instances", "2", "--triton-kind", "cpu", "--max-batch", "16")
    assert r.returncode == 0, r.stderr
    assert "triton/elastic_s010 (onnxruntime_onnx, sparsity 0.1)" in r.stdout
    assert "triton/elastic (router, python backend, default sparsity 0.1)" in r.stdout
    return art / "triton"


def test_repository_layout_and_configs_parse(art, repo):
    names = ["elastic", "elastic_index", "elastic_s000", "elastic_s010", "elastic_s050"]
    assert sorted(p.name for p in repo.iterdir()) == names
    m = load_manifest(art)
    for name in names[1:]:
        cfg = _parse(repo / name / "config.pbtxt")  # every config, Triton's own schema
        assert cfg.name == name and cfg.max_batch_size == 16
        assert cfg.dynamic_batching.max_queue_delay_microseconds == TR.DEFAULT_QUEUE_DELAY_US
        assert [g.kind for g in cfg.instance_group] == [model_config_pb2.ModelInstanceGroup.KIND_CPU]
        assert [g.count for g in cfg.instance_group] == [1 if name == "elastic_index" else 2]  # the lane: one
        ins = {t.name: t for t in cfg.input}
        outs = {t.name: t for t in cfg.output}
        for spec in m["inputs"]:
            assert ins[spec["name"]].data_type == model_config_pb2.TYPE_INT64 and list(ins[spec["name"]].dims) == [-1]
        assert list(outs["last_hidden_state"].dims) == [-1, 384] and list(outs["sentence_embedding"].dims) == [384]
        assert outs["sentence_embedding"].data_type == model_config_pb2.TYPE_FP32
    router = _parse(repo / "elastic" / "config.pbtxt")
    assert router.backend == "python" and router.platform == ""
    assert router.max_batch_size == 0 and not router.HasField("dynamic_batching")  # it forwards; budget models batch
    assert [(g.kind, g.count) for g in router.instance_group] == [(model_config_pb2.ModelInstanceGroup.KIND_CPU, 1)]
    ins = {t.name: t for t in router.input}
    assert list(ins["input_ids"].dims) == [-1, -1] and ins["input_ids"].optional  # optional: text may replace them
    sp = ins["sparsity"]
    assert sp.optional and sp.data_type == model_config_pb2.TYPE_FP32 and list(sp.dims) == [-1, 1]
    assert ins["text"].data_type == model_config_pb2.TYPE_STRING and list(ins["text"].dims) == [-1]
    outs = {t.name: t for t in router.output}
    assert list(outs["sentence_embedding"].dims) == [-1, 384]
    assert outs["served_sparsity"].data_type == model_config_pb2.TYPE_FP64 and list(outs["served_sparsity"].dims) == [-1, 1]
    assert outs["served_precision"].data_type == model_config_pb2.TYPE_STRING
    table = json.loads(router.parameters["budget_models"].string_value)
    assert table == [[0.0, "elastic_s000"], [0.1, "elastic_s010"], [0.5, "elastic_s050"]]
    assert float(router.parameters["default_sparsity"].string_value) == 0.1
    assert router.parameters["policy"].string_value == "fixed"  # a default sparsity was given
    assert (repo / "elastic" / "1" / "model.py").read_text() == TR.router_source()
    assert (repo / "elastic" / "1" / "tokenizer" / "tokenizer.json").is_file()  # for the text input
    for name in names[1:]:
        cfg = _parse(repo / name / "config.pbtxt")
        assert cfg.platform == "onnxruntime_onnx" and cfg.backend == ""
        if name in ("elastic_index", "elastic_s000"):  # the lane is the dense model
            assert cfg.parameters["sparsity"].string_value == "0.0"
        assert sorted(p.name for p in (repo / name).rglob("*")) == ["1", "config.pbtxt", "model.onnx"]


def test_python_budget_backend_runs_the_onnx_in_the_python_backend(art, repo, tmp_path):
    """--budget-backend python: each budget a Python-backend model (onnxruntime on its model.onnx),
    same inputs, outputs, dims and batching as the onnxruntime flavor; the router is the same file."""
    import shutil as sh

    d = tmp_path / "py"
    sh.copytree(art, d, copy_function=os.link, ignore=sh.ignore_patterns("triton"))
    r = _cli("build", "triton", str(d), "--budget-backend", "python", "--max-batch", "16", "--ort-threads", "1")
    assert r.returncode == 0, r.stderr
    assert "triton/elastic_s050 (python, sparsity 0.5)" in r.stdout and "load-adaptive" in r.stdout
    onnx_flavor = _parse(repo / "elastic_s050" / "config.pbtxt")
    cfg = _parse(d / "triton" / "elastic_s050" / "config.pbtxt")
    assert cfg.backend == "python" and cfg.platform == "" and cfg.max_batch_size == 16
    assert [(t.name, t.data_type, list(t.dims)) for t in cfg.input] == [
        (t.name, t.data_type, list(t.dims)) for t in onnx_flavor.input]
    assert [(t.name, t.data_type, list(t.dims)) for t in cfg.output] == [
        (t.name, t.data_type, list(t.dims)) for t in onnx_flavor.output]
    assert cfg.HasField("dynamic_batching") and cfg.parameters["intra_op_threads"].string_value == "1"
    assert cfg.parameters["allow_spinning"].string_value == "0"  # see test_python_budget_model_session_options
    assert cfg.parameters["nice"].string_value == str(TR.BUDGET_NICE)  # its compute yields to the request path
    lane = _parse(d / "triton" / "elastic_index" / "config.pbtxt")  # documents: dense, the lowest priority
    assert lane.backend == "python" and lane.parameters["nice"].string_value == str(TR.INDEX_NICE) == "19"
    assert [g.count for g in lane.instance_group] == [1] and lane.max_batch_size == 16
    lane_file, dense_file = (d / "triton" / n / "1" / "model.onnx" for n in ("elastic_index", "elastic_s000"))
    assert os.path.samefile(lane_file, dense_file)
    assert not cfg.dynamic_batching.HasField("default_queue_policy")  # Triton 2.51's python backend: see queue_policy
    policy = onnx_flavor.dynamic_batching.default_queue_policy  # other backends: bounded, late work rejected
    assert policy.max_queue_size == TR.QUEUE_BATCHES * 16 and policy.timeout_action == policy.REJECT
    files = sorted(p.name for p in (d / "triton" / "elastic_s050" / "1").iterdir())
    assert files == ["length_groups.py", "model.onnx", "model.py"]
    assert (d / "triton" / "elastic_s050" / "1" / "length_groups.py").read_text() == TR.serving_sources(
        ["length_groups"])["length_groups.py"]  # the package's own file, verbatim
    assert (d / "triton" / "elastic_s050" / "1" / "model.py").read_text() == TR._package_source(TR.ORT_MODEL_FILE)
    assert (d / "triton" / "elastic" / "1" / "model.py").read_text() == TR.router_source()
    t = load_manifest(d)["triton"]
    assert {x["platform"] for x in t["models"]} == {"python"} and t["policy"] == "adaptive"
    routing = {k: v.string_value for k, v in _parse(d / "triton" / "elastic" / "config.pbtxt").parameters.items()}
    assert routing["inline"] == "1" and routing["intra_op_threads"] == "1"  # idle requests run in the router
    assert routing["warmup_tokens"] == str(load_manifest(d)["tokens"]) and routing["allow_spinning"] == "0"
    assert "inline" not in _parse(repo / "elastic" / "config.pbtxt").parameters  # onnxruntime models: BLS only


def test_an_inline_run_of_pooled_rows_goes_in_groups_of_similar_length(art, tmp_path, routers, monkeypatch):
    """Merged queries of 5-30 tokens pad to the longest: the router's inline run cuts them into groups of
    similar length, each trimmed to its longest row (fewer padded tokens), and answers what the whole padded
    batch does; a request that asks for the token axis too runs whole. A budget model's ``model.py`` (a
    forwarded batch) groups the same way."""
    import shutil as sh

    from _triton_fake import Request, execute

    from elastic_export.serving.length_groups import length_groups

    d = tmp_path / "py"
    sh.copytree(art, d, copy_function=os.link, ignore=sh.ignore_patterns("triton"))
    r = _cli("build", "triton", str(d), "--budget-backend", "python", "--max-batch", "32", "--ort-threads", "1")
    assert r.returncode == 0, r.stderr
    model, server = routers(d / "triton", "elastic")
    assert model.config.row_outputs == {"sentence_embedding"}
    session, widths = model.sessions[0.5], []

    class Seen:  # the real session, its feeds' shapes noted
        def run(self, names, feeds):
            widths.append(feeds["input_ids"].shape)
            return session.run(names, feeds)

    model.sessions[0.5] = Seen()
    monkeypatch.setattr(model.routing.policy.rate, "rate", lambda now=None: 0.0)  # idle: 20 rows run inline
    rng = np.random.default_rng(0)
    lengths = rng.permutation([6] * 10 + [30] * 10)
    ids = rng.integers(1000, 20000, (20, 30)).astype(np.int64)
    mask = (np.arange(30)[None, :] < lengths[:, None]).astype(np.int64)
    feeds = {"input_ids": ids * mask, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
    (pooled,) = execute(model, [Request(feeds, {"sparsity": 0.5}, ("sentence_embedding", "served_sparsity"))])
    assert server.calls == [] and len(length_groups(lengths.tolist())) == 2
    assert sorted(widths) == [(10, 6), (10, 30)]
    want = session.run(["sentence_embedding"], feeds)[0]
    np.testing.assert_allclose(pooled.as_dict()["sentence_embedding"], want, rtol=0, atol=1e-5)
    widths.clear()
    (tokens,) = execute(model, [Request(feeds, {"sparsity": 0.5}, ("sentence_embedding", "last_hidden_state"))])
    assert widths == [(20, 30)] and not tokens.has_error()

    # the budget model's own model.py (a forwarded batch) does the same
    from _triton_fake import fake_pb_utils, load_router, model_config_json

    version = d / "triton" / "elastic_s050" / "1"
    budget = load_router(version / "model.py", fake_pb_utils(server), monkeypatch).TritonPythonModel()
    budget.initialize({"model_config": model_config_json(version.parent / "config.pbtxt"),
                       "model_repository": str(version.parent), "model_version": "1"})
    session, widths[:] = budget.session, []
    budget.session = Seen()
    (pooled,) = budget.execute([Request(feeds, None, ("sentence_embedding",))])
    assert sorted(widths) == [(10, 6), (10, 30)]
    np.testing.assert_allclose(pooled.as_dict()["sentence_embedding"], want, rtol=0, atol=1e-5)


def test_large_python_budget_models_are_not_held_twice(art, tmp_path, monkeypatch):
    """Above INLINE_MAX_BYTES the router holds no second copy of the budgets: it forwards every request."""
    import shutil as sh

    d = tmp_path / "py"
    sh.copytree(art, d, copy_function=os.link, ignore=sh.ignore_patterns("triton"))
    monkeypatch.setattr(TR, "INLINE_MAX_BYTES", 1 << 20)
    said: list[str] = []
    TR.build_repository(d, platform="python", echo=said.append)
    assert "inline" not in _parse(d / "triton" / "elastic" / "config.pbtxt").parameters
    assert any("the router forwards every request" in line for line in said), said


def test_python_budget_model_session_options():
    """The config's parameters reach the budget model's onnxruntime session: threads, and spinning off
    (the budget models of one server share its cores)."""
    from elastic_export.targets import triton_onnx_model as M

    quiet = M.session_options({M.THREADS_PARAMETER: "1", M.SPIN_PARAMETER: "0"})
    assert quiet.intra_op_num_threads == 1
    assert quiet.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert quiet.get_session_config_entry("session.inter_op.allow_spinning") == "0"
    default = M.session_options({})
    assert default.intra_op_num_threads == 0
    with pytest.raises(Exception):  # onnxruntime's own default: the entry is not set
        default.get_session_config_entry("session.intra_op.allow_spinning")


def test_service_times_measure_the_budgets_in_turn(art):
    """The router's start-up measurement of its budgets: round by round, every budget at batch 1 and 8 in
    turn (what else runs meanwhile falls on all of them alike), the least of the rounds per budget and batch."""
    import onnxruntime as ort

    from elastic_export.targets import triton_onnx_model as M

    order: list = []

    class Logged:
        """A real session whose runs are logged as (budget, rows)."""

        def __init__(self, key, path):
            self.key, self.session = key, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

        def get_inputs(self):
            return self.session.get_inputs()

        def run(self, names, feeds):
            order.append((self.key, len(next(iter(feeds.values())))))
            return self.session.run(names, feeds)

    m = load_manifest(art)
    sessions = {0.0: Logged(0.0, art / m["dense"]["onnx"]), 0.5: Logged(0.5, art / m["budgets"][-1]["onnx"])}
    times = M.service_times(sessions, 16, repeats=3)
    assert set(times) == {0.0, 0.5} and all(set(v) == {1, 8} and min(v.values()) > 0 for v in times.values())
    turn = [(0.0, 1), (0.0, 8), (0.5, 1), (0.5, 8)]
    assert order == turn * 4  # a warm-up run each, then three rounds in turn


def test_router_model_routes_on_the_built_repository(art, repo, monkeypatch, routers):
    """The router's model.py as written, initialised from its config.pbtxt's JSON, forwarding to the real budget ONNX."""
    from _triton_fake import Request, execute

    from elastic_export.targets.onnxruntime import make_session

    model, server = routers(repo, "elastic")
    assert model.config.models == {0.0: "elastic_s000", 0.1: "elastic_s010", 0.5: "elastic_s050"}
    assert model.config.default == 0.1 and "sparsity" not in model.config.inputs
    ids = np.random.default_rng(0).integers(1000, 20000, (2, 12)).astype(np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
    out = execute(model, [Request(feeds, {"sparsity": 0.3}), Request(feeds)])
    m = load_manifest(art)
    for response, served, onnx_file in zip(out, (0.5, 0.1), (m["budgets"][1]["onnx"], m["budgets"][0]["onnx"])):
        got = response.as_dict()
        assert got["served_sparsity"].tolist() == [[served]] * 2
        want = make_session(art / onnx_file).run(["sentence_embedding"], feeds)[0]
        np.testing.assert_array_equal(got["sentence_embedding"], want)


def test_served_files_are_the_budget_onnx(art, repo):
    import onnxruntime as ort

    m = load_manifest(art)
    sources = {"elastic_s000": m["dense"]["onnx"], "elastic_s010": m["budgets"][0]["onnx"],
               "elastic_s050": m["budgets"][1]["onnx"], "elastic_index": m["dense"]["onnx"]}
    for name, src in sources.items():
        served, orig = repo / name / "1" / "model.onnx", art / src
        assert os.path.samefile(served, orig)  # a hard link: same filesystem, no copy
        cfg = _parse(repo / name / "config.pbtxt")
        sess = ort.InferenceSession(str(served), providers=["CPUExecutionProvider"])
        assert [i.name for i in sess.get_inputs()] == [t.name for t in cfg.input]
        assert [o.name for o in sess.get_outputs()] == [t.name for t in cfg.output]


def test_manifest_records_the_repository(art, repo):
    t = load_manifest(art)["triton"]
    assert t["dir"] == "triton" and t["router"] == "elastic" and t["default_sparsity"] == 0.1
    assert [(x["name"], x["sparsity"], x["platform"]) for x in t["models"]] == [
        ("elastic_s000", 0.0, "onnxruntime_onnx"), ("elastic_s010", 0.1, "onnxruntime_onnx"),
        ("elastic_s050", 0.5, "onnxruntime_onnx")]
    assert all((art / x["file"]).is_file() for x in t["models"])
    assert t["index"] == {"name": "elastic_index", "sparsity": 0.0, "platform": "onnxruntime_onnx",
                          "source": load_manifest(art)["dense"]["onnx"],
                          "file": "triton/elastic_index/1/model.onnx", "nice": None}  # niceness: python models only
    assert t["max_batch_size"] == 16 and t["instances"] == 2 and t["instance_kind"] == "cpu"


def test_rerun_replaces_the_repository(art, repo, tmp_path):
    import shutil as sh

    d = tmp_path / "copy"
    sh.copytree(art, d, copy_function=os.link)  # cheap: hard links
    (d / "triton" / "stale_model").mkdir()
    TR.build_repository(d, name="minilm", dense=False, kind="auto")
    assert sorted(p.name for p in (d / "triton").iterdir()) == ["minilm", "minilm_s010", "minilm_s050"]  # no dense: no lane
    assert load_manifest(d)["triton"]["index"] is None
    assert not [p.name for p in d.iterdir() if p.name.startswith(".triton")]  # no temporary left behind
    cfg = _parse(d / "triton" / "minilm_s050" / "config.pbtxt")
    assert cfg.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_AUTO
    assert cfg.max_batch_size == TR.DEFAULT_MAX_BATCH
    t = load_manifest(d)["triton"]
    assert t["router"] == "minilm" and t["default_sparsity"] == 0.1  # the densest served by default


def test_cli_bad_input_exits_2_and_changes_nothing(art, repo, tmp_path):
    before = _tree(art)
    for args, needle in [
        ((str(tmp_path),), "no manifest.json"),
        ((str(art), "--triton-default-sparsity", "0.7"), "above the sparsest served budget 0.5"),
    ]:
        r = _cli("build", "--target", "triton", *args)
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (args, r.stderr)
        assert needle in lines[0] and "Traceback" not in r.stderr, (args, lines[0])
    assert _tree(art) == before


@pytest.mark.parametrize("where,kw,needle", [
    ("missing", {}, "no such directory"),
    ("art", {"platform": "tensorrt"}, "has no engine"),
    ("art", {"instances": 0}, "--triton-instances must be a positive integer"),
    ("art", {"max_batch": 0}, "--max-batch must be a positive integer"),
    ("art", {"queue_delay_us": -1}, "--triton-queue-delay-us"),
    ("art", {"kind": "tpu"}, "--triton-kind tpu"),
    ("art", {"name": "../x"}, "--triton-name"),
    ("art", {"precision": "fp16"}, "fp16 ONNX"),
    ("art", {"default_sparsity": 1.5}, "outside [0, 1)"),
    ("art", {"platform": "triton"}, "--budget-backend triton"),
    ("art", {"policy": "random"}, "--policy random"),
    ("art", {"slo_ms": 0.0}, "--slo-ms must be a positive number"),
    ("art", {"ort_threads": -1}, "--ort-threads must be a non-negative integer"),
])
def test_bad_input_refused_and_changes_nothing(art, repo, tmp_path, where, kw, needle):
    before = _tree(art)
    with pytest.raises(UserError, match=re.escape(needle)):
        TR.build_repository(art if where == "art" else tmp_path / where, **kw)
    assert _tree(art) == before


def test_truncated_onnx_is_refused_before_building(art, tmp_path):

    d = tmp_path / "art"
    shutil.copytree(art, d, ignore=shutil.ignore_patterns("triton"))
    rel = json.loads((d / "manifest.json").read_text())["budgets"][-1]["onnx"]
    raw = (d / rel).read_bytes()
    (d / rel).write_bytes(raw[: len(raw) // 2])
    before = _tree(d)
    with pytest.raises(UserError, match=re.escape(rel) + ".*not a valid ONNX model"):
        TR.build_repository(d)
    assert _tree(d) == before and not (d / "triton").exists()


def test_foreign_triton_dir_refused(tmp_path):
    d = _fake_dir(tmp_path / "a")
    (d / "triton" / "mine").mkdir(parents=True)
    with pytest.raises(UserError, match="not written by elastic-export"):
        TR.build_repository(d)
    assert sorted(p.name for p in (d / "triton").iterdir()) == ["mine"]


# --- stand-in directories: engines, fp16 ----------------------------------------------------------
def _manifest() -> dict:
    return {
        "format": FORMAT, "model": {"source": "x", "architecture": "bert", "fingerprint": "f"},
        "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"]},
                   {"name": "attention_mask", "dtype": "int64", "shape": ["batch", "sequence"]}],
        "outputs": [{"name": "last_hidden_state", "dtype": "float32", "shape": ["batch", "sequence", 8]}],
        "tokens": 16, "precisions": ["fp32"],
        "dense": {"onnx": "dense.onnx", "onnx_fp16": None, "engine": None},
        "budgets": [{"sparsity": 0.25, "onnx": "budget_s025.onnx", "onnx_fp16": None, "engine": None},
                    {"sparsity": 0.5, "onnx": "budget_s050.onnx", "onnx_fp16": None, "engine": None}],
        "elastic": None, "ranking": {"file": "ranking.safetensors", "method": "random"},
    }


def _tiny_onnx(path: Path, out_type: int) -> None:
    """A real (trivial) ONNX file with the manifest's interface: cast input_ids, add a unit dim, expand."""
    from onnx import TensorProto, helper

    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])
    mask = helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "sequence"])
    out = helper.make_tensor_value_info("last_hidden_state", out_type, ["batch", "sequence", 8])
    nodes = [helper.make_node("Add", ["input_ids", "attention_mask"], ["s"]),
             helper.make_node("Cast", ["s"], ["c"], to=out_type),
             helper.make_node("Unsqueeze", ["c", "axes"], ["u"]),
             helper.make_node("Expand", ["u", "shape"], ["last_hidden_state"])]
    inits = [helper.make_tensor("axes", TensorProto.INT64, [1], [2]),
             helper.make_tensor("shape", TensorProto.INT64, [3], [1, 1, 8])]
    g = helper.make_graph(nodes, "tiny", [ids, mask], [out], initializer=inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))


def _fake_dir(root: Path, engines: bool = False, fp16: bool = False) -> Path:
    m = _manifest()
    root.mkdir(parents=True, exist_ok=True)
    for entry in [m["dense"], *m["budgets"]]:
        _tiny_onnx(root / entry["onnx"], onnx.TensorProto.FLOAT)
        if fp16:
            entry["onnx_fp16"] = entry["onnx"][:-5] + ".fp16.onnx"
            _tiny_onnx(root / entry["onnx_fp16"], onnx.TensorProto.FLOAT16)
        if engines:
            entry["engine"] = entry["onnx"][:-5] + ".engine"
            (root / entry["engine"]).write_bytes(b"a stand-in engine")
    if engines:
        m["tensorrt"] = {"profiles": [{n: {"min": [1, 1], "opt": [8, 16], "max": [32, 16]}
                                       for n in ("input_ids", "attention_mask")}]}
    (root / "manifest.json").write_text(json.dumps(m, indent=2) + "\n")
    return root


def test_engines_become_tensorrt_plans(tmp_path):
    d = _fake_dir(tmp_path / "a", engines=True)
    m = TR.build_repository(d)
    for name, src in (("elastic_s000", "dense.engine"), ("elastic_s025", "budget_s025.engine"),
                      ("elastic_s050", "budget_s050.engine")):
        cfg = _parse(d / "triton" / name / "config.pbtxt")
        assert cfg.platform == "tensorrt_plan" and cfg.max_batch_size == 32  # the engines' profile maximum
        assert cfg.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_GPU
        assert os.path.samefile(d / "triton" / name / "1" / "model.plan", d / src)
    assert {x["platform"] for x in m.triton["models"]} == {"tensorrt_plan"}
    with pytest.raises(UserError, match="accept at most batch 32"):
        TR.build_repository(d, max_batch=64)
    with pytest.raises(UserError, match="run on the GPU only"):
        TR.build_repository(d, kind="cpu")
    TR.build_repository(d, platform="onnxruntime", kind="cpu", max_batch=64)  # the ONNX files instead
    cfg = _parse(d / "triton" / "elastic_s025" / "config.pbtxt")
    assert cfg.platform == "onnxruntime_onnx" and cfg.max_batch_size == 64
    assert (d / "triton" / "elastic_s025" / "1" / "model.onnx").is_file()


def test_fp16_onnx_types_from_the_file(tmp_path):
    d = _fake_dir(tmp_path / "a", fp16=True)
    TR.build_repository(d, precision="fp16", dense=False)
    cfg = _parse(d / "triton" / "elastic_s050" / "config.pbtxt")
    assert cfg.output[0].data_type == model_config_pb2.TYPE_FP16
    assert cfg.input[0].data_type == model_config_pb2.TYPE_INT64
    assert os.path.samefile(d / "triton" / "elastic_s050" / "1" / "model.onnx", d / "budget_s050.fp16.onnx")
    router = _parse(d / "triton" / "elastic" / "config.pbtxt")
    assert json.loads(router.parameters["budget_models"].string_value) == [[0.25, "elastic_s025"],
                                                                            [0.5, "elastic_s050"]]


def test_copies_when_links_fail(tmp_path, monkeypatch):
    d = _fake_dir(tmp_path / "a")

    def no_link(src, dst):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(TR.os, "link", no_link)
    TR.build_repository(d)
    served = d / "triton" / "elastic_s025" / "1" / "model.onnx"
    assert not os.path.samefile(served, d / "budget_s025.onnx")
    assert served.read_bytes() == (d / "budget_s025.onnx").read_bytes()


def test_failed_build_leaves_previous_repository(tmp_path, monkeypatch):
    d = _fake_dir(tmp_path / "a")
    TR.build_repository(d)
    before, manifest = _tree(d / "triton"), (d / "manifest.json").read_text()

    def broken(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(TR, "_place", broken)
    with pytest.raises(OSError):
        TR.build_repository(d, name="other")
    assert _tree(d / "triton") == before and (d / "manifest.json").read_text() == manifest
    assert not [p.name for p in d.iterdir() if p.name.startswith(".triton")]
