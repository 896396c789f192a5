"""The elastic targets cover the budgets asked for (issue 22, item 3), and the main job ranks on a
copy of its options (a reused ``Options`` never resumes another ``--out``'s checkpoint)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import tiny_encoder
from safetensors import safe_open

from elastic_export import pipeline
from elastic_export.cli.main import main
from elastic_export.ranking import driver
from elastic_export.ranking.file import META_KEY, Ranking
from elastic_export.ranking.options import DEEP_SCHEDULE, DEFAULT_TARGETS, ElasticConfig, cover_budgets, targets_spec

# tiny and quick: 2 elastic steps on 8 calibration texts, nothing but the ONNX files
FAST = ["--seq-len", "16", "--calib-size", "8", "--batch-size", "4", "--steps", "2", "--targets-per-step", "2",
        "--no-verify", "--no-quick-eval", "--no-report", "--no-elastic-graph"]


def _hyper(path: Path) -> dict:
    with safe_open(str(path), framework="numpy") as f:
        return json.loads(f.metadata()[META_KEY])["hyperparameters"]


def _cli(capsys, *args: str) -> list[str]:
    """Run the CLI in-process; its stderr lines (exit code 0 asserted)."""
    with pytest.raises(SystemExit) as e:
        main(list(args))
    err = capsys.readouterr().err
    assert e.value.code == 0, err[-2000:]
    return [x.strip() for x in err.replace("\r", "\n").splitlines() if x.strip()]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cover") / "tiny-bert"
    tiny_encoder("hf-bert").module.save_pretrained(path)
    return path


def test_cover_budgets_extends_at_the_targets_step():
    assert cover_budgets(DEFAULT_TARGETS, [0.1, 0.6]) == DEFAULT_TARGETS  # covered: unchanged
    assert cover_budgets(DEFAULT_TARGETS, [0.5, 0.9]) == DEFAULT_TARGETS + (0.75, 0.8, 0.85, 0.9)
    assert cover_budgets(DEFAULT_TARGETS, [0.88])[-2:] == (0.85, 0.88)  # up to and including the budget
    assert cover_budgets((0.5,), [0.6]) == (0.5, 0.55, 0.6)
    assert targets_spec(cover_budgets(DEFAULT_TARGETS, [0.9])) == "0.05..0.9:0.05"
    assert targets_spec((0.3, 0.5)) == "0.3,0.5"


def test_targets_extend_to_the_largest_budget_and_a_reused_ranking_warns(tmp_path, monkeypatch, capsys, bert_dir):
    monkeypatch.chdir(tmp_path)
    model = ["--model", str(bert_dir), *FAST]
    covered = _cli(capsys, *model, "--budgets", "0.3,0.6", "--out", "a")
    assert not any(x.startswith(("targets:", "warning:")) for x in covered)
    assert _hyper(tmp_path / "a" / "ranking.safetensors")["targets"] == list(DEFAULT_TARGETS)

    extended = _cli(capsys, *model, "--budgets", "0.5..0.9", "--out", "b")
    assert ("targets: the elastic targets stop at 0.7 but --budgets go to 0.9; optimising 0.05..0.9:0.05 "
            "(18 targets) instead (recorded in the ranking file)") in extended
    assert not any(x.startswith("ranking: budgets past") for x in extended)  # --steps given: kept
    hyper = _hyper(tmp_path / "b" / "ranking.safetensors")
    assert max(hyper["targets"]) == 0.9 and hyper["targets"][-4:] == [0.75, 0.8, 0.85, 0.9]
    assert hyper["targets_extended_from"] == list(DEFAULT_TARGETS)

    reused = _cli(capsys, *model, "--budgets", "0.5..0.9", "--out", "c", "--ranking", "a/ranking.safetensors")
    warnings = [x for x in reused if x.startswith("warning:")]
    assert warnings == ["warning: --ranking a/ranking.safetensors: its targets stop at 0.7 but --budgets go to 0.9, "
                        "so the budgets past 0.7 are ranked less well; re-rank with --targets 0.05..0.9:0.05 "
                        "(or drop --ranking)"]
    assert not any(x.startswith("warning:") for x in _cli(capsys, *model, "--budgets", "0.5..0.9", "--out", "d",
                                                           "--ranking", "b/ranking.safetensors"))


def test_budgets_past_the_default_targets_rank_with_the_deep_schedule(tmp_path, monkeypatch, capsys, bert_dir):
    """No schedule given, budgets to 0.9: the main job says it ranks with 64 steps of 4 targets at lr 0.02, and
    the ranking file records them."""
    monkeypatch.chdir(tmp_path)
    fast = [a for a in FAST if a not in ("--steps", "--targets-per-step", "2")]
    lines = _cli(capsys, "--model", str(bert_dir), *fast, "--budgets", "0.5,0.9", "--out", "deep")
    assert ("ranking: budgets past 0.7 rank with 64 steps of 4 targets at lr 0.02 (the default 40 x 2 holds up to "
            "0.7; give --steps, --targets-per-step or --lr to choose)") in lines
    hyper = _hyper(tmp_path / "deep" / "ranking.safetensors")
    assert (hyper["steps"], hyper["targets_per_step"], hyper["lr"]) == (64, 4, 0.02)
    # the default schedule given on the command line is kept
    lines = _cli(capsys, "--model", str(bert_dir), *fast, "--steps", "40", "--budgets", "0.5,0.9", "--out", "kept")
    assert not any(x.startswith("ranking: budgets past") for x in lines)
    hyper = _hyper(tmp_path / "kept" / "ranking.safetensors")
    assert (hyper["steps"], hyper["targets_per_step"]) == (40, 2) and "keep_schedule" not in hyper


def test_rank_leaves_the_callers_options_alone(tmp_path, monkeypatch):
    """``rank_or_reuse`` ranks with its own checkpoint per ``--out``; the Options given stay unchanged."""
    seen: list[pipeline.Options] = []

    def fake_rank(encoder, inventory, opts, echo, calib=None):
        seen.append(opts)
        return Ranking([], [], {"hyperparameters": {}})

    monkeypatch.setattr(driver, "rank_encoder", fake_rank)
    opts = pipeline.Options(out=str(tmp_path / "one"), budgets=(0.5, 0.9))
    driver.rank_or_reuse(None, None, opts, None, lambda msg: None)
    opts.out = str(tmp_path / "two")
    driver.rank_or_reuse(None, None, opts, None, lambda msg: None)
    assert opts.checkpoint is None and opts.elastic.targets == DEFAULT_TARGETS
    assert [Path(o.checkpoint).name for o in seen] == [".one.ranking-checkpoint.safetensors",
                                                       ".two.ranking-checkpoint.safetensors"]
    assert max(seen[0].elastic.targets) == 0.9
    # budgets past the default targets rank with the 64 x 4 schedule; the caller's config stays the default
    assert (seen[0].elastic.steps, seen[0].elastic.targets_per_step, seen[0].elastic.lr) == (64, 4, 0.02)
    assert (opts.elastic.steps, opts.elastic.targets_per_step) == (ElasticConfig().steps, ElasticConfig().targets_per_step)


def test_only_the_default_schedule_deepens_past_the_default_targets():
    plain = ElasticConfig()
    deep = plain.deepened(True)
    assert {k: getattr(deep, k) for k in DEEP_SCHEDULE} == DEEP_SCHEDULE and deep.targets == plain.targets
    assert plain.deepened(False) == plain  # targets not extended: the default schedule
    for given in ({"steps": 50}, {"targets_per_step": 3}, {"lr": 0.05}, {"keep_schedule": True}):  # given: kept
        config = replace(plain, **given)
        assert config.deepened(True) == config
