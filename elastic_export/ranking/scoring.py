"""Ranking methods: a registry of functions that score every unit on one scale.

A method takes the encoder, its inventory and calibration batches and returns per-layer head and
neuron scores (higher = keep longer). Budget plans keep units in descending score order; every
method divides its importance by the unit's FLOP cost, so all methods share one FLOP scale and one
budget filler.

* ``initial``: *removal damage*. Removing unit u deletes its contribution ``c_u`` to the residual
  stream (a neuron: its activation times its fc2 column; a head: its context times its block of
  the output projection). The estimate of the loss increase is ``E[‖c_u‖²] / E[‖h‖²]`` over
  calibration tokens (h: the block's input hidden state, so layers compare on one scale). A
  first-order estimate of a distillation loss would be useless here: its gradient is zero at the
  dense model.
* ``activation`` (Minitron-style): mean activation magnitude (neuron: ``|a_u|``; head: ``‖o_h‖``).
* ``variance`` (VBP): variance of the unit's activation over calibration tokens.
* ``fisher`` (Kwon et al. 2022): ``E[(∂L/∂m_u)²]`` of a unit mask m_u = 1. With labelled
  calibration data and a classifier, L is the cross-entropy of each sample. With no labels the loss
  is a random projection ``r·f(x)`` of the pooled output (r ~ N(0, I) per sample), whose squared
  mask gradient is, in expectation, the squared norm of the output's Jacobian wrt the mask. These
  are the starting scores of the optimised ranking (``elastic``).
* ``magnitude``: data-free weight norms (‖in-rows‖·‖out-columns‖ per unit).
* ``random``: seeded random scores, a floor for comparisons.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from collections.abc import Set as AbstractSet
from typing import Any, Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from elastic_export.data.calibration import Calibration
from elastic_export.models.adapters import HEADS, NEURONS, UnitGroup
from elastic_export.models.encoder import Encoder
from elastic_export.models.inventory import Inventory
from elastic_export.ranking import distributed as ddp
from elastic_export.ranking import methods
from elastic_export.ranking.masks import capture_inputs, frozen_weights, unit_masks

Scores = tuple[list[np.ndarray], list[np.ndarray]]
ScoringFn = Callable[..., Scores]


class _Methods(Mapping[str, ScoringFn]):
    """``name -> scoring function``: a view of :data:`elastic_export.ranking.methods.REGISTRY`, importing on lookup."""

    def __getitem__(self, name: str) -> ScoringFn:
        if name not in methods.REGISTRY:
            raise KeyError(name)
        return methods.REGISTRY[name].load()

    def __contains__(self, name: object) -> bool:
        return name in methods.REGISTRY

    def __iter__(self) -> Iterator[str]:
        return iter(methods.names())

    def __len__(self) -> int:
        return len(methods.REGISTRY)


class _NeedsData(AbstractSet[str]):
    """The names of the methods that read calibration batches (a view of the registry)."""

    def __contains__(self, name: object) -> bool:
        return name in methods.REGISTRY and methods.REGISTRY[name].needs_data

    def __iter__(self) -> Iterator[str]:
        return iter([n for n in methods.names() if methods.REGISTRY[n].needs_data])

    def __len__(self) -> int:
        return sum(m.needs_data for m in methods.REGISTRY.values())


METHODS: Mapping[str, ScoringFn] = _Methods()
NEEDS_DATA: AbstractSet[str] = _NeedsData()


def register_method(name: str, needs_data: bool = True) -> Callable[[ScoringFn], ScoringFn]:
    """Decorator: add a ranking method under ``name`` (``--method name``) from code that is already
    imported (the built-in methods are listed by import path in :mod:`elastic_export.ranking.methods`)."""

    def deco(fn: ScoringFn) -> ScoringFn:
        methods.register(name, fn, needs_data=needs_data)
        return fn

    return deco


def token_weights(feeds: dict[str, torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """1 for real tokens, 0 for padding, shaped (B, N)."""
    mask = feeds.get("attention_mask")
    if mask is not None and mask.shape == shape:
        return mask.to(torch.float32)
    return torch.ones(shape, device=next(iter(feeds.values())).device)


def unit_view(x: torch.Tensor, group: UnitGroup) -> torch.Tensor:
    """Consumer input (B, N, U·w) -> (B, N, U, w)."""
    return x.reshape(*x.shape[:2], group.count, group.width)


def contribution_energy(x: torch.Tensor, group: UnitGroup) -> torch.Tensor:
    """Per token and unit: ‖c_u‖² where c_u is unit u's share of the consumer's output. (B, N, U)."""
    W = group.consumer.linear.weight.to(x.dtype)  # (D, U*w); fp32 statistics with bf16/fp16 weights
    if group.width == 1:
        return x.pow(2) * W.pow(2).sum(0)
    B, N = x.shape[:2]
    xs = unit_view(x, group).reshape(B * N, group.count, group.width).transpose(0, 1)  # (U, BN, w)
    Ws = W.reshape(W.shape[0], group.count, group.width).permute(1, 2, 0)  # (U, w, D)
    return torch.bmm(xs, Ws).pow(2).sum(-1).transpose(0, 1).reshape(B, N, group.count)


def _device(encoder: Encoder) -> torch.device:
    return next(encoder.module.parameters()).device


def _per_flop(inventory: Inventory, values: dict[tuple[int, str], torch.Tensor]) -> Scores:
    heads = [values[(i, HEADS)].double().cpu().numpy() / L.head_cost for i, L in enumerate(inventory.layers)]
    neurons = [values[(i, NEURONS)].double().cpu().numpy() / L.neuron_cost for i, L in enumerate(inventory.layers)]
    return normalise(heads, neurons)


def _token_statistics(encoder: Encoder, calibration: Calibration, stat: Callable, desc: str,
                      observe: Callable[[int, Any, dict], None] | None = None):
    """Run the calibration batches and sum ``stat(x, group, weights) -> (U,)`` per unit group;
    ``observe(batch_index, outputs, feeds)``, when given, sees every batch's (dense) outputs.

    Under torch.distributed each process runs its share of every batch and the sums are added up.
    Returns the sums, the per-block residual energy and the token count."""
    ddp.check_batches(calibration.batches)
    blocks = encoder.blocks()
    sums: dict = {(b.index, k): 0.0 for b in blocks for k in (HEADS, NEURONS)}
    stream = torch.zeros(len(blocks), dtype=torch.float64)
    state = {"tokens": 0.0}
    dev = _device(encoder)

    def sink(layer, kind, group, x):
        w = token_weights(state["feeds"], x.shape[:2])
        sums[(layer, kind)] += stat(x.detach().float(), group, w).double().cpu()

    handles = []
    for b in blocks:
        def pre(mod, args, kwargs, i=b.index):
            h = args[0] if args else next(iter(kwargs.values()))
            w = token_weights(state["feeds"], h.shape[:2])
            stream[i] += (h.detach().float().pow(2).sum(-1) * w).sum().double().cpu()

        handles.append(b.block.register_forward_pre_hook(pre, with_kwargs=True))
    fn = encoder.export_module()
    dtype = ddp.model_dtype(encoder.module)
    try:
        with torch.no_grad(), capture_inputs(blocks, sink):
            batches = tqdm(calibration.batches, desc=desc, unit="batch", leave=False, disable=not ddp.is_main())
            for bi, feeds in enumerate(batches):
                feeds = ddp.place(ddp.shard(feeds), dev, dtype)
                state["feeds"] = feeds
                state["tokens"] += float(token_weights(feeds, next(iter(feeds.values())).shape[:2]).sum())
                outputs = fn(*feeds.values())
                if observe is not None:
                    observe(bi, ddp.as_fp32(outputs), feeds)
    finally:
        for h in handles:
            h.remove()
    if ddp.active():  # add up every process's share, in rank order
        parts = ddp.gather_objects((sums, stream, state["tokens"]))
        sums = {k: sum(p[0][k] for p in parts) for k in sums}
        stream = sum(p[1] for p in parts)
        state["tokens"] = sum(p[2] for p in parts)
    return sums, stream, state["tokens"]


def removal_damage(encoder: Encoder, inventory: Inventory, calibration: Calibration,
                   observe: Callable[[int, Any, dict], None] | None = None, **_) -> Scores:
    """Each unit's output energy relative to its block's residual stream, per FLOP (one forward pass;
    ``observe`` as for :func:`fisher_information`)."""
    def stat(x, group, w):
        return (contribution_energy(x, group) * w[..., None]).sum((0, 1))

    sums, stream, _ = _token_statistics(encoder, calibration, stat, "scoring (initial)", observe)
    for (layer, kind), v in sums.items():
        v /= max(float(stream[layer]), 1e-30)
    return _per_flop(inventory, sums)


def activation_magnitude(encoder: Encoder, inventory: Inventory, calibration: Calibration,
                         observe: Callable[[int, Any, dict], None] | None = None, **_) -> Scores:
    def stat(x, group, w):
        return (unit_view(x, group).norm(dim=-1) * w[..., None]).sum((0, 1))

    sums, _, tokens = _token_statistics(encoder, calibration, stat, "scoring (activation)", observe)
    return _per_flop(inventory, {k: v / max(tokens, 1.0) for k, v in sums.items()})


def activation_variance(encoder: Encoder, inventory: Inventory, calibration: Calibration,
                        observe: Callable[[int, Any, dict], None] | None = None, **_) -> Scores:
    def moments(x, group, w):
        """Token-weighted sums of each feature and of its square, in one pass: (2, U, w)."""
        v, ww = unit_view(x, group), w[..., None, None]
        return torch.stack([(v * ww).sum((0, 1)), (v.pow(2) * ww).sum((0, 1))])

    sums, _, tokens = _token_statistics(encoder, calibration, moments, "scoring (variance)", observe)
    out = {}
    for key, s in sums.items():
        mean, sq = s[0] / tokens, s[1] / tokens
        out[key] = (sq - mean.pow(2)).clamp(min=0).sum(-1)  # summed over a head's features
    return _per_flop(inventory, out)


def _zero_vectors(encoder: Encoder):
    return {(b.index, k): torch.zeros(b.group(k).count, dtype=torch.float64) for b in encoder.blocks()
            for k in (HEADS, NEURONS)}


def fisher_information(encoder: Encoder, inventory: Inventory, calibration: Calibration, seed: int = 0,
                       observe: Callable[[int, Any, dict], None] | None = None, projections: int = 2,
                       compute: str = "fp32", **_) -> Scores:
    """Squared mask gradients, summed over the calibration data (an embedding model's: of
    ``projections`` random projections of each batch's embeddings, one backward pass each).

    ``observe(batch_index, outputs, feeds)``, when given, sees every batch's outputs (fp32, masks all
    1: the dense model's own outputs, bit for bit) before the backward passes; the elastic ranking
    takes its dense targets from there instead of a second forward pass.

    Under torch.distributed each process takes its share of every batch: per-sample squared
    gradients (labelled data) are summed over processes; the gradient of a batch's random
    projection is summed over processes *before* it is squared, as in one process. ``compute``:
    the forward passes' :func:`~elastic_export.ranking.distributed.compute` (``fp32`` or ``bf16``)."""
    ddp.check_batches(calibration.batches)
    blocks = encoder.blocks()
    dev = _device(encoder)
    masks = {(b.index, k): torch.ones(b.group(k).count, device=dev, requires_grad=True) for b in blocks
             for k in (HEADS, NEURONS)}
    fisher = _zero_vectors(encoder)
    g = torch.Generator().manual_seed(seed)
    fn = encoder.export_module()
    names = encoder.output_names()
    labels = calibration.labels if "logits" in names else None
    dtype = ddp.model_dtype(encoder.module)
    with frozen_weights(encoder.module), unit_masks(blocks, lambda layer, kind: masks[(layer, kind)]):
        batches = tqdm(calibration.batches, desc="scoring (fisher)", unit="batch", leave=False,
                       disable=not ddp.is_main())
        for bi, feeds in enumerate(batches):
            n, part = ddp.batch_size(feeds), ddp.share(ddp.batch_size(feeds))
            feeds = ddp.place(ddp.shard(feeds), dev, dtype)
            with ddp.compute(compute, dev):
                outputs = ddp.as_fp32(fn(*feeds.values()))
            if observe is not None:
                with torch.no_grad():
                    observe(bi, tuple(o.detach() if torch.is_tensor(o) else o for o in outputs), feeds)
            if labels is not None:  # squared gradient of each sample's cross-entropy
                ce = torch.nn.functional.cross_entropy(outputs[names.index("logits")], labels[bi][part].to(dev),
                                                       reduction="none")
                for j in range(ce.shape[0]):
                    grads = torch.autograd.grad(ce[j], list(masks.values()), retain_graph=True)
                    for key, grad in zip(masks, grads):
                        fisher[key] += grad.detach().double().cpu().pow(2)
                continue
            emb = encoder.embedding(outputs, feeds)
            for _ in range(projections):
                r = torch.randn((n, *emb.shape[1:]), generator=g)[part].to(dev)  # the global batch's draw
                grads = torch.autograd.grad((emb * r).sum(), list(masks.values()), retain_graph=True)
                if ddp.active():  # the whole batch's gradient, then its square
                    flat = ddp.all_reduce_(torch.cat([gr.detach().reshape(-1) for gr in grads]))
                    grads = flat.split([gr.numel() for gr in grads])
                for key, grad in zip(masks, grads):
                    fisher[key] += grad.detach().double().cpu().pow(2)
    if ddp.active() and labels is not None:  # per-sample squares: add up every process's sum
        for v in fisher.values():
            ddp.all_reduce_(v)
    return _per_flop(inventory, fisher)


@torch.no_grad()
def weight_magnitude(encoder: Encoder, inventory: Inventory, calibration: Calibration | None = None, **_) -> Scores:
    values = {}
    for b in encoder.blocks():
        for kind in (HEADS, NEURONS):
            g = b.group(kind)
            U, w = g.count, g.width
            norm_in = torch.zeros(U, dtype=torch.float64)
            for role in g.producers:
                norm_in += role.linear.weight.reshape(role.groups, U, w, -1).double().pow(2).sum((0, 2, 3)).cpu()
            norm_out = g.consumer.linear.weight.reshape(-1, U, w).double().pow(2).sum((0, 2)).cpu()
            values[(b.index, kind)] = norm_in.sqrt() * norm_out.sqrt()
    return _per_flop(inventory, values)


def random_scores(encoder: Encoder, inventory: Inventory, calibration: Calibration | None = None, seed: int = 0, **_) -> Scores:
    rng = np.random.default_rng(seed)
    heads = [rng.random(L.heads).astype(np.float32) for L in inventory.layers]
    neurons = [rng.random(L.neurons).astype(np.float32) for L in inventory.layers]
    return heads, neurons


def normalise(heads: list[np.ndarray], neurons: list[np.ndarray]) -> Scores:
    """Scale all scores jointly (in float64) so the largest is 1, then store as float32."""
    top = max([float(np.max(a)) for a in heads + neurons if a.size] + [1e-300])
    cast = lambda a: (np.asarray(a, dtype=np.float64) / top).astype(np.float32)  # noqa: E731
    return [cast(a) for a in heads], [cast(a) for a in neurons]
