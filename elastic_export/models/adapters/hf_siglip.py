"""Hugging Face SigLIP / SigLIP 2 towers: ``SiglipVisionModel``, ``SiglipTextModel``, ``Siglip2TextModel``.

Both towers are stacks of pre-norm encoder layers shaped like CLIP's (q/k/v/out_proj attention,
fc1/fc2 MLP), so the units are those of :func:`elastic_export.models.adapters.hf_clip.describe_clip_layer`.

* vision: no class token (N = patches); ``pooler_output`` is the attention-pooling head's output
  (``MultiheadAttentionPoolingHead``: not prunable, exported as it is); without a head
  (``vision_use_head=False``) only ``last_hidden_state``.
* text: bidirectional; transformers pools the *last position* after the final norm and applies
  ``head`` (a Linear): that is ``sentence_embedding``. SigLIP was trained on rows padded to the
  model's length (``padding="max_length"``); ``attention_mask`` is passed on as transformers does.

``Siglip2VisionModel`` (NaFlex: patchified pixels with ``pixel_attention_mask`` and
``spatial_shapes``, its position embeddings resized per image) is refused; the fixed-resolution
SigLIP 2 checkpoints are ``SiglipModel`` directories.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers import (
    Siglip2Model,
    Siglip2TextModel,
    Siglip2VisionModel,
    SiglipModel,
    SiglipTextModel,
    SiglipVisionModel,
)
from transformers.models.siglip.modeling_siglip import SiglipEncoderLayer
from transformers.models.siglip2.modeling_siglip2 import Siglip2EncoderLayer

from elastic_export.models.adapters.base import register_block
from elastic_export.models.adapters.hf_clip import HFClipTextAdapter, describe_clip_layer
from elastic_export.models.adapters.hf_vision import HFVisionAdapter
from elastic_export.models.adapters.registry import refuse_model, register_adapter, register_towers

register_block(SiglipEncoderLayer, Siglip2EncoderLayer)(describe_clip_layer)

refuse_model(Siglip2VisionModel, "its NaFlex inputs (patchified pixel_values, pixel_attention_mask, spatial_shapes) "
                                 "resize position embeddings per image, which a fixed ONNX graph cannot; "
                                 "fixed-resolution SigLIP 2 checkpoints load as SiglipModel")


@register_adapter(SiglipVisionModel)
class HFSiglipVisionAdapter(HFVisionAdapter):
    """SigLIP vision tower: ``pixel_values`` in; ``last_hidden_state`` and, with the attention-pooling
    head, ``pooler_output`` (the embedding) out. N = patches (no class token)."""

    label = "Hugging Face SiglipVisionModel (SigLIP / SigLIP 2 fixed resolution)"

    def tokens(self, model: nn.Module, seq_len: int) -> int:
        return super().tokens(model, seq_len) - 1

    def output_names(self, model: nn.Module, extras: dict[str, Any]) -> list[str]:
        return ["last_hidden_state"] + (["pooler_output"] if model.use_head else [])


@register_adapter(SiglipTextModel, Siglip2TextModel)
class HFSiglipTextAdapter(HFClipTextAdapter):
    """SigLIP text tower: inputs ``input_ids``, ``attention_mask``; outputs ``last_hidden_state`` and
    ``sentence_embedding`` (``pooler_output``: ``head`` of the last position's normed state)."""

    label = "Hugging Face SiglipTextModel / Siglip2TextModel"


@register_towers(SiglipModel, Siglip2Model)
def siglip_tower(model: nn.Module, tower: str) -> nn.Module:
    """A SigLIP tower is a model of its own inside ``SiglipModel`` (no projections: each tower's
    ``head`` makes its embedding)."""
    return (model.text_model if tower == "text" else model.vision_model).eval()
