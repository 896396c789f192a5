"""Merged short queries run whole (padded to the longest) or in groups of similar length
(``elastic_export.serving.length_groups``, what the router and the budget models do with pooled rows).

The API merges concurrent queries into one request; the queries are 5-30 tokens long (``serve_traffic.py``'s
short trace, real text), so a merged batch pads to about its longest. This times, in this process, the
default MiniLM run's budget models (the files ``serve`` serves, onnxruntime as the Python budget models open
them: default threads, spinning off) on merged batches of 4-32 queries drawn from that trace: the padded
batch whole against :func:`run_grouped`, interleaved round by round, median per batch. Rows/s and padded
tokens of both; the gain is what the grouping saves on the model's compute, not end to end.

Usage:
    python benchmarks/length_groups.py [--rows 4,8,16,32] [--budgets 0,0.3,0.6] [--batches 12] [--rounds 7]
        [--artifacts DIR] [--no-write]

Writes benchmarks/results/length_groups.{json,md} unless ``--no-write``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from serve_traffic import build_corpus  # noqa: E402
from serve_triton import DEFAULT_ARTIFACTS, ensure_artifacts, machine, write_results  # noqa: E402

from elastic_export.serving.length_groups import length_groups, padded_tokens, run_grouped  # noqa: E402

OUTPUT = "sentence_embedding"


def sessions(directory: Path, budgets: list[float]) -> dict[float, object]:
    """The budget models' sessions, opened as the Python budget models open theirs."""
    from elastic_export.core.manifest import Manifest
    from elastic_export.targets import triton_onnx_model as ort_model

    m = Manifest.load(directory)
    files = {0.0: m.dense.onnx, **{b.sparsity: b.onnx for b in m.budgets}}
    return {s: ort_model.open_session(str(directory / files[s]), {ort_model.SPIN_PARAMETER: "0"}) for s in budgets}


def merged_batches(encoder, lengths_pool: list[int], rows: int, count: int, seed: int) -> list[dict]:
    """``count`` padded batches of ``rows`` queries of lengths drawn from the short trace (seeded)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        lengths = rng.choice(lengths_pool, rows)
        width = int(lengths.max())
        ids = rng.integers(1000, encoder.tokenizer.get_vocab_size(), (rows, width)).astype(np.int64)
        mask = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int64)
        out.append({"input_ids": ids * mask, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)})
    return out


def timed(run, batches: list[dict], rounds: int) -> float:
    """Median seconds over ``rounds`` of running every batch once."""
    for b in batches[:2]:
        run(b)
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for b in batches:
            run(b)
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def measure(sess, batches: list[dict], rounds: int) -> dict:
    whole = lambda b: sess.run([OUTPUT], b)  # noqa: E731
    grouped = lambda b: run_grouped(sess.run, [OUTPUT], b)  # noqa: E731
    t_whole, t_grouped = [], []
    for _ in range(rounds):  # interleaved: what else runs falls on both alike
        t_whole.append(timed(whole, batches, 1))
        t_grouped.append(timed(grouped, batches, 1))
    lengths = [b["attention_mask"].sum(axis=1).tolist() for b in batches]
    real = sum(sum(x) for x in lengths)
    padded = sum(padded_tokens(x) for x in lengths)
    grouped_padded = sum(padded_tokens([x[i] for i in g]) for x in lengths for g in length_groups(x))
    rows = sum(len(x) for x in lengths)
    return {"rows_per_s_whole": rows / float(np.median(t_whole)), "rows_per_s_grouped": rows / float(np.median(t_grouped)),
            "waste_whole": 1 - real / padded, "waste_grouped": 1 - real / grouped_padded,
            "cut": float(np.mean([len(length_groups(x)) > 1 for x in lengths]))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifacts", type=Path, default=DEFAULT_ARTIFACTS)
    ap.add_argument("--rows", default="4,8,16,32")
    ap.add_argument("--budgets", default="0,0.3,0.6")
    ap.add_argument("--batches", type=int, default=12, help="merged batches per size")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args(argv)
    from elastic_export.core.manifest import Manifest
    from elastic_export.models.text import TextEncoder, tokenizer_folder

    d = ensure_artifacts(a.artifacts)
    m = Manifest.load(d)
    encoder = TextEncoder.from_dir(tokenizer_folder(m, d), [v.name for v in m.inputs])
    pool = build_corpus(encoder).query_tokens
    budgets = [float(x) for x in a.budgets.split(",")]
    sess = sessions(d, budgets)
    rows_list = [int(x) for x in a.rows.split(",")]
    records = []
    for rows in rows_list:
        batches = merged_batches(encoder, pool, rows, a.batches, seed=rows)
        for s in budgets:
            r = {"rows": rows, "sparsity": s, **measure(sess[s], batches, a.rounds)}
            r["gain"] = r["rows_per_s_grouped"] / r["rows_per_s_whole"]
            records.append(r)
            print(f"rows {rows:3d} sparsity {s:.1f}: whole {r['rows_per_s_whole']:.0f} rows/s, grouped "
                  f"{r['rows_per_s_grouped']:.0f} rows/s (x{r['gain']:.2f}); padding {r['waste_whole']:.0%} -> "
                  f"{r['waste_grouped']:.0%}", flush=True)
    out = {"machine": machine(), "command": "python benchmarks/length_groups.py " + " ".join(argv or sys.argv[1:]),
           "artifacts": str(d), "query_tokens": [min(pool), max(pool)], "batches_per_size": a.batches,
           "rounds": a.rounds, "records": records}
    text = "\n".join(report(out)) + "\n"
    if a.no_write:
        print(text)
    else:
        write_results("length_groups", out, text)
    return 0


def report(out: dict) -> list[str]:
    lines = ["# Merged short queries: whole padded batch against groups of similar length", "",
             f"Machine: {out['machine']}. `{out['command'].strip()}`.", "",
             f"Queries of {out['query_tokens'][0]}-{out['query_tokens'][1]} tokens (the short trace's real text), "
             f"{out['batches_per_size']} merged batches per size, {out['rounds']} interleaved rounds, median; "
             "in-process onnxruntime on the served budget files (default threads, spinning off). "
             "cut: the share of batches that ran as more than one group.", "",
             "| rows | sparsity | padding whole | padding grouped | cut | rows/s whole | rows/s grouped | gain |",
             "|---|---|---|---|---|---|---|---|"]
    for r in out["records"]:
        lines.append(f"| {r['rows']} | {r['sparsity']:.1f} | {r['waste_whole']:.0%} | {r['waste_grouped']:.0%} | "
                     f"{r['cut']:.0%} | {r['rows_per_s_whole']:.0f} | {r['rows_per_s_grouped']:.0f} | "
                     f"{r['gain']:.2f} |")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
