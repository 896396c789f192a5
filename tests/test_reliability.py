"""Reliability (issue 6): faults, concurrency, locks, hostile files. Bad command-line input is in
test_cli.py; docs/reliability.md lists every case and the test that shows it."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from conftest import tiny_encoder
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic_export.core.errors import UserError
from elastic_export.core.fileio import OutputLock
from elastic_export.core.manifest import FORMAT, MANIFEST, load_manifest
from elastic_export.data.calibration import load_calibration
from elastic_export.serving.runtime import ElasticRuntime
from elastic_export.targets.onnxruntime import SessionConfig

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
       "PYTHONWARNINGS": "ignore"}
BUDGETS = (0.2, 0.5, 0.8)


def _cli(args: list[str], cwd: Path, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "elastic_export", *args], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=600, **kw)


def _main(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``elastic-export ARGS`` in this process (``cli.main.main``, what the console script calls) in
    ``cwd``, on one torch thread as ``ENV``'s ``OMP_NUM_THREADS=1`` gives :func:`_cli` (the same
    arithmetic, so the same ranking bytes); its exit code, stdout and stderr as :func:`_cli` returns them."""
    import contextlib
    import io

    import torch

    from elastic_export.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    here, threads = os.getcwd(), torch.get_num_threads()
    os.chdir(cwd)
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as done:
            main(list(args))
    finally:
        torch.set_num_threads(threads)
        os.chdir(here)
    return subprocess.CompletedProcess(["elastic-export", *args], done.value.code, out.getvalue(), err.getvalue())


def _one_line_error(r: subprocess.CompletedProcess, *expected: str) -> str:
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr
    assert lines and lines[-1].startswith("error: "), r.stderr
    for e in expected:
        assert e in lines[-1], (e, lines[-1])
    return lines[-1]


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rel") / "tiny-bert"
    tiny_encoder("hf-bert").module.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def art(tmp_path_factory, bert_dir) -> Path:
    from elastic_export import pipeline

    out = tmp_path_factory.mktemp("rel-art") / "out"
    pipeline.run(pipeline.Options(model=str(bert_dir), budgets=BUDGETS, out=str(out), seq_len=16, method="magnitude",
                                  verify=False, report=False, quick_eval=False), echo=lambda s: None)
    return out


# --- locks ----------------------------------------------------------------------------------------
def test_second_writer_to_the_same_out_is_refused(tmp_path, bert_dir, art):
    """While one process holds --out (here: this test, through the same lock), a run is refused
    with exit 2, and neither the previous artifacts nor the lock are touched."""
    out = tmp_path / "out"
    import shutil

    shutil.copytree(art, out)
    before = _snapshot(out)
    with OutputLock(out) as lock:
        assert lock.held and lock.lock_path.read_text() == str(os.getpid())
        r = _cli(["--model", str(bert_dir), "--budgets", "0.5", "--seq-len", "16", "--method", "magnitude",
                  "--no-verify", "--out", "out"], tmp_path)
        _one_line_error(r, "another elastic-export process", f"pid {os.getpid()}", "--out")
        assert _snapshot(out) == before
        assert lock.held
    assert not lock.lock_path.exists()  # released and removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_lock_of_a_killed_process_is_released(tmp_path):
    out = tmp_path / "out"
    code = ("import sys, time; from elastic_export.core.fileio import OutputLock; "
            f"l = OutputLock({str(out)!r}); l.acquire(); print('held', flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        assert p.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match=f"pid {p.pid}"):
            OutputLock(out).acquire()
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
        lock = OutputLock(out)
        assert lock.acquire() and lock.held  # the kernel dropped the dead process's lock
        lock.release()
    finally:
        p.kill()
        p.wait()


def test_lock_waits_for_the_parent_directory(tmp_path):
    lock = OutputLock(tmp_path / "missing" / "out")
    assert lock.acquire() is False and not lock.held
    (tmp_path / "missing").mkdir()
    assert lock.acquire() is True
    lock.release()
    assert list((tmp_path / "missing").iterdir()) == []


# --- faults: a killed ranking resumes to the identical file ------------------------------------
# --ranking-compute fp32: the processes compared byte for byte run the same arithmetic on any CPU
# (`auto` picks bf16 products only where the CPU has them)
RANK = ["rank", "--seq-len", "16", "--calib-size", "16", "--batch-size", "4", "--steps", "48",
        "--targets-per-step", "2", "--ranking-compute", "fp32"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, bert_dir) -> bytes:
    """The ranking of an uninterrupted run; ``--resume`` with no checkpoint says it starts from scratch."""
    root = tmp_path_factory.mktemp("rank-full")
    r = _main([*RANK, "--model", str(bert_dir), "--out", "r.safetensors", "--resume"], root)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--resume: no checkpoint at r.safetensors.checkpoint; ranking from scratch" in r.stderr
    return (root / "r.safetensors").read_bytes()


# The CLI, run so that it holds (sleeps) right after writing its first checkpoint: the signal then
# always arrives mid-ranking, however fast the machine (the run cannot finish first).
_HOLD_AFTER_CHECKPOINT = """
import runpy, sys, time
import elastic_export.ranking.soft_ranking as sr
_save = sr._save_checkpoint
def _save_and_hold(*a, **k):
    _save(*a, **k)
    time.sleep(600)
sr._save_checkpoint = _save_and_hold
sys.argv = ["elastic-export", *sys.argv[1:]]
runpy.run_module("elastic_export", run_name="__main__")
"""


def _default_sigint() -> None:
    """In the child before exec: SIGINT back to its default action. A parent that ignores SIGINT
    (a non-interactive shell's background job, such as a CI runner) passes "ignore" on to its
    children, and the product rightly keeps a disposition its parent chose; the test must not
    depend on how pytest was launched."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _ignores_sigint(pid: int) -> bool:
    """Whether process ``pid`` ignores SIGINT (the SigIgn mask of /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGINT - 1)))
    raise AssertionError(f"no SigIgn line for pid {pid}")  # pragma: no cover


def test_sigint_reset_works_under_an_ignoring_parent():
    """The reset above is effective even when this process itself ignores SIGINT."""
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        inherited = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        reset = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], preexec_fn=_default_sigint)
    finally:
        signal.signal(signal.SIGINT, old)
    try:
        assert _ignores_sigint(inherited.pid) and not _ignores_sigint(reset.pid)
    finally:
        for p in (inherited, reset):
            p.kill()
            p.wait()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def test_killed_ranking_resumes_to_the_identical_ranking(tmp_path, bert_dir, uninterrupted, sig):
    ckpt = tmp_path / "r.safetensors.checkpoint"
    p = subprocess.Popen([sys.executable, "-c", _HOLD_AFTER_CHECKPOINT, *RANK, "--model", str(bert_dir),
                          "--out", "r.safetensors"], cwd=tmp_path, env=ENV, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint)
    try:
        assert not _ignores_sigint(p.pid), "the child inherited an ignored SIGINT"
        deadline = time.time() + 300
        while not ckpt.exists() and p.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert ckpt.exists(), "no checkpoint was written before the run ended"
        p.send_signal(sig)
        _, err = p.communicate(timeout=120)
    finally:
        p.kill()
    if p.returncode == 0:
        pytest.fail("the ranking finished before the signal arrived")  # pragma: no cover
    if sig == signal.SIGINT:  # the last line says how to go on
        assert p.returncode == 130 and "Traceback" not in err
        assert err.strip().splitlines()[-1] == (
            "interrupted; the ranking checkpoint r.safetensors.checkpoint holds step 8 of 48: "
            "run the same command again with --resume to continue from it")
    assert not (tmp_path / "r.safetensors").exists()  # nothing half-written
    r = _main([*RANK, "--model", str(bert_dir), "--out", "r.safetensors", "--resume"], tmp_path)  # resumed here
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--resume: continuing the ranking from step 8 of 48 (checkpoint r.safetensors.checkpoint)" in r.stderr
    assert (tmp_path / "r.safetensors").read_bytes() == uninterrupted


# --- concurrency: 8 threads, 10,000 requests, random switches -------------------------------------
def _random_feeds(rng: np.random.Generator) -> dict[str, np.ndarray]:
    batch, tokens = int(rng.integers(1, 4)), int(rng.integers(2, 17))
    ids = rng.integers(1, 500, size=(batch, tokens)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[:, int(rng.integers(1, tokens + 1)):] = 0
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}


def test_runtime_serves_10000_requests_from_8_threads_exactly(art):
    """Every request, at its own or at the current (switching) budget, gets exactly what its
    budget's ONNX file alone returns for that input."""
    m = json.loads((art / MANIFEST).read_text())
    files = {0.0: m["dense"]["onnx"], **{b["sparsity"]: b["onnx"] for b in m["budgets"]}}
    rng = np.random.default_rng(0)
    pool = [_random_feeds(rng) for _ in range(24)]
    alone = {}
    for s, f in files.items():
        sess = ort.InferenceSession(str(art / f), providers=["CPUExecutionProvider"])
        alone[s] = [sess.run(None, feeds) for feeds in pool]
    rt = ElasticRuntime.from_dir(art, config=SessionConfig(threads=1))
    sparsities = rt.sparsities
    errors: list[str] = []
    served = {s: 0 for s in sparsities}
    count = threading.Lock()
    stop = threading.Event()

    def worker(seed: int, n: int) -> None:
        r = random.Random(seed)
        for _ in range(n):
            i = r.randrange(len(pool))
            asked = r.choice([None, *sparsities])
            s, got = rt.serve(pool[i], sparsity=asked)
            if asked is not None and s != asked:
                errors.append(f"asked {asked}, served {s}")
            want = alone[s][i]
            if any(not np.array_equal(a, b) for a, b in zip(got.values(), want)):
                errors.append(f"request {i} at sparsity {s} differs from its ONNX file")
            with count:
                served[s] += 1

    def switcher() -> None:
        r = random.Random(99)
        while not stop.is_set():
            rt.set_budget(r.choice(sparsities))
            time.sleep(0.0005)

    threads = [threading.Thread(target=worker, args=(k, 1250)) for k in range(8)]
    sw = threading.Thread(target=switcher)
    sw.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    sw.join()
    assert errors == [], errors[:5]
    assert sum(served.values()) == 10_000
    assert all(v > 500 for v in served.values()), served


# --- calibration data ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def text_enc():
    return tiny_encoder("hf-bert")


@pytest.fixture(scope="module")
def image_enc():
    return tiny_encoder("timm-vit")


def test_calibration_empty_text_file(tmp_path, text_enc):
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(UserError, match="no text found"):
        load_calibration(text_enc, str(tmp_path / "empty.txt"), size=8, batch_size=4)


def test_calibration_unreadable_text_file(tmp_path, text_enc):
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00\x81" * 50)
    with pytest.raises(UserError, match="not UTF-8"):
        load_calibration(text_enc, str(tmp_path / "bin.txt"), size=8, batch_size=4)
    if os.geteuid() != 0:  # root reads anything
        (tmp_path / "locked.txt").write_text("text\n")
        os.chmod(tmp_path / "locked.txt", 0)
        with pytest.raises(UserError, match="unreadable"):
            load_calibration(text_enc, str(tmp_path / "locked.txt"), size=8, batch_size=4)


def test_calibration_wrong_modality(tmp_path, text_enc, image_enc):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "t.txt").write_text("a sentence\n")
    with pytest.raises(UserError, match="text models take"):
        load_calibration(text_enc, str(tmp_path / "imgs"), size=8, batch_size=4)
    with pytest.raises(UserError, match="image models take a directory"):
        load_calibration(image_enc, str(tmp_path / "t.txt"), size=8, batch_size=4)


def test_calibration_images_that_fail_to_decode(tmp_path, image_enc):
    from PIL import Image

    d = tmp_path / "imgs"
    d.mkdir()
    for i in range(3):
        Image.fromarray(np.full((40, 40, 3), 60 * i, dtype=np.uint8)).save(d / f"ok{i}.png")
    (d / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 this is not a jpeg")
    (d / "truncated.png").write_bytes((d / "ok0.png").read_bytes()[:40])
    cal = load_calibration(image_enc, str(d), size=8, batch_size=2)
    assert cal.description["samples"] == 3
    assert cal.description["failed_to_decode"] == 2  # skipped with a count
    for f in d.glob("ok*.png"):
        f.unlink()
    with pytest.raises(UserError, match="none of the images could be decoded"):
        load_calibration(image_enc, str(d), size=8, batch_size=2)


# --- hostile files: property-based -------------------------------------------------------------
_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                     max_leaves=20)
_path = st.one_of(st.none(), st.integers(), st.sampled_from(["dense.onnx", "../x.onnx", "/etc/passwd", "", "a\x00b",
                                                             "sub/../../x", "ok.onnx", "."]), st.text(max_size=12))
_budget = st.fixed_dictionaries({"sparsity": st.one_of(st.floats(), st.integers(), st.booleans(), st.none()),
                                 "onnx": _path}, optional={"heads_per_layer": _json, "engine": _path,
                                                           "onnx_fp16": _path, "neurons_per_layer": _json})
_manifest = st.fixed_dictionaries(
    {"format": st.sampled_from([FORMAT, "other/1", 3])},
    optional={"model": _json | st.just({}), "inputs": _json | st.just([{"name": "x"}]), "outputs": _json,
              "dense": st.fixed_dictionaries({"onnx": _path}) | _json, "budgets": st.lists(_budget, max_size=3) | _json,
              "ranking": st.fixed_dictionaries({"file": _path}) | _json,
              "elastic": _json | st.fixed_dictionaries({"onnx": _path}),
              "triton": _json | st.fixed_dictionaries({"dir": _path})})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(manifest=_manifest)
def test_manifest_loader_accepts_or_refuses_cleanly(tmp_path, manifest):
    """Any JSON: load_manifest returns a manifest whose paths all stay inside the directory, or
    raises UserError; never another exception."""
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    try:
        m = load_manifest(tmp_path)
    except UserError as e:
        assert "\n" not in str(e)
        return
    root = tmp_path.resolve()
    rels = [m["dense"]["onnx"], *(b["onnx"] for b in m["budgets"])]
    for rel in rels:
        p = (root / rel).resolve()
        assert p == root or root in p.parents
    assert all(0 <= b["sparsity"] < 1 for b in m["budgets"])


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=300))
def test_manifest_loader_on_random_bytes(tmp_path, raw):
    (tmp_path / MANIFEST).write_bytes(raw)
    with pytest.raises(UserError):
        load_manifest(tmp_path)


# --- bad files on the command line --------------------------------------------------------------
def _copy(art: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(art, dst)
    return dst


def test_truncated_ranking_file_is_refused(tmp_path, bert_dir, art):
    raw = (art / "ranking.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(raw[: len(raw) // 2])
    before = _snapshot(tmp_path)
    r = _main(["--model", str(bert_dir), "--budgets", "0.5", "--seq-len", "16", "--no-verify",
               "--ranking", "cut.safetensors", "--out", "out"], tmp_path)
    _one_line_error(r, "cut.safetensors")
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("which", ["dense.onnx", "budget_s050.onnx"])
def test_truncated_onnx_is_refused_by_verify(tmp_path, art, which):
    d = _copy(art, tmp_path / "art")
    raw = (d / which).read_bytes()
    (d / which).write_bytes(raw[: len(raw) // 3])
    before = _snapshot(d)
    r = _cli(["verify", "art", "--no-torch"], tmp_path)
    _one_line_error(r, which)
    assert _snapshot(d) == before


def test_manifest_path_leaving_the_directory_is_refused(tmp_path, art):
    d = _copy(art, tmp_path / "art")
    m = json.loads((d / MANIFEST).read_text())
    m["budgets"][0]["onnx"] = "../../etc/passwd"
    (d / MANIFEST).write_text(json.dumps(m))
    before = _snapshot(tmp_path)
    for args in (["verify", "art", "--no-torch"], ["bench", "art", "--batches", "1", "--repeats", "1"]):
        r = _cli(args, tmp_path)
        _one_line_error(r, "leaves the artifact directory")
    assert _snapshot(tmp_path) == before


def test_unwritable_output_location_is_refused(tmp_path, bert_dir):
    if os.geteuid() == 0:
        out = "/sys/elastic-export-out"  # sysfs: not writable even for root
    else:
        (tmp_path / "ro").mkdir()
        os.chmod(tmp_path / "ro", 0o555)
        out = str(tmp_path / "ro" / "out")
    r = _main(["--model", str(bert_dir), "--budgets", "0.5", "--seq-len", "16", "--method", "magnitude",
               "--no-verify", "--out", out], tmp_path)
    _one_line_error(r, out)
    assert not Path(out).exists()


def test_main_job_under_torchrun_is_refused(tmp_path, bert_dir, monkeypatch):
    """Only `rank` is distributed; the main job under torchrun would run once per process."""
    for name, value in (("WORLD_SIZE", "2"), ("RANK", "0"), ("LOCAL_RANK", "0")):  # what torchrun sets
        monkeypatch.setenv(name, value)
    r = _main(["--model", str(bert_dir), "--budgets", "0.5", "--out", "out"], tmp_path)
    _one_line_error(r, "torchrun", "rank")
    assert list(tmp_path.iterdir()) == []


# --- security -------------------------------------------------------------------------------------
def test_model_code_is_not_run_without_trust_remote_code(tmp_path):
    from elastic_export.models.loader import load_encoder

    d = tmp_path / "custom"
    d.mkdir()
    marker = tmp_path / "code-ran"
    (d / "config.json").write_text(json.dumps({
        "model_type": "elastic-export-custom", "architectures": ["CustomModel"],
        "auto_map": {"AutoConfig": "custom_code.CustomConfig", "AutoModel": "custom_code.CustomModel"}}))
    (d / "custom_code.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                                      "from transformers import PretrainedConfig\n"
                                      "class CustomConfig(PretrainedConfig):\n    model_type = 'elastic-export-custom'\n")
    (d / "model.safetensors").write_bytes(b"")
    with pytest.raises(UserError, match="--trust-remote-code"):
        load_encoder(str(d))
    assert not marker.exists()


def _package_sources() -> list[Path]:
    root = Path(__file__).resolve().parents[1]
    return [p for d in ("elastic_export", "passes", "targets") for p in (root / d).rglob("*.py")]


def test_no_unsafe_loaders_or_shell_commands_in_the_package():
    """Weights and rankings load through safetensors (or weights_only); nothing runs a shell."""
    import re

    bad = re.compile(r"\btorch\.load\((?![^)]*weights_only=True)|\bpickle\.loads?\(|\bshell=True|\bos\.system\(|"
                     r"\bos\.popen\(|(?<![.\w])eval\(|(?<![.\w])exec\(|\bnp\.load\([^)]*allow_pickle=True")
    hits = [f"{p.name}:{i}: {line.strip()}" for p in _package_sources()
            for i, line in enumerate(p.read_text().splitlines(), 1) if bad.search(line)]
    assert hits == []
    assert len(_package_sources()) > 20


def test_killed_export_leaves_the_previous_artifacts(tmp_path, bert_dir, art):
    """SIGKILL during the export (its temporary directory exists): --out is untouched; the next
    run removes the dead run's temporary directory and completes."""
    out = _copy(art, tmp_path / "out")
    before = _snapshot(out)
    args = ["--model", str(bert_dir), "--budgets", "0.3,0.6", "--seq-len", "16", "--method", "magnitude",
            "--no-quick-eval", "--no-report", "--out", "out"]
    p = subprocess.Popen([sys.executable, "-m", "elastic_export", *args], cwd=tmp_path, env=ENV,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while not list(tmp_path.glob(".out.tmp-*")) and p.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        assert list(tmp_path.glob(".out.tmp-*")), "the run ended before its temporary directory appeared"
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
    finally:
        p.kill()
    assert _snapshot(out) == before
    r = _main(args, tmp_path)  # the next run (here: in this process)
    assert r.returncode == 0, r.stderr[-2000:]
    assert [b["sparsity"] for b in json.loads((out / MANIFEST).read_text())["budgets"]] == [0.3, 0.6]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_killed_while_replacing_restores_the_previous_set(tmp_path, art):
    """Killed between moving the previous set aside and moving the new one in: the next run under
    the lock puts the previous set back before anything else."""
    from elastic_export.core.outdir import clean_stale

    _copy(art, tmp_path / ".out.old-12345")
    (tmp_path / ".out.tmp-abc").mkdir()
    before = _snapshot(tmp_path / ".out.old-12345")
    clean_stale(tmp_path / "out", echo=lambda s: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert _snapshot(tmp_path / "out") == before


@pytest.mark.parametrize("out", [".", "..", "./", "sub/.."])
def test_out_that_is_the_working_directory_is_refused(tmp_path, monkeypatch, out):
    from elastic_export.core.outdir import prepare_out

    (tmp_path / "sub").mkdir()
    (tmp_path / "mine.txt").write_text("x")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="a directory of its own"):
        prepare_out(Path(out), overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt", "sub"]
