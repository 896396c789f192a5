"""Serving judged on the traffic applications send (issue 53, item 7): real text, real `elastic-export serve`.

Issue 29's acceptance (``serve_triton.py``) sends one 128-token text per request straight to Triton. This
sends what applications send, through the OpenAI-style API (``POST /v1/embeddings``), built from sentences of
the interpreter's own ``pydoc_data.topics`` (the calibration source) and counted in the model's own tokens:

* ``short``: one query of 5-30 tokens per request (``input_type`` query);
* ``mix``: 80 % short queries, 20 % documents of up to the model's context (``input_type`` document);
* ``t128``: one 128-token text per request (queries): the old trace;
* ``index``: short queries at 0.25x their reference beside one indexing client that sends 64-document
  requests back to back (closed loop, concurrency 1).

Reference of each trace: the same machine's onnxruntime in this process (no server), per budget, with ideal
batching (batches of 16 texts sorted by length; documents always dense), measured in the same run before the
server starts; and the dense rate of 64-document requests (the indexing reference). Each ladder trace is
offered seeded Poisson steps at 0.25x-2x of its dense reference, open loop (``aiohttp``: the client shares the
machine's cores with the server, and costs a fraction of ``httpx``'s CPU per request), to a server this
script starts on loopback and always stops. Per rate: offered, answered, refused (503), lost, SLO attainment
(answered within the SLO over offered: refusals are misses), p50 / p99, refusals' p99, served sparsity,
served quality against the oracle's (the densest budget whose compute plus 2 ms of CPU per request fits in
80 % of the machine), padding waste where the server exposes it; verdicts as issue 53's "Done means".

Usage:
    python benchmarks/serve_traffic.py [--traces short,mix,t128,index] [--rates 0.25,0.5,...] [--step-s 10]
        [--seed 0] [--slo-ms 250] [--artifacts DIR] [--no-write]

Writes benchmarks/results/serve_traffic.{json,md,png} unless ``--no-write``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from serve_triton import (  # noqa: E402
    DEFAULT_ARTIFACTS,
    RESULTS,
    ensure_artifacts,
    machine,
    phase_times,
    quality_per_budget,
    write_results,
)

from elastic_export.targets.triton import DEFAULT_NAME, INDEX_SUFFIX, SEARCH_SUFFIX  # noqa: E402

TRACES = ("short", "mix", "t128", "index")
RATES = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0)  # x the trace's dense reference
SHORT_TOKENS = (5, 30)  # a short query's model tokens (specials included)
LONG_TOKENS = 128  # t128's text
DOC_SHARE = 0.2  # mix: the share of requests that are documents
MIN_DOC_TOKENS = 16
INDEX_BATCH = 64  # documents per indexing request
INDEX_QUERY_RATE = 0.25  # x short's dense reference: the queries beside the indexing client
INDEX_STEP_FACTOR = 6  # the index trace runs this many --step-s: an indexing request takes seconds, and the
# figure counts finished requests, so a window of a few of them reads in coarse steps
REF_BATCH = 16  # ideal batching: texts sorted by length, this many per batch
REF_ROUNDS = 3  # interleaved rounds of the reference; each budget's time is their median
REF_SAMPLE = {"short": 320, "mix": 160, "t128": 64}  # requests timed per reference round
CPU_PER_REQUEST_S = 0.002  # the oracle's: CPU the API, router and server may spend per request
ORACLE_UTILISATION = 0.8
QUALITY_TOLERANCE = 0.005
SHORT_PROMISE = 1.25  # short queries: >= 99 % within the SLO up to this x their dense reference
DRAIN_S = 2.0  # pause between steps
READY_S = 600.0  # server start (builds the Triton repository when missing)
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(`'\"])")


# --- traces from real text ---------------------------------------------------------------------------
@dataclass
class Corpus:
    """Texts of the interpreter's reference, with their model token counts (specials included)."""

    queries: list[str]
    query_tokens: list[int]
    documents: list[str]
    document_tokens: list[int]
    long: list[str]
    long_tokens: list[int]
    max_len: int
    meta: dict = field(default_factory=dict)


def _paragraphs() -> list[list[str]]:
    """Per topic of ``pydoc_data.topics`` (sorted), its paragraphs, whitespace normalised."""
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        paras = [" ".join(p.split()) for p in re.split(r"\n\s*\n", topics[key])]
        out.append([p for p in paras if p])
    return out


def _raw_tokenizer(encoder):
    """A copy of the encoder's tokenizer that neither pads nor truncates (counts and cuts text)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(encoder.tokenizer.to_str())
    tok.no_padding()
    tok.no_truncation()
    return tok


def _cut(tok, text: str, tokens: int) -> str:
    """The prefix of ``text`` that encodes to at most ``tokens`` model tokens (specials included)."""
    enc = tok.encode(text)
    if len(enc.ids) <= tokens:
        return text
    content = [o for o, s in zip(enc.offsets, enc.special_tokens_mask) if not s]
    return text[:content[tokens - 3][1]]


def _documents(tok, topics: list[list[str]], max_len: int) -> list[str]:
    """Each topic's paragraphs merged in order into chunks of up to ``max_len`` tokens (a paragraph longer
    than that is cut): documents of realistic lengths up to the context, as a chunker makes them."""
    docs = []
    for paras in topics:
        lengths = [len(e.ids) - 2 for e in tok.encode_batch(paras)] if paras else []
        chunk, size = [], 0
        for p, n in zip(paras, lengths):
            if chunk and size + n > max_len - 2:
                docs.append(" ".join(chunk))
                chunk, size = [], 0
            chunk.append(p if n <= max_len - 2 else _cut(tok, p, max_len))
            size += min(n, max_len - 2)
        if chunk:
            docs.append(" ".join(chunk))
    return docs


def _long_texts(tok, topics: list[list[str]], tokens: int) -> list[str]:
    """Consecutive windows of each topic's text that encode to exactly ``tokens`` tokens."""
    out = []
    for paras in topics:
        text = " ".join(paras)
        enc = tok.encode(text)
        content = [o for o, s in zip(enc.offsets, enc.special_tokens_mask) if not s]
        step = tokens - 2
        for i in range(0, len(content) - step + 1, step):
            out.append(text[content[i][0]:content[i + step - 1][1]])
    return [t for t, e in zip(out, tok.encode_batch(out)) if len(e.ids) == tokens]


def build_corpus(encoder) -> Corpus:
    """Short queries (sentences of :data:`SHORT_TOKENS`), documents (chunks up to the context) and 128-token
    texts, from ``pydoc_data.topics`` through ``encoder``'s tokenizer; deterministic (no randomness)."""
    tok, topics = _raw_tokenizer(encoder), _paragraphs()
    sentences = sorted({s.strip() for paras in topics for p in paras for s in SENTENCE_END.split(p) if s.strip()})
    lengths = [len(e.ids) for e in tok.encode_batch(sentences)]
    lo, hi = SHORT_TOKENS
    queries = [(s, n) for s, n in zip(sentences, lengths) if lo <= n <= hi]
    docs = _documents(tok, topics, encoder.max_len)
    doc_len = [len(e.ids) for e in tok.encode_batch(docs)]
    docs = [(d, n) for d, n in zip(docs, doc_len) if MIN_DOC_TOKENS <= n <= encoder.max_len]
    long = _long_texts(tok, topics, LONG_TOKENS)
    return Corpus([q for q, _ in queries], [n for _, n in queries], [d for d, _ in docs], [n for _, n in docs],
                  long, [LONG_TOKENS] * len(long), encoder.max_len,
                  {"sentences": len(sentences), "topics": len(topics)})


def trace_requests(corpus: Corpus, trace: str, n: int, seed: int) -> list[tuple[str, str, int]]:
    """``n`` requests of ``trace`` (seeded): (text, input_type, tokens) each, one text per request."""
    rng = np.random.default_rng([seed, TRACES.index(trace)])
    out = []
    for _ in range(n):
        doc = trace == "mix" and rng.random() < DOC_SHARE
        pool, lens = ((corpus.documents, corpus.document_tokens) if doc else
                      (corpus.long, corpus.long_tokens) if trace == "t128" else (corpus.queries, corpus.query_tokens))
        i = int(rng.integers(len(pool)))
        out.append((pool[i], "document" if doc else "query", lens[i]))
    return out


def index_requests(corpus: Corpus, n: int, seed: int) -> list[list[str]]:
    """``n`` indexing requests of :data:`INDEX_BATCH` documents each (seeded), a corpus walked in order from a
    seeded start, as a client embedding its collection sends it."""
    start = int(np.random.default_rng([seed, 99]).integers(len(corpus.documents)))
    docs = corpus.documents
    return [[docs[(start + r * INDEX_BATCH + i) % len(docs)] for i in range(INDEX_BATCH)] for r in range(n)]


# --- the in-process reference ------------------------------------------------------------------------
def ideal_batches(lengths: list[int], size: int = REF_BATCH) -> list[list[int]]:
    """Indices sorted by length, in batches of ``size``: each batch holds texts of about one length."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    return [order[i:i + size] for i in range(0, len(order), size)]


def _workload(encoder, requests: list[tuple[str, str, int]]) -> dict[str, list]:
    """The reference's feeds of ``requests``: queries and documents apart, each in ideal batches."""
    out = {}
    for kind in ("query", "document"):
        texts = [t for t, k, _ in requests if k == kind]
        lens = [n for _, k, n in requests if k == kind]
        out[kind] = [encoder.encode([texts[i] for i in b]) for b in ideal_batches(lens)]
    return out


def _timed(rt, feeds: list, sparsity: float) -> float:
    t0 = time.perf_counter()
    for f in feeds:
        rt.run(f, sparsity=sparsity)
    return time.perf_counter() - t0


def reference_rates(rt, encoder, requests: list, sparsities: list[float], rounds: int = REF_ROUNDS) -> dict[float, float]:
    """Requests/s of ``requests`` in process per budget: queries at the budget, documents dense, ideal
    batches; the median of ``rounds`` rounds interleaved over the budgets (order reversed every other)."""
    work = _workload(encoder, requests)
    for f in work["query"][:1] + work["document"][:1]:
        for s in sparsities:
            rt.run(f, sparsity=s)  # warm every session
    docs_s = [_timed(rt, work["document"], 0.0) for _ in range(rounds)]
    times = {s: [] for s in sparsities}
    for r in range(rounds):
        for s in (sparsities if r % 2 == 0 else sparsities[::-1]):
            times[s].append(_timed(rt, work["query"], s))
    return {s: len(requests) / (float(np.median(times[s])) + float(np.median(docs_s))) for s in sparsities}


def index_reference(rt, encoder, batches: list[list[str]], rounds: int = REF_ROUNDS) -> float:
    """Documents/s of dense 64-document requests in process (each request sorted into ideal batches)."""
    tok = _raw_tokenizer(encoder)
    feeds = []
    for docs in batches:
        lens = [min(len(e.ids), encoder.max_len) for e in tok.encode_batch(docs)]
        feeds += [encoder.encode([docs[i] for i in b]) for b in ideal_batches(lens)]
    rt.run(feeds[0], sparsity=0.0)
    runs = [_timed(rt, feeds, 0.0) for _ in range(rounds)]
    return sum(map(len, batches)) / float(np.median(runs))


def measure_references(directory: Path, encoder, corpus: Corpus, traces: list[str], sparsities: list[float],
                       seed: int, rounds: int = REF_ROUNDS) -> dict:
    """Every trace's reference rates per budget (short's too where index runs) and the indexing reference."""
    from elastic_export.serving.runtime import ElasticRuntime

    rt = ElasticRuntime.from_dir(directory)
    try:
        out = {}
        for trace in dict.fromkeys(["short" if t == "index" else t for t in traces]):
            req = trace_requests(corpus, trace, REF_SAMPLE[trace], seed + 7)
            out[trace] = reference_rates(rt, encoder, req, sparsities, rounds)
            print(f"reference {trace}: " + ", ".join(f"{s:g} {r:.1f}/s" for s, r in out[trace].items()), flush=True)
        if "index" in traces:
            out["index_docs_per_s"] = index_reference(rt, encoder, index_requests(corpus, 2, seed + 7), rounds)
            print(f"reference index: dense {INDEX_BATCH}-document requests {out['index_docs_per_s']:.1f} documents/s")
        return out
    finally:
        rt.close()


def reference_drift(before: dict, after: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per trace measured again (``after``: its dense requests/s): its dense reference before and after the
    load and the relative change."""
    return {t: {"before": before[t][0.0], "after": a, "change": a / before[t][0.0] - 1.0}
            for t, a in after.items() if t in before}


class StepReference:
    """A trace's dense reference measured again just before each step (one round, in this process, while
    the server is idle between steps): the host's speed moves on a shared machine, and a step's rate is
    then shown as a multiple of the machine it met as well as of the run's opening reference."""

    def __init__(self, directory: Path, encoder, corpus: Corpus, seed: int):
        from elastic_export.serving.runtime import ElasticRuntime

        self.rt, self.encoder, self.corpus, self.seed = ElasticRuntime.from_dir(directory), encoder, corpus, seed

    def dense(self, trace: str, rounds: int = 1) -> float:
        """``trace``'s dense requests/s now, the median of ``rounds`` rounds (``index`` is measured on the short
        queries it sends)."""
        trace = "short" if trace == "index" else trace
        req = trace_requests(self.corpus, trace, REF_SAMPLE[trace], self.seed + 7)
        return reference_rates(self.rt, self.encoder, req, [0.0], rounds)[0.0]

    def close(self) -> None:
        self.rt.close()


# --- the oracle and the verdicts (pure) --------------------------------------------------------------
def oracle_budget(rate: float, ref: dict[float, float], cores: int) -> float:
    """The densest budget s with rate x (1/ref[s] + CPU_PER_REQUEST_S / cores) <= ORACLE_UTILISATION (its
    compute plus 2 ms of CPU per request fits in 80 % of the machine); the sparsest when none does."""
    fits = [s for s in sorted(ref) if rate * (1.0 / ref[s] + CPU_PER_REQUEST_S / cores) <= ORACLE_UTILISATION]
    return fits[0] if fits else max(ref)


def _all(values: list) -> bool | None:
    """True / False over the checked values; None when nothing was measured."""
    return None if not values else all(values)


def verdict(trace: str, steps: list[dict], slo_ms: float) -> dict[str, bool | None]:
    """Issue 53's "Done means" for one trace's steps (each with ``multiple`` and its summary); None: not run."""
    if trace == "index":
        s = steps[0]
        return {"index: >= 99 % within the SLO": s["slo_attainment"] >= 0.99,
                "index: 0 refused": s["refused"] == 0 and s["index"]["refused"] == 0,
                "index: indexing >= 35 % of the reference": s["index"]["fraction_of_reference"] >= 0.35,
                "index: every document vector dense": s["index"]["all_dense"]}
    promise = SHORT_PROMISE if trace == "short" else 1.0
    upto = [s for s in steps if s["multiple"] <= promise + 1e-9]
    past = [s for s in steps if s["multiple"] > promise + 1e-9]
    q = [s for s in steps if s["multiple"] <= 1.0 + 1e-9 and s["served_quality"] is not None]
    low = [s for s in steps if s["multiple"] <= 0.5 + 1e-9]
    return {
        f"{trace}: >= 99 % within the SLO up to {promise:g}x": _all([s["slo_attainment"] >= 0.99 for s in upto]),
        f"{trace}: past {promise:g}x refusals' p99 < 50 ms": _all(
            [s["refusal_p99_ms"] is None or s["refusal_p99_ms"] < 50.0 for s in past]),
        f"{trace}: past {promise:g}x answered p99 <= SLO": _all(
            [s["p99_ms"] is not None and s["p99_ms"] <= slo_ms for s in past]),
        f"{trace}: quality within {QUALITY_TOLERANCE:g} of the oracle up to 1x": _all(
            [s["served_quality"] >= s["oracle_quality"] - QUALITY_TOLERANCE for s in q]),
        f"{trace}: >= 90 % dense at <= 0.5x": _all([s["dense_share"] is not None and s["dense_share"] >= 0.9
                                                   for s in low]),
    }


def _p(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarise(recs: list[dict], slo_ms: float, quality: dict[float, float], oracle: float | None) -> dict:
    """One step's figures from its records (``type``, ``outcome``, ``ms``, ``sparsity``)."""
    ok = [r for r in recs if r["outcome"] == "ok"]
    queries = [r["sparsity"] for r in ok if r["type"] == "query"]
    docs = [r for r in recs if r["type"] == "document"]
    served_q = float(np.mean([quality[round(s, 6)] for s in queries])) if queries else None
    out = {"offered": len(recs), "answered": len(ok), "refused": sum(r["outcome"] == "refused" for r in recs),
           "lost": sum(r["outcome"] == "lost" for r in recs),
           "slo_attainment": sum(r["ms"] <= slo_ms for r in ok) / max(len(recs), 1),
           "p50_ms": _p([r["ms"] for r in ok], 50), "p99_ms": _p([r["ms"] for r in ok], 99),
           "refusal_p99_ms": _p([r["ms"] for r in recs if r["outcome"] == "refused"], 99),
           "mean_sparsity": float(np.mean(queries)) if queries else None,
           "dense_share": float(np.mean([s == 0.0 for s in queries])) if queries else None,
           "served_quality": served_q,
           "errors": sorted({r["error"] for r in recs if r.get("error")})[:3]}
    if docs:
        dok = [r for r in docs if r["outcome"] == "ok"]
        out["documents"] = {"offered": len(docs), "answered": len(dok),
                            "slo_attainment": sum(r["ms"] <= slo_ms for r in dok) / len(docs),
                            "p99_ms": _p([r["ms"] for r in dok], 99), "all_dense": all(r["sparsity"] == 0 for r in dok)}
        qs = [r for r in recs if r["type"] == "query"]
        out["query_slo_attainment"] = sum(r["ms"] <= slo_ms for r in qs if r["outcome"] == "ok") / max(len(qs), 1)
    if oracle is not None:
        out.update(oracle_sparsity=oracle, oracle_quality=quality[round(oracle, 6)],
                   quality_vs_oracle=None if served_q is None else served_q - quality[round(oracle, 6)])
    return out


# --- the server --------------------------------------------------------------------------------------
class Server:
    """``elastic-export serve DIR`` on loopback on a free port block, in a process group of its own; the API
    on port+3. :meth:`stop` ends it by its pid (SIGINT, then SIGKILL of the group, bounded)."""

    def __init__(self, directory: Path, slo_ms: float, log: Path):
        self.directory, self.slo_ms, self.log = directory, slo_ms, log
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.port + 3}"

    def start(self, attempts: int = 3) -> "Server":
        from elastic_export.targets.tritonserver import free_port_block

        for _ in range(attempts):
            self.port = free_port_block()
            with open(self.log, "w") as f:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "elastic_export", "serve", str(self.directory), "--port", str(self.port),
                     "--slo-ms", f"{self.slo_ms:g}", "--ready-timeout", str(READY_S)],
                    stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
            text = self._wait_ready()
            if text is not None:
                print(f"server ready (pid {self.proc.pid}): API {self.api}", flush=True)
                return self
            self.stop()
            if "in use" not in (self.log.read_text() if self.log.is_file() else ""):
                raise RuntimeError("serve did not become ready:\n" + self.log.read_text()[-3000:])
        raise RuntimeError("serve: no free port block after retries")

    def _wait_ready(self) -> str | None:
        deadline = time.monotonic() + READY_S + 120
        while time.monotonic() < deadline and self.proc.poll() is None:
            text = self.log.read_text()
            if any(ln.startswith("ready:") for ln in text.splitlines()):
                return text
            time.sleep(0.5)
        return None

    def stop(self, timeout_s: float = 60.0) -> None:
        p = self.proc
        if p is None:
            return
        for sig, wait in ((signal.SIGINT, timeout_s), (signal.SIGKILL, 30.0)):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                break
            try:
                p.wait(timeout=wait)
                if sig == signal.SIGINT:  # serve has exited: whatever it left in its group goes too
                    os.killpg(p.pid, signal.SIGKILL)
                break
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                break
        self.proc = None
        print(f"server stopped (exit {p.poll()})", flush=True)

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# --- the load ----------------------------------------------------------------------------------------
def _proc_stats() -> dict[int, tuple[int, float, list[str]]]:
    """Every process's parent, CPU seconds (user + system) and command line, from ``/proc`` (Linux)."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            args = (d / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:  # it ended meanwhile
            continue
        rest = stat[stat.rindex(")") + 2:].split()
        out[int(d.name)] = (int(rest[1]), (int(rest[11]) + int(rest[12])) / tick, args)
    return out


def _part(pid: int, root: int, args: list[str]) -> str:
    """What a process of the server's tree is: the API (``serve``), tritonserver, or a Python backend stub
    by its model's name (the repository's: the router, the indexing lane, the search model, a budget model)."""
    if pid == root:
        return "api"
    if "tritonserver" in Path(args[0]).name:
        return "tritonserver"
    model = next((Path(a).parent.parent.name for a in args if a.endswith("model.py")), None)
    if model is None:
        return "other"
    if model == DEFAULT_NAME:
        return "router"
    return "lane" if model.endswith(INDEX_SUFFIX) else "search" if model.endswith(SEARCH_SUFFIX) else "budget models"


def cpu_by_part(root: int) -> dict[str, float]:
    """CPU seconds so far of the server's process tree (``root``: the ``serve`` process) by :func:`_part`, and
    of this client process; a step's use is the difference of two readings."""
    stats, tree, out = _proc_stats(), {root}, {}
    grew = True
    while grew:  # the descendants of root
        new = {pid for pid, (ppid, _, _) in stats.items() if ppid in tree and pid not in tree}
        tree |= new
        grew = bool(new)
    for pid in tree & set(stats):
        part = _part(pid, root, stats[pid][2])
        out[part] = out.get(part, 0.0) + stats[pid][1]
    out["client"] = stats.get(os.getpid(), (0, 0.0, []))[1]
    return out


def cpu_use(before: dict[str, float], after: dict[str, float], seconds: float, requests: int) -> dict:
    """A step's CPU by part: cores busy on average, and ms of CPU per request offered."""
    used = {k: after[k] - before.get(k, 0.0) for k in after}
    return {"cores": {k: v / seconds for k, v in used.items()},
            "ms_per_request": {k: 1e3 * v / max(1, requests) for k, v in used.items()}}


async def send(client, url: str, texts: list[str], input_type: str) -> dict:
    """One ``POST /v1/embeddings``: latency, outcome (ok / refused: 503 / lost), served sparsity, vectors."""
    t0 = time.perf_counter()
    try:
        async with client.post(url, json={"input": texts, "input_type": input_type, "encoding_format": "base64"}) as r:
            status, text = r.status, await r.text()
        ms = (time.perf_counter() - t0) * 1e3
        if status == 200:
            body = json.loads(text)
            return {"ms": ms, "outcome": "ok", "sparsity": float(body["served_sparsity"]), "vectors": len(body["data"])}
        return {"ms": ms, "outcome": "refused" if status == 503 else "lost", "sparsity": None, "vectors": 0,
                "error": f"HTTP {status}: {text[:120]}"}
    except Exception as e:  # a failed request is a result here
        return {"ms": (time.perf_counter() - t0) * 1e3, "outcome": "lost", "sparsity": None, "vectors": 0,
                "error": f"{type(e).__name__}: {str(e)[:120]}"}


async def open_loop(client, url: str, times: np.ndarray, requests: list[tuple[str, str, int]]) -> list[dict]:
    """Each request sent at its time (never waiting for earlier answers); their records."""
    t0, tasks = time.perf_counter(), []
    for t, (text, kind, _) in zip(times, requests):
        delay = t0 + t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(send(client, url, [text], kind)))
    return [{**r, "type": kind} for r, (_, kind, _) in zip(await asyncio.gather(*tasks), requests)]


async def indexing_client(client, url: str, batches: list[list[str]], seconds: float) -> dict:
    """One client sending 64-document requests back to back for ``seconds`` (the last one is waited for)."""
    t0, recs, i = time.perf_counter(), [], 0
    while time.perf_counter() - t0 < seconds:
        recs.append(await send(client, url, batches[i % len(batches)], "document"))
        i += 1
    elapsed = time.perf_counter() - t0
    ok = [r for r in recs if r["outcome"] == "ok"]
    docs = sum(r["vectors"] for r in ok)
    return {"requests": len(recs), "answered": len(ok), "refused": sum(r["outcome"] == "refused" for r in recs),
            "lost": sum(r["outcome"] == "lost" for r in recs), "documents": docs, "seconds": elapsed,
            "documents_per_s": docs / elapsed, "all_dense": bool(ok) and all(r["sparsity"] == 0 for r in ok),
            "p50_ms": _p([r["ms"] for r in ok], 50), "errors": sorted({r["error"] for r in recs if r.get("error")})[:3]}


BATCH_METRICS = ("elastic_api_query_tokens_total", "elastic_api_query_batches_total", "elastic_api_queries_batched_total",
                 "elastic_api_queries_late_total", "elastic_api_queries_refused_total")  # serving/api_guard.py


async def padding_metrics(client, urls: list[str]) -> dict[str, float]:
    """The API's merged-query counters (real and padded tokens, router requests, queries, late) and any metric
    whose name says padding (``pad``, ``waste``), from the API's and Triton's ``/metrics`` (empty: none)."""
    out = {}
    for url in urls:
        try:
            async with client.get(url) as r:
                text = await r.text()
        except Exception:
            continue
        for line in text.splitlines():
            name = line.split("{")[0].split(" ")[0]
            if not line.startswith("#") and (name in BATCH_METRICS or "pad" in name or "waste" in name):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
    return out


def padding_waste(metrics: dict) -> float | None:
    """1 - real / padded tokens of the queries merged over a step (``{name: (after, before)}``); None without."""
    def delta(kind: str) -> float | None:
        v = metrics.get(f'elastic_api_query_tokens_total{{kind="{kind}"}}')
        return None if v is None or v[1] is None else v[0] - v[1]

    real, padded = delta("real"), delta("padded")
    return None if not real or not padded else 1.0 - real / padded


async def warm(client, url: str, corpus: Corpus) -> None:
    """A few queries and documents, one at a time, before anything is timed."""
    for i in range(20):
        await send(client, url, [corpus.queries[i]], "query")
    for i in range(3):
        await send(client, url, [corpus.documents[i]], "document")
        await send(client, url, [corpus.long[i]], "query")


async def ladder(client, server: Server, corpus: Corpus, trace: str, ref: dict, args, quality: dict,
                 step_ref: StepReference | None = None) -> list[dict]:
    """Seeded Poisson steps at ``args.rates`` x the trace's dense reference, each open loop for --step-s."""
    dense = ref[0.0]
    times, idx = phase_times([m * dense for m in args.rates], [args.step_s] * len(args.rates), args.seed)
    requests = trace_requests(corpus, trace, len(times), args.seed)
    url, steps = server.api + "/v1/embeddings", []
    for i, m in enumerate(args.rates):
        rows = np.flatnonzero(idx == i)
        await asyncio.sleep(DRAIN_S)
        now = step_ref.dense(trace) if step_ref is not None else None
        recs, cpu, metrics = await measured_step(client, server, len(rows), lambda: open_loop(
            client, url, times[rows] - i * args.step_s, [requests[j] for j in rows]))
        oracle = oracle_budget(m * dense, ref, args.cores)
        s = {"multiple": m, "rate_rps": m * dense, **summarise(recs, args.slo_ms, quality, oracle), "cpu": cpu,
             "reference_now": now}
        if metrics:
            s["padding_metrics"] = metrics
            s["padding_waste"] = padding_waste(metrics)
            s["refused_where"] = refused_where(s["refused"], metrics)
        steps.append(s)
        print(_progress(trace, s), flush=True)
    return steps


async def measured_step(client, server: Server, requests: int, load: Callable[[], Awaitable]) -> tuple[Any, dict, dict]:
    """Start ``load()`` (a step's requests, once the counters are read) and measure it: its result, the
    server's CPU by part over it (:func:`cpu_use`, per request of ``requests``), and the API's and Triton's
    counters as ``{name: (after, before)}`` (:func:`padding_metrics`; empty when neither answered)."""
    before = await padding_metrics(client, _metrics_urls(server))
    cpu0, t0 = cpu_by_part(server.proc.pid), time.perf_counter()
    result = await load()
    cpu = cpu_use(cpu0, cpu_by_part(server.proc.pid), time.perf_counter() - t0, requests)
    after = await padding_metrics(client, _metrics_urls(server))
    return result, cpu, {k: (v, before.get(k)) for k, v in after.items()}


def refused_where(refused: int, metrics: dict) -> dict[str, int]:
    """Where a step's refusals happened, from the API's counters: on arrival (predicted past the deadline),
    late (waited past it, unsent) and the rest (the router's admission, after a round trip)."""
    def delta(name: str) -> int:
        after, before = metrics.get(name, (0.0, 0.0))
        return int(after - (before or 0.0))

    arrival, late = delta("elastic_api_queries_refused_total"), delta("elastic_api_queries_late_total")
    return {"arrival": arrival, "late": late, "router": max(0, refused - arrival - late)}


def _metrics_urls(server: Server) -> list[str]:
    return [server.api + "/metrics", f"http://127.0.0.1:{server.port + 2}/metrics"]


def _progress(trace: str, s: dict) -> str:
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    return (f"{trace} {s['multiple']:g}x ({s['rate_rps']:.1f}/s, {_own_multiple(s)}): offered {s['offered']}, "
            f"answered {s['answered']}, "
            f"refused {s['refused']}, lost {s['lost']}, SLO {100 * s['slo_attainment']:.1f} %, p50 "
            f"{f(s['p50_ms'], '.0f')} p99 {f(s['p99_ms'], '.0f')} ms, refusals p99 {f(s['refusal_p99_ms'], '.1f')} "
            f"ms, sparsity {f(s['mean_sparsity'], '.2f')}, dense {f(s['dense_share'], '.0%')}, quality "
            f"{f(s['served_quality'], '.4f')} vs oracle {s.get('oracle_sparsity', '-')} "
            f"({f(s.get('oracle_quality'), '.4f')})" + (f"; refused where {s.get('refused_where')}" if s["refused"] else "")
            + (f"; errors {s['errors']}" if s["errors"] else ""))


async def index_trace(client, server: Server, corpus: Corpus, refs: dict, args, quality: dict,
                      step_ref: StepReference | None = None) -> list[dict]:
    """Short queries at 0.25x their dense reference beside one indexing client, for INDEX_STEP_FACTOR steps."""
    seconds = INDEX_STEP_FACTOR * args.step_s
    rate = INDEX_QUERY_RATE * refs["short"][0.0]
    times, _ = phase_times([rate], [seconds], args.seed + 1)
    requests = trace_requests(corpus, "short", len(times), args.seed + 1)
    url = server.api + "/v1/embeddings"
    await asyncio.sleep(DRAIN_S)
    now = step_ref.dense("index") if step_ref is not None else None
    batches = index_requests(corpus, 64, args.seed)
    (recs, idx), cpu, metrics = await measured_step(client, server, len(times), lambda: asyncio.gather(
        open_loop(client, url, times, requests), indexing_client(client, url, batches, seconds)))
    idx["reference_docs_per_s"] = refs["index_docs_per_s"]
    idx["fraction_of_reference"] = idx["documents_per_s"] / refs["index_docs_per_s"]
    oracle = oracle_budget(rate, refs["short"], args.cores)
    s = {"multiple": INDEX_QUERY_RATE, "rate_rps": rate, **summarise(recs, args.slo_ms, quality, oracle), "index": idx,
         "cpu": cpu, "reference_now": now}
    if metrics:
        s["refused_where"] = refused_where(s["refused"], metrics)
    print(_progress("index", s) + f"; indexing {idx['documents_per_s']:.1f} documents/s "
          f"({100 * idx['fraction_of_reference']:.0f} % of the reference), {idx['requests']} requests, "
          f"{idx['refused']} refused, all dense: {idx['all_dense']}", flush=True)
    return [s]


async def run_load(server: Server, corpus: Corpus, refs: dict, args, quality: dict,
                   step_ref: StepReference | None = None) -> dict:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=2000)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        await warm(client, server.api + "/v1/embeddings", corpus)
        out = {}
        for trace in args.traces:
            if trace == "index":
                out[trace] = await index_trace(client, server, corpus, refs, args, quality, step_ref)
            else:
                out[trace] = await ladder(client, server, corpus, trace, refs[trace], args, quality, step_ref)
        return out


# --- the report --------------------------------------------------------------------------------------
def _cell(v, spec: str, scale: float = 1.0) -> str:
    return "-" if v is None else format(v * scale, spec)


def table_lines(trace: str, steps: list[dict]) -> list[str]:
    head = ("| rate | req/s | x the step's own reference | offered | answered | refused (on arrival / late / router) "
            "| lost | SLO met | p50 ms | p99 ms | refusals p99 ms | "
            "mean sparsity | dense | quality | oracle (quality) | vs oracle | padding |")
    lines = [head, "|---" * 17 + "|"]
    for s in steps:
        pm = s.get("padding_metrics") or {}
        merged = [_step_value(k, *pm[k]) for k in ("elastic_api_queries_batched_total", "elastic_api_query_batches_total")
                  if k in pm]
        pad = (f"{100 * s['padding_waste']:.0f} % ({merged[0]:g} queries in {merged[1]:g} requests)"
               if s.get("padding_waste") is not None and len(merged) == 2 else "n/a")
        where = s.get("refused_where")
        refused = f"{s['refused']}" + (f" ({where['arrival']} / {where['late']} / {where['router']})"
                                       if where and s["refused"] else "")
        lines.append(
            f"| {s['multiple']:g}x | {s['rate_rps']:.1f} | {_own_multiple(s)} | {s['offered']} | {s['answered']} | "
            f"{refused} | "
            f"{s['lost']} | {100 * s['slo_attainment']:.1f} % | {_cell(s['p50_ms'], '.0f')} | "
            f"{_cell(s['p99_ms'], '.0f')} | {_cell(s['refusal_p99_ms'], '.1f')} | {_cell(s['mean_sparsity'], '.2f')} | "
            f"{_cell(s['dense_share'], '.0f', 100)} % | {_cell(s['served_quality'], '.4f')} | "
            f"{s.get('oracle_sparsity', '-')} ({_cell(s.get('oracle_quality'), '.4f')}) | "
            f"{_cell(s.get('quality_vs_oracle'), '+.4f')} | {pad} |")
    return lines


def _own_multiple(step: dict) -> str:
    """The step's rate over the dense reference measured just before it, with that reference (or n/a)."""
    now = step.get("reference_now")
    return f"{step['rate_rps'] / now:.2f}x of {now:.1f}" if now else "n/a"


def _step_value(name: str, after: float, before: float | None) -> float:
    """A metric's figure for one step: a counter's increase over it, else its value at its end."""
    counter = name.split("{")[0].endswith(("_total", "_count", "_sum"))
    return after - before if counter and before is not None else after


def _ref_line(name: str, ref: dict) -> str:
    return f"- {name}: " + ", ".join(f"{'dense' if s == 0 else f'{s:g}'} {r:.1f}" for s, r in ref.items())


CPU_PARTS = ("api", "tritonserver", "router", "budget models", "lane", "search", "other", "client")


def cpu_lines(steps: list[dict]) -> list[str]:
    """Where a trace's CPU went, per step: ms of CPU per request offered by part and the cores busy in all
    (``/proc`` of the server's processes and of this client, over the step)."""
    steps = [s for s in steps if "cpu" in s]
    if not steps:
        return []
    parts = [p for p in CPU_PARTS if any(p in s["cpu"]["ms_per_request"] for s in steps)]
    lines = ["CPU per request offered (ms; `/proc` of each process over the step) and cores busy in all:", "",
             "| rate | " + " | ".join(parts) + " | cores busy |", "|---" * (len(parts) + 2) + "|"]
    for s in steps:
        ms, cores = s["cpu"]["ms_per_request"], s["cpu"]["cores"]
        lines.append(f"| {s['multiple']:g}x | " + " | ".join(_cell(ms.get(p), ".2f") for p in parts)
                     + f" | {sum(cores.values()):.2f} |")
    return lines


def report_lines(out: dict) -> list[str]:
    lines = [f"# Serving the traffic applications send ({out['date']})", "", f"Machine: {out['machine']}", "",
             f"Command: `{out['command']}`", "",
             f"SLO {out['slo_ms']:g} ms (a 503 is a miss); requests through `POST /v1/embeddings` of `elastic-export "
             f"serve` (loopback, aiohttp, open loop, seeded Poisson steps of {out['step_s']:g} s, seed {out['seed']}); "
             "texts from `pydoc_data.topics` in the model's tokens: short queries "
             f"{SHORT_TOKENS[0]}-{SHORT_TOKENS[1]} tokens, documents {MIN_DOC_TOKENS}-{out['max_len']} tokens "
             f"(the context), {LONG_TOKENS}-token texts.", "",
             "Reference (requests/s, onnxruntime in this process before the server starts; batches of "
             f"{REF_BATCH} texts sorted by length; documents dense; median of {out['ref_rounds']} rounds):"]
    lines += [_ref_line(k, v) for k, v in out["reference"].items() if isinstance(v, dict)]
    if "index_docs_per_s" in out["reference"]:
        lines.append(f"- indexing: dense {INDEX_BATCH}-document requests "
                     f"{out['reference']['index_docs_per_s']:.1f} documents/s")
    lines += ["", "Before each step the trace's dense reference is measured again in this process (one round, the "
              "server idle between steps): the column 'x the step's own reference' is the step's rate over it."]
    if out.get("reference_after"):
        lines += ["", "The dense reference again after the load, the server stopped (the host's own speed moves on a "
                  "shared machine; a large change means the rates above were multiples of a different machine):",
                  *(f"- {t}: dense {d['after']:.1f} (before {d['before']:.1f}, {100 * d['change']:+.0f} %)"
                    for t, d in out["reference_after"].items())]
    lines += ["", f"Oracle: the densest budget s with rate x (1/ref_rate(s) + {CPU_PER_REQUEST_S * 1e3:g} ms / "
              f"{out['cores']} cores) <= {ORACLE_UTILISATION:g}, ref_rate the trace's reference at s (the sparsest "
              "when none fits). Quality: recall@10 per budget (`elastic-export eval`), mean over answered queries. "
              "SLO attainment counts every request of the trace (queries and documents); mean sparsity and dense "
              "share are over answered queries. Padding: any metric whose name says pad or waste on the API's or "
              "Triton's /metrics (a counter: its increase over the step)"
              + ("" if out["padding_exposed"] else ": the server exposes none, so the column is n/a") + ".", ""]
    for trace, steps in out["traces"].items():
        lines += [f"## {trace}", "", *table_lines(trace, steps), "", *cpu_lines(steps), ""]
        for s in steps:
            if "documents" in s:
                d = s["documents"]
                lines.append(f"- {s['multiple']:g}x: documents {d['answered']}/{d['offered']} answered, "
                             f"{100 * d['slo_attainment']:.1f} % within the SLO, all dense: {d['all_dense']}; queries "
                             f"{100 * s['query_slo_attainment']:.1f} % within the SLO")
            if "index" in s:
                x = s["index"]
                lines.append(f"- indexing client: {x['requests']} requests of {INDEX_BATCH} documents, {x['refused']} "
                             f"refused, {x['lost']} lost, {x['documents_per_s']:.1f} documents/s = "
                             f"{100 * x['fraction_of_reference']:.0f} % of the reference; every vector dense: "
                             f"{x['all_dense']}")
        lines.append("")
    lines += ["## Done means (issue 53)", ""]
    lines += [f"- {k}: {'-' if v is None else 'met' if v else 'NOT met'}" for k, v in out["verdict"].items()]
    return lines + ["", "![serve_traffic](serve_traffic.png)", ""]


def plot(path: Path, out: dict) -> None:
    """SLO attainment and mean served sparsity against the rate (x the trace's dense reference), per trace."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for trace, steps in out["traces"].items():
        x = [s["multiple"] for s in steps]
        style = {"marker": "o", "label": trace, "ls": "none" if trace == "index" else "-"}
        a1.plot(x, [100 * s["slo_attainment"] for s in steps], **style)
        a2.plot(x, [np.nan if s["mean_sparsity"] is None else s["mean_sparsity"] for s in steps], **style)
        if trace != "index":
            a2.plot(x, [s["oracle_sparsity"] for s in steps], ls=":", color=a2.lines[-1].get_color(), lw=1)
    a1.axhline(99, color="k", ls="--", lw=1)
    a1.set_ylabel("within the SLO (% of offered)")
    a2.set_ylabel("mean served sparsity (dotted: oracle)")
    for a in (a1, a2):
        a.set_xlabel("rate (x the trace's in-process dense reference)")
        a.legend(fontsize=8)
    fig.suptitle(f"elastic-export serve, SLO {out['slo_ms']:g} ms: {out['machine'][:90]}", fontsize=8)
    fig.tight_layout()
    from _png import save_png

    save_png(fig, path)


# --- main --------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifacts", type=Path, default=DEFAULT_ARTIFACTS)
    ap.add_argument("--traces", default=",".join(TRACES), help="comma-separated, among " + ", ".join(TRACES))
    ap.add_argument("--rates", default=",".join(f"{r:g}" for r in RATES), help="x the trace's dense reference")
    ap.add_argument("--step-s", type=float, default=10.0, help="seconds of each rate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slo-ms", type=float, default=250.0)
    ap.add_argument("--ref-rounds", type=int, default=REF_ROUNDS, help="rounds of the in-process reference")
    ap.add_argument("--request-timeout", type=float, default=30.0, help="client timeout of every request (s)")
    ap.add_argument("--server-log", type=Path, default=Path("/tmp/serve_traffic.server.log"))
    ap.add_argument("--no-write", action="store_true", help="print only; leave benchmarks/results as they are")
    args = ap.parse_args(argv)
    args.traces = [t.strip() for t in args.traces.split(",") if t.strip()]
    if not args.traces or set(args.traces) - set(TRACES):
        ap.error(f"--traces: choose among {', '.join(TRACES)}")
    args.rates = sorted(float(r) for r in args.rates.split(",") if r.strip())
    args.cores = os.cpu_count() or 1
    return args


def main(argv: list[str] | None = None) -> int:
    from elastic_export.core.manifest import Manifest
    from elastic_export.models.text import TextEncoder, tokenizer_folder

    args = parse_args(argv)
    d = ensure_artifacts(args.artifacts)
    manifest = Manifest.load(d)
    encoder = TextEncoder.from_dir(tokenizer_folder(manifest, d), [v.name for v in manifest.inputs])
    corpus = build_corpus(encoder)
    print(f"corpus: {len(corpus.queries)} short queries, {len(corpus.documents)} documents (median "
          f"{np.median(corpus.document_tokens):.0f} tokens), {len(corpus.long)} {LONG_TOKENS}-token texts", flush=True)
    sparsities = [0.0] + sorted(b.sparsity for b in manifest.budgets)
    metric, quality = quality_per_budget(d, sparsities)
    refs = measure_references(d, encoder, corpus, args.traces, sparsities, args.seed, args.ref_rounds)
    step_ref = StepReference(d, encoder, corpus, args.seed)
    try:
        with Server(d, args.slo_ms, args.server_log) as server:
            traces = asyncio.run(run_load(server, corpus, refs, args, quality, step_ref))
        after = {t: step_ref.dense(t, args.ref_rounds) for t in refs if t in TRACES}  # the server stopped
    finally:
        step_ref.close()
    out = {"date": time.strftime("%Y-%m-%d"), "machine": machine(),
           "command": "python benchmarks/serve_traffic.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "slo_ms": args.slo_ms, "step_s": args.step_s, "ref_rounds": args.ref_rounds, "seed": args.seed, "cores": args.cores,
           "artifacts": str(d), "max_len": corpus.max_len, "quality_metric": metric, "quality": quality,
           "reference": refs, "reference_after": reference_drift(refs, after), "traces": traces,
           "padding_exposed": any("padding_metrics" in s for st in traces.values() for s in st)}
    out["verdict"] = {k: v for t, st in traces.items() for k, v in verdict(t, st, args.slo_ms).items()}
    text = "\n".join(report_lines(out))
    if args.no_write:
        print(text)
    else:
        write_results("serve_traffic", out, text)
        plot(RESULTS / "serve_traffic.png", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
