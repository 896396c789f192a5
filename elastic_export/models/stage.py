"""The main job's load stage (called by :mod:`elastic_export.pipeline`): the model and its unit inventory."""

from __future__ import annotations

from typing import Callable

from elastic_export.models.encoder import Encoder
from elastic_export.models.inventory import Inventory, build_inventory
from elastic_export.models.loader import load_encoder


def load_model(model: str | None, echo: Callable[[str], None], **options) -> tuple[Encoder, Inventory]:
    """Load ``model`` (None: the embedded all-MiniLM-L6-v2) with :func:`load_encoder`'s ``options``
    and count its units; say what was loaded."""
    echo(f"loading {model or 'all-MiniLM-L6-v2 (embedded default)'}")
    encoder = load_encoder(model, **options)
    inventory = build_inventory(encoder)
    if encoder.revision:
        echo(f"{encoder.repo_id}: hub commit {encoder.revision}")
    echo(f"{encoder.architecture}: {len(inventory.layers)} blocks, N={inventory.tokens} tokens, "
         f"{inventory.total_flops / 1e9:.3f} GFLOPs ({inventory.prunable_flops / 1e9:.3f} prunable), "
         f"{inventory.total_params / 1e6:.2f}M params")
    return encoder, inventory
