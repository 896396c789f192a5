"""``elastic-export index --overwrite`` under a live ``serve``: while a client searches without pause,
every answer's ids and texts are one build's (never old ids with new texts), the new build is served
once it is written, and a broken build renamed into place is refused with one logged line while the
previous one stays served."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from _helpers import ENV, link_copy, serve_process, stop_process, wait_for_line
from test_index import build_corpus, write_jsonl

from elastic_export.core.manifest import MANIFEST

REQUEST_S = 120.0  # every search request
WAIT_S = 300.0  # every awaited condition
PAIRS = {tag: {d["id"]: d["text"] for d in build_corpus(tag)} for tag in "AB"}


class Searcher:
    """Searches from a thread, one request after another, until stopped (bounded); keeps every answer
    as (status, body) and wakes :meth:`wait_for` on each."""

    def __init__(self, url: str):
        self.url, self.answers = url, []
        self._stop, self._cond = threading.Event(), threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"query": ["python code file", "winter light on the mountain"], "top_k": 5, "return_text": True}
        deadline = time.monotonic() + 4 * WAIT_S
        with httpx.Client(timeout=REQUEST_S) as client:
            while not self._stop.is_set() and time.monotonic() < deadline:
                try:
                    r = client.post(self.url, json=body)
                    got = (r.status_code, r.json())
                except (httpx.HTTPError, ValueError) as e:
                    got = (0, repr(e))
                with self._cond:
                    self.answers.append(got)
                    self._cond.notify_all()

    def wait_for(self, condition, what: str) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: condition(self.answers), WAIT_S), (what, self.answers[-3:])

    def __enter__(self) -> "Searcher":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(REQUEST_S + 10)


def build_of(body: dict) -> str | None:
    """``A`` or ``B``: the one build every hit's (id, text) is a pair of; None for a mix."""
    hits = [(i, t) for row in body["data"] for i, t in zip(row["ids"], row["texts"], strict=True)]
    found = [tag for tag in "AB" if hits and all(PAIRS[tag].get(i) == t for i, t in hits)]
    return found[0] if len(found) == 1 else None


def builds(answers: list) -> list[str | None]:
    """The build of every answered search (503s, the router's refusals under load, skipped)."""
    return [build_of(body) for status, body in answers if status == 200]


def _first_mix(answers: list) -> dict | None:
    return next((body for status, body in answers if status == 200 and build_of(body) is None), None)


def test_index_overwrite_under_a_live_server(minilm_small, tmp_path):
    from elastic_export.index.build import build_index

    d = link_copy(minilm_small, tmp_path / "art", ignore=("triton", "index"))
    build_index(d, write_jsonl(tmp_path / "a.jsonl", build_corpus("A")), progress=False)
    corpus_b = write_jsonl(tmp_path / "b.jsonl", build_corpus("B"))
    serve, port, _ = serve_process(d)
    try:
        with Searcher(f"http://127.0.0.1:{port + 3}/v1/search") as s:
            s.wait_for(lambda a: "A" in builds(a), "build A answered")
            r = subprocess.run([sys.executable, "-m", "elastic_export", "index", str(d), str(corpus_b), "--overwrite"],
                               env=ENV, capture_output=True, text=True, timeout=600)
            assert r.returncode == 0, r.stderr[-2000:]
            s.wait_for(lambda a: "B" in builds(a) or None in builds(a), "build B answered")
            assert None not in builds(s.answers), _first_mix(s.answers)
            build_b = json.loads((d / MANIFEST).read_text())["index"]["build"]
            wait_for_line(serve, f"index: serving build {build_b} (40 documents)", WAIT_S)
            seen = len(s.answers)
            _rename_a_broken_build_into_place(d, tmp_path)
            wait_for_line(serve, f"index: refused {d / 'index'} (index: ", WAIT_S)
            s.wait_for(lambda a: len(builds(a[seen:])) >= 3, "answers after the refusal")
        answered = builds(s.answers)
    finally:
        stop_process(serve)
    assert None not in answered, _first_mix(s.answers)
    first_b = answered.index("B")
    assert set(answered[:first_b]) == {"A"} and set(answered[first_b:]) == {"B"}, answered  # swapped once, whole
    assert {status for status, _ in s.answers} <= {200, 503}, [a for a in s.answers if a[0] not in (200, 503)][:1]
    assert sum(1 for x in serve.lines if x.startswith("index: refused")) == 1


def _rename_a_broken_build_into_place(d: Path, tmp_path: Path) -> None:
    """A copy of the served build whose ids.json lists the ids in another order, renamed into place as
    ``index --overwrite`` does."""
    broken = tmp_path / "broken"
    shutil.copytree(d / "index", broken)
    (broken / "ids.json").write_text(json.dumps(sorted(json.loads((broken / "ids.json").read_text()))))
    (d / "index").rename(tmp_path / "aside")
    broken.rename(d / "index")
