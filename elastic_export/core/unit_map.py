"""Unit kinds and the unit map an exported ONNX model carries in its metadata (no torch).

The dense export stores, under :data:`UNITS_KEY`, one entry per layer: for ``heads`` and
``neurons`` the unit count and width, the producer weights (and their packing) and the consumer
weight, bias and nodes. The passes, ``verify`` and the onnxruntime optimiser read it; none of them
needs torch, so this module does not import it.
"""

from __future__ import annotations

import json

import onnx

from elastic_export.core.errors import UserError

HEADS = "heads"
NEURONS = "neurons"
UNITS_KEY = "elastic_export.units"


def get_units(model: onnx.ModelProto) -> list[dict]:
    """The unit map of an exported model (one dict per layer).

    Raises:
        UserError: the model has none (not exported by elastic-export).
    """
    for p in model.metadata_props:
        if p.key == UNITS_KEY:
            return json.loads(p.value)
    raise UserError("this ONNX model has no elastic-export unit map; export it with elastic-export first")


def set_units(model: onnx.ModelProto, layers: list[dict]) -> None:
    """Replace the unit map of ``model`` with ``layers``."""
    keep = [p for p in model.metadata_props if p.key != UNITS_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(keep)
    entry = model.metadata_props.add()
    entry.key, entry.value = UNITS_KEY, json.dumps(layers, sort_keys=True)
