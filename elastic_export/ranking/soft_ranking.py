"""The paper's optimised ranking (``--method elastic``): soft pruning over many budgets at once.

Every unit u has a score s_u (initialised from the ``fisher`` scores by default, in log space,
standardised). For each sparsity target b, the cutoff t_b is where the score-ordered ranking,
accumulating unit FLOP costs, fills the budget ``(1 - b)·P``. Soft masks
``m_u = sigmoid((s_u - t_b) / T)`` multiply each unit's output; the loss is the distillation loss
to the frozen dense model (1 - cosine of the pooled embedding plus a similarity-structure term; KL
to the dense logits for classifiers; cross-entropy when labelled calibration data is given),
averaged over the targets, and only the scores move (Adam). Many cutoffs give every region of the ranking a gradient. Each step
evaluates a rotating subset of the targets in one batched forward pass (the targets are slices of
the batch), so all targets are visited equally often.

Checkpoints (safetensors: scores and optimiser state, step in the metadata) are written every few
steps; ``resume=True`` continues a killed run and ends with the identical ranking.

Under torch.distributed (``torchrun``, see :mod:`elastic_export.ranking.distributed`) each process takes its
share of every global batch; each loss term is weighted by the process's share of the batch (of its
samples, or of its real tokens for the token term) and the score gradients are summed over the
processes, so every process applies the single-process update. The similarity-structure term
compares each embedding with a fixed dense index of all calibration samples, so it is per-sample;
the index itself is gathered from every process once. Only rank 0 writes checkpoints.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from elastic_export.core.errors import UserError, first_line
from elastic_export.core.fileio import atomic_write
from elastic_export.data.calibration import Calibration
from elastic_export.models.adapters import HEADS, NEURONS
from elastic_export.models.encoder import Encoder
from elastic_export.models.inventory import Inventory
from elastic_export.ranking import distributed as ddp
from elastic_export.ranking.masks import frozen_weights, unit_masks
from elastic_export.ranking.options import DEFAULT_TARGETS, ElasticConfig  # noqa: F401 (re-exported)
from elastic_export.ranking.scoring import METHODS, Scores


@dataclass
class _Units:
    """All units of the model as one flat vector (per layer: heads, then neurons)."""

    slices: dict[tuple[int, str], slice] = field(default_factory=dict)
    cost: torch.Tensor | None = None

    @classmethod
    def of(cls, inventory: Inventory) -> "_Units":
        u, pos, costs = cls(), 0, []
        for i, L in enumerate(inventory.layers):
            for kind in (HEADS, NEURONS):
                n = L.count(kind)
                u.slices[(i, kind)] = slice(pos, pos + n)
                costs.append(torch.full((n,), float(L.cost(kind)), dtype=torch.float64))
                pos += n
        u.cost = torch.cat(costs)
        return u

    def flatten(self, heads: list[np.ndarray], neurons: list[np.ndarray]) -> torch.Tensor:
        parts = []
        for i in range(len(heads)):
            parts += [torch.as_tensor(heads[i], dtype=torch.float64), torch.as_tensor(neurons[i], dtype=torch.float64)]
        return torch.cat(parts)

    def split(self, flat: torch.Tensor) -> Scores:
        n = len(self.slices) // 2
        heads = [flat[self.slices[(i, HEADS)]].detach().cpu().numpy().astype(np.float32) for i in range(n)]
        neurons = [flat[self.slices[(i, NEURONS)]].detach().cpu().numpy().astype(np.float32) for i in range(n)]
        return heads, neurons


def cutoffs(scores: torch.Tensor, cost: torch.Tensor, targets: list[float]) -> torch.Tensor:
    """For each target b, the score t_b where the score-ordered ranking fills ``(1 - b)·P``.

    Units with score above t_b are exactly the prefix that the budget filler keeps."""
    s = scores.detach().double().cpu()
    order = torch.argsort(-s, stable=True)
    ss = s[order]
    cum = torch.cumsum(cost[order], 0)
    total = float(cum[-1])
    out = []
    for b in targets:
        k = int(torch.searchsorted(cum, torch.tensor((1.0 - b) * total * (1 + 1e-12), dtype=torch.float64), right=True))
        if k <= 0:
            out.append(float(ss[0]) + 1.0)
        elif k >= len(ss):
            out.append(float(ss[-1]) - 1.0)
        else:
            out.append(0.5 * float(ss[k - 1] + ss[k]))
    return torch.tensor(out, dtype=scores.dtype, device=scores.device)


def _save_checkpoint(path: Path, state: dict[str, torch.Tensor], meta: dict) -> None:
    from safetensors.torch import save_file

    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata={
        "elastic_export.checkpoint": json.dumps(meta, sort_keys=True)}))


def _load_checkpoint(path: Path, meta: dict) -> tuple[dict[str, torch.Tensor], int] | None:
    from safetensors import safe_open

    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            saved = json.loads((f.metadata() or {})["elastic_export.checkpoint"])
            state = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:
        raise UserError(f"--resume: checkpoint {path} is unreadable ({first_line(e)})")
    step = saved.pop("step", None)
    if saved != meta or not isinstance(step, int):
        raise UserError(f"--resume: checkpoint {path} belongs to another run (model, data or hyperparameters differ)")
    return state, step


def checkpoint_step(path: Path) -> int | None:
    """The step the checkpoint ``path`` was written at (None: no readable checkpoint there)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            step = json.loads((f.metadata() or {})["elastic_export.checkpoint"]).get("step")
    except Exception:  # noqa: BLE001 - absent or damaged: no step to report
        return None
    return step if isinstance(step, int) else None


def resume_hint(checkpoint: Path | None, config: ElasticConfig) -> str | None:
    """How to go on after an interrupted ranking (the CLI's ``interrupted; ...`` line); None: no checkpointing."""
    if checkpoint is None or not config.checkpoint_every:
        return None
    step = checkpoint_step(checkpoint)
    if step is None:
        return f"no ranking checkpoint written yet (one every {config.checkpoint_every} steps); a re-run starts over"
    return (f"the ranking checkpoint {checkpoint} holds step {step} of {config.steps}: "
            "run the same command again with --resume to continue from it")


def _announce(checkpoint: Path | None, resume: bool, start: int, steps: int, echo: Callable[[str], None]) -> None:
    """Say whether the ranking resumes (from which step), or starts from scratch and why."""
    if checkpoint is None:
        return
    if resume:
        echo(f"--resume: continuing the ranking from step {start} of {steps} (checkpoint {checkpoint})" if start
             else f"--resume: no checkpoint at {checkpoint}; ranking from scratch")
    elif checkpoint.is_file():
        step = checkpoint_step(checkpoint)
        at = f" (step {step} of {steps})" if step is not None else ""
        echo(f"found the checkpoint {checkpoint} of an interrupted ranking{at}; starting over "
             "(--resume would continue from it)")


def _check_loss(encoder: Encoder, config: ElasticConfig, calibration: Calibration | None = None) -> list[str]:
    """Refuse a loss the model or the data cannot use; returns the model's output names."""
    names = encoder.output_names()
    if config.loss not in ("auto", "cosine", "kl", "ce"):
        raise UserError(f"--loss {config.loss}: choose auto, cosine, kl or ce")
    if config.loss in ("kl", "ce") and "logits" not in names:
        raise UserError(f"--loss {config.loss} needs a classifier (a logits output); this model has none")
    if config.loss == "ce" and calibration is not None and calibration.labels is None:
        why = calibration.description.get("labels", "none")
        raise UserError(f"--loss ce needs labelled calibration images (class sub-folders); labels: {why}")
    return names


def loss_kind(names: list[str], config: ElasticConfig, calibration: Calibration) -> str:
    """The loss ``auto`` resolves to: ``ce``, ``kl`` or ``cosine``."""
    if config.loss != "auto":
        return config.loss
    if "logits" in names:
        return "ce" if calibration.labels is not None else "kl"
    return "cosine"


def _shares(batches: list[dict], config: ElasticConfig) -> tuple[list[slice], list[float], list[float]]:
    """This process's rows of every batch, its share of each batch's samples and of its real tokens
    (the token term's weight; the sample share when the token term is off or no mask exists)."""
    sizes = [ddp.batch_size(b) for b in batches]
    parts = [ddp.share(n) for n in sizes]
    fracs = [(p.stop - p.start) / n for p, n in zip(parts, sizes)]
    tok_fracs = fracs
    if ddp.active() and config.token_weight and "attention_mask" in batches[0]:
        local = torch.tensor([float(b["attention_mask"][p].sum()) for b, p in zip(batches, parts)], dtype=torch.float64)
        total = ddp.all_reduce_(local.clone())
        tok_fracs = [float(a / t) if t > 0 else f for a, t, f in zip(local, total, fracs)]
    return parts, fracs, tok_fracs


class _Distiller:
    """The distillation loss of a masked forward pass against the frozen dense model's outputs:
    1 - cosine of the pooled embedding (or KL / cross-entropy on logits), plus the similarity
    structure against the dense index of all calibration samples, plus the per-token term."""

    def __init__(self, encoder: Encoder, names: list[str], config: ElasticConfig, kind: str) -> None:
        self.encoder, self.names, self.config = encoder, names, config
        self.use_kl = kind in ("kl", "ce")  # both work on the logits
        self.hidden_at = names.index("last_hidden_state") if "last_hidden_state" in names else None
        self.bank: torch.Tensor | None = None

    def targets(self, outputs, feeds) -> dict[str, torch.Tensor]:
        t = {"emb": F.normalize(self.encoder.embedding(outputs, feeds), dim=-1)}
        if self.use_kl:
            t["logp"] = F.log_softmax(outputs[self.names.index("logits")], dim=-1)
        if self.config.token_weight and self.hidden_at is not None:
            t["tokens"] = F.normalize(outputs[self.hidden_at], dim=-1)
        return t

    @torch.no_grad()
    def dense_targets(self, fn, batches: list[dict], dev, dtype,
                      known: dict[int, dict[str, torch.Tensor]] | None = None) -> list[dict[str, torch.Tensor]]:
        """The frozen dense model's targets per batch (``known``'s where it has them: no forward
        pass for those); sets the dense index (``bank``)."""
        dense = []
        for i, b in enumerate(batches):
            if known is not None and i in known:
                dense.append(known[i])
                continue
            feeds = ddp.place(ddp.shard(b), dev, dtype)
            with ddp.compute(self.config.compute, dev):
                outputs = ddp.as_fp32(fn(*feeds.values()))
            dense.append(self.targets(outputs, feeds))
        self.bank = torch.cat([d["emb"] for d in dense])
        if ddp.active():  # every process's share of every batch, in the global order
            shares = ddp.gather_objects([d["emb"].cpu() for d in dense])
            self.bank = torch.cat([r[i] for i in range(len(batches)) for r in shares]).to(dev)
        if self.config.relational_weight and not self.use_kl:
            for d in dense:
                d["rel"] = F.log_softmax(d["emb"] @ self.bank.T / self.config.relational_temperature, dim=-1)
        return dense

    def loss(self, outputs, feeds, dense_t, reps, target=None, frac=1.0, tok_frac=1.0) -> torch.Tensor:
        """The loss of this process's share, weighted by its share (1.0: the whole batch)."""
        config = self.config
        got = self.targets(ddp.as_fp32(outputs), feeds)
        if target is not None:
            loss = F.nll_loss(got["logp"], target.to(got["logp"].device).repeat(reps))
        elif self.use_kl:
            ref = dense_t["logp"].repeat(reps, 1)
            loss = (ref.exp() * (ref - got["logp"])).sum(-1).mean()
        else:
            loss = (1.0 - (got["emb"] * dense_t["emb"].repeat(reps, 1)).sum(-1)).mean()
        if frac != 1.0:
            loss = loss * frac
        if "rel" in dense_t:
            logq = F.log_softmax(got["emb"] @ self.bank.T / config.relational_temperature, dim=-1)
            ref = dense_t["rel"].repeat(reps, 1)
            rel = (ref.exp() * (ref - logq)).sum(-1).mean()
            loss = loss + config.relational_weight * (rel * frac if frac != 1.0 else rel)
        if "tokens" in got:
            cos = (got["tokens"] * dense_t["tokens"].repeat(reps, 1, 1)).sum(-1)
            w = feeds.get("attention_mask")
            w = torch.ones_like(cos) if w is None else w.to(cos.dtype)
            tok = ((1.0 - cos) * w).sum() / w.sum().clamp(min=1.0)
            loss = loss + config.token_weight * (tok * tok_frac if tok_frac != 1.0 else tok)
        return loss


@dataclass
class _Adam:
    """Adam on the score vector (the optimiser state a checkpoint holds with the scores)."""

    s: torch.Tensor
    m1: torch.Tensor
    m2: torch.Tensor
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8

    @torch.no_grad()
    def update(self, grad: torch.Tensor, k: int, lr: float) -> None:
        self.m1.mul_(self.b1).add_(grad, alpha=1 - self.b1)
        self.m2.mul_(self.b2).addcmul_(grad, grad, value=1 - self.b2)
        self.s = self.s - lr * (self.m1 / (1 - self.b1**k)) / ((self.m2 / (1 - self.b2**k)).sqrt() + self.eps)

    def state(self) -> dict[str, torch.Tensor]:
        return {"scores": self.s, "m1": self.m1, "m2": self.m2}


def _start(encoder: Encoder, units: _Units, initial: Scores, config: ElasticConfig, calibration: Calibration,
           checkpoint: Path | None, resume: bool,
           echo: Callable[[str], None] = lambda msg: None) -> tuple[_Adam, int, dict]:
    """The optimiser at its first step (standardised log initial scores, or a checkpoint's state with
    ``resume``), that step, and the run's identity a checkpoint must match; says which (``echo``)."""
    dev = next(encoder.module.parameters()).device
    init = units.flatten(*initial).clamp(min=1e-30).log()
    init = (init - init.mean()) / init.std().clamp(min=1e-12)
    s = init.float().to(dev)
    adam, start = _Adam(s, torch.zeros_like(s), torch.zeros_like(s)), 0
    meta = {"config": asdict(config), "fingerprint": encoder.fingerprint(), "calibration": calibration.description,
            "units": int(s.numel())}
    meta = json.loads(json.dumps(meta, default=list))
    if resume and checkpoint is not None:
        loaded = _load_checkpoint(checkpoint, meta)
        if loaded is not None:
            state, start = loaded
            adam = _Adam(state["scores"].to(dev), state["m1"].to(dev), state["m2"].to(dev))
    _announce(checkpoint, resume, start, config.steps, echo)
    return adam, start, meta


def _batch_of_step(step: int, n_batches: int, seed: int) -> int:
    """The calibration batch of a step: a fresh permutation of the batches every epoch."""
    epoch, pos = divmod(step, n_batches)
    perm = torch.randperm(n_batches, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
    return int(perm[pos])


def optimise_ranking(
    encoder: Encoder,
    inventory: Inventory,
    calibration: Calibration,
    initial: Scores,
    config: ElasticConfig,
    checkpoint: Path | None = None,
    resume: bool = False,
    echo: Callable[[str], None] = lambda msg: None,
    dense_known: dict[int, dict[str, torch.Tensor]] | None = None,
) -> tuple[Scores, list[float]]:
    """Run the soft-mask optimisation; returns the final scores and the loss per step.

    Args:
        encoder: the model (frozen; fp32, bf16 or fp16 weights: outputs are cast to fp32 for the loss).
        inventory: its units and costs.
        calibration: the global calibration batches (each process takes its share under torch.distributed).
        initial: the starting scores.
        config: hyperparameters.
        checkpoint: where rank 0 writes a checkpoint every ``config.checkpoint_every`` steps.
        resume: continue from ``checkpoint`` when it exists.
        echo: where to say whether it resumed, or starts over despite a checkpoint.
        dense_known: the dense targets (:meth:`_Distiller.targets`) of calibration batches already
            run, by batch index (the fisher scores' forward passes): no second pass for those.
    """
    names = _check_loss(encoder, config, calibration)
    ddp.check_batches(calibration.batches)
    kind = loss_kind(names, config, calibration)
    units = _Units.of(inventory)
    adam, start, meta = _start(encoder, units, initial, config, calibration, checkpoint, resume, echo)
    targets, batches = list(config.targets), calibration.batches
    per_step = min(config.targets_per_step, len(targets))
    parts, fracs, tok_fracs = _shares(batches, config)
    dev, dtype = adam.s.device, ddp.model_dtype(encoder.module)
    fn = encoder.export_module()
    labels = calibration.labels if kind == "ce" else None
    distiller = _Distiller(encoder, names, config, kind)
    dense = distiller.dense_targets(fn, batches, dev, dtype, dense_known)
    blocks, state = encoder.blocks(), {}

    def mask_for(layer, kind):
        return state["masks"][:, units.slices[(layer, kind)]]

    losses: list[float] = []
    with frozen_weights(encoder.module):
        bar = tqdm(range(start, config.steps), desc="ranking (elastic)", unit="step", initial=start,
                   total=config.steps, leave=False, disable=not ddp.is_main())
        for step in bar:
            bi = _batch_of_step(step, len(batches), config.seed)
            feeds = ddp.place(ddp.shard(batches[bi]), dev, dtype)
            chosen = [targets[(step * per_step + j) % len(targets)] for j in range(per_step)]
            scores = adam.s.clone().requires_grad_(True)
            t = cutoffs(scores, units.cost, chosen)
            state["masks"] = torch.sigmoid((scores[None, :] - t[:, None]) / config.temperature)
            rep = {k: torch.cat([v] * per_step) for k, v in feeds.items()}
            with unit_masks(blocks, mask_for, groups=per_step):
                with ddp.compute(config.compute, dev):
                    outputs = fn(*rep.values())
                loss = distiller.loss(outputs, rep, dense[bi], per_step,
                                      None if labels is None else labels[bi][parts[bi]], fracs[bi], tok_fracs[bi])
                (grad,) = torch.autograd.grad(loss, scores)  # inside: checkpointed blocks recompute with masks
            loss = loss.detach()
            if ddp.active():  # the global batch's gradient and loss: sum of the weighted shares
                both = ddp.all_reduce_(torch.cat([grad.reshape(-1), loss.reshape(1).to(grad.dtype)]))
                grad, loss = both[:-1], both[-1]
            k = step + 1
            adam.update(grad, k, config.lr)
            losses.append(float(loss.detach()))
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
            if (checkpoint is not None and config.checkpoint_every and k % config.checkpoint_every == 0
                    and k < config.steps and ddp.is_main()):
                _save_checkpoint(checkpoint, adam.state(), dict(meta, step=k))
    return units.split(_finish(adam.s, checkpoint)), losses


def _finish(s: torch.Tensor, checkpoint: Path | None) -> torch.Tensor:
    """Rank 0's scores on every process; the checkpoint of the finished run removed."""
    s = ddp.broadcast_(s)  # every process holds rank 0's scores (they agree already)
    ddp.barrier()  # nobody is still reading a checkpoint
    if checkpoint is not None and checkpoint.exists() and ddp.is_main():
        checkpoint.unlink()
    return s


def elastic_ranking(encoder: Encoder, inventory: Inventory, calibration: Calibration, seed: int = 0,
                    config: ElasticConfig | None = None, checkpoint: Path | None = None, resume: bool = False,
                    echo: Callable[[str], None] = lambda msg: None, **_) -> Scores:
    config = config or ElasticConfig(seed=seed)
    if config.init not in METHODS or config.init == "elastic":
        raise UserError(f"elastic: unknown initial scores {config.init!r}")
    names = _check_loss(encoder, config, calibration)  # before the initial scores, not after them
    distiller = _Distiller(encoder, names, config, loss_kind(names, config, calibration))
    seen: dict[int, dict[str, torch.Tensor]] = {}

    def observe(i: int, outputs: tuple, feeds: dict) -> None:
        seen[i] = distiller.targets(outputs, feeds)

    # a starting method's forward passes over the calibration data are the dense model's (fisher: every
    # mask 1; initial, activation, variance: no mask): their targets spare the optimisation its own pass
    initial = METHODS[config.init](encoder, inventory, calibration, seed=config.seed, observe=observe,
                                   projections=config.fisher_projections, compute=config.compute)
    scores, _ = optimise_ranking(encoder, inventory, calibration, initial, config, checkpoint, resume, echo,
                                 dense_known=seen)
    return scores
