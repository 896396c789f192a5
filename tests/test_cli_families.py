"""Every registered architecture through the command line, as a user runs it: a tiny model saved
as a directory (``save_pretrained``, or timm's hub layout), then ``inspect``, the main job and
``verify`` through the console entry point (in process: the same ``main()`` the script runs)."""

from __future__ import annotations

import json

import pytest
from conftest import save_tiny

from elastic_export.adapters import ADAPTERS
from elastic_export.cli import main
from elastic_export.manifest import MANIFEST

CLASSES = sorted(ADAPTERS, key=lambda c: c.__name__)


def _run(args: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(args)
    out, err = capsys.readouterr()
    return e.value.code, out, err


@pytest.mark.parametrize("model_class", CLASSES, ids=[c.__name__ for c in CLASSES])
def test_inspect_main_job_and_verify(model_class, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    save_tiny(model_class, tmp_path / "model")
    rc, out, err = _run(["inspect", "--model", "model"], capsys)
    assert rc == 0, err[-2000:]
    assert "GFLOPs" in out and model_class.__name__ in out

    rc, out, err = _run(["--model", "model", "--budgets", "0.3,0.6", "--method", "magnitude", "--calib-size", "8",
                         "--out", "out", "--no-report"], capsys)
    assert rc == 0, err[-2000:]
    m = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert m["model"]["architecture"].split(":")[0] == model_class.__name__
    assert [b["sparsity"] for b in m["budgets"]] == [0.3, 0.6]
    assert all(b["max_abs_error"] <= 1e-4 for b in m["budgets"])
    assert m["elastic"] is not None and m["elastic"]["max_abs_error"] <= 1e-4
    assert "quick eval skipped" not in err  # the main job's quick eval runs on every family
    assert [(r["sparsity"], r["precision"]) for r in m["quick_eval"]["rows"]] == [(0.0, "fp32"), (0.3, "fp32"), (0.6, "fp32")]

    rc, out, err = _run(["verify", "out"], capsys)
    assert rc == 0, (out + err)[-2000:]
