"""The docs hold together: README.md and docs/*.md are short where they must be, link only to files
the repository holds, and every code block in them is run by a named test; the reliability table
(docs/reliability.md) names tests that exist."""

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


# --- README.md and docs/ ------------------------------------------------------------------------------
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
QUICK_START = ['pip install -e . && elastic-export --budgets 0.1..0.6',
               'pip install -c constraints.txt -e ".[test]" && python -m pytest']

# Every python, bash and console block, by (page, its first line), and what runs it: tests as
# "file.py::test_name" (python blocks are executed literally; shell blocks' commands are run by
# those tests, on tiny inputs where the block's own would take minutes), or ".ci/run". Any other
# block is ```text (output, layouts, usage synopses) or ```json (an excerpt of a file).
RUN_BY = {
    ("README.md", QUICK_START[0]): [".ci/run", "test_pipeline.py::test_default_run_manifest"],
    ("README.md", 'pip install -e ".[serve]"'): [".ci/run", "test_pipeline.py::test_readme_serve_on_the_default_run"],
    ("README.md", "import httpx"): ["test_pipeline.py::test_readme_serve_on_the_default_run"],
    ("README.md", "from elastic_export.serving.runtime import ElasticRuntime"):
        ["test_pipeline.py::test_docs_runtime_snippet_on_the_default_run"],
    ("docs/evaluation.md", "$ elastic-export --method initial --budgets 0.1..0.6 --out out-initial"):
        ["test_cli_families.py::test_inspect_main_job_and_verify", "test_evaluation.py::test_text_eval_files_and_table",
         "test_evaluation.py::test_heldout_pairs_deterministic_and_sized"],
    ("docs/evaluation.md", "from elastic_export.core import results"):
        ["test_report.py::test_docs_results_snippet_on_eval_and_bench_files"],
    ("docs/large_models.md", "# CPU, 2 processes (gloo): the same ranking as one process with the same --batch-size"):
        ["test_distributed.py::test_torchrun_two_processes_match_one", "test_distributed.py::test_checkpointing_and_bf16",
         "test_pipeline.py::test_reuse_ranking_and_replace_previous_output"],
    ("docs/models.md", "from elastic_export.models.loader import load_encoder"): ["test_hub.py::test_docs_python_snippet_runs"],
    ("docs/models.md", 'hf download sentence-transformers/all-MiniLM-L6-v2 --include "*.json" "*.safetensors" "*.txt"'):
        ["test_hub.py::test_main_job_verify_and_export_st_on_a_hub_id"],
    ("docs/python.md", "from elastic_export.pipeline import Options, run"):
        ["test_pipeline.py::test_docs_python_snippets_on_the_default_run"],
    ("docs/python.md", "import numpy as np"): ["test_pipeline.py::test_docs_python_snippets_on_the_default_run"],
    ("docs/runtime.md", "from elastic_export.serving.runtime import ElasticRuntime, LatencyTargetPolicy, "
                        "LoadAdaptivePolicy, load_profile"):
        ["test_pipeline.py::test_docs_runtime_snippet_on_the_default_run"],
    ("docs/runtime.md", "from elastic_export.serving.runtime import ElasticRuntime, LatencyTargetPolicy, load_profile"):
        ["test_runtime_pairs.py::test_docs_runtime_pairs_snippet"],
    ("docs/sentence_transformers.md", "elastic-export export-st elastic-out --out minilm-st --budgets 0.3"):
        ["test_pipeline.py::test_docs_sentence_transformers_snippets_on_the_default_run"],
    ("docs/sentence_transformers.md", "from sentence_transformers import SentenceTransformer"):
        ["test_pipeline.py::test_docs_sentence_transformers_snippets_on_the_default_run"],
    ("docs/embeddings_api.md", "elastic-export index elastic-out corpus.jsonl"):
        ["test_index.py::test_index_is_torch_free_and_matches_brute_force", "test_index.py::test_hnsw_txt_and_overwrite"],
    ("docs/embeddings_api.md", "import numpy as np"): ["test_http_api.py::test_docs_embeddings_api_snippets_run"],
    ("docs/embeddings_api.md", "from langchain_core.vectorstores import InMemoryVectorStore"):
        ["test_http_api.py::test_docs_embeddings_api_snippets_run"],
    ("docs/embeddings_api.md", "import httpx"): ["test_http_api.py::test_docs_embeddings_api_snippets_run"],
    ("docs/serving.md", 'pip install -e ".[serve]"'): [".ci/run", "test_pipeline.py::test_readme_serve_on_the_default_run"],
    ("docs/serving.md", "import numpy as np, tritonclient.grpc as grpcclient"):
        ["test_triton_server.py::test_docs_serving_python_snippets_run"],
}
# Blocks no test can run, and why: keep this short.
NOT_RUN = {
    ("docs/serving.md", "docker run --rm --gpus all -p 8000:8000 -p 8001:8001 -p 8002:8002 "
                        "-v $PWD/elastic-out/triton:/models \\"):
        "needs Docker, an NGC Triton container and a GPU",
}


def _rel(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _blocks():
    for page in PAGES:
        for m in FENCE.finditer(page.read_text()):
            first = next((line for line in m.group(2).splitlines() if line.strip()), "")
            yield _rel(page), m.group(1).strip(), first.split("  #")[0].rstrip()


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 350, len(lines)


CI = ROOT / ".ci" / "run"
#: a command's position: a line's start, after ``;`` ``&&`` ``||`` ``(`` ``!`` or ``if`` / ``then`` (not in an echo's text)
AT_COMMAND = r"(?:^|[;&|(!]\s*|\b(?:if|then|else|do)\s+)"


def ci_commands(script: str) -> list[str]:
    """The command lines of a shell script: continuation lines joined, comments and echo / printf lines left out."""
    lines = [re.sub(r"(^|\s)#.*", "", line).strip() for line in script.replace("\\\n", " ").splitlines()]
    return [line for line in lines if line and not re.match(r"(echo|printf)\b", line)]


def runs(script: str, command: str) -> list[str]:
    """The command lines of ``script`` that run ``command`` (a regex; an optional ``"$venv/bin/"`` before it)."""
    return [line for line in ci_commands(script) if re.search(AT_COMMAND + r'(?:"?\$\w+/bin/)?' + command, line)]


def test_ci_command_lines_are_commands_not_text():
    script = 'echo "== tests (python -m pytest)"\n# python -m pytest\nx="python -m pytest"\n'
    assert runs(script, "python -m pytest") == []
    script = "(trap '' INT; python -m pytest -ra \\\n  --durations=25)\n\"$plain/bin/python\" -m pytest tests/a.py\n"
    assert runs(script, r"python\"? -m pytest") == ["(trap '' INT; python -m pytest -ra    --durations=25)",
                                                    '"$plain/bin/python" -m pytest tests/a.py']


def test_readme_quick_start_is_what_ci_runs():
    """CI installs and tests the project with the README's own commands: the test extra (pinned by
    constraints.txt) and the whole suite, then the plain install in a second venv and its quick start's tests."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Quick start\n\n```bash\n(.*?)```", readme, re.S).group(1)
    assert [line.split("  #")[0].rstrip() for line in block.splitlines()] == QUICK_START
    ci = CI.read_text()
    assert runs(ci, r'pip install -q -c constraints\.txt -e "\.\[test\]"$'), "CI installs the test extra with the pins"
    assert [line for line in runs(ci, "python -m pytest") if "-ra --strict-markers" in line], "CI runs the suite"
    assert runs(ci, r"python \.ci/check_skips\.py "), "CI checks the skips"
    golden = runs(ci, r"unset ELASTIC_EXPORT_UPDATE_GOLDEN$")
    ci_true = runs(ci, r"export .*\bCI=true\b")
    assert golden and ci_true, "CI neither rewrites the golden file nor lets the golden test do it"
    lines = ci_commands(ci)
    pytest_at = lines.index([line for line in runs(ci, "python -m pytest") if "-ra --strict-markers" in line][0])
    assert lines.index(golden[0]) < pytest_at and lines.index(ci_true[0]) < pytest_at
    assert runs(ci, r'pip"? install -q -e \.(?:\s|$)'), "CI runs the README's plain install"
    plain = runs(ci, r'python"? -m pytest .*tests/test_pipeline\.py::')
    assert plain and all(f"tests/{ref}" in plain[0] for ref in RUN_BY[("README.md", QUICK_START[0])][1:]), plain


def ci_installs(block: str) -> bool:
    """CI runs the block's ``pip install -e SPEC``: the same spec, or ``.[EXTRA]`` through the test extra including it."""
    import tomllib

    spec = re.search(r"pip install -e (\S+)", block).group(1).strip('"')
    installed = [m.strip('"') for line in runs(CI.read_text(), r'pip"? install')
                 for m in re.findall(r'pip"? install (?:-q )?(?:-c \S+ )?-e (\S+)', line)]
    extra = re.fullmatch(r"\.\[(\w+)\]", spec)
    test_extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    return spec in installed or bool(extra and ".[test]" in installed and f"elastic-export[{extra[1]}]" in test_extra)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_relative_links_point_at_files_in_the_repository():
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            assert file.is_relative_to(ROOT) and file.exists(), f"{_rel(page)}: {target}"
            if anchor and file.suffix == ".md":
                headings = re.findall(r"^#+ (.*)$", file.read_text(), flags=re.M)
                assert anchor in {_slug(h) for h in headings}, f"{_rel(page)}: {target}"


def test_no_page_points_outside_the_repository():
    for page in PAGES:
        text = page.read_text()
        for word in ("../shared", "DESIGN.md", "load average", "this machine", "nothing can be downloaded"):
            assert word not in text, f"{_rel(page)}: {word!r}"


def test_every_code_block_is_run_by_a_test():
    seen = set()
    for page, lang, first in _blocks():
        assert lang, f"{page}: a code block without a language ({first!r}): text, json, python, bash or console"
        assert lang in ("text", "json", "python", "bash", "console"), f"{page}: ```{lang}"
        if lang in ("text", "json"):
            continue
        key = (page, first)
        assert key in RUN_BY or key in NOT_RUN, f"{page}: no test runs the {lang} block starting {first!r}"
        seen.add(key)
    assert seen == set(RUN_BY) | set(NOT_RUN), set(RUN_BY) | set(NOT_RUN) - seen
    for (page, first), refs in RUN_BY.items():
        for ref in refs:
            if ref == ".ci/run":
                assert ci_installs(first), f"{page}: .ci/run does not run {first!r}"
                continue
            file, name = ref.split("::")
            assert name in _defined(file), ref


def test_ci_skip_check_allows_only_the_stated_reasons(tmp_path):
    """.ci/check_skips.py passes the TensorRT / GPU skips and fails on any other skip and on an xfail."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_skips", ROOT / ".ci" / "check_skips.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    case = '<testcase classname="tests.t" name="{}"><skipped type="pytest.{}" message="{}">x</skipped></testcase>'
    allowed = case.format("a", "skip", "needs TensorRT and a CUDA GPU (TensorRT engines need the tensorrt package and a "
                          "CUDA GPU: tensorrt is not installed (pip install ...))")
    report = tmp_path / "ok.xml"
    report.write_text(f'<testsuites><testsuite name="pytest">{allowed}<testcase classname="tests.t" name="b"/>'
                      "</testsuite></testsuites>")
    assert check.main([str(report)]) == 0
    others = [case.format("c", "skip", "chromium not found"), case.format("d", "xfail", "flaky"),
              case.format("e", "skip", "could not import 'tritonclient': No module named 'tritonclient'")]
    report.write_text(f'<testsuites><testsuite name="pytest">{allowed}{"".join(others)}</testsuite></testsuites>')
    assert check.main([str(report)]) == 1
    assert [name for name, _, _ in check.unexpected(check.skips(str(report)))] == ["tests.t::c", "tests.t::d", "tests.t::e"]
