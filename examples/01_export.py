"""01: make a model elastic: rank every unit, export one ONNX per budget plus the elastic graph.

    python examples/01_export.py [--model PATH_OR_TIMM_NAME] [--budgets 0.1..0.6] [--out elastic-out]

Default: the embedded all-MiniLM-L6-v2 with the paper's optimised ranking (about 1.5 minutes on
2 CPU cores). Any ``elastic-export`` option is an ``Options`` field.
"""

import argparse

from elastic_export.core.budgets import parse_budgets
from elastic_export.pipeline import Options, run

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--model", default=None)
ap.add_argument("--budgets", default="0.1..0.6")
ap.add_argument("--out", default="elastic-out")
ap.add_argument("--method", default="elastic")
ap.add_argument("--seq-len", type=int, default=None)
args = ap.parse_args()

manifest = run(Options(model=args.model, budgets=parse_budgets(args.budgets), out=args.out, method=args.method,
                       seq_len=args.seq_len, overwrite=True))
for b in manifest.budgets:
    print(f"sparsity {b.sparsity:.2f}: {b.gflops:.3f} GFLOPs, {b.params / 1e6:.2f}M params, "
          f"heads per layer {b.heads_per_layer}, max abs error {b.max_abs_error:.1e} -> {b.onnx}")
