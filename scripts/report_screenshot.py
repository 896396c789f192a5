"""The report screenshot of docs/evaluation.md: a report page rendered in headless Chromium, saved as a PNG.

    python scripts/report_screenshot.py DIR/report.html docs/report_minilm.png [--width 1280] [--max-height 20000]

The browser is driven the way tests/test_report.py drives it (tests/_devtools.py: the DevTools
protocol over a pipe, no extra dependency); the page is captured from the top, at most
``--max-height`` CSS pixels of it.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _devtools import DevTools, find_chromium  # noqa: E402


def screenshot(page: Path, out: Path, width: int, max_height: int) -> tuple[int, int]:
    """Render ``page`` at ``width`` CSS pixels and write its top ``max_height`` pixels to ``out``."""
    binary = find_chromium()
    if binary is None:
        raise SystemExit("chromium not found (Debian: apt-get install -y chromium)")
    with tempfile.TemporaryDirectory() as tmp:
        browser = DevTools(binary, Path(tmp))
        try:
            target = browser.call("Target.createTarget", {"url": "about:blank"})["targetId"]
            session = browser.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
            browser.call("Page.enable", session=session)
            metrics = {"width": width, "height": 900, "deviceScaleFactor": 1, "mobile": False}
            browser.call("Emulation.setDeviceMetricsOverride", metrics, session)
            browser.call("Emulation.setScrollbarsHidden", {"hidden": True}, session)
            browser.call("Page.navigate", {"url": page.resolve().as_uri()}, session)
            browser.wait_for("Page.loadEventFired")
            js = "JSON.stringify([document.documentElement.scrollWidth, document.documentElement.scrollHeight])"
            w, h = json.loads(browser.call("Runtime.evaluate", {"expression": js, "returnByValue": True},
                                           session)["result"]["value"])
            height = min(int(h), max_height)
            browser.call("Emulation.setDeviceMetricsOverride", {**metrics, "height": height}, session)
            shot = browser.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": False,
                                                           "clip": {"x": 0, "y": 0, "width": width, "height": height,
                                                                    "scale": 1}}, session)
        finally:
            browser.close()
    from PIL import Image

    with Image.open(io.BytesIO(base64.b64decode(shot["data"]))) as img:  # a 256-colour palette: a third the bytes
        img.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(out, optimize=True)
    return width, height


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("page", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--max-height", type=int, default=20000)
    args = ap.parse_args()
    w, h = screenshot(args.page, args.out, args.width, args.max_height)
    print(f"wrote {args.out} ({w} x {h})")


if __name__ == "__main__":
    main()
