"""The main job's quick evaluation: quality and speed of every (budget, precision), by default.

After the artifacts are written (``--no-quick-eval`` skips this), every (sparsity, precision) pair is
loaded once in an :class:`elastic_export.runtime.ElasticRuntime` (CPU execution provider, as a
server would load them) and

* **quality** on a *held-out* slice of the calibration source: up to :data:`HELDOUT` samples that
  the ranking did not see (the calibration draws ``--calib-size`` samples evenly spread over its
  source, :func:`elastic_export.calibration.load_calibration`; the held-out ones are spread over
  the rest, texts compared by value; synthetic images continue the calibration's random stream).
  ``fidelity_cosine``: mean cosine between the pair's pooled output and the dense fp32 model's
  (pooling as in ``elastic-export eval``). Text also ``recall@10``: each held-out text, encoded by
  the pair, queries an index of the held-out slice encoded once by the dense fp32 model; the share
  of the dense model's own 10 nearest neighbours of that text (itself excluded) among the pair's
  top 10 (:func:`neighbour_recall`; finding the text itself is too easy to tell budgets apart).
* **speed**: p50 / p90 / p99 latency and throughput (inputs / s at the p50) at batch sizes
  :data:`BATCHES`, :data:`REPEATS` timed runs after :data:`WARMUP` untimed ones, on the inputs
  ``elastic-export bench`` uses (the manifest's token count N); onnxruntime's default threads
  without spin-waiting (``SessionConfig(spin=False)``: with every pair loaded, idle sessions' spinning
  threads would otherwise take the CPU from the one that runs). A first look: ``elastic-export
  bench`` measures longer.

The results go to the manifest's ``quick_eval`` entry (field names below, defined once here)::

    {"heldout": {"source", "samples", "excluded", ...}, "metric": "fidelity_cosine",
     "speed": {"provider": "cpu", "batches": [1, 8], "repeats", "warmup", "seq_len"}, "seconds",
     "rows": [{"sparsity", "precision", "gflops", "fidelity_cosine", "recall@10",
               "speed": {"1": {"p50_ms", "p90_ms", "p99_ms", "throughput"}, "8": {...}}}, ...]}

and to ``DIR/latency_profile.json`` (:mod:`elastic_export.latency_profile`): the measured rows, the
``quality`` block (metric ``metric``: the runtime's latency-target policy then picks the
highest-quality pair meeting a target with no separate eval run) and the ``frontier`` per batch
(:mod:`elastic_export.frontier`). ``elastic-export bench`` later replaces the rows with longer
measurements and keeps the quality block.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import numpy as np

from elastic_export.latency_profile import PRECISION_ORDER, LatencyProfile, Pair, key, measure_profile, save_profile
from elastic_export.manifest import Manifest, as_manifest

ENTRY = "quick_eval"  # the manifest key
HELDOUT = 64  # held-out samples at most
BATCHES = (1, 8)
REPEATS = 3
WARMUP = 0  # the quality pass has run every session already
EVAL_BATCH = 16
FIDELITY = "fidelity_cosine"
RECALL = "recall@10"
QUALITY_METRIC = FIDELITY  # the figure copied to the latency profile (every modality has it)
SPEED_STATS = ("p50_ms", "p90_ms", "p99_ms", "throughput")
Feeds = dict[str, np.ndarray]


# --- held-out data ------------------------------------------------------------------------------
def heldout_texts(calib: str | None, calib_size: int, n: int = HELDOUT) -> tuple[list[str], dict]:
    """Up to ``n`` texts of the calibration source that the ranking's ``calib_size`` samples miss.

    Falls back to :func:`elastic_export.retrieval_data.heldout_pairs` documents (disjoint from the
    built-in calibration text) when the source has fewer than 2 texts left.
    """
    from elastic_export.calibration import _read_text_file, _spread, default_texts

    if calib is None:
        texts, source = default_texts(), "pydoc_data.topics (Python reference)"
    else:
        texts, source = _read_text_file(Path(calib)), str(calib)
    used = set(_spread(texts, calib_size))
    rest = list(dict.fromkeys(t for t in texts if t not in used))
    desc = {"source": source, "excluded": f"the {len(used)} calibration texts ({calib_size} spread evenly)"}
    if len(rest) < 2:
        from elastic_export.retrieval_data import heldout_pairs

        rest = [p["doc"] for p in heldout_pairs(n)]
        desc = {"source": "elastic_export.retrieval_data.heldout_pairs documents",
                "excluded": f"{source} has no text left beyond the {len(used)} calibration texts"}
    picked = _spread(rest, n)
    return picked, {**desc, "samples": len(picked)}


def _text_feeds(encoder, texts: list[str]) -> list[Feeds]:
    from elastic_export.calibration import _text_batches, by_length

    batches = _text_batches(encoder, by_length(encoder, texts), EVAL_BATCH)
    return [{k: v.numpy() for k, v in b.items()} for b in batches]


def heldout_images(encoder, calib: str | None, calib_size: int, seed: int, n: int = HELDOUT) -> tuple[list, dict]:
    """Up to ``n`` preprocessed images beyond the calibration set: the next synthetic images of
    the calibration's random stream, or the image files its evenly spread sample missed."""
    from elastic_export.calibration import _image_files, _spread, synthetic_images

    cfg = encoder.data_config
    rest = []
    if calib is not None:
        files = _image_files(Path(calib))
        used = set(_spread(files, calib_size))
        rest = _spread([f for f in files if f not in used], n)
    if not rest:
        imgs = synthetic_images(cfg, calib_size + n, seed)[calib_size:]
        note = "" if calib is None else f" ({calib} has no image left beyond the calibration set)"
        return imgs, {"source": f"synthetic colour fields (seed {seed}){note}", "samples": len(imgs),
                      "excluded": f"the first {calib_size} images of the stream (calibration)"}
    from PIL import Image

    from elastic_export import preprocess

    prep, imgs = preprocess.transform(cfg), []
    for f in rest:
        try:
            with Image.open(f) as img:
                imgs.append(prep(img))
        except Exception:  # noqa: BLE001 - undecodable files are skipped, as in calibration
            continue
    return imgs, {"source": str(calib), "samples": len(imgs),
                  "excluded": f"the {len(used)} calibration images ({calib_size} spread evenly)"}


def heldout_feeds(encoder, calib: str | None, calib_size: int, seed: int) -> tuple[list[Feeds], dict]:
    """Model inputs of the held-out slice, in batches of :data:`EVAL_BATCH`, and its description."""
    if encoder.modality == "text":
        texts, desc = heldout_texts(calib, calib_size)
        return _text_feeds(encoder, texts), desc
    imgs, desc = heldout_images(encoder, calib, calib_size, seed)
    if not imgs:
        raise ValueError(f"no decodable held-out image in {calib}")
    return [{"pixel_values": np.stack([t.numpy() for t in imgs[i:i + EVAL_BATCH]]).astype(np.float32)}
            for i in range(0, len(imgs), EVAL_BATCH)], desc


# --- quality ------------------------------------------------------------------------------------
def pooled(outputs: dict[str, np.ndarray], feeds: Feeds) -> np.ndarray:
    """One vector per input, pooled as ``elastic-export eval`` pools (any other output: flattened)."""
    from elastic_export.evaluation import IMAGE_EMBEDDINGS, _pool_text

    if "attention_mask" in feeds and ("sentence_embedding" in outputs or "last_hidden_state" in outputs):
        return _pool_text(outputs, feeds["attention_mask"]).astype(np.float32)
    for name in IMAGE_EMBEDDINGS:
        if name in outputs:
            return outputs[name].astype(np.float32)
    if "last_hidden_state" in outputs:
        return outputs["last_hidden_state"].mean(1).astype(np.float32)
    first = next(iter(outputs.values()))
    return first.reshape(len(first), -1).astype(np.float32)


def neighbour_recall(queries: np.ndarray, index: np.ndarray, k: int = 10) -> float:
    """Recall@k against a dense index: for each row i, the share of the dense top-k neighbours of
    ``index[i]`` (itself excluded) that ``queries[i]`` finds among its own top-k in ``index``.

    Args:
        queries: the pair's embeddings of the held-out samples.
        index: the dense fp32 model's embeddings of the same samples (row i = the same sample).
        k: neighbours (at most the number of samples - 1).
    """
    from elastic_export.evaluation import _normalize

    k = min(k, len(index) - 1)
    q, d = _normalize(queries), _normalize(index)
    truth, got = d @ d.T, q @ d.T
    np.fill_diagonal(truth, -np.inf)
    np.fill_diagonal(got, -np.inf)
    want = np.argsort(-truth, axis=1, kind="stable")[:, :k]
    have = np.argsort(-got, axis=1, kind="stable")[:, :k]
    return float(np.mean([len(set(a) & set(b)) / k for a, b in zip(want, have)]))


def quality(rt, batches: list[Feeds], text: bool) -> dict[Pair, dict[str, float]]:
    """Fidelity (and recall@10 for text) of every loaded pair against the dense fp32 model."""
    from elastic_export.evaluation import mean_cosine

    emb = {pair: np.concatenate([pooled(rt.run(f, sparsity=pair[0], precision=pair[1]), f) for f in batches])
           for pair in rt.pairs}
    ref = emb[(0.0, "fp32")]
    out = {}
    for pair, e in emb.items():
        out[pair] = {FIDELITY: mean_cosine(e, ref)}
        if text and len(ref) > 1:
            out[pair][RECALL] = neighbour_recall(e, ref)
    return out


# --- the whole step -----------------------------------------------------------------------------
def speed_feeds(directory: Path, manifest: Manifest) -> dict[int, Feeds]:
    """The inputs ``elastic-export bench`` times, at each of :data:`BATCHES`."""
    from elastic_export.bench import sample_feeds

    return {b: sample_feeds(directory, manifest, b, None) for b in BATCHES}


def entry_rows(manifest: Manifest, qual: dict[Pair, dict[str, float]], prof: LatencyProfile) -> list[dict]:
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



def run_quick_eval(directory: Path, manifest: Manifest | dict, encoder, calib: str | None, calib_size: int, seed: int,
                   echo: Callable[[str], None] = print) -> dict:
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
    """
    from elastic_export.frontier import profile_frontier
    from elastic_export.runtime import ElasticRuntime
    from elastic_export.targets.onnxruntime import SessionConfig

    manifest = as_manifest(manifest)
    t0 = time.time()
    batches, heldout = heldout_feeds(encoder, calib, calib_size, seed)
    rt = ElasticRuntime.from_dir(directory, precisions="all", config=SessionConfig(spin=False))
    qual = quality(rt, batches, text=encoder.modality == "text")
    figures = {pair: q[QUALITY_METRIC] for pair, q in qual.items()}
    prof = measure_profile(rt, speed_feeds(directory, manifest), repeats=REPEATS, warmup=WARMUP,
                           quality=figures, quality_metric=QUALITY_METRIC)
    prof.frontier = profile_frontier({p: prof.rows(p) for p in prof.measured_precisions()}, figures, QUALITY_METRIC)
    save_profile(prof, directory)
    rows = entry_rows(manifest, qual, prof)
    seconds = round(time.time() - t0, 1)
    echo(f"quick eval: {len(rows)} (budget, precision) pairs on {heldout['samples']} held-out samples, "
         f"batches {', '.join(map(str, BATCHES))}, in {seconds:.1f}s")
    return {"heldout": heldout, "metric": QUALITY_METRIC,
            "speed": {"provider": rt.provider, "batches": list(BATCHES), "repeats": REPEATS, "warmup": WARMUP,
                      "threads": "onnxruntime default", "spin": False, "seq_len": manifest.tokens},
            "seconds": seconds, "rows": rows}


# --- views of the entry (the report draws them like eval / bench results) -----------------------
def as_eval_result(manifest: Manifest) -> dict | None:
    """The manifest's ``quick_eval`` entry as an ``elastic-export eval`` result (None without one)."""
    qe = manifest.quick_eval
    if not isinstance(qe, dict) or not isinstance(qe.get("rows"), list):
        return None
    held = qe.get("heldout") or {}
    return {"datasets": {"held-out": {"source": held.get("source"), "count": held.get("samples")}},
            "results": [{"label": "quick eval", "method": manifest.ranking.method, "dir": ".",
                         "budgets": [r for r in qe["rows"] if isinstance(r, dict)]}]}


def as_bench_result(manifest: Manifest) -> dict | None:
    """The speed of the manifest's ``quick_eval`` entry as an ``elastic-export bench`` result (None
    without one): rows per (batch, sparsity, precision), speedup over the dense fp32 model."""
    qe = manifest.quick_eval
    if not isinstance(qe, dict) or not isinstance(qe.get("rows"), list):
        return None
    dense_gflops = float(manifest.dense.gflops)
    base = {b: st["throughput"] for r in qe["rows"] if r.get("sparsity") == 0.0 and r.get("precision") == "fp32"
            for b, st in (r.get("speed") or {}).items()}
    rows = []
    for r in qe["rows"]:
        for b, st in (r.get("speed") or {}).items():
            rows.append({"sparsity": r["sparsity"], "precision": r["precision"], "gflops": r["gflops"],
                         "flop_ratio": dense_gflops / float(r["gflops"]), "batch": int(b), **st,
                         "speedup": st["throughput"] / base[b] if b in base else None, "switch_ms": None})
    speed = qe.get("speed") or {}
    return {"format": "elastic-export-bench/1", "backend": "onnxruntime", "provider": speed.get("provider"),
            "runtime": "the main job's quick eval", "machine": {},
            "settings": {"repeats": speed.get("repeats"), "seq_len": speed.get("seq_len"),
                         "threads": speed.get("threads")}, "rows": rows}
