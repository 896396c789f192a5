"""Replicas behind a real load balancer: two ``elastic-export serve`` processes behind nginx (Debian's
package, started here on loopback with its own config, stopped by its pid), which retries a failed or
draining request on the next replica (``proxy_next_upstream error timeout http_502 http_503 non_idempotent``).
Under closed-loop load from four clients: one replica SIGTERMed (it drains) gives no error at all; nginx
reloaded onto a fresh replica, one SIGKILLed gives no lost request, and the p99 of the 5 s after the kill
is printed. A response the killed replica was writing when it died is cut (nginx had forwarded its
header, so it cannot retry it); the clients retry a cut response as the ``openai`` SDK does (twice), and
only requests in flight at the kill may be cut. Every request is bounded; every process is stopped by
its pid."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time

import httpx
import numpy as np
import pytest
from _helpers import PortInUse, busy_port, link_copy, on_a_free_block, stop_process
from test_api_exposure import KEY, assert_nothing_left, auth, poll, start_serve

from elastic_export.serving.api_guard import API_KEY_ENV
from elastic_export.targets import tritonserver as TS

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
CLIENTS = 4
TIMEOUT_S = 60.0
RETRIES = 2  # the openai SDK's default max_retries: a connection error is retried twice


def nginx_conf(folder, port: int, upstreams: list[int]) -> str:
    """A minimal nginx config: ``upstreams`` (API ports on 127.0.0.1) behind 127.0.0.1:``port``."""
    user = "user root;\n" if os.geteuid() == 0 else ""
    servers = "".join(f"    server 127.0.0.1:{p} max_fails=0;\n" for p in upstreams)
    temp = "".join(f"  {k}_temp_path {folder}/{k};\n" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return (f"{user}worker_processes 1;\ndaemon off;\npid {folder}/nginx.pid;\nerror_log {folder}/error.log notice;\n"
            "events { worker_connections 512; }\n"
            f"http {{\n  log_format up '$status $upstream_status $upstream_addr';\n"
            f"  access_log {folder}/access.log up;\n{temp}"
            f"  upstream api {{\n{servers}    keepalive 16;\n  }}\n"
            f"  server {{\n    listen 127.0.0.1:{port};\n    location / {{\n"
            "      proxy_pass http://api;\n      proxy_http_version 1.1;\n      proxy_set_header Connection \"\";\n"
            "      proxy_next_upstream error timeout http_502 http_503 non_idempotent;\n"
            "      proxy_next_upstream_tries 3;\n      proxy_connect_timeout 2s;\n      proxy_read_timeout 60s;\n"
            "    }\n  }\n}\n")


class Nginx:
    """nginx in the foreground (``daemon off``), its master process ours: :meth:`reload` (SIGHUP) and
    :meth:`stop` (SIGQUIT, then SIGKILL, bounded) by its pid."""

    def __init__(self, folder, upstreams: list[int]):
        assert os.path.exists(NGINX), "nginx is not installed: apt-get install -y nginx-light (as .ci/run does)"
        self.folder = folder
        on_a_free_block(lambda port: self.start(port, upstreams))

    def start(self, port: int, upstreams: list[int]) -> None:
        """nginx on ``port``, until it answers; stopped again, and :class:`PortInUse`, when its bind found the
        port in use."""
        self.port, log = port, self.folder / "error.log"
        log.unlink(missing_ok=True)  # this start's lines only
        self.write(upstreams)
        self.process = subprocess.Popen([NGINX, "-p", str(self.folder), "-c", str(self.folder / "nginx.conf")],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            poll(lambda: self.answers() or self.process.poll() is not None, 30, "nginx listening")
        except BaseException:
            self.stop()
            raise
        if self.process.poll() is not None:
            text = log.read_text() if log.exists() else ""
            busy = [x for x in text.splitlines() if busy_port(x)]
            if busy:
                raise PortInUse(busy[-1])
        assert self.process.poll() is None, log.read_text()

    def write(self, upstreams: list[int]) -> None:
        (self.folder / "nginx.conf").write_text(nginx_conf(self.folder, self.port, upstreams))

    def answers(self) -> bool:
        try:
            r = httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=5)  # from nginx, not another on its port
            return r.status_code in (200, 502, 503) and r.headers.get("server", "").startswith("nginx")
        except httpx.TransportError:
            return False

    def reload(self, upstreams: list[int]) -> None:
        """Point nginx at ``upstreams`` (SIGHUP: new workers, old ones finish their requests)."""
        self.write(upstreams)
        self.process.send_signal(signal.SIGHUP)
        poll(lambda: "reconfiguring" in (self.folder / "error.log").read_text(), 30, "nginx reloading")
        def since() -> str:
            return (self.folder / "error.log").read_text().split("reconfiguring", 1)[1]

        poll(lambda: "start worker process" in since(), 30, "nginx's new worker")
        poll(lambda: "exited with code" in since(), 30, "nginx's old worker gone")  # it takes no new connection

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGQUIT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(30)


class Load:
    """``CLIENTS`` closed-loop clients through nginx; every request's (start, seconds, status or error),
    and the (time, error) of every try that a transport error cut and the client retried."""

    def __init__(self, url: str):
        self.url, self.stop_at, self.done, self.cut = url, threading.Event(), [], []
        self.threads = [threading.Thread(target=self.client, args=(i,), daemon=True) for i in range(CLIENTS)]
        for t in self.threads:
            t.start()

    def client(self, i: int) -> None:
        with httpx.Client(timeout=TIMEOUT_S) as c:
            n = 0
            while not self.stop_at.is_set():
                start = time.monotonic()
                outcome = self.request(c, {"model": "elastic", "input": [f"client {i} request {n}"] * (1 + n % 3)})
                self.done.append((start, time.monotonic() - start, outcome))
                n += 1

    def request(self, c: httpx.Client, body: dict) -> object:
        """The status of ``body``'s answer, after up to ``RETRIES`` retries of a transport error."""
        for tries_left in range(RETRIES, -1, -1):
            try:
                return c.post(self.url + "/v1/embeddings", headers=auth(), json=body).status_code
            except httpx.TransportError as e:
                if not tries_left:
                    return type(e).__name__
                self.cut.append((time.monotonic(), type(e).__name__))

    def answered_since(self, t: float) -> int:
        return sum(1 for s, _, _ in self.done if s >= t)

    def finish(self) -> list[tuple[float, float, object]]:
        self.stop_at.set()
        for t in self.threads:
            t.join(TIMEOUT_S + 10)
        return list(self.done)


@pytest.fixture(scope="module")
def art(minilm_small, tmp_path_factory):
    return link_copy(minilm_small, tmp_path_factory.mktemp("replicas") / "art", ignore=("triton", "index"))


def test_two_replicas_behind_nginx_sigterm_no_error_sigkill_nothing_lost(art, tmp_path):
    env = {API_KEY_ENV: KEY}
    started, nginx = [], None
    try:
        for _ in range(2):
            started.append(start_serve(art, env=env))
        a, b = (p for p, _ in started)
        nginx = Nginx(tmp_path, [port + 3 for _, port in started])
        load = Load(f"http://127.0.0.1:{nginx.port}")
        poll(lambda: len(load.done) >= 20, 120, "20 answers through nginx")
        t_term = time.monotonic()
        a.send_signal(signal.SIGTERM)  # drains: its new requests are 503, which nginx retries on b
        poll(lambda: a.poll() is not None, 60, "the SIGTERMed replica exits")
        poll(lambda: load.answered_since(t_term) >= 40, 120, "40 answers since the SIGTERM")
        term = load.finish()
        assert a.returncode == 0
        assert {o for _, _, o in term} == {200}, [o for _, _, o in term if o != 200][:5]
        assert load.cut == [], load.cut[:5]  # a drain closes no connection it is answering

        started.append(start_serve(art, env=env))  # a fresh replica; nginx onto b and it
        c, c_port = started[-1]
        nginx.reload([started[1][1] + 3, c_port + 3])
        load = Load(f"http://127.0.0.1:{nginx.port}")
        poll(lambda: len(load.done) >= 20, 120, "20 answers through nginx after the reload")
        t_kill = time.monotonic()
        os.kill(b.pid, signal.SIGKILL)  # its tritonserver dies with it (PDEATHSIG, the watchdog)
        poll(lambda: time.monotonic() - t_kill >= 5 and load.answered_since(t_kill) >= 20, 120, "5 s after the kill")
        kill = load.finish()
        after = [d for s, d, _ in kill if t_kill <= s < t_kill + 5]
        print(f"SIGTERM: {len(term)} requests, all 200; SIGKILL: {len(kill)} requests, "
              f"{sorted({str(o) for _, _, o in kill})}, {len(load.cut)} cut and retried; 5 s after the kill: "
              f"{len(after)} requests, p50 {np.percentile(after, 50) * 1000:.0f} ms, "
              f"p99 {np.percentile(after, 99) * 1000:.0f} ms")
        assert {o for _, _, o in kill} == {200}, [o for _, _, o in kill if o != 200][:5]
        # only a request in flight at the kill can be cut: at most one a client, none before the kill
        assert len(load.cut) <= CLIENTS and all(t >= t_kill for t, _ in load.cut), (t_kill, load.cut)
        retried = [x for x in (tmp_path / "access.log").read_text().splitlines() if "," in x.split(" ", 1)[1]]
        print(f"retried on the next replica by nginx: {len(retried)} requests ({sorted(set(retried))[:6]})")
        killed = f"127.0.0.1:{started[1][1] + 3}"
        assert any(x.startswith("200 502, 200") and killed in x for x in retried), retried  # the kill was seen
        b.wait(30)
        poll(lambda: TS.alive(b.server_pid) is False, 30, "the killed replica's tritonserver gone")
    finally:
        if nginx is not None:
            nginx.stop()
        for p, _ in started:
            stop_process(p)
    for p, _ in started:
        assert_nothing_left(p)
