"""Unit masks applied inside a torch model by forward pre-hooks on each group's consumer layer.

One mechanism serves every stage that needs it: hard 0/1 masks (the reference), soft masks with
gradients (the optimised ranking, Fisher scores) and masks that differ per sample group (several
budgets evaluated in one batched forward pass).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from elastic_export.models.adapters import HEADS, NEURONS, BlockUnits, UnitGroup

MaskFn = Callable[[int, str], torch.Tensor | None]


def expand(mask: torch.Tensor, group: UnitGroup) -> torch.Tensor:
    """Per-unit mask (..., U) -> per-feature mask (..., U·width)."""
    return mask.repeat_interleave(group.width, dim=-1) if group.width > 1 else mask


@contextlib.contextmanager
def frozen_weights(module: torch.nn.Module) -> Iterator[None]:
    """No parameter of ``module`` requires a gradient inside the context (restored after, also on
    error), so gradients flow only to masks or scores."""
    params = list(module.parameters())
    saved = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, req in zip(params, saved):
            p.requires_grad_(req)


@contextlib.contextmanager
def _consumer_pre_hooks(blocks: list[BlockUnits], make_hook) -> Iterator[None]:
    """Register ``make_hook(layer, kind, group)`` as a forward pre-hook on every consumer layer."""
    handles = []
    for b in blocks:
        for kind in (HEADS, NEURONS):
            g = b.group(kind)
            handles.append(g.consumer.linear.register_forward_pre_hook(make_hook(b.index, kind, g)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def unit_masks(blocks: list[BlockUnits], mask_for: MaskFn, groups: int = 1):
    """Multiply each unit's output by a mask inside the context.

    Args:
        blocks: the model's blocks.
        mask_for: ``(layer, kind) -> tensor`` of shape (U,) or, with ``groups`` > 1, (groups, U);
            None leaves that group unmasked. Called at every forward, so masks may change between
            calls (e.g. when they are parameters being optimised).
        groups: the batch is ``groups`` equal slices, slice g uses mask row g.
    """

    def make_hook(layer: int, kind: str, group: UnitGroup):
        def hook(mod, args):
            m = mask_for(layer, kind)
            if m is None:
                return None
            x = args[0]
            m = expand(m, group).to(x.dtype)
            if groups == 1:
                return (x * m,) + tuple(args[1:])
            shape = x.shape
            y = x.reshape(groups, shape[0] // groups, *shape[1:]) * m.reshape(groups, *([1] * (x.dim() - 1)), -1)
            return (y.reshape(shape),) + tuple(args[1:])

        return hook

    return _consumer_pre_hooks(blocks, make_hook)


def capture_inputs(blocks: list[BlockUnits], sink: Callable[[int, str, UnitGroup, torch.Tensor], None]):
    """Call ``sink(layer, kind, group, x)`` with every consumer layer's input (the units' outputs)."""

    def make_hook(layer: int, kind: str, group: UnitGroup):
        def hook(mod, args):
            sink(layer, kind, group, args[0])

        return hook

    return _consumer_pre_hooks(blocks, make_hook)
