"""The GPU check scripts where there is no GPU.

``benchmarks/gpu_torch.py`` (the sliced budgets as PyTorch modules, the GPU check's path without
TensorRT) runs its whole code path on the CPU with ``--device cpu``: every budget is built, loaded
in the requested dtype, timed, compared with fp32, and the table / JSON are written.
``scripts/gpu_check.sh`` refuses, naming what is missing, on a machine without a GPU.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_encoder

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _gpu_torch_main(argv: list[str]) -> int:
    """``python benchmarks/gpu_torch.py ARGV``'s ``main``, in this process (the script loaded from its
    file; ``sys.path`` as it was after). The refusal's exit code is checked in a fresh process below."""
    import importlib.util

    path, script = list(sys.path), ROOT / "benchmarks" / "gpu_torch.py"
    try:
        spec = importlib.util.spec_from_file_location("bench_gpu_torch", script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path
    return module.main(argv)


@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-5), ("fp16", 2e-2)])
def test_gpu_torch_runs_on_cpu(tmp_path, dtype, tol, capsys):
    model = tmp_path / "tiny-bert"
    tiny_encoder("hf-bert").module.save_pretrained(model)
    rc = _gpu_torch_main(["--model", str(model), "--device", "cpu", "--dtype", dtype, "--batch", "4", "--budgets",
                          "0.3,0.6", "--align", "1", "--iters", "2", "--latency-iters", "3", "--switch-pairs", "2",
                          "--seq-len", "8", "--results", str(tmp_path / "out")])
    assert rc == 0, capsys.readouterr().err[-2000:]
    out = json.loads((tmp_path / "out" / "gpu_torch.json").read_text())
    rows = {row["budget"]: row for row in out["rows"]}
    assert list(rows) == ["dense", "0.30", "0.60"] and out["dtype"] == dtype and not out["cuda_graphs"]
    assert rows["dense"]["flop_ratio"] == 1.0 and rows["0.30"]["flop_ratio"] > 1.2 and rows["0.60"]["flop_ratio"] > 2
    assert all(row["throughput"] > 0 and row["latency_ms"] > 0 for row in rows.values())
    assert rows["dense"]["switch_ms"] is None and all(rows[k]["switch_ms"] >= 0 for k in ("0.30", "0.60"))
    assert all(row["rel_error_vs_fp32"] <= tol for row in rows.values()), [r["rel_error_vs_fp32"] for r in rows.values()]
    assert (tmp_path / "out" / "gpu_torch.md").read_text().count("\n| ") == 4  # header + 3 budgets


def test_gpu_torch_refuses_cuda_without_a_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible here: the refusal cannot happen")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_torch.py"), "--results", str(tmp_path)],
                       capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 1 and "missing: a CUDA GPU" in r.stderr and "Traceback" not in r.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="an NVIDIA GPU may be present: the check would run")
def test_gpu_check_names_what_is_missing():
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                       env={**ENV, "PYTHON": sys.executable}, timeout=300)
    assert r.returncode == 1
    assert "missing: an NVIDIA GPU" in r.stderr and "cannot run here" in r.stderr and "Traceback" not in r.stderr
