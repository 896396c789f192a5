"""``elastic-export serve`` where other machines reach it, against a live server (loopback only: 127.0.0.2 stands
for a network address): the API key on every ``/v1`` route and in no command line, only the API on ``--host``,
``--expose-triton``'s restricted APIs, the limits at the door, ``/health`` / ``/ready``, the API's metrics, and
SIGTERM's drain with nothing left behind. Every request is bounded; each server is stopped by its pid."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from _helpers import ENV, link_copy, serve_process, stop_process

from elastic_export.serving.api_guard import API_KEY_ENV, Exposure
from elastic_export.targets import tritonserver as TS

KEY = "sk-test-" + "7f3a9c1e5b2d4086"  # the API key (in the environment of the first server)
KEY2 = "sk-test-" + "c0ffee15deadbeef"  # the second server's, given on its command line
HOST = "127.0.0.2"  # "the network"
TIMEOUT_S = 60.0
LIMITS = ["--payload-limit", "1000000", "--max-client-batch-size", "8", "--max-concurrent-requests", "4"]


def start_serve(directory, *extra: str, env=None, attempts: int = 3):
    """``elastic-export serve DIR --port P ...`` until its ready line (:func:`_helpers.serve_process`, again on
    another block when a port was taken); (process, port); ``p.lines`` follows its output, ``p.server_pid`` is
    its tritonserver. The ports must be free on 127.0.0.1 and on :data:`HOST`."""
    p, port, _ = serve_process(directory, *extra, env=env, attempts=attempts, free_on=(HOST,))
    return p, port


def gone(pid: int | None) -> bool:
    return pid is None or not TS.alive(pid)


def group(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            fields = TS._stat(int(entry.name))
            if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                found.append(int(entry.name))
    return found


def assert_nothing_left(p) -> None:
    """serve, its tritonserver, the server's group (its stubs, killed by serve: polled until reaped) and
    serve's children (the watchdog) are gone."""
    assert p.poll() is not None
    assert gone(p.server_pid), p.server_pid
    poll(lambda: not group(p.server_pid), 10, f"tritonserver's group {group(p.server_pid)} gone")
    assert not TS.children(p.pid)


@pytest.fixture(scope="module")
def art(minilm_small, tmp_path_factory):
    return link_copy(minilm_small, tmp_path_factory.mktemp("exposure") / "art", ignore=("triton", "index"))


@pytest.fixture(scope="module")
def guarded(art):
    """serve with the key in its environment, the API on 127.0.0.2, small limits."""
    p, port = start_serve(art, "--host", HOST, *LIMITS, env={API_KEY_ENV: KEY})
    p.port, p.api = port, f"http://{HOST}:{port + 3}"
    try:
        yield p
    finally:
        stop_process(p)


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def embed(p, n: int = 1, key: str = KEY) -> httpx.Response:
    return httpx.post(p.api + "/v1/embeddings", json={"model": "elastic", "input": ["hello world"] * n},
                      headers=auth(key), timeout=TIMEOUT_S)


# --- 1. the key ------------------------------------------------------------------------------------
def test_a_network_host_without_a_key_is_refused_with_one_line(tmp_path):
    """Nothing is bound: the refusal comes before anything starts; an empty key file is refused too."""
    for args, env in ((["--host", "0.0.0.0"], {}), (["--host", "192.0.2.1"], {API_KEY_ENV: ""})):
        r = subprocess.run([sys.executable, "-m", "elastic_export", "serve", str(tmp_path), *args], capture_output=True,
                           text=True, env={**ENV, **env}, timeout=120)
        assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
        assert r.stderr.count("\n") == 1 and "without a key" in r.stderr and "--allow-no-api-key" in r.stderr, r.stderr
    (tmp_path / "key").write_text("\n")
    r = subprocess.run([sys.executable, "-m", "elastic_export", "serve", str(tmp_path), "--api-key-file",
                        str(tmp_path / "key")], capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "empty" in r.stderr, r.stderr
    Exposure(allow_no_api_key=True).check("0.0.0.0")  # the opt-out


def test_every_v1_route_needs_the_key_and_the_openai_client_sends_it(guarded):
    from openai import AuthenticationError, OpenAI

    routes = [("GET", "/v1/models", None), ("GET", "/v1/models/elastic", None), ("GET", "/metrics", None),
              ("POST", "/v1/embeddings", {"model": "elastic", "input": "x"}), ("POST", "/v1/search", {"query": "x"})]
    for method, path, body in routes:
        for headers in ({}, auth("wrong"), {"Authorization": KEY}, {"Authorization": "Basic " + KEY}):
            r = httpx.request(method, guarded.api + path, json=body, headers=headers, timeout=TIMEOUT_S)
            assert r.status_code == 401, (path, headers, r.status_code)
            err = r.json()["error"]
            assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error" and err["message"]
    for path in ("/health", "/ready"):  # probes carry no key
        assert httpx.get(guarded.api + path, timeout=TIMEOUT_S).status_code == 200
    assert httpx.get(guarded.api + "/v1/models", headers=auth(), timeout=TIMEOUT_S).status_code == 200
    client = OpenAI(base_url=guarded.api + "/v1", api_key=KEY, timeout=TIMEOUT_S, max_retries=0)
    got = client.embeddings.create(model="elastic", input=["hello", "world"])
    assert len(got.data) == 2 and len(got.data[0].embedding) == 384
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=guarded.api + "/v1", api_key="wrong", timeout=TIMEOUT_S, max_retries=0).embeddings.create(
            model="elastic", input="hello")
    from langchain_openai import OpenAIEmbeddings
    from llama_index.embeddings.openai import OpenAIEmbedding

    lc = OpenAIEmbeddings(base_url=guarded.api + "/v1", api_key=KEY, model="elastic", check_embedding_ctx_length=False,
                          timeout=TIMEOUT_S, max_retries=0)
    assert len(lc.embed_documents(["hello", "world"])) == 2
    li = OpenAIEmbedding(api_base=guarded.api + "/v1", api_key=KEY, model_name="elastic", timeout=TIMEOUT_S,
                         max_retries=0)
    assert len(li.get_text_embedding("hello")) == 384


def all_cmdlines() -> dict[int, bytes]:
    out = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    out[int(entry.name)] = f.read()
            except OSError:
                pass
    return out


def test_the_key_is_in_no_command_line_and_not_in_tritonservers_environment(guarded):
    found = [pid for pid, line in all_cmdlines().items() if KEY.encode() in line]
    assert not found, found
    with open(f"/proc/{guarded.server_pid}/environ", "rb") as f:
        assert KEY.encode() not in f.read()


# --- 2. only the API on --host ---------------------------------------------------------------------
def connects(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=5):
            return True
    except OSError:
        return False


def test_only_the_api_is_on_the_host_triton_stays_on_loopback(guarded):
    port = guarded.port
    assert httpx.get(f"http://{HOST}:{port + 3}/health", timeout=TIMEOUT_S).status_code == 200
    assert not connects("127.0.0.1", port + 3)
    for p in (port, port + 1, port + 2):  # Triton's HTTP, gRPC, metrics
        assert connects("127.0.0.1", p) and not connects(HOST, p), p
    assert f"OpenAI API http://{HOST}:{port + 3}/v1" in guarded.lines[-1] or any(
        f"OpenAI API http://{HOST}:{port + 3}/v1" in x for x in guarded.lines)


# --- 3. limits at the door ---------------------------------------------------------------------------
def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmRSS:")) / 1024


def send_chunked(host: str, port: int, total: int, key: str = KEY, chunk: int = 64 << 10) -> tuple[int, bytes]:
    """POST /v1/embeddings with a chunked body of ``total`` bytes, stopping once the server answers or
    closes; (bytes sent, what came back). Bounded by socket timeouts."""
    s = socket.create_connection((host, port), timeout=TIMEOUT_S)
    head = (f"POST /v1/embeddings HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    data, sent = b"[" + b" " * (chunk - 1), 0
    try:
        s.sendall(head.encode())
        while sent < total and not select.select([s], [], [], 0)[0]:
            s.sendall(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            sent += len(data)
    except OSError:
        pass
    got = b""
    try:
        while b"\r\n\r\n" not in got or len(got) < 200:
            more = s.recv(65536)
            if not more:
                break
            got += more
    except OSError:
        pass
    s.close()
    return sent, got


def test_a_20mb_chunked_body_is_refused_without_holding_it(guarded):
    base, peak, done = rss_mb(guarded.pid), [0.0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], rss_mb(guarded.pid))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        sent, got = send_chunked(HOST, guarded.port + 3, 20 << 20)
    finally:
        done.set()
        watcher.join(10)
    print(f"sent {sent / 2**20:.1f} MB before the answer; serve's RSS {base:.0f} MB -> peak {peak[0]:.0f} MB")
    assert got.startswith(b"HTTP/1.1 413"), got[:200]
    assert b"--payload-limit" in got and sent < 20 << 20
    assert peak[0] - base < 50, (base, peak[0])
    r = httpx.post(guarded.api + "/v1/embeddings", content=b"x" * 1_000_001, headers=auth(), timeout=TIMEOUT_S)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"  # a declared length
    assert embed(guarded).status_code == 200  # the next request is fine


def test_too_many_inputs_is_413_and_the_next_request_fine(guarded):
    r = embed(guarded, 9)
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_many_inputs", r.text
    assert "--max-client-batch-size" in r.json()["error"]["message"]
    r = httpx.post(guarded.api + "/v1/search", json={"query": ["q"] * 9}, headers=auth(), timeout=TIMEOUT_S)
    assert r.status_code == 413
    assert embed(guarded, 8).status_code == 200


class Held:
    """A request whose headers and half its body are sent: the API holds it in flight until :meth:`finish`."""

    def __init__(self, host: str, port: int, key: str = KEY):
        body = b'{"model": "elastic", "input": ["held in flight"]}'
        self.rest, self.sock = body[10:], socket.create_connection((host, port), timeout=TIMEOUT_S)
        self.sock.sendall((f"POST /v1/embeddings HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
                           f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body[:10])

    def finish(self) -> tuple[int, bytes]:
        self.sock.sendall(self.rest)
        got = b""
        while b"\r\n\r\n" not in got:
            more = self.sock.recv(65536)
            if not more:
                break
            got += more
        self.sock.close()
        return int(got.split(b" ", 2)[1]), got


def poll(check, timeout_s: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"{what} not met within {timeout_s:g} s")


def test_more_concurrent_requests_than_the_limit_is_429(guarded):
    held = [Held(HOST, guarded.port + 3) for _ in range(4)]
    r = poll(lambda: (x := embed(guarded)).status_code == 429 and x, what="a 429")
    assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "too_many_concurrent_requests"
    for h in held:
        assert h.finish()[0] == 200
    assert embed(guarded).status_code == 200


# --- 4. metrics ------------------------------------------------------------------------------------
def test_api_metrics_count_requests_latency_and_refusals(guarded):
    text = httpx.get(guarded.api + "/metrics", headers=auth(), timeout=TIMEOUT_S).text
    assert 'elastic_api_requests_total{route="/v1/embeddings",status="200"}' in text
    assert 'elastic_api_request_duration_seconds_bucket{le="0.25",route="/v1/embeddings"}' in text
    assert "elastic_api_in_flight 0.0" in text
    for reason in ("unauthorized", "payload_too_large", "too_many_inputs", "concurrency"):
        line = next(x for x in text.splitlines() if x.startswith(f'elastic_api_refused_total{{reason="{reason}"}}'))
        assert float(line.split()[-1]) >= 1, line


# --- 5. drain (last: it stops the server) ----------------------------------------------------------
def test_sigterm_drains_answers_in_flight_refuses_new_and_leaves_nothing(guarded):
    outcomes, stop = [], threading.Event()

    def load():  # a client in a loop: every request sent is answered 200 or 503
        with httpx.Client(timeout=TIMEOUT_S) as c:
            while not stop.is_set():
                try:
                    r = c.post(guarded.api + "/v1/embeddings", json={"model": "elastic", "input": ["load"]},
                               headers=auth())
                    outcomes.append(r.status_code)
                except httpx.ConnectError:  # not sent: the listener is gone
                    return
                if r.status_code == 503:
                    return

    held = Held(HOST, guarded.port + 3)  # in flight before the load starts: the gauge says so
    poll(lambda: "elastic_api_in_flight 1.0" in httpx.get(guarded.api + "/metrics", headers=auth(),
                                                          timeout=TIMEOUT_S).text, 30, "the held request in flight")
    clients = [threading.Thread(target=load, daemon=True) for _ in range(3)]  # 3 + the held one: the limit
    for c in clients:
        c.start()
    poll(lambda: len(outcomes) >= 30, 120, "30 answers under load")
    t0 = time.monotonic()
    guarded.send_signal(signal.SIGTERM)
    poll(lambda: httpx.get(guarded.api + "/ready", timeout=TIMEOUT_S).status_code == 503, 5, "/ready 503")
    ready_s = time.monotonic() - t0
    assert httpx.get(guarded.api + "/health", timeout=TIMEOUT_S).status_code == 200
    r = embed(guarded)
    assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] == "draining"
    status, raw = held.finish()
    assert status == 200 and b"connection: close" in raw.lower(), raw[:300]
    code = guarded.wait(60)
    exit_s = time.monotonic() - t0
    stop.set()
    for c in clients:
        c.join(30)
    guarded.follower.join(30)
    print(f"/ready 503 {ready_s:.2f} s after SIGTERM; exit {exit_s:.1f} s after; {len(outcomes)} load answers")
    assert code == 0 and exit_s < 30, (code, exit_s)
    assert set(outcomes) <= {200, 503} and outcomes.count(200) >= 30, outcomes
    assert any(x.startswith("drained: ") and "all answered" in x for x in guarded.lines), guarded.lines[-5:]
    assert_nothing_left(guarded)


# --- --expose-triton: Triton on the host too, everything but inference, health and metadata restricted ------
@pytest.fixture(scope="module")
def exposed(art):
    """serve --expose-triton with the key on its command line (overwritten there at once)."""
    p, port = start_serve(art, "--host", HOST, "--expose-triton", "--api-key", KEY2)
    p.port, p.api = port, f"http://{HOST}:{port + 3}"
    try:
        yield p
    finally:
        stop_process(p)


def triton_secret(server_pid: int) -> tuple[str, str]:
    env = dict(x.split(b"=", 1) for x in open(f"/proc/{server_pid}/environ", "rb").read().split(b"\0") if b"=" in x)
    name, _, value = env[TS.STATS_HEADER_ENV.encode()].decode().partition("=")
    return name, value


def test_expose_triton_restricts_all_but_inference_health_and_metadata(exposed):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    base = f"http://{HOST}:{exposed.port}"
    for path in ("/v2/health/ready", "/v2", "/v2/models/elastic", "/v2/models/elastic/ready"):
        assert httpx.get(base + path, timeout=TIMEOUT_S).status_code == 200, path
    refused = [("POST", "/v2/repository/index"), ("POST", "/v2/repository/models/elastic/unload"), ("GET", "/v2/logging"),
               ("POST", "/v2/logging"), ("GET", "/v2/trace/setting"), ("POST", "/v2/trace/setting"),
               ("GET", "/v2/systemsharedmemory/status"), ("POST", "/v2/systemsharedmemory/region/x/unregister"),
               ("GET", "/v2/models/stats")]
    for method, path in refused:
        r = httpx.request(method, base + path, json={}, timeout=TIMEOUT_S)
        assert r.status_code == 403 and "restricted" in r.text, (method, path, r.status_code, r.text)
    name, secret = triton_secret(exposed.server_pid)
    assert httpx.get(base + "/v2/models/stats", headers={name: secret}, timeout=TIMEOUT_S).status_code == 200
    with grpcclient.InferenceServerClient(f"{HOST}:{exposed.port + 1}") as c:
        assert c.is_model_ready("elastic")
        for call in (c.get_log_settings, c.get_model_repository_index, c.get_system_shared_memory_status,
                     c.get_trace_settings):
            with pytest.raises(InferenceServerException):
                call()
    r = embed(exposed, key=KEY2)  # inference through the router (whose statistics carry the header) still works
    assert r.status_code == 200 and len(r.json()["data"]) == 1
    found = [pid for pid, line in all_cmdlines().items() if KEY2.encode() in line or secret.encode() in line]
    assert not found, found  # the key given on serve's command line, and Triton's secret, are overwritten there


def test_ready_turns_503_when_triton_is_killed_and_serve_exits(exposed):
    assert httpx.get(exposed.api + "/ready", timeout=TIMEOUT_S).status_code == 200
    t0 = time.monotonic()
    os.kill(exposed.server_pid, signal.SIGKILL)

    def not_ready():
        try:
            r = httpx.get(exposed.api + "/ready", timeout=5)
            return r.status_code != 200 and ("503" if r.status_code == 503 else str(r.status_code))
        except httpx.TransportError:
            return "gone"

    how = poll(not_ready, 10, "/ready not 200")
    ready_s = time.monotonic() - t0
    code = exposed.wait(60)
    exposed.follower.join(30)
    print(f"/ready {how} {ready_s:.2f} s after SIGKILL of tritonserver; serve exited {code}")
    assert how == "503" and ready_s < 1.0, (how, ready_s)
    assert code == 2 and any("tritonserver" in x and "died" in x for x in exposed.lines), exposed.lines[-5:]
    assert_nothing_left(exposed)
