"""Drain and replicas under open-loop load (issue 54's last two figures), against real ``elastic-export serve``.

On loopback, with the default MiniLM artifacts (hard-linked copies, less ``triton/`` and ``index/``), the API key
in the environment, and every request one short query (``POST /v1/embeddings``, ``input_type`` query), bounded:

* capacity: a closed loop of 8 clients for a few seconds against one replica, then through nginx in front of two
  (the combined capacity is that measured figure, not twice one replica's);
* drain: one ``serve``, seeded Poisson arrivals at 0.5x one replica's capacity for 20 s, SIGTERM at 10 s:
  answered / 503 / refused at connect once the listener closed / lost (anything else), the requests in flight at
  the signal and how each ended, ``serve``'s exit time against ``--drain-timeout``, nothing left behind;
* replicas: two ``serve`` behind nginx (``tests/test_replicas.py``'s config: retry on the next replica), Poisson
  at 0.8x the combined capacity for 20 s, one replica SIGKILLed at 10 s: lost (non-200 after nginx's retries),
  p50 / p99 of the 5 s after the kill; then a fresh replica, nginx reloaded onto it and the survivor, the same
  load with SIGTERM on one: errors.

Every process started here is stopped by its pid (SIGTERM / SIGQUIT, then SIGKILL of its group, bounded).

Usage:
    python benchmarks/replicas.py [--quick] [--seed 0] [--phase-s 20] [--artifacts DIR] [--no-write]

Writes benchmarks/results/replicas.{json,md} unless ``--no-write`` (``--quick``: 6 s phases, never written).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from _helpers import link_copy, stop_process  # noqa: E402
from serve_triton import DEFAULT_ARTIFACTS, ensure_artifacts, machine, phase_times, write_results  # noqa: E402
from test_api_exposure import KEY, assert_nothing_left, auth, start_serve  # noqa: E402
from test_replicas import Nginx  # noqa: E402

from elastic_export.serving.api_guard import API_KEY_ENV  # noqa: E402

CLIENTS = 8  # the closed loop measuring capacity
CAPACITY_S, WARMUP_S = 8.0, 1.0  # each capacity loop; its first WARMUP_S not counted
DRAIN_LOAD, REPLICA_LOAD = 0.5, 0.8  # x one replica's capacity / x the two replicas' combined capacity
REQUEST_TIMEOUT_S = 30.0  # every request
DRAIN_TIMEOUT_S = 30.0  # serve's --drain-timeout (its default, passed explicitly)
AFTER_S = 5.0  # the window after the kill whose latency is stated
QUERIES = ("how do I sort a list", "cheap flights to lisbon", "what is a transformer model", "reset my password",
           "best pizza near me", "python async http client", "symptoms of the flu", "convert pdf to text",
           "weather tomorrow in oslo", "how to tie a tie", "rust borrow checker error", "train times to leeds")


def query(i: int) -> dict:
    return {"model": "elastic", "input": f"{QUERIES[i % len(QUERIES)]} {i}", "input_type": "query"}


async def post(client, url: str, i: int, t0: float) -> dict:
    """One bounded query: start and end (s after ``t0``), latency and outcome (``200``, ``503 CODE``, ``ConnectError``
    when the connection was refused, or the error's name)."""
    import aiohttp

    start = time.monotonic()
    try:
        async with client.post(url, json=query(i), headers=auth()) as r:
            outcome, text = str(r.status), await r.text()
        if outcome == "503":
            try:
                outcome += " " + str(json.loads(text)["error"]["code"])
            except Exception:  # nginx's own page, not the API's
                outcome += " html"
    except aiohttp.ClientConnectorError:
        outcome = "ConnectError"  # nothing was sent
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        outcome = type(e).__name__
    end = time.monotonic()
    return {"t": start - t0, "end": end - t0, "ms": (end - start) * 1e3, "outcome": outcome}


def client(concurrency: int):
    """An aiohttp session (about a quarter of httpx's CPU a request, on the replicas' own cores)."""
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=max(concurrency, 16)),
                                 timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S))


async def closed_loop(api: str, seconds: float, clients: int = CLIENTS) -> dict:
    """``clients`` clients back to back for ``seconds``: answered requests/s after the first :data:`WARMUP_S`."""
    t0, recs = time.monotonic(), []

    async def worker(k: int) -> None:
        i = k
        while time.monotonic() - t0 < seconds:
            recs.append(await post(c, api + "/v1/embeddings", i, t0))
            i += clients

    async with client(clients) as c:
        await asyncio.gather(*(worker(k) for k in range(clients)))
    counted = [r for r in recs if r["t"] >= WARMUP_S and r["end"] <= seconds]
    ok = [r["ms"] for r in counted if r["outcome"] == "200"]
    return {"rps": len(ok) / (seconds - WARMUP_S), "requests": len(counted), "not_200": len(counted) - len(ok),
            "p50_ms": float(np.percentile(ok, 50)) if ok else None, "seconds": seconds, "clients": clients}


async def open_loop(api: str, times: np.ndarray, act_at: float, act) -> tuple[list[dict], float]:
    """Each query sent at its time (never waiting for earlier answers); ``act()`` called at ``act_at`` s.
    Returns the records and the time (s after the start) of the action."""
    t0, tasks, acted = time.monotonic(), [], []

    async def action() -> None:
        await asyncio.sleep(max(0.0, t0 + act_at - time.monotonic()))
        acted.append(time.monotonic() - t0)
        act()

    async with client(256) as c:
        fired = asyncio.ensure_future(action())
        for i, t in enumerate(times):
            delay = t0 + t - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(post(c, api + "/v1/embeddings", i, t0)))
        recs = await asyncio.gather(*tasks)
        await fired
    return list(recs), acted[0]


# --- pure summaries (tests/test_replicas_bench.py) ---------------------------------------------------
def kind(outcome: str, t: float, closed_at: float | None) -> str:
    """``answered`` (200), ``503``, ``closed`` (refused at connect once the API's listener had closed: nothing
    was sent) or ``lost`` (anything else: another status, a timeout, a dropped connection)."""
    if outcome == "200":
        return "answered"
    if outcome.startswith("503"):
        return "503"
    if outcome == "ConnectError" and closed_at is not None and t >= closed_at:
        return "closed"
    return "lost"


def counts(recs: list[dict], closed_at: float | None = None) -> dict[str, int]:
    out = {"offered": len(recs), "answered": 0, "503": 0, "closed": 0, "lost": 0}
    for r in recs:
        out[kind(r["outcome"], r["t"], closed_at)] += 1
    return out


def in_flight(recs: list[dict], at: float) -> dict:
    """The requests sent before ``at`` and not yet answered then: how many, how each ended, whether every one was
    answered 200, and how many were lost (a 503 here is one that reached the server only after ``at``)."""
    held = [r for r in recs if r["t"] < at < r["end"]]
    return {"n": len(held), "outcomes": tally(r["outcome"] for r in held),
            "all_answered": all(r["outcome"] == "200" for r in held),
            "lost": sum(kind(r["outcome"], r["t"], None) == "lost" for r in held)}


def window(recs: list[dict], start: float, span: float) -> dict:
    """Latency of the requests sent in ``[start, start + span)``: n, p50, p99, max (ms), and their non-200s."""
    sel = [r for r in recs if start <= r["t"] < start + span]
    ms = np.array([r["ms"] for r in sel]) if sel else np.zeros(0)
    stat = (lambda q: float(np.percentile(ms, q))) if len(ms) else (lambda q: None)
    return {"n": len(sel), "p50_ms": stat(50), "p99_ms": stat(99), "max_ms": stat(100),
            "not_200": sum(r["outcome"] != "200" for r in sel)}


def tally(outcomes) -> dict[str, int]:
    out: dict[str, int] = {}
    for o in outcomes:
        out[o] = out.get(o, 0) + 1
    return out


def compact(recs: list[dict]) -> list[list]:
    """Per-request records for the JSON: [sent s, ms, outcome]."""
    return [[round(r["t"], 3), round(r["ms"], 1), r["outcome"]] for r in recs]


# --- the runs ------------------------------------------------------------------------------------------
def waiter(p, into: dict) -> None:
    """A thread noting when ``p`` exits (``into["exit"]``, monotonic), bounded; :func:`wait_bounded` joins it."""
    def run() -> None:
        try:
            p.wait(DRAIN_TIMEOUT_S + 60)
            into["exit"] = time.monotonic()
        except Exception:  # still running past the bound: the caller sees no "exit"
            pass
    into["waiter"] = threading.Thread(target=run, daemon=True)
    into["waiter"].start()


def wait_bounded(p, noted: dict) -> None:
    """Wait for a signalled serve up to the drain bound and a minute (past that, the caller's stop kills it),
    and for its :func:`waiter` to note the exit (the two wait side by side: reading ``noted`` before the
    waiter woke read no exit)."""
    try:
        p.wait(DRAIN_TIMEOUT_S + 60)
    except subprocess.TimeoutExpired:
        print(f"serve {p.pid} still running {DRAIN_TIMEOUT_S + 60:g} s after its signal")
    if "waiter" in noted:
        noted.pop("waiter").join(10)


def nothing_left(procs: list) -> bool:
    """Every serve (by its pid), its tritonserver, the server's group and serve's children gone."""
    try:
        for p in procs:
            assert_nothing_left(p)
        return True
    except AssertionError as e:
        print(f"left behind: {e}")
        return False


def signalled(url: str, rate: float, seconds: float, seed: int, act, log: Path | None = None) -> dict:
    """Poisson at ``rate`` for ``seconds``, ``act()`` half-way: counts, latency before and after, nginx's retries."""
    times, _ = phase_times([rate], [seconds], seed)
    err = log.parent / "error.log" if log else None
    lines_before = len(log.read_text().splitlines()) if log else 0
    err_before = len(err.read_text()) if err else 0
    recs, at = asyncio.run(open_loop(url, times, seconds / 2, act))
    out = {"rate": rate, "seconds": seconds, "seed": seed, "signal_s": at, **counts(recs),
           "before": window(recs, at - AFTER_S, AFTER_S), "after": window(recs, at, AFTER_S),
           "not_200": tally(r["outcome"] for r in recs if r["outcome"] != "200"), "records": compact(recs)}
    if log:
        new = log.read_text().splitlines()[lines_before:]
        out["nginx_retried"] = sum("," in x.split(" ", 1)[1] for x in new if " " in x)
        out["nginx_not_200"] = dict(sorted(tally(x for x in new if not x.startswith("200 ")).items(),
                                           key=lambda kv: -kv[1])[:8])  # "status upstream_statuses upstream_addrs"
        out["nginx_no_live_upstreams"] = err.read_text()[err_before:].count("no live upstreams")
    out["_recs"] = recs
    return out


def drained_line(p) -> str | None:
    return next((x for x in p.lines if x.startswith("drained:")), None)


def drain_phase(art: Path, args) -> tuple[dict, dict]:
    """One serve: its closed-loop capacity, then Poisson at 0.5x of it with SIGTERM half-way."""
    p, port = start_serve(art, "--drain-timeout", f"{DRAIN_TIMEOUT_S:g}", env={API_KEY_ENV: KEY})
    api, noted = f"http://127.0.0.1:{port + 3}", {}
    try:
        cap = asyncio.run(closed_loop(api, args.capacity_s))
        print(f"one replica: {cap['rps']:.1f} requests/s answered ({CLIENTS} clients, closed loop)", flush=True)

        def term() -> None:
            noted["signal"] = time.monotonic()
            p.send_signal(signal.SIGTERM)
            waiter(p, noted)

        run = signalled(api, DRAIN_LOAD * cap["rps"], args.phase_s, args.seed, term)
        recs = run.pop("_recs")
        wait_bounded(p, noted)
    finally:
        stop_process(p)
    connect = [r["t"] - run["signal_s"] for r in recs if r["outcome"] == "ConnectError"]
    run.update(counts(recs, closed_at=run["signal_s"]))
    run.update({"in_flight": in_flight(recs, run["signal_s"]), "serve_said": drained_line(p), "exit_code": p.returncode,
                "exit_s": noted["exit"] - noted["signal"] if "exit" in noted else None,
                "drain_timeout_s": DRAIN_TIMEOUT_S, "first_connect_refused_s": min(connect) if connect else None,
                "nothing_left": nothing_left([p])})
    return cap, run


def replicas_phase(art: Path, folder: Path, args) -> tuple[dict, dict, dict]:
    """Two serve behind nginx: combined capacity; SIGKILL one under 0.8x of it; a fresh one, nginx reloaded; SIGTERM."""
    env, started, nginx = {API_KEY_ENV: KEY}, [], None
    try:
        for _ in range(2):
            started.append(start_serve(art, env=env))
        nginx = Nginx(folder, [port + 3 for _, port in started])
        url, log = f"http://127.0.0.1:{nginx.port}", folder / "access.log"
        cap = asyncio.run(closed_loop(url, args.capacity_s))
        rate = REPLICA_LOAD * cap["rps"]
        print(f"two replicas through nginx: {cap['rps']:.1f} requests/s answered; load {rate:.1f}/s", flush=True)
        a, b = started[0][0], started[1][0]
        kill = signalled(url, rate, args.phase_s, args.seed + 1, lambda: os.kill(a.pid, signal.SIGKILL), log)
        a.wait(30)
        started.append(start_serve(art, env=env))
        asyncio.run(closed_loop(f"http://127.0.0.1:{started[2][1] + 3}", 2.0, clients=2))  # warm the fresh one
        nginx.reload([started[1][1] + 3, started[2][1] + 3])
        noted = {}

        def term() -> None:
            noted["signal"] = time.monotonic()
            b.send_signal(signal.SIGTERM)
            waiter(b, noted)

        term_run = signalled(url, rate, args.phase_s, args.seed + 2, term, log)
        wait_bounded(b, noted)
    finally:
        if nginx is not None:
            nginx.stop()
        for p, _ in started:
            stop_process(p)
    kill.pop("_recs")
    term_run.pop("_recs")
    term_run.update({"exit_code": b.returncode, "serve_said": drained_line(b),
                     "exit_s": noted["exit"] - noted["signal"] if "exit" in noted else None})
    left = nothing_left([p for p, _ in started])
    kill["nothing_left"] = term_run["nothing_left"] = left
    return cap, kill, term_run


# --- the report ----------------------------------------------------------------------------------------
def _ms(v) -> str:
    return "n/a" if v is None else f"{v:.0f}"


def _row(name: str, r: dict) -> str:
    a = r["after"]
    return (f"| {name} | {r['rate']:.1f} | {r['offered']} | {r['answered']} | {r['503']} | {r['closed']} | "
            f"{r['lost']} | {a['n']} | {_ms(a['p50_ms'])} | {_ms(a['p99_ms'])} | {_ms(a['max_ms'])} | "
            f"{r.get('nginx_retried', '')} |")


def report_lines(out: dict) -> list[str]:
    d, k, t = out["drain"], out["kill"], out["term"]
    one, two = out["capacity"]["one"], out["capacity"]["two_nginx"]
    f = d["in_flight"]
    exit_s = "did not exit" if d["exit_s"] is None else f"{d['exit_s']:.2f} s"
    lost_at = [f"{o} sent {t - d['signal_s']:+.3f} s from the signal" for t, _, o in d["records"]
               if kind(o, t, d["signal_s"]) == "lost"]
    lines = [f"# Drain and replicas under open-loop load ({out['date']})", "", f"Machine: {out['machine']}", "",
             f"Command: `{out['command']}`", "",
             f"Capacity (closed loop, {CLIENTS} clients, {one['seconds']:g} s, the first {WARMUP_S:g} s not counted, "
             f"short queries): one replica {one['rps']:.1f} requests/s answered (p50 {_ms(one['p50_ms'])} ms); "
             f"two replicas through nginx {two['rps']:.1f}/s (p50 {_ms(two['p50_ms'])} ms), measured, not 2x one: "
             "the replicas share the machine's cores.", "",
             "| run | offered/s | offered | 200 | 503 | refused at connect | lost | sent in the 5 s after the signal "
             "| p50 ms | p99 ms | max ms | nginx retried |", "|---|---|---|---|---|---|---|---|---|---|---|---|",
             _row(f"drain: SIGTERM at {d['signal_s']:.1f} s ({DRAIN_LOAD:g}x one)", d),
             _row(f"SIGKILL one of two at {k['signal_s']:.1f} s ({REPLICA_LOAD:g}x two)", k),
             _row(f"SIGTERM one of two at {t['signal_s']:.1f} s ({REPLICA_LOAD:g}x two)", t), "",
             f"Drain: {d['answered']} answered, {d['503']} refused 503, {d['lost']} lost {lost_at or ''} "
             f"(not 200: {d['not_200'] or 'none'}); "
             f"{d['closed']} refused at "
             f"connect once the API's listener had closed (nothing sent; the first "
             f"{'n/a' if d['first_connect_refused_s'] is None else format(d['first_connect_refused_s'], '.2f')} s after "
             f"the signal). In flight at the signal (sent before it, unanswered then): {f['n']}, ended "
             f"{f['outcomes']}: {'every one answered 200' if f['all_answered'] else str(f['lost']) + ' lost'}. serve said: "
             f"`{d['serve_said']}`; exit code {d['exit_code']}, {exit_s} after the SIGTERM (bound: --drain-timeout "
             f"{d['drain_timeout_s']:g} s); nothing left behind: {d['nothing_left']}.", "",
             f"SIGKILL: {k['lost'] + k['503'] + k['closed']} not 200 after nginx's retries ({k['not_200'] or 'none'}); "
             f"the 5 s after the kill: {k['after']['n']} requests, p50 {_ms(k['after']['p50_ms'])} ms, p99 "
             f"{_ms(k['after']['p99_ms'])} ms (the 5 s before: p99 {_ms(k['before']['p99_ms'])} ms). nginx's log: "
             f"\"no live upstreams\" {k['nginx_no_live_upstreams']} times; its non-200 lines (status, upstream "
             f"statuses, upstreams): {k['nginx_not_200'] or 'none'}.", "",
             f"SIGTERM: {t['lost'] + t['503'] + t['closed']} errors ({t['not_200'] or 'none'}); the replica exited "
             f"{t['exit_code']} after {_ms(None if t['exit_s'] is None else t['exit_s'] * 1e3)} ms; serve said "
             f"`{t['serve_said']}`; nginx's \"no live upstreams\" {t['nginx_no_live_upstreams']} times, non-200 lines "
             f"{t['nginx_not_200'] or 'none'}. Nothing left behind (every serve, tritonserver, stub and watchdog): "
             f"{k['nothing_left']}.", "",
             f"Open loop: seeded Poisson arrivals (`phase_times`, seed {out['seed']}), {out['phase_s']:g} s a run, the "
             f"signal half-way, every request one short query bounded at {REQUEST_TIMEOUT_S:g} s, one "
             "aiohttp session in one process on the same machine. Lost = anything but 200, 503 and (drain only) a "
             "connection refused after the signal. nginx: tests/test_replicas.py's config (`proxy_next_upstream error "
             "timeout http_502 http_503 non_idempotent`, 3 tries, `max_fails=0`); before the SIGTERM "
             "run nginx was reloaded onto the survivor and a fresh replica. One run; the figures move with the "
             "machine's load.", ""]
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifacts", type=Path, default=DEFAULT_ARTIFACTS)
    ap.add_argument("--phase-s", type=float, default=20.0, help="seconds of each open-loop run (signal half-way)")
    ap.add_argument("--capacity-s", type=float, default=CAPACITY_S)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 6 s runs, 4 s capacity, nothing written")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.phase_s, args.capacity_s, args.no_write = 6.0, 4.0, True
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    d = ensure_artifacts(args.artifacts)
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="replicas-") as tmp:
        art = link_copy(d, Path(tmp) / "art", ignore=("triton", "index"))
        nginx_dir = Path(tmp) / "nginx"
        nginx_dir.mkdir()
        one, drain = drain_phase(art, args)
        two, kill, term = replicas_phase(art, nginx_dir, args)
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
           "command": " ".join(["python benchmarks/replicas.py", *(sys.argv[1:] if argv is None else argv)]),
           "seed": args.seed, "phase_s": args.phase_s, "artifacts": str(d), "clients": CLIENTS,
           "capacity": {"one": one, "two_nginx": two}, "drain": drain, "kill": kill, "term": term,
           "wall_s": time.monotonic() - t_start}
    text = "\n".join(report_lines(out))
    if args.no_write:
        print(text)
    else:
        write_results("replicas", out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
