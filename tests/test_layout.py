"""The package layout: each stage subpackage imports only from its own or a lower stage (no import back up).

Every import statement counts, the lazy ones inside functions included. The stages, bottom to top,
are :data:`LAYERS`; ``docs/design.md`` describes each.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"elastic_export": ROOT / "elastic_export", "elastic_export.passes": ROOT / "passes",
           "elastic_export.targets": ROOT / "targets"}

# Bottom to top. A module belongs to the longest prefix listed; a module may import its own layer or lower ones.
LAYERS = [
    ["elastic_export.core"],
    ["elastic_export.models"],
    ["elastic_export.data"],
    ["elastic_export.ranking"],
    ["elastic_export.export", "elastic_export.passes"],
    ["elastic_export.targets.onnxruntime", "elastic_export.targets.profiles"],  # onnxruntime sessions
    ["elastic_export.serving"],
    ["elastic_export.index"],  # a dense FAISS index of a corpus, embedded by the runtime
    ["elastic_export.serving.http_api"],  # the OpenAI-style API: the router's client, the index searched
    ["elastic_export.checks"],
    ["elastic_export.precision"],
    ["elastic_export.measure"],
    ["elastic_export.targets"],  # deployment targets: TensorRT, Triton, the runtime's backends
    ["elastic_export.report"],
    ["elastic_export.pipeline"],
    ["elastic_export.cli", "elastic_export.__main__"],
]
FACE = "elastic_export"  # the public face (elastic_export/__init__.py): names entry points, lazily


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def layer(module: str) -> int:
    best, index = "", None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > len(best):
                best, index = p, i
    assert index is not None, f"{module} is in no layer of tests/test_layout.py"
    return index


def imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, imported names) of every absolute import of the project in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names if a.name.startswith(FACE)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith(FACE):
            found.append((node.lineno, node.module, [a.name for a in node.names]))
    return found


def resolve(name: str, known: dict[str, Path]) -> str:
    while name not in known:
        name = name.rpartition(".")[0]
    return name


MODULES = modules()


def test_every_module_has_a_layer():
    for m in MODULES:
        if m != FACE:
            layer(m)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != FACE))
def test_imports_point_down(module):
    here, wrong = layer(module), []
    for line, target, names in imports(MODULES[module]):
        targets = [resolve(f"{target}.{n}", MODULES) for n in names] or [resolve(target, MODULES)]
        for t in targets:
            if t != FACE and t != module and layer(t) > here:
                wrong.append(f"line {line}: {t} (layer {layer(t)} > {here})")
    assert not wrong, f"{module} imports upward: " + "; ".join(wrong)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_name_crosses_modules(module):
    wrong = []
    for line, target, names in imports(MODULES[module]):
        for n in names:
            if n.startswith("_") and not n.startswith("__") and resolve(f"{target}.{n}", MODULES) != module:
                wrong.append(f"line {line}: {target}.{n}")
    assert not wrong, f"{module} imports private names of other modules: " + "; ".join(wrong)


def test_public_face_names_resolve_and_import_light():
    """``import elastic_export`` imports no torch; every name of its face resolves to a real object."""
    import subprocess
    import sys

    code = ("import sys, elastic_export as ee; light = 'torch' not in sys.modules; "
            "names = [n for n in ee.__all__ if getattr(ee, n) is None]; print(light, names)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[0] == "True" and out.stdout.strip().endswith("[]"), out.stdout


def imported_modules(path: Path) -> set[str]:
    """Every project module ``path`` imports, lazy imports inside functions included."""
    found: set[str] = set()
    for _, target, names in imports(path):
        found.update([resolve(f"{target}.{n}", MODULES) for n in names] or [resolve(target, MODULES)])
    return found


def test_no_import_cycle():
    """No module imports one that imports it back (directly or through others), counting every import
    statement: lazy ones inside functions too (a cycle hidden in a function is still a cycle)."""
    graph = {m: imported_modules(p) - {m} for m, p in MODULES.items()}
    done: set[str] = set()

    def cycle_from(m: str, path: list[str]) -> list[str] | None:
        if m in path:
            return path[path.index(m):] + [m]
        if m in done:
            return None
        for n in sorted(graph.get(m, ())):
            found = cycle_from(n, path + [m])
            if found:
                return found
        done.add(m)
        return None

    for m in sorted(graph):
        cycle = cycle_from(m, [])
        assert cycle is None, "import cycle: " + " -> ".join(cycle)


#: the most project modules ``elastic_export/pipeline.py`` may import (issue 23): it orchestrates the
#: stages through their entry points, it does not reach into each stage's modules
PIPELINE_IMPORTS = 15


def test_pipeline_only_orchestrates():
    found = sorted(imported_modules(MODULES["elastic_export.pipeline"]) - {"elastic_export.pipeline"})
    assert len(found) <= PIPELINE_IMPORTS, f"pipeline.py imports {len(found)} project modules: {found}"


def test_import_counts_see_lazy_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from elastic_export.core import errors\n\n\ndef f():\n    from elastic_export.core.budgets import tag\n")
    assert imported_modules(source) == {"elastic_export.core.errors", "elastic_export.core.budgets"}
