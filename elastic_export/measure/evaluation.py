"""``elastic-export eval``: how good is every budget of an artifact directory?

It measures the exported ONNX files (what users deploy) in onnxruntime CPU sessions; the torch model
is never used. For the dense model and every budget of each directory:

* **fidelity** (``fidelity_cosine``): mean cosine similarity between the budget's pooled output and
  the dense model's on held-out inputs (text: every query and document of the retrieval pairs;
  images: the image folder, or deterministic synthetic images when none is given). The pooled output
  is ``sentence_embedding`` when the artifacts have it, else the attention-masked mean of
  ``last_hidden_state`` (text); ``pooler_output`` when present, else the mean of
  ``last_hidden_state`` over tokens (images).
* **retrieval** (text): from {query, doc} pairs, doc ``i`` relevant to query ``i``; cosine similarity
  of L2-normalised embeddings. *Asymmetric* ``recall@1`` / ``recall@10``: queries encoded by the
  budget's model against a *dense* index (documents encoded once by the dense model), the deployment
  where the index is not re-encoded. *Symmetric* ``sym_recall@1`` / ``sym_recall@10``: both sides by
  the budget's model. A query counts as a hit at k when fewer than k documents score strictly higher
  than its own.
* **k-NN accuracy** (images, ``knn@1`` / ``knn@10``): a labelled folder (one sub-folder per class),
  features of index and queries by the budget's model, majority vote of the k nearest (ties go to
  the class with the larger summed similarity); leave-one-out by default, or a per-class held-out
  fraction (``split``).

Every figure is a mean over queries / inputs; each row also holds its 95 % percentile bootstrap band
(``ci95``, :func:`bootstrap_ci`: 1,000 resamples of those queries / inputs, seed 0, the same
resamples for every budget) and each result the sample count per metric (``samples``).
``elastic-export eval DIR`` without ``--out`` writes :data:`EVAL_RESULTS` into every DIR, where
``elastic-export report`` finds it.

The default retrieval set is :func:`elastic_export.data.retrieval_data.heldout_pairs` (standard-library
docstrings, disjoint from the calibration text).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from elastic_export.core import results as schema
from elastic_export.core.errors import UserError, first_line
from elastic_export.core.fileio import atomic_write, check_creatable
from elastic_export.core.manifest import MANIFEST, Manifest
from elastic_export.core.precisions import FILE_KEYS
from elastic_export.measure.metrics import BOOTSTRAP, cosines, knn_hits, own_ranks, summarise

TEXT_METRICS = ("fidelity_cosine", "recall@1", "recall@10", "sym_recall@1", "sym_recall@10")
IMAGE_METRICS = ("fidelity_cosine", "knn@1", "knn@10")
NEIGHBOUR_OVERLAP = "neighbour_overlap@10"  # the main job's quick eval (elastic_export.measure.quick_eval); not retrieval
#: what each metric key is called wherever a person reads it (report, terminal): the quick eval's
#: neighbour overlap (dense = 1.0 by construction) is never called recall
METRIC_LABELS = {
    "fidelity_cosine": "fidelity (cosine to dense fp32)",
    "recall@1": "retrieval recall@1 (dense index)", "recall@10": "retrieval recall@10 (dense index)",
    "sym_recall@1": "retrieval recall@1 (symmetric)", "sym_recall@10": "retrieval recall@10 (symmetric)",
    "knn@1": "k-NN accuracy@1", "knn@10": "k-NN accuracy@10",
    NEIGHBOUR_OVERLAP: "neighbour overlap@10 (vs dense)",
}
CI_KEY = "ci95"  # a result row's {metric: [low, high]}: the bootstrap band of every quality figure
SAMPLES_KEY = "samples"  # a result's {metric: how many queries / inputs each figure averages}
EVAL_RESULTS = "eval.json"  # `elastic-export eval DIR` without --out writes DIR/eval.json (the report reads it)
DEFAULT_PAIRS = 1000
SYNTHETIC_IMAGES = 64
SYNTHETIC_SEED = 12345  # not the calibration seed: held-out synthetic inputs
TEXT_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


# --- artifact directories -----------------------------------------------------------------------
@dataclass
class Artifact:
    """One artifact directory: its manifest and the ONNX file of the dense model and every budget."""

    given: str
    directory: Path
    manifest: Manifest
    modality: str
    models: list[dict] = field(default_factory=list)  # {sparsity, achieved_sparsity, gflops, precision, onnx: Path}

    @property
    def method(self) -> str:
        return str(self.manifest.ranking.method)

    @property
    def input_names(self) -> list[str]:
        return [i.name for i in self.manifest.inputs]

    @property
    def output_names(self) -> list[str]:
        return [o.name for o in self.manifest.outputs]


def _modality(manifest: Manifest, path: Path) -> str:
    m = manifest.model.modality
    if m in ("text", "image"):
        return m
    names = {i.name for i in manifest.inputs}
    if "input_ids" in names:
        return "text"
    if "pixel_values" in names:
        return "image"
    raise UserError(f"{path}: inputs {sorted(map(str, names))} are neither text (input_ids) nor images (pixel_values)")


def load_artifact(directory: str | Path, precisions: list[str] | None = None) -> Artifact:
    """Check and load one artifact directory (refuses a missing directory or manifest, missing files).

    Args:
        directory: the artifact directory.
        precisions: the precisions to evaluate (None: every one the manifest lists); the dense fp32
            model always comes first (every model's fidelity is measured against it).
    """
    given = str(directory)
    d = Path(directory)
    if not d.exists():
        raise UserError(f"{given}: no such directory")
    if not d.is_dir():
        raise UserError(f"{given}: not a directory (give an artifact directory with a manifest.json)")
    m = Manifest.load(d)
    art = Artifact(given, d, m, _modality(m, d / MANIFEST))
    entries = [({"sparsity": 0.0, "achieved_sparsity": 0.0, "gflops": m.dense.gflops}, m.dense)]
    entries += [({"sparsity": b.sparsity, "achieved_sparsity": b.achieved_sparsity, "gflops": b.gflops}, b)
                for b in m.budgets]
    have = [p for p in FILE_KEYS if p in (m.precisions or ["fp32"])]
    if precisions is not None and [p for p in precisions if p not in have]:
        missing = next(p for p in precisions if p not in have)
        raise UserError(f"--precision {','.join(precisions)}: {given} has no {missing} files (exported with "
                        f"{', '.join(have)})")
    for prec in ["fp32"] + [p for p in (precisions or have) if p != "fp32"]:
        for info, entry in entries:
            rel = entry.file(prec)
            onnx_path = m.path(rel)
            if onnx_path is None:
                raise UserError(f"{d / MANIFEST}: budget {info['sparsity']} has no {FILE_KEYS[prec]} file")
            if not onnx_path.is_file():
                raise UserError(f"{d}: {rel} is listed in the manifest but missing")
            art.models.append({**info, "precision": prec, "onnx": onnx_path})
    if precisions is not None and "fp32" not in precisions:  # kept only as the reference
        art.models = art.models[:1] + [x for x in art.models if x["precision"] != "fp32"]
    return art


def _session(path: Path):
    from elastic_export.targets.onnxruntime import cpu_session

    try:
        return cpu_session(path)
    except Exception as e:  # onnxruntime raises its own exception types
        raise UserError(f"{path}: onnxruntime cannot load it ({first_line(e)})")


def _labels(arts: list[Artifact]) -> list[str]:
    """Curve / table label per directory: the method, or the directory name where methods repeat."""
    methods = [a.method for a in arts]
    names = [a.directory.name or a.given for a in arts]
    out = []
    for a, meth, name in zip(arts, methods, names):
        if methods.count(meth) == 1:
            out.append(meth)
        elif names.count(name) == 1:
            out.append(name)
        else:
            out.append(a.given)
    return out


# --- data ---------------------------------------------------------------------------------------
def load_pairs(path: str | Path, max_pairs: int | None = None) -> list[dict]:
    """{query, doc} pairs from a JSONL file (one object per line, both fields non-empty strings)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--pairs {path}: no such file")
    from elastic_export.data.calibration import json_lines, read_text

    raw = read_text(p, "--pairs", "expected JSONL with query and doc fields")
    pairs = []
    for n, obj in json_lines(raw, p, "--pairs"):
        if not isinstance(obj, dict) or not all(
            isinstance(obj.get(k), str) and obj[k].strip() for k in ("query", "doc")
        ):
            raise UserError(f"--pairs {path}:{n}: expected an object with non-empty string fields 'query' and 'doc'")
        pairs.append({"query": obj["query"], "doc": obj["doc"]})
        if max_pairs is not None and len(pairs) >= max_pairs:
            break
    if len(pairs) < 2:
        raise UserError(f"--pairs {path}: needs at least 2 query/doc pairs, found {len(pairs)}")
    return pairs


def _image_files(folder: Path) -> list[tuple[Path, int, str]]:
    from elastic_export.data.calibration import IMAGE_EXTS

    out = []
    for c in sorted(p for p in folder.iterdir() if p.is_dir()):
        files = sorted(p for p in c.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_EXTS)
        label = len({name for _, _, name in out})
        out += [(f, label, c.name) for f in files]
    return out


def load_image_folder(path: str | Path, cfg: dict, base: Path | None = None) -> tuple[np.ndarray, np.ndarray, list[str], int]:
    """Preprocessed images, integer labels, class names and the number that failed to decode.

    The folder holds one sub-folder per class; preprocessing is the model's own
    (:func:`elastic_export.models.preprocess.transform` of ``cfg``, relative paths under ``base``).
    """
    from PIL import Image

    from elastic_export.models.preprocess import transform

    folder = Path(path)
    if not folder.is_dir():
        raise UserError(f"--images {path}: no such directory")
    files = _image_files(folder)
    if not files:
        raise UserError(f"--images {path}: no images in class sub-folders (expected DIR/<class>/<image>.png ...)")
    prep = transform(cfg, base)
    tensors, labels, failed = [], [], 0
    for f, label, _ in files:
        try:
            with Image.open(f) as img:
                tensors.append(prep(img).numpy())
            labels.append(label)
        except Exception:
            failed += 1
    classes = list(dict.fromkeys(name for _, _, name in files))
    if len(set(labels)) < 2:
        raise UserError(f"--images {path}: k-NN needs at least 2 classes with decodable images, found {len(set(labels))}")
    return np.stack(tensors).astype(np.float32), np.asarray(labels), classes, failed


def preprocess_config(art: Artifact) -> dict:
    """Image preprocessing: the manifest's ``preprocess`` entry, else mean/std 0.5 at the input size."""
    pp = art.manifest.preprocess
    if isinstance(pp, dict) and "input_size" in pp:
        cfg = {"mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5), "crop_pct": 1.0, **pp}
        cfg["input_size"] = tuple(int(x) for x in cfg["input_size"])
        return cfg
    spec = next((i for i in art.manifest.inputs if i.name == "pixel_values"), None)
    shape = spec.shape if spec else None
    if not shape or len(shape) != 4 or not all(isinstance(x, int) for x in shape[1:]):
        raise UserError(f"{art.directory / MANIFEST}: no fixed pixel_values size and no 'preprocess' entry")
    return {"input_size": tuple(shape[1:]), "mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5), "crop_pct": 1.0}


# --- text encoding ------------------------------------------------------------------------------
def load_tokenizer(art: Artifact, override: str | None = None):
    """The tokenizer of the artifacts (``DIR/tokenizer/``, else the model source's folder, a hub
    id's snapshot at the recorded commit included), or ``override``."""
    if override is not None:
        path, what = Path(override), f"--tokenizer {override}"
    else:
        from elastic_export.models.text import tokenizer_folder

        source = art.manifest.model.source
        path = tokenizer_folder(art.manifest, art.directory) or Path(os.path.expanduser(str(source)))
        what = f"{art.given}: model source {source!r}"
    from elastic_export.models.text import has_tokenizer_files

    if not path.is_dir() or not has_tokenizer_files(path):
        raise UserError(f"{what} has no tokenizer (a local directory with tokenizer files is needed); "
                        "pass --tokenizer DIR")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        raise UserError(f"{what}: the tokenizer does not load ({first_line(e)})")


@dataclass
class TextBatches:
    """Tokenised texts in length-sorted batches; ``order[i]`` is the text index of row i."""

    batches: list[dict[str, np.ndarray]]
    order: np.ndarray


def tokenize(tokenizer, texts: list[str], input_names: list[str], max_length: int, batch_size: int) -> TextBatches:
    enc = tokenizer(texts, truncation=True, max_length=max_length)
    ids = enc["input_ids"]
    types = enc.get("token_type_ids")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    order = np.array(sorted(range(len(texts)), key=lambda i: (-len(ids[i]), i)), dtype=np.int64)
    batches = []
    for s in range(0, len(order), batch_size):
        rows = order[s : s + batch_size]
        width = max(len(ids[i]) for i in rows)
        a = np.full((len(rows), width), pad, dtype=np.int64)
        m = np.zeros((len(rows), width), dtype=np.int64)
        t = np.zeros((len(rows), width), dtype=np.int64)
        for r, i in enumerate(rows):
            a[r, : len(ids[i])] = ids[i]
            m[r, : len(ids[i])] = 1
            if types is not None:
                t[r, : len(types[i])] = types[i]
        feeds = {"input_ids": a, "attention_mask": m, "token_type_ids": t}
        batches.append({n: feeds[n] for n in input_names})
    return TextBatches(batches, order)


def pool_text(outputs: dict[str, np.ndarray], mask: np.ndarray) -> np.ndarray:
    if "sentence_embedding" in outputs:
        return outputs["sentence_embedding"]
    h = outputs["last_hidden_state"]
    w = mask[..., None].astype(h.dtype)
    return (h * w).sum(1) / np.maximum(w.sum(1), 1e-9)


IMAGE_EMBEDDINGS = ("image_embeds", "pooler_output")  # in order of preference (CLIP projection first)


def _pool_image(outputs: dict[str, np.ndarray]) -> np.ndarray:
    for name in IMAGE_EMBEDDINGS:
        if name in outputs:
            return outputs[name]
    return outputs["last_hidden_state"].mean(1)


def encode_texts(sess, tb: TextBatches, want: list[str]) -> np.ndarray:
    """Pooled embedding of every text (in the original text order)."""
    rows = []
    for feeds in tb.batches:
        got = dict(zip(want, sess.run(want, feeds)))
        rows.append(pool_text(got, feeds["attention_mask"]).astype(np.float32))
    emb = np.concatenate(rows)
    out = np.empty_like(emb)
    out[tb.order] = emb
    return out


def encode_images(sess, pixels: np.ndarray, want: list[str], batch_size: int) -> np.ndarray:
    rows = []
    for s in range(0, len(pixels), batch_size):
        got = dict(zip(want, sess.run(want, {"pixel_values": pixels[s : s + batch_size]})))
        rows.append(_pool_image(got).astype(np.float32))
    return np.concatenate(rows)


# --- metric names ------------------------------------------------------------------------------
def metric_label(metric: str) -> str:
    """The name a person reads for a metric key (:data:`METRIC_LABELS`; unknown keys as they are)."""
    return METRIC_LABELS.get(metric, metric)


# --- the harness --------------------------------------------------------------------------------
def check_output_path(path: str | Path | None, what: str) -> None:
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{what} {path}: is a directory; give a file name")
    check_creatable(p, what)


def evaluate(
    dirs: list[str | Path],
    *,
    pairs: str | Path | list[dict] | None = None,
    images: str | Path | None = None,
    max_pairs: int | None = None,
    split: float | None = None,
    max_length: int = 128,
    batch_size: int = 64,
    tokenizer: str | None = None,
    precisions: list[str] | None = None,
    echo: Callable[[str], None] = lambda s: None,
) -> dict:
    """Evaluate the dense model and every budget of each artifact directory.

    Args:
        dirs: artifact directories (each with a manifest.json).
        pairs: JSONL file of {query, doc} pairs, or a list of such dicts; default
            :func:`~elastic_export.data.retrieval_data.heldout_pairs` (text directories only).
        images: labelled image folder (one sub-folder per class) for image directories.
        max_pairs: use at most this many pairs (default pair set: its size, default 1000).
        split: image k-NN with this per-class fraction held out as queries (default leave-one-out).
        max_length: token cap (the manifest's ``tokens`` when smaller).
        batch_size: inputs per onnxruntime run.
        tokenizer: tokenizer directory overriding the manifest's model source.
        precisions: evaluate these precisions' files (fp32, fp16, int8, int8-qdq; None: every one each
            directory has); fidelity is always against the dense fp32 model.
        echo: progress messages.

    Returns:
        ``{"datasets": ..., "settings": ..., "results": [{"dir", "method", "label", "modality", "model",
        "samples": {metric: n}, "budgets": [{"sparsity", "precision", "achieved_sparsity", "gflops",
        "fidelity_cosine", ..., "ci95": {metric: [low, high]}}]}]}`` (``ci95``: :func:`bootstrap_ci`).

    Raises:
        UserError: missing directory or manifest, bad pairs file, data of the wrong modality, ...
    """
    _check_settings(dirs, max_pairs, max_length, batch_size, split, precisions)
    arts = [load_artifact(d, precisions) for d in dirs]
    modalities = _check_modalities(arts, pairs, images)
    datasets: dict[str, Any] = {}
    pair_list = _text_data(pairs, max_pairs, datasets) if "text" in modalities else None
    folder = _image_data(images, split, "image" in modalities, datasets)
    results = []
    token_cache: dict[tuple, TextBatches] = {}
    image_cache: dict[tuple, tuple] = {}
    for art, label in zip(arts, _labels(arts)):
        t0 = time.time()
        echo(f"evaluating {art.given} ({art.method}, {art.modality}, {len(art.models)} models)")
        if art.modality == "text":
            budgets, sizes = _eval_text(art, pair_list, tokenizer, max_length, batch_size, token_cache, echo)
        else:
            budgets, sizes = _eval_image(art, folder, split, batch_size, image_cache, datasets, echo)
        echo(f"  done in {time.time() - t0:.1f}s")
        results.append({"dir": art.given, "method": art.method, "label": label, "modality": art.modality,
                        "model": art.manifest.model.source, SAMPLES_KEY: sizes, "budgets": budgets})
    settings = {"provider": "CPUExecutionProvider", "batch_size": batch_size, "max_length": max_length,
                "knn": "leave-one-out" if split is None else {"split": split, "seed": 0}, "bootstrap": BOOTSTRAP}
    from elastic_export.measure.timing import machine

    return {"datasets": datasets, "settings": settings, "machine": machine(), "results": results}


def _check_settings(dirs: list, max_pairs: int | None, max_length: int, batch_size: int, split: float | None,
                    precisions: list[str] | None) -> None:
    """Refuse settings :func:`evaluate` cannot use (one-line :class:`UserError`)."""
    if not dirs:
        raise UserError("eval: give at least one artifact directory")
    if max_pairs is not None and max_pairs < 2:
        raise UserError(f"--max-pairs must be at least 2, got {max_pairs}")
    if max_length < 1:
        raise UserError(f"--max-length must be positive, got {max_length}")
    if batch_size < 1:
        raise UserError(f"--batch-size must be positive, got {batch_size}")
    if split is not None and not 0 < split < 1:
        raise UserError(f"--split must be a fraction between 0 and 1, got {split}")
    if precisions is not None and (not precisions or [p for p in precisions if p not in FILE_KEYS]):
        raise UserError(f"--precision {','.join(precisions)}: choose all or a comma list of {', '.join(FILE_KEYS)}")


def _check_modalities(arts: list[Artifact], pairs: Any, images: Any) -> set[str]:
    """Refuse text pairs for an image model and an image folder for a text model; the modalities present."""
    text_arts = [a for a in arts if a.modality == "text"]
    image_arts = [a for a in arts if a.modality == "image"]
    if pairs is not None and image_arts:
        raise UserError(f"--pairs: {image_arts[0].given} is an image model; text pairs need a text model")
    if images is not None and text_arts:
        raise UserError(f"--images: {text_arts[0].given} is a text model; an image folder needs an image model")
    return {a.modality for a in arts}


def _text_data(pairs: str | Path | list[dict] | None, max_pairs: int | None, datasets: dict) -> list[dict]:
    """The query / document pairs (``pairs``, or the default held-out set); adds ``datasets["pairs"]``."""
    if pairs is None:
        from elastic_export.data.retrieval_data import heldout_pairs

        n = max_pairs or DEFAULT_PAIRS
        pair_list = heldout_pairs(n)
        source = f"elastic_export.data.retrieval_data.heldout_pairs(n={n}, seed=0) (standard-library docstrings)"
    elif isinstance(pairs, (str, Path)):
        pair_list, source = load_pairs(pairs, max_pairs), str(pairs)
    else:
        pair_list, source = list(pairs)[: max_pairs or None], "<given list>"
        for i, p in enumerate(pair_list):
            if not isinstance(p, dict) or not all(isinstance(p.get(k), str) and p[k].strip()
                                                  for k in ("query", "doc")):
                raise UserError(f"eval: pair {i} needs non-empty string fields 'query' and 'doc'")
        if len(pair_list) < 2:
            raise UserError("eval: needs at least 2 query/doc pairs")
    datasets["pairs"] = {"source": source, "count": len(pair_list),
                         "fidelity_inputs": "every query and document of the pairs"}
    return pair_list


def _image_data(images: str | Path | None, split: float | None, any_image: bool, datasets: dict) -> Path | None:
    """The labelled image folder (None: none given); adds ``datasets["images"]`` where there are
    image directories (``any_image``) or a folder."""
    if images is not None:
        if not Path(images).is_dir():
            raise UserError(f"--images {images}: no such directory")
        datasets["images"] = {"source": str(images), "protocol": "leave-one-out" if split is None else
                              f"per-class split, {split:g} held out as queries (seed 0)"}
        return Path(images)
    if any_image:
        datasets["images"] = {"source": f"{SYNTHETIC_IMAGES} synthetic colour fields (seed {SYNTHETIC_SEED})",
                              "protocol": None, "fidelity_inputs": "synthetic images; no k-NN without --images"}
    return None


def _eval_text(art: Artifact, pairs: list[dict], tok_dir: str | None, max_length: int, batch_size: int,
               cache: dict, echo) -> tuple[list[dict], dict[str, int]]:
    """Every model's text metrics (rows with bootstrap bands) and the sample count of each metric."""
    names = [n for n in art.input_names if n in TEXT_INPUTS]
    if "input_ids" not in names or "attention_mask" not in names:
        raise UserError(f"{art.given}: text artifacts need input_ids and attention_mask inputs, have {art.input_names}")
    want = ["sentence_embedding"] if "sentence_embedding" in art.output_names else ["last_hidden_state"]
    if want[0] not in art.output_names:
        raise UserError(f"{art.given}: no sentence_embedding or last_hidden_state output")
    tokens = art.manifest.tokens
    length = min(max_length, int(tokens)) if isinstance(tokens, int) and tokens > 0 else max_length
    source = tok_dir or art.manifest.model.source
    key = (str(source), length, tuple(names))
    if key not in cache:
        tok = load_tokenizer(art, tok_dir)
        texts = [p["query"] for p in pairs] + [p["doc"] for p in pairs]
        cache[key] = tokenize(tok, texts, names, length, batch_size)
    tb = cache[key]
    n = len(pairs)
    out, dense_d, sizes = [], None, {}
    for i, model in enumerate(art.models):
        t0 = time.time()
        emb = encode_texts(_session(model["onnx"]), tb, want)
        q, d = emb[:n], emb[n:]
        if i == 0:
            dense_d, dense_all = d, emb
        asym, sym = own_ranks(q, dense_d), own_ranks(q, d)
        values, ci = summarise({"fidelity_cosine": cosines(emb, dense_all), "recall@1": asym < 1,
                                "recall@10": asym < 10, "sym_recall@1": sym < 1, "sym_recall@10": sym < 10})
        row = {"sparsity": model["sparsity"], "precision": model["precision"],
               "achieved_sparsity": model["achieved_sparsity"], "gflops": model["gflops"], **values, CI_KEY: ci}
        out.append(row)
        sizes = {"fidelity_cosine": len(emb), **{m: n for m in values if m != "fidelity_cosine"}}
        echo(f"  sparsity {row['sparsity']:.2f} {row['precision']}: "
             f"fidelity {row['fidelity_cosine']:.4f}  R@1 {row['recall@1']:.3f}  R@10 {row['recall@10']:.3f}  "
             f"sym R@10 {row['sym_recall@10']:.3f}  ({time.time() - t0:.1f}s)")
    return out, sizes


def _eval_image(art: Artifact, folder: Path | None, split: float | None, batch_size: int, cache: dict,
                datasets: dict, echo) -> tuple[list[dict], dict[str, int]]:
    """Every model's image metrics (rows with bootstrap bands) and the sample count of each metric."""
    if "pixel_values" not in art.input_names:
        raise UserError(f"{art.given}: image artifacts need a pixel_values input, have {art.input_names}")
    want = next(([n] for n in IMAGE_EMBEDDINGS if n in art.output_names), ["last_hidden_state"])
    if want[0] not in art.output_names:
        raise UserError(f"{art.given}: no pooler_output or last_hidden_state output")
    cfg = preprocess_config(art)
    key = (str(folder), json.dumps(cfg, sort_keys=True, default=str))
    if key not in cache:
        if folder is None:
            from elastic_export.data.calibration import synthetic_images

            imgs = synthetic_images(cfg, SYNTHETIC_IMAGES, SYNTHETIC_SEED)
            cache[key] = (np.stack([t.numpy() for t in imgs]).astype(np.float32), None)
        else:
            pixels, labels, classes, failed = load_image_folder(folder, cfg, art.directory)
            cache[key] = (pixels, labels)
            datasets["images"].update(count=len(labels), classes=classes, failed_to_decode=failed)
    pixels, labels = cache[key]
    out, dense, sizes = [], None, {}
    for i, model in enumerate(art.models):
        t0 = time.time()
        feats = encode_images(_session(model["onnx"]), pixels, want, batch_size)
        if i == 0:
            dense = feats
        samples = {"fidelity_cosine": cosines(feats, dense)}
        if labels is not None:
            hits = knn_hits(feats, labels, (1, 10), split)
            samples.update({"knn@1": hits[1], "knn@10": hits[10]})
        values, ci = summarise(samples)
        row = {"sparsity": model["sparsity"], "precision": model["precision"],
               "achieved_sparsity": model["achieved_sparsity"], "gflops": model["gflops"],
               **{"fidelity_cosine": None, "knn@1": None, "knn@10": None, **values}, CI_KEY: ci}
        out.append(row)
        sizes = {m: len(v) for m, v in samples.items()}
        knn = "" if labels is None else f"  kNN@1 {row['knn@1']:.3f}  kNN@10 {row['knn@10']:.3f}"
        echo(f"  sparsity {row['sparsity']:.2f} {row['precision']}: fidelity {row['fidelity_cosine']:.4f}{knn}  "
             f"({time.time() - t0:.1f}s)")
    return out, sizes


# --- output -------------------------------------------------------------------------------------
def default_outputs(dirs: list[str | Path]) -> dict[Path, str]:
    """Where ``elastic-export eval`` without ``--out`` writes: ``DIR/eval.json`` (:data:`EVAL_RESULTS`)
    of every directory, each mapped to that directory as given (its result goes first there)."""
    return {Path(d) / EVAL_RESULTS: str(d) for d in dict.fromkeys(str(d) for d in dirs)}


def write_results(path: str | Path, results: dict, first: str | None = None) -> Path:
    """The results as JSON in the one results schema (:mod:`elastic_export.core.results`), written atomically.

    Args:
        path: the JSON file.
        results: :func:`evaluate`'s results.
        first: put the result of this directory (as given) first: the one the report's frontier and
            recommendation read in that directory.
    """
    if first is not None:
        own = [r for r in results["results"] if r.get("dir") == first]
        results = {**results, "results": own + [r for r in results["results"] if r.get("dir") != first]}

    return schema.save(schema.from_eval(results), path)


def _metrics_present(results: dict) -> list[str]:
    order = list(dict.fromkeys(TEXT_METRICS + IMAGE_METRICS))
    return [m for m in order if any(b.get(m) is not None for r in results["results"] for b in r["budgets"])]


def by_precision(curves: list[dict]) -> list[dict]:
    """Each curve ``{"label", "budgets"}`` split into one per precision of its budgets (label
    ``"<label> int8"``; a curve of one precision keeps its label)."""
    out = []
    for c in curves:
        precs = list(dict.fromkeys(b.get("precision", "fp32") for b in c["budgets"] if isinstance(b, dict)))
        if len(precs) <= 1:
            out.append(c)
            continue
        for p in precs:
            out.append({**c, "label": f"{c['label']} {p}",
                        "budgets": [b for b in c["budgets"] if isinstance(b, dict) and b.get("precision", "fp32") == p]})
    return out


def _sample_note(curves: list[dict], metric: str) -> str:
    """``n = 64`` (or ``n = 64 / 1000`` where curves differ) for a metric's subplot title."""
    ns = list(dict.fromkeys(c.get(SAMPLES_KEY, {}).get(metric) for c in curves
                            if isinstance(c.get(SAMPLES_KEY), dict)))
    ns = [str(n) for n in ns if isinstance(n, int)]
    return f"n = {' / '.join(ns)}, 95 % bootstrap band" if ns else "n unknown, no band"


def _curve(ax, c: dict, metric: str) -> tuple[float, float] | None:
    """One curve of ``metric`` vs GFLOPs with its bootstrap band (where the rows hold one); returns
    the dense point (GFLOPs, value) when the curve has it."""
    rows = sorted((b for b in c["budgets"] if isinstance(b, dict) and isinstance(b.get(metric), (int, float))
                   and isinstance(b.get("gflops"), (int, float))), key=lambda b: float(b["gflops"]))
    if not rows:
        return None
    x, y = [float(b["gflops"]) for b in rows], [float(b[metric]) for b in rows]
    line = ax.plot(x, y, marker="o", markersize=3.5, label=c["label"])[0]
    bands = [(b.get(CI_KEY) or {}).get(metric) for b in rows]
    if all(isinstance(v, list) and len(v) == 2 for v in bands):
        lo, hi = [float(v[0]) for v in bands], [float(v[1]) for v in bands]
        ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.15, linewidth=0)
        ax.errorbar(x, y, yerr=[[max(0.0, a - b) for a, b in zip(y, lo)], [max(0.0, b - a) for a, b in zip(y, hi)]],
                    fmt="none", ecolor=line.get_color(), elinewidth=0.8, capsize=2.5, alpha=0.8)
    dense = [(xi, yi) for xi, yi, b in zip(x, y, rows) if float(b.get("sparsity") or 0.0) == 0.0
             and b.get("precision", "fp32") == "fp32"]
    return dense[0] if dense else None


def quality_figure(curves: list[dict], metrics: list[str], width: float = 4.6, height: float = 3.6):
    """One subplot per metric, metric vs GFLOPs, one curve per method with its 95 % bootstrap band
    (rows' ``ci95``), the dense fp32 model starred and its value a dotted line (a point above it
    whose band reaches it is noise, not a gain); sample counts (``samples``) in the titles.

    Args:
        curves: ``{"label", "samples": {metric: n}, "budgets": [{"sparsity", "gflops", metric: value,
            "ci95": {metric: [low, high]}}]}`` (``samples`` and ``ci95`` optional).
        metrics: the metrics to plot.
        width: inches per subplot.
        height: inches per subplot.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ncols = min(3, len(metrics))
    nrows = -(-len(metrics) // ncols)
    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(nrows, ncols, i + 1) for i in range(len(metrics))]
    for ax, metric in zip(axes, metrics):
        dense = [d for d in (_curve(ax, c, metric) for c in curves) if d is not None]
        if dense:
            ax.axhline(dense[0][1], color="gray", linestyle=":", linewidth=1)
            ax.plot([dense[0][0]], [dense[0][1]], linestyle="none", marker="*", markersize=12, color="black",
                    zorder=5, label="dense")
        ax.set_title(f"{metric_label(metric)}\n{_sample_note(curves, metric)}", fontsize="medium")
        ax.set_xlabel("GFLOPs")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize="small")
    return fig


def plot_results(results: dict, path: str | Path) -> Path:
    """PNG: one subplot per metric, metric vs GFLOPs, one curve per directory, dense marked (Agg)."""
    metrics = _metrics_present(results)
    if not metrics:
        raise UserError("nothing to plot: no metric was computed")
    fig = quality_figure(by_precision(results["results"]), metrics)

    def write(tmp: str) -> None:
        fig.savefig(tmp, format="png", dpi=110)

    return atomic_write(path, write)


def format_table(results: dict) -> str:
    """The printed summary: dir/method, sparsity, (precision, where any is not fp32,) GFLOPs, fidelity,
    R@1, R@10, sym R@10 (kNN for images)."""
    has_text = any(r["modality"] == "text" for r in results["results"])
    has_image = any(r["modality"] == "image" for r in results["results"])
    precs = any(b.get("precision", "fp32") != "fp32" for r in results["results"] for b in r["budgets"])
    cols = [("dir/method", None), ("sparsity", None)] + ([("precision", None)] if precs else []) + [
        ("GFLOPs", None), ("fidelity", "fidelity_cosine")]
    if has_text:
        cols += [("R@1", "recall@1"), ("R@10", "recall@10"), ("sym R@10", "sym_recall@10")]
    if has_image:
        cols += [("kNN@1", "knn@1"), ("kNN@10", "knn@10")]
    rows = [[c for c, _ in cols]]
    for r in results["results"]:
        name = f"{r['dir']}/{r['method']}"
        for b in r["budgets"]:
            cells = [name, "dense" if b["sparsity"] == 0.0 else f"{b['sparsity']:.2f}"]
            cells += [b.get("precision", "fp32")] if precs else []
            cells.append("-" if b.get("gflops") is None else f"{b['gflops']:.3f}")
            for _, key in cols[len(cells):]:
                v = b.get(key)
                cells.append("-" if v is None else f"{v:.4f}" if key == "fidelity_cosine" else f"{v:.3f}")
            rows.append(cells)
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)
