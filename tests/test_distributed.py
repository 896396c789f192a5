"""Distributed ranking (torchrun, gloo on CPU) equals the one-process ranking; bf16 weights and
activation checkpointing run and agree with fp32.

Run as a script under torchrun (``python -m torch.distributed.run --nproc-per-node 2
tests/test_distributed.py OUT.npz``), this file is also the worker of
:func:`test_scoring_methods_two_processes_match_one`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from elastic_export.ranking.file import Ranking, load_ranking

TESTS = Path(__file__).resolve().parent
# fp32 passes: the processes' sums equal one process's to float rounding (bf16 products round per GEMM shape)
RANK = ["--seq-len", "16", "--calib-size", "16", "--batch-size", "4", "--steps", "4", "--token-weight", "0.5",
        "--ranking-compute", "fp32"]

pytestmark = pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def _run(args: list[str], cwd: Path, procs: int = 2) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node N -m elastic_export ...``."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}"]
    r = subprocess.run([*launcher, "-m", "elastic_export", *args], cwd=cwd, env=_env(), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _rank_here(args: list[str], cwd: Path) -> None:
    """``elastic-export rank ...`` in this process (``cli.main.main``), in ``cwd``, on one torch thread
    as :func:`_run`'s ``OMP_NUM_THREADS=1`` gives a fresh process (the same arithmetic: test_pipeline's
    test_ranking_is_deterministic checks the bytes agree)."""
    import contextlib
    import io

    from elastic_export.cli.main import main

    here, threads, err = os.getcwd(), torch.get_num_threads(), io.StringIO()
    os.chdir(cwd)
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err), \
                pytest.raises(SystemExit) as done:
            main(["rank", *args])
    finally:
        torch.set_num_threads(threads)
        os.chdir(here)
    assert done.value.code == 0, err.getvalue()[-3000:]


def _flat(r: Ranking) -> np.ndarray:
    return np.concatenate([*r.heads, *r.neurons]).astype(np.float64)


def assert_same_ranking(a: np.ndarray, b: np.ndarray, rtol: float) -> float:
    """Scores agree within ``rtol`` × the score scale, and every pair of units whose scores differ by
    more than twice that keeps its order (one global order: the budget filler's). Returns the max
    abs difference."""
    tol = rtol * float(np.abs(a).max())
    diff = float(np.abs(a - b).max())
    assert diff <= tol, f"max abs score difference {diff:.3g} > {tol:.3g}"
    order = np.argsort(-a, kind="stable")
    sa, sb = a[order], b[order]
    clear = np.diff(sa) < -2 * tol  # neighbours in a's order that are not (near-)tied
    assert np.all(np.diff(sb)[clear] < 0), "unit order differs where scores are not tied"
    return diff


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> Path:
    sys.path.insert(0, str(TESTS))
    from conftest import tiny_encoder

    root = tmp_path_factory.mktemp("dist")
    tiny_encoder("hf-bert").module.save_pretrained(root / "bert")
    return root


@pytest.fixture(scope="module")
def one_process(bert_dir) -> Ranking:
    _rank_here(["--model", "bert", *RANK, "--out", "one.safetensors"], bert_dir)
    return load_ranking(bert_dir / "one.safetensors")


def test_torchrun_two_processes_match_one(bert_dir, one_process):
    """The default (elastic, fisher init, similarity-structure term) plus the token term, 2 × gloo."""
    r = _run(["rank", "--model", "bert", *RANK, "--out", "two.safetensors"], bert_dir, procs=2)
    assert r.stdout.count("wrote two.safetensors") == 1  # rank 0 only
    two = load_ranking(bert_dir / "two.safetensors")
    assert two.meta == one_process.meta
    # the similarity-structure term's KL between nearly equal softmaxes at temperature 0.05 turns
    # float rounding (different GEMM shapes per process) into ~2e-5 of the score scale
    diff = assert_same_ranking(_flat(one_process), _flat(two), rtol=1e-4)
    print(f"max abs score difference 2 vs 1 processes: {diff:.3g}")
    assert not (bert_dir / "two.safetensors.checkpoint").exists()


def test_checkpointing_and_bf16(bert_dir, one_process):
    _rank_here(["--model", "bert", *RANK, "--checkpoint-activations", "--out", "ck.safetensors"], bert_dir)
    ck = load_ranking(bert_dir / "ck.safetensors")
    assert ck.meta == one_process.meta
    assert_same_ranking(_flat(one_process), _flat(ck), rtol=1e-6)  # recomputation: the same arithmetic

    _rank_here(["--model", "bert", *RANK, "--weights-dtype", "bf16", "--checkpoint-activations",
                "--out", "bf16.safetensors"], bert_dir)
    bf = load_ranking(bert_dir / "bf16.safetensors")
    assert bf.meta["fingerprint"] == one_process.meta["fingerprint"]  # of the fp32 weights, for export
    assert bf.meta["hyperparameters"]["weights_dtype"] == "bf16"
    a, b = _flat(one_process), _flat(bf)
    assert np.all(np.isfinite(b))
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    assert np.corrcoef(ra, rb)[0, 1] > 0.99  # bf16 rounding moves near-ties only


def test_tiny_batches_are_refused(bert_dir):
    """A global batch with fewer samples than processes is a one-line error on every rank."""
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        "-m", "elastic_export", "rank", "--model", "bert", "--seq-len", "16", "--calib-size", "5",
                        "--batch-size", "4", "--method", "fisher", "--out", "x.safetensors"],
                       cwd=bert_dir, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert "error: distributed ranking: calibration batch 1 has 1 samples" in r.stderr
    assert not (bert_dir / "x.safetensors").exists()


# --- every scoring path, in one torchrun launch ------------------------------------------------
def _all_scores() -> dict[str, np.ndarray]:
    """Scores of every data-driven method on tiny models: text (random-projection Fisher, token
    statistics, elastic with the token term) and a classifier with labelled images (per-sample
    cross-entropy Fisher, elastic with cross-entropy)."""
    sys.path.insert(0, str(TESTS))
    from conftest import tiny_encoder

    from elastic_export.data.calibration import load_calibration
    from elastic_export.models.inventory import build_inventory
    from elastic_export.ranking.scoring import METHODS
    from elastic_export.ranking.soft_ranking import ElasticConfig

    torch.set_num_threads(1)
    out = {}
    cfg = dict(steps=4, targets_per_step=3, checkpoint_every=0, targets=(0.1, 0.3, 0.5, 0.7),
               compute="fp32")  # fp32: equal to float rounding (bf16 products round per GEMM shape)
    bert = tiny_encoder("hf-bert")
    inv = build_inventory(bert)
    cal = load_calibration(bert, None, size=14, batch_size=5)  # batches of 5, 5, 4: uneven shares
    for m in ("fisher", "initial", "activation", "variance"):
        h, n = METHODS[m](bert, inv, cal)
        out[f"bert/{m}"] = np.concatenate([*h, *n])
    h, n = METHODS["elastic"](bert, inv, cal, config=ElasticConfig(**cfg, token_weight=0.5, relational_weight=0.0))
    out["bert/elastic"] = np.concatenate([*h, *n])
    vit = tiny_encoder("timm-vit")
    inv = build_inventory(vit)
    cal = load_calibration(vit, None, size=12, batch_size=6)
    cal.labels = [torch.arange(i, i + 6) % 10 for i in range(0, 12, 6)]
    h, n = METHODS["fisher"](vit, inv, cal)
    out["vit/fisher-ce"] = np.concatenate([*h, *n])
    h, n = METHODS["elastic"](vit, inv, cal, config=ElasticConfig(**cfg, loss="ce"))
    out["vit/elastic-ce"] = np.concatenate([*h, *n])
    return out


def test_scoring_methods_two_processes_match_one(tmp_path):
    out = tmp_path / "two.npz"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        str(Path(__file__).resolve()), str(out)], env=_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    two = dict(np.load(out))
    threads = torch.get_num_threads()
    try:
        one = _all_scores()
    finally:
        torch.set_num_threads(threads)  # _all_scores sets one thread (the torchrun workers' count)
    assert sorted(two) == sorted(one)
    worst = {k: assert_same_ranking(one[k].astype(np.float64), two[k].astype(np.float64), rtol=1e-5) for k in one}
    print("max abs score difference 2 vs 1 processes:", {k: f"{v:.2g}" for k, v in worst.items()})


if __name__ == "__main__":  # the torchrun worker
    from elastic_export.ranking import distributed as ddp

    with ddp.session("cpu"):
        scores = _all_scores()
        if ddp.is_main():
            np.savez(sys.argv[1], **scores)
