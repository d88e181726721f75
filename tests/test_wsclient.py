"""WsConnection against a real websockets server on loopback: answers, fragments, pings, timeouts, cancellation,
closes, refused handshakes, and frames nobody asked for."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl
import time
from collections.abc import AsyncIterator

import pytest
import trustme
import uvloop
from websockets.asyncio.server import ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import InvalidStatus
from websockets.http11 import Request, Response

from envkit.remote.wsclient import WsClosedError, WsConnection

seen_headers: list[Headers] = []
closed_by_client: list[float] = []


async def handler(ws: ServerConnection) -> None:
    """Commands: ``echo:X`` answers X; ``parts:X`` answers X in 3 fragments; ``ping`` pings the client first;
    ``sleep:S`` answers after S s; ``close`` closes with 1011; ``twice`` answers two messages."""
    try:
        async for message in ws:
            command, _, arg = str(message).partition(":")
            if command == "echo":
                await ws.send(arg)
            elif command == "parts":
                await ws.send([arg[:1], arg[1:2], arg[2:]])
            elif command == "ping":
                pong = await ws.ping()
                await asyncio.wait_for(pong, 2)
                await ws.send("ponged")
            elif command == "sleep":
                # A client that gave up closes the connection: no one is left to answer, and the server's close
                # (which waits for its handlers) is not held up by a long sleep.
                try:
                    await asyncio.wait_for(ws.wait_closed(), float(arg))
                except TimeoutError:
                    await ws.send("late")
            elif command == "close":
                await ws.close(1011, "going away")
            elif command == "twice":
                await ws.send("one")
                await ws.send("two")
    finally:
        closed_by_client.append(time.monotonic())


def refuse_bad_tokens(ws: ServerConnection, request: Request) -> Response | None:
    seen_headers.append(request.headers)
    if request.headers.get("Authorization") == "Bearer wrong":
        return ws.respond(401, json.dumps({"error": {"code": "unauthorized"}}))
    return None


@contextlib.asynccontextmanager
async def ws_server() -> AsyncIterator[str]:
    async with serve(handler, "127.0.0.1", 0, process_request=refuse_bad_tokens, max_size=None) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        yield f"ws://127.0.0.1:{port}/ws"


@pytest.fixture
async def url() -> AsyncIterator[str]:
    async with ws_server() as address:
        yield address


async def test_requests_get_their_answers_including_fragmented_ones_and_after_pings(url: str):
    conn = await WsConnection.connect(url, headers={"Authorization": "Bearer right"})
    assert seen_headers[-1]["Authorization"] == "Bearer right"
    assert await conn.request("echo:hello", 5) == b"hello"
    assert await conn.request("parts:abcdef", 5) == b"abcdef"
    assert await conn.request("ping", 5) == b"ponged"  # the server's ping got its pong
    assert await conn.request("echo:" + "x" * 3_000_000, 5) == b"x" * 3_000_000  # no size limit on answers
    await conn.close()
    assert conn.closed
    await conn.close()  # idempotent


def test_it_runs_on_uvloop_too():
    """uvloop's transports do not subclass asyncio.Transport, and they fill the protocol's read buffer themselves."""
    async def scenario() -> None:
        async with ws_server() as address:
            conn = await WsConnection.connect(address)
            assert await conn.request("echo:hello", 5) == b"hello"
            assert await conn.request("parts:abcdef", 5) == b"abcdef"
            assert await conn.request("echo:" + "x" * 3_000_000, 5) == b"x" * 3_000_000
            with pytest.raises(TimeoutError):
                await conn.request("sleep:1", 0.1)
            assert conn.closed

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario())


async def test_a_timeout_closes_the_connection_so_a_late_answer_is_never_misread(url: str):
    conn = await WsConnection.connect(url)
    closes = len(closed_by_client)
    start = time.perf_counter()
    with pytest.raises(TimeoutError):
        # The guard only ends a wait for the 30 s answer: 100x the 0.2 s timeout, and it expires before that answer.
        async with asyncio.timeout(20) as guard:
            await conn.request("sleep:30", 0.2)
    assert not guard.expired()  # the request's own 0.2 s timeout raised, not the guard
    assert time.perf_counter() - start >= 0.2  # an ordering: not before the timeout (load cannot break it)
    assert conn.closed
    with pytest.raises(WsClosedError):
        await conn.request("echo:next", 5)
    for _ in range(1000):  # up to 10 s, only to end a failing run: a connection left open stays open for good
        if len(closed_by_client) > closes:
            break
        await asyncio.sleep(0.01)
    assert len(closed_by_client) == closes + 1  # the server saw the connection end


async def test_a_shorter_timeout_after_a_longer_one_still_fires_on_time(url: str):
    conn = await WsConnection.connect(url)
    assert await conn.request("echo:a", 60) == b"a"  # arms the shared timer a minute out
    with pytest.raises(TimeoutError):
        # The guard expires before the 30 s answer and the minute-long timer, which it guards against, and is 200x
        # the 0.1 s timeout.
        async with asyncio.timeout(20) as guard:
            await conn.request("sleep:30", 0.1)
    assert not guard.expired()  # the request's own 0.1 s timeout raised, not the guard


async def test_many_requests_under_a_long_timeout_then_one_that_expires(url: str):
    conn = await WsConnection.connect(url)
    for i in range(200):
        assert await conn.request(f"echo:{i}", 0.3) == str(i).encode()
    with pytest.raises(TimeoutError):  # the lazily re-armed timer still catches the slow one
        await conn.request("sleep:1", 0.3)


async def test_cancelling_a_request_closes_the_connection(url: str):
    conn = await WsConnection.connect(url)
    pending = asyncio.create_task(conn.request("sleep:0.3", 5))
    await asyncio.sleep(0.05)
    pending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pending
    assert conn.closed
    with pytest.raises(WsClosedError):
        await conn.request("echo:next", 5)


async def test_a_server_close_fails_the_waiting_request_with_its_code(url: str):
    conn = await WsConnection.connect(url)
    with pytest.raises(WsClosedError, match="1011: going away"):
        await conn.request("close", 5)
    assert conn.closed


async def test_an_answer_nobody_asked_for_ends_the_connection(url: str):
    conn = await WsConnection.connect(url)
    assert await conn.request("twice", 5) == b"one"
    for _ in range(1000):  # up to 10 s, only to end a failing run: the stray answer is already on its way
        if conn.closed:
            break
        await asyncio.sleep(0.01)
    assert conn.closed
    with pytest.raises(WsClosedError, match="nobody asked for"):
        await conn.request("echo:x", 5)


async def test_one_request_at_a_time(url: str):
    conn = await WsConnection.connect(url)
    first = asyncio.create_task(conn.request("sleep:0.1", 5))
    await asyncio.sleep(0.01)
    with pytest.raises(RuntimeError, match="one request at a time"):
        await conn.request("echo:x", 5)
    assert await first == b"late"


async def test_wss_verifies_the_server_against_the_trusted_cas(tmp_path, monkeypatch):
    ca = trustme.CA()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    async with serve(handler, "127.0.0.1", 0, ssl=context) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        with pytest.raises(ssl.SSLCertVerificationError):  # an unknown CA is refused
            await WsConnection.connect(f"wss://127.0.0.1:{port}/ws")
        ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
        monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "ca.pem"))  # how users trust a private CA
        conn = await WsConnection.connect(f"wss://127.0.0.1:{port}/ws")
        assert await conn.request("echo:secure", 5) == b"secure"
        await conn.close()


async def test_a_refused_handshake_carries_the_status_and_body(url: str):
    with pytest.raises(InvalidStatus) as refused:
        await WsConnection.connect(url, headers={"Authorization": "Bearer wrong"})
    assert refused.value.response.status_code == 401
    assert json.loads(refused.value.response.body) == {"error": {"code": "unauthorized"}}


async def test_a_server_that_never_answers_the_handshake_times_out():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with pytest.raises(TimeoutError):
            # The guard only ends a hang (a server that never answers): 100x the handshake's 0.2 s timeout.
            async with asyncio.timeout(20) as guard:
                await WsConnection.connect(f"ws://127.0.0.1:{port}/ws", timeout_s=0.2)
        assert not guard.expired()  # the handshake's own 0.2 s timeout raised, not the guard


async def test_a_closed_port_refuses():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(OSError):
        await WsConnection.connect(f"ws://127.0.0.1:{port}/ws")
