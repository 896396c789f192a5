"""Headless Chromium driven through the DevTools protocol over ``--remote-debugging-pipe`` (no
extra dependency): tests/test_report.py renders the report in it, scripts/report_screenshot.py
takes the screenshot in docs/evaluation.md with it."""

from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path

CHROMIUM = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    """The first Chromium-like browser on PATH, or None."""
    return next((shutil.which(n) for n in CHROMIUM if shutil.which(n)), None)


class DevTools:
    """Headless Chromium driven through the DevTools protocol over ``--remote-debugging-pipe``
    (JSON messages separated by NUL bytes; the browser reads fd 3 and writes fd 4)."""

    def __init__(self, binary: str, workdir: Path, timeout: float = 60.0):
        self.timeout, self.events, self._id, self._buf = timeout, [], 0, b""
        self.log = workdir / "chromium.log"
        cmd_r, self._cmd_w = os.pipe()
        self._out_r, out_w = os.pipe()
        # the child's ends moved above fd 9, so bash's 3< / 4> redirections cannot clobber them
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (cmd_r, out_w)]
        os.close(cmd_r)
        os.close(out_w)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                ["bash", "-c", f'exec "$0" "$@" 3<&{high[0]} 4>&{high[1]}', binary, "--headless", "--no-sandbox",
                 "--disable-gpu", "--no-first-run", "--remote-debugging-pipe",
                 f"--user-data-dir={workdir / 'profile'}", "about:blank"],
                pass_fds=tuple(high), stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        for fd in high:
            os.close(fd)

    def _recv(self) -> dict:
        end = time.monotonic() + self.timeout
        while b"\0" not in self._buf:
            ready, _, _ = select.select([self._out_r], [], [], max(0.0, end - time.monotonic()))
            if not ready:
                raise TimeoutError("no message from chromium")
            chunk = os.read(self._out_r, 1 << 16)
            if not chunk:
                raise EOFError(f"chromium closed the pipe: {self.log.read_text(errors='replace')[-2000:]}")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def call(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        try:
            os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        except BrokenPipeError:
            raise EOFError(f"chromium is gone: {self.log.read_text(errors='replace')[-2000:]}")
        while True:
            reply = self._recv()
            if reply.get("id") == self._id:
                assert "error" not in reply, reply
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str) -> None:
        while not any(e.get("method") == method for e in self.events):
            self.events.append(self._recv())

    def close(self) -> None:
        try:
            self.call("Browser.close")
            self.proc.wait(timeout=20)
        except Exception:  # noqa: BLE001 - make sure our own browser process is gone
            self.proc.kill()
            self.proc.wait()
        finally:
            os.close(self._cmd_w)
            os.close(self._out_r)
