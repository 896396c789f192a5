"""Hugging Face BERT-family text encoders: BERT (incl. MiniLM), RoBERTa, XLM-RoBERTa."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import BertModel, RobertaModel, XLMRobertaModel
from transformers.models.bert.modeling_bert import BertLayer
from transformers.models.roberta.modeling_roberta import RobertaLayer
from transformers.models.xlm_roberta.modeling_xlm_roberta import XLMRobertaLayer

from elastic_export.models.adapters.base import HEADS, NEURONS, InputSpec, LinearRole, UnitGroup, register_block
from elastic_export.models.adapters.registry import ModelAdapter, register_adapter


def _no_heads_forward(self_attn: nn.Module):
    """Forward of a self-attention that kept 0 heads: a 0-wide context (the output dense adds its bias)."""

    def forward(hidden_states, *args, **kwargs):
        return hidden_states.new_zeros(*hidden_states.shape[:-1], 0), None

    return forward


@register_block(BertLayer, RobertaLayer, XLMRobertaLayer)
def describe_bert_layer(layer: nn.Module) -> tuple[UnitGroup, UnitGroup]:
    sa = layer.attention.self
    hd = sa.attention_head_size

    def resize(n: int) -> None:
        sa.num_attention_heads = n
        sa.all_head_size = n * hd
        if n == 0:
            sa.forward = _no_heads_forward(sa)

    heads = UnitGroup(
        kind=HEADS,
        count=sa.num_attention_heads,
        width=hd,
        producers=[LinearRole(sa.query, "out"), LinearRole(sa.key, "out"), LinearRole(sa.value, "out")],
        consumer=LinearRole(layer.attention.output.dense, "in"),
        module=sa,
        resize=resize,
    )
    neurons = UnitGroup(
        kind=NEURONS,
        count=layer.intermediate.dense.out_features,
        width=1,
        producers=[LinearRole(layer.intermediate.dense, "out")],
        consumer=LinearRole(layer.output.dense, "in"),
        module=layer.intermediate,
    )
    return heads, neurons


def last_token(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The state at the last position whose mask is 1, per row (left or right padding)."""
    positions = torch.arange(hidden.shape[1], device=hidden.device)
    last = (positions * (attention_mask > 0).long()).amax(dim=1)
    return torch.gather(hidden, 1, last[:, None, None].expand(-1, 1, hidden.shape[-1])).squeeze(1)


def pool_tokens(hidden: torch.Tensor, attention_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Sentence-transformers pooling of token states: ``mean``, ``cls``, ``max`` or ``lasttoken``."""
    if mode == "cls":
        return hidden[:, 0]
    if mode == "lasttoken":
        return last_token(hidden, attention_mask)
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "max":
        return (hidden - (1.0 - mask) * 1e9).max(dim=1).values
    return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)


class TextExport(nn.Module):
    def __init__(self, model: nn.Module, token_types: bool, pooling: str | None, normalize: bool) -> None:
        super().__init__()
        self.model = model
        self.token_types = token_types
        self.pooling = pooling
        self.normalize = normalize

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        kwargs = {"token_type_ids": token_type_ids} if self.token_types else {}
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)[0]
        if self.pooling is None:
            return (hidden,)
        emb = pool_tokens(hidden, attention_mask, self.pooling)
        if self.normalize:
            emb = F.normalize(emb, p=2.0, dim=-1)
        return hidden, emb


@register_adapter(BertModel, RobertaModel, XLMRobertaModel)
class HFBertAdapter(ModelAdapter):
    """Hugging Face BERT-family encoders (BERT, MiniLM, RoBERTa, XLM-RoBERTa)."""

    label = "Hugging Face BertModel / RobertaModel / XLMRobertaModel (incl. MiniLM)"
    modality = "text"

    def width(self, model: nn.Module) -> int:
        return model.config.hidden_size

    def tokens(self, model: nn.Module, seq_len: int) -> int:
        return seq_len

    def has_token_types(self, model: nn.Module) -> bool:
        return getattr(model.config, "type_vocab_size", 0) > 1

    def input_specs(self, model: nn.Module) -> list[InputSpec]:
        names = ["input_ids", "attention_mask"] + (["token_type_ids"] if self.has_token_types(model) else [])
        return [InputSpec(n, "int64", ["batch", "sequence"]) for n in names]

    def output_names(self, model: nn.Module, extras: dict[str, Any]) -> list[str]:
        return ["last_hidden_state"] + (["sentence_embedding"] if extras.get("pooling") else [])

    def export_module(self, model: nn.Module, extras: dict[str, Any]) -> nn.Module:
        return TextExport(model, self.has_token_types(model), extras.get("pooling"), bool(extras.get("normalize")))

    def sample_inputs(self, model: nn.Module, batch: int, seq_len: int, generator: torch.Generator) -> dict:
        cfg = model.config
        low = 1000 if cfg.vocab_size > 2000 else 1  # stay clear of special tokens in real vocabularies
        ids = torch.randint(low, cfg.vocab_size, (batch, seq_len), generator=generator)
        lengths = torch.randint(1, seq_len + 1, (batch,), generator=generator)
        lengths[0] = seq_len
        mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
        pad = getattr(cfg, "pad_token_id", 0) or 0
        ids = torch.where(mask.bool(), ids, torch.full_like(ids, pad))
        feeds = {"input_ids": ids, "attention_mask": mask}
        if self.has_token_types(model):
            feeds["token_type_ids"] = torch.zeros_like(ids)
        return feeds
