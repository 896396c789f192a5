"""02: the passes alone: cut any per-layer widths from an exported dense model (no torch).

    python examples/02_slice_custom_widths.py DIR [--keep 0.5]

Keeps the first ``--keep`` of every layer's heads and neurons (the dense export stores units in
rank order, so a prefix is the best-ranked units), writes ``DIR/custom.onnx`` with
``BudgetSlicer`` and runs it next to the dense model in onnxruntime.
"""

import argparse
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from elastic_export.checks.verify import sample_inputs
from elastic_export.core.manifest import Manifest
from elastic_export.core.unit_map import get_units
from elastic_export.passes import BudgetSlicer

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("directory", type=Path)
ap.add_argument("--keep", type=float, default=0.5)
args = ap.parse_args()

manifest = Manifest.load(args.directory)
dense = onnx.load(str(manifest.path(manifest.dense.onnx)))
units = get_units(dense)
heads = [int(L["heads"]["count"] * args.keep) for L in units]
neurons = [int(L["neurons"]["count"] * args.keep) for L in units]
out = args.directory / "custom.onnx"
BudgetSlicer(dense).save(heads, neurons, out, full_check=True)
print(f"heads {heads}, neurons {neurons} -> {out} ({out.stat().st_size / 1e6:.1f} MB)")

feeds = sample_inputs(manifest, dense, batch=2, seed=0)
for name in (manifest.dense.onnx, "custom.onnx"):
    sess = ort.InferenceSession(str(args.directory / name), providers=["CPUExecutionProvider"])
    first = sess.run(None, {i.name: feeds[i.name] for i in sess.get_inputs()})[0]
    print(f"{name}: output {first.shape}, mean |x| {float(np.abs(first).mean()):.4f}")
