"""04: a Triton model repository: one model per budget and a router that picks one per request.

    python examples/04_triton_repository.py DIR

Writes ``DIR/triton/`` (same as ``elastic-export build triton DIR``) and prints the router's
config. Serve it with ``elastic-export serve DIR`` (docs/serving.md), or an NGC container's
``tritonserver --model-repository DIR/triton``.
"""

import argparse
from pathlib import Path

from elastic_export.targets.triton import build_repository

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("directory", type=Path)
args = ap.parse_args()

manifest = build_repository(args.directory)
info = manifest.triton
print({k: v for k, v in info.items() if k != "models"})
router = args.directory / info["dir"] / info["router"] / "config.pbtxt"
print(router.read_text())
