"""Choose the dynamic-quantization settings of ``elastic_export.precision.int8`` by measurement.

On the embedded all-MiniLM-L6-v2 (``load_encoder(None)``), the main job (``magnitude`` ranking, no
elastic graph) writes the dense ONNX and one budget; each is quantized with every combination of
``per_channel`` and ``reduce_range`` (int8 weights on MatMul / Gemm, ``QInt8``). For each file:

* accuracy: the min and mean cosine of ``sentence_embedding`` vs the fp32 file on held-out texts
  (queries and docs of ``elastic_export.data.retrieval_data.heldout_pairs``, not calibration text),
  tokenized to at most 128 tokens, run 8 at a time. Exact (deterministic).
* latency: batch 8 (the first 8 texts, padded to 128 tokens), onnxruntime CPU EP, 2 intra-op
  threads; median of ``--repeats`` runs after warm-up. Rough on a shared machine.

Usage:
    python benchmarks/int8_settings.py [--budget 0.5] [--texts 64] [--repeats 15] [--work DIR]

Writes ``benchmarks/results/int8_settings.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from elastic_export.measure.timing import machine, time_calls  # noqa: E402
from elastic_export.precision.int8 import embedding, min_cosine, quantize  # noqa: E402

RESULTS = Path(__file__).parent / "results"
SETTINGS = [(pc, rr) for pc in (False, True) for rr in (False, True)]


def build(work: Path, budget: float) -> Path:
    """The main job's dense + one budget of MiniLM in ``work/out`` (reused when present)."""
    from elastic_export.pipeline import Options, run

    out = work / "out"
    if not (out / "manifest.json").is_file():
        run(Options(model=None, budgets=(budget,), out=str(out), method="magnitude", verify=False,
                    elastic_graph=False, report=False, overwrite=True))
    return out


def text_feeds(texts: list[str], names: list[str], batch: int, pad: bool = False) -> list[dict[str, np.ndarray]]:
    """Tokenized batches of ``texts`` (MiniLM tokenizer, <= 128 tokens) restricted to ``names``."""
    from elastic_export.models.loader import load_encoder

    tok = load_encoder(None).tokenizer
    out = []
    for i in range(0, len(texts), batch):
        enc = tok(texts[i:i + batch], padding="max_length" if pad else True, truncation=True, max_length=128,
                  return_tensors="np")
        out.append({k: np.asarray(v, np.int64) for k, v in enc.items() if k in names})
    return out


def session(path: Path):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = 2, 1
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def embeddings(sess, batches: list[dict]) -> np.ndarray:
    names = [o.name for o in sess.get_outputs()]
    return np.concatenate([embedding(names, sess.run(names, f), f.get("attention_mask")) for f in batches])


def measure(fp32: Path, work: Path, batches: list[dict], timing: dict, repeats: int) -> list[dict]:
    """One row for fp32 and one per setting: file size, min / mean cosine, batch-8 median latency."""
    ref = session(fp32)
    want = embeddings(ref, batches)
    rows = []
    for pc, rr in [(None, None), *SETTINGS]:
        path = fp32 if pc is None else work / f"{fp32.stem}.pc{int(pc)}_rr{int(rr)}.int8.onnx"
        if pc is not None:
            quantize(fp32, path, per_channel=pc, reduce_range=rr)
        sess = session(path)
        got = embeddings(sess, batches)
        a, b = want, got
        cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
        times = time_calls(lambda: sess.run(None, timing), warmup=3, repeats=repeats)
        rows.append({"file": fp32.name, "precision": "fp32" if pc is None else "int8", "per_channel": pc,
                     "reduce_range": rr, "mb": round(path.stat().st_size / 1e6, 2),
                     "min_cosine": round(min_cosine(want, got), 5), "mean_cosine": round(float(cos.mean()), 5),
                     "batch8_ms": round(1e3 * statistics.median(times), 1)})
        print(rows[-1], flush=True)
    return rows


def markdown(res: dict) -> str:
    lines = ["# int8 dynamic quantization settings (all-MiniLM-L6-v2, onnxruntime CPU EP)", "",
             f"CPU: {res['machine']['cpu']} (AVX2, no VNNI), onnxruntime {res['machine'].get('onnxruntime')}, "
             f"2 intra-op threads, load average at start {res['machine']['load_average'][0]:.1f}.", "",
             f"Accuracy: cosine of `sentence_embedding` vs the fp32 file on {res['texts']} held-out texts "
             "(standard-library docstrings, `heldout_pairs`), exact and deterministic.",
             "Latency: batch 8 at 128 tokens, median of "
             f"{res['repeats']} runs. **The machine was shared with other jobs while this ran: latencies "
             "are rough (differences under ~15 % are noise); the accuracy figures are exact.**", "",
             "| file | precision | per_channel | reduce_range | MB | min cosine | mean cosine | batch-8 ms |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['file']} | {r['precision']} | {r['per_channel']} | {r['reduce_range']} | {r['mb']} | "
                     f"{r['min_cosine']:.5f} | {r['mean_cosine']:.5f} | {r['batch8_ms']} |")
    lines += ["", f"Chosen: {res['chosen']}. See the docstring of `elastic_export/precision/int8.py` for why."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=0.5)
    ap.add_argument("--texts", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--work", default=None)
    args = ap.parse_args()
    from elastic_export.data.retrieval_data import heldout_pairs

    work = Path(args.work or tempfile.mkdtemp(prefix="int8-settings-"))
    work.mkdir(parents=True, exist_ok=True)
    out = build(work, args.budget)
    manifest = json.loads((out / "manifest.json").read_text())
    pairs = heldout_pairs(args.texts // 2)
    texts = [t for p in pairs for t in (p["query"], p["doc"])][:args.texts]
    names = [i["name"] for i in manifest["inputs"]]
    batches = text_feeds(texts, names, 8)
    timing = text_feeds(texts[:8], names, 8, pad=True)[0]
    rows = []
    for rel in ["dense.onnx", manifest["budgets"][0]["onnx"]]:
        rows += measure(out / rel, work, batches, timing, args.repeats)
    res = {"model": "all-MiniLM-L6-v2 (embedded default)", "budget": args.budget, "texts": len(texts),
           "repeats": args.repeats, "machine": machine(), "rows": rows,
           "chosen": "per_channel=True, reduce_range=False, weight_type=QInt8, MatMul/Gemm"}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "int8_settings.json").write_text(json.dumps(res, indent=2) + "\n")
    (RESULTS / "int8_settings.md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
