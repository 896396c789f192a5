"""Ranking methods: every method on tiny models, the soft-mask cutoffs, determinism and resume."""

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_encoder

from elastic_export.core.errors import UserError
from elastic_export.data.calibration import load_calibration
from elastic_export.models.inventory import build_inventory
from elastic_export.ranking import distributed as ddp
from elastic_export.ranking import soft_ranking
from elastic_export.ranking.file import Ranking, make_meta, save_ranking
from elastic_export.ranking.plans import make_plans
from elastic_export.ranking.scoring import METHODS
from elastic_export.ranking.soft_ranking import ElasticConfig, _Units, cutoffs, optimise_ranking

FAST = ElasticConfig(steps=6, targets_per_step=3, checkpoint_every=2, targets=(0.1, 0.3, 0.5, 0.7))


def _setup(name):
    enc = tiny_encoder(name)
    inv = build_inventory(enc)
    cal = load_calibration(enc, size=8, batch_size=4)
    return enc, inv, cal


@pytest.mark.parametrize("name", ["hf-bert", "timm-vit-swiglu", "hf-dinov2", "hf-modernbert", "timm-eva02",
                                  "hf-siglip-vision", "hf-siglip-text", "hf-mpnet"])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_runs_on_tiny_models(name, method):
    enc, inv, cal = _setup(name)
    kw = {"config": FAST} if method == "elastic" else {}
    heads, neurons = METHODS[method](enc, inv, cal, seed=0, **kw)
    again = METHODS[method](enc, inv, cal, seed=0, **kw)
    assert [len(h) for h in heads] == [L.heads for L in inv.layers]
    assert [len(n) for n in neurons] == [L.neurons for L in inv.layers]
    for a, b in zip(heads + neurons, again[0] + again[1]):
        assert a.dtype == np.float32 and np.all(np.isfinite(a))
        np.testing.assert_array_equal(a, b)  # deterministic for a seed
    if method != "random":  # data- or weight-driven scores are not all equal
        assert np.ptp(np.concatenate(heads + neurons)) > 0


def test_methods_disagree():
    """The methods are different estimators: their neuron orders differ."""
    enc, inv, cal = _setup("hf-bert")
    orders = {m: tuple(np.argsort(-METHODS[m](enc, inv, cal)[1][0])) for m in ("initial", "activation", "variance",
                                                                            "fisher", "magnitude")}
    assert len(set(orders.values())) == len(orders)


def test_cutoffs_fill_each_target_budget():
    rng = np.random.default_rng(0)
    scores = torch.tensor(rng.normal(size=500))
    cost = torch.tensor(rng.integers(1, 50, size=500).astype(np.float64))
    targets = [round(0.05 * i, 2) for i in range(1, 15)]
    t = cutoffs(scores, cost, targets)
    total = float(cost.sum())
    for b, tb in zip(targets, t.tolist()):
        kept = scores > tb
        budget = (1 - b) * total
        assert float(cost[kept].sum()) <= budget + 1e-9
        best_dropped = torch.argmax(torch.where(kept, torch.tensor(-np.inf, dtype=torch.float64), scores))
        assert float(cost[kept].sum() + cost[best_dropped]) > budget  # the prefix is maximal
    assert torch.all(t[1:] >= t[:-1])  # higher sparsity, higher cutoff


def test_cutoffs_agree_with_budget_plans():
    """The soft-mask cutoffs keep exactly the units the budget filler keeps."""
    enc, inv, cal = _setup("hf-bert")
    heads, neurons = METHODS["magnitude"](enc, inv, cal)
    units = _Units.of(inv)
    flat = units.flatten(heads, neurons)
    targets = [0.2, 0.45, 0.7]
    for b, tb, plan in zip(targets, cutoffs(flat, units.cost, targets), make_plans(Ranking(heads, neurons), inv, targets)):
        for i in range(len(inv.layers)):
            assert int((flat[units.slices[(i, "heads")]] > tb).sum()) == plan.heads_per_layer[i]
            assert int((flat[units.slices[(i, "neurons")]] > tb).sum()) == plan.neurons_per_layer[i]


def test_optimisation_reduces_the_loss():
    enc, inv, cal = _setup("hf-bert")
    initial = METHODS["initial"](enc, inv, cal)
    cfg = ElasticConfig(steps=40, targets_per_step=4, targets=(0.2, 0.4, 0.6, 0.8), lr=0.1, checkpoint_every=0)
    _, losses = optimise_ranking(enc, inv, cal, initial, cfg)
    assert np.mean(losses[-8:]) < np.mean(losses[:8])


def _ranking_bytes(enc, inv, cal, scores, path: Path) -> bytes:
    save_ranking(Ranking(*scores, make_meta(inv, enc.fingerprint(), "elastic", {}, cal.description)), path)
    return path.read_bytes()


def test_same_seed_same_ranking_bytes(tmp_path):
    enc, inv, cal = _setup("hf-bert")
    a = METHODS["elastic"](enc, inv, cal, seed=1, config=FAST)
    b = METHODS["elastic"](enc, inv, cal, seed=1, config=FAST)
    c = METHODS["elastic"](enc, inv, cal, seed=2, config=ElasticConfig(**{**FAST.__dict__, "seed": 2}))
    assert _ranking_bytes(enc, inv, cal, a, tmp_path / "a") == _ranking_bytes(enc, inv, cal, b, tmp_path / "b")
    assert _ranking_bytes(enc, inv, cal, a, tmp_path / "a") != _ranking_bytes(enc, inv, cal, c, tmp_path / "c")


def test_resume_after_kill_gives_identical_ranking(tmp_path, monkeypatch):
    enc, inv, cal = _setup("hf-bert")
    ckpt = tmp_path / "ranking.checkpoint"
    full = METHODS["elastic"](enc, inv, cal, config=FAST)

    real_save = soft_ranking._save_checkpoint
    saves = []

    def save_then_die(path, state, meta):
        real_save(path, state, meta)
        saves.append(meta["step"])
        if meta["step"] == 4:
            raise KeyboardInterrupt  # killed right after the second checkpoint

    monkeypatch.setattr(soft_ranking, "_save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        METHODS["elastic"](enc, inv, cal, config=FAST, checkpoint=ckpt)
    assert saves == [2, 4] and ckpt.is_file()
    monkeypatch.setattr(soft_ranking, "_save_checkpoint", real_save)
    resumed = METHODS["elastic"](enc, inv, cal, config=FAST, checkpoint=ckpt, resume=True)
    assert _ranking_bytes(enc, inv, cal, full, tmp_path / "a") == _ranking_bytes(enc, inv, cal, resumed, tmp_path / "b")
    assert not ckpt.exists()  # a finished run removes its checkpoint


def test_resume_refuses_a_foreign_checkpoint(tmp_path, monkeypatch):
    from elastic_export.core.errors import UserError

    enc, inv, cal = _setup("hf-bert")
    ckpt = tmp_path / "ranking.checkpoint"

    def save_then_die(path, state, meta):
        soft_ranking.__dict__["_real_save"](path, state, meta)
        raise KeyboardInterrupt

    monkeypatch.setitem(soft_ranking.__dict__, "_real_save", soft_ranking._save_checkpoint)
    monkeypatch.setattr(soft_ranking, "_save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        METHODS["elastic"](enc, inv, cal, config=FAST, checkpoint=ckpt)
    monkeypatch.undo()
    other = ElasticConfig(**{**FAST.__dict__, "lr": 0.2})
    with pytest.raises(UserError, match="another run"):
        METHODS["elastic"](enc, inv, cal, config=other, checkpoint=ckpt, resume=True)
    lines: list[str] = []  # without --resume: one line says it starts over, and that --resume would continue
    METHODS["elastic"](enc, inv, cal, config=other, checkpoint=ckpt, echo=lines.append)
    assert lines == [f"found the checkpoint {ckpt} of an interrupted ranking (step 2 of {FAST.steps}); "
                     "starting over (--resume would continue from it)"]


@pytest.mark.parametrize("name,loss,token_weight", [("timm-vit", "auto", 0.0), ("timm-vit", "cosine", 0.5),
                                                    ("hf-bert", "cosine", 1.0)])
def test_loss_variants_reduce_the_loss(name, loss, token_weight):
    """KL to the dense logits (classifiers), embedding cosine, and the token-level term all train."""
    enc, inv, cal = _setup(name)
    initial = METHODS["initial"](enc, inv, cal)
    cfg = ElasticConfig(steps=30, targets_per_step=4, targets=(0.2, 0.4, 0.6, 0.8), lr=0.1, checkpoint_every=0,
                        loss=loss, token_weight=token_weight)
    _, losses = optimise_ranking(enc, inv, cal, initial, cfg)
    assert all(np.isfinite(losses)) and np.mean(losses[-6:]) < np.mean(losses[:6])


def test_kl_needs_logits():
    from elastic_export.core.errors import UserError

    enc, inv, cal = _setup("hf-bert")
    with pytest.raises(UserError, match="logits"):
        optimise_ranking(enc, inv, cal, METHODS["initial"](enc, inv, cal), ElasticConfig(steps=1, loss="kl"))
    assert all(p.requires_grad for p in enc.module.parameters())  # nothing left frozen
    with pytest.raises(UserError, match="logits"):  # the method refuses it before any scoring
        METHODS["elastic"](enc, inv, cal, config=ElasticConfig(steps=1, loss="kl"))


def test_fisher_leaves_weights_trainable():
    enc, inv, cal = _setup("hf-bert")
    METHODS["fisher"](enc, inv, cal)
    assert all(p.requires_grad for p in enc.module.parameters())


def _class_folders(root: Path, names: list[str], per_class: int = 4) -> Path:
    from PIL import Image

    rng = np.random.default_rng(0)
    for c, name in enumerate(names):
        (root / name).mkdir(parents=True)
        for j in range(per_class):
            pixels = (rng.random((40, 40, 3)) * 60 + 60 * c).clip(0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(root / name / f"{j}.png")
    return root


def test_labelled_images_train_on_cross_entropy(tmp_path):
    """Class sub-folders that name the classifier's classes become labels; the ranking uses CE."""
    from elastic_export.ranking.soft_ranking import loss_kind

    enc = tiny_encoder("timm-vit")  # 10 classes
    inv = build_inventory(enc)
    cal = load_calibration(enc, str(_class_folders(tmp_path / "imgs", ["3", "7"])), size=8, batch_size=4)
    assert cal.description["labels"] == "2 classes from sub-folders"
    assert [t.tolist() for t in cal.labels] == [[3, 3, 3, 3], [7, 7, 7, 7]]
    assert loss_kind(enc.output_names(), ElasticConfig(), cal) == "ce"
    fisher = METHODS["fisher"](enc, inv, cal)
    assert all(np.isfinite(a).all() and a.std() > 0 for a in fisher[1])
    cfg = ElasticConfig(steps=30, targets_per_step=4, targets=(0.2, 0.4, 0.6, 0.8), lr=0.1, checkpoint_every=0)
    _, losses = optimise_ranking(enc, inv, cal, fisher, cfg)
    assert all(np.isfinite(losses)) and np.mean(losses[-6:]) < np.mean(losses[:6])


def test_folders_that_name_no_class_give_no_labels(tmp_path):
    from elastic_export.core.errors import UserError

    enc = tiny_encoder("timm-vit")
    inv = build_inventory(enc)
    cal = load_calibration(enc, str(_class_folders(tmp_path / "imgs", ["cat", "dog"])), size=8, batch_size=4)
    assert cal.labels is None and "name no model class" in cal.description["labels"]
    with pytest.raises(UserError, match="labelled calibration"):
        METHODS["elastic"](enc, inv, cal, config=ElasticConfig(steps=1, loss="ce"))
    text = tiny_encoder("hf-bert")
    with pytest.raises(UserError, match="logits"):
        METHODS["elastic"](text, build_inventory(text), load_calibration(text, size=8, batch_size=4),
                           config=ElasticConfig(steps=1, loss="ce"))


@pytest.mark.parametrize("name,loss,init", [("hf-bert", "auto", "fisher"), ("timm-vit", "kl", "fisher"),
                                            ("hf-bert", "auto", "initial"), ("timm-vit", "kl", "initial"),
                                            ("hf-bert", "auto", "activation"), ("hf-bert", "auto", "variance")])
def test_the_elastic_ranking_takes_its_dense_targets_from_the_initial_scores_pass(name, loss, init, monkeypatch):
    """The starting scores' forward passes (fisher: every mask 1; the others: no mask) are the dense model's
    outputs: the elastic ranking reuses them as its dense targets, runs the model once less over the
    calibration data, and ends with the ranking a separate dense pass gives, bit for bit (in fp32: under bf16
    the passes with and without masks round differently)."""
    enc, inv, cal = _setup(name)
    cfg = ElasticConfig(steps=4, targets_per_step=2, checkpoint_every=0, targets=(0.2, 0.5), loss=loss, init=init,
                        compute="fp32")
    initial = METHODS[init](enc, inv, cal, seed=cfg.seed)
    separate, _ = optimise_ranking(enc, inv, cal, initial, cfg)
    forward = enc.export_module().forward
    calls = []
    monkeypatch.setattr(type(enc.export_module()), "forward",
                        lambda self, *a, **k: calls.append(1) or forward(*a, **k), raising=False)
    reused = soft_ranking.elastic_ranking(enc, inv, cal, config=cfg)
    for a, b in zip(separate[0] + separate[1], reused[0] + reused[1]):
        np.testing.assert_array_equal(a, b)
    assert len(calls) == len(cal.batches) + cfg.steps  # the initial scores' passes and the steps', no dense pass


@pytest.mark.parametrize("projections", [1, 3])
def test_fisher_takes_one_backward_pass_per_projection(projections, monkeypatch):
    """``fisher_projections`` random projections of each batch's embedding, one backward pass each:
    other projections, other scores."""
    enc, inv, cal = _setup("hf-bert")
    grad, calls = torch.autograd.grad, []
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: calls.append(1) or grad(*a, **k))
    scores = METHODS["fisher"](enc, inv, cal, seed=0, projections=projections)
    assert len(calls) == projections * len(cal.batches)
    two = METHODS["fisher"](enc, inv, cal, seed=0)
    assert not all(np.array_equal(a, b) for a, b in zip(scores[1], two[1]))
    calls.clear()  # the elastic ranking passes its config's count on: then one backward per step
    cfg = ElasticConfig(steps=2, checkpoint_every=0, targets=(0.2, 0.5), fisher_projections=projections)
    soft_ranking.elastic_ranking(enc, inv, cal, config=cfg)
    assert len(calls) == projections * len(cal.batches) + cfg.steps


def test_auto_compute_is_bf16_exactly_where_the_cpu_multiplies_bf16():
    """``auto`` resolves by the CPU's own feature flags (read here from /proc/cpuinfo, independently of torch)."""
    flags = set(" ".join(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("flags")).split())
    native = bool({"avx512_bf16", "amx_tile"} & flags)
    cpu = torch.device("cpu")
    assert ddp.native_bf16(cpu) == native
    assert ddp.resolve_compute("auto", cpu) == ("bf16" if native else "fp32")
    assert [ddp.resolve_compute(n, cpu) for n in ("fp32", "bf16")] == ["fp32", "bf16"]
    with pytest.raises(UserError, match="--ranking-compute fp16: choose auto, fp32, bf16"):
        ddp.resolve_compute("fp16", cpu)


@pytest.mark.parametrize("compute", ["fp32", "bf16"])
def test_ranking_compute_sets_the_type_of_the_matrix_products(compute):
    """fisher and the elastic steps run their linear layers in the compute type; the scores stay
    fp32 and, in bf16, keep the fp32 ranking's order up to near-ties."""
    enc, inv, cal = _setup("hf-bert")
    linear = next(m for m in enc.module.modules() if isinstance(m, torch.nn.Linear))
    seen: list[torch.dtype] = []
    handle = linear.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    cfg = ElasticConfig(steps=2, checkpoint_every=0, targets=(0.2, 0.5), compute=compute)
    try:
        fisher = METHODS["fisher"](enc, inv, cal, seed=0, compute=compute)
        elastic = soft_ranking.elastic_ranking(enc, inv, cal, config=cfg)
    finally:
        handle.remove()
    assert set(seen) == {torch.bfloat16 if compute == "bf16" else torch.float32}
    assert len(seen) == 2 * len(cal.batches) + cfg.steps  # fisher's passes twice (alone, as the start), the steps'
    reference = METHODS["fisher"](enc, inv, cal, seed=0, compute="fp32")
    a, b = np.concatenate(reference[1]), np.concatenate(fisher[1])
    assert b.dtype == np.float32 and np.all(np.isfinite(b)) and all(np.all(np.isfinite(x)) for x in elastic[1])
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    assert np.corrcoef(ra, rb)[0, 1] > 0.98


def test_the_ranking_file_records_the_compute_that_ran(tmp_path):
    """``auto`` is recorded as what it resolved to on this machine, for elastic and fisher."""
    from elastic_export.pipeline import Options
    from elastic_export.ranking.driver import rank_encoder

    enc, inv, cal = _setup("hf-bert")
    want = ddp.resolve_compute("auto", torch.device("cpu"))
    for method in ("elastic", "fisher"):
        opts = Options(method=method, out=str(tmp_path / "out"), elastic=ElasticConfig(steps=2, checkpoint_every=0))
        ranking = rank_encoder(enc, inv, opts, echo=lambda s: None, calib=cal)
        assert ranking.meta["hyperparameters"]["compute"] == want
