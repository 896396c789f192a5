"""Architecture adapters: a registry keyed by model type.

``adapter_for(model)`` returns the :class:`ModelAdapter` registered for the model's class (or a
base class). Block-level unit descriptions live in a second table keyed by block type
(:data:`elastic_export.models.adapters.base.BLOCK_DESCRIBERS`). Importing this package registers all
built-in adapters.
"""

from __future__ import annotations

from torch import nn

from elastic_export.core.errors import UserError
from elastic_export.models.adapters.base import (  # noqa: F401
    HEADS,
    NEURONS,
    BlockUnits,
    IndexRole,
    InputSpec,
    LinearRole,
    SharedHeads,
    UnitGroup,
    find_blocks,
)
from elastic_export.models.adapters.registry import (  # noqa: F401
    ADAPTERS,
    REFUSED,
    TOWERS,
    ModelAdapter,
    register_adapter,
)

# isort: split
# Registration side effects: each module adds its adapters and block describers.
from elastic_export.models.adapters import (
    hf_bert,  # noqa: E402,F401
    hf_clip,  # noqa: E402,F401
    hf_decoder,  # noqa: E402,F401
    hf_distilbert,  # noqa: E402,F401
    hf_modernbert,  # noqa: E402,F401
    hf_mpnet,  # noqa: E402,F401
    hf_siglip,  # noqa: E402,F401
    hf_vision,  # noqa: E402,F401
    timm_eva,  # noqa: E402,F401
    timm_vit,  # noqa: E402,F401
)


def supported() -> list[str]:
    """Human-readable names of every supported architecture."""
    return sorted({a.label for a in ADAPTERS.values()})


def adapter_for(model: nn.Module) -> ModelAdapter:
    """The adapter registered for ``type(model)`` or its nearest registered base class.

    Raises:
        UserError: the model type is not supported (the message lists what is), or the adapter
            refuses one of its options (:meth:`ModelAdapter.check`).
    """
    for cls in type(model).__mro__:
        if cls in ADAPTERS:
            ADAPTERS[cls].check(model)
            return ADAPTERS[cls]
        if cls in REFUSED:
            raise UserError(f"{type(model).__name__} is not supported: {REFUSED[cls]}")
        if cls in TOWERS:
            raise UserError(f"{type(model).__name__} holds a text and a vision tower: choose one with "
                            "--tower text or --tower vision")
    raise UserError(
        f"unsupported architecture {type(model).__name__}; supported: {', '.join(supported())}"
    )
