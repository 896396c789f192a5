"""``elastic-export report DIR`` and the report the main job writes: a tiny BERT exported by the real
pipeline, evaluated, benchmarked and ranked a second way, its page rendered in headless Chromium
(driven through the DevTools protocol over ``--remote-debugging-pipe``: no extra dependency)."""

from __future__ import annotations

import base64
import html
import json
import re
import shutil
import struct
from pathlib import Path

import pytest
from _devtools import DevTools, find_chromium

from elastic_export import pipeline
from elastic_export.cli.main import main
from elastic_export.core import results
from elastic_export.data.retrieval_data import heldout_pairs, write_pairs_jsonl
from elastic_export.models.loader import default_model_path
from elastic_export.report.page import REPORT, render_report, write_report

QUIET = dict(echo=lambda s: None)
BUDGETS = (0.3, 0.6)
SECTIONS = ("budgets", "recommend", "quality", "sparsity", "speed", "frontier", "provenance")


def cli(args: list[str], capsys) -> tuple[int, str, str]:
    """Run the console entry point in-process: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exit_:
        main(args)
    captured = capsys.readouterr()
    return exit_.value.code, captured.out, captured.err


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("report")


@pytest.fixture(scope="module")
def model(work) -> Path:
    """A tiny sentence-transformers BERT with MiniLM's tokenizer (so ``eval`` can run on it)."""
    import torch
    from conftest import _perturb
    from transformers import BertConfig, BertModel

    path = work / "bert"
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64)
    _perturb(BertModel(cfg, add_pooling_layer=False), seed=1).save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(default_model_path() / f, path / f)
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True}))
    return path


@pytest.fixture(scope="module")
def exported(work, model) -> tuple[Path, Path]:
    """The main job twice (magnitude and random rankings); only the main job has run on them."""
    dirs = []
    for method in ("magnitude", "random"):
        out = work / method
        pipeline.run(pipeline.Options(model=str(model), method=method, budgets=BUDGETS, out=str(out), seq_len=16,
                                      elastic_graph=method == "magnitude"), **QUIET)
        dirs.append(out)
    return dirs[0], dirs[1]


@pytest.fixture(scope="module")
def full(work, exported) -> Path:
    """The magnitude directory with everything a report shows: eval results of both directories
    (``eval`` without ``--out``: DIR/eval.json), bench.json, and the random ranking as a second
    ranking file; report re-rendered by the CLI."""
    main_dir, other = exported
    pairs = write_pairs_jsonl(work / "pairs.jsonl", heldout_pairs(n=32))
    shutil.copy(other / "ranking.safetensors", main_dir / "ranking_random.safetensors")
    for args in (["eval", str(main_dir), str(other), "--pairs", str(pairs)],
                 ["bench", str(main_dir), "--batches", "1,2", "--repeats", "2", "--warmup", "0"],
                 ["report", str(main_dir)]):
        with pytest.raises(SystemExit) as e:
            main(args)
        assert e.value.code == 0, args
    return main_dir


def _images(page: str) -> list[bytes]:
    srcs = re.findall(r'<img [^>]*src="([^"]+)"', page)
    assert all(s.startswith("data:image/png;base64,") for s in srcs), [s[:40] for s in srcs]
    return [base64.b64decode(s.split(",", 1)[1]) for s in srcs]


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


# --- the main job -------------------------------------------------------------------------------
def test_main_job_writes_the_report(exported):
    d, _ = exported
    page = (d / REPORT).read_text()
    m = json.loads((d / "manifest.json").read_text())
    assert isinstance(m["ranking"]["seconds"], float)
    for anchor in SECTIONS:
        assert f'<section id="{anchor}">' in page
    # a fresh directory has no eval or bench results yet: the main job's quick eval stands in
    assert 'class="absent"' not in page and "could not be drawn" not in page
    assert len(_images(page)) == 4  # quality vs GFLOPs, where sparsity goes, speed, the frontier
    for anchor in ("quality", "speed"):
        assert "manifest.json (quick eval)" in page.split(f'<section id="{anchor}">')[1].split("</section>")[0]
    frontier = page.split('<section id="frontier">')[1].split("</section>")[0]
    assert "Pareto frontier" in frontier and "recall@10" not in frontier.split("<img")[0]
    for b in m["budgets"]:
        assert b["onnx"] in page
    assert not [p for p in d.parent.iterdir() if p.name.startswith(".")]  # no temp dir left


def _section(page: str, anchor: str) -> str:
    return page.split(f'<section id="{anchor}">')[1].split("</section>")[0]


def _text(page: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", " ", re.sub(r'<img [^>]*>', "", page)))


def test_fresh_report_names_the_quick_eval_honestly(exported):
    d, _ = exported
    page = (d / REPORT).read_text()
    text = _text(page)
    assert "neighbour overlap@10 (vs dense)" in text and "retrieval recall@10 (dense index)" not in text
    assert "recall@10" not in text  # the overlap is never called recall
    quality = _section(page, "quality")
    assert f'<td class="l">{d}</td>' in quality and '<td class="l">.</td>' not in quality  # the directory, not "."
    assert "(n = 64)" in quality and re.search(r"\[\d\.\d{4}, \d\.\d{4}\]", quality)  # sample size and band
    speed = _text(_section(page, "speed"))
    assert "None" not in speed and re.search(r"Machine: .+, \d+ logical CPUs \(load average [\d.]+", speed)
    assert re.search(r"timed runs per point: \d+ at batch 1, \d+ at batch 8 \(interleaved rounds\)", speed)
    rec = _text(_section(page, "recommend"))
    assert "fastest pair within 1 % of dense quality" in rec and "best quality under" in rec
    assert "elastic-export eval DIR" in rec  # the proxy says how to get task quality


def test_render_failure_keeps_artifacts(work, model, monkeypatch):
    import elastic_export.report.page as report

    def broken(*args, **kw):
        raise RuntimeError("renderer exploded")

    monkeypatch.setattr(report, "render_report", broken)
    out, said = work / "broken", []
    m = pipeline.run(pipeline.Options(model=str(model), method="magnitude", budgets=(0.5,), out=str(out), seq_len=16,
                                      verify=False, elastic_graph=False), echo=said.append)
    assert not (out / REPORT).exists()
    assert sorted(p.name for p in out.iterdir()) == ["budget_s050.onnx", "dense.onnx", "latency_profile.json",
                                                     "manifest.json", "ranking.safetensors", "tokenizer"]
    assert m.budgets[0].onnx == "budget_s050.onnx"
    assert any("report.html not written" in s and "renderer exploded" in s for s in said)


def test_cli_no_report_flag(work, model, capsys):
    out = work / "cli-no-report"
    code, stdout, _ = cli(["--model", str(model), "--budgets", "0.5", "--method", "magnitude", "--seq-len", "16",
                           "--no-verify", "--no-elastic-graph", "--no-report", "--out", str(out)], capsys)
    assert code == 0 and not (out / REPORT).exists() and "report.html" not in stdout
    out = work / "cli-report"
    code, stdout, _ = cli(["--model", str(model), "--budgets", "0.5", "--method", "magnitude", "--seq-len", "16",
                           "--no-verify", "--no-elastic-graph", "--out", str(out)], capsys)
    assert code == 0 and (out / REPORT).is_file()
    assert stdout.strip().splitlines()[-1] == f"wrote {out / REPORT}"


# --- every section with data --------------------------------------------------------------------
def test_full_report_has_every_section(full):
    page = (full / REPORT).read_text()
    assert 'class="absent"' not in page and "could not be drawn" not in page
    for anchor in SECTIONS:
        assert f'<section id="{anchor}">' in page
    images = _images(page)
    assert len(images) == 4  # quality, where sparsity goes, speed, the frontier
    assert all(w > 100 and h > 100 for w, h in map(_png_size, images))
    assert not re.search(r"(src|href)=\"(https?:)?//", page)  # nothing from the network
    assert "default-src 'none'" in page
    # both rankings side by side, both eval curves, the bench table, the provenance
    sparsity = page.split('<section id="sparsity">')[1].split("</section>")[0]
    assert "ranking_random.safetensors" in sparsity and "ranking.safetensors" in sparsity
    quality = page.split('<section id="quality">')[1].split("</section>")[0]
    assert "eval.json" in quality and "magnitude" in quality and "random" in quality
    speed = page.split('<section id="speed">')[1].split("</section>")[0]
    assert "bench.json" in speed and "inputs/s" in speed
    prov = page.split('<section id="provenance">')[1].split("</section>")[0]
    assert prov.count("<h3>") == 2 and "time taken" in prov and "calibration data" in prov
    assert re.search(r"<dd>\d+\.\d s</dd>", prov)  # the main job recorded how long ranking took


def test_full_report_recommends_from_eval_and_bench(full):
    from elastic_export.measure.frontier import recommend

    page = (full / REPORT).read_text()
    rec = _section(page, "recommend")
    assert "Quality from eval.json, speed from bench.json" in rec and "retrieval recall@10 (dense index)" in rec
    assert "n = 32" in rec and "elastic-export eval DIR" not in rec  # task quality, no proxy note
    ev, bench = results.load(full / "eval.json").eval_view(), results.load(full / "bench.json").bench_view()
    own = ev["results"][0]
    assert own["dir"] == str(full)  # the directory's own result first: the one the frontier reads
    quality = {(b["sparsity"], b["precision"]): b["recall@10"] for b in own["budgets"]}
    cells = re.findall(r"<tr><td class=\"l\">([^<]+)</td><td>(\d+)</td><td class=\"l\">(?:<b>)?([^<]+)", rec)
    assert len(cells) == 8  # 2 floors + 2 targets, at batch 1 and batch 2
    for batch in (1, 2):
        cost = {(r["sparsity"], r["precision"]): r["p50_ms"] for r in bench["rows"] if r["batch"] == batch}
        want = recommend(cost, quality)
        got = [c for c in cells if c[1] == str(batch)]
        for r, (goal, _, pick) in zip(want, got):
            assert (r.kind == "quality") == goal.startswith("fastest pair within")
            name = "none" if r.pair is None else f"{'dense' if r.pair[0] == 0.0 else f'{r.pair[0]:g}'} {r.pair[1]}"
            assert pick.startswith(name), (goal, pick, r)
    text = _text(page)
    assert "retrieval recall@10 (dense index)" in _text(_section(page, "quality"))
    assert "neighbour overlap@10" not in text  # eval results in DIR: the quick eval is not shown
    assert not re.search(r"(?<!retrieval )recall@10", text.replace("sym_recall@10", ""))


def test_absent_and_broken_data_do_not_fail(full, tmp_path, capsys):
    d = tmp_path / "copy"
    shutil.copytree(full, d)
    (d / "eval.json").write_text('{"results": [{"budgets": [{"gflops": "many"}]}]}')
    (d / "bench.json").unlink()
    (d / "broken.json").write_text("{not json")
    (d / "ranking_random.safetensors").write_bytes(b"not a ranking")
    (d / "ranking.safetensors").unlink()
    code, stdout, _ = cli(["report", str(d), "--out", str(tmp_path / "r.html")], capsys)
    assert code == 0 and stdout.strip() == f"wrote {tmp_path / 'r.html'}"
    page = (tmp_path / "r.html").read_text()
    assert "Evaluation results were found but hold no metric" in page
    assert "manifest.json (quick eval)" in page.split('<section id="speed">')[1]  # the quick eval stands in
    assert "Needs quality and speed figures" in page  # the frontier: the eval result holds no metric
    assert "No readable ranking file" in page and "ranking.safetensors is missing" in page
    assert "broken.json" in page and "ranking_random.safetensors: skipped" in page
    assert "could not be drawn" not in page


def test_ranking_of_another_model_is_skipped(full, tmp_path):
    from elastic_export.ranking.file import load_ranking, save_ranking

    d = tmp_path / "copy"
    shutil.copytree(full, d)
    other = load_ranking(d / "ranking_random.safetensors")
    other.meta["fingerprint"] = "sha256:another"
    save_ranking(other, d / "ranking_random.safetensors")
    page = render_report(d)
    assert "ranking_random.safetensors: skipped (it was made for another model)" in page
    assert len(_images(page)) == 4  # the directory's own ranking is still drawn (and quality, speed, frontier)


@pytest.mark.parametrize("args, words", [
    (["report", "/nonexistent/dir"], "no such directory"),
    (["report", "."], "no manifest.json"),
])
def test_cli_bad_input_exits_2_with_one_line(args, words, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(args, capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and words in err


def test_write_report_out_is_a_directory(full, tmp_path):
    from elastic_export.core.errors import UserError

    with pytest.raises(UserError, match="is a directory"):
        write_report(full, out=tmp_path)


# --- in a real browser --------------------------------------------------------------------------
def _chromium() -> str:
    if find_chromium():
        return find_chromium()
    pytest.skip("chromium not found (Debian: apt-get install -y chromium; .ci/run installs it)")


def test_report_in_headless_chromium(full, tmp_path):
    browser = DevTools(_chromium(), tmp_path)
    try:
        target = browser.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = browser.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Runtime", "Log", "Page", "Network"):
            browser.call(f"{domain}.enable", session=session)
        browser.call("Page.navigate", {"url": (full / REPORT).resolve().as_uri()}, session)
        browser.wait_for("Page.loadEventFired")
        js = ("JSON.stringify({title: document.title, sections: document.querySelectorAll('section').length,"
              " images: [...document.images].map(i => [i.complete, i.naturalWidth, i.naturalHeight])})")
        state = json.loads(browser.call("Runtime.evaluate", {"expression": js, "returnByValue": True},
                                        session)["result"]["value"])
    finally:
        browser.close()
    events = [e for e in browser.events if e.get("sessionId") == session]
    errors = [e["params"] for e in events
              if (e.get("method") == "Runtime.consoleAPICalled" and e["params"]["type"] in ("error", "assert"))
              or e.get("method") == "Runtime.exceptionThrown"
              or (e.get("method") == "Log.entryAdded" and e["params"]["entry"]["level"] == "error")]
    assert errors == []
    requests = [e["params"]["request"]["url"] for e in events if e.get("method") == "Network.requestWillBeSent"]
    assert requests and all(u.startswith(("file:", "data:image/png;base64,")) for u in requests)
    assert [u for u in requests if u.startswith("file:")] == [(full / REPORT).resolve().as_uri()]
    assert state["title"].startswith("elastic-export report") and state["sections"] == len(SECTIONS)
    assert len(state["images"]) == 4  # quality, where sparsity goes, speed, the frontier
    assert all(done and w > 0 and h > 0 for done, w, h in state["images"]), state["images"]


def test_docs_results_snippet_on_eval_and_bench_files(full, tmp_path, monkeypatch):
    """docs/evaluation.md "Results files": its snippet, literally, on a directory with eval.json and bench.json."""
    doc = (Path(__file__).parents[1] / "docs" / "evaluation.md").read_text()
    snippet = re.findall(r"```python\n(.*?)```", doc.split("## Results files", 1)[1], re.S)[0]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "elastic-out").symlink_to(full)
    ns: dict = {}
    exec(compile(snippet, "docs/evaluation.md", "exec"), ns)
    assert ns["res"].kind == "eval" and ns["speed"].kind == "bench" and ns["best"]["sparsity"] > 0
    ns["policy"].bind_pairs(sorted({(r["sparsity"], r["precision"]) for r in ns["speed"].speed()}), "fp32")
    assert ns["policy"].select(1) in {(r["sparsity"], r["precision"]) for r in ns["speed"].speed()}
