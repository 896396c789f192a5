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
from test_examples import check_report, check_triton_repository

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


def test_cli_lists_and_parses_methods_without_importing_torch():
    """Help and option parsing name and check the ranking methods from the registry, torch never imported."""
    code = textwrap.dedent("""
        import json, sys
        import click
        from elastic_export.ranking import methods
        from elastic_export.cli.main import cli, main
        from elastic_export.core.errors import UserError
        try:
            main(["--help"])
        except SystemExit as e:
            assert e.code == 0, e.code
        parsed = [cli.make_context("elastic-export", ["--method", m, "--budgets", "0.3", "--out", "x"]).params["method"]
                  for m in methods.names()]
        rank = cli.commands["rank"].make_context("rank", ["--method", "fisher", "--out", "r.safetensors"]).params
        try:
            cli.make_context("elastic-export", ["--method", "nope"])
        except UserError as e:
            refused = str(e)
        print("RESULT", json.dumps({"parsed": parsed, "rank": rank["method"], "refused": refused,
                                    "heavy": sorted(m for m in ("torch", "transformers", "timm") if m in sys.modules)}))
    """)
    r = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    from elastic_export.ranking import methods

    help_text, result = r.stdout.split("RESULT", 1)
    assert "Ranking method: " + ", ".join(methods.names()) in " ".join(help_text.split())
    result = json.loads(result)
    assert result["parsed"] == list(methods.names()) and result["rank"] == "fisher"
    assert result["refused"] == "--method nope: unknown; choose from " + ", ".join(methods.names())
    assert result["heavy"] == []


def test_registry_entries_load_their_scoring_functions():
    from elastic_export.ranking import methods, scoring

    assert methods.names() == ("activation", "elastic", "fisher", "initial", "magnitude", "random", "variance")
    for name in methods.names():
        fn = methods.load(name)
        assert callable(fn) and methods.REGISTRY[name].target == f"{fn.__module__}:{fn.__name__}"
        assert scoring.METHODS[name] is fn and name in scoring.METHODS
    assert tuple(scoring.METHODS) == methods.names() and len(scoring.METHODS) == len(methods.names())
    assert set(scoring.NEEDS_DATA) == {"activation", "elastic", "fisher", "initial", "variance"}
    assert "magnitude" not in scoring.NEEDS_DATA and "nope" not in scoring.NEEDS_DATA and "nope" not in scoring.METHODS
    with pytest.raises(KeyError):
        scoring.METHODS["nope"]
    with pytest.raises(ValueError, match="not 'package.module:function'"):
        methods.register("bad", "no_colon")


def test_a_registered_method_is_listed_loaded_and_ranked(monkeypatch):
    """Adding a method: one ``methods.register`` line naming ``module:function``; it is imported on first use."""
    from elastic_export.models.inventory import build_inventory
    from elastic_export.ranking import methods, scoring

    monkeypatch.setattr(methods, "REGISTRY", dict(methods.REGISTRY))
    methods.register("reversed-random", "test_torch_free:_reversed_random", needs_data=False)
    assert "reversed-random" in methods.names() and "reversed-random" not in scoring.NEEDS_DATA
    enc = tiny_encoder("hf-bert")
    inv = build_inventory(enc)
    heads, neurons = scoring.METHODS["reversed-random"](enc, inv, None, seed=1)
    base_heads, _ = scoring.METHODS["random"](enc, inv, None, seed=1)
    assert [h.tolist() for h in heads] == [(-b).tolist() for b in base_heads]

    @scoring.register_method("decorated", needs_data=False)
    def decorated(encoder, inventory, calibration=None, **_):
        return _reversed_random(encoder, inventory, calibration)

    assert methods.load("decorated") is decorated and scoring.METHODS["decorated"] is decorated


def _reversed_random(encoder, inventory, calibration=None, seed=0, **_):
    """A ranking method defined outside the package: the random scores, negated."""
    from elastic_export.ranking.scoring import random_scores

    heads, neurons = random_scores(encoder, inventory, calibration, seed=seed)
    return [-h for h in heads], [-n for n in neurons]


def test_commands_run_without_torch(art):
    commands = [["--help"], ["verify", str(art), "--no-torch"], ["verify", str(art)],
                ["bench", str(art), "--batches", "1", "--repeats", "2", "--warmup", "0", "--no-plot"],
                ["report", str(art)], ["build", "--target", "triton", str(art)]]
    code = textwrap.dedent(f"""
        import json, sys
        sys.modules["torch"] = None  # importing torch now raises ImportError
        from elastic_export.cli.main import main
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
    assert (art / "bench.json").is_file()
    assert json.loads((art / "manifest.json").read_text())["triton"]["dir"] == "triton"
    check_report(art)
    check_triton_repository(art)
