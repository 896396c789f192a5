"""The stages that never touch a torch model run where torch is not installed (an edge device
given a copied artifact directory): the CLI, verify --no-torch (and verify, which then skips its
torch check), bench, report and build --target triton."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import tiny_encoder

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def art(tmp_path_factory) -> Path:
    from elastic_export import pipeline

    root = tmp_path_factory.mktemp("notorch")
    model = root / "tiny-bert"
    tiny_encoder("hf-bert").module.save_pretrained(model)
    out = root / "out"
    pipeline.run(pipeline.Options(model=str(model), budgets=(0.3, 0.6), out=str(out), seq_len=16, method="magnitude",
                                  verify=False, report=False), echo=lambda s: None)
    return out


def test_method_names_match_the_registry():
    import elastic_export.soft_ranking  # noqa: F401 (registers "elastic")
    from elastic_export.rank_options import METHOD_NAMES
    from elastic_export.scoring import METHODS

    assert tuple(sorted(METHODS)) == METHOD_NAMES


def test_commands_run_without_torch(art):
    commands = [["--help"], ["verify", str(art), "--no-torch"], ["verify", str(art)],
                ["bench", str(art), "--batches", "1", "--repeats", "2", "--warmup", "0", "--no-plot"],
                ["report", str(art)], ["build", "--target", "triton", str(art)]]
    code = textwrap.dedent(f"""
        import json, sys
        sys.modules["torch"] = None  # importing torch now raises ImportError
        from elastic_export.cli import main
        codes = []
        for args in {commands!r}:
            try:
                main(args)
            except SystemExit as e:
                codes.append(e.code)
        print("CODES", json.dumps(codes))
    """)
    r = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=600)
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    codes = json.loads(r.stdout.split("CODES", 1)[1])
    assert codes == [0] * len(commands), r.stdout[-3000:] + r.stderr[-3000:]
    assert "torch is not installed here" in r.stdout
    assert (art / "report.html").is_file() and (art / "bench.json").is_file() and (art / "triton").is_dir()
    assert json.loads((art / "manifest.json").read_text())["triton"]["dir"] == "triton"
