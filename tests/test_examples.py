"""Every numbered example in examples/ runs, in order, on a tiny model (the first exports the
directory the others use)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_encoder

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def _run(script: str, *args: str, cwd: Path) -> str:
    r = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=cwd, env=ENV, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r.stdout


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("examples")
    tiny_encoder("hf-bert").module.save_pretrained(root / "bert")
    out = _run("01_export.py", "--model", "bert", "--budgets", "0.3,0.6", "--seq-len", "16", "--method", "magnitude",
               "--out", "art", cwd=root)
    assert "sparsity 0.30" in out and "budget_s060.onnx" in out
    return root


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
    assert 'backend: "python"' in out and (exported / "art" / "triton").is_dir()


def test_05_report(exported):
    out = _run("05_report.py", "art", cwd=exported)
    assert out.strip().endswith("report.html") and (exported / "art" / "report.html").is_file()
