"""The reliability table (docs/reliability.md) names tests that exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"


def _defined(file: str) -> set[str]:
    return set(re.findall(r"^def (test_\w+)", (TESTS / file).read_text(), flags=re.M))


def test_reliability_table_names_existing_tests():
    doc = (ROOT / "docs" / "reliability.md").read_text()
    rows = [line for line in doc.splitlines() if line.startswith("| ") and not line.startswith("| case")]
    assert len(rows) >= 35
    refs = 0
    for row in rows:
        cells = row.split("|")[1:-1]
        assert len(cells) == 3, row
        test_cell = cells[2]
        current = None
        for m in re.finditer(r"`(test_\w+\.py)?(?:::(test_\w+)(\*)?(?:\[([^\]]*)\])?)?`", test_cell):
            file, name, star, params = m.groups()
            if file:
                assert (TESTS / file).is_file(), file
                current = file
            if name:
                assert current, row
                defined = _defined(current)
                ok = any(d.startswith(name) for d in defined) if star else name in defined
                assert ok, f"{current}::{name} (row: {cells[0].strip()})"
                refs += 1
        assert current, f"row without a test: {cells[0].strip()}"
    assert refs >= 40
