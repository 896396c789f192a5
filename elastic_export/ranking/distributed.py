"""Distributed and large-model ranking: torch.distributed helpers, frozen low-precision weights and
activation checkpointing.

Under ``torchrun --nproc-per-node N -m elastic_export rank ...`` every process loads the same model
and the same calibration batches, and takes a contiguous share of the samples of every *global*
batch (:func:`shard`), so the union over processes is exactly the single-process batch. Gradients
of the scores (and Fisher sums, activation statistics, the dense index) are summed over processes,
each process weighting its loss by its share of the global batch, so the result equals the
single-process ranking with the same global batch within float tolerance. Only rank 0 writes files
and shows progress. Without ``WORLD_SIZE`` > 1 nothing here changes anything.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Iterator

import torch
import torch.distributed as dist

from elastic_export.core.errors import UserError

WEIGHT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
COMPUTE = ("auto", "fp32", "bf16")  # the ranking's forward passes (see compute())


def active() -> bool:
    """True inside an initialised process group of more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) without a process group."""
    return (dist.get_rank(), dist.get_world_size()) if active() else (0, 1)


def is_main() -> bool:
    """Whether this process writes files and prints progress (rank 0, or no process group)."""
    return world()[0] == 0


@contextlib.contextmanager
def session(device: str) -> Iterator[str]:
    """Join the torchrun process group for the duration of the context (when ``WORLD_SIZE`` > 1).

    Args:
        device: the requested device (``cpu`` or ``cuda``); under torchrun with CUDA each process
            takes ``cuda:LOCAL_RANK`` and the NCCL backend, on CPU the gloo backend.

    Yields:
        The device this process ranks on.
    """
    size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if size <= 1 or (dist.is_available() and dist.is_initialized()):
        yield device
        return
    if not dist.is_available():
        raise UserError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
    cuda = device.startswith("cuda")
    if cuda:
        if not torch.cuda.is_available():
            raise UserError(f"--device {device}: CUDA is not available on this machine")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        yield device
        dist.barrier()
    finally:
        dist.destroy_process_group()


def barrier() -> None:
    """Wait for every process (no-op without a process group)."""
    if active():
        dist.barrier()


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def all_reduce_(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over all processes, in place (no-op without a process group); returns ``t``."""
    if not active():
        return t
    dev = _comm_device()
    if t.device == dev:
        dist.all_reduce(t)
    else:
        buf = t.to(dev)
        dist.all_reduce(buf)
        t.copy_(buf)
    return t


def broadcast_(t: torch.Tensor) -> torch.Tensor:
    """Overwrite ``t`` with rank 0's copy, in place (no-op without a process group); returns ``t``."""
    if not active():
        return t
    dev = _comm_device()
    buf = t if t.device == dev else t.to(dev)
    dist.broadcast(buf, 0)
    if buf is not t:
        t.copy_(buf)
    return t


def gather_objects(obj: Any) -> list[Any]:
    """Every process's ``obj``, in rank order (``[obj]`` without a process group). Tensors inside
    should be on the CPU."""
    if not active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def batch_size(batch: dict[str, torch.Tensor]) -> int:
    """Samples in a batch of model inputs."""
    return int(next(iter(batch.values())).shape[0])


def share(n: int) -> slice:
    """This process's contiguous share of the ``n`` samples of a global batch (all of them without a
    process group). Shares are in rank order, so concatenating them gives the global batch."""
    rank, size = world()
    return slice(rank * n // size, (rank + 1) * n // size)


def shard(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This process's share of a global batch (the batch itself without a process group)."""
    if not active():
        return batch
    sl = share(batch_size(batch))
    return {k: v[sl] for k, v in batch.items()}


def check_batches(batches: list[dict[str, torch.Tensor]]) -> None:
    """Refuse a global batch that some process would get no sample of."""
    _, size = world()
    if size <= 1:
        return
    for i, b in enumerate(batches):
        if batch_size(b) < size:
            raise UserError(f"distributed ranking: calibration batch {i} has {batch_size(b)} samples, fewer than "
                            f"the {size} processes; choose --calib-size / --batch-size so that every batch has "
                            f"at least {size}")


def model_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype of the module's (first floating-point) parameters."""
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def place(batch: dict[str, torch.Tensor], device: torch.device,
          dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Move a batch to ``device``; floating-point inputs (pixels) take the weights' ``dtype``."""
    return {k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in batch.items()}


def as_fp32(outputs: tuple) -> tuple:
    """Model outputs with floating-point tensors in fp32 (the losses stay fp32 with bf16/fp16 weights)."""
    return tuple(o.float() if torch.is_tensor(o) and o.is_floating_point() else o for o in outputs)


def cast_weights(module: torch.nn.Module, name: str) -> None:
    """Cast the frozen weights for ranking: ``fp32`` (no change), ``bf16`` or ``fp16``."""
    if name not in WEIGHT_DTYPES:
        raise UserError(f"--weights-dtype {name}: choose {', '.join(WEIGHT_DTYPES)}")
    if name != "fp32":
        module.to(WEIGHT_DTYPES[name])


@functools.cache
def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 matrices natively (CPUs with AVX-512 BF16 or AMX, or a
    CUDA GPU with bf16), so that bf16 products are faster than fp32 there rather than emulated. Asked
    once per device: :func:`compute` resolves ``auto`` on every forward pass of the ranking."""
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch.cpu's feature checks
    return device.type == "cpu" and any(bool(getattr(torch.cpu, name, lambda: False)()) for name in checks)


def resolve_compute(name: str, device: torch.device) -> str:
    """``name`` (``auto``, ``fp32`` or ``bf16``) as the ranking runs it on ``device``: ``auto`` is
    ``bf16`` where :func:`native_bf16`, else ``fp32``."""
    if name not in COMPUTE:
        raise UserError(f"--ranking-compute {name}: choose {', '.join(COMPUTE)}")
    if name == "auto":
        return "bf16" if native_bf16(device) else "fp32"
    return name


def compute(name: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The context the model's forward passes run in while ranking (``name`` as :func:`resolve_compute`
    reads it): ``fp32`` changes nothing; ``bf16`` is torch autocast (matrix products in bfloat16;
    normalisations, softmax and the losses in fp32; the backward pass follows the forward's types)."""
    if resolve_compute(name, device) == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


@contextlib.contextmanager
def checkpointed(blocks: list, enabled: bool = True) -> Iterator[None]:
    """Recompute each block's activations in the backward pass instead of keeping them
    (``torch.utils.checkpoint``, non-reentrant, so hooks and masks inside the block still work).

    Args:
        blocks: the adapter's :class:`~elastic_export.models.adapters.BlockUnits` (their ``block`` modules).
        enabled: False leaves the blocks alone.
    """
    from torch.utils.checkpoint import checkpoint

    if not enabled:
        yield
        return
    patched = []
    for b in blocks:
        mod = b.block
        orig = mod.forward

        def forward(*args, _orig=orig, **kwargs):
            if not torch.is_grad_enabled():
                return _orig(*args, **kwargs)
            return checkpoint(_orig, *args, use_reentrant=False, **kwargs)

        had = "forward" in mod.__dict__
        mod.forward = forward
        patched.append((mod, had, orig))
    try:
        yield
    finally:
        for mod, had, orig in patched:
            if had:
                mod.forward = orig
            else:
                del mod.forward
