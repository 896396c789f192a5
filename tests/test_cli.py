"""The console script (DESIGN.md §4 "CLI"): bad input ends with exit code 2, one ``error:`` line on
stderr, no traceback and nothing new on disk; ``inspect`` and ``--help`` work.

Each case runs in its own fresh directory through ``elastic_export.cli.main.main`` (the function the
console script calls), in this process with stdout and stderr captured: an exception that escapes
``main`` fails the test as a traceback would. :data:`SUBPROCESS` names the cases that run as
``python -m elastic_export`` in a fresh process instead (the exit codes 0 and 2 as the shell sees
them: about 5 s each, mostly imports, so they start at once on a thread pool when the first test
asks for one; each test then waits for its own).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch

from elastic_export.cli.main import main

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
CHEAP = ["--budgets", "0.5", "--no-verify", "--calib-size", "4"]
# a main job that must complete: the magnitude ranking (these tests are not about the ranking)
COMPLETE = [*CHEAP, "--method", "magnitude"]
TIMEOUT = 300


# --- running the console script ------------------------------------------------------------------
def snapshot(root: Path) -> dict[str, str]:
    """Every path under root: directories as 'dir', files as the sha256 of their bytes."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = "dir"
        for f in filenames:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = hashlib.sha256(Path(p).read_bytes()).hexdigest()
    return out


@dataclass
class Result:
    args: list[str]
    rc: int
    stdout: str
    stderr: str
    seconds: float
    root: Path
    before: dict[str, str] = field(default_factory=dict)
    after: dict[str, str] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    def describe(self) -> str:
        return (f"elastic-export {' '.join(self.args)}\nexit {self.rc} after {self.seconds:.1f}s\n"
                f"--- stdout ---\n{self.stdout[-3000:]}\n--- stderr ---\n{self.stderr[-3000:]}")


def run_subprocess(args: list[str], cwd: Path) -> Result:
    """``python -m elastic_export ARGS`` in a fresh process in ``cwd``."""
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "elastic_export", *args], cwd=cwd, env=ENV, capture_output=True,
                       text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    return Result(args, p.returncode, p.stdout, p.stderr, time.time() - t0, cwd)


def run_cli(args: list[str], cwd: Path) -> Result:
    """``main(ARGS)`` in this process with ``cwd`` as the working directory, stdout and stderr
    captured; its exit code is the code of the ``SystemExit`` it ends with."""
    out, err = io.StringIO(), io.StringIO()
    t0 = time.time()
    here = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                pytest.raises(SystemExit) as done:
            main(list(args))
    finally:
        os.chdir(here)
    return Result(args, done.value.code, out.getvalue(), err.getvalue(), time.time() - t0, cwd)


def stderr_lines(text: str) -> list[str]:
    """Lines of stderr; progress bars redraw with carriage returns, so those split lines too."""
    return [line.strip() for line in re.split(r"[\r\n]+", text) if line.strip()]


def assert_bad_input(r: Result, *expected: str) -> str:
    """Exit code 2, exactly one ``error:`` line and it is the last, no traceback, nothing written."""
    assert r.rc == 2, r.describe()
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.describe()
    lines = stderr_lines(r.stderr)
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, r.describe()
    assert lines[-1] == errors[0], r.describe()
    raw = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b", line)]
    assert not raw, r.describe()
    assert r.stdout.strip() == "", r.describe()
    for text in expected:
        assert text in errors[0], r.describe()
    new = sorted(set(r.after) - set(r.before))
    changed = sorted(k for k in r.before if r.after.get(k) != r.before[k])
    assert not new and not changed, f"new on disk: {new}; changed or removed: {changed}\n{r.describe()}"
    return errors[0]


# --- inputs the cases need -----------------------------------------------------------------------
def save_tiny_bert(path: Path, layers: int = 2, seed: int = 0) -> Path:
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=512, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=72)
    BertModel(cfg).save_pretrained(str(path))
    return path


def save_tiny_gpt2(path: Path) -> Path:
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    GPT2Model(GPT2Config(n_layer=1, n_embd=16, n_head=2)).save_pretrained(str(path))
    return path


def _with_out_holding_a_file(root: Path) -> list[str]:
    (root / "existing").mkdir()
    (root / "existing" / "notes.txt").write_text("my own notes, not an artifact set\n")
    return ["--out", "existing", *CHEAP]


def _with_garbage_ranking(root: Path) -> list[str]:
    import numpy as np

    (root / "garbage.safetensors").write_bytes(np.random.default_rng(0).bytes(3000))
    return ["--ranking", "garbage.safetensors", *CHEAP]


def _with_gpt2(root: Path) -> list[str]:
    save_tiny_gpt2(root / "gpt2")
    return ["--model", "gpt2", *CHEAP]


def _after_a_full_run(root: Path) -> tuple[list[str], dict]:
    """A complete (cheap) run into ``out``, then a run that fails while reusing ``out``."""
    save_tiny_bert(root / "bert", layers=2, seed=0)
    save_tiny_bert(root / "bert3", layers=3, seed=1)
    first = run_cli(["--model", "bert", "--seq-len", "16", *COMPLETE, "--out", "out"], root)
    second = ["--model", "bert3", "--seq-len", "16", *CHEAP, "--out", "out", "--ranking", "out/ranking.safetensors"]
    return second, {"first": first}


def _with_bert_and_an_existing_dir(root: Path) -> list[str]:
    save_tiny_bert(root / "bert")
    (root / "existing_dir").mkdir()
    return ["rank", "--model", "bert", "--seq-len", "16", "--calib-size", "4", "--out", "existing_dir"]


def _exported_then_built_with_target(root: Path) -> tuple[list[str], dict]:
    """A cheap export into ``out`` and a copy ``legacy`` built with ``build --target triton``; then the
    same build with the ``build triton`` subcommand on ``out``."""
    import shutil

    save_tiny_bert(root / "bert")
    export = run_cli(["--model", "bert", "--seq-len", "16", *COMPLETE, "--no-quick-eval", "--no-report",
                      "--no-elastic-graph", "--out", "out"], root)
    shutil.copytree(root / "out", root / "legacy")
    opts = ["--triton-kind", "cpu", "--triton-default-sparsity", "0.5", "--max-batch", "8"]
    legacy = run_cli(["build", "--target", "triton", "legacy", *opts], root)
    return ["build", "triton", "out", *opts], {"export": export, "legacy": legacy}


def _build_helps(root: Path) -> tuple[list[str], dict]:
    helps = {name: run_cli(["build", *args, "--help"], root)
             for name, args in (("triton", ["triton"]), ("tensorrt", ["tensorrt"]), ("target", ["--target", "triton"]))}
    return ["build", "--help"], helps


def _args(*args: str) -> Callable[[Path], list[str]]:
    return lambda root: list(args)


# test item name -> what to run there (args, or a setup that returns them and may run more first)
CASES: dict[str, Callable[[Path], list[str] | tuple[list[str], dict]]] = {
    "test_bad_fisher_projections": _args("--fisher-projections", "0"),
    "test_bad_ranking_compute": _args("--ranking-compute", "fp16"),
    "test_bad_budgets[reversed-range]": _args("--budgets", "0.7..0.2"),
    "test_bad_budgets[not-a-number]": _args("--budgets", "abc"),
    "test_bad_budgets[duplicate]": _args("--budgets", "0.1,0.1"),
    "test_bad_budgets[above-one]": _args("--budgets", "1.5"),
    "test_bad_budgets[empty]": _args("--budgets", ""),
    "test_bad_budgets[negative]": _args("--budgets", "-0.1"),
    "test_bad_budgets[empty-item]": _args("--budgets", "0.1,,0.2"),
    "test_bad_budgets_overflowing_range": _args("--budgets", "0..1e308"),
    "test_unknown_option": _args("--bogus"),
    "test_missing_model_path": _args("--model", "/nonexistent/path", *CHEAP),
    "test_unknown_model_name": _args("--model", "not_a_model_name_xyz", *CHEAP),
    "test_unsupported_architecture": _with_gpt2,
    "test_out_holding_other_files_is_refused": _with_out_holding_a_file,
    "test_failed_run_creates_no_parent_directories": _args("--model", "/nonexistent/path", "--out",
                                                           "nested/deeper/out", *CHEAP),
    "test_garbage_ranking_file": _with_garbage_ranking,
    "test_missing_calibration_file": _args("--calib", "missing.txt", *CHEAP),
    "test_seq_len_beyond_positions": _args("--seq-len", "100000", *CHEAP),
    "test_align_wider_than_mlp": _args("--align", "100000", *CHEAP),
    "test_device_cuda_without_cuda": _args("--device", "cuda", *CHEAP),
    "test_failed_run_keeps_previous_artifacts": _after_a_full_run,
    "test_rank_out_is_a_directory": _with_bert_and_an_existing_dir,
    "test_inspect_image_size_smaller_than_patch": _args("inspect", "--model", "vit_tiny_patch16_224",
                                                        "--no-pretrained", "--image-size", "8"),
    "test_inspect_vit_base": _args("inspect", "--model", "vit_base_patch16_224", "--no-pretrained"),
    "test_help": _args("--help"),
    "test_build_triton_subcommand": _exported_then_built_with_target,
    "test_build_help_lists_the_subcommands": _build_helps,
    "test_build_triton_refuses_tensorrt_options": _args("build", "triton", ".", "--min-batch", "2"),
    "test_build_tensorrt_refuses_triton_options": _args("build", "tensorrt", ".", "--triton-name", "x"),
    "test_build_without_target_is_the_original_error": _args("build", "somewhere"),
}
# run as `python -m elastic_export` in a fresh process: exit 0, a click usage error and a UserError
# (exit 2) as the shell sees them
SUBPROCESS = {"test_help", "test_unknown_option", "test_missing_model_path"}


def run_case(name: str, root: Path, run: Callable[[list[str], Path], Result] = run_cli) -> Result:
    """Case ``name`` in the fresh directory ``root``: its setup, then its command by ``run``, with a
    snapshot of ``root`` before and after the command."""
    got = CASES[name](root)
    args, extra = got if isinstance(got, tuple) else (got, {})
    before = snapshot(root)
    r = run(args, root)
    r.before, r.after, r.extra = before, snapshot(root), extra
    return r


class Runs:
    """Starts every wanted :data:`SUBPROCESS` case at once; ``get(name)`` waits for one."""

    def __init__(self, names: list[str], base: Path):
        self.base = base
        self.pool = ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2)))
        self.futures: dict[str, Future] = {}
        for name in names:
            self._submit(name)

    def _submit(self, name: str) -> None:
        if name not in self.futures:
            self.futures[name] = self.pool.submit(self._run, name)

    def _run(self, name: str) -> Result:
        root = self.base / re.sub(r"[^\w.-]+", "_", name)
        root.mkdir()
        return run_case(name, root, run_subprocess)

    def get(self, name: str) -> Result:
        self._submit(name)
        return self.futures[name].result()


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    wanted = [item.name for item in request.session.items
              if item.module is request.module and item.name in SUBPROCESS]
    r = Runs(wanted, tmp_path_factory.mktemp("cli"))
    yield r
    r.pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture
def result(runs, request, tmp_path) -> Result:
    name = request.node.name
    return runs.get(name) if name in SUBPROCESS else run_case(name, tmp_path)


# --- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["0.7..0.2", "abc", "0.1,0.1", "1.5", "", "-0.1", "0.1,,0.2"],
                         ids=["reversed-range", "not-a-number", "duplicate", "above-one", "empty", "negative",
                              "empty-item"])
def test_bad_budgets(result, spec):
    # the error quotes the spec it refuses (an empty one is named as empty: '' would match any line)
    assert_bad_input(result, "--budgets", f"'{spec}'" if spec else "empty --budgets")
    assert "loading" not in result.stderr  # refused before any model is loaded


def test_bad_fisher_projections(result):
    assert_bad_input(result, "--fisher-projections must be a positive integer, got 0")
    assert "loading" not in result.stderr  # refused before any model is loaded


def test_bad_ranking_compute(result):
    assert_bad_input(result, "--ranking-compute", "'fp16' is not one of 'auto', 'fp32', 'bf16'")
    assert "loading" not in result.stderr


def test_bad_budgets_overflowing_range(result):
    # parse_budgets used to raise OverflowError here: a traceback and exit 1
    assert_bad_input(result, "--budgets")


def test_unknown_option(result):
    assert_bad_input(result, "--bogus")


def test_missing_model_path(result):
    assert_bad_input(result, "/nonexistent/path", "no such directory")


def test_unknown_model_name(result):
    assert_bad_input(result, "not_a_model_name_xyz")


def test_unsupported_architecture(result):
    msg = assert_bad_input(result, "GPT2Model")
    assert "unsupported" in msg


def test_out_holding_other_files_is_refused(result):
    assert_bad_input(result, "--out", "--overwrite")
    assert (result.root / "existing" / "notes.txt").read_text() == "my own notes, not an artifact set\n"
    assert sorted(os.listdir(result.root / "existing")) == ["notes.txt"]


def test_failed_run_creates_no_parent_directories(result):
    # pipeline.prepare_out used to create nested/deeper before loading the model
    assert_bad_input(result, "/nonexistent/path")


def test_garbage_ranking_file(result):
    assert_bad_input(result, "--ranking", "garbage.safetensors")


def test_missing_calibration_file(result):
    assert_bad_input(result, "--calib", "missing.txt")


def test_seq_len_beyond_positions(result):
    assert_bad_input(result, "--seq-len", "100000")


def test_align_wider_than_mlp(result):
    assert_bad_input(result, "--align", "100000")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA, so --device cuda is valid input")
def test_device_cuda_without_cuda(result):
    msg = assert_bad_input(result, "--device cuda")
    assert "CUDA" in msg
    assert "loading" not in result.stderr  # refused before the model is loaded


def test_failed_run_keeps_previous_artifacts(result):
    first = result.extra["first"]
    assert first.rc == 0, first.describe()
    assert "Traceback" not in first.stderr
    assert "wrote out" in first.stdout and "manifest.json" in first.stdout
    manifest = json.loads((result.root / "out" / "manifest.json").read_text())
    assert [b["sparsity"] for b in manifest["budgets"]] == [0.5]
    for rel in [manifest["dense"]["onnx"], manifest["ranking"]["file"], *(b["onnx"] for b in manifest["budgets"])]:
        assert (result.root / "out" / rel).is_file(), rel
    assert sorted(os.listdir(result.root)) == ["bert", "bert3", "out"]  # no temporary directory left
    # the second run (another model, reusing out/'s ranking) is refused and leaves out/ as it was
    assert_bad_input(result, "another model")


def test_rank_out_is_a_directory(result):
    # ranking.save_ranking used to let os.replace raise IsADirectoryError here
    assert_bad_input(result, "existing_dir", "directory")


def test_inspect_image_size_smaller_than_patch(result):
    # the patch conv used to raise RuntimeError in build_inventory here
    assert_bad_input(result, "--image-size")


# --- good input ----------------------------------------------------------------------------------
def test_inspect_vit_base(result):
    assert result.rc == 0, result.describe()
    assert "Traceback" not in result.stderr
    out = result.stdout
    assert "605,184" in out  # neuron: 4 * 768 * 197
    assert "87,515,083" in out  # head: 8 * 768 * 64 * 197 + 4 * 64 * 197**2 + 3 * 197**2
    assert "N=197" in out and "D=768" in out
    rows = [line.split() for line in out.splitlines() if re.match(r"^\s*\d+\s+12\s+64\s+3072\b", line)]
    assert len(rows) == 12
    assert all(r[5] == "87,515,083" and r[6] == "605,184" for r in rows)
    assert result.after == result.before


def test_help(result):
    assert result.rc == 0, result.describe()
    assert "Traceback" not in result.stderr
    out = result.stdout
    assert "Usage:" in out
    for opt in ("--model", "--budgets", "--out", "--method", "--calib", "--ranking", "--align", "--seq-len",
                "--image-size", "--pretrained / --no-pretrained", "--device", "--overwrite"):
        assert opt in out, opt
    for cmd in ("inspect", "rank", "export"):
        assert cmd in out, cmd
    assert result.after == result.before


# --- build: the subcommands and the original --target form ---------------------------------------
def test_build_triton_subcommand(result):
    export, legacy = result.extra["export"], result.extra["legacy"]
    assert export.rc == 0 and legacy.rc == 0, export.describe() + legacy.describe()
    assert result.rc == 0, result.describe()
    assert "triton/elastic (router, python backend, default sparsity 0.5)" in result.stdout
    assert result.stdout == legacy.stdout.replace("legacy", "out")  # same report as `build --target triton`
    out, old = result.root / "out", result.root / "legacy"
    repo = snapshot(out / "triton")
    assert repo == snapshot(old / "triton") and "elastic/config.pbtxt" in repo  # byte-identical repositories
    new, was = (json.loads((d / "manifest.json").read_text()) for d in (out, old))
    assert new["triton"] == was["triton"] and new["triton"]["instance_kind"] == "cpu"
    assert new["triton"]["max_batch_size"] == 8


def test_build_help_lists_the_subcommands(result):
    assert result.rc == 0 and "Traceback" not in result.stderr, result.describe()
    assert "Usage: elastic-export build [OPTIONS] COMMAND [ARGS]..." in result.stdout
    assert re.search(r"^\s+tensorrt\s", result.stdout, re.M) and re.search(r"^\s+triton\s", result.stdout, re.M)
    assert "--target" in result.stdout  # the original form is documented as still working
    triton, tensorrt, target = (result.extra[k] for k in ("triton", "tensorrt", "target"))
    assert all(r.rc == 0 for r in (triton, tensorrt, target)), triton.describe() + tensorrt.describe()
    assert "Usage: elastic-export build triton [OPTIONS] DIR" in triton.stdout
    assert "--triton-kind" in triton.stdout and "--workspace-gb" not in triton.stdout and "--opt-batch" not in triton.stdout
    assert "Usage: elastic-export build tensorrt [OPTIONS] DIR" in tensorrt.stdout
    assert "--workspace-gb" in tensorrt.stdout and "--triton" not in tensorrt.stdout
    assert "Usage: elastic-export build [OPTIONS] DIR" in target.stdout  # the original command, every option
    assert "--target [tensorrt|triton]" in target.stdout and "--workspace-gb" in target.stdout
    assert "--triton-kind" in target.stdout
    assert result.after == result.before


def test_build_triton_refuses_tensorrt_options(result):
    assert_bad_input(result, "No such option '--min-batch'")


def test_build_tensorrt_refuses_triton_options(result):
    assert_bad_input(result, "No such option '--triton-name'")


def test_build_without_target_is_the_original_error(result):
    # a DIR that is not a subcommand name: the original command, and its error (click lists the choices)
    assert result.rc == 2 and "Traceback" not in result.stderr, result.describe()
    assert result.stderr.startswith("error: Missing option '--target'. Choose from:"), result.describe()
    assert result.after == result.before


def test_defaults_are_read_from_where_they_are_defined(monkeypatch):
    """--atol / --rtol-fp16 come from checks.compare, the elastic options (--targets, --loss, --token-weight,
    --steps, ...) from ranking.options.ElasticConfig: changed there, the command line follows."""
    import importlib
    from dataclasses import dataclass

    import click

    from elastic_export.checks import compare
    from elastic_export.ranking import options

    @dataclass
    class Other(options.ElasticConfig):
        targets: tuple[float, ...] = (0.1, 0.2, 0.3)
        loss: str = "kl"
        token_weight: float = 0.5
        steps: int = 7

    modules = [importlib.import_module(f"elastic_export.cli.{m}") for m in ("options", "measure")]
    monkeypatch.setattr(compare, "ATOL", 3e-4)
    monkeypatch.setattr(compare, "FP16_RTOL", 3e-2)
    monkeypatch.setattr(options, "ElasticConfig", Other)
    try:
        cli_options, measure = (importlib.reload(m) for m in modules)
        verify = {p.name: p.default for p in measure.verify_cmd.params}
        ranking = {p.name: p.default for p in click.command()(cli_options.ranking_options(lambda **kw: None)).params}
    finally:
        monkeypatch.undo()
        for m in modules:
            importlib.reload(m)
    assert verify["atol"] == 3e-4 and verify["rtol_fp16"] == 3e-2
    assert ranking["targets"] == "0.1..0.3:0.1" and ranking["loss"] == "kl" and ranking["token_weight"] == 0.5
    assert ranking["steps"] == 7
