"""The backend registry (elastic_export.serving.backends): a backend added from outside the package (onnx's numpy
reference evaluator, below: one class and one registry line) runs through ElasticRuntime.from_dir, bench
and the command line; the built-in ones are listed without importing them. Real tiny artifacts, no mocks."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from test_runtime import _export

from elastic_export.core import results
from elastic_export.core.errors import UserError
from elastic_export.core.manifest import resolve
from elastic_export.serving.backends import (
    REGISTRY,
    Backend,
    Loaded,
    RunnableBudget,
    backend_help,
    backend_names,
    get_backend,
    manifest_sparsity,
    register_backend,
    serialized,
)
from elastic_export.serving.runtime import ElasticRuntime, SessionConfig

NAME = "onnx-reference"
BUDGETS = (0.3, 0.6)


class ReferenceBackend(Backend):
    """Every fp32 file (dense.onnx and each budget's) run by ``onnx.reference.ReferenceEvaluator`` (numpy)."""

    supports_precisions = False
    closed: list[str] = []  # names of the instances closed

    def load_budgets(self, directory, manifest, mode, keep, precisions, config=None, providers=None) -> Loaded:
        if mode != "per-budget":
            raise UserError(f"backend {self.name!r} runs the per-budget files; use mode='per-budget'")
        rows = [(0.0, manifest.dense.onnx)] + [(b.sparsity, b.onnx) for b in manifest.budgets]
        rows = [(manifest_sparsity(directory, s), rel) for s, rel in rows]
        return Loaded([RunnableBudget(s, rel, _evaluator(resolve(directory, rel))) for s, rel in rows if keep(s)], "numpy")

    def close(self) -> None:
        self.closed.append(self.name)


def _evaluator(path: Path):
    from onnx.reference import ReferenceEvaluator

    ref = ReferenceEvaluator(str(path))
    return serialized(lambda feeds: ref.run(None, {n: feeds[n] for n in ref.input_names}))


@pytest.fixture(scope="module")
def registered():
    """The one registry line a new backend needs (removed again afterwards)."""
    register_backend(NAME, "test_backends:ReferenceBackend", help="onnx's reference evaluator")
    yield NAME
    REGISTRY.pop(NAME)


@pytest.fixture(scope="module")
def art(tmp_path_factory) -> Path:
    return _export(tmp_path_factory, BUDGETS, elastic_graph=False)


@pytest.fixture(scope="module")
def feeds() -> dict[str, np.ndarray]:
    ids = np.array([[5, 17, 300, 9, 2, 0, 0, 0], [7, 8, 9, 10, 11, 12, 13, 14]], dtype=np.int64)
    return {"input_ids": ids, "attention_mask": (ids > 0).astype(np.int64), "token_type_ids": np.zeros_like(ids)}


def test_builtin_backends_listed_without_importing_them():
    """The CLI and the registry name the backends; only using one imports its module, and TensorRT
    (the package and the target module) only when the tensorrt backend checks or loads."""
    code = textwrap.dedent("""
        import json, sys
        import elastic_export.cli.main
        from elastic_export.serving.backends import backend_names, get_backend
        before = sorted(m for m in sys.modules if m.startswith("elastic_export.targets") or m == "tensorrt")
        trt = get_backend("tensorrt")
        after = sorted(m for m in sys.modules if m.startswith("elastic_export.targets") or m == "tensorrt")
        print(json.dumps({"names": backend_names(), "before": before, "after": after, "name": trt.name,
                          "torch": "torch" in sys.modules}))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    assert got["names"] == ["onnxruntime", "tensorrt"] and got["name"] == "tensorrt" and not got["torch"]
    assert got["before"] == []
    assert got["after"] == ["elastic_export.targets", "elastic_export.targets.trt_backend"]


def test_registry_entries_and_refusals():
    assert backend_names()[:2] == ("onnxruntime", "tensorrt")
    assert backend_help() == "onnxruntime (the ONNX files) or tensorrt (the manifest's engines; see `build --target tensorrt`)"
    assert get_backend("onnxruntime").supports_precisions and not get_backend("tensorrt").supports_precisions
    assert get_backend("tensorrt") is not get_backend("tensorrt")  # one instance per runtime
    with pytest.raises(UserError, match=r"^backend 'nope': unknown; choose from onnxruntime, tensorrt"):
        get_backend("nope")
    with pytest.raises(ValueError, match="not 'package.module:Class'"):
        register_backend("x", "no_colon")
    assert "x" not in backend_names()


def test_added_backend_runs_through_the_runtime(registered, art, feeds):
    assert registered in backend_names() and backend_help().endswith(f" or {NAME} (onnx's reference evaluator)")
    ref = ElasticRuntime.from_dir(art, backend=NAME)
    ort = ElasticRuntime.from_dir(art, config=SessionConfig(threads=1))
    assert (ref.backend, ref.provider, ref.precisions) == (NAME, "numpy", ["fp32"])
    assert ref.pairs == ort.pairs == [(0.0, "fp32"), (0.3, "fp32"), (0.6, "fp32")]
    for s in ref.sparsities:
        assert ref.file(s) == ort.file(s)
        got, want = ref.run(feeds, sparsity=s), ort.run(feeds, sparsity=s)
        assert list(got) == list(want) == ort.output_names
        for name in got:
            np.testing.assert_allclose(got[name], want[name], atol=1e-4)
    ref.set_budget(0.6)
    assert ref.serve(feeds)[0] == 0.6
    ref.close()
    assert ReferenceBackend.closed[-1] == NAME
    assert ElasticRuntime.from_dir(art, backend=NAME, sparsities=[0.3]).pairs == [(0.3, "fp32")]


def test_added_backend_refusals(registered, art):
    with pytest.raises(UserError, match=rf"^precision fp32, int8: backend '{NAME}' runs one precision per budget"):
        ElasticRuntime.from_dir(art, backend=NAME, precisions="fp32,int8")
    with pytest.raises(UserError, match="use mode='per-budget'"):
        ElasticRuntime.from_dir(art, backend=NAME, mode="elastic")


def test_added_backend_runs_through_bench_and_the_cli(registered, art, tmp_path, capsys):
    from elastic_export.cli.main import main
    from elastic_export.measure.bench import BenchConfig, bench, latency_profile

    config = BenchConfig(backend=NAME, batches=(1, 2), repeats=2, warmup=0)
    result, written = bench(art, config, out=tmp_path / "b.json", plot=False, profile=False)
    assert result["backend"] == NAME and result["provider"] == "numpy" and written.json.is_file()
    assert [(r["batch"], r["sparsity"], r["precision"]) for r in result["rows"]] == [
        (b, s, "fp32") for b in (1, 2) for s in (0.0, *BUDGETS)]
    assert all(r["p50_ms"] > 0 for r in result["rows"])
    assert set(latency_profile(result)["batches"]) == {"1", "2"}
    with pytest.raises(UserError, match=rf"^--precision int8: backend '{NAME}'"):
        BenchConfig(backend=NAME, precision="int8").check()
    with pytest.raises(SystemExit) as code:
        main(["bench", str(art), "--backend", NAME, "--batches", "1", "--repeats", "1", "--warmup", "0",
              "--no-plot", "--no-profile", "--out", str(tmp_path / "cli.json")])
    assert code.value.code == 0, capsys.readouterr().err
    assert results.load(tmp_path / "cli.json").meta["backend"] == NAME  # the one results schema
