"""``elastic-export index DIR CORPUS``: the FAISS index of a corpus embedded with the dense model (torch-free),
its top-10 equal to a brute-force search with the runtime's embeddings, every bad corpus refused with one
line and exit code 2 and nothing written, never a half-written ``DIR/index/``."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from _helpers import ENV, link_copy

from elastic_export.cli.main import main
from elastic_export.core.manifest import MANIFEST

WORDS = ("apple banana river mountain code python file open network server model budget index query search "
         "quantum cat dog music piano train winter summer glass stone light shadow engine garden").split()


def corpus_docs(n: int = 300, seed: int = 0) -> list[dict]:
    """``n`` distinct generated documents with ids ``d0`` ..."""
    rng = random.Random(seed)
    seen: set[str] = set()
    docs = []
    while len(docs) < n:
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 24)))
        if text not in seen:
            seen.add(text)
            docs.append({"id": f"d{len(docs)}", "text": text})
    return docs


def write_jsonl(path: Path, docs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return path


def brute_force(rt, texts: list[str], queries: list[str], k: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """(positions, scores) of the top ``k`` documents by cosine, with the dense runtime's embeddings."""
    def unit(x):
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    docs, q = unit(rt.encode(texts, sparsity=0.0)), unit(rt.encode(queries, sparsity=0.0))
    scores = q @ docs.T
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return order, np.take_along_axis(scores, order, axis=1)


def assert_same_top(got_pos, got_scores, want_pos, want_scores, tol: float = 1e-5) -> None:
    """Same scores; same documents except where two scores tie within ``tol``."""
    np.testing.assert_allclose(got_scores, want_scores, atol=tol)
    for g, w, s in zip(got_pos, want_pos, want_scores):
        for i in np.nonzero(g != w)[0]:
            assert abs(s[i] - s[min(i + 1, len(s) - 1)]) < tol or abs(s[i] - s[max(i - 1, 0)]) < tol, (g, w)


@pytest.fixture(scope="module")
def art(minilm_small, tmp_path_factory) -> Path:
    return link_copy(minilm_small, tmp_path_factory.mktemp("index") / "art")


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    return corpus_docs()


def _cli(args: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return e.value.code, out, err


def test_index_is_torch_free_and_matches_brute_force(art, docs, tmp_path):
    """The command runs without importing torch; the index's top-10 of every query (and the manifest
    entry) is what a numpy search over the runtime's dense embeddings gives."""
    corpus = write_jsonl(tmp_path / "corpus.jsonl", docs)
    code = textwrap.dedent(f"""
        import sys
        from elastic_export.cli.main import main
        try:
            main(["index", {str(art)!r}, {str(corpus)!r}, "--batch-size", "32"])
        except SystemExit as e:
            print("EXIT", e.code, "torch" in sys.modules)
    """)
    r = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=300)
    assert "EXIT 0 False" in r.stdout, r.stdout + r.stderr[-3000:]
    assert "indexed 300 documents (384 dims, flat)" in r.stdout
    entry = json.loads((art / MANIFEST).read_text())["index"]
    assert entry["count"] == 300 and entry["dims"] == 384 and entry["metric"] == "inner_product"
    assert entry["corpus"]["sha256"] == __import__("hashlib").sha256(corpus.read_bytes()).hexdigest()
    assert entry["model"]["onnx"] == "dense.onnx" and entry["model"]["fingerprint"]
    from elastic_export.index.store import DenseIndex
    from elastic_export.serving.runtime import ElasticRuntime

    index = DenseIndex.load(art)
    assert index.ids == [d["id"] for d in docs] and index.texts == [d["text"] for d in docs]
    rt = ElasticRuntime.from_dir(art, sparsities=(0.0,))
    queries = ["python code file", "a cat and a dog", "winter light on the mountain", docs[7]["text"]]
    want_pos, want_scores = brute_force(rt, [d["text"] for d in docs], queries)
    scores, pos = index.search(rt.encode(queries, sparsity=0.0), 10)
    assert_same_top(pos, scores, want_pos, want_scores)
    assert pos[3][0] == 7  # a document is its own nearest neighbour


def test_hnsw_txt_and_overwrite(art, docs, tmp_path, capsys):
    """A .txt corpus (ids = line numbers, blank lines skipped) with --hnsw replaces the index only with
    --overwrite; HNSW finds the exact top-10 on a corpus this small."""
    d = link_copy(art, tmp_path / "art", ignore=("triton", "index"))
    write_jsonl(tmp_path / "c.jsonl", docs[:50])
    assert _cli(["index", d, tmp_path / "c.jsonl"], capsys)[0] == 0
    before = (d / MANIFEST).read_text()
    code, _, err = _cli(["index", d, tmp_path / "c.jsonl"], capsys)
    assert code == 2 and err.strip().startswith("error:") and "--overwrite" in err and len(err.strip().splitlines()) == 1
    assert (d / MANIFEST).read_text() == before
    lines = [docs[i]["text"] if i % 10 else "" for i in range(120)]
    (tmp_path / "c.txt").write_text("\n".join(lines) + "\n")
    code, out, _ = _cli(["index", d, tmp_path / "c.txt", "--hnsw", "--overwrite"], capsys)
    assert code == 0 and "hnsw" in out
    from elastic_export.index.store import DenseIndex
    from elastic_export.serving.runtime import ElasticRuntime

    index = DenseIndex.load(d)
    kept = [i for i in range(120) if i % 10]
    assert index.ids == [i + 1 for i in kept] and index.entry["kind"] == "hnsw"
    rt = ElasticRuntime.from_dir(d, sparsities=(0.0,))
    queries = ["python code file", docs[3]["text"]]
    want_pos, want_scores = brute_force(rt, [lines[i] for i in kept], queries)
    scores, pos = index.search(rt.encode(queries, sparsity=0.0), 10)
    assert_same_top(pos, scores, want_pos, want_scores)
    assert not [p.name for p in d.iterdir() if p.name.startswith(".index")]


BAD = {
    "empty": ("c.jsonl", b"", "no documents"),
    "blank lines only": ("c.txt", b"\n  \n\n", "no documents"),
    "not utf-8": ("c.txt", b"caf\xe9\n", "not UTF-8"),
    "invalid json line": ("c.jsonl", b'{"id": 1, "text": "a"}\n{"id": 2, "text": \n', ":2: not a JSON line"),
    "not an object": ("c.jsonl", b'["a", "b"]\n', "expected a JSON object"),
    "duplicate id": ("c.jsonl", b'{"id": 1, "text": "a"}\n{"id": "1", "text": "b"}\n', "duplicate id"),
    "missing id field": ("c.jsonl", b'{"id": 1, "text": "a"}\n{"text": "b"}\n', "id field 'id' missing"),
    "missing text field": ("c.jsonl", b'{"id": 1, "body": "a"}\n', "text field 'text' missing"),
    "empty text": ("c.jsonl", b'{"id": 1, "text": "  "}\n', "not a non-empty string"),
    "unknown extension": ("c.csv", b"id,text\n1,a\n", "expected a .txt"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_corpus_is_one_line_exit_2_nothing_written(art, tmp_path, capsys, case):
    name, data, message = BAD[case]
    d = link_copy(art, tmp_path / "art", ignore=("triton", "index"))
    shared = (art / MANIFEST).read_bytes()
    manifest = json.loads((d / MANIFEST).read_text())
    manifest.pop("index", None)
    (d / MANIFEST).unlink()  # a hard link to art's: replaced, never written into
    (d / MANIFEST).write_text(json.dumps(manifest))
    assert (art / MANIFEST).read_bytes() == shared
    before = (d / MANIFEST).read_bytes()
    (tmp_path / name).write_bytes(data)
    code, out, err = _cli(["index", d, tmp_path / name], capsys)
    assert code == 2 and out == "", (out, err)
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and message in err, err
    assert "Traceback" not in err
    assert (d / MANIFEST).read_bytes() == before and sorted(p.name for p in d.iterdir() if "index" in p.name) == []


def test_missing_corpus_and_bad_options(art, tmp_path, capsys):
    for args, message in ((["index", art, tmp_path / "nope.jsonl"], "no such file"),
                          (["index", art, tmp_path / "c.txt", "--batch-size", "0"], "--batch-size 0"),
                          (["index", tmp_path / "nodir", tmp_path / "c.txt"], "no such directory")):
        (tmp_path / "c.txt").write_text("a\n")
        code, _, err = _cli(args, capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


def test_a_failed_write_leaves_no_half_written_index(art, docs, tmp_path, monkeypatch):
    """A failure while the files are written (here: after the FAISS file) leaves the previous index and
    manifest as they were and no temporary folder; likewise without a previous index."""
    from elastic_export.core.errors import UserError
    from elastic_export.index import build

    d = link_copy(art, tmp_path / "art", ignore=("triton", "index"))
    corpus = write_jsonl(tmp_path / "c.jsonl", docs[:20])
    build.build_index(d, corpus, overwrite=True, progress=False)
    real = build._write_files

    def failing(folder, corpus_, index, entry):
        real(folder, corpus_, index, entry)
        assert (folder / "index.faiss").is_file()
        raise UserError("disk full")

    monkeypatch.setattr(build, "_write_files", failing)
    old = {p.name: p.read_bytes() for p in (d / "index").iterdir()}
    before = (d / MANIFEST).read_bytes()
    with pytest.raises(UserError, match="disk full"):
        build.build_index(d, corpus, overwrite=True, progress=False)
    assert {p.name: p.read_bytes() for p in (d / "index").iterdir()} == old and (d / MANIFEST).read_bytes() == before
    assert not [p.name for p in d.iterdir() if p.name.startswith(".index")]
    fresh = link_copy(art, tmp_path / "fresh", ignore=("triton", "index"))
    with pytest.raises(UserError, match="disk full"):
        build.build_index(fresh, corpus, progress=False)
    assert sorted(p.name for p in fresh.iterdir() if "index" in p.name) == []


# --- one whole build at a time under a server (LiveIndex) ---------------------------------------------
def build_corpus(tag: str, n: int = 40, seed: int = 0) -> list[dict]:
    """``n`` documents whose texts name their build (``build-A ...``); build B lists the same ids in reverse
    order, so a position read from one build and a text from the other pair an id with the wrong text."""
    docs = [{"id": d["id"], "text": f"build-{tag} {d['text']}"} for d in corpus_docs(n, seed)]
    return docs if tag == "A" else docs[::-1]


def _built(art, tmp_path, name: str, tag: str, seed: int = 0) -> Path:
    from elastic_export.index.build import build_index

    d = link_copy(art, tmp_path / name, ignore=("triton", "index"))
    build_index(d, write_jsonl(tmp_path / f"{name}.jsonl", build_corpus(tag, seed=seed)), progress=False)
    return d


def _pairs(index) -> dict:
    return dict(zip(index.ids, index.texts))


def _want(tag: str, seed: int = 0) -> dict:
    return {d["id"]: d["text"] for d in build_corpus(tag, seed=seed)}


def test_a_build_is_read_through_one_handle_on_its_folder(art, tmp_path, monkeypatch):
    """Another build renamed into place while one is read: the read is the first build's whole (ids,
    vectors, texts); ids.json and docs.jsonl of two builds are refused."""
    from elastic_export.core.errors import UserError
    from elastic_export.index import store

    a, b = _built(art, tmp_path, "a", "A"), _built(art, tmp_path, "b", "B")
    want = {tag: _want(tag) for tag in "AB"}
    real = store._open_in

    def swap_then_open(fd, folder, name, missing_ok=False):
        if name == "index.faiss":  # the build's own entry read: B takes A's place, A kept aside
            (a / "index").rename(a / ".index.old")
            (b / "index").rename(a / "index")
        return real(fd, folder, name, missing_ok)

    monkeypatch.setattr(store, "_open_in", swap_then_open)
    got = store.read_build(a / "index")
    monkeypatch.setattr(store, "_open_in", real)
    assert _pairs(got) == want["A"] and got.index.ntotal == 40 and got.build != store.read_build(a / "index").build
    assert _pairs(store.read_build(a / "index")) == want["B"]
    mixed = a / "index"
    (mixed / "ids.json").unlink()
    (mixed / "ids.json").write_bytes((a / ".index.old" / "ids.json").read_bytes())
    with pytest.raises(UserError, match="ids of ids.json and docs.jsonl differ"):
        store.read_build(mixed)


def test_live_index_swaps_whole_builds_and_refuses_a_broken_one(art, tmp_path):
    """``index --overwrite`` under a LiveIndex: the next look reads the new build whole and swaps it in
    (the build a request took stays whole); a broken build renamed into place is refused with one line,
    the previous build served, and not read again until the folder changes."""
    from elastic_export.index.build import build_index
    from elastic_export.index.store import LiveIndex, folder_key

    d = _built(art, tmp_path, "d", "A")
    logged: list[str] = []
    live = LiveIndex.load(d, log=logged.append)
    taken = live.current()
    assert _pairs(taken) == _want("A") and live._thread is None
    build_index(d, write_jsonl(tmp_path / "b.jsonl", build_corpus("B")), overwrite=True, progress=False)
    live.current()  # sees another folder: reads it in the background
    live.wait(120)
    new = live.current()
    assert new is not taken and _pairs(new) == _want("B")
    assert _pairs(taken) == _want("A")  # never written into
    assert new.build == json.loads((d / MANIFEST).read_text())["index"]["build"]
    assert logged == [f"index: serving build {new.build} (40 documents)"]
    broken = tmp_path / "broken"
    shutil.copytree(d / "index", broken)
    (broken / "index.faiss").write_bytes(b"not faiss")
    (d / "index").rename(tmp_path / "aside")
    broken.rename(d / "index")
    assert live.reload() is False and live.current() is new and live._seen == folder_key(d / "index")
    assert len(logged) == 2 and logged[1].startswith(f"index: refused {d / 'index'} (index: ") and "\n" not in logged[1]
    assert logged[1].endswith(f"; serving build {new.build} (40 documents)")
    assert live.reload() is False and len(logged) == 2  # refused once, not read again
    build_index(d, write_jsonl(tmp_path / "c.jsonl", build_corpus("A", seed=3)), overwrite=True, progress=False)
    assert live.reload() is True and _pairs(live.current()) == _want("A", 3)


def test_a_build_removed_while_read_is_read_again_not_refused(art, tmp_path, monkeypatch):
    """The folder a reload opened is replaced and removed under it (``index --overwrite`` finishing):
    the read fails, nothing is refused or logged, and the next reload serves the new build."""
    from elastic_export.index import store

    d, b = _built(art, tmp_path, "d", "A"), _built(art, tmp_path, "b", "B")
    logged: list[str] = []
    live = store.LiveIndex(d, None, log=logged.append)
    real = store._open_in

    def replace_then_open(fd, folder, name, missing_ok=False):
        if name == "ids.json" and (b / "index").exists():
            (d / "index").rename(tmp_path / "old")
            (b / "index").rename(d / "index")
            shutil.rmtree(tmp_path / "old")
        return real(fd, folder, name, missing_ok)

    monkeypatch.setattr(store, "_open_in", replace_then_open)
    assert live.reload() is False and live.build is None and logged == []
    assert live.reload() is True and _pairs(live.current()) == _want("B")
    assert len(logged) == 1
