"""Hugging Face CLIP towers: ``CLIPTextModel`` / ``CLIPVisionModel`` and their ``...WithProjection``.

Both towers are stacks of ``CLIPEncoderLayer`` (pre-norm; q/k/v/out_proj attention, fc1/fc2 MLP).
The text tower is causal and pools the final-norm state of the first EOS token; the vision tower
has a class token, a pre-layernorm and pools the post-layernormed class token.

Outputs (the embedding the ranking distils is the last one named here):

* text: ``last_hidden_state``, ``sentence_embedding`` = the EOS-pooled state (``CLIPTextModel``'s
  ``pooler_output``) or, with projection, ``text_embeds``;
* vision: ``last_hidden_state``, ``pooler_output`` (+ ``image_embeds`` with projection).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    CLIPModel,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPVisionModel,
    CLIPVisionModelWithProjection,
)
from transformers.models.clip.modeling_clip import CLIPEncoderLayer

from elastic_export.models.adapters.base import UnitGroup, mlp_neurons, qkv_heads, register_block
from elastic_export.models.adapters.hf_vision import HFVisionAdapter
from elastic_export.models.adapters.registry import EmbedderAdapter, register_adapter, register_towers


@register_block(CLIPEncoderLayer)
def describe_clip_layer(layer: nn.Module) -> tuple[UnitGroup, UnitGroup]:
    """Heads of ``layer.self_attn`` and neurons of ``layer.mlp``."""
    attn, mlp = layer.self_attn, layer.mlp
    return (qkv_heads(attn, attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj, "num_heads", attn.head_dim),
            mlp_neurons(mlp, mlp.fc1, mlp.fc2))


# --- text tower --------------------------------------------------------------------------------


class _ClipTextExport(nn.Module):
    def __init__(self, model: nn.Module, normalize: bool) -> None:
        super().__init__()
        self.model = model
        self.projected = isinstance(model, CLIPTextModelWithProjection)
        self.normalize = normalize

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask)
        emb = out.text_embeds if self.projected else out.pooler_output
        if self.normalize:
            emb = F.normalize(emb, p=2.0, dim=-1)
        return out.last_hidden_state, emb


def eos_id(config: Any) -> int:
    """The token the text tower pools at. Legacy configs (``eos_token_id == 2``, or an id outside
    the vocabulary) pool at the highest token id, which the CLIP tokenizer gives to EOS."""
    eos = config.eos_token_id
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    if eos is None or eos == 2 or not 0 <= eos < config.vocab_size:
        return config.vocab_size - 1
    return int(eos)


@register_adapter(CLIPTextModel, CLIPTextModelWithProjection)
class HFClipTextAdapter(EmbedderAdapter):
    """CLIP text tower: inputs ``input_ids``, ``attention_mask``; outputs ``last_hidden_state`` and
    ``sentence_embedding`` (EOS-pooled, projected for ``CLIPTextModelWithProjection``)."""

    label = "Hugging Face CLIPTextModel / CLIPTextModelWithProjection"
    def export_module(self, model: nn.Module, extras: dict[str, Any]) -> nn.Module:
        return _ClipTextExport(model, bool(extras.get("normalize")))

    def sample_inputs(self, model: nn.Module, batch: int, seq_len: int, generator: torch.Generator) -> dict:
        """Rows like the CLIP tokenizer makes them: BOS, text, EOS, then padding."""
        cfg = model.config
        eos = eos_id(cfg)
        bos = cfg.bos_token_id if cfg.bos_token_id is not None and 0 <= cfg.bos_token_id < cfg.vocab_size else None
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else eos
        low = 1000 if cfg.vocab_size > 2000 else 2
        ids = torch.randint(low, cfg.vocab_size, (batch, seq_len), generator=generator)
        for special in (eos, bos):
            if special is not None:
                ids[ids == special] = low
        lengths = torch.randint(min(2, seq_len), seq_len + 1, (batch,), generator=generator)
        lengths[0] = seq_len
        pos = torch.arange(seq_len)[None, :]
        mask = (pos < lengths[:, None]).long()
        if bos is not None and seq_len > 1:
            ids[:, 0] = bos
        ids = torch.where(pos == lengths[:, None] - 1, torch.full_like(ids, eos), ids)
        ids = torch.where(mask.bool(), ids, torch.full_like(ids, pad))
        return {"input_ids": ids, "attention_mask": mask}


# --- vision tower ------------------------------------------------------------------------------


class _ClipVisionExport(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.projected = isinstance(model, CLIPVisionModelWithProjection)

    def forward(self, pixel_values: torch.Tensor):
        if not self.projected:
            out = self.model(pixel_values=pixel_values)
            return out.last_hidden_state, out.pooler_output
        out = self.model.vision_model(pixel_values=pixel_values)
        return out.last_hidden_state, out.pooler_output, self.model.visual_projection(out.pooler_output)


@register_adapter(CLIPVisionModel, CLIPVisionModelWithProjection)
class HFClipVisionAdapter(HFVisionAdapter):
    """CLIP vision tower: ``pixel_values`` in; ``last_hidden_state`` and ``pooler_output`` (the
    post-layernormed class token) out, plus ``image_embeds`` (the embedding) with projection."""

    label = "Hugging Face CLIPVisionModel / CLIPVisionModelWithProjection"

    def output_names(self, model: nn.Module, extras: dict[str, Any]) -> list[str]:
        extra = ["image_embeds"] if isinstance(model, CLIPVisionModelWithProjection) else []
        return ["last_hidden_state", "pooler_output", *extra]

    def embedding_output(self, model: nn.Module, extras: dict[str, Any]) -> str | None:
        return self.output_names(model, extras)[-1]

    def export_module(self, model: nn.Module, extras: dict[str, Any]) -> nn.Module:
        return _ClipVisionExport(model)


# --- dual encoder ------------------------------------------------------------------------------


@register_towers(CLIPModel)
def clip_tower(model: nn.Module, tower: str) -> nn.Module:
    """One tower of a ``CLIPModel`` with its projection, as the ``...WithProjection`` class that
    transformers has for it (sharing the full model's modules; nothing is copied)."""
    if tower == "text":
        cls, cfg, parts = CLIPTextModelWithProjection, model.config.text_config, ("text_model", "text_projection")
    else:
        cls, cfg, parts = CLIPVisionModelWithProjection, model.config.vision_config, ("vision_model", "visual_projection")
    cfg = copy.deepcopy(cfg)
    cfg.projection_dim = model.config.projection_dim
    with torch.device("meta"):  # every module is replaced by the full model's below
        out = cls(cfg)
    for name in parts:
        setattr(out, name, getattr(model, name))
    return out.eval()
