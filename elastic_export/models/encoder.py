"""``Encoder``: a loaded model bound to its adapter, with everything later stages ask of it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from elastic_export.models.adapters import BlockUnits, InputSpec, ModelAdapter, find_blocks


@dataclass
class Encoder:
    """A pre-trained encoder ready for the pipeline.

    Args:
        module: the torch model (eval mode, fp32).
        adapter: its registered adapter.
        source: what the user passed (path or timm name).
        architecture: model class name (and timm name where there is one).
        seq_len: nominal text length N (text encoders).
        extras: adapter options, e.g. sentence-transformers ``pooling`` and ``normalize``.
        tokenizer: a Hugging Face tokenizer for text encoders, when the model directory has one.
        data_config: timm / HF preprocessing config for image encoders.
        tower: ``"text"`` / ``"vision"`` when the module is one tower of a dual-encoder ``source``.
        repo_id: the hub repository the weights came from (hub ids and timm hub weights), else None.
        revision: the commit of ``repo_id`` that was loaded.
    """

    module: nn.Module
    adapter: ModelAdapter
    source: str
    architecture: str
    seq_len: int = 128
    extras: dict[str, Any] = field(default_factory=dict)
    tokenizer: Any = None
    data_config: dict[str, Any] | None = None
    tower: str | None = None
    repo_id: str | None = None
    revision: str | None = None

    @property
    def modality(self) -> str:
        return self.adapter.modality

    def blocks(self, module: nn.Module | None = None) -> list[BlockUnits]:
        """Unit description of every block of ``module`` (default: this encoder's model)."""
        return find_blocks(self.module if module is None else module)

    @property
    def width(self) -> int:
        return self.adapter.width(self.module)

    @property
    def tokens(self) -> int:
        return self.adapter.tokens(self.module, self.seq_len)

    def input_specs(self) -> list[InputSpec]:
        return self.adapter.input_specs(self.module)

    def output_names(self) -> list[str]:
        return self.adapter.output_names(self.module, self.extras)

    def export_module(self, module: nn.Module | None = None) -> nn.Module:
        """The function the artifacts compute: positional inputs -> tuple of outputs."""
        return self.adapter.export_module(self.module if module is None else module, self.extras).eval()

    def sample_inputs(self, batch: int = 2, seed: int = 0, seq_len: int | None = None) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return self.adapter.sample_inputs(self.module, batch, seq_len or min(self.seq_len, 32), g)

    def embedding(self, outputs: tuple, feeds: dict[str, torch.Tensor]) -> torch.Tensor:
        """The output the ranking distils: the adapter's embedding output (e.g.
        ``sentence_embedding``, ``pooler_output``, ``image_embeds``), else the mask-weighted mean
        of ``last_hidden_state``."""
        names = self.output_names()
        name = self.adapter.embedding_output(self.module, self.extras)
        if name is not None:
            return outputs[names.index(name)]
        hidden = outputs[names.index("last_hidden_state")]
        mask = feeds.get("attention_mask")
        if mask is None:
            return hidden.mean(1)
        m = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)

    def fingerprint(self) -> str:
        """sha256 over architecture, config and every parameter and buffer (names and bytes)."""
        h = hashlib.sha256()
        h.update(self.architecture.encode())
        cfg = getattr(self.module, "config", None)
        if cfg is not None and hasattr(cfg, "to_dict"):
            d = {k: v for k, v in cfg.to_dict().items() if not k.startswith("_") and k != "transformers_version"}
            h.update(json.dumps(d, sort_keys=True, default=str).encode())
        for name, t in sorted(self.module.state_dict().items()):
            h.update(name.encode())
            h.update(str(tuple(t.shape)).encode())
            h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return "sha256:" + h.hexdigest()
