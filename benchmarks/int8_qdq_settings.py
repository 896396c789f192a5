"""Choose the calibration settings of ``elastic_export.precision.int8_qdq`` (``--precision int8-qdq``) by measurement.

On the embedded all-MiniLM-L6-v2, an artifact directory (``--dir``: the main job's output with the
dense model and budgets; default: a fresh ``magnitude`` run with budgets 0.3 and 0.6) is quantized
with static QDQ int8 (symmetric int8 activations and per-channel weights, Q/DQ on MatMul / Gemm
inputs) for each calibration setting:

* ``MinMax`` or ``Percentile`` (99.999) activation ranges (Percentile on the first 48 calibration
  samples, zero-padded to one length: onnxruntime's histogram calibrator keeps every output of every
  sample in memory and stacks them);
* ``all MatMuls`` or ``weight MatMuls`` (attention score / value MatMuls stay fp32);
* MLP down projections int8 or fp32.

The calibration reader gets the main job's default calibration data (256 samples of the Python
reference, batches of 8, length-bucketed) less every 4th sample, which is held out. For each file:

* accuracy: min / mean cosine of ``sentence_embedding`` vs the fp32 file on the held-out calibration
  samples, on held-out retrieval texts (``heldout_pairs``: other text than the calibration source),
  and on the random-token check inputs of ``verify`` (batch 2 x 32 tokens, seeds 0 and 1);
* latency: batch 8 at 128 tokens, onnxruntime CPU EP, 2 intra-op threads, median of ``--repeats``
  runs; fp32 and the dynamic int8 file (``elastic_export.precision.int8``) alongside. Rough on a shared machine.

Usage:
    python benchmarks/int8_qdq_settings.py [--dir DIR] [--repeats 15] [--work DIR]

Writes ``benchmarks/results/int8_qdq_settings.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from elastic_export.core.manifest import Manifest  # noqa: E402
from elastic_export.measure.timing import machine, time_calls  # noqa: E402
from elastic_export.precision.int8 import embedding, quantize  # noqa: E402
from elastic_export.precision.int8_qdq import quantize_qdq, split_heldout  # noqa: E402

RESULTS = Path(__file__).parent / "results"
SETTINGS = [("MinMax", False, False), ("MinMax", True, False), ("MinMax", True, True), ("Percentile", True, True)]
PERCENTILE_SAMPLES = 48  # the histogram calibrator keeps every output of every sample in memory


def session(path: Path):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = 2, 1
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def cosines(ref, sess, batches: list[dict]) -> np.ndarray:
    """Row-wise embedding cosines of two sessions over ``batches``."""
    names = [o.name for o in ref.get_outputs()]
    out = []
    for f in batches:
        f = {k: v for k, v in f.items() if k in {i.name for i in ref.get_inputs()}}
        a = embedding(names, ref.run(names, f), f.get("attention_mask"))
        b = embedding(names, sess.run(names, f), f.get("attention_mask"))
        out.append((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)))
    return np.concatenate(out)


def inputs(manifest: dict) -> dict[str, list[dict]]:
    """The feed sets measured: held-out calibration samples, retrieval texts, verify's random tokens."""
    import onnx

    from elastic_export.checks.verify import sample_inputs
    from elastic_export.data.calibration import load_calibration
    from elastic_export.data.retrieval_data import heldout_pairs
    from elastic_export.models.loader import load_encoder

    enc = load_encoder(None)
    data = split_heldout(load_calibration(enc, None, size=256, batch_size=8, seed=0).batches)
    names = [i["name"] for i in manifest["inputs"]]
    texts = [t for p in heldout_pairs(32) for t in (p["query"], p["doc"])]
    tok = [enc.tokenizer(texts[i:i + 8], padding=True, truncation=True, max_length=128, return_tensors="np")
           for i in range(0, len(texts), 8)]
    dense = onnx.load(str(Path(manifest["_dir"]) / "dense.onnx"), load_external_data=False)
    timing = enc.tokenizer(texts[:8], padding="max_length", truncation=True, max_length=128, return_tensors="np")
    return {"calib": data.calib, "heldout_calib": data.heldout,
            "heldout_texts": [{k: np.asarray(v, np.int64) for k, v in t.items() if k in names} for t in tok],
            "verify_random": [sample_inputs(Manifest.load(manifest["_dir"]), dense, batch=2, seed=s) for s in (0, 1)],
            "timing": [{k: np.asarray(v, np.int64) for k, v in timing.items() if k in names}]}


def row(fp32: Path, path: Path, label: str, feeds: dict, repeats: int, seconds: float | None) -> dict:
    ref, sess = session(fp32), session(path)
    r = {"file": fp32.name, "variant": label, "mb": round(path.stat().st_size / 1e6, 1), "quantize_s": seconds}
    for key in ("heldout_calib", "heldout_texts", "verify_random"):
        c = cosines(ref, sess, feeds[key])
        r[f"{key}_min"], r[f"{key}_mean"] = round(float(c.min()), 5), round(float(c.mean()), 5)
    times = time_calls(lambda: sess.run(None, feeds["timing"][0]), warmup=3, repeats=repeats)
    r["batch8_ms"] = round(1e3 * statistics.median(times), 1)
    print(r, flush=True)
    return r


def _first(batches: list[dict], n: int) -> list[dict]:
    """The batches holding the first ``n`` samples."""
    out, count = [], 0
    for b in batches:
        if count >= n:
            break
        out.append(b)
        count += len(next(iter(b.values())))
    return out


def measure(fp32: Path, work: Path, feeds: dict, repeats: int) -> list[dict]:
    rows = [row(fp32, fp32, "fp32", feeds, repeats, None)]
    dyn = work / f"{fp32.stem}.int8.onnx"
    t0 = time.perf_counter()
    quantize(fp32, dyn)
    rows.append(row(fp32, dyn, "dynamic int8", feeds, repeats, round(time.perf_counter() - t0, 1)))
    for method, const_b, down in SETTINGS:
        path = work / f"{fp32.stem}.{method}{'_constb' if const_b else ''}{'_down32' if down else ''}.int8-qdq.onnx"
        t0 = time.perf_counter()
        calib = feeds["calib"] if method == "MinMax" else _first(feeds["calib"], PERCENTILE_SAMPLES)
        quantize_qdq(fp32, path, calib, method=method, const_b_only=const_b, fp32_down=down)
        label = (f"qdq {method}{'' if method == 'MinMax' else f' ({PERCENTILE_SAMPLES} samples)'}, "
                 f"{'weight MatMuls' if const_b else 'all MatMuls'}{', MLP down fp32' if down else ''}")
        rows.append(row(fp32, path, label, feeds, repeats, round(time.perf_counter() - t0, 1)))
    return rows


def markdown(res: dict) -> str:
    lines = ["# int8 QDQ (static) calibration settings (all-MiniLM-L6-v2, onnxruntime CPU EP)", "",
             f"Artifacts: {res['dir']} (ranking {res['ranking']}). CPU: {res['machine']['cpu']} (AVX2, no VNNI), "
             f"onnxruntime {res['machine'].get('onnxruntime')}, 2 intra-op threads, load average at start "
             f"{res['machine']['load_average'][0]:.1f}.", "",
             "Cosine of `sentence_embedding` vs the file's own fp32 file (min / mean over rows): "
             f"**held-out calib** = the {res['heldout']} calibration samples held out of the calibration reader "
             f"(the reader got the other {res['calibrated']}); **held-out texts** = {res['texts']} retrieval texts "
             "(standard-library docstrings); **verify random** = verify's random-token inputs (2 x 32 tokens, "
             "seeds 0 and 1). Exact and deterministic.",
             "Latency: batch 8 at 128 tokens, median of "
             f"{res['repeats']} runs. **The machine was shared with other jobs (a niced benchmark): latencies "
             "are rough (differences under ~15 % are noise).**", "",
             "| file | variant | MB | quantize s | held-out calib min / mean | held-out texts min / mean | "
             "verify random min / mean | batch-8 ms |", "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['file']} | {r['variant']} | {r['mb']} | {r['quantize_s'] or ''} | "
                     f"{r['heldout_calib_min']:.4f} / {r['heldout_calib_mean']:.4f} | "
                     f"{r['heldout_texts_min']:.4f} / {r['heldout_texts_mean']:.4f} | "
                     f"{r['verify_random_min']:.4f} / {r['verify_random_mean']:.4f} | {r['batch8_ms']} |")
    lines += ["", f"Chosen: {res['chosen']}. See the docstring of `elastic_export/precision/int8_qdq.py`."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="artifact directory of MiniLM (default: build one)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--work", default=None)
    ap.add_argument("--files", default=None, help="comma list of fp32 files of DIR (default: dense and every budget)")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="int8-qdq-settings-"))
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.dir) if args.dir else work / "out"
    if not (out / "manifest.json").is_file():
        from elastic_export.pipeline import Options, run

        run(Options(model=None, budgets=(0.3, 0.6), out=str(out), method="magnitude", verify=False,
                    elastic_graph=False, report=False, overwrite=True))
    manifest = {**json.loads((out / "manifest.json").read_text()), "_dir": str(out)}
    feeds = inputs(manifest)
    rows = []
    files = args.files.split(",") if args.files else ["dense.onnx", *[b["onnx"] for b in manifest["budgets"]]]
    for rel in files:
        rows += measure(out / rel, work, feeds, args.repeats)
    res = {"model": "all-MiniLM-L6-v2 (embedded default)", "dir": str(out), "ranking": manifest["ranking"]["method"],
           "heldout": sum(len(b["input_ids"]) for b in feeds["heldout_calib"]),
           "calibrated": sum(len(b["input_ids"]) for b in feeds["calib"]),
           "texts": sum(len(b["input_ids"]) for b in feeds["heldout_texts"]),
           "repeats": args.repeats, "machine": machine(), "rows": rows, "chosen": os.environ.get("QDQ_CHOSEN", "?")}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "int8_qdq_settings.json").write_text(json.dumps(res, indent=2) + "\n")
    (RESULTS / "int8_qdq_settings.md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
