"""The main job's quick evaluation: quality and speed of every (budget, precision), by default.

After the artifacts are written (``--no-quick-eval`` skips this), every (sparsity, precision) pair is
loaded once in an :class:`elastic_export.serving.runtime.ElasticRuntime` (CPU execution provider, as a
server would load them) and

* **quality** on a *held-out* slice of the calibration source: up to :data:`HELDOUT` samples that
  the ranking did not see (the calibration draws ``--calib-size`` samples evenly spread over its
  source, :func:`elastic_export.data.calibration.load_calibration`; the held-out ones are spread over
  the rest, no text equal to, a prefix of or starting with a calibration text; synthetic images continue
  the calibration's random stream). A ``--ranking`` made on other data: what its file says it was
  calibrated on is held out too, or the entry's ``heldout.not_guaranteed`` says what could not be.
  ``fidelity_cosine``: mean cosine between the pair's pooled output and the dense fp32 model's
  (pooling as in ``elastic-export eval``). Text also ``neighbour_overlap@10`` ("neighbour overlap@10
  (vs dense)"): each held-out text, encoded by the pair, queries an index of the held-out slice
  encoded once by the dense fp32 model; the share of the dense model's own 10 nearest neighbours of
  that text (itself excluded) among the pair's top 10 (:func:`neighbour_overlaps`; finding the text
  itself is too easy to tell budgets apart). The dense model scores 1.0 by construction: it is
  *not* query->document retrieval recall (``elastic-export eval``'s ``recall@10``), and falls much
  faster with the budget. Entries written before the rename call it ``recall@10``
  (:func:`entry_of` reads them). Each figure has its 95 % bootstrap band over the held-out samples
  (``ci95``, :func:`elastic_export.measure.metrics.bootstrap_ci`).
* **speed**: p50 / p90 / p99 latency and throughput (inputs / s at the p50) at batch sizes
  :data:`BATCHES`, in interleaved rounds (:func:`time_interleaved`: every pair once per round, so
  a burst of load on a shared machine falls on all pairs alike; :data:`MIN_ROUNDS` to
  :data:`MAX_ROUNDS` rounds within :data:`SPEED_SECONDS` per batch size, fewer once every p50 is
  pinned to :data:`SPEED_PRECISION`, :data:`LEAST_ROUNDS` where one round takes seconds), on the
  inputs ``elastic-export bench`` uses (the manifest's token count N); onnxruntime's default
  threads without spin-waiting (``SessionConfig(spin=False)``: with every pair loaded, idle
  sessions' spinning threads would otherwise take the CPU from the one that runs). A first look:
  ``elastic-export bench`` measures longer.

The results go to the manifest's ``quick_eval`` entry (field names below, defined once here)::

    {"heldout": {"source", "samples", "excluded", ...}, "metric": "fidelity_cosine",
     "samples": {"fidelity_cosine": 64, "neighbour_overlap@10": 64}, "bootstrap": {...},
     "speed": {"provider": "cpu", "batches": [1, 8], "repeats": {"1": 14, "8": 3}, "warmup",
               "schedule", "seconds", "threads", "spin", "seq_len", "machine": {"cpu", ...}}, "seconds",
     "rows": [{"sparsity", "precision", "gflops", "fidelity_cosine", "neighbour_overlap@10",
               "ci95": {"fidelity_cosine": [low, high], ...},
               "speed": {"1": {"p50_ms", "p90_ms", "p99_ms", "throughput"}, "8": {...}}}, ...]}

and to ``DIR/latency_profile.json`` (:mod:`elastic_export.core.latency_profile`): the measured rows, the
``quality`` block (metric ``metric``: the runtime's latency-target policy then picks the
highest-quality pair meeting a target with no separate eval run) and the ``frontier`` per batch
(:mod:`elastic_export.measure.frontier`). ``elastic-export bench`` later replaces the rows with longer
measurements and keeps the quality block.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from elastic_export.core import results
from elastic_export.core.errors import UserError
from elastic_export.core.latency_profile import (
    PRECISION_ORDER,
    LatencyProfile,
    Pair,
    key,
    profile_of,
    save_profile,
)
from elastic_export.core.manifest import Manifest
from elastic_export.measure.evaluation import CI_KEY, NEIGHBOUR_OVERLAP, SAMPLES_KEY
from elastic_export.measure.metrics import BOOTSTRAP, neighbour_overlaps
from elastic_export.measure.timing import latency_stats, profile_stats

if TYPE_CHECKING:
    from elastic_export.data.calibration import Drawn

ENTRY = "quick_eval"  # the manifest key
LABEL = "quick eval"  # the records' label (the report's curve name)
HELDOUT = 64  # held-out samples at most
BATCHES = (1, 8)
#: timing: interleaved rounds (every pair once per round, the start rotating), at least MIN_ROUNDS
#: (LEAST_ROUNDS where the first round alone took LONG_ROUND times the batch size's SPEED_SECONDS: a
#: large model at batch 8, seconds a round), at most MAX_ROUNDS, ending once a batch size has had its
#: SPEED_SECONDS or every pair's p50 is pinned to SPEED_PRECISION (half-width of its 95 %
#: distribution-free interval, relative)
MIN_ROUNDS = 3
LEAST_ROUNDS = 2
LONG_ROUND = 3.0
MAX_ROUNDS = 15  # tiny test models (ms per run) rarely pin their p50: this bounds their cost
SPEED_SECONDS = {1: 1.0, 8: 1.0}  # per batch size; another size gets the largest (`bench` times precisely)
SPEED_PRECISION = 0.03
WARMUP = 0  # the quality pass has run every session already
EVAL_BATCH = 16
FIDELITY = "fidelity_cosine"
OVERLAP = NEIGHBOUR_OVERLAP  # the share of the dense model's own 10 neighbours found (dense = 1.0)
LEGACY_OVERLAP = "recall@10"  # what entries written before the rename call the overlap (still read)
QUALITY_METRIC = FIDELITY  # the figure copied to the latency profile (every modality has it)
LEGEND = {FIDELITY: "mean cosine to the dense fp32 embedding",
          OVERLAP: "neighbour overlap@10 (vs dense): share of the dense model's 10 nearest held-out neighbours found, "
                   "dense = 1.0; not retrieval recall (elastic-export eval DIR measures that)"}
SPEED_STATS = ("p50_ms", "p90_ms", "p99_ms", "throughput")
Feeds = dict[str, np.ndarray]


# --- held-out data ------------------------------------------------------------------------------
def heldout_texts(calib: str | None, calib_size: int, n: int = HELDOUT,
                  ranking: Drawn | None = None) -> tuple[list[str], dict]:
    """Up to ``n`` texts of the calibration source that the ``calib_size`` calibration samples miss,
    and that ``ranking`` (what the ranking was calibrated on, when another sample) missed too; no
    held-out text is a prefix of one of them or starts with one (:func:`~elastic_export.data.calibration.overlapping`).
    The description's ``not_guaranteed`` says why, where the ranking's texts cannot be known.

    Falls back to :func:`elastic_export.data.retrieval_data.heldout_pairs` documents (disjoint from the
    built-in calibration text) when the source has fewer than 2 texts left.
    """
    from elastic_export.data.calibration import (
        DEFAULT_TEXT_SOURCE,
        Drawn,
        drawn_texts,
        evenly_spaced,
        overlapping,
        source_texts,
    )

    texts, source = source_texts(calib), DEFAULT_TEXT_SOURCE if calib is None else str(calib)
    used = evenly_spaced(texts, calib_size)
    theirs, caveat = drawn_texts(ranking, Drawn(calib, calib_size))
    excluded = (f"the {len(used)} calibration texts ({calib_size} spread evenly)"
                + (f", the ranking's {len(theirs)} ({ranking})" if theirs else "")
                + ", and every text that is a prefix of one of them or starts with one")
    clash = overlapping(texts, used + theirs)
    rest = list(dict.fromkeys(t for t in texts if t not in clash))
    desc = {"source": source, "excluded": excluded}
    if len(rest) < 2:
        from elastic_export.data.retrieval_data import heldout_pairs

        docs = [p["doc"] for p in heldout_pairs(n)]
        clash = overlapping(docs, used + theirs)
        rest = [d for d in docs if d not in clash]
        desc = {"source": "elastic_export.data.retrieval_data.heldout_pairs documents",
                "excluded": f"{source} has no text left beyond the {len(used)} calibration texts"}
    picked = evenly_spaced(rest, n)
    return picked, {**desc, "samples": len(picked), **({"not_guaranteed": caveat} if caveat else {})}


def _text_feeds(encoder, texts: list[str]) -> list[Feeds]:
    from elastic_export.data.calibration import by_length, text_batches

    batches = text_batches(encoder, by_length(encoder, texts), EVAL_BATCH)
    return [{k: v.numpy() for k, v in b.items()} for b in batches]


def heldout_images(encoder, calib: str | None, calib_size: int, seed: int, n: int = HELDOUT,
                   ranking: Drawn | None = None) -> tuple[list, dict]:
    """Up to ``n`` preprocessed images beyond the calibration set and beyond ``ranking`` (what the
    ranking was calibrated on): the next synthetic images of the calibration's random stream, or the
    image files their evenly spread samples missed (``not_guaranteed``, as for :func:`heldout_texts`)."""
    from elastic_export.data.calibration import (
        SYNTHETIC_SOURCE,
        Drawn,
        drawn_files,
        evenly_spaced,
        image_files,
        synthetic_images,
        synthetic_skip,
    )

    cfg = encoder.data_config
    rest, caveat = [], None
    if calib is not None:
        files = image_files(Path(calib))
        theirs, caveat = drawn_files(ranking, Drawn(calib, calib_size))
        used = set(evenly_spaced(files, calib_size))
        rest = evenly_spaced([f for f in files if f not in used and f.resolve() not in theirs], n)
    if not rest:
        skip, caveat = synthetic_skip(ranking, calib_size, seed)
        imgs = synthetic_images(cfg, skip + n, seed)[skip:]
        note = "" if calib is None else f" ({calib} has no image left beyond the calibration set)"
        return imgs, {"source": f"{SYNTHETIC_SOURCE} (seed {seed}){note}", "samples": len(imgs),
                      "excluded": f"the first {skip} images of the stream (calibration"
                                  + (", and the ranking's)" if skip > calib_size else ")"),
                      **({"not_guaranteed": caveat} if caveat else {})}
    from PIL import Image

    from elastic_export.models import preprocess

    prep, imgs = preprocess.transform(cfg), []
    for f in rest:
        try:
            with Image.open(f) as img:
                imgs.append(prep(img))
        except Exception:  # noqa: BLE001 - undecodable files are skipped, as in calibration
            continue
    excluded = f"the {len(used)} calibration images ({calib_size} spread evenly)" + (
        f", the ranking's {len(theirs)} ({ranking})" if theirs else "")
    return imgs, {"source": str(calib), "samples": len(imgs), "excluded": excluded,
                  **({"not_guaranteed": caveat} if caveat else {})}


def ranking_calibration(directory: Path, manifest: Manifest) -> Drawn | None:
    """What the directory's ranking file says the ranking was calibrated on (``--ranking`` may reuse
    one made on other data); None when it read no data or there is no ranking file."""
    from elastic_export.core.manifest import resolve
    from elastic_export.data.calibration import Drawn
    from elastic_export.ranking.file import load_ranking

    path = resolve(Path(directory), manifest.ranking.file)
    return Drawn.from_meta(load_ranking(path).meta) if path is not None and path.is_file() else None


def heldout_feeds(encoder, calib: str | None, calib_size: int, seed: int,
                  ranking: Drawn | None = None) -> tuple[list[Feeds], dict]:
    """Model inputs of the held-out slice, in batches of :data:`EVAL_BATCH`, and its description."""
    if encoder.modality == "text":
        texts, desc = heldout_texts(calib, calib_size, ranking=ranking)
        return _text_feeds(encoder, texts), desc
    imgs, desc = heldout_images(encoder, calib, calib_size, seed, ranking=ranking)
    if not imgs:
        raise ValueError(f"no decodable held-out image in {calib}")
    return [{"pixel_values": np.stack([t.numpy() for t in imgs[i:i + EVAL_BATCH]]).astype(np.float32)}
            for i in range(0, len(imgs), EVAL_BATCH)], desc


# --- quality ------------------------------------------------------------------------------------
def pooled(outputs: dict[str, np.ndarray], feeds: Feeds) -> np.ndarray:
    """One vector per input, pooled as ``elastic-export eval`` pools (any other output: flattened)."""
    from elastic_export.measure.evaluation import IMAGE_EMBEDDINGS, pool_text

    if "attention_mask" in feeds and ("sentence_embedding" in outputs or "last_hidden_state" in outputs):
        return pool_text(outputs, feeds["attention_mask"]).astype(np.float32)
    for name in IMAGE_EMBEDDINGS:
        if name in outputs:
            return outputs[name].astype(np.float32)
    if "last_hidden_state" in outputs:
        return outputs["last_hidden_state"].mean(1).astype(np.float32)
    first = next(iter(outputs.values()))
    return first.reshape(len(first), -1).astype(np.float32)


def quality(rt, batches: list[Feeds], text: bool) -> dict[Pair, dict]:
    """Fidelity (and neighbour overlap@10 for text) of every loaded pair against the dense fp32 model,
    each with its bootstrap band over the held-out samples (``ci95``)."""
    from elastic_export.measure.metrics import cosines, summarise

    emb = {pair: np.concatenate([pooled(rt.run(f, sparsity=pair[0], precision=pair[1]), f) for f in batches])
           for pair in rt.pairs}
    ref = emb[(0.0, "fp32")]
    out = {}
    for pair, e in emb.items():
        samples = {FIDELITY: cosines(e, ref)}
        if text and len(ref) > 1:
            samples[OVERLAP] = neighbour_overlaps(e, ref)
        values, ci = summarise(samples)
        out[pair] = {**values, CI_KEY: ci}
    return out


# --- speed --------------------------------------------------------------------------------------
def median_spread(times: list[float]) -> float:
    """Half-width of the distribution-free 95 % interval of the median (order statistics), relative
    to the median (inf with fewer than 2 runs)."""
    n = len(times)
    if n < 2:
        return float("inf")
    v, h = np.sort(times), 0.98 * np.sqrt(n)
    lo, hi = v[max(0, int(np.floor(n / 2 - h)))], v[min(n - 1, int(np.ceil(n / 2 + h)))]
    return float((hi - lo) / 2 / max(float(np.median(v)), 1e-12))


def time_interleaved(rt, feeds: Feeds, seconds: float, min_rounds: int = MIN_ROUNDS,
                     max_rounds: int = MAX_ROUNDS) -> dict[Pair, list[float]]:
    """Timed runs (ms) of every pair of ``rt`` on ``feeds``, in interleaved rounds: each round runs
    every pair once, the first pair rotating, so a burst of load on the machine falls on all pairs
    alike instead of on the ones timed during it. Ends after ``max_rounds``, or from
    ``min_rounds`` on (:data:`LEAST_ROUNDS`, at most, when the first round took :data:`LONG_ROUND`
    times ``seconds``) once ``seconds`` have passed or every pair's :func:`median_spread` is at most
    :data:`SPEED_PRECISION`."""
    pairs = list(rt.pairs)
    times: dict[Pair, list[float]] = {pair: [] for pair in pairs}
    start = time.perf_counter()
    for r in range(max_rounds):
        for pair in pairs[r % len(pairs):] + pairs[:r % len(pairs)]:
            t0 = time.perf_counter()
            rt.run(feeds, sparsity=pair[0], precision=pair[1])
            times[pair].append((time.perf_counter() - t0) * 1e3)
        if r == 0 and time.perf_counter() - start >= LONG_ROUND * seconds:
            min_rounds = min(min_rounds, LEAST_ROUNDS)
        if r + 1 >= min_rounds and (time.perf_counter() - start >= seconds
                                    or max(map(median_spread, times.values())) <= SPEED_PRECISION):
            break
    return times


def measure_speed(rt, feeds_by_batch: dict[int, Feeds], figures: dict[Pair, float]) -> tuple[LatencyProfile, dict]:
    """The latency profile of every pair at every batch size (:func:`time_interleaved`) with the
    quality ``figures``, and the timed runs per pair at each batch size (``{"1": 14, "8": 3}``)."""
    rows: dict[str, dict] = {}
    runs = {}
    for b, feeds in sorted(feeds_by_batch.items()):
        times = time_interleaved(rt, feeds, SPEED_SECONDS.get(b, max(SPEED_SECONDS.values())))
        runs[str(b)] = min(len(v) for v in times.values())
        for (s, p), v in times.items():
            rows.setdefault(p, {}).setdefault(int(b), {})[s] = profile_stats(latency_stats(np.asarray(v) / 1e3, int(b)))
    return profile_of(rt, rows, figures, QUALITY_METRIC), runs


# --- the whole step -----------------------------------------------------------------------------
def speed_feeds(directory: Path, manifest: Manifest, dense=None) -> dict[int, Feeds]:
    """The inputs ``elastic-export bench`` times, at each of :data:`BATCHES` (``dense``: the dense
    ONNX model, when the caller has it in memory)."""
    from elastic_export.measure.timing import dense_graph, sample_feeds

    dense = dense_graph(directory, manifest) if dense is None else dense
    return {b: sample_feeds(directory, manifest, b, None, dense) for b in BATCHES}


def entry_rows(manifest: Manifest, qual: dict[Pair, dict], prof: LatencyProfile) -> list[dict]:
    """The ``rows`` of the manifest entry: one per pair, dense first, by precision then sparsity."""
    gflops = {0.0: manifest.dense.gflops, **{key(b.sparsity): b.gflops for b in manifest.budgets}}
    rows = []
    for s, p in sorted(qual, key=lambda pair: (PRECISION_ORDER.index(pair[1]), pair[0])):
        speed = {}
        for b in prof.batch_sizes():
            st = prof.rows(p).get(b, {}).get(s)
            if st is not None:
                speed[str(b)] = {**st, "throughput": b / (st["p50_ms"] / 1e3)}
        rows.append({"sparsity": s, "precision": p, "gflops": gflops.get(s), **qual[(s, p)], "speed": speed})
    return rows


def run_quick_eval(directory: Path, manifest: Manifest, encoder, calib: str | None, calib_size: int, seed: int,
                   echo: Callable[[str], None] = print, dense=None) -> dict:
    """Measure every pair of the artifact ``directory`` (its manifest already written); write
    ``DIR/latency_profile.json``; return the manifest's ``quick_eval`` entry (module docstring).

    Args:
        directory: the artifact directory.
        manifest: its manifest.
        encoder: the model (tokenizer, preprocessing, modality).
        calib: the calibration source (``--calib``; None: built in).
        calib_size: samples the calibration took from it (held out: the others).
        seed: the calibration seed (synthetic images).
        echo: progress lines.
        dense: the dense ONNX model in memory (its vocabulary: the timed inputs); None reads its file.
    """
    from elastic_export.measure.frontier import profile_frontier
    from elastic_export.measure.timing import machine
    from elastic_export.serving.runtime import ElasticRuntime
    from elastic_export.targets.onnxruntime import SessionConfig

    t0 = time.time()
    batches, heldout = heldout_feeds(encoder, calib, calib_size, seed, ranking_calibration(directory, manifest))
    if heldout.get("not_guaranteed"):
        echo(f"warning: quick eval: {heldout['not_guaranteed']}")
    rt = ElasticRuntime.from_dir(directory, precisions="all", config=SessionConfig(spin=False))
    qual = quality(rt, batches, text=encoder.modality == "text")
    figures = {pair: q[QUALITY_METRIC] for pair, q in qual.items()}
    t_speed = time.time()
    prof, runs = measure_speed(rt, speed_feeds(directory, manifest, dense), figures)
    speed_s = time.time() - t_speed
    prof.frontier = profile_frontier({p: prof.rows(p) for p in prof.measured_precisions()}, figures, QUALITY_METRIC)
    save_profile(prof, directory)
    rows = entry_rows(manifest, qual, prof)
    seconds = round(time.time() - t0, 1)
    echo(f"quick eval: {len(rows)} (budget, precision) pairs on {heldout['samples']} held-out samples, "
         f"batches {', '.join(map(str, BATCHES))} ({' / '.join(map(str, runs.values()))} interleaved runs, "
         f"{speed_s:.1f}s), in {seconds:.1f}s")
    metrics = [m for m in (FIDELITY, OVERLAP) if m in rows[0]]
    pairs = {"heldout": heldout, "metric": QUALITY_METRIC, SAMPLES_KEY: {m: heldout["samples"] for m in metrics},
             "bootstrap": BOOTSTRAP,
             "speed": {"provider": rt.provider, "batches": list(BATCHES), "repeats": runs, "warmup": WARMUP,
                       "schedule": "interleaved rounds", "seconds": round(speed_s, 1),
                       "threads": "onnxruntime default", "spin": False, "seq_len": manifest.tokens,
                       "machine": machine()},
             "seconds": seconds, "rows": rows}
    return results.from_quick_eval(pairs, method=manifest.ranking.method, model=manifest.model.source).to_json()


# --- the entry read back (any format the main job ever wrote) ------------------------------------
def _renamed(d: dict) -> dict:
    """Today's metric names in a record (entries written before the rename call the overlap ``recall@10``)."""
    d = {(OVERLAP if k == LEGACY_OVERLAP else k): v for k, v in d.items()}
    if isinstance(d.get(CI_KEY), dict):
        d[CI_KEY] = {(OVERLAP if k == LEGACY_OVERLAP else k): v for k, v in d[CI_KEY].items()}
    return d


def results_of(manifest: Manifest, directory: str = ".") -> results.Results | None:
    """The manifest's ``quick_eval`` entry as results (:mod:`elastic_export.core.results`), in today's
    metric names, its records naming ``directory`` (the report's name for it); None without one."""
    qe = manifest.quick_eval
    try:
        res = results.parse(qe, "quick_eval") if isinstance(qe, dict) else None
    except UserError:
        return None
    if res is None or res.kind != "quick_eval":
        return None
    res.records = [{**_renamed(r), "dir": directory, "method": r.get("method") or manifest.ranking.method}
                   for r in res.records]
    own = res.samples.get(LABEL) or {}
    if not own:
        n = (res.settings.get("heldout") or {}).get("samples")
        own = {m: n for m in (FIDELITY, OVERLAP) if any(m in r for r in res.quality())}
    res.samples = {**res.samples, LABEL: _renamed(own)}
    return res


def entry_of(manifest: Manifest) -> dict | None:
    """The quick eval as one row per pair (``rows``, each with its ``speed`` per batch size), with
    ``heldout``, ``metric``, ``samples`` and ``speed`` settings; None without an entry."""
    res = results_of(manifest)
    if res is None:
        return None
    rows, by_pair = [], {}
    for r in res.quality():
        row = {k: v for k, v in r.items() if k not in results.IDENTITY and k != results.BATCH}
        rows.append({**row, "speed": {}})
        by_pair[(key(r["sparsity"]), str(r.get("precision", "fp32")))] = rows[-1]
    for r in res.speed():
        row = by_pair.get((key(r["sparsity"]), str(r.get("precision", "fp32"))))
        if row is not None:
            row["speed"][str(r[results.BATCH])] = {k: r[k] for k in SPEED_STATS if k in r}
    return {**res.settings, "speed": {**(res.settings.get("speed") or {}), "machine": res.machine},
            SAMPLES_KEY: res.samples[LABEL], "rows": rows}


def table_columns(manifest: Manifest) -> tuple[list[str], dict[Pair, list[str]], list[str]] | None:
    """The main job's terminal table columns from the quick eval: (headers, cells per (sparsity,
    precision), legend lines); None without an entry."""
    qe = entry_of(manifest)
    if qe is None:
        return None
    metrics = [m for m in (FIDELITY, OVERLAP) if any(isinstance(r.get(m), (int, float)) for r in qe["rows"])]
    batches = [str(b) for b in (qe.get("speed") or {}).get("batches", BATCHES)]
    head = [{FIDELITY: "fidelity", OVERLAP: "overlap@10"}[m] for m in metrics] + [f"p50 ms b{b}" for b in batches]
    cells = {}
    for r in qe["rows"]:
        q = [f"{r[m]:.4f}" if m == FIDELITY else f"{r[m]:.3f}" for m in metrics if isinstance(r.get(m), (int, float))]
        t = [f"{(r.get('speed') or {}).get(b, {}).get('p50_ms', float('nan')):.1f}" for b in batches]
        cells[(key(r["sparsity"]), str(r.get("precision", "fp32")))] = q + t
    n, runs = (qe.get("heldout") or {}).get("samples"), (qe.get("speed") or {}).get("repeats")
    runs = (" / ".join(f"{v}" for v in runs.values()) + " interleaved" if isinstance(runs, dict) else runs)
    legend = [f"quick eval on {n} held-out samples: " + "; ".join(f"{h} = {LEGEND[m]}" for h, m in zip(head, metrics)),
              f"p50 ms b1 / b8 = median latency at batch 1 / 8 over {runs} runs (onnxruntime CPU)"]
    return head, cells, legend
