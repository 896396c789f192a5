"""TensorRT target (``elastic_export.targets.tensorrt``) and ``elastic-export build``.

CPU parts run everywhere: optimisation profiles from manifests, the FP16 feature checks (against
small stand-in objects that have or lack the attributes), engine names and sources, the manifest
update, the CLI's refusal without TensorRT, and importing the module without torch. Building and
running real engines needs TensorRT and a CUDA GPU and is skipped, with that reason, without them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from elastic_export.core.errors import UserError
from elastic_export.core.manifest import FORMAT, Manifest, load_manifest
from elastic_export.targets import tensorrt as T

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
GPU_REASON = "needs TensorRT and a CUDA GPU"


# --- stand-in artifact directories (no export needed) ---------------------------------------------
def _text_manifest() -> dict:
    return {
        "format": FORMAT, "model": {"source": "x", "architecture": "bert", "fingerprint": "f"},
        "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"]},
                   {"name": "attention_mask", "dtype": "int64", "shape": ["batch", "sequence"]}],
        "outputs": [{"name": "last_hidden_state", "dtype": "float32", "shape": ["batch", "sequence", 32]}],
        "tokens": 64, "precisions": ["fp32"],
        "dense": {"onnx": "dense.onnx", "onnx_fp16": None},
        "budgets": [{"sparsity": 0.1, "onnx": "budget_s010.onnx", "onnx_fp16": None, "engine": None,
                     "heads_per_layer": [4], "neurons_per_layer": [64]},
                    {"sparsity": 0.5, "onnx": "budget_s050.onnx", "onnx_fp16": None, "engine": None,
                     "heads_per_layer": [2], "neurons_per_layer": [32]}],
        "elastic": None, "ranking": {"file": "ranking.safetensors", "method": "random"},
    }


def _vision_manifest(symbolic: bool = False) -> dict:
    m = _text_manifest()
    m["inputs"] = [{"name": "pixel_values", "dtype": "float32",
                    "shape": ["batch", 3, "height", "width"] if symbolic else ["batch", 3, 224, 224]}]
    m["preprocess"] = {"input_size": [3, 224, 224]}
    m["tokens"] = 197
    return m


def _fake_dir(root: Path, manifest: dict | None = None, fp16: bool = False) -> Path:
    m = manifest or _text_manifest()
    root.mkdir(parents=True, exist_ok=True)
    for entry in [m["dense"], *m["budgets"]]:
        (root / entry["onnx"]).write_bytes(b"not really onnx")
        if fp16:
            entry["onnx_fp16"] = entry["onnx"][:-5] + ".fp16.onnx"
            (root / entry["onnx_fp16"]).write_bytes(b"not really onnx either")
    (root / "manifest.json").write_text(json.dumps(m, indent=2) + "\n")
    return root


def _snapshot(d: Path) -> dict[str, tuple[str, int]]:
    return {str(p.relative_to(d)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(d.rglob("*")) if p.is_file()}


# --- profiles -------------------------------------------------------------------------------------
def test_profile_text_defaults_from_manifest_tokens():
    p = T.compute_profile(Manifest.from_dict(_text_manifest()), min_batch=1, opt_batch=8, max_batch=32)
    assert p.shapes == {"input_ids": ((1, 1), (8, 64), (32, 64)), "attention_mask": ((1, 1), (8, 64), (32, 64))}
    j = p.to_json()
    assert j["input_ids"] == {"min": [1, 1], "opt": [8, 64], "max": [32, 64]}
    json.dumps(j)


def test_profile_text_custom_tokens():
    p = T.compute_profile(Manifest.from_dict(_text_manifest()), min_batch=2, opt_batch=4, max_batch=4, min_tokens=8,
                          opt_tokens=16, max_tokens=128)
    assert p.shapes["attention_mask"] == ((2, 8), (4, 16), (4, 128))


def test_profile_vision_fixed_and_symbolic_size():
    for symbolic in (False, True):
        p = T.compute_profile(Manifest.from_dict(_vision_manifest(symbolic)), min_batch=1, opt_batch=128, max_batch=128)
        assert p.shapes == {"pixel_values": ((1, 3, 224, 224), (128, 3, 224, 224), (128, 3, 224, 224))}


@pytest.mark.parametrize("kw", [dict(min_batch=4, opt_batch=2, max_batch=8), dict(min_batch=0),
                                dict(max_batch=8, opt_batch=16), dict(min_tokens=32, opt_tokens=16)])
def test_profile_bad_ranges_refused(kw):
    with pytest.raises(UserError, match="min"):
        T.compute_profile(Manifest.from_dict(_text_manifest()), **kw)


def test_profile_unresolvable_dim_refused():
    m = _vision_manifest(symbolic=True)
    del m["preprocess"]
    with pytest.raises(UserError, match="image size"):
        T.compute_profile(Manifest.from_dict(m))


# --- FP16 feature checks (our decision logic, on stand-in modules) ---------------------------------
TRT10 = SimpleNamespace(BuilderFlag=SimpleNamespace(FP16=0, TF32=1),
                        NetworkDefinitionCreationFlag=SimpleNamespace(EXPLICIT_BATCH=0, STRONGLY_TYPED=1))
TRT11 = SimpleNamespace(BuilderFlag=SimpleNamespace(TF32=1),
                        NetworkDefinitionCreationFlag=SimpleNamespace(STRONGLY_TYPED=1))
NEITHER = SimpleNamespace(BuilderFlag=SimpleNamespace(), NetworkDefinitionCreationFlag=SimpleNamespace())


def test_fp16_mode_builder_flag_where_present():
    assert T.fp16_mode(TRT10, have_fp16_onnx=False) == T.BUILDER_FLAG
    assert T.fp16_mode(TRT10, have_fp16_onnx=True) == T.BUILDER_FLAG


def test_fp16_mode_strongly_typed_without_flag():
    assert T.fp16_mode(TRT11, have_fp16_onnx=True) == T.STRONGLY_TYPED
    with pytest.raises(UserError, match="--precision fp16"):
        T.fp16_mode(TRT11, have_fp16_onnx=False)
    with pytest.raises(UserError, match="neither"):
        T.fp16_mode(NEITHER, have_fp16_onnx=True)
    with pytest.raises(UserError, match="neither"):
        T.fp16_mode(SimpleNamespace(), have_fp16_onnx=True)


class _Config:
    def __init__(self, reject: bool = False) -> None:
        self.flags: list = []
        self.reject = reject

    def set_flag(self, flag) -> None:
        if self.reject:
            raise TypeError("deprecated flag")
        self.flags.append(flag)


def test_int8_mode_feature_checks():
    """int8 engines come from the QDQ files: BuilderFlag.INT8 where it exists (10), else strongly typed (11)."""
    trt10 = SimpleNamespace(BuilderFlag=SimpleNamespace(FP16=0, INT8=2, TF32=1),
                            NetworkDefinitionCreationFlag=SimpleNamespace(EXPLICIT_BATCH=0, STRONGLY_TYPED=1))
    assert T.int8_mode(trt10) == T.BUILDER_FLAG
    assert T.int8_mode(TRT11) == T.STRONGLY_TYPED
    with pytest.raises(UserError, match="neither BuilderFlag.INT8"):
        T.int8_mode(NEITHER)


def test_int8_jobs_use_the_qdq_files(tmp_path):
    d = _fake_dir(tmp_path / "a")
    m = Manifest.load(d)
    for entry in [m.dense, *m.budgets]:
        entry.onnx_int8_qdq = entry.onnx[:-5] + ".int8-qdq.onnx"
        (d / entry.onnx_int8_qdq).write_bytes(b"not really onnx")
    jobs = T.plan_jobs(d, m, key=T.SOURCE_KEYS["int8"])
    assert [(j.onnx, j.engine) for j in jobs] == [("dense.int8-qdq.onnx", "dense.engine"),
                                                 ("budget_s010.int8-qdq.onnx", "budget_s010.engine"),
                                                 ("budget_s050.int8-qdq.onnx", "budget_s050.engine")]
    assert T.engine_name("budget_s010.int8-qdq.onnx") == "budget_s010.engine"


def test_try_set_flag():
    c = _Config()
    assert T.try_set_flag(c, TRT10.BuilderFlag, "FP16") and c.flags == [0]
    assert not T.try_set_flag(c, TRT11.BuilderFlag, "FP16") and c.flags == [0]
    assert not T.try_set_flag(c, None, "FP16")
    assert not T.try_set_flag(_Config(reject=True), TRT10.BuilderFlag, "FP16")


def test_try_clear_flag():
    class Cfg(_Config):
        def clear_flag(self, flag) -> None:
            self.flags.remove(flag)

    c = Cfg()
    c.flags = [1]
    assert T.try_clear_flag(c, TRT11.BuilderFlag, "TF32") and c.flags == []
    assert not T.try_clear_flag(c, TRT11.BuilderFlag, "FP16")
    assert not T.try_clear_flag(_Config(), TRT11.BuilderFlag, "TF32")  # a config without clear_flag
    assert not T.try_clear_flag(c, TRT11.BuilderFlag, "TF32")  # clearing an unset flag raises: False


class _Tensor(SimpleNamespace):
    pass


class _Layer:
    """A layer of a stand-in network: type, per-layer precision and output types (TensorRT 10 API)."""

    def __init__(self, kind: str, out_dtypes: list[str], norm: bool = False) -> None:
        self.type, self.precision = kind, "unset"
        self.outputs = [_Tensor(dtype=d) for d in out_dtypes]
        self.set_types: dict[int, str] = {}
        if norm:
            self.compute_precision = "unset"

    @property
    def num_outputs(self) -> int:
        return len(self.outputs)

    def get_output(self, j: int) -> _Tensor:
        return self.outputs[j]

    def set_output_type(self, j: int, dtype: str) -> None:
        self.set_types[j] = dtype


def _network(layers: list) -> SimpleNamespace:
    return SimpleNamespace(num_layers=len(layers), get_layer=lambda i: layers[i])


TRT10_LAYERS = SimpleNamespace(
    BuilderFlag=SimpleNamespace(FP16=0, TF32=1, PREFER_PRECISION_CONSTRAINTS=2, OBEY_PRECISION_CONSTRAINTS=3),
    LayerType=SimpleNamespace(NORMALIZATION="norm", SOFTMAX="softmax", REDUCE="reduce", MATRIX_MULTIPLY="mm"),
    float32="f32", float16="f16", int64="i64")


def test_pin_fp32_layers_builder_flag_path():
    norm = _Layer("norm", ["f32"], norm=True)
    soft, mm = _Layer("softmax", ["f32"]), _Layer("mm", ["f32"])
    count = _Layer("reduce", ["i64"])  # an integer reduction keeps its output type
    cfg = _Config()
    assert T.pin_fp32_layers(TRT10_LAYERS, _network([norm, mm, soft, count]), cfg) == 3
    assert cfg.flags == [2]  # PREFER_PRECISION_CONSTRAINTS
    assert norm.precision == norm.compute_precision == "f32" and norm.set_types == {0: "f32"}
    assert soft.precision == "f32" and soft.set_types == {0: "f32"}
    assert mm.precision == "unset" and mm.set_types == {}
    assert count.precision == "f32" and count.set_types == {}


def test_pin_fp32_layers_falls_back_or_does_nothing():
    obey_only = SimpleNamespace(**{**vars(TRT10_LAYERS), "BuilderFlag": SimpleNamespace(FP16=0, OBEY_PRECISION_CONSTRAINTS=3)})
    cfg = _Config()
    assert T.pin_fp32_layers(obey_only, _network([_Layer("softmax", ["f32"])]), cfg) == 1 and cfg.flags == [3]
    # TensorRT 11: always strongly typed, no precision-constraint flags: nothing is touched
    trt11 = SimpleNamespace(**{**vars(TRT10_LAYERS), "BuilderFlag": TRT11.BuilderFlag})
    layer = _Layer("norm", ["f32"], norm=True)
    assert T.pin_fp32_layers(trt11, _network([layer]), _Config()) == 0 and layer.precision == "unset"
    assert T.pin_fp32_layers(TRT11, _network([layer]), _Config()) == 0  # no LayerType at all


def test_network_flags():
    assert T.network_flags(TRT10, strongly_typed=False) == 1 << 0
    assert T.network_flags(TRT10, strongly_typed=True) == 1 << 1
    assert T.network_flags(TRT11, strongly_typed=False) == 0
    assert T.network_flags(TRT11, strongly_typed=True) == 1 << 1


# --- jobs and the manifest update -----------------------------------------------------------------
def test_engine_names():
    assert T.engine_name("budget_s010.onnx") == "budget_s010.engine"
    assert T.engine_name("budget_s010.fp16.onnx") == "budget_s010.engine"
    assert T.engine_name("dense.onnx") == "dense.engine"


def test_plan_jobs(tmp_path):
    d = _fake_dir(tmp_path / "a", fp16=True)
    m = Manifest.load(d)
    jobs = T.plan_jobs(d, m, use_fp16_onnx=False)
    assert [(j.key, j.onnx, j.engine) for j in jobs] == [
        ("dense", "dense.onnx", "dense.engine"), (0, "budget_s010.onnx", "budget_s010.engine"),
        (1, "budget_s050.onnx", "budget_s050.engine")]
    jobs16 = T.plan_jobs(d, m, use_fp16_onnx=True, dense=False)
    assert [(j.onnx, j.engine) for j in jobs16] == [("budget_s010.fp16.onnx", "budget_s010.engine"),
                                                   ("budget_s050.fp16.onnx", "budget_s050.engine")]
    (d / "budget_s050.onnx").unlink()
    with pytest.raises(UserError, match="budget_s050.onnx is listed in the manifest but missing"):
        T.plan_jobs(d, m, use_fp16_onnx=False)
    d2 = _fake_dir(tmp_path / "b")
    with pytest.raises(UserError, match="onnx_fp16"):
        T.plan_jobs(d2, Manifest.load(d2), use_fp16_onnx=True)


def test_record_engines_writes_manifest_atomically(tmp_path):
    d = _fake_dir(tmp_path / "a")
    m = Manifest.load(d)
    for name in ("dense.engine", "budget_s010.engine", "budget_s050.engine"):
        (d / name).write_bytes(b"plan")
    info = {"version": "10.x", "precision": "fp16", "fp16_mode": T.BUILDER_FLAG,
            "profiles": [T.compute_profile(m).to_json()], "timing_cache": T.TIMING_CACHE}
    T.record_engines(d, m, {"dense": "dense.engine", 0: "budget_s010.engine", 1: "budget_s050.engine"}, info)
    again = Manifest.load(d)  # passes the manifest's own checks (engine paths inside the directory)
    assert again.dense.engine == "dense.engine"
    assert [b.engine for b in again.budgets] == ["budget_s010.engine", "budget_s050.engine"]
    assert again.tensorrt["precision"] == "fp16"
    assert again.tensorrt["profiles"][0]["input_ids"]["max"] == [128, 64]
    assert not [p for p in d.iterdir() if p.name.endswith(".tmp")]
    # a partial rebuild drops engines it did not build (they would not match ``tensorrt`` any more)
    T.record_engines(d, again, {0: "budget_s010.engine"}, info)
    assert [b["engine"] for b in load_manifest(d)["budgets"]] == ["budget_s010.engine", None]


def test_record_engines_refuses_missing_or_escaping(tmp_path):
    d = _fake_dir(tmp_path / "a")
    before = _snapshot(d)
    m = Manifest.load(d)
    with pytest.raises(UserError, match="not written"):
        T.record_engines(d, m, {0: "budget_s010.engine"}, {})
    with pytest.raises(UserError, match="leaves the artifact directory"):
        T.record_engines(d, m, {0: "../elsewhere.engine"}, {})
    (d / "x.engine").write_bytes(b"plan")
    with pytest.raises(UserError, match="no budget"):
        T.record_engines(d, m, {7: "x.engine"}, {})
    (d / "x.engine").unlink()
    assert _snapshot(d) == before


def test_build_engines_checks_input_before_tensorrt(tmp_path):
    d = _fake_dir(tmp_path / "a")
    before = _snapshot(d)
    with pytest.raises(UserError, match="min <= opt <= max"):
        T.build_engines(d, min_batch=8, opt_batch=4, max_batch=16)
    with pytest.raises(UserError, match="fp32, fp16 or int8"):
        T.build_engines(d, precision="int4")
    with pytest.raises(UserError, match="no 'onnx_int8_qdq' file.*--precision int8-qdq"):
        T.build_engines(d, precision="int8")  # the directory has no QDQ files: refused before TensorRT
    with pytest.raises(UserError, match="no such directory"):
        T.build_engines(tmp_path / "nope")
    with pytest.raises(UserError, match="--opt-level must be 0..5"):
        T.build_engines(d, opt_level=7)
    assert _snapshot(d) == before


# --- the build config (validated without TensorRT; applied to stand-in builder configs) -----------
def test_build_config_defaults_match_the_cli():
    c = T.BuildConfig()
    assert (c.precision, c.min_batch, c.opt_batch, c.max_batch, c.workspace_gb) == ("fp32", 1, 32, 128, 4.0)
    assert c.workspace_bytes == 4 << 30 and T.BuildConfig(workspace_gb=None).workspace_bytes is None
    assert c.dense and c.fp32_norms and not c.tf32 and c.opt_level is None and c.timing_cache is None
    with pytest.raises(AttributeError):
        c.precision = "fp16"  # frozen: checked once, when made


@pytest.mark.parametrize("kw,needle", [
    (dict(precision="int4"), "--precision int4: choose fp32, fp16 or int8"),
    (dict(workspace_gb=0), "--workspace-gb must be positive, got 0"),
    (dict(workspace_gb=-1.5), "--workspace-gb must be positive"),
    (dict(opt_level=6), "--opt-level must be 0..5, got 6"),
    (dict(opt_level=-1), "--opt-level must be 0..5"),
    (dict(opt_level=True), "--opt-level must be 0..5, got True"),
])
def test_build_config_refuses_bad_options(kw, needle):
    with pytest.raises(UserError, match=re.escape(needle)):
        T.BuildConfig(**kw)


def test_build_config_profile_and_timing_cache(tmp_path):
    m = Manifest.from_dict(_text_manifest())
    p = T.BuildConfig(opt_batch=8, max_batch=16, max_tokens=32).profile(m)
    assert p.shapes["input_ids"] == ((1, 1), (8, 32), (16, 32))
    with pytest.raises(UserError, match="min <= opt <= max"):
        T.BuildConfig(min_batch=8, opt_batch=4).profile(m)  # ranges need the manifest: checked here
    assert T.BuildConfig().cache_path(tmp_path) == tmp_path / T.TIMING_CACHE
    assert T.BuildConfig(timing_cache=tmp_path / "c.bin").cache_path(tmp_path) == tmp_path / "c.bin"
    (tmp_path / "dir.cache").mkdir()
    with pytest.raises(UserError, match="--timing-cache .*: not a file"):
        T.BuildConfig(timing_cache=tmp_path / "dir.cache").cache_path(tmp_path)


class _BuilderConfig(_Config):
    """A stand-in IBuilderConfig: flags, workspace pool and optimisation level."""

    def __init__(self, reject: bool = False) -> None:
        super().__init__(reject)
        self.pools: dict = {}
        self.builder_optimization_level = 3

    def clear_flag(self, flag) -> None:
        self.flags = [f for f in self.flags if f != flag]

    def set_memory_pool_limit(self, pool, size: int) -> None:
        self.pools[pool] = size


def _apply(trt, mode, reject=False, **kw):
    cfg = _BuilderConfig(reject)
    builder = SimpleNamespace(create_builder_config=lambda: cfg)
    layers = [_Layer("norm", ["f32"], norm=True), _Layer("mm", ["f32"])]
    out, tf32, pinned = T.BuildConfig(**kw).create_builder_config(trt, builder, _network(layers), mode)
    assert out is cfg
    return cfg, tf32, pinned


def test_build_config_create_builder_config_feature_checks():
    trt10 = SimpleNamespace(**{**vars(TRT10_LAYERS), "MemoryPoolType": SimpleNamespace(WORKSPACE="ws"),
                               "BuilderFlag": SimpleNamespace(**{**vars(TRT10_LAYERS.BuilderFlag), "INT8": 4})})
    cfg, tf32, pinned = _apply(trt10, None, workspace_gb=1, opt_level=1)  # fp32: TF32 off, nothing pinned
    assert cfg.pools == {"ws": 1 << 30} and cfg.builder_optimization_level == 1 and cfg.flags == []
    assert tf32 is True and pinned is None  # this TensorRT has a TF32 flag (cleared here)
    no_tf32 = SimpleNamespace(**{**vars(trt10), "BuilderFlag": SimpleNamespace(FP16=0)})
    assert _apply(no_tf32, None, tf32=True)[1] is False  # no such flag: the manifest will say tf32 false
    cfg, tf32, pinned = _apply(trt10, None, tf32=True, workspace_gb=None)
    assert cfg.flags == [1] and tf32 and cfg.pools == {} and cfg.builder_optimization_level == 3
    cfg, _, pinned = _apply(trt10, T.BUILDER_FLAG, precision="fp16")  # TensorRT 10 fp16: flag + fp32 norms
    assert cfg.flags == [0, 2] and pinned == 1
    assert _apply(trt10, T.BUILDER_FLAG, precision="fp16", fp32_norms=False)[0].flags == [0]
    assert _apply(trt10, T.BUILDER_FLAG, precision="int8")[0].flags == [4]
    cfg, _, pinned = _apply(TRT11, T.STRONGLY_TYPED, precision="fp16")  # TensorRT 11: the types say it all
    assert cfg.flags == [] and pinned is None
    with pytest.raises(UserError, match="rejected BuilderFlag.INT8"):
        _apply(trt10, T.BUILDER_FLAG, reject=True, precision="int8", tf32=True)
    with pytest.raises(UserError, match="rejected BuilderFlag.FP16.*--precision fp16"):
        _apply(trt10, T.BUILDER_FLAG, reject=True, precision="fp16", tf32=True)


def test_precision_mode_picks_the_files():
    m = Manifest.from_dict(_text_manifest())
    assert T.precision_mode(TRT10, "fp32", m) == (None, None)
    assert T.precision_mode(TRT10, "fp16", m) == (T.BUILDER_FLAG, None)  # the fp32 ONNX, built with the flag
    with pytest.raises(UserError, match="--precision fp16"):
        T.precision_mode(TRT11, "fp16", m)  # strongly typed needs the fp16 files
    for entry in [m.dense, *m.budgets]:
        entry.onnx_fp16 = "x.fp16.onnx"
    assert T.precision_mode(TRT11, "fp16", m) == (T.STRONGLY_TYPED, "onnx_fp16")
    assert T.precision_mode(TRT11, "int8", m) == (T.STRONGLY_TYPED, "onnx_int8_qdq")


def test_build_engines_takes_a_config(tmp_path):
    d = _fake_dir(tmp_path / "a")
    before = _snapshot(d)
    with pytest.raises(TypeError, match="not both"):
        T.build_engines(d, T.BuildConfig(), precision="fp16")
    with pytest.raises(UserError, match="no 'onnx_int8_qdq' file"):
        T.build_engines(d, T.BuildConfig(precision="int8"))  # files checked before TensorRT, as with keywords
    with pytest.raises(UserError, match="no such directory"):
        T.build_engines(tmp_path / "nope", T.BuildConfig())
    with pytest.raises(UserError, match="no such directory"):
        T.build_engines(tmp_path / "nope", precision="int4")  # the directory is named before a bad option
    with pytest.raises(TypeError):
        T.build_engines(d, precision_typo="fp16")
    assert _snapshot(d) == before


# --- CLI without TensorRT -------------------------------------------------------------------------
def _cli_without_tensorrt(*args: str) -> subprocess.CompletedProcess:
    code = ("import sys; sys.modules['tensorrt'] = None\n"
            "from elastic_export.cli.main import main\n"
            f"main({list(args)!r})\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)


def test_cli_build_refuses_without_tensorrt(tmp_path):
    d = _fake_dir(tmp_path / "a")
    before = _snapshot(d)
    r = _cli_without_tensorrt("build", "--target", "tensorrt", str(d), "--precision", "fp16")
    assert r.returncode == 2, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr
    assert "tensorrt is not installed" in lines[0] and 'pip install -e ".[tensorrt]"' in lines[0]
    assert "CUDA GPU" in lines[0]
    assert _snapshot(d) == before and not (d / T.TIMING_CACHE).exists()
    # the build options parse (and are refused for TensorRT's absence, not as unknown)
    r = _cli_without_tensorrt("build", "--target", "tensorrt", str(d), "--opt-level", "2", "--tf32", "--no-fp32-norms")
    assert r.returncode == 2 and "tensorrt is not installed" in r.stderr, r.stderr
    r = _cli_without_tensorrt("build", "--target", "tensorrt", str(d), "--opt-level", "9")
    assert r.returncode == 2 and "--opt-level" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_cli_build_tensorrt_subcommand_refuses_without_tensorrt(tmp_path):
    """``build tensorrt DIR`` takes the TensorRT options only and refuses as ``build --target tensorrt`` does."""
    d = _fake_dir(tmp_path / "a")
    before = _snapshot(d)
    args = ["--precision", "fp16", "--opt-level", "2", "--tf32", "--no-fp32-norms", "--workspace-gb", "2"]
    sub = _cli_without_tensorrt("build", "tensorrt", str(d), *args)
    target = _cli_without_tensorrt("build", "--target", "tensorrt", str(d), *args)
    assert sub.returncode == 2 and (sub.stdout, sub.stderr) == (target.stdout, target.stderr), sub.stderr
    lines = [x for x in sub.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "tensorrt is not installed" in lines[0] and "Traceback" not in sub.stderr
    r = _cli_without_tensorrt("build", "tensorrt", str(d), "--triton-kind", "cpu")  # not a TensorRT option
    assert r.returncode == 2 and "No such option '--triton-kind'" in r.stderr, r.stderr
    r = _cli_without_tensorrt("build", "tensorrt", str(d), "--min-batch", "8", "--opt-batch", "4")
    assert r.returncode == 2 and "min <= opt <= max" in r.stderr, r.stderr  # checked before TensorRT
    assert _snapshot(d) == before and not (d / T.TIMING_CACHE).exists()


def test_imports_and_refuses_without_torch(tmp_path):
    d = _fake_dir(tmp_path / "a")
    code = f"""
import sys
sys.modules['torch'] = None  # importing torch now raises ImportError
sys.modules['tensorrt'] = None
import elastic_export.targets.tensorrt as T
from elastic_export.core.errors import UserError
p = T.compute_profile(T.Manifest.load({str(d)!r}), max_batch=4, opt_batch=2)
assert p.shapes['input_ids'][2] == (4, 64), p
assert T._torch_present() is False
why = T.tensorrt_unavailable()
assert why and 'tensorrt is not installed' in why, why
try:
    T.build_engines({str(d)!r}, progress=False)
except UserError as e:
    assert 'tensorrt is not installed' in str(e)
else:
    raise SystemExit('no refusal')
try:
    T.load_engine('x.engine')
except UserError:
    pass
bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]
assert all(sys.modules[m] is None for m in bad), bad
print('ok')
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


# --- the skip reason CI accepts ---------------------------------------------------------------------
_BROKEN = {
    "missing": None,  # sys.modules["tensorrt"] = None: importing it raises ImportError
    "broken": "raise OSError('libnvinfer.so.10: cannot open shared object file')",
    "old-api": "class ICudaEngine: pass\nclass IExecutionContext: pass",
    "no-device": "class ICudaEngine:\n    def get_tensor_name(self): pass\n"
                 "class IExecutionContext:\n    def execute_async_v3(self): pass",
}


def _skip_reason(tmp_path: Path, case: str) -> str:
    """This module's GPU skip reason when ``tensorrt`` is as :data:`_BROKEN` says (and no CUDA device is visible)."""
    pkg = tmp_path / case
    pkg.mkdir()
    setup = "sys.modules['tensorrt'] = None"
    if _BROKEN[case] is not None:
        (pkg / "tensorrt.py").write_text(_BROKEN[case] + "\n")
        setup = f"sys.path.insert(0, {str(pkg)!r})"
    code = f"import sys\n{setup}\nfrom elastic_export.targets import tensorrt as T\nprint(T.tensorrt_unavailable())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**ENV, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr
    return f"{GPU_REASON} ({r.stdout.strip()})"


def test_ci_skip_check_fails_a_broken_tensorrt(tmp_path):
    """.ci/check_skips.py accepts this module's skip when tensorrt is not installed or no CUDA device is
    visible, and fails it when tensorrt is installed but broken (its import raises) or too old."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_skips", Path(__file__).parents[1] / ".ci" / "check_skips.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    reasons = {case: _skip_reason(tmp_path, case) for case in _BROKEN}
    assert "tensorrt is not installed" in reasons["missing"], reasons
    assert "cannot be imported (libnvinfer.so.10" in reasons["broken"], reasons
    assert "lacks the named-tensor API" in reasons["old-api"], reasons
    assert reasons["no-device"].endswith("no CUDA device is visible)"), reasons
    found = [(f"tests.test_tensorrt::{case}", "skip", why) for case, why in reasons.items()]
    assert [name for name, _, _ in check.unexpected(found)] == ["tests.test_tensorrt::broken", "tests.test_tensorrt::old-api"]


# --- GPU: real engines ----------------------------------------------------------------------------
_WHY = T.tensorrt_unavailable()
gpu = pytest.mark.skipif(_WHY is not None, reason=f"{GPU_REASON} ({_WHY})")


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    import torch
    from transformers import BertConfig, BertModel

    from elastic_export.pipeline import Options, run

    root = tmp_path_factory.mktemp("trt")
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=72)
    BertModel(cfg).save_pretrained(str(root / "bert"))
    out = root / "out"
    run(Options(model=str(root / "bert"), budgets=(0.3, 0.6), out=str(out), method="magnitude", seq_len=16,
                precision="fp16", elastic_graph=False), echo=lambda s: None)
    return out


def _feeds(batch: int, seq: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    mask = np.ones((batch, seq), np.int64)
    mask[1:, seq // 2:] = 0
    return {"input_ids": rng.integers(5, 512, (batch, seq), dtype=np.int64), "attention_mask": mask,
            "token_type_ids": np.zeros((batch, seq), np.int64)}


def _ort(path: Path, feeds: dict) -> tuple[list[str], list[np.ndarray]]:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    return [o.name for o in sess.get_outputs()], sess.run(None, {n: feeds[n] for n in names})


@gpu
@pytest.mark.parametrize("precision,tol", [("fp32", 1e-3), ("fp16", 1e-2)])
def test_engines_match_onnx(artifacts, tmp_path, precision, tol):
    import shutil

    from elastic_export.checks.compare import relative_error

    d = Path(shutil.copytree(artifacts, tmp_path / precision))
    m = T.build_engines(d, precision=precision, min_batch=1, opt_batch=2, max_batch=4, max_tokens=16,
                        workspace_gb=1, progress=False)
    assert (d / T.TIMING_CACHE).is_file() and m.tensorrt["precision"] == precision
    assert m.tensorrt["tf32"] is False  # fp32 means fp32: the 1e-3 bound below holds without TF32
    if m.tensorrt["fp16_mode"] == T.BUILDER_FLAG:  # TensorRT 10: norms / softmax asked to stay fp32
        assert all(n > 0 for n in m.tensorrt["fp32_layers"].values()), m.tensorrt["fp32_layers"]
    assert load_manifest(d)["dense"]["engine"] == "dense.engine"
    for entry in [m.dense, *m.budgets]:
        with T.load_engine(d / entry.engine) as runner:
            for batch, seq in ((1, 16), (3, 9)):
                feeds = _feeds(batch, seq)
                names, want = _ort(d / entry.onnx, feeds)
                got = runner.run({n: feeds[n] for n in runner.inputs}, outputs=names)
                assert [g.shape for g in got] == [w.shape for w in want]
                if precision == "fp32":
                    err = max(float(np.abs(np.asarray(g, np.float64) - w).max()) for g, w in zip(got, want))
                    assert err <= tol, (entry.engine, err)
                else:
                    assert relative_error(want, [np.asarray(g, np.float32) for g in got]) <= tol
            with pytest.raises(UserError, match="outside the engine's profile"):
                runner.run({n: v for n, v in _feeds(8, 16).items() if n in runner.inputs})


@gpu
def test_cli_build_and_timing_cache_reuse(artifacts, tmp_path):
    import shutil

    d = Path(shutil.copytree(artifacts, tmp_path / "cli"))
    r = subprocess.run([sys.executable, "-m", "elastic_export", "build", "--target", "tensorrt", str(d),
                        "--max-batch", "4", "--opt-batch", "2", "--workspace-gb", "1"],
                       capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr
    m = load_manifest(d)
    assert all((d / b["engine"]).is_file() for b in m["budgets"])
    assert m["tensorrt"]["timing_cache"] == T.TIMING_CACHE and (d / T.TIMING_CACHE).stat().st_size > 0


def test_output_order_follows_manifest(tmp_path):
    d = _fake_dir(tmp_path / "a")
    m = json.loads((d / "manifest.json").read_text())
    m["outputs"] = [{"name": "last_hidden_state"}, {"name": "sentence_embedding"}]
    (d / "manifest.json").write_text(json.dumps(m))
    engine = d / "dense.engine"
    assert T._manifest_order(engine, ["sentence_embedding", "last_hidden_state"]) == ["last_hidden_state",
                                                                                       "sentence_embedding"]
    assert T._manifest_order(engine, ["other"]) == ["other"]
    assert T._manifest_order(tmp_path / "nowhere" / "x.engine", ["b", "a"]) == ["b", "a"]
