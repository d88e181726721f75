"""HttpConnection against a real HTTP server on loopback: keep-alive, chunked and large answers, closes, timeouts,
cancellation, answers that are not HTTP or that nobody asked for, header injection, TLS, uvloop."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from collections.abc import AsyncIterator

import pytest
import trustme
import uvloop

from envkit.remote.httpclient import HttpClosedError, HttpConnection

seen: list[tuple[int, bytes, bytes]] = []  # (connection number, request head, body) per request
connections: list[int] = []


async def _answer(path: str, body: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """Answer one request by its path; False closes the connection afterwards."""
    command, _, arg = path.lstrip("/").partition("/")
    if command == "echo":
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
    elif command == "status":
        text = b"no such thing"
        writer.write(b"HTTP/1.1 %s X\r\ncontent-length: %d\r\n\r\n%s" % (arg.encode(), len(text), text))
    elif command == "empty":
        writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
    elif command == "chunked":
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n3\r\ndef\r\n0\r\n\r\n")
    elif command == "big":
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 3000000\r\n\r\n")
        for _ in range(30):
            writer.write(b"x" * 100_000)
            await writer.drain()
    elif command == "last":
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 3\r\n\r\nbye")
        return False
    elif command == "sleep":
        # A client that gave up closes the connection (read() then returns b""): no one is left to answer, and a
        # long sleep keeps no task behind. Nothing else arrives meanwhile: a client sends one request at a time.
        try:
            await asyncio.wait_for(reader.read(1), float(arg))
        except TimeoutError:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nlate")
        else:
            return False
    elif command == "half":
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly some")
        return False
    elif command == "garbage":
        writer.write(b"SMTP ready\r\n\r\n")
    elif command == "twice":
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\noneHTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\ntwo")
    return True


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    number = len(connections)
    connections.append(number)
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            length = next((int(line.split(":", 1)[1]) for line in lines if line.lower().startswith("content-length:")),
                          0)
            body = await reader.readexactly(length)
            seen.append((number, head, body))
            keep = await _answer(lines[0].split(" ")[1], body, reader, writer)
            await writer.drain()
            if not keep:
                break
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


@contextlib.asynccontextmanager
async def http_server(tls: ssl.SSLContext | None = None) -> AsyncIterator[str]:
    server = await asyncio.start_server(_serve, "127.0.0.1", 0, ssl=tls)
    async with server:
        port = server.sockets[0].getsockname()[1]
        yield f"{'https' if tls else 'http'}://127.0.0.1:{port}"


@pytest.fixture
async def origin() -> AsyncIterator[str]:
    async with http_server() as address:
        yield address


async def test_answers_of_every_framing_come_back_on_one_kept_alive_connection(origin: str):
    conn = await HttpConnection.connect(origin, headers={"Authorization": "Bearer right"})
    first = len(seen)
    assert await conn.request("POST", "/echo", b'{"a": 1}', 5) == (200, b'{"a": 1}')
    assert await conn.request("GET", "/status/404", None, 5) == (404, b"no such thing")
    assert await conn.request("DELETE", "/empty", None, 5) == (204, b"")
    assert await conn.request("GET", "/chunked", None, 5) == (200, b"abcdef")
    assert await conn.request("GET", "/big", None, 5) == (200, b"x" * 3_000_000)  # no size limit on answers
    assert await conn.request("POST", "/echo", b"again", 5) == (200, b"again")
    requests = seen[first:]
    assert len({number for number, _, _ in requests}) == 1  # one connection for all six
    head = requests[0][1].decode()
    assert head.startswith("POST /echo HTTP/1.1\r\n")
    assert "Authorization: Bearer right\r\n" in head
    assert f"host: {origin.split('//')[1]}\r\n" in head and "content-length: 8\r\n" in head
    await conn.close()
    assert conn.closed
    await conn.close()  # idempotent


async def test_an_answer_that_says_connection_close_ends_the_connection(origin: str):
    conn = await HttpConnection.connect(origin)
    assert await conn.request("GET", "/last", None, 5) == (200, b"bye")
    assert conn.closed
    with pytest.raises(HttpClosedError, match="closed"):
        await conn.request("GET", "/echo", None, 5)


async def test_a_timeout_closes_the_connection_so_a_late_answer_is_never_misread(origin: str):
    conn = await HttpConnection.connect(origin)
    start = time.perf_counter()
    with pytest.raises(TimeoutError):
        # The guard only ends a wait for the 30 s answer: 100x the 0.2 s timeout, and it expires before that answer.
        async with asyncio.timeout(20) as guard:
            await conn.request("GET", "/sleep/30", None, 0.2)
    assert not guard.expired()  # the request's own 0.2 s timeout raised, not the guard
    assert time.perf_counter() - start >= 0.2  # an ordering: not before the timeout (load cannot break it)
    assert conn.closed
    with pytest.raises(HttpClosedError):
        await conn.request("POST", "/echo", b"next", 5)


async def test_many_requests_under_a_long_timeout_then_one_that_expires(origin: str):
    conn = await HttpConnection.connect(origin)
    for i in range(200):
        assert await conn.request("POST", "/echo", str(i).encode(), 0.3) == (200, str(i).encode())
    with pytest.raises(TimeoutError):  # the lazily re-armed timer still catches the slow one
        await conn.request("GET", "/sleep/1", None, 0.3)


async def test_cancelling_a_request_closes_the_connection(origin: str):
    conn = await HttpConnection.connect(origin)
    pending = asyncio.create_task(conn.request("GET", "/sleep/0.3", None, 5))
    await asyncio.sleep(0.05)
    pending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pending
    assert conn.closed


@pytest.mark.parametrize(("path", "why"), [("/half", "closed"), ("/garbage", "not HTTP/1.1")])
async def test_a_cut_short_or_non_http_answer_fails_the_request(origin: str, path: str, why: str):
    conn = await HttpConnection.connect(origin)
    with pytest.raises(HttpClosedError, match=why):
        await conn.request("GET", path, None, 5)
    assert conn.closed


async def test_an_answer_nobody_asked_for_ends_the_connection(origin: str):
    conn = await HttpConnection.connect(origin)
    assert await conn.request("GET", "/twice", None, 5) == (200, b"one")
    for _ in range(1000):  # up to 10 s, only to end a failing run: the stray answer is already on its way
        if conn.closed:
            break
        await asyncio.sleep(0.01)
    assert conn.closed
    with pytest.raises(HttpClosedError, match="nobody asked for"):
        await conn.request("POST", "/echo", b"x", 5)


async def test_one_request_at_a_time(origin: str):
    conn = await HttpConnection.connect(origin)
    first = asyncio.create_task(conn.request("GET", "/sleep/0.1", None, 5))
    await asyncio.sleep(0.01)
    with pytest.raises(RuntimeError, match="one request at a time"):
        await conn.request("POST", "/echo", b"x", 5)
    assert await first == (200, b"late")


@pytest.mark.parametrize("headers", [{"Authorization": "Bearer x\r\nX-Admin: 1"}, {"Bad Name": "v"},
                                     {"X-Token": "a\nb"}])
async def test_header_injection_is_refused_before_connecting(origin: str, headers: dict[str, str]):
    with pytest.raises(ValueError, match="header"):
        await HttpConnection.connect(origin, headers=headers)


@pytest.mark.parametrize("origin", ["ftp://127.0.0.1:1", "http://", "http://user:pw@127.0.0.1:1"])
async def test_bad_origins_are_refused(origin: str):
    with pytest.raises(ValueError):
        await HttpConnection.connect(origin)


async def test_https_verifies_the_server_against_the_trusted_cas(tmp_path, monkeypatch):
    ca = trustme.CA()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    async with http_server(context) as address:
        with pytest.raises(ssl.SSLCertVerificationError):  # an unknown CA is refused
            await HttpConnection.connect(address)
        ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
        monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "ca.pem"))  # how users trust a private CA
        conn = await HttpConnection.connect(address)
        assert await conn.request("POST", "/echo", b"secure", 5) == (200, b"secure")
        await conn.close()


def test_it_runs_on_uvloop_too():
    """uvloop's transports do not subclass asyncio.Transport, and they fill the protocol's read buffer themselves."""
    async def scenario() -> None:
        async with http_server() as address:
            conn = await HttpConnection.connect(address)
            assert await conn.request("POST", "/echo", b"hello", 5) == (200, b"hello")
            assert await conn.request("GET", "/big", None, 5) == (200, b"x" * 3_000_000)
            with pytest.raises(TimeoutError):
                await conn.request("GET", "/sleep/1", None, 0.1)
            assert conn.closed

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario())


async def test_a_closed_port_refuses():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(OSError):
        await HttpConnection.connect(f"http://127.0.0.1:{port}")


async def test_a_server_that_never_answers_times_out():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        conn = await HttpConnection.connect(f"http://127.0.0.1:{listener.getsockname()[1]}")
        with pytest.raises(TimeoutError):
            # The guard only ends a hang (a server that never answers): 100x the request's 0.2 s timeout.
            async with asyncio.timeout(20) as guard:
                await conn.request("GET", "/", None, 0.2)
        assert not guard.expired()  # the request's own 0.2 s timeout raised, not the guard
