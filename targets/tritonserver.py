"""A real Triton Inference Server process on a model repository: found, started, waited for, stopped.

Where the server comes from: PyPI's ``nvidia-pytriton`` wheel (the ``serve`` extra) carries the
``tritonserver`` binary (Triton 2.51, CPU) with its Python backend, the Python backend stubs for
Python 3.8-3.13 and the libraries they need; it has no onnxruntime backend, so the repository's
budget models run in the Python backend there (``build triton --budget-backend python``). A
``tritonserver`` on PATH (with its own backends, e.g. in an NGC container) is used instead when the
wheel is not installed.

What a working Python backend needs (found the hard way, checked by :func:`check_stub_python`):

* the stub's Python is the ``python3`` first on PATH, so this Python's ``bin`` folder goes first;
* that Python's numpy must be 1.x: with numpy 2 this server's Python backend answers with empty
  outputs (``nvidia-pytriton`` itself pins ``numpy<2``, so installing the extra brings 1.26);
* the backend folder must hold the stub built for this Python version (prepared in a folder of its
  own by :func:`backend_dir`, never inside site-packages).

:class:`TritonServer` binds to 127.0.0.1 unless told otherwise (HTTP on the port, gRPC on port+1,
metrics on port+2), refuses busy ports before starting, runs the server in its own process group
(so the stub processes go with it), and stops it by its process id: SIGTERM, then SIGKILL after a
bound. Its model-repository API (load / unload / index) is closed to clients unless asked otherwise:
Triton's restricted-API options with a header whose value is a random secret of this process, which
:class:`TritonServer` sends for its own calls. Started from the main thread, the server gets
``PR_SET_PDEATHSIG(SIGKILL)``, so it never outlives this process, even one killed by SIGKILL; a
watchdog process (its own session, reading a pipe only this process holds) kills the server's group
when this process is gone, the Python backend stubs with it (they do not all exit with their server).
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from elastic_export.core.errors import UserError
from elastic_export.serving.api_guard import API_KEY_ENV, Exposure, Limits, hide_argument
from elastic_export.serving.triton_stats import STATS_HEADER_ENV, STATS_URL_ENV

STUB = "triton_python_backend_stub"
SHM_REGION = "triton_python_backend_shm_region"  # how the Python backend names a stub's region in /dev/shm
READY_TIMEOUT_S = 300.0
EXIT_TIMEOUT_S = 10  # how long the server waits for open connections and in-flight requests on SIGTERM
STOP_TIMEOUT_S = EXIT_TIMEOUT_S + 15.0
CONTROL_HEADER = "elastic-export-control"  # the model-repository API's header (HTTP); its value: a secret per server
GRPC_HEADER_PREFIX = "triton-grpc-protocol-"  # Triton 2.51 expects gRPC metadata "triton-grpc-protocol-<header>"
# Triton's APIs closed to clients without the secret header when its ports leave loopback (--expose-triton);
# inference, health and metadata stay open, and model-config (the API reads the router's config with it)
EXPOSED_RESTRICTED = ("model-repository", "logging", "trace", "shared-memory", "statistics")
POLL_S = 0.25  # serve's supervision: how often it checks the server and the stubs
INSTALL_HINT = 'pip install -e ".[serve]" (PyPI\'s nvidia-pytriton wheel carries a tritonserver with the Python backend)'


@dataclass(frozen=True)
class ServerInstall:
    """A ``tritonserver`` binary and what it runs with.

    Attributes:
        binary: the ``tritonserver`` executable.
        libs: a folder for ``LD_LIBRARY_PATH`` (None: the binary finds its libraries itself).
        backends: the folder of backends as shipped (``python/`` inside).
        stubs: the wheel's ``python_backend_stubs`` folder (None: the backends hold their stub).
    """

    binary: Path
    libs: Path | None
    backends: Path
    stubs: Path | None


def find_server() -> ServerInstall:
    """The ``nvidia-pytriton`` wheel's server, else a ``tritonserver`` on PATH.

    Raises:
        UserError: neither is installed.
    """
    try:
        import pytriton
    except ImportError:
        pytriton = None
    if pytriton is not None:
        root = Path(pytriton.__file__).parent / "tritonserver"
        libs = Path(pytriton.__file__).parent.parent / "nvidia_pytriton.libs"
        if (root / "bin" / "tritonserver").is_file():
            return ServerInstall(root / "bin" / "tritonserver", libs if libs.is_dir() else None, root / "backends",
                                 root / "python_backend_stubs")
    found = shutil.which("tritonserver")
    if found:
        return ServerInstall(Path(found), None, Path(os.environ.get("TRITON_BACKENDS", "/opt/tritonserver/backends")),
                             None)
    raise UserError(f"no tritonserver found: {INSTALL_HINT}")


def backend_dir(install: ServerInstall, dest: Path) -> Path:
    """A backends folder whose ``python/`` holds the wheel's backend and the stub of this Python.

    Raises:
        UserError: the wheel has no stub for this Python version.
    """
    if install.stubs is None:
        return install.backends
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    stub = install.stubs / version / STUB
    if not stub.is_file():
        raise UserError(f"the tritonserver in {install.binary.parent.parent} has no Python backend stub for Python "
                        f"{version}; use Python 3.8-3.13")
    python = dest / "python"
    python.mkdir(parents=True, exist_ok=True)
    for f in (install.backends / "python").iterdir():
        if f.is_file():
            shutil.copyfile(f, python / f.name)
    shutil.copyfile(stub, python / STUB)
    os.chmod(python / STUB, 0o755)
    return dest


def server_env(install: ServerInstall, python: str = sys.executable) -> dict[str, str]:
    """The server's environment: ``python``'s ``bin`` first on PATH (the stub's Python), the wheel's
    libraries on ``LD_LIBRARY_PATH``."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(python).parent), env.get("PATH", "")])
    if install.libs is not None:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(install.libs), env.get("LD_LIBRARY_PATH", "")) if p)
    return env


def check_stub_python(env: dict[str, str]) -> str:
    """The numpy version of the Python the stub will run (the ``python3`` on ``env``'s PATH).

    Raises:
        UserError: no numpy there, or numpy 2 (this server's Python backend then answers empty outputs).
    """
    python = shutil.which("python3", path=env.get("PATH"))
    if python is None:
        raise UserError("no python3 on PATH for Triton's Python backend stub")
    r = subprocess.run([python, "-c", "import numpy; print(numpy.__version__)"], capture_output=True, text=True,
                       env=env, timeout=60)
    if r.returncode != 0:
        raise UserError(f"{python}: numpy does not import ({(r.stderr.strip().splitlines() or ['?'])[-1]}); "
                        "Triton's Python backend needs numpy 1.x")
    version = r.stdout.strip()
    if int(version.split(".")[0]) >= 2:
        raise UserError(f"{python} has numpy {version}: Triton 2.51's Python backend answers empty outputs with "
                        "numpy 2; install numpy<2 there (pip install \"numpy<2\", as the serve extra does)")
    return version


def port_free(host: str, port: int) -> bool:
    """Whether ``host:port`` can be bound now (TCP)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


PORT_USES = ("HTTP", "gRPC", "metrics", "OpenAI API")  # port, port+1, ...: what serve binds there


def check_ports(host: str, port: int, api_host: str | None = None) -> None:
    """Refuse a port block (HTTP ``port``, gRPC ``port+1``, metrics ``port+2`` on ``host``, the OpenAI-style
    API ``port+3`` on ``api_host``, default ``host``) that is not free where it binds."""
    if not 1 <= port <= 65536 - len(PORT_USES):
        raise UserError(f"--port {port}: choose 1-{65536 - len(PORT_USES)} (serve uses the port and the next "
                        f"{len(PORT_USES) - 1})")
    for p, what in ((port + i, what) for i, what in enumerate(PORT_USES)):
        where = (api_host or host) if what == "OpenAI API" else host
        if not port_free(where, p):
            raise UserError(f"port {p} on {where} ({what}) is in use; choose another --port")


def free_port_block(host: str = "127.0.0.1", tries: int = 50) -> int:
    """A port whose next ones (:data:`PORT_USES`) are free too, as the OS hands out ephemeral ports (free when
    checked; a caller that may race with others retries on a busy-port failure)."""
    n = len(PORT_USES)
    for _ in range(tries):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port <= 65536 - n and all(port_free(host, p) for p in range(port, port + n)):
            return port
    raise UserError(f"no free block of {n} ports on {host}")


class TritonServer:
    """One ``tritonserver`` process on ``repository``.

    Args:
        repository: the model repository.
        host: address every endpoint binds to.
        port: HTTP port (gRPC: port+1, metrics: port+2).
        log: file for the server's output (default: a temporary file, removed on :meth:`stop`).
        args: extra ``tritonserver`` arguments.
        open_control: leave the model-repository API (load / unload / index) open to every client;
            by default it answers only requests with :meth:`control_headers` (HTTP 403 otherwise).
        exposed: the server is reachable beyond loopback (``serve --expose-triton``): every API but inference,
            health, metadata and model-config (:data:`EXPOSED_RESTRICTED`) answers only requests with the
            secret header (the router reads statistics with it, from its environment).

    ``scratch``: a temporary folder for the backends copy (and the default log), removed by
    :meth:`stop`, or by the watchdog when this process dies without stopping the server.
    """

    def __init__(self, repository: str | Path, host: str = "127.0.0.1", port: int = 8000, log: str | Path | None = None,
                 args: Sequence[str] = (), open_control: bool = False, exposed: bool = False):
        self.repository, self.host, self.port, self.exposed = Path(repository), host, int(port), exposed
        self.install = find_server()
        self.scratch = Path(tempfile.mkdtemp(prefix="elastic-export-triton."))
        self.log_path = Path(log) if log else self.scratch / "server.log"
        self.args, self.process = list(args), None
        self._watchdog: subprocess.Popen | None = None
        self._regions: set[str] = set()  # the stubs' shared-memory regions seen (:meth:`stop` removes them)
        self.secret = None if open_control and not exposed else secrets.token_urlsafe(24)
        self.open_control, self._hidden = open_control, False

    def control_headers(self, protocol: str = "http") -> dict[str, str]:
        """The headers the model-repository API asks for (none when it is open); ``protocol="grpc"``:
        the metadata key a gRPC client sends (Triton prefixes the header's name)."""
        if self.secret is None:
            return {}
        return {(CONTROL_HEADER if protocol == "http" else GRPC_HEADER_PREFIX + CONTROL_HEADER): self.secret}

    @property
    def http_url(self) -> str:
        return f"{self._url_host}:{self.port}"

    @property
    def grpc_url(self) -> str:
        return f"{self._url_host}:{self.port + 1}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self._url_host}:{self.port + 2}/metrics"

    @property
    def _url_host(self) -> str:
        return f"[{self.host}]" if ":" in self.host else self.host

    def command(self, backends: Path, load: Sequence[str] | None = None) -> list[str]:
        """The command line; ``load``: explicit model control, loading only those models at startup."""
        control = ["--model-control-mode=explicit", *(f"--load-model={m}" for m in load)] if load is not None else []
        apis = [a for a in (EXPOSED_RESTRICTED if self.exposed else ("model-repository",))
                if not (self.open_control and a == "model-repository")]
        if self.secret is not None and apis:
            rule = f"{','.join(apis)}:{CONTROL_HEADER}={self.secret}"
            control += [f"--http-restricted-api={rule}", f"--grpc-restricted-protocol={rule}"]
        return [str(self.install.binary), *control, f"--model-repository={self.repository}", f"--backend-directory={backends}",
                f"--http-address={self.host}", f"--grpc-address={self.host}", f"--metrics-address={self.host}",
                f"--http-port={self.port}", f"--grpc-port={self.port + 1}", f"--metrics-port={self.port + 2}",
                "--strict-readiness=true", "--exit-on-error=true", f"--exit-timeout-secs={EXIT_TIMEOUT_S}", *self.args]

    def start(self, load: Sequence[str] | None = None) -> "TritonServer":
        """Start the server (after checking the ports and the stub's numpy); returns at once.

        Args:
            load: explicit model control: load only these models at startup (:meth:`load` adds more);
                None: every model of the repository.
        """
        check_ports(self.host, self.port)
        env = server_env(self.install)
        env[STATS_URL_ENV] = f"http://{self.http_url}"  # the router reads its budget models' batch times there
        env.pop(API_KEY_ENV, None)  # the API's key: serve's alone
        if self.secret is not None:  # for the router (statistics restricted when exposed); the same user reads it
            env[STATS_HEADER_ENV] = f"{CONTROL_HEADER}={self.secret}"
        check_stub_python(env)
        backends = backend_dir(self.install, self.scratch / "backends")
        log = open(self.log_path, "ab")
        # Ctrl-C / SIGTERM held back until the process is recorded: one that lands inside Popen would
        # leave a server nobody knows the pid of (seen in a test); the child gets them unblocked.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            self.process = subprocess.Popen(self.command(backends, load), stdout=log, stderr=subprocess.STDOUT, env=env,
                                            stdin=subprocess.DEVNULL, start_new_session=True,
                                            preexec_fn=_child_setup(threading.current_thread() is threading.main_thread()))
            self._watchdog = _start_watchdog(self.process.pid, self.scratch)
        finally:
            log.close()
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        return self

    def _get(self, path: str, timeout: float = 2.0) -> int:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}{path}", timeout=timeout) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return 0

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S, models: Sequence[str] = ()) -> None:
        """Block until the server (and each of ``models``) is READY.

        Raises:
            UserError: the server exited, or was not ready within ``timeout_s`` (the reason from its log).
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                raise UserError(f"tritonserver exited ({self.process.returncode if self.process else '-'}): "
                                f"{self.failure()}")
            status = self._get("/v2/health/ready")
            if status:  # it answers: its options are parsed
                self.hide_secret()
            if status == 200 and all(self._get(f"/v2/models/{m}/ready") == 200 for m in models):
                return
            time.sleep(0.25)
        raise UserError(f"tritonserver not ready after {timeout_s:g} s: {self.failure()}")

    def hide_secret(self) -> None:
        """Overwrite the restricted APIs' secret in the server's command line (readable by every local user
        in ``/proc/PID/cmdline`` from its start until the server first answers), once."""
        if self.secret is not None and self.process is not None and not self._hidden:
            self._hidden = hide_argument(self.secret, self.process.pid)

    def load(self, model: str, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Load ``model`` (explicit model control) and wait until it is READY.

        Raises:
            UserError: the server refused to load it (its reason), or it was not ready in time.
        """
        status, detail = self._control(f"models/{model}/load", timeout_s)
        if status != 200:
            raise UserError(f"model {model!r} failed to load: {detail.strip()[:400]}")
        self.wait_ready(timeout_s, models=[model])
        self.stubs()  # its stub's region, noted

    def unload(self, model: str, timeout_s: float = 60.0) -> None:
        """Ask the server to unload ``model`` (returns once the request is accepted; unloading goes on).

        Raises:
            UserError: the server refused.
        """
        status, detail = self._control(f"models/{model}/unload", timeout_s)
        if status != 200:
            raise UserError(f"model {model!r} did not unload: {detail.strip()[:400]}")

    def reload(self, model: str, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Unload and load ``model`` again, until it is READY: the way back for a model whose Python
        backend stub died (Triton 2.51 neither restarts the stub nor reloads a model that is still
        loaded; the dead instance's unload never completes, so the server's stop then takes its exit
        timeout).

        Raises:
            UserError: the model did not load again (the server's reason), or not in time.
        """
        self.unload(model)
        self.load(model, timeout_s)

    def _control(self, path: str, timeout_s: float) -> tuple[int, str]:
        """POST to the model-repository API (with :meth:`control_headers`); its status and body (the
        error's text for a refusal; 0 when the server does not answer)."""
        req = urllib.request.Request(f"http://{self.http_url}/v2/repository/{path}", data=b"{}", method="POST",
                                     headers=self.control_headers())
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return r.status, r.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")
            try:
                detail = json.loads(detail).get("error", detail)
            except ValueError:
                pass
            return e.code, detail
        except OSError as e:
            return 0, str(e)

    def start_routed(self, models: Sequence[str], router: str, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Start with only the budget ``models``, wait until every one is READY, then load the
        ``router``: it is never READY in front of a budget model that is not.

        Raises:
            UserError: a model that does not load, or the server exits.
        """
        self.start(load=list(models))
        self.wait_ready(timeout_s, models=list(models))
        self.load(router, timeout_s)  # notes every stub's region

    def failure(self) -> str:
        """The most telling line of the server's log (an error, an unavailable model, else the last line)."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "no log"
        for marker in ("UNAVAILABLE", "Address already in use", "error:", "E1", "E0"):
            hits = [ln for ln in lines if marker in ln and "CudaDriverHelper" not in ln and "NVML" not in ln]
            if hits:
                return hits[0].strip()[:400]
        return lines[-1].strip()[:400] if lines else "no output"

    def model_states(self) -> dict[str, str]:
        """Model name -> state (``READY``, ``UNAVAILABLE`` ...) from the repository index.

        Raises:
            UserError: the server did not answer the index.
        """
        status, body = self._control("index", 5.0)
        if status != 200:
            raise UserError(f"tritonserver's repository index: {status} {body.strip()[:200]}")
        return {m["name"]: m.get("state", "") for m in json.loads(body)}

    def stubs(self) -> dict[str, list[int]]:
        """Model name -> the pids of its Python backend stub processes (:func:`stubs_of`); their
        shared-memory regions are noted for :meth:`stop`."""
        found = {} if self.process is None else stubs_of(self.process.pid)
        self._regions.update(regions_of([pid for pids in found.values() for pid in pids]))
        return found

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """Stop the server by its process id (SIGTERM to the server, which unloads its models; SIGKILL to its
        group after ``timeout_s``, and to stubs left in it), then remove the Python backend's shared-memory
        regions its stubs left behind (those seen while it ran too: a server that died has no stubs left to
        name them); returns its exit code."""
        self.stubs()
        p, self.process = self.process, None
        code = None
        if p is not None:
            regions = sorted(self._regions)
            code = p.poll()
            if code is None:
                _signal(p.pid, signal.SIGTERM)  # the server alone first: it unloads its models, their stubs exit
                try:
                    code = p.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    _signal_group(p.pid, signal.SIGKILL)
                    code = p.wait(10)
            _signal_group(p.pid, signal.SIGKILL)  # stubs left in the group, if any
            remove_regions(regions)
        self._stop_watchdog()
        shutil.rmtree(self.scratch, ignore_errors=True)  # the backends copy, and the log unless it was given
        return code

    def _stop_watchdog(self) -> None:
        """Close the watchdog's pipe (the group it guards is gone by now): it exits; reaped, bounded."""
        w, self._watchdog = self._watchdog, None
        if w is None:
            return
        w.stdin.close()
        try:
            w.wait(10)
        except subprocess.TimeoutExpired:
            w.kill()
            w.wait(10)

    def __enter__(self) -> "TritonServer":
        if self.process is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
_PR_SET_PDEATHSIG = 1


def _child_setup(die_with_parent: bool) -> Callable[[], None]:
    """The server's ``preexec_fn``: SIGINT / SIGTERM unblocked and, with ``die_with_parent``,
    ``PR_SET_PDEATHSIG(SIGKILL)``. The death signal comes when the *thread* that forked the child
    ends, so only a server started from the main thread gets it (the main thread ends with the
    process); a parent already gone before the prctl: the child kills itself."""
    libc = ctypes.CDLL(None, use_errno=True) if die_with_parent and sys.platform.startswith("linux") else None
    parent = os.getpid()

    def setup() -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
        if libc is not None:
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGKILL)
    return setup


# The watchdog: blocks on its stdin, a pipe only this process writes to; at EOF (this process ended,
# however: even SIGKILL) it kills the server's process group (the server and its Python backend stubs),
# removes the shared-memory regions of the stubs it found in the group (named in their command lines,
# :func:`regions_of`) and the server's scratch folder (the backends copy, the default log).
_WATCHDOG = ("import os, shutil, signal, sys\n"
             "for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):\n    signal.signal(s, signal.SIG_IGN)\n"
             "sys.stdin.buffer.read()\n"
             "group, prefix, regions = int(sys.argv[1]), sys.argv[3].encode(), []\n"
             "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
             "    try:\n"
             "        argv = open('/proc/' + pid + '/cmdline', 'rb').read().split(b'\\0')\n"
             "        if os.getpgid(int(pid)) == group and len(argv) > 2 and argv[2].strip(b'/').startswith(prefix):\n"
             "            regions.append(argv[2].strip(b'/'))\n"
             "    except OSError:\n        pass\n"
             "try:\n    os.killpg(group, signal.SIGKILL)\nexcept OSError:\n    pass\n"
             "for r in regions:\n    try:\n        os.unlink(b'/dev/shm/' + r)\n    except OSError:\n        pass\n"
             "shutil.rmtree(sys.argv[2], ignore_errors=True)\n")


def _start_watchdog(server_pid: int, scratch: Path) -> subprocess.Popen:
    """A process of its own session that kills ``server_pid``'s group and removes ``scratch`` once this
    process is gone: the stubs outlive a killed server otherwise (most exit about 2 s after it, the
    router's stub was seen to stay), and PR_SET_PDEATHSIG reaches only the server, and only from the
    main thread."""
    return subprocess.Popen([sys.executable, "-S", "-c", _WATCHDOG, str(server_pid), str(scratch), SHM_REGION],
                            stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _stat(pid: int) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command name (state, ppid, pgrp, ...); [] when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def cmdline(pid: int) -> list[str]:
    """The command line of ``pid`` ([] when gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0")[:-1]]
    except OSError:
        return []


def stubs_of(server_pid: int) -> dict[str, list[int]]:
    """Model name -> the pids of its Python backend stubs: the server's children running
    ``triton_python_backend_stub <repository>/<model>/<version>/model.py <shm region> ... <instance>``."""
    found: dict[str, list[int]] = {}
    for pid in children(server_pid):
        argv = cmdline(pid)
        if len(argv) > 1 and Path(argv[0]).name == STUB:
            found.setdefault(Path(argv[1]).parent.parent.name, []).append(pid)
    return found


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    fields = _stat(pid)
    return bool(fields) and fields[0] not in ("Z", "X")


def children(pid: int) -> list[int]:
    """The pids of ``pid``'s live children (from ``/proc``)."""
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if len(fields) > 1 and int(fields[1]) == pid and fields[0] not in ("Z", "X"):
                out.append(int(entry.name))
    return out


def shm_regions(server_pid: int) -> list[str]:
    """The shared-memory regions (names under ``/dev/shm``) of the server's Python backend stubs
    (:func:`stubs_of`, :func:`regions_of`)."""
    return regions_of([pid for group in stubs_of(server_pid).values() for pid in group])


def regions_of(stub_pids: Sequence[int]) -> list[str]:
    """The shared-memory regions of these Python backend stubs: the argument after the model file in
    each one's command line."""
    names = [argv[2].strip("/") for argv in map(cmdline, stub_pids) if len(argv) > 2]
    return [n for n in names if n.startswith(SHM_REGION) and "/" not in n]


def remove_regions(regions: Sequence[str]) -> None:
    """Remove the named shared-memory regions that are still there (their stubs are gone)."""
    for name in regions:
        try:
            os.unlink(os.path.join("/dev/shm", name.strip("/")))
        except OSError:
            pass


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# --- `elastic-export serve DIR` -------------------------------------------------------------------
def default_budget_backend(install: ServerInstall) -> str:
    """``python`` where the server has no onnxruntime backend (the ``nvidia-pytriton`` wheel), else ``auto``."""
    return "auto" if (install.backends / "onnxruntime").is_dir() else "python"


_PLATFORM = {"onnxruntime": "onnxruntime_onnx", "python": "python", "tensorrt": "tensorrt_plan"}  # --budget-backend


def ensure_repository(directory: Path, budget_backend: str, policy: str | None, slo_ms: float | None,
                      echo: Callable[[str], None], slo_quantile: float | None = None,
                      max_sparsity: float | None = None) -> dict:
    """``DIR/triton/`` as asked: built when missing, when it was built with other serving settings (a setting
    left None accepts what the repository has), when its search model is not of the directory's index
    (one built, replaced or removed since), or when its Python model files are another elastic-export's
    (:func:`~elastic_export.targets.triton.stale_model_files`).

    Returns:
        The manifest's ``triton`` entry.
    """
    from elastic_export.core.manifest import Manifest
    from elastic_export.targets.triton import build_repository, stale_model_files

    manifest = Manifest.load(directory)
    entry = manifest.triton
    models = entry.get("models", []) if isinstance(entry, dict) else []
    platform = _PLATFORM.get(budget_backend)
    asked = {"policy": policy, "slo_ms": slo_ms, "slo_quantile": slo_quantile, "max_sparsity": max_sparsity}
    same = (bool(models) and (directory / entry.get("dir", "triton")).is_dir()
            and (platform is None or all(m.get("platform") == platform for m in models))
            and all(v is None or entry.get(k) == v for k, v in asked.items())
            and (entry.get("search") or {}).get("index") == (manifest.index or None)
            and "index" in entry)  # built before the indexing lane: build it anew
    stale = stale_model_files(directory / entry["dir"], entry) if same else []
    if stale:
        echo(f"rebuilding {directory / entry['dir']}: {stale[0]}{f' and {len(stale) - 1} more' if len(stale) > 1 else ''} "
             "not this elastic-export's")
    elif same:
        echo(f"serving the existing {directory / entry['dir']}")
        return entry
    kind = "cpu" if budget_backend == "python" else "auto"
    extra = {k: v for k, v in (("slo_quantile", slo_quantile), ("max_sparsity", max_sparsity)) if v is not None}
    return build_repository(directory, platform=budget_backend, policy=policy, slo_ms=slo_ms, kind=kind, echo=echo,
                            **extra).triton


def check_serving_options(slo_ms: float | None, slo_quantile: float | None, max_sparsity: float | None) -> None:
    """Refuse serving settings out of range (before anything starts)."""
    if slo_ms is not None and not slo_ms > 0:
        raise UserError(f"--slo-ms must be positive, got {slo_ms:g}")
    if slo_quantile is not None and not 0 < slo_quantile < 1:
        raise UserError(f"--slo-quantile must be in (0, 1), e.g. 0.99, got {slo_quantile:g}")
    if max_sparsity is not None and not 0 <= max_sparsity < 1:
        raise UserError(f"--max-sparsity must be in [0, 1), got {max_sparsity:g}")


def serve(directory: str | Path, *, port: int = 8000, host: str = "127.0.0.1", budget_backend: str | None = None,
          policy: str | None = None, slo_ms: float | None = None, slo_quantile: float | None = None,
          max_sparsity: float | None = None, allow_model_control: bool = False,
          ready_timeout_s: float = READY_TIMEOUT_S, echo: Callable[[str], None] = print,
          wait: Callable[[TritonServer], None] | None = None, exposure: Exposure | None = None) -> int:
    """Serve ``DIR``'s Triton repository (built when missing) in the foreground until the process is
    interrupted (Ctrl-C / SIGTERM); returns the server's exit code.

    The budget models load first; the router loads only once every one of them is READY (explicit
    model control), so the router is never READY in front of a missing budget model; the search model
    (with an index) loads last, in front of the router. The
    model-repository API is closed to clients unless ``allow_model_control``. While serving
    (:class:`Supervisor`, unless ``wait`` replaces it) a model whose stub dies is reloaded. ``exposure``: the
    API's key and limits, and Triton's ports on loopback unless exposed; SIGTERM drains the API first
    (:func:`shut_down`).

    Raises:
        UserError: no server, a busy port, a model that does not load, or a server that dies.
    """
    from elastic_export.core.fileio import existing_dir

    door = exposure or Exposure()
    check_serving_options(slo_ms, slo_quantile, max_sparsity)
    door.check(host)
    d = existing_dir(directory)
    install = find_server()
    check_ports(door.triton_host(host), port, api_host=host)
    entry = ensure_repository(d, budget_backend or default_budget_backend(install), policy, slo_ms, echo,
                              slo_quantile=slo_quantile, max_sparsity=max_sparsity)
    server = TritonServer(d / entry["dir"], host=door.triton_host(host), port=port, open_control=allow_model_control,
                          exposed=door.expose_triton)
    term = signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM while starting: stop the server, as Ctrl-C does
    api = None
    search = (entry.get("search") or {}).get("name")
    try:
        server.start_routed(served_models(entry), entry["router"], ready_timeout_s)
        if search:  # it encodes through the router: loaded once the router is READY
            server.load(search, ready_timeout_s)
        if allow_model_control:
            echo("the model-repository API (load / unload / index) is open to every client (--allow-model-control)")
        api = start_api(d, server, echo, host, door.limits)
        echo(ready_line(entry, server, api))
        drain = api.app.state.guard.drain if api is not None else None
        (wait or Supervisor(server, entry, echo, ready_timeout_s, on_stop=drain).run)(server)
        check_running(server)
    finally:
        code = shut_down(server, api, door.drain_timeout_s, echo)
        signal.signal(signal.SIGTERM, term)
    return code or 0


def shut_down(server: "TritonServer", api, drain_timeout_s: float, echo: Callable[[str], None]) -> int | None:
    """Drain the API (``/ready`` 503, new requests 503, those in flight answered), then stop it and the
    server, all within ``drain_timeout_s`` (a server slower than what is left is killed); the server's code."""
    start = time.monotonic()
    reserve = min(10.0, drain_timeout_s / 3)  # for the server's own stop
    if api is not None:
        guard = api.app.state.guard
        busy = guard.in_flight
        idle = api.drain(max(0.0, drain_timeout_s - reserve))
        echo(f"drained: {busy} requests in flight at the signal, "
             f"{'all answered' if idle else f'{guard.in_flight} cut off'} in {time.monotonic() - start:.1f} s")
    return server.stop(max(1.0, drain_timeout_s - (time.monotonic() - start)))


def served_models(entry: dict) -> list[str]:
    """The models that load before the router: the budget models and the indexing lane (documents)."""
    return [m["name"] for m in entry["models"]] + ([entry["index"]["name"]] if entry.get("index") else [])


def ready_line(entry: dict, server: "TritonServer", api) -> str:
    """What ``serve`` prints once everything is READY: the models and every endpoint."""
    search = entry.get("search") or {}
    found = f" + search {search['name']!r} ({search['count']} documents)" if search.get("name") else ""
    extra = f", OpenAI API {api.url}/v1" if api is not None else ""
    return (f"ready: router {entry['router']!r} + {len(entry['models'])} budget models{found}; HTTP "
            f"http://{server.http_url}, gRPC {server.grpc_url}, metrics {server.metrics_url}{extra} (Ctrl-C stops)")


def start_api(directory: Path, server: "TritonServer", echo: Callable[[str], None], host: str | None = None,
              limits: Limits | None = None):
    """The OpenAI-style embeddings API (and search, with an index) on ``host`` (default: the server's), port+3,
    in this process, in front of the router (:mod:`elastic_export.serving.http_api`) behind ``limits``' door;
    None with one line for a model it does not serve (an image encoder, no tokenizer)."""
    from elastic_export.serving.http_api import create_app, run

    try:
        app = create_app(directory, server.grpc_url, limits=limits)
    except UserError as e:
        echo(f"no OpenAI embeddings API: {e}")
        return None
    try:
        return run(app, host or server.host, server.port + 3)
    except RuntimeError as e:
        raise UserError(f"the OpenAI embeddings API did not start on port {server.port + 3}: {e}") from None


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def check_running(server: TritonServer) -> None:
    """Raises:
        UserError: the server's process is gone (by a signal, or with an exit code and its log's telling line)."""
    p = server.process
    code = None if p is None else p.poll()
    if p is None or code is None:
        return
    if code < 0:
        raise UserError(f"tritonserver (pid {p.pid}) died: killed by {signal.Signals(-code).name}")
    raise UserError(f"tritonserver (pid {p.pid}) exited with code {code} while serving: {server.failure()}")


class Supervisor:
    """``serve``'s watch over a running server, every :data:`POLL_S` until SIGINT / SIGTERM: the server
    itself (it exits: :class:`UserError`, one line) and the Python backend stubs of the models serve
    loaded (one dies: that model is reloaded through the repository API, each step logged). A model a
    client unloaded (``--allow-model-control``) is left as it is."""

    def __init__(self, server: TritonServer, entry: dict, echo: Callable[[str], None],
                 reload_timeout_s: float = READY_TIMEOUT_S, on_stop: Callable[[], None] | None = None):
        self.server, self.echo, self.reload_timeout_s, self.on_stop = server, echo, reload_timeout_s, on_stop
        self.role = {m["name"]: "budget model" for m in entry["models"]}
        if entry.get("index"):
            self.role[entry["index"]["name"]] = "indexing lane"
        self.role[entry["router"]] = "router"
        if (entry.get("search") or {}).get("name"):
            self.role[entry["search"]["name"]] = "search model"
        self.stubs = {m: pids for m, pids in server.stubs().items() if m in self.role}
        self.regions = {m: regions_of(pids) for m, pids in self.stubs.items()}  # read while the stubs live
        self.stopping = False

    def run(self, server: TritonServer | None = None) -> None:
        """Watch until SIGINT / SIGTERM (which end the watch normally)."""
        def handler(signum, frame):
            self.stopping = True
            if self.on_stop is not None:  # at once: the API's /ready turns 503 before anything else
                self.on_stop()

        old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            while not self.stopping:
                self.check_server()
                self.check_stubs()
                time.sleep(POLL_S)
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def check_server(self) -> None:
        check_running(self.server)

    def check_stubs(self) -> None:
        """Reload each model one of whose stubs is gone, unless the server no longer has it READY
        (a client unloaded it)."""
        for model, pids in list(self.stubs.items()):
            if all(alive(pid) for pid in pids) or self.stopping:
                continue
            self.check_server()  # a server that died takes its stubs with it: that is the news
            role = self.role[model]
            if self.server.model_states().get(model) != "READY":
                self.echo(f"{role} {model}: unloaded (not by serve); no longer watched")
                del self.stubs[model]
                continue
            self.echo(f"{role} {model}: stub died; reloading")
            self.reload(model, role)

    def reload(self, model: str, role: str) -> None:
        """Reload ``model`` and watch its new stubs (a failed reload: logged, no longer watched)."""
        start = time.monotonic()
        try:
            self.server.reload(model, self.reload_timeout_s)
        except UserError as e:
            self.check_server()
            self.echo(f"{role} {model}: reload failed ({e}); no longer watched")
            del self.stubs[model]
            return
        self.stubs[model] = self.server.stubs().get(model, [])
        # the dead stub's region: Triton leaves it when requests were sent to the dead stub (seen here)
        remove_regions([r for r in self.regions.get(model, []) if r not in regions_of(self.stubs[model])])
        self.regions[model] = regions_of(self.stubs[model])
        self.echo(f"{role} {model}: READY again after {time.monotonic() - start:.1f} s "
                  f"(stub pid {', '.join(map(str, self.stubs[model])) or '-'})")
