"""``elastic-export bench DIR``: JSON with every budget x batch, PNG plots, the latency profile in its
exact format, and one-line exit-2 errors for bad input. Real onnxruntime sessions on a tiny BERT;
wall-clock values are only checked for ordering and positivity."""

from __future__ import annotations

import json
import math

import onnxruntime as ort
import pytest
from conftest import tiny_encoder

from elastic_export.core import results

PNG = b"\x89PNG\r\n\x1a\n"
BUDGETS = (0.2, 0.5)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """A tiny HF BERT exported at two budgets and two precisions (magnitude ranking, 16 tokens), with the
    main job's quick eval (its quality figures go into the latency profile)."""
    from elastic_export import pipeline

    root = tmp_path_factory.mktemp("bench")
    model = root / "tiny-bert"
    tiny_encoder("hf-bert").module.save_pretrained(model)
    out = root / "art"
    pipeline.run(pipeline.Options(model=str(model), budgets=BUDGETS, out=str(out), seq_len=16, method="magnitude",
                                  verify=False, elastic_graph=False, precision="fp32,int8", calib_size=8),
                 echo=lambda s: None)
    return out


def cli(args: list[str], capsys) -> tuple[int, str, str]:
    """Run the console entry point in-process: (exit code, stdout, stderr)."""
    from elastic_export.cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(args)
    captured = capsys.readouterr()
    return exit_.value.code, captured.out, captured.err


def test_bench_writes_json_plots_and_profile(artifacts, tmp_path, capsys):
    out = tmp_path / "res" / "tiny.json"
    code, stdout, err = cli(["bench", str(artifacts), "--batches", "1,3", "--repeats", "5", "--warmup", "1",
                             "--threads", "1", "--out", str(out)], capsys)
    assert code == 0, err
    result = results.load(out).bench_view()
    sparsities = [0.0, *BUDGETS]
    assert sorted((r["batch"], r["sparsity"], r["precision"]) for r in result["rows"]) == sorted(
        (b, s, p) for b in (1, 3) for s in sparsities for p in ("fp32", "int8"))  # every precision present
    assert result["backend"] == "onnxruntime" and result["provider"] == "cpu"
    for r in result["rows"]:
        for key in ("gflops", "flop_ratio", "p50_ms", "p90_ms", "p99_ms", "throughput", "speedup", "switch_ms"):
            assert math.isfinite(r[key]) and r[key] > 0, (key, r)
        assert math.isfinite(r["switch_overhead_ms"])
        assert r["min_ms"] <= r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"] <= r["max_ms"]
        assert r["throughput"] == pytest.approx(r["batch"] / (r["p50_ms"] / 1e3))
        if r["sparsity"] == 0.0 and r["precision"] == "fp32":
            assert r["speedup"] == pytest.approx(1.0) and r["flop_ratio"] == pytest.approx(1.0)
        elif r["sparsity"] > 0:
            assert r["flop_ratio"] > 1.0
    for kind in ("throughput", "latency", "speedup"):
        png = out.with_name(f"tiny_{kind}.png")
        assert png.read_bytes()[:8] == PNG
    # the table: one line per (batch, budget, precision) plus the header
    assert sum(1 for line in stdout.splitlines() if line.strip().startswith(("1 ", "3 "))) == 12

    profile = json.loads((artifacts / "latency_profile.json").read_text())
    assert set(profile) == {"backend", "provider", "batches", "precisions", "quality", "frontier"}
    assert profile["backend"] == "onnxruntime" and profile["provider"] == "cpu"
    assert set(profile["batches"]) == {"1", "3"}
    for batch, table in profile["batches"].items():
        assert set(table) == {str(float(s)) for s in sparsities} == {"0.0", "0.2", "0.5"}
        for s, entry in table.items():
            assert set(entry) == {"p50_ms", "p90_ms", "p99_ms", "throughput"}
            assert 0 < entry["p50_ms"] <= entry["p90_ms"] <= entry["p99_ms"] and entry["throughput"] > 0
            row = next(r for r in result["rows"] if r["batch"] == int(batch) and str(float(r["sparsity"])) == s
                       and r["precision"] == "fp32")
            assert entry["p50_ms"] == row["p50_ms"]
    assert set(profile["precisions"]) == {"int8"} and set(profile["precisions"]["int8"]) == {"1", "3"}
    # the quick eval's quality figures are kept; the frontier is over them and the measured p90
    manifest = json.loads((artifacts / "manifest.json").read_text())
    assert profile["quality"]["metric"] == manifest["quick_eval"]["settings"]["metric"] == "fidelity_cosine"
    assert profile["quality"]["values"]["fp32"]["0.0"] == pytest.approx(1.0)
    assert profile["frontier"]["metric"] == "fidelity_cosine" and profile["frontier"]["stat"] == "p90_ms"
    for batch, front in profile["frontier"]["batches"].items():
        table = {("fp32", s): v for s, v in profile["batches"][batch].items()}
        table.update({("int8", s): v for s, v in profile["precisions"]["int8"][batch].items()})
        lat = [table[(p, str(float(s)))]["p90_ms"] for s, p in front]
        qual = [profile["quality"]["values"][p][str(float(s))] for s, p in front]
        assert lat == sorted(lat) and qual == sorted(qual) and front  # fastest first, quality rising
    # the runtime's latency-target policy reads it
    from elastic_export.serving.runtime import load_profile

    loaded = load_profile(artifacts)
    assert loaded.latency(3, 0.5, "p90_ms") == profile["batches"]["3"]["0.5"]["p90_ms"]


def test_bench_default_out_and_no_plot(artifacts, capsys):
    (artifacts / "latency_profile.json").unlink(missing_ok=True)
    code, _, err = cli(["bench", str(artifacts), "--batches", "2", "--repeats", "2", "--warmup", "0",
                        "--threads", "1", "--no-plot", "--no-profile", "--precision", "int8"], capsys)
    assert code == 0, err
    raw = json.loads((artifacts / "bench.json").read_text())
    assert raw["format"] == results.FORMAT and raw["kind"] == "bench"  # the one results schema
    result = results.load(artifacts / "bench.json").bench_view()
    assert {r["batch"] for r in result["rows"]} == {2} and len(result["rows"]) == 1 + len(BUDGETS)
    assert {r["precision"] for r in result["rows"]} == {"int8"} and result["rows"][0]["speedup"] == pytest.approx(1.0)
    assert not list(artifacts.glob("bench_*.png")) and not (artifacts / "latency_profile.json").exists()


@pytest.mark.parametrize("args, words", [
    (["--batches", "0"], "--batches"),
    (["--batches", "1,x"], "--batches"),
    (["--repeats", "0"], "--repeats"),
    (["--provider", "cuda"], "cuda"),
    (["--provider", "gpu"], "--provider"),
    (["--backend", "tensorrt"], "tensorrt"),
    (["--backend", "openvino"], "--backend"),
    (["--precision", "int4"], "--precision"),
    (["--precision", "fp16"], "fp16"),  # not exported with fp16
])
def test_bench_bad_input_exits_2_with_one_line(artifacts, capsys, args, words):
    if args == ["--provider", "cuda"] and "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA provider")
    code, stdout, err = cli(["bench", str(artifacts), "--repeats", "1", "--warmup", "0", "--no-plot",
                             "--no-profile", "--out", str(artifacts / "never.json"), *args], capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("error:") and words in err, err
    assert "Traceback" not in err and not (artifacts / "never.json").exists()


def test_bench_missing_dir_exits_2(tmp_path, capsys):
    code, _, err = cli(["bench", str(tmp_path / "nope")], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "nope" in err
    (tmp_path / "empty").mkdir()
    code, _, err = cli(["bench", str(tmp_path / "empty")], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "manifest.json" in err
