"""ManagedServer with a real HTTP server process: health wait, clean stop, crash detection, and no orphan when
its owner is killed with SIGKILL."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from generators.engines.base import EngineError
from generators.engines.server import ManagedServer


def _http_server(port: int) -> list[str]:
    return [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


async def test_start_health_stop_and_crash_detection(tmp_path):
    server = ManagedServer("http", _http_server, log_path=tmp_path / "http.log", health_path="/")
    await server.start()
    pid = server.process.pid
    assert server.alive and server.base_url.startswith("http://127.0.0.1:")
    os.kill(pid, signal.SIGKILL)
    assert await server.exited_within(5.0) and not server.alive
    await server.stop()
    await server.stop()  # idempotent
    assert not _alive(pid)


async def test_a_server_that_exits_while_starting_reports_its_log(tmp_path):
    def crashing(port: int) -> list[str]:
        return [sys.executable, "-c", "import sys; print('bad flag --nope'); sys.exit(3)"]

    server = ManagedServer("crashy", crashing, log_path=tmp_path / "crashy.log", health_path="/")
    with pytest.raises(EngineError, match=r"(?s)exited with code 3 while starting.*bad flag --nope"):
        await server.start()


def test_server_and_what_it_forks_die_with_their_owner_even_on_sigkill(tmp_path):
    """The server forks a helper into a session of its own (out of reach of a process-group kill, as a daemonizing
    engine would); a SIGKILLed owner takes both along, through the watchdog."""
    helper_pid = tmp_path / "helper.pid"
    server_code = (f"import subprocess, sys; h = subprocess.Popen(['sleep', '600'], start_new_session=True); "
                   f"open({str(helper_pid)!r}, 'w').write(str(h.pid)); "
                   f"import runpy; sys.argv = ['http.server', sys.argv[1], '--bind', '127.0.0.1']; "
                   f"runpy.run_module('http.server', run_name='__main__')")
    owner = textwrap.dedent(f"""
        import asyncio, sys, time
        from pathlib import Path
        from generators.engines.server import ManagedServer
        def cmd(port):
            return [sys.executable, "-c", {server_code!r}, str(port)]
        async def main():
            server = ManagedServer("http", cmd, log_path=Path({str(tmp_path)!r}) / "h.log", health_path="/")
            await server.start()
            print(server.process.pid, flush=True)
            time.sleep(600)
        asyncio.run(main())
    """)
    process = subprocess.Popen([sys.executable, "-c", owner], stdout=subprocess.PIPE, text=True)
    watchdog = int(process.stdout.readline())
    helper = int(helper_pid.read_text())
    assert _alive(watchdog) and _alive(helper) and os.getpgid(helper) != os.getpgid(watchdog)
    process.kill()
    process.wait()
    deadline = time.monotonic() + 15  # only ends a failing run: a process that outlived its owner lives for good
    while (_alive(watchdog) or _alive(helper)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(helper), "a process the server forked outlived its SIGKILLed owner"
    assert not _alive(watchdog), "the server outlived its SIGKILLed owner"


async def test_a_request_on_a_keep_alive_connection_the_server_dropped_is_sent_again():
    """A server closes an idle keep-alive connection when it likes (vLLM's uvicorn after 5 s), and a request sent
    on it at that moment gets no answer. Here every connection's second request is read and left unanswered:
    the engine sends it again on a new connection instead of failing (a rollout, in a training step)."""
    from generators.engines.managed import ServerOptions
    from generators.engines.vllm import VLLMEngine

    dropped = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal dropped
        for answered in range(2):
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            if answered:
                dropped += 1
                break
            body = b'{"weight_version": "0"}'
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    engine = VLLMEngine(options=ServerOptions(url=f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"))
    try:
        await engine.start()
        assert [await engine.server_weight_version() for _ in range(3)] == ["0", "0", "0"]
    finally:
        await engine.stop()
        server.close()
    assert dropped == 3  # the race happened on each request after the first, and each was answered all the same
