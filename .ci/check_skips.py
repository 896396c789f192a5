"""CI's check that nothing went quietly green: every skipped test of a pytest junit XML report has a
stated reason of :data:`ALLOWED` (TensorRT not installed, no CUDA device, a GPU present), and no test is xfailed.

    python .ci/check_skips.py REPORT.xml

Prints every skip with its reason; exits 1 when a skip's reason is not allowed (a missing package,
a missing tool, a version mismatch, anything else: those are failures to fix, not skips).
"""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET

#: the skips a machine may state (tests/test_tensorrt.py, test_cli.py, test_bench.py, test_gpu_scripts.py):
#: TensorRT not installed or no CUDA device visible (targets/tensorrt.py's tensorrt_unavailable), or a
#: CUDA GPU present where a test needs its absence. A TensorRT that is installed but cannot be imported,
#: or lacks the named-tensor API, is a broken install: its skip fails the check.
ALLOWED = (
    r"^needs TensorRT and a CUDA GPU \(TensorRT engines need the tensorrt package and a CUDA GPU: "
    r"tensorrt is not installed \(",
    r"^needs TensorRT and a CUDA GPU \(TensorRT engines need a CUDA GPU: no CUDA device is visible\)$",
    r"^this machine has CUDA, so --device cuda is valid input$",
    r"^this onnxruntime has the CUDA provider$",
    r"^a CUDA GPU is visible here: the refusal cannot happen$",
    r"^an NVIDIA GPU may be present: the check would run$",
)


def skips(path: str) -> list[tuple[str, str, str]]:
    """(test id, kind, message) of every skipped or xfailed test case in the junit XML at ``path``."""
    found = []
    for case in ET.parse(path).getroot().iter("testcase"):
        for node in case.findall("skipped"):
            name = f"{case.get('classname')}::{case.get('name')}"
            kind = "xfail" if node.get("type") == "pytest.xfail" else "skip"
            found.append((name, kind, (node.get("message") or "").strip()))
    return found


def unexpected(found: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """The skips whose reason no pattern of :data:`ALLOWED` matches, and every xfail."""
    return [s for s in found if s[1] == "xfail" or not any(re.search(p, s[2]) for p in ALLOWED)]


def main(argv: list[str]) -> int:
    """Print the skips of the report ``argv[0]``; 1 when one is not allowed."""
    found = skips(argv[0])
    for name, kind, why in found:
        print(f"{kind}: {name}: {why}")
    bad = unexpected(found)
    for name, kind, why in bad:
        print(f"error: {kind} without an allowed TensorRT / GPU reason: {name}: {why}", file=sys.stderr)
    print(f"skip check: {len(found)} skips, {len(bad)} without an allowed reason")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
