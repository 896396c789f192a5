"""The benchmarks' figures as PNGs of at most 256 colours: a plot's few colours and their anti-aliasing fit a
palette, at about a third of the bytes of matplotlib's RGBA file (``benchmarks/results`` stays small)."""

from __future__ import annotations

import io
from pathlib import Path


def palette_png(png: bytes | Path, path: Path) -> None:
    """``png`` (the bytes of a PNG, or its file) written to ``path`` with a palette of at most 256 colours."""
    from PIL import Image

    image = Image.open(io.BytesIO(png) if isinstance(png, bytes) else png)
    image.convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(path, optimize=True)


def save_png(fig, path: Path, dpi: int = 110) -> None:
    """``fig`` saved as ``path`` (:func:`palette_png`)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    palette_png(buf.getvalue(), path)
