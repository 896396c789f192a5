"""How long ``elastic-export index`` takes over a corpus of a few thousand documents.

The corpus is text the interpreter ships, in a fixed order: the documents of the retrieval set's
candidate pairs (standard-library docstrings, ``elastic_export.data.retrieval_data``) and then the
paragraphs of the Python reference (``pydoc_data.topics``), deduplicated, the first ``--docs`` of them.
The command runs as a user runs it (a fresh process on a hard-linked copy of the default main job's
artifacts, FAISS exact inner product) and is timed from start to exit; the tokens per document are
counted with the model's own tokenizer (cut to the model's context as the index cuts them).

Usage:
    python benchmarks/index_build.py [--artifacts DIR] [--docs 2800] [--repeats 2]

Writes benchmarks/results/index_build.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

import serve_triton as ST  # noqa: E402  (the default artifacts, the machine line, the results' writer)
from elastic_search import prepare, timed_index  # noqa: E402  (a fresh copy of the artifacts, the timed command)


def corpus_texts(n: int) -> list[str]:
    """The first ``n`` distinct documents: the candidate pairs' docs, then the reference's paragraphs."""
    from pydoc_data.topics import topics

    from elastic_export.data.retrieval_data import candidate_pairs

    texts = [p["doc"] for p in candidate_pairs()]
    texts += [" ".join(p.split()) for _, t in sorted(topics.items()) for p in t.split("\n\n") if len(p.split()) >= 8]
    out = list(dict.fromkeys(texts))[:n]
    if len(out) < n:
        raise SystemExit(f"only {len(out)} distinct documents; ask for at most that many")
    return out


def token_counts(directory: Path, texts: list[str]) -> np.ndarray:
    """Tokens per document with the model's tokenizer, as the index cuts them (the model's context)."""
    from elastic_export.core.manifest import Manifest
    from elastic_export.models.text import TextEncoder, tokenizer_folder

    manifest = Manifest.load(directory)
    enc = TextEncoder.from_dir(tokenizer_folder(manifest, directory), [i.name for i in manifest.inputs])
    return np.array([int(enc.encode([t])["attention_mask"].sum()) for t in texts])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifacts", type=Path, default=ST.DEFAULT_ARTIFACTS)
    ap.add_argument("--docs", type=int, default=2800)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    texts = corpus_texts(args.docs)
    with tempfile.TemporaryDirectory(prefix="index-build-") as tmp:
        work = prepare(args.artifacts, Path(tmp) / "elastic-out")
        corpus = Path(tmp) / "corpus.jsonl"
        corpus.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
        runs = [timed_index(work, corpus) for _ in range(args.repeats)]
        tokens = token_counts(work, texts)
    seconds = [s for s, _ in runs]
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": ST.machine(), "documents": len(texts),
           "tokens": {"total": int(tokens.sum()), "mean": float(tokens.mean()), "p50": float(np.median(tokens)),
                      "max": int(tokens.max())},
           "seconds": seconds, "docs_per_s": [len(texts) / s for s in seconds],
           "tokens_per_s": [float(tokens.sum()) / s for s in seconds], "output": runs[-1][1],
           "command": "elastic-export index elastic-out corpus.jsonl --overwrite"}
    md = [f"# `elastic-export index` over {len(texts)} documents ({out['date']})", "", f"Machine: {out['machine']}", "",
          "Corpus: the retrieval set's candidate documents (standard-library docstrings), then the Python reference's "
          f"paragraphs; {out['tokens']['total']} tokens in all (mean {out['tokens']['mean']:.0f}, median "
          f"{out['tokens']['p50']:.0f}, max {out['tokens']['max']} per document, all-MiniLM-L6-v2's tokenizer, cut to "
          "its context). Dense model, onnxruntime, FAISS exact inner product; wall time of the command from start "
          "to exit (Python start-up included).", "",
          "| run | seconds | documents/s | tokens/s |", "|---|---|---|---|"]
    md += [f"| {i + 1} | {s:.1f} | {d:.0f} | {t:.0f} |" for i, (s, d, t) in
           enumerate(zip(seconds, out["docs_per_s"], out["tokens_per_s"]))]
    ST.write_results("index_build", out, "\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
