"""The int8 cosine on the *check* inputs (random token ids), which the bound must hold on.

The main job checks every int8 file against its fp32 file on its sample inputs (batch 2, 128
random token ids for MiniLM) and ``verify`` on its own (batch 2, 32 random tokens by default).
Random tokens are harsher than real text (``int8_settings.py`` measures real held-out text).
This runs the main job on the embedded all-MiniLM-L6-v2 (``magnitude`` ranking, budgets
0.1..0.6, ``--precision fp32,int8``) with the bound switched off, then ``verify`` with two seeds,
and writes every file's min cosine to ``benchmarks/results/int8_check_inputs.{json,md}``.

Usage: python benchmarks/int8_check_inputs.py [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from pathlib import Path

import elastic_export.checks.verify as V
import elastic_export.pipeline as P

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=None)
    out = Path(ap.parse_args().work or tempfile.mkdtemp(prefix="int8-check-")) / "minilm"
    logging.disable(logging.WARNING)
    add, check = P.add_int8, V._check_int8
    P.add_int8 = lambda d, n, f: add(d, n, f, bound=-1.0)  # measure, do not fail
    V._check_int8 = lambda *a, **k: check(*a, bound=-1.0)
    m = P.run(P.Options(method="magnitude", precision="fp32,int8", report=False, out=str(out), overwrite=True),
              echo=lambda s: None)
    res = {"model": "all-MiniLM-L6-v2", "files": [e["onnx_int8"] for e in [m["dense"], *m["budgets"]]],
           "main job (batch 2, 128 random tokens)": [round(e["int8_min_cosine"], 4) for e in [m["dense"], *m["budgets"]]]}
    for seed in (0, 1):
        r = V.verify_dir(out, use_torch=False, seed=seed)
        res[f"verify seed {seed} (batch 2, 32 random tokens)"] = [float(c.detail.split()[-1]) for c in r.checks
                                                                   if c.kind == "int8"]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "int8_check_inputs.json").write_text(json.dumps(res, indent=2) + "\n")
    keys = [k for k in res if k not in ("model", "files")]
    lines = ["# int8 min embedding cosine vs fp32 on the check inputs (all-MiniLM-L6-v2, magnitude ranking)", "",
             "| file | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    lines += [f"| {f} | " + " | ".join(f"{res[k][i]:.4f}" for k in keys) + " |" for i, f in enumerate(res["files"])]
    (RESULTS / "int8_check_inputs.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
