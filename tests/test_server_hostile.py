"""`envkit serve` against hostile clients on real sockets: stalled half-requests and silent WebSockets flood a server
whose descriptor limit is 1,024 while an honest client keeps stepping."""

from __future__ import annotations

import json
import re
import resource
import selectors
import shutil
import socket
import statistics
import sys
import threading
import time

import httpx
import pytest
from remote_envs import Server, free_port
from websockets.sync.client import connect as ws_connect

SCRIPTED = "remote_envs:ScriptedEnv"
REQUEST_TIMEOUT_S, IDLE_TIMEOUT_S = 3.0, 3.0
WS_CLOSE_TIMEOUT_S = 10.0  # the websockets library waits this long for the silent peer's close frame
UPGRADE = (b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
           b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
HALF_REQUEST = b"POST /sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Le"


def _honest_client(url: str, stop: threading.Event, latencies: list[float], errors: list[str]) -> None:
    """Steps an episode until ``stop``; each step's latency, and every error (a failure of the client itself too: a
    thread's exception would only be a warning)."""
    try:
        _steps(url, stop, latencies, errors)
    except Exception as e:  # recorded: the test asserts there was none
        errors.append(f"the honest client failed: {type(e).__name__}: {e}")


def _steps(url: str, stop: threading.Event, latencies: list[float], errors: list[str]) -> None:
    with ws_connect(url, compression=None) as ws:
        ws.send(json.dumps({"op": "create", "kwargs": {"max_turns": 10**9}}))
        ws.recv(timeout=10)
        ws.send(json.dumps({"op": "reset", "seed": 1}))
        ws.recv(timeout=10)
        while not stop.is_set():
            started = time.perf_counter()
            ws.send(json.dumps({"op": "step", "action": {"role": "assistant", "content": "x"}}))
            answer = json.loads(ws.recv(timeout=10))
            latencies.append(time.perf_counter() - started)
            if "error" in answer:
                errors.append(answer["error"]["code"])
            time.sleep(0.005)


def test_stalled_and_silent_clients_cannot_lock_out_an_honest_one():
    prlimit = shutil.which("prlimit")
    assert prlimit, "prlimit (util-linux) is needed to start the server with a 1,024-descriptor limit"
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(8192, hard), hard))  # this process holds 2,500 sockets
    port = free_port()
    server = Server([prlimit, "--nofile=1024:1024", sys.executable, "-m", "envkit.cli", "serve", SCRIPTED,
                     "--port", str(port), "--request-timeout", str(REQUEST_TIMEOUT_S),
                     "--idle-timeout", str(IDLE_TIMEOUT_S)], port=port)
    attackers: list[socket.socket] = []
    stop, latencies, errors = threading.Event(), [], []
    honest = threading.Thread(target=_honest_client, args=(f"ws://127.0.0.1:{port}/ws", stop, latencies, errors))
    try:
        honest.start()
        while not latencies:
            assert honest.is_alive(), errors
            time.sleep(0.01)
        for _ in range(500):  # silent WebSockets: a handshake, then nothing
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(UPGRADE)
            attackers.append(sock)
        for _ in range(2000):  # half a request's headers, then nothing
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(HALF_REQUEST)
            attackers.append(sock)
        flood_done = time.monotonic()
        with httpx.Client(timeout=10) as fresh:  # a new client gets in once the stalled ones are cut off
            # The deadline only ends a failing run: stalled requests that are never cut off lock the client out for
            # good, and 10x their 3 s request timeout leaves a loaded machine room.
            deadline = flood_done + 10 * REQUEST_TIMEOUT_S
            while (answer := fresh.get(server.url + "/info")).status_code == 503 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert answer.status_code == 200, answer.text
        # Likewise: a connection the server never cuts off stays open for good; 10x the 13 s the last one may take.
        answers = _read_until_closed(attackers, flood_done + 10 * (IDLE_TIMEOUT_S + WS_CLOSE_TIMEOUT_S))
    finally:
        stop.set()
        honest.join(30)
        assert not honest.is_alive(), "the honest client hung on a step"
        for sock in attackers:
            sock.close()
        server.stop()
    log = server.output()
    assert not errors and len(latencies) > 100, (errors, len(latencies), log[-4000:])
    p99 = statistics.quantiles(latencies, n=100)[98]
    print(f"honest client: {len(latencies)} steps during the flood, p50 {statistics.median(latencies) * 1e3:.1f} ms, "
          f"p99 {p99 * 1e3:.1f} ms; the server closed every attacker's connection within "
          f"{max(t for t, _ in answers) - flood_done:.1f} s of the flood")
    statuses = [int(first.split(b" ")[1]) for _, first in answers]
    assert len(statuses) == 2500 and set(statuses) <= {101, 408, 503}, set(statuses)
    assert statuses.count(503) > 1000  # past the cap, connections were answered 503 and closed at once
    assert statuses.count(408) > 0  # stalled requests that got in were cut off at the deadline
    assert statuses[:500].count(101) > 0  # silent WebSockets that got in were closed when idle
    assert re.search(r"serving at most \d+ connections instead of 4096", log), log[-2000:]
    assert "Too many open files" not in log and "Traceback" not in log, log[-3000:]


def _read_until_closed(socks: list[socket.socket], deadline: float) -> list[tuple[float, bytes]]:
    """For each socket, when it read EOF (or was reset) and the first line the server sent; fails if any is still
    open at ``deadline`` (a ``time.monotonic()`` value)."""
    selector = selectors.DefaultSelector()
    received: dict[socket.socket, bytes] = {}
    for sock in socks:
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
        received[sock] = b""
    closed: dict[socket.socket, float] = {}
    while len(closed) < len(socks):
        left = deadline - time.monotonic()
        if left <= 0:
            pytest.fail(f"{len(socks) - len(closed)} attacker connections still open past the deadline")
        for key, _ in selector.select(timeout=min(left, 1.0)):
            sock = key.fileobj
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                data = b""
            if data:
                received[sock] += data
            else:
                selector.unregister(sock)
                closed[sock] = time.monotonic()
    selector.close()
    return [(closed[sock], received[sock].split(b"\r\n", 1)[0]) for sock in socks]


def test_a_body_that_trickles_in_is_cut_off_at_the_deadline():
    """Headers complete, then the body a byte at a time: the deadline covers the body too, and the server lives."""
    port = free_port()
    with Server([sys.executable, "-m", "envkit.cli", "serve", SCRIPTED, "--port", str(port),
                 "--request-timeout", "1"], port=port) as server:
        with socket.create_connection(("127.0.0.1", port)) as slow:
            slow.sendall(b"POST /sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{")
            # An ordering, not a clock: a byte every 0.2 s or so completes the body after about 20 s (20x the 1 s
            # deadline), so the 408 must come while the body is still short. A deadline that missed the body would
            # let it complete and get another answer.
            sent, answer = 1, b""
            slow.settimeout(0.2)
            while sent < 100:
                try:
                    slow.sendall(b" ")
                    sent += 1
                    chunk = slow.recv(4096)
                except TimeoutError:
                    continue
                except (BrokenPipeError, ConnectionResetError):
                    break
                if not chunk:
                    break
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 408 "), (sent, answer)
            assert b'"request_timeout"' in answer and sent < 100, (sent, answer)
        assert httpx.post(server.url + "/sessions", json={}).status_code == 201  # the server carries on
