"""The API's door as plain ASGI middleware (no server): the drain's answers and when it ends, on an injected
clock. The live drain against a real ``serve`` is tests/test_api_exposure.py's."""

import asyncio

from elastic_export.serving.api_guard import DRAIN_QUIET_S, Guard, Limits


class Clock:
    """A clock that moves only when the code under test sleeps, and a hook run at each sleep."""

    def __init__(self):
        self.t, self.on_sleep = 100.0, None

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s
        if self.on_sleep:
            self.on_sleep(self.t)


async def _ok(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


def call(guard: Guard, path: str = "/v1/embeddings") -> tuple[int, dict]:
    """One request through the door: its status and headers."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": path, "method": "POST", "headers": []}
    asyncio.run(guard(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}


def test_draining_refuses_new_requests_503_retry_after_and_closes_connections():
    clock = Clock()
    guard = Guard(_ok, Limits(), clock=clock, sleep=clock.sleep)
    status, headers = call(guard)
    assert status == 200 and "connection" not in headers
    guard.drain()
    status, headers = call(guard)
    assert status == 503 and headers["retry-after"] == "1" and headers["connection"] == "close"
    assert call(guard, "/ready")[0] == 503 and call(guard, "/health")[0] == 200


def test_the_drain_ends_after_the_quiet_period_not_before():
    clock = Clock()
    guard = Guard(_ok, Limits(), clock=clock, sleep=clock.sleep)
    guard.drain()
    start = clock()
    assert guard.wait_drained(timeout_s=30)
    assert DRAIN_QUIET_S <= clock() - start < DRAIN_QUIET_S + 0.1


def test_the_drain_waits_while_clients_keep_sending_and_for_requests_in_flight():
    clock = Clock()
    guard = Guard(_ok, Limits(), clock=clock, sleep=clock.sleep)
    guard.drain()
    start = clock()
    refused = []

    def client(t):  # a request every 0.5 s for 5 s, then silence; one held in flight until 6 s
        if t - start < 5 and round((t - start) / 0.02) % 25 == 0:
            refused.append(call(guard)[0])
        guard.in_flight = 1 if t - start < 6 else 0

    clock.on_sleep = client
    assert guard.wait_drained(timeout_s=30)
    assert set(refused) == {503} and len(refused) >= 9
    assert 5 + DRAIN_QUIET_S - 0.6 <= clock() - start < 6.1 + DRAIN_QUIET_S  # after the last request
    assert clock() - start >= 6  # and never before the one in flight was answered


def test_the_drain_is_bounded_and_says_whether_everything_was_answered():
    clock = Clock()
    guard = Guard(_ok, Limits(), clock=clock, sleep=clock.sleep)
    guard.drain()
    guard.in_flight = 1  # never answered
    start = clock()
    assert not guard.wait_drained(timeout_s=3)
    assert 3 <= clock() - start < 3.1
