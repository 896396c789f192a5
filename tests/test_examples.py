"""Every numbered example in examples/ runs, in order, on a tiny model (the first, run in this process,
exports the directory the others use, each run as ``python examples/SCRIPT``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_encoder
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def _run(script: str, *args: str, cwd: Path) -> str:
    r = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=cwd, env=ENV, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r.stdout


def _run_here(script: str, *args: str, cwd: Path) -> str:
    """The example as ``python examples/SCRIPT ARGS`` runs it (``runpy``, as ``__main__``, its argv), in
    this process, in ``cwd``; what it prints. Saves a fresh process's imports where the example's
    own work is what is tested."""
    import contextlib
    import io
    import runpy

    out, here, argv = io.StringIO(), os.getcwd(), sys.argv
    os.chdir(cwd)
    sys.argv = [str(EXAMPLES / script), *args]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    finally:
        sys.argv = argv
        os.chdir(here)
    return out.getvalue()


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("examples")
    tiny_encoder("hf-bert").module.save_pretrained(root / "bert")
    out = _run_here("01_export.py", "--model", "bert", "--budgets", "0.3,0.6", "--seq-len", "16", "--method",
                    "magnitude", "--out", "art", cwd=root)
    assert "sparsity 0.30" in out and "budget_s060.onnx" in out
    return root


def check_report(art: Path) -> None:
    """``art/report.html`` is the report of ``art``: its budgets section names every budget's file."""
    html = (art / "report.html").read_text()
    manifest = json.loads((art / "manifest.json").read_text())
    assert "<h2>Budgets" in html, html[:500]
    missing = [b["onnx"] for b in manifest["budgets"] if b["onnx"] not in html]
    assert not missing, f"report.html does not name {missing}"


def check_triton_repository(art: Path) -> None:
    """``art``'s Triton repository holds, and only holds, a model per budget (dense included), the indexing
    lane (the dense model for documents) and the router, each with a ``config.pbtxt`` that Triton's schema
    parses and that names it, and its files."""
    manifest = json.loads((art / "manifest.json").read_text())
    triton = manifest["triton"]
    repo = art / triton["dir"]
    assert sorted(m["sparsity"] for m in triton["models"]) == [0.0] + [b["sparsity"] for b in manifest["budgets"]]
    names = [m["name"] for m in triton["models"]] + [triton["index"]["name"], triton["router"]]
    assert sorted(p.name for p in repo.iterdir()) == sorted(names)
    for name in names:
        config = text_format.Parse((repo / name / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
        assert config.name == name
    for m in triton["models"]:
        assert (art / m["file"]).is_file(), m
    router = text_format.Parse((repo / triton["router"] / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert router.backend == "python" and (repo / triton["router"] / "1" / "model.py").is_file()


def test_every_example_is_tested():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == [
        "01_export.py", "02_slice_custom_widths.py", "03_serve_with_the_runtime.py", "04_triton_repository.py",
        "05_report.py", "06_triton_client.py"]  # 06 needs a running server: tests/test_triton_server.py


def test_02_slice_custom_widths(exported):
    out = _run("02_slice_custom_widths.py", "art", "--keep", "0.5", cwd=exported)
    assert (exported / "art" / "custom.onnx").is_file() and "custom.onnx: output (2, 16, 32)" in out


def test_03_serve_with_the_runtime(exported):
    out = _run("03_serve_with_the_runtime.py", "art", cwd=exported)
    assert "sparsity 0.60: budget_s060.onnx" in out and "queue depth 12 -> serving sparsity 0.60" in out
    assert out.strip().endswith("serving sparsity 0.00")  # back to dense once the queue drained


def test_04_triton_repository(exported):
    out = _run("04_triton_repository.py", "art", cwd=exported)
    assert 'backend: "python"' in out
    check_triton_repository(exported / "art")


def test_05_report(exported):
    out = _run("05_report.py", "art", cwd=exported)
    assert out.strip().endswith("report.html")
    check_report(exported / "art")
