"""The main job's quick eval (elastic_export.measure.quick_eval): held-out data disjoint from the calibration
sample, quality and speed of every (budget, precision) in the manifest, the latency profile's quality
block and frontier, and the runtime's latency-target policy reading them. Tiny real models, real
onnxruntime; timings are only checked for presence and positivity."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from conftest import tiny_encoder

from elastic_export import pipeline
from elastic_export.cli.main import main
from elastic_export.core.manifest import MANIFEST
from elastic_export.data.calibration import default_texts, evenly_spaced, synthetic_images
from elastic_export.measure import metrics, quick_eval

QUIET = dict(echo=lambda s: None)
BUDGETS = (0.3, 0.6)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qe") / "tiny-bert"
    tiny_encoder("hf-bert").module.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def text_art(bert_dir):
    """The main job on a tiny BERT at two precisions, quick eval on (the default)."""
    out = bert_dir.parent / "art"
    said: list[str] = []
    m = pipeline.run(pipeline.Options(model=str(bert_dir), budgets=BUDGETS, out=str(out), seq_len=16,
                                      method="magnitude", calib_size=8, precision="fp32,int8", elastic_graph=False),
                     echo=said.append)
    return out, m, said


def test_heldout_texts_are_beyond_the_calibration_sample(tmp_path):
    texts = default_texts()
    calib = set(evenly_spaced(texts, 256))  # what load_calibration takes from the built-in source
    held, desc = quick_eval.heldout_texts(None, 256)
    assert len(held) == quick_eval.HELDOUT == desc["samples"] and len(set(held)) == len(held)
    assert not set(held) & calib and set(held) <= set(texts)
    f = tmp_path / "calib.txt"
    f.write_text("\n".join(f"passage number {i} about topic {i % 7}" for i in range(30)))
    held, desc = quick_eval.heldout_texts(str(f), 8)
    lines = f.read_text().splitlines()
    assert len(held) == 22 and not set(held) & set(evenly_spaced(lines, 8)) and desc["source"] == str(f)
    held, desc = quick_eval.heldout_texts(str(f), 30)  # the whole file calibrated: the fallback set
    assert held and not set(held) & set(lines) and "heldout_pairs" in desc["source"]


def test_heldout_images_continue_the_synthetic_stream():
    enc = tiny_encoder("timm-vit")
    imgs, desc = quick_eval.heldout_images(enc, None, 8, seed=0, n=5)
    stream = synthetic_images(enc.data_config, 13, 0)
    assert len(imgs) == 5 and all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(imgs, stream[8:]))
    assert "synthetic" in desc["source"]


def _clashes(held: list[str], used: list[str]) -> list[str]:
    """The held-out texts equal to, a prefix of, or starting with a calibration text."""
    return [h for h in held if any(c.startswith(h) or h.startswith(c) for c in used)]


def test_heldout_texts_are_no_prefix_of_a_calibration_text(tmp_path):
    """The calibration adds each paragraph's first sentence as its own sample: a held-out text is
    neither the first sentence (a prefix) of a calibration text nor a paragraph a calibration text opens."""
    held, _ = quick_eval.heldout_texts(None, 256)
    assert len(held) == quick_eval.HELDOUT and not _clashes(held, evenly_spaced(default_texts(), 256))
    names = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"]
    lines = [t for n in names for t in (f"Paragraph {n} opens here. It goes on about {n}.", f"Paragraph {n} opens here.")]
    f = tmp_path / "calib.txt"
    f.write_text("\n".join(lines))
    used = evenly_spaced(lines, 5)  # the paragraphs alpha, charlie, echo, golf, india
    held, _ = quick_eval.heldout_texts(str(f), 5)
    assert not _clashes(held, used) and sorted(held) == sorted(lines[i] for i in range(20) if (i // 2) % 2)


def _rank_file(model, calib, size: int, out) -> str:
    """A fisher ranking of ``model`` calibrated on ``size`` samples of ``calib`` (None: built in), by ``rank``."""
    with pytest.raises(SystemExit) as e:
        main(["rank", "--model", str(model), "--method", "fisher", "--seq-len", "16", "--calib-size", str(size),
              "--batch-size", "4", "--out", str(out)] + (["--calib", str(calib)] if calib else []))
    assert e.value.code == 0
    return str(out)


def _spy(monkeypatch, name: str) -> list:
    """Record what quick_eval.<name> returns."""
    seen, real = [], getattr(quick_eval, name)

    def spy(*args, **kw):
        seen.append(real(*args, **kw))
        return seen[-1]

    monkeypatch.setattr(quick_eval, name, spy)
    return seen


def test_heldout_texts_miss_what_a_reused_ranking_was_calibrated_on(bert_dir, tmp_path, monkeypatch):
    """--ranking made on other data: the held-out texts are disjoint from the ranking's calibration
    texts too (its file's metadata names them), or the entry says what it could not guarantee."""
    theirs = tmp_path / "theirs.txt"
    theirs.write_text("\n".join(f"ranking passage {i} on subject {i % 5}, kept apart" for i in range(40)))
    ranked_on = evenly_spaced(theirs.read_text().splitlines(), 12)
    ours = tmp_path / "ours.txt"  # the ranking's source and more: what --calib now names
    ours.write_text("\n".join(theirs.read_text().splitlines()
                              + [f"evaluation line {i} about theme {i % 3}, written later" for i in range(40)]))
    ranking = _rank_file(bert_dir, theirs, 12, tmp_path / "r.safetensors")
    seen, said = _spy(monkeypatch, "heldout_texts"), []
    opts = dict(model=str(bert_dir), ranking=ranking, calib=str(ours), calib_size=8, budgets=(0.5,), seq_len=16,
                verify=False, elastic_graph=False, report=False)
    m = pipeline.run(pipeline.Options(out=str(tmp_path / "a"), **opts), echo=said.append)
    held = seen[-1][0]
    assert held and not _clashes(held, ranked_on) and not _clashes(held, evenly_spaced(ours.read_text().splitlines(), 8))
    held_out = quick_eval.entry_of(m)["heldout"]
    assert "ranking" in held_out["excluded"] and "not_guaranteed" not in held_out
    theirs.unlink()  # the ranking's data is gone: what it saw is unknown, and the entry says so
    m = pipeline.run(pipeline.Options(out=str(tmp_path / "b"), **opts), echo=said.append)
    assert str(theirs) in quick_eval.entry_of(m)["heldout"]["not_guaranteed"]
    assert any(s.startswith("warning: quick eval:") and str(theirs) in s for s in said)


def test_heldout_images_miss_what_a_reused_ranking_was_calibrated_on(tmp_path, monkeypatch):
    """A ranking calibrated on more synthetic images than --calib-size: the held-out images start after them."""
    model = tmp_path / "vit"
    tiny_encoder("hf-vit").module.save_pretrained(model)
    ranking = _rank_file(model, None, 12, tmp_path / "r.safetensors")
    seen = _spy(monkeypatch, "heldout_images")
    pipeline.run(pipeline.Options(model=str(model), ranking=ranking, calib_size=4, budgets=(0.5,), out=str(tmp_path / "o"),
                                  verify=False, elastic_graph=False, report=False), **QUIET)
    imgs, desc = seen[-1]
    from elastic_export.models.loader import load_encoder

    stream = synthetic_images(load_encoder(str(model)).data_config, 12 + len(imgs), 0)
    assert imgs and all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(imgs, stream[12:]))
    assert "12" in desc["excluded"]


def test_neighbour_overlap():
    rng = np.random.default_rng(0)
    index = rng.normal(size=(40, 8))
    assert metrics.neighbour_overlap(index, index) == 1.0
    assert metrics.neighbour_overlap(index * 3.0, index) == 1.0  # cosine: scale does not matter
    assert metrics.neighbour_overlap(rng.normal(size=(40, 8)), index) < 0.6
    close = metrics.neighbour_overlap(index + 0.05 * rng.normal(size=index.shape), index)
    assert 0.6 < close < 1.0 or close == 1.0
    per_query = metrics.neighbour_overlaps(close * index, index)
    assert per_query.shape == (40,) and set(np.unique(per_query)) <= {i / 10 for i in range(11)}


class _CountingRuntime:
    """Stands in for an ElasticRuntime: records the order pairs run in, takes no time to speak of."""

    def __init__(self, pairs):
        self.pairs, self.calls = list(pairs), []

    def run(self, feeds, sparsity, precision):
        self.calls.append((sparsity, precision))


def test_timing_interleaves_rounds_with_a_rotating_start():
    pairs = [(0.0, "fp32"), (0.3, "fp32"), (0.6, "fp32")]
    rt = _CountingRuntime(pairs)
    times = quick_eval.time_interleaved(rt, {}, seconds=1e9, min_rounds=2, max_rounds=4)
    assert all(len(v) == 4 for v in times.values()) and all(t >= 0 for v in times.values() for t in v)
    rounds = [rt.calls[i:i + 3] for i in range(0, 12, 3)]
    assert [r[0] for r in rounds] == [pairs[0], pairs[1], pairs[2], pairs[0]]  # every position in turn
    assert all(sorted(r) == pairs for r in rounds)  # every pair once per round
    # a time bound already spent: min_rounds, no more
    rt = _CountingRuntime(pairs)
    times = quick_eval.time_interleaved(rt, {}, seconds=0.0, min_rounds=2, max_rounds=9)
    assert all(len(v) == 2 for v in times.values())


class _SlowRuntime(_CountingRuntime):
    """Each run advances a fake clock by ``ms``."""

    def __init__(self, pairs, ms, clock):
        super().__init__(pairs)
        self.ms, self.clock = ms, clock

    def run(self, feeds, sparsity, precision):
        super().run(feeds, sparsity, precision)
        self.clock[0] += self.ms / 1e3


@pytest.mark.parametrize("ms,rounds", [(100.0, 3), (1500.0, 2)])
def test_a_round_of_seconds_is_timed_twice_not_three_times(ms, rounds, monkeypatch):
    """A round far past the batch size's time (a large model at batch 8) ends the timing after
    LEAST_ROUNDS; a round within it keeps MIN_ROUNDS."""
    clock = [0.0]
    monkeypatch.setattr(quick_eval.time, "perf_counter", lambda: clock[0])
    pairs = [(0.0, "fp32"), (0.3, "fp32")]
    times = quick_eval.time_interleaved(_SlowRuntime(pairs, ms, clock), {}, seconds=1.0)
    assert all(len(v) == rounds for v in times.values())
    assert all(t == pytest.approx(ms) for v in times.values() for t in v)


def test_median_spread():
    assert quick_eval.median_spread([5.0]) == float("inf")
    assert quick_eval.median_spread([4.0] * 10) == 0.0
    wide = quick_eval.median_spread([1.0, 10.0, 2.0, 9.0, 5.0])
    assert wide > quick_eval.median_spread([4.9, 5.1, 5.0, 5.0, 4.95])
    assert quick_eval.median_spread([10.0 + (i % 3) * 0.01 for i in range(25)]) < quick_eval.SPEED_PRECISION


def _legacy(entry: dict) -> dict:
    """A quick_eval entry as the main job wrote it before the rename: the overlap called recall@10,
    no bands, sample counts or machine, a plain repeat count."""
    rows = [{("recall@10" if k == quick_eval.OVERLAP else k): v for k, v in r.items() if k != "ci95"}
            for r in entry["rows"]]
    speed = {k: v for k, v in entry["speed"].items() if k not in ("machine", "schedule", "seconds")}
    return {"heldout": entry["heldout"], "metric": entry["metric"], "speed": {**speed, "repeats": 3},
            "seconds": entry["seconds"], "rows": rows}


def test_entry_written_before_the_rename_still_reads(text_art, tmp_path):
    import shutil

    from elastic_export.cli.job import budget_rows
    from elastic_export.core.manifest import Manifest
    from elastic_export.report.page import render_report

    out, m, _ = text_art
    old = tmp_path / "old"
    shutil.copytree(out, old)
    raw = json.loads((old / MANIFEST).read_text())
    raw[quick_eval.ENTRY] = _legacy(quick_eval.entry_of(Manifest.load(out)))
    (old / MANIFEST).write_text(json.dumps(raw))
    manifest = Manifest.load(old)
    qe = quick_eval.entry_of(manifest)
    want = [r[quick_eval.OVERLAP] for r in quick_eval.entry_of(m)["rows"]]
    assert [r[quick_eval.OVERLAP] for r in qe["rows"]] == want and not any("recall@10" in r for r in qe["rows"])
    assert qe["samples"] == {"fidelity_cosine": quick_eval.HELDOUT, quick_eval.OVERLAP: quick_eval.HELDOUT}
    res = quick_eval.results_of(manifest, "old-dir").eval_view()
    assert res["results"][0]["dir"] == "old-dir"
    assert "3 runs" in budget_rows(manifest)[-1] and "interleaved" not in budget_rows(manifest)[-1]
    page = render_report(old)
    assert "neighbour overlap@10 (vs dense)" in page and "Machine: not recorded" in page
    assert "could not be drawn" not in page


def test_main_job_records_quality_and_speed_of_every_pair(text_art):
    out, m, said = text_art
    qe = m.quick_eval
    assert qe == json.loads((out / MANIFEST).read_text())[quick_eval.ENTRY]
    assert qe["format"] == "elastic-export-results/1" and qe["kind"] == "quick_eval"  # the one results schema
    assert {(r["batch"], r["sparsity"], r["precision"]) for r in qe["records"]} == {
        (b, s, p) for b in (None, 1, 8) for p in ("fp32", "int8") for s in (0.0, *BUDGETS)}
    qe = quick_eval.entry_of(m)
    assert any(s.startswith("quick eval: 6 (budget, precision) pairs") for s in said)
    assert qe["metric"] == "fidelity_cosine" and qe["speed"]["batches"] == [1, 8]
    assert qe["heldout"]["samples"] == quick_eval.HELDOUT and "8 spread evenly" in qe["heldout"]["excluded"]
    pairs = [(r["sparsity"], r["precision"]) for r in qe["rows"]]
    assert pairs == [(s, p) for p in ("fp32", "int8") for s in (0.0, *BUDGETS)]
    gflops = {0.0: m.dense.gflops, **{b.sparsity: b.gflops for b in m.budgets}}
    for r in qe["rows"]:
        assert r["gflops"] == gflops[r["sparsity"]]
        assert -1.0 <= r["fidelity_cosine"] <= 1.0 + 1e-6 and 0.0 <= r[quick_eval.OVERLAP] <= 1.0
        assert "recall@10" not in r  # the overlap is not retrieval recall, and is not called so
        for metric in ("fidelity_cosine", quick_eval.OVERLAP):  # the band holds the figure
            lo, hi = r["ci95"][metric]
            assert lo - 1e-9 <= r[metric] <= hi + 1e-9
        assert set(r["speed"]) == {"1", "8"}
        for b, st in r["speed"].items():
            assert 0 < st["p50_ms"] <= st["p90_ms"] <= st["p99_ms"]
            assert st["throughput"] == pytest.approx(int(b) / (st["p50_ms"] / 1e3))
    dense = qe["rows"][0]
    assert dense["fidelity_cosine"] == pytest.approx(1.0) and dense[quick_eval.OVERLAP] == 1.0
    assert qe["samples"] == {"fidelity_cosine": quick_eval.HELDOUT, quick_eval.OVERLAP: quick_eval.HELDOUT}
    speed = qe["speed"]
    assert set(speed["repeats"]) == {"1", "8"} and speed["schedule"] == "interleaved rounds"
    assert all(quick_eval.MIN_ROUNDS <= n <= quick_eval.MAX_ROUNDS for n in speed["repeats"].values())
    assert speed["machine"]["logical_cpus"] >= 1 and speed["machine"]["onnxruntime"] and speed["machine"]["cpu"]
    assert qe["rows"][2]["fidelity_cosine"] < 1.0 - 1e-4  # the sparsest fp32 budget differs from dense
    assert all(math.isfinite(r["fidelity_cosine"]) for r in qe["rows"])


def test_latency_profile_carries_quality_and_frontier(text_art):
    from elastic_export.serving.runtime import ElasticRuntime, LatencyTargetPolicy, load_profile

    out, m, _ = text_art
    prof = load_profile(out)
    assert prof.quality_metric == "fidelity_cosine" and prof.measured_precisions() == ["fp32", "int8"]
    for r in quick_eval.entry_of(m)["rows"]:
        assert prof.quality_of(r["sparsity"], r["precision"]) == pytest.approx(r["fidelity_cosine"])
        assert prof.latency(8, r["sparsity"], "p90_ms", r["precision"]) == pytest.approx(r["speed"]["8"]["p90_ms"])
    assert prof.frontier["metric"] == "fidelity_cosine" and set(prof.frontier["batches"]) == {"1", "8"}
    for b, front in prof.frontier["batches"].items():
        lat = [prof.latency(int(b), s, "p90_ms", p) for s, p in front]
        qual = [prof.quality_of(s, p) for s, p in front]
        assert lat == sorted(lat) and qual == sorted(qual)
        assert front[-1] == [0.0, "fp32"]  # the best pair ends every frontier
    # the runtime's policy picks by those figures with no separate eval run
    rt = ElasticRuntime.from_dir(out, precisions="all")
    rt.set_policy(LatencyTargetPolicy(prof, target_ms=1e9))
    assert rt.choose_pair(1) == (0.0, "fp32")
    p90 = {pair: prof.latency(1, pair[0], "p90_ms", pair[1]) for pair in rt.pairs}
    target = sorted(p90.values())[len(p90) // 2]
    rt.set_policy(LatencyTargetPolicy(prof, target_ms=target))
    meeting = [pair for pair in rt.pairs if p90[pair] <= target]
    assert rt.choose_pair(1) == max(meeting, key=lambda pair: prof.quality_of(*pair))


def test_image_model_quick_eval(tmp_path):
    m = pipeline.run(pipeline.Options(model="vit_tiny_patch16_224", pretrained=False, image_size=32, budgets=(0.5,),
                                      out=str(tmp_path / "vit"), method="magnitude", calib_size=8, verify=False,
                                      elastic_graph=False, report=False), **QUIET)
    rows = quick_eval.entry_of(m)["rows"]
    assert [(r["sparsity"], r["precision"]) for r in rows] == [(0.0, "fp32"), (0.5, "fp32")]
    assert rows[0]["fidelity_cosine"] == pytest.approx(1.0) and quick_eval.OVERLAP not in rows[0]
    assert "synthetic" in quick_eval.entry_of(m)["heldout"]["source"]


def test_no_quick_eval_flag_and_failure_only_warns(bert_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "plain"
    with pytest.raises(SystemExit) as e:
        main(["--model", str(bert_dir), "--budgets", "0.5", "--method", "magnitude", "--seq-len", "16",
              "--no-verify", "--no-elastic-graph", "--no-report", "--no-quick-eval", "--out", str(out)])
    assert e.value.code == 0
    assert quick_eval.ENTRY not in json.loads((out / MANIFEST).read_text())
    assert not (out / "latency_profile.json").exists()

    def broken(*args, **kw):
        raise RuntimeError("timer exploded")

    monkeypatch.setattr(quick_eval, "run_quick_eval", broken)
    said: list[str] = []
    m = pipeline.run(pipeline.Options(model=str(bert_dir), budgets=(0.5,), out=str(tmp_path / "warned"), seq_len=16,
                                      method="magnitude", verify=False, elastic_graph=False, report=False),
                     echo=said.append)
    assert m.quick_eval is None and (tmp_path / "warned" / "budget_s050.onnx").is_file()
    assert any("quick eval skipped" in s and "timer exploded" in s for s in said)


def test_terminal_table_shows_quality_and_p50_per_pair(bert_dir, tmp_path, capsys):
    out = tmp_path / "cli"
    with pytest.raises(SystemExit) as e:
        main(["--model", str(bert_dir), "--budgets", "0.3,0.6", "--method", "magnitude", "--seq-len", "16",
              "--precision", "fp32,int8", "--no-verify", "--no-elastic-graph", "--no-report", "--out", str(out)])
    assert e.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    top = next(i for i, line in enumerate(lines) if line.startswith("budget "))
    assert lines[top].split() == ["budget", "precision", "achieved", "GFLOPs", "params", "max", "err", "file",
                                  "fidelity", "overlap@10", "p50", "ms", "b1", "p50", "ms", "b8"]
    rows = [line.split() for line in lines[top + 1:top + 7]]
    assert [(r[0], r[1]) for r in rows] == [(b, p) for p in ("fp32", "int8") for b in ("dense", "0.30", "0.60")]
    from elastic_export.core.manifest import Manifest

    qe = quick_eval.entry_of(Manifest.load(out))
    for cells, r in zip(rows, qe["rows"]):  # the manifest's figures, rounded as printed
        assert cells[-4:] == [f"{r['fidelity_cosine']:.4f}", f"{r[quick_eval.OVERLAP]:.3f}",
                              f"{r['speed']['1']['p50_ms']:.1f}", f"{r['speed']['8']['p50_ms']:.1f}"]
    assert rows[3][6] == "dense.int8.onnx" and rows[3][5] == "-"  # the int8 file, no fp32 error on it
    legend = lines[top + 7:top + 9]
    assert "neighbour overlap@10 (vs dense)" in legend[0] and "not retrieval recall" in legend[0]
    assert "interleaved runs" in legend[1] and "p50" in legend[1]
