"""Models named by hub id, from a local Hugging Face hub cache read offline (no test touches the network).

The cache is built as huggingface_hub lays it out: ``models--ORG--NAME/refs/<branch>`` holds a
commit, ``snapshots/<commit>/`` its files (symlinks, as in a real cache). ``HF_HUB_CACHE`` points at
it and ``HF_HUB_OFFLINE=1``, so a model that is not there is refused in one line.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import save_tiny

from elastic_export.cli.main import main
from elastic_export.core.errors import UserError
from elastic_export.core.manifest import MANIFEST
from elastic_export.models import hub
from elastic_export.models.loader import default_model_path, load_encoder

MINILM = "sentence-transformers/all-MiniLM-L6-v2"
TIMM_REPO = "timm/vit_tiny_test.elastic"
MAIN, V1 = "1" * 40, "2" * 40  # the commits of refs/main and refs/v1
# the main job as these tests need it: no quick eval, report or elastic graph (none is read here)
QUICK = ["--budgets", "0.5", "--method", "magnitude", "--calib-size", "8", "--no-report", "--no-quick-eval",
         "--no-elastic-graph"]


def add_to_cache(cache: Path, repo_id: str, files: Path, commit: str, ref: str = "main") -> Path:
    """Put ``files`` (a model folder) in ``cache`` as snapshot ``commit`` of ``repo_id``, named by ``ref``."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / commit
    for f in files.rglob("*"):
        if f.is_file():
            (snap / f.relative_to(files)).parent.mkdir(parents=True, exist_ok=True)
            (snap / f.relative_to(files)).symlink_to(f.resolve())
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    """MiniLM (the embedded default's files) at two refs, and a tiny timm ViT as timm saves it."""
    from timm.models import VisionTransformer

    cache = tmp_path_factory.mktemp("hf") / "hub"
    add_to_cache(cache, MINILM, default_model_path(), MAIN)
    add_to_cache(cache, MINILM, default_model_path(), V1, ref="v1")
    timm_dir = tmp_path_factory.mktemp("timm_model")
    save_tiny(VisionTransformer, timm_dir)
    add_to_cache(cache, TIMM_REPO, timm_dir, MAIN)
    return cache


@pytest.fixture()
def offline_cache(hub_cache, monkeypatch, tmp_path) -> Path:
    """huggingface_hub reading only ``hub_cache``, offline; the working directory an empty tmp_path."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    return hub_cache


def _run(args: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(args)
    out, err = capsys.readouterr()
    return e.value.code, out, err


@pytest.mark.parametrize("name, revision, want", [
    ("org/name", None, hub.HubRef("org/name")),
    ("org/name@v1", None, hub.HubRef("org/name", "v1")),
    ("org/name", "abc", hub.HubRef("org/name", "abc")),
    ("org/name@abc", "abc", hub.HubRef("org/name", "abc")),
    ("vit_small_patch16_224.augreg_in21k", None, None),
    ("./org/name", None, None),
    ("/abs/org/name", None, None),
    ("a/b/c", None, None),
])
def test_parse(name, revision, want):
    assert hub.parse(name, revision) == want


def test_parse_refuses_two_revisions():
    with pytest.raises(UserError, match="two different revisions"):
        hub.parse("org/name@v1", "v2")


def test_main_job_verify_and_export_st_on_a_hub_id(offline_cache, capsys, tmp_path):
    """The main job on ``sentence-transformers/all-MiniLM-L6-v2`` from the cache; the manifest pins the
    commit; ``verify`` (torch reference included) and ``export-st`` find that snapshot again."""
    rc, out, err = _run(["--model", MINILM, *QUICK, "--out", "out"], capsys)
    assert rc == 0, err[-3000:]
    assert f"hub commit {MAIN}" in err
    model = json.loads((tmp_path / "out" / MANIFEST).read_text())["model"]
    assert (model["source"], model["repo_id"], model["revision"]) == (MINILM, MINILM, MAIN)
    assert model["fingerprint"] == load_encoder().fingerprint()  # the same weights as the embedded default
    assert (tmp_path / "out" / "tokenizer" / "tokenizer.json").is_file()

    rc, out, err = _run(["verify", "out"], capsys)
    assert rc == 0, (out + err)[-3000:]
    assert re.search(r" torch .* ok$", out, re.M) and "does not load here" not in out + err  # the torch check ran

    rc, out, err = _run(["export-st", "out", "--out", "st"], capsys)
    assert rc == 0, (out + err)[-3000:]
    assert any((tmp_path / "st").rglob("modules.json"))


@pytest.mark.parametrize("args", [["--model", f"{MINILM}@v1"], ["--model", MINILM, "--revision", "v1"],
                                  ["--model", f"{MINILM}@{V1}"]])
def test_a_revision_picks_its_snapshot(offline_cache, capsys, args):
    rc, out, err = _run(["inspect", *args], capsys)
    assert rc == 0, err[-3000:]
    enc = load_encoder(MINILM, revision="v1")
    assert (enc.source, enc.repo_id, enc.revision) == (MINILM, MINILM, V1)


def test_timm_hf_hub_name(offline_cache, capsys, tmp_path):
    """A timm ``hf-hub:`` name goes through timm's own hub loading, from the same cache."""
    rc, out, err = _run(["--model", f"hf-hub:{TIMM_REPO}", *QUICK, "--out", "out"], capsys)
    assert rc == 0, err[-3000:]
    model = json.loads((tmp_path / "out" / MANIFEST).read_text())["model"]
    assert (model["source"], model["repo_id"], model["revision"]) == (f"hf-hub:{TIMM_REPO}", TIMM_REPO, MAIN)
    assert model["architecture"].startswith("VisionTransformer")
    rc, out, err = _run(["verify", "out"], capsys)
    assert rc == 0, (out + err)[-3000:]
    assert re.search(r" torch .* ok$", out, re.M) and "does not load here" not in out + err  # the torch check ran


@pytest.mark.parametrize("name", ["BAAI/bge-small-en-v1.5", "hf-hub:timm/vit_small_patch16_224.augreg_in21k",
                                  f"{MINILM}@no-such-branch"])
def test_an_uncached_id_offline_is_one_line(offline_cache, capsys, tmp_path, name):
    rc, out, err = _run(["--model", name, *QUICK, "--out", "out"], capsys)
    assert rc == 2
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err
    assert name in lines[0] and str(offline_cache) in lines[0] and "HF_HUB_OFFLINE" in lines[0]
    assert not (tmp_path / "out").exists()


def test_a_local_path_wins_over_a_hub_id(offline_cache, capsys, tmp_path):
    """``org/name`` that exists as a folder is that folder, even with the same id in the cache."""
    from transformers import BertModel

    save_tiny(BertModel, tmp_path / "sentence-transformers" / "all-MiniLM-L6-v2")
    enc = load_encoder(MINILM)
    assert enc.revision is None and Path(enc.source) == (tmp_path / MINILM).resolve()
    rc, out, err = _run(["inspect", "--model", MINILM, "--revision", "v1"], capsys)
    assert rc == 2 and "local directory" in err and "--revision" in err


def test_the_env_variables_reach_a_fresh_process(hub_cache, tmp_path):
    """HF_HUB_CACHE and HF_HUB_OFFLINE are read as huggingface_hub reads them, in a new process."""
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HOME", None)
    from concurrent.futures import ThreadPoolExecutor

    def inspect(model: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "elastic_export", "inspect", "--model", model], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=300)

    with ThreadPoolExecutor(2) as pool:  # side by side: each is mostly imports
        cached, missing = pool.map(inspect, (MINILM, "BAAI/bge-small-en-v1.5"))
    assert cached.returncode == 0, cached.stderr[-3000:]
    assert "BertModel" in cached.stdout
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and str(hub_cache) in missing.stderr, \
        missing.stderr


def test_docs_python_snippet_runs(offline_cache, capsys):
    """docs/models.md's Python snippet, run literally against the cache."""
    doc = (Path(__file__).parents[1] / "docs" / "models.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, re.S)
    assert blocks
    for code in blocks:
        exec(compile(code, "docs/models.md", "exec"), {})
    assert capsys.readouterr().out.split() == [MINILM, MAIN, "BertModel"]
