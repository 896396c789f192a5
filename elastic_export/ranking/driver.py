"""The ranking driver: calibration data, the device, one ranking method run (or a ``--ranking`` file
reused and checked), its metadata; what the main job and ``elastic-export rank`` call.

``opts`` is the main job's :class:`elastic_export.pipeline.Options` (or any object with its ranking
fields: ``method``, ``device``, ``calib``, ``calib_size``, ``batch_size``, ``seed``, ``elastic``,
``checkpoint``, ``resume``, ``ranking``, ``budgets``, ``out``).
"""

from __future__ import annotations

import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable

import torch

from elastic_export.core.errors import Interrupted, UserError
from elastic_export.data.calibration import Calibration, load_calibration
from elastic_export.models.encoder import Encoder
from elastic_export.models.inventory import Inventory
from elastic_export.ranking import distributed as ddp
from elastic_export.ranking.file import Ranking, load_ranking, make_meta
from elastic_export.ranking.options import cover_budgets, targets_spec
from elastic_export.ranking.scoring import METHODS, NEEDS_DATA
from elastic_export.ranking.soft_ranking import ElasticConfig, resume_hint


def load_calib(encoder: Encoder, opts: Any) -> Calibration:
    """The calibration data of ``opts`` (the ranking's and the int8-qdq calibrator's: the same call)."""
    return load_calibration(encoder, opts.calib, size=opts.calib_size, batch_size=opts.batch_size, seed=opts.seed)


def check_device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UserError(f"--device {device}: not a device (use cpu or cuda)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {device}: CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise UserError(f"--device {device}: only cpu and cuda are supported")
    return dev


def rank_encoder(encoder: Encoder, inventory: Inventory, opts: Any, echo: Callable[[str], None],
                 calib: Calibration | None = None) -> Ranking:
    """Score every unit with ``opts.method`` (on ``calib`` when given and the method needs data) and
    wrap the scores with their metadata."""
    if opts.method not in METHODS:
        raise UserError(f"--method {opts.method}: unknown; choose from {', '.join(sorted(METHODS))}")
    desc = {"source": None}
    if opts.method not in NEEDS_DATA:
        calib = None
    else:
        calib = calib if calib is not None else load_calib(encoder, opts)
        desc = calib.description
        skipped = desc.get("failed_to_decode") or 0
        echo(f"calibration: {desc.get('samples')} samples from {desc.get('source')}"
             + (f" ({skipped} images failed to decode and were skipped)" if skipped else ""))
    dev = check_device(opts.device)
    t0 = time.time()
    encoder.module.to(dev)
    checkpoint = Path(opts.checkpoint) if opts.checkpoint else None
    compute = ddp.resolve_compute(opts.elastic.compute, dev)  # recorded as it ran, not "auto"
    config = ElasticConfig(**{**asdict(opts.elastic), "seed": opts.seed, "compute": compute})
    extra = {"echo": echo} if opts.method == "elastic" else {}
    try:
        heads, neurons = METHODS[opts.method](encoder, inventory, calib, seed=opts.seed, config=config,
                                              checkpoint=checkpoint, resume=opts.resume, compute=compute,
                                              **extra)
    except KeyboardInterrupt as e:
        hint = resume_hint(checkpoint, config) if opts.method == "elastic" and not isinstance(e, Interrupted) else None
        if hint is None:
            raise
        raise Interrupted(hint) from None
    finally:
        encoder.module.to("cpu")
    hyper: dict = {"seed": opts.seed}
    if opts.method == "fisher":
        hyper["compute"] = compute
    if opts.method in NEEDS_DATA:
        hyper.update(calib_size=opts.calib_size, batch_size=opts.batch_size)
    if opts.method == "elastic":
        hyper.update({k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(config).items()
                      if k not in ("checkpoint_every", "keep_schedule")})
    meta = make_meta(inventory, encoder.fingerprint(), opts.method, hyper, desc)
    echo(f"ranked {sum(L.heads + L.neurons for L in inventory.layers)} units with {opts.method!r} "
         f"in {time.time() - t0:.1f}s")
    return Ranking(heads, neurons, meta)


def rank_or_reuse(encoder: Encoder, inventory: Inventory, opts: Any, calib: Calibration | None,
          echo: Callable[[str], None]) -> tuple[Ranking, float | None]:
    """The ranking (``--ranking``'s, checked against the model, or a new one) and the seconds taken
    to rank (None: reused)."""
    if opts.ranking:
        ranking = load_ranking(opts.ranking)
        ranking.check_matches(inventory, encoder.fingerprint(), f"--ranking {opts.ranking}")
        echo(f"reusing ranking {opts.ranking} (method {ranking.meta.get('method')!r})")
        warn_uncovered(ranking, opts, echo)
        return ranking, None
    out = Path(opts.out)
    checkpoint = opts.checkpoint or str(out.parent / f".{out.name}.ranking-checkpoint.safetensors")
    opts = replace(opts, checkpoint=checkpoint)  # a copy: the caller's Options stay as they were
    asked, plain = opts.elastic.targets, opts.elastic
    if opts.method == "elastic":
        covered = cover_budgets(asked, opts.budgets)
        opts = replace(opts, elastic=replace(plain, targets=covered).deepened(covered != asked))
    if opts.elastic.targets != asked:
        echo(f"targets: the elastic targets stop at {max(asked):g} but --budgets go to {max(opts.budgets):g}; "
             f"optimising {targets_spec(opts.elastic.targets)} ({len(opts.elastic.targets)} targets) instead "
             "(recorded in the ranking file)")
    if opts.elastic.steps != plain.steps:
        e = opts.elastic
        echo(f"ranking: budgets past {max(asked):g} rank with {e.steps} steps of {e.targets_per_step} targets at lr "
             f"{e.lr:g} (the default {plain.steps} x {plain.targets_per_step} holds up to {max(asked):g}; give "
             "--steps, --targets-per-step or --lr to choose)")
    t_rank = time.time()
    ranking = rank_encoder(encoder, inventory, opts, echo, calib)
    if opts.elastic.targets != asked:
        ranking.meta["hyperparameters"]["targets_extended_from"] = list(asked)
    return ranking, round(time.time() - t_rank, 1)


def warn_uncovered(ranking: Ranking, opts: Any, echo: Callable[[str], None]) -> None:
    """Warn (one line) when a reused elastic ranking's targets stop below the largest budget."""
    targets = (ranking.meta.get("hyperparameters") or {}).get("targets")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, (int, float)) for t in targets):
        return
    top = max(opts.budgets)
    if max(targets) >= top - 1e-9:
        return
    echo(f"warning: --ranking {opts.ranking}: its targets stop at {max(targets):g} but --budgets go to {top:g}, "
         f"so the budgets past {max(targets):g} are ranked less well; re-rank with --targets "
         f"{targets_spec(cover_budgets(targets, opts.budgets))} (or drop --ranking)")
