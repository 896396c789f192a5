"""Image preprocessing is the model's own library's: ``AutoImageProcessor`` for Hugging Face
directories, timm's ``create_transform`` for timm models, in calibration and in ``eval --images``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import tiny_encoder
from PIL import Image

from elastic_export.core.errors import UserError
from elastic_export.data.calibration import load_calibration
from elastic_export.measure.evaluation import load_image_folder
from elastic_export.models.loader import load_encoder
from elastic_export.models.preprocess import PROCESSOR_FILE, artifact_entry


def _photo_folder(root, sizes=((61, 45), (40, 90))):
    """Real PNG files (smooth gradients plus noise, odd sizes), one per class sub-folder."""
    rng = np.random.default_rng(0)
    for i, (w, h) in enumerate(sizes):
        y, x = np.mgrid[0:h, 0:w]
        img = np.stack([x * 255 / w, y * 255 / h, (x + y) * 127 / (w + h)], -1) + rng.normal(0, 20, (h, w, 3))
        (root / f"cls{i}").mkdir(parents=True)
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(root / f"cls{i}" / "img.png")
    return sorted(root.rglob("*.png"))


@pytest.fixture(scope="module")
def vit_dir(tmp_path_factory):
    """A saved HF ViT with its own processor: shortest-edge resize (bicubic), 32 px centre crop,
    its own mean / std."""
    from transformers import ViTImageProcessor

    path = tmp_path_factory.mktemp("pp") / "vit"
    tiny_encoder("hf-vit").module.save_pretrained(path)
    ViTImageProcessor(size={"height": 32, "width": 32}, resample=3, image_mean=[0.4, 0.45, 0.5],
                      image_std=[0.2, 0.25, 0.3]).save_pretrained(path)
    return path


def test_hf_directory_uses_its_image_processor(vit_dir, tmp_path):
    from transformers import AutoImageProcessor

    files = _photo_folder(tmp_path / "imgs")
    enc = load_encoder(str(vit_dir))
    assert enc.data_config["library"] == "transformers"
    cal = load_calibration(enc, str(tmp_path / "imgs"), size=2, batch_size=2)
    proc = AutoImageProcessor.from_pretrained(str(vit_dir))
    want = torch.cat([proc(images=Image.open(f).convert("RGB"), return_tensors="pt")["pixel_values"] for f in files])
    assert cal.batches[0]["pixel_values"].shape == (2, 3, 32, 32)
    assert float((cal.batches[0]["pixel_values"] - want).abs().max()) <= 1e-6
    # the artifact directory gets a copy of the processor config and eval --images uses it
    art = tmp_path / "art"
    art.mkdir()
    entry = artifact_entry(enc.data_config, art)
    assert entry["processor"] == PROCESSOR_FILE and (art / PROCESSOR_FILE).is_file()
    json.dumps(entry)
    pixels, labels, classes, failed = load_image_folder(tmp_path / "imgs", entry, art)
    assert failed == 0 and classes == ["cls0", "cls1"]
    assert float(np.abs(pixels - want.numpy()).max()) <= 1e-6


def test_timm_model_uses_create_transform(tmp_path):
    import timm
    from timm.data import create_transform, resolve_data_config
    from timm.models import save_for_hf

    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=48,
                              depth=2, num_heads=4, num_classes=0)
    save_for_hf(model, tmp_path / "timm", safe_serialization=True)
    files = _photo_folder(tmp_path / "imgs")
    enc = load_encoder(str(tmp_path / "timm"))
    assert enc.data_config["library"] == "timm" and enc.data_config["interpolation"] == "bicubic"
    cal = load_calibration(enc, str(tmp_path / "imgs"), size=2, batch_size=2)
    t = create_transform(**resolve_data_config({}, model=enc.module))  # as saved: 32 px, bicubic, crop 0.9
    want = torch.stack([t(Image.open(f).convert("RGB")) for f in files])
    assert float((cal.batches[0]["pixel_values"] - want).abs().max()) <= 1e-6


def test_processor_of_another_size_is_refused(vit_dir, tmp_path):
    import shutil

    from transformers import ViTImageProcessor

    bad = tmp_path / "vit"
    shutil.copytree(vit_dir, bad)
    ViTImageProcessor(size={"height": 48, "width": 48}).save_pretrained(bad)
    with pytest.raises(UserError, match="makes 48x48 images but the model's config expects 32x32"):
        load_encoder(str(bad))
