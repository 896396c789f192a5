"""03: serve every budget from one process and let the load pick the budget.

    python examples/03_serve_with_the_runtime.py DIR

Loads the dense model and every budget once (``ElasticRuntime``), runs one request per budget,
then lets a ``LoadAdaptivePolicy`` move between budgets as a made-up queue grows and drains.
"""

import argparse
from pathlib import Path

import onnx

from elastic_export.checks.verify import sample_inputs
from elastic_export.core.manifest import Manifest
from elastic_export.serving.runtime import ElasticRuntime, LoadAdaptivePolicy, measure_switch_cost
from elastic_export.targets.onnxruntime import SessionConfig

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("directory", type=Path)
args = ap.parse_args()

rt = ElasticRuntime.from_dir(args.directory, config=SessionConfig(threads=1))
manifest = Manifest.load(args.directory)
dense = onnx.load(str(manifest.path(manifest.dense.onnx)), load_external_data=False)
feeds = sample_inputs(manifest, dense, batch=1, seed=0)
for s in rt.sparsities:
    served, out = rt.serve(feeds, sparsity=s)
    print(f"sparsity {served:.2f}: {rt.file(served)} -> {', '.join(f'{k} {v.shape}' for k, v in out.items())}")
print(f"switching budget costs {measure_switch_cost(rt, n=1000) * 1e3:.2f} µs (median of 1000)")

rt.set_policy(LoadAdaptivePolicy(up_depth=4, down_depth=1, down_after=3))
for depth in [0, 2, 6, 9, 12, 8, 3, 1, 0, 0, 0, 0, 0, 0, 0]:
    s = rt.observe(queue_depth=depth)
    print(f"queue depth {depth:2d} -> serving sparsity {s:.2f}")
