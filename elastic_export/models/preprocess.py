"""Image preprocessing by the model's own library.

An image encoder carries a preprocessing config (``Encoder.data_config``; the manifest's
``preprocess`` entry), one of two kinds:

* ``{"library": "transformers", "processor": PATH, ...}``: a Hugging Face directory's
  ``preprocessor_config.json``, applied by ``transformers.AutoImageProcessor`` (its size, crop,
  resample, rescale and normalisation, exactly as the model was trained);
* ``{"library": "timm", "input_size", "interpolation", "mean", "std", "crop_pct", "crop_mode"}``:
  timm's ``resolve_data_config`` output, applied by ``timm.data.create_transform`` (eval mode).
  Hugging Face directories without a processor config and configs written before this entry had a
  ``library`` use it too.

Both kinds also hold ``input_size`` (3, H, W), ``mean`` and ``std`` (synthetic calibration images
are normalised with them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from elastic_export.core.errors import UserError

PROCESSOR_FILE = "preprocessor_config.json"
Transform = Callable[[Any], "Any"]  # PIL image -> float tensor (3, H, W)


def hf_config(path: Path, size: tuple[int, int]) -> dict:
    """The preprocessing config of a Hugging Face image model directory whose model runs at ``size``.

    Raises:
        UserError: the directory's processor config cannot be loaded, or it makes images of
            another size than the model's config says.
    """
    base = {"input_size": (3, *size), "mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5)}
    if not (path / PROCESSOR_FILE).is_file():
        return {"library": "timm", **base, "interpolation": "bilinear", "crop_pct": 1.0, "crop_mode": "center"}
    cfg = {"library": "transformers", "processor": str(path / PROCESSOR_FILE), **base}
    proc = _hf_processor(path)
    cfg["mean"] = tuple(float(x) for x in getattr(proc, "image_mean", None) or base["mean"])
    cfg["std"] = tuple(float(x) for x in getattr(proc, "image_std", None) or base["std"])
    from PIL import Image

    got = tuple(transform(cfg)(Image.new("RGB", (size[1] + 7, size[0] + 3))).shape)
    if got != (3, *size):
        raise UserError(f"{path / PROCESSOR_FILE}: the image processor makes {got[1]}x{got[2]} images but the "
                        f"model's config expects {size[0]}x{size[1]}")
    return cfg


def _hf_processor(directory: Path):
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(str(directory))
    except Exception as e:  # transformers raises many types here
        from elastic_export.core.errors import first_line

        raise UserError(f"{directory / PROCESSOR_FILE}: not a loadable image processor ({first_line(e)})")


def transform(cfg: dict, base: Path | None = None) -> Transform:
    """The function that turns one PIL image into the model's ``pixel_values`` row (3, H, W).

    Args:
        cfg: a preprocessing config (module docstring).
        base: directory that a relative ``processor`` path is relative to (an artifact directory).
    """
    if cfg.get("library") == "transformers":
        proc_file = Path(cfg["processor"])
        if not proc_file.is_absolute() and base is not None:
            proc_file = base / proc_file
        proc = _hf_processor(proc_file.parent)
        return lambda img: proc(images=img.convert("RGB"), return_tensors="pt")["pixel_values"][0]
    from timm.data import create_transform

    t = create_transform(
        input_size=tuple(int(x) for x in cfg["input_size"]), is_training=False,
        interpolation=cfg.get("interpolation") or "bilinear", mean=tuple(cfg["mean"]), std=tuple(cfg["std"]),
        crop_pct=cfg.get("crop_pct") or 1.0, crop_mode=cfg.get("crop_mode") or "center",
    )
    return lambda img: t(img.convert("RGB"))


def artifact_entry(cfg: dict | None, directory: Path) -> dict | None:
    """The manifest's ``preprocess`` entry (plain JSON) for an artifact directory being written.

    A Hugging Face processor config is copied into ``directory`` as ``preprocessor_config.json``
    (the usual Hugging Face layout) and named relative to it, so the directory preprocesses as its
    model did without the model directory.
    """
    if cfg is None:
        return None
    out = {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()
           if isinstance(v, (int, float, str, tuple, list, type(None)))}
    if cfg.get("library") == "transformers":
        import shutil

        shutil.copyfile(cfg["processor"], directory / PROCESSOR_FILE)
        out["processor"] = PROCESSOR_FILE
    return out
