"""Ranking methods: a registry of functions that score every unit on one scale.

A method takes the encoder, its inventory and calibration batches and returns per-layer head and
neuron scores (higher = keep longer). Budget plans keep units in descending score order, so a
score must already weigh importance against cost.

Built in:

* ``initial`` (default for now): *removal damage per FLOP*. Removing unit u deletes its
  contribution ``c_u`` to the residual stream (a neuron: its activation times its fc2 column;
  a head: its context times its block of the output projection). The estimate is
  ``E[||c_u||²] / E[||h||²]`` over calibration tokens (h: the block's input hidden state, so
  layers compare on one scale), divided by the unit's FLOP cost.
* ``magnitude``: data-free weight norms (‖in-rows‖·‖out-columns‖ per unit), per FLOP.
* ``random``: seeded random scores, a floor for comparisons.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from elastic_export.adapters import HEADS, NEURONS, UnitGroup
from elastic_export.calibration import Calibration
from elastic_export.encoder import Encoder
from elastic_export.inventory import Inventory

Scores = tuple[list[np.ndarray], list[np.ndarray]]
ScoringFn = Callable[..., Scores]
METHODS: dict[str, ScoringFn] = {}
NEEDS_DATA: set[str] = set()


def register_method(name: str, needs_data: bool = True) -> Callable[[ScoringFn], ScoringFn]:
    def deco(fn: ScoringFn) -> ScoringFn:
        METHODS[name] = fn
        if needs_data:
            NEEDS_DATA.add(name)
        return fn

    return deco


def _token_weights(feeds: dict[str, torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """1 for real tokens, 0 for padding, shaped (B, N)."""
    mask = feeds.get("attention_mask")
    if mask is not None and mask.shape == shape:
        return mask.to(torch.float32)
    return torch.ones(shape, device=next(iter(feeds.values())).device)


def _contribution_energy(x: torch.Tensor, group: UnitGroup) -> torch.Tensor:
    """Per token and unit: ||c_u||² where c_u is unit u's share of the consumer's output. (B, N, U)."""
    W = group.consumer.linear.weight  # (D, U*w)
    B, N = x.shape[:2]
    if group.width == 1:
        return x.pow(2) * W.pow(2).sum(0)
    xs = x.reshape(B, N, group.count, group.width)
    Ws = W.reshape(W.shape[0], group.count, group.width)
    return torch.einsum("bnuw,duw->bnud", xs, Ws).pow(2).sum(-1)


@register_method("initial")
@torch.no_grad()
def removal_damage(encoder: Encoder, inventory: Inventory, calibration: Calibration, **_) -> Scores:
    blocks = encoder.blocks()
    n = len(blocks)
    energy = {(i, k): torch.zeros(blocks[i].group(k).count, dtype=torch.float64) for i in range(n) for k in (HEADS, NEURONS)}
    stream = torch.zeros(n, dtype=torch.float64)  # accumulated on the CPU
    state: dict = {}
    handles = []

    def block_hook(i):
        def hook(mod, args, kwargs):
            h = args[0] if args else next(iter(kwargs.values()))
            w = _token_weights(state["feeds"], h.shape[:2])
            stream[i] += (h.pow(2).sum(-1) * w).sum().double().cpu()

        return hook

    def unit_hook(i, kind, group):
        def hook(mod, args):
            x = args[0]
            w = _token_weights(state["feeds"], x.shape[:2])
            e = _contribution_energy(x, group)
            energy[(i, kind)] += (e * w[..., None]).sum((0, 1)).double().cpu()

        return hook

    for b in blocks:
        handles.append(b.block.register_forward_pre_hook(block_hook(b.index), with_kwargs=True))
        for kind in (HEADS, NEURONS):
            g = b.group(kind)
            handles.append(g.consumer.linear.register_forward_pre_hook(unit_hook(b.index, kind, g)))
    fn = encoder.export_module()
    device = next(encoder.module.parameters()).device
    try:
        for feeds in tqdm(calibration.batches, desc="scoring", unit="batch", leave=False):
            feeds = {k: v.to(device) for k, v in feeds.items()}
            state["feeds"] = feeds
            fn(*feeds.values())
    finally:
        for h in handles:
            h.remove()
    heads, neurons = [], []
    for i, L in enumerate(inventory.layers):
        scale = max(float(stream[i]), 1e-30)
        heads.append((energy[(i, HEADS)] / scale / L.head_cost).numpy())
        neurons.append((energy[(i, NEURONS)] / scale / L.neuron_cost).numpy())
    return _normalise(heads, neurons)


@register_method("magnitude", needs_data=False)
@torch.no_grad()
def weight_magnitude(encoder: Encoder, inventory: Inventory, calibration: Calibration | None = None, **_) -> Scores:
    heads, neurons = [], []
    for b, L in zip(encoder.blocks(), inventory.layers):
        for kind, dst in ((HEADS, heads), (NEURONS, neurons)):
            g = b.group(kind)
            U, w = g.count, g.width
            norm_in = torch.zeros(U, dtype=torch.float64)
            for role in g.producers:
                Wp = role.linear.weight.reshape(role.groups, U, w, -1)
                norm_in += Wp.double().pow(2).sum((0, 2, 3))
            Wc = g.consumer.linear.weight.reshape(-1, U, w)
            norm_out = Wc.double().pow(2).sum((0, 2))
            dst.append((norm_in.sqrt() * norm_out.sqrt() / L.cost(kind)).numpy())
    return _normalise(heads, neurons)


@register_method("random", needs_data=False)
def random_scores(encoder: Encoder, inventory: Inventory, calibration: Calibration | None = None, seed: int = 0, **_) -> Scores:
    rng = np.random.default_rng(seed)
    heads = [rng.random(L.heads).astype(np.float32) for L in inventory.layers]
    neurons = [rng.random(L.neurons).astype(np.float32) for L in inventory.layers]
    return heads, neurons


def _normalise(heads: list[np.ndarray], neurons: list[np.ndarray]) -> Scores:
    """Scale all scores jointly (in float64) so the largest is 1, then store as float32."""
    top = max([float(np.max(a)) for a in heads + neurons if a.size] + [1e-300])
    cast = lambda a: (np.asarray(a, dtype=np.float64) / top).astype(np.float32)  # noqa: E731
    return [cast(a) for a in heads], [cast(a) for a in neurons]
