"""Metric functions: every quality figure of eval and the quick eval comes from here.

Per-sample figures (a cosine, a retrieval hit, a k-NN hit, a neighbour-overlap share) are averaged
by :func:`summarise`, which also gives each mean its paired percentile bootstrap band
(:func:`bootstrap_ci`, settings :data:`BOOTSTRAP`).

* embedding fidelity: :func:`cosines` / :func:`mean_cosine` against the dense fp32 model;
* text retrieval: :func:`own_ranks` (rank of each query's own document) and :func:`recall_at`;
* image k-NN: :func:`knn_hits` / :func:`knn_accuracy` (leave-one-out or a per-class split);
* neighbour overlap@k against a dense index (the quick eval): :func:`neighbour_overlaps`.
"""

from __future__ import annotations

import random

import numpy as np

from elastic_export.core.errors import UserError

BOOTSTRAP = {"resamples": 1000, "level": 0.95, "seed": 0, "interval": "percentile",
             "over": "the figure's own samples (queries, inputs), resampled with replacement"}


def l2_normalize(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity."""
    return (l2_normalize(a) * l2_normalize(b)).sum(1)


def mean_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Mean row-wise cosine similarity."""
    return float(cosines(a, b).mean())


def bootstrap_ci(values: np.ndarray, resamples: int = BOOTSTRAP["resamples"], level: float = BOOTSTRAP["level"],
                 seed: int = BOOTSTRAP["seed"], chunk: int = 200) -> list[float]:
    """Percentile bootstrap interval of the mean of ``values`` (one per query / input).

    The resampled indices depend only on ``seed`` and ``len(values)``: every budget of one data set is
    resampled the same way (a paired bootstrap), and the band is the same from run to run.

    Args:
        values: per-sample figures (a hit 0/1, a cosine, an overlap share).
        resamples: bootstrap samples of the mean.
        level: the central share of them the band holds.
        seed: the generator's seed.
        chunk: resamples drawn at a time (bounds the memory for large data sets).

    Returns:
        ``[low, high]`` (both the value itself with fewer than 2 samples).
    """
    v = np.asarray(values, dtype=np.float64).ravel()
    if len(v) < 2:
        return [float(v.mean()), float(v.mean())] if len(v) else [float("nan"), float("nan")]
    rng = np.random.default_rng(seed)
    means = np.concatenate([v[rng.integers(0, len(v), (min(chunk, resamples - s), len(v)))].mean(1)
                            for s in range(0, resamples, chunk)])
    tail = 100 * (1 - level) / 2
    lo, hi = np.percentile(means, [tail, 100 - tail])
    return [float(lo), float(hi)]


def summarise(samples: dict[str, np.ndarray]) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Per metric: the mean of its per-sample figures and the bootstrap band (:func:`bootstrap_ci`)."""
    return ({m: float(np.mean(v)) for m, v in samples.items()}, {m: bootstrap_ci(v) for m, v in samples.items()})


def own_ranks(queries: np.ndarray, docs: np.ndarray, chunk: int = 1024) -> np.ndarray:
    """Per query i: how many documents score strictly higher than doc i (cosine similarity)."""
    q, d = l2_normalize(queries), l2_normalize(docs)
    ranks = []
    for s in range(0, len(q), chunk):
        sims = q[s : s + chunk] @ d.T
        own = sims[np.arange(len(sims)), np.arange(s, s + len(sims))]
        ranks.append((sims > own[:, None]).sum(1))
    return np.concatenate(ranks)


def recall_at(queries: np.ndarray, docs: np.ndarray, ks: tuple[int, ...] = (1, 10), chunk: int = 1024) -> dict[int, float]:
    """Recall@k of doc i for query i by cosine similarity (strictly better documents push it down)."""
    r = own_ranks(queries, docs, chunk)
    return {k: float((r < k).mean()) for k in ks}


def _vote(sims: np.ndarray, index_labels: np.ndarray, k: int, n_classes: int) -> np.ndarray:
    k = min(k, sims.shape[1])
    nn = np.argsort(-sims, axis=1, kind="stable")[:, :k]
    pred = np.empty(len(sims), dtype=np.int64)
    for i in range(len(sims)):
        labs = index_labels[nn[i]]
        votes = np.bincount(labs, minlength=n_classes).astype(np.float64)
        mass = np.bincount(labs, weights=sims[i, nn[i]], minlength=n_classes)
        best = np.flatnonzero(votes == votes.max())
        pred[i] = best[np.argmax(mass[best])]
    return pred


def split_indices(labels: np.ndarray, split: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(index, query) positions: per class a seeded shuffle, ``split`` of it held out as queries."""
    index, query = [], []
    rng = random.Random(seed)
    for c in sorted(set(labels.tolist())):
        members = [int(i) for i in np.flatnonzero(labels == c)]
        rng.shuffle(members)
        nq = min(len(members) - 1, max(1, round(split * len(members)))) if len(members) > 1 else 0
        query += members[:nq]
        index += members[nq:]
    return np.array(sorted(index)), np.array(sorted(query))


def knn_hits(feats: np.ndarray, labels: np.ndarray, ks: tuple[int, ...] = (1, 10),
             split: float | None = None, seed: int = 0) -> dict[int, np.ndarray]:
    """Per query image, whether the k-NN vote is right: leave-one-out (``split`` None) or a per-class
    held-out fraction as queries."""
    f = l2_normalize(feats)
    n_classes = int(labels.max()) + 1
    if split is None:
        sims = f @ f.T
        np.fill_diagonal(sims, -np.inf)  # an image is not its own neighbour
        return {k: _vote(sims, labels, min(k, len(f) - 1), n_classes) == labels for k in ks}
    index, query = split_indices(labels, split, seed)
    if len(query) == 0 or len(index) == 0:
        raise UserError(f"--split {split}: leaves no query or no index image")
    sims = f[query] @ f[index].T
    idx_labels = labels[index]
    return {k: _vote(sims, idx_labels, k, n_classes) == labels[query] for k in ks}


def knn_accuracy(feats: np.ndarray, labels: np.ndarray, ks: tuple[int, ...] = (1, 10),
                 split: float | None = None, seed: int = 0) -> dict[int, float]:
    """k-NN accuracy: leave-one-out (``split`` None) or a per-class held-out fraction."""
    return {k: float(h.mean()) for k, h in knn_hits(feats, labels, ks, split, seed).items()}


def neighbour_overlap(queries: np.ndarray, index: np.ndarray, k: int = 10) -> float:
    """Mean of :func:`neighbour_overlaps`."""
    return float(np.mean(neighbour_overlaps(queries, index, k)))


def neighbour_overlaps(queries: np.ndarray, index: np.ndarray, k: int = 10) -> np.ndarray:
    """Neighbour overlap@k against a dense index: for each row i, the share of the dense top-k
    neighbours of ``index[i]`` (itself excluded) that ``queries[i]`` finds among its own top-k in
    ``index``. Not retrieval recall: the dense model scores 1.0 by construction.

    Args:
        queries: the pair's embeddings of the held-out samples.
        index: the dense fp32 model's embeddings of the same samples (row i = the same sample).
        k: neighbours (at most the number of samples - 1).
    """
    k = min(k, len(index) - 1)
    q, d = l2_normalize(queries), l2_normalize(index)
    truth, got = d @ d.T, q @ d.T
    np.fill_diagonal(truth, -np.inf)
    np.fill_diagonal(got, -np.inf)
    want = np.argsort(-truth, axis=1, kind="stable")[:, :k]
    have = np.argsort(-got, axis=1, kind="stable")[:, :k]
    return np.array([len(set(a) & set(b)) / k for a, b in zip(want, have)], dtype=np.float64)
