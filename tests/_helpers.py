"""Shared test helpers: export a tiny encoder once, slice it, run it in onnxruntime."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import onnx
import onnxruntime as ort
import torch

from elastic_export.export.dense import export_dense
from elastic_export.models.inventory import build_inventory
from elastic_export.ranking.file import Ranking
from elastic_export.ranking.plans import make_plans
from elastic_export.ranking.reference import hard_mask, ranked_keep
from elastic_export.ranking.scoring import METHODS
from elastic_export.targets import tritonserver as TS


def ranking_with_empty_layers(enc, inv, seed=3):
    heads, neurons = METHODS["random"](enc, inv, seed=seed)
    heads[0][:] = -1.0
    neurons[-1][:] = -1.0
    return Ranking(heads, neurons, {})


def run_onnx(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {k: v.numpy() for k, v in feeds.items()})


def masked_torch(enc, plan, ranking, feeds) -> list[np.ndarray]:
    with torch.no_grad(), hard_mask(enc.blocks(), ranked_keep(plan, ranking)):
        return [t.numpy() for t in enc.export_module()(*feeds.values())]


def max_err(a: list, b: list) -> float:
    assert len(a) == len(b)
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def prepared(enc, tmp_path, sparsities=(0.0, 0.25, 0.5, 0.9)):
    inv = build_inventory(enc)
    rk = ranking_with_empty_layers(enc, inv)
    dense = export_dense(enc, rk, tmp_path / "dense.onnx")
    return inv, rk, dense, make_plans(rk, inv, list(sparsities))


class TinyExport:
    """One tiny model's :func:`prepared` export, made once and shared by the tests that take it: the
    encoder, its inventory and ranking, and the dense ONNX file at ``path``. :meth:`prepared` hands
    each test its own copy of the dense model, and checks that no test before changed the encoder."""

    def __init__(self, name: str, directory) -> None:
        from conftest import tiny_encoder

        directory.mkdir()
        self.name, self.path, self.enc = name, directory / "dense.onnx", tiny_encoder(name)
        self.inv = build_inventory(self.enc)
        self.rk = ranking_with_empty_layers(self.enc, self.inv)
        self._dense = export_dense(self.enc, self.rk, self.path)
        self._state = {k: v.clone() for k, v in self.enc.module.state_dict().items()}
        self._hooks = self._hook_count()

    def _hook_count(self) -> int:
        return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in self.enc.module.modules())

    def prepared(self, sparsities=(0.0, 0.25, 0.5, 0.9)):
        """What ``prepared(enc, tmp_path, sparsities)`` returns: the inventory, the ranking, a fresh
        copy of the dense model (the test may change it) and the plans."""
        state = self.enc.module.state_dict()
        assert state.keys() == self._state.keys() and all(torch.equal(state[k], v) for k, v in self._state.items()), \
            f"{self.name}: a test changed the shared encoder's weights"
        assert self._hook_count() == self._hooks, f"{self.name}: a test left a hook on the shared encoder"
        dense = onnx.ModelProto()
        dense.CopyFrom(self._dense)
        return self.inv, self.rk, dense, make_plans(self.rk, self.inv, list(sparsities))


class TinyExports:
    """The session's cache of :class:`TinyExport`, one per tiny model, made on first use (``conftest``'s
    ``tiny_exports`` fixture): the same export is not repeated by every test that slices it."""

    def __init__(self, directory) -> None:
        self.directory, self._made = directory, {}

    def __getitem__(self, name: str) -> TinyExport:
        if name not in self._made:
            self._made[name] = TinyExport(name, self.directory / name)
        return self._made[name]


def minilm_small_export(minilm, out) -> tuple[Ranking, onnx.ModelProto]:
    """``conftest``'s session export ``minilm_small`` (directory ``out``): its ranking and a fresh load of
    its dense ONNX, checked to be the data-free magnitude ranking of ``minilm`` (the embedded
    all-MiniLM-L6-v2), so ``out/dense.onnx`` is what ``export_dense(minilm, that ranking)`` writes."""
    from elastic_export.ranking.file import load_ranking

    rk = load_ranking(out / "ranking.safetensors")
    assert rk.meta["method"] == "magnitude" and rk.meta["fingerprint"] == minilm.fingerprint(), rk.meta
    return rk, onnx.load(str(out / "dense.onnx"))


def save_sentence_transformer(enc, path, pooling: dict) -> None:
    """A ``save_pretrained`` directory plus a sentence-transformers Transformer / Pooling (with the
    ``pooling`` config) / Normalize module list, as sentence-transformers saves a model."""
    import json

    enc.module.save_pretrained(path)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))


def link_copy(src, dst, ignore=("triton",)):
    """A copy of an artifact directory made of hard links (cheap), less the folders in ``ignore``.
    Files are shared with ``src``: replace them, never write into them."""
    import shutil

    shutil.copytree(src, dst, copy_function=os.link, ignore=shutil.ignore_patterns(*ignore))
    return dst


# --- `elastic-export serve` as a user runs it (tests/test_triton_server.py, test_pipeline.py) -------
READY_S = 240  # every server start
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


# --- a server on a free port block, again on another when a port was taken before it bound ---------
BUSY_PORT = re.compile(r"\b(?:is|already) in use\b", re.IGNORECASE)


class PortInUse(Exception):
    """What a start callable of :func:`on_a_free_block` raises when its server's failure says one of its ports
    was in use, after stopping that server (by its pid)."""


def busy_port(text: str) -> bool:
    """Whether a server's failure says a port was in use: serve's ``port P on H (what) is in use``,
    tritonserver's ``Socket '127.0.0.1:P' already in use`` / ``Address already in use``, uvicorn's
    ``error while attempting to bind on address (...): address already in use``, nginx's ``bind() to
    127.0.0.1:P failed (98: Address already in use)``."""
    return BUSY_PORT.search(text) is not None


def on_a_free_block(start, attempts: int = 3):
    """``start(port)`` with ``port`` from ``free_port_block()``, and again on a fresh block (``attempts`` tries
    in all) while it raises :class:`PortInUse`: the block is free when checked, and another process can take
    one of its ports before the server binds it (free_port_block's race: the caller retries). Whatever else
    ``start`` raises is raised at once."""
    taken = []
    for _ in range(attempts):
        port = TS.free_port_block()
        try:
            return start(port)
        except PortInUse as e:
            taken.append(f"block {port}: {e}")
    raise AssertionError(f"a port was in use in each of {attempts} free port blocks:\n" + "\n".join(taken))


def serve_process(directory, *extra: str, attempts: int = 3, cwd=None, env=None,
                  free_on: tuple[str, ...] = ()) -> tuple[subprocess.Popen, int, list[str]]:
    """``elastic-export serve DIR`` on a free port block (:func:`on_a_free_block`; ``free_on``: hosts besides
    127.0.0.1 where the block must be free too), until it prints its ready line (bounded); ``env`` is added
    to :data:`ENV`.

    Returns the process, its port and the lines it printed up to the ready line; ``p.lines`` holds those
    and, as they come, the lines it prints later (a reader thread: :func:`wait_for_line`), and
    ``p.server_pid`` is its tritonserver's pid."""
    def start(port: int) -> tuple[subprocess.Popen, int, list[str]]:
        taken = [h for h in free_on if not all(TS.port_free(h, port + i) for i in range(len(TS.PORT_USES)))]
        if taken:
            raise PortInUse(f"not free on {', '.join(taken)}")
        p = subprocess.Popen([sys.executable, "-m", "elastic_export", "serve", str(directory), "--port", str(port),
                              "--ready-timeout", str(READY_S),
                              *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**ENV, **(env or {})}, cwd=cwd,
                             start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        # a reader thread from the start: the deadline holds even while serve prints nothing
        p.lines = lines = []
        p.follower = threading.Thread(target=_follow, args=(p, lines), daemon=True)
        p.follower.start()
        deadline = time.monotonic() + READY_S + 120
        while (ready := next((i for i, x in enumerate(lines) if x.startswith("ready:")), None)) is None:
            if p.poll() is not None:  # ended: the reader gets its last lines
                p.follower.join(timeout=30)
                if not any(x.startswith("ready:") for x in lines):
                    break
            elif time.monotonic() > deadline:
                break
            else:
                time.sleep(0.05)
        if ready is not None:
            p.server_pid = tritonserver_of(p.pid)
            return p, port, list(lines[:ready + 1])
        stop_process(p)
        busy = [x for x in lines if busy_port(x)]
        if busy:
            raise PortInUse(busy[0])
        raise AssertionError("serve did not become ready:\n" + "\n".join(lines[-20:]))

    return on_a_free_block(start, attempts)


def _follow(p: subprocess.Popen, lines: list[str]) -> None:
    for line in p.stdout:
        lines.append(line.rstrip())


def tritonserver_of(pid: int) -> int | None:
    """The pid of the ``tritonserver`` that process ``pid`` started (its child), if any."""
    found = [c for c in TS.children(pid) if os.path.basename((TS.cmdline(c) or [""])[0]) == "tritonserver"]
    return found[0] if found else None


def wait_for_line(p: subprocess.Popen, text: str, timeout_s: float = 60.0, start: int = 0) -> str:
    """The first line serve printed (from index ``start``) that contains ``text``, polled until ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        hit = next((x for x in p.lines[start:] if text in x), None)
        if hit is not None:
            return hit
        time.sleep(0.05)
    raise AssertionError(f"serve did not print {text!r} within {timeout_s:g} s:\n" + "\n".join(p.lines[-20:]))


def stop_process(p) -> tuple[int, str]:
    """SIGTERM to serve (by its pid), bounded; the rest of its output (after the ready line; all of it for
    a serve that never printed one)."""
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
    follower = getattr(p, "follower", None)
    if follower is not None:
        try:
            p.wait(timeout=TS.STOP_TIMEOUT_S + 30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
        follower.join(timeout=30)
        ready = next((i for i, x in enumerate(p.lines) if x.startswith("ready:")), -1)
        return p.returncode, "\n".join(p.lines[ready + 1:])
    try:
        rest, _ = p.communicate(timeout=TS.STOP_TIMEOUT_S + 30)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        rest, _ = p.communicate(timeout=30)
    return p.returncode, rest or ""
