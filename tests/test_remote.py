"""RemoteEnv against a real `envkit serve` subprocess: the Env contract over REST and WebSocket, errors, retries."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import uvloop
from remote_envs import Server, envkit_serve, free_port, numpy_info

import envkit
from envkit.errors import (
    EnvError,
    EpisodeDoneError,
    InvalidTaskError,
    RemoteConnectionError,
    RemoteEnvCrashError,
    RemoteEnvError,
    RemoteEpisodeDoneError,
    RemoteInvalidTaskError,
    ResetNeededError,
)
from envkit.remote import RemoteConfig, RemoteEnv

TOKEN = "remote-token"
SCRIPTED = "remote_envs:ScriptedEnv"
CONFIG = RemoteConfig(token=TOKEN)
TRANSPORTS = ["http", "ws"]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = envkit_serve(SCRIPTED, "--step-timeout", "2", env={"ENVKIT_TOKEN": TOKEN})
    yield srv
    srv.stop()


def url(server: Server, scheme: str) -> str:
    return f"{scheme}://127.0.0.1:{server.port}/{SCRIPTED}"


def say(text: str | None) -> envkit.Message:
    return envkit.assistant(text)


def server_side(server: Server) -> httpx.AsyncClient:
    """A REST client of its own, to see or use a session as the server has it, waiting as long as need be."""
    return httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)


@pytest.mark.parametrize("scheme", TRANSPORTS)
async def test_make_with_a_url_gives_a_checked_remote_env(server: Server, scheme: str):
    env = envkit.make(url(server, scheme), remote=CONFIG, prefix="~")
    assert isinstance(env, envkit.ContractChecker) and isinstance(env.unwrapped, RemoteEnv)
    async with env:
        assert [t.name for t in env.tools] == ["echo"]  # the server's tools, once the session is open
        messages, info = await env.reset(seed=4)
        assert messages == [{"role": "user", "content": "~say w4"}] and info == {"seed": 4, "word": "w4"}
        result = await env.step(say("no"))
        assert result == envkit.StepResult([{"role": "user", "content": "~no"}], 0.0, info={"turn": 1})
        result = await env.step(say("w4"))
        assert (result.reward, result.terminated, result.done) == (1.0, True, True)
        with pytest.raises(EpisodeDoneError):  # the local ContractChecker stops it before it leaves
            await env.step(say("more"))
        state = await env.unwrapped.state()
        assert (state["episodes"], state["steps"]) == (1, 2)
        session_id = env.unwrapped.session_id
    assert env.unwrapped.session_id == session_id
    await env.close()  # idempotent


def _as_lists(value: object) -> object:
    """``value`` with every numpy array and scalar as the Python lists and numbers it holds."""
    if isinstance(value, dict):
        return {k: _as_lists(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_lists(v) for v in value]
    return value.tolist() if isinstance(value, np.ndarray | np.generic) else value


@pytest.mark.parametrize("scheme", TRANSPORTS)
async def test_numpy_values_cross_the_wire_as_json_numbers_and_lists_both_ways(server: Server, scheme: str):
    local = numpy_info()
    echo = {"n": np.int64(5), "mask": np.array([0, 1], dtype=np.int8), "x": np.float64(0.25), "on": np.bool_(False)}
    async with envkit.make(url(server, scheme), remote=CONFIG) as env:
        _, info = await env.reset(task={"word": "w", "echo": echo})
        assert info["echo"] == {"n": 5, "mask": [0, 1], "x": 0.25, "on": False}  # sent by the client as JSON
        assert type(info["echo"]["n"]) is int and type(info["echo"]["on"]) is bool
        remote = (await env.step(say("numpy info"))).info
    assert len(remote["values"]) == 10_000 and remote["values"] == local["values"].tolist()  # never cut
    assert remote["mask"] == [1, 0, 1, 0, 0, 0] and remote["columns"] == local["columns"].tolist()
    assert (type(remote["count"]), type(remote["ok"]), remote["flags"]) == (int, bool, [True, False])
    assert np.float32(remote.pop("ratio")) == local.pop("ratio")  # float32 travels as its shortest decimal
    assert remote == _as_lists(local)


def test_sync_facade_over_a_remote_env(server: Server):
    with envkit.SyncEnv(envkit.make(url(server, "http"), remote=CONFIG)) as env:
        messages, _ = env.reset(task={"word": "kiwi"})
        assert messages[0]["content"] == "say kiwi"
        assert env.step("kiwi").reward == 1.0
    with envkit.SyncEnv(envkit.make(url(server, "ws"), remote=CONFIG)) as env:
        env.reset(seed=1)
        assert env.step("w1").terminated


@pytest.mark.parametrize("scheme", TRANSPORTS)
async def test_server_errors_raise_envkit_exceptions_with_the_code(server: Server, scheme: str):
    env = envkit.make(url(server, scheme), remote=CONFIG, checked=False)  # let the server do the checking
    try:
        await env.init()
        with pytest.raises(ResetNeededError) as caught:
            await env.step(say("early"))
        assert (caught.value.code, caught.value.status) == ("reset_needed", 409)
        with pytest.raises(RemoteInvalidTaskError) as bad_task:
            await env.reset(task={"word": 1})
        assert isinstance(bad_task.value, InvalidTaskError) and bad_task.value.status == 422
        await env.reset(seed=0)
        await env.step(say("bye"))
        with pytest.raises(RemoteEpisodeDoneError) as done:
            await env.step(say("again"))
        assert isinstance(done.value, EpisodeDoneError) and done.value.code == "episode_done"
        await env.reset(seed=0)
        with pytest.raises(RemoteEnvCrashError) as crash:
            await env.step(say("crash"))
        assert isinstance(crash.value, EnvError) and (crash.value.code, crash.value.status) == ("env_error", 500)
        assert "deliberate crash" in str(crash.value) and "code env_error" in str(crash.value)
        await env.reset(seed=0)
        with pytest.raises(RemoteEnvCrashError) as hang:
            await env.step(say("hang"))
        assert (hang.value.code, hang.value.status) == ("env_timeout", 504)
        await env.reset(seed=0)  # the session survives both
        assert (await env.step(say("w0"))).reward == 1.0
    finally:
        await env.close()


@pytest.mark.parametrize("scheme", TRANSPORTS)
async def test_wrong_token_wrong_env_and_bad_kwargs_fail_at_init(server: Server, scheme: str):
    with pytest.raises(RemoteEnvError) as denied:
        await envkit.make(url(server, scheme), remote=RemoteConfig(token="wrong")).reset()
    assert (denied.value.code, denied.value.status) == ("unauthorized", 401)
    with pytest.raises(RemoteEnvError) as mismatch:
        await envkit.make(f"{scheme}://127.0.0.1:{server.port}/arithmetic", remote=CONFIG).reset()
    assert mismatch.value.code == "env_mismatch" and SCRIPTED in str(mismatch.value)
    with pytest.raises(RemoteEnvError) as bad:
        await envkit.make(url(server, scheme), remote=CONFIG, no_such_kwarg=1).reset()
    assert (bad.value.code, bad.value.status) == ("invalid_kwargs", 422)


@pytest.mark.parametrize("scheme", TRANSPORTS)
async def test_a_timed_out_step_is_never_sent_again(server: Server, scheme: str):
    # 0.6 s: long enough for the reset on a loaded machine, well short of the step's 1.5 s.
    env = RemoteEnv(url(server, scheme), remote=RemoteConfig(token=TOKEN, timeout_s=0.6))
    await env.reset(seed=0)
    # The step answers after 1.5 s, within the server's 2 s step timeout: a client that waited for it would get its
    # answer (no error), or env_timeout; "timeout" is the client's own 0.6 s wait expiring.
    with pytest.raises(RemoteEnvError) as caught:
        await env.step(say("sleep:1.5"))
    assert caught.value.code == "timeout"
    if scheme == "http":  # the session outlives the client's timeout: the step ran exactly once
        async with server_side(server) as http:
            # A session runs one step at a time: this one waits for the slow step and any copy of it sent again
            after = await http.post(f"/sessions/{env.session_id}/step", json={"action": say("w0")})
            assert after.json()["reward"] == 1.0
            assert (await http.get(f"/sessions/{env.session_id}")).json()["steps"] == 2
    else:  # a late WebSocket answer would be mistaken for the next one's: the session ends instead
        with pytest.raises(RemoteEnvError) as gone:
            await env.step(say("w0"))
        assert gone.value.code == "connection_lost"
    await env.close()


async def test_a_rest_session_outlives_its_connection(server: Server, monkeypatch: pytest.MonkeyPatch):
    """REST sessions are ids in the URL: a dropped connection, or one idle long enough that the server may be
    closing it, is reopened before the next request (which is never sent on a connection that may be gone)."""
    env = RemoteEnv(url(server, "http"), remote=CONFIG)
    await env.reset(seed=3)
    rest = env._transport
    first = rest.conn
    first.abort()  # the server (or a proxy) dropped it
    assert (await env.step(say("no"))).observation == [{"role": "user", "content": "no"}]
    second = rest.conn
    assert second is not first and not second.closed
    monkeypatch.setattr(type(rest), "REUSE_IDLE_S", 0.05)
    await asyncio.sleep(0.1)  # idle past the reuse limit
    assert (await env.step(say("w3"))).reward == 1.0
    assert rest.conn is not second and second.closed
    assert (await env.state())["steps"] == 2  # each step ran once
    await env.close()


async def test_a_cancelled_websocket_step_ends_the_session_instead_of_misreading_its_answer(server: Server):
    env = RemoteEnv(url(server, "ws"), remote=CONFIG)
    await env.reset(seed=0)
    # A rollout cancelled mid-step: the step's frame is out before the sleep ends, its answer 1.5 s later.
    step = asyncio.create_task(env.step(say("sleep:1.5")))
    await asyncio.sleep(0.1)
    step.cancel()
    with pytest.raises(asyncio.CancelledError):
        await step
    # The server deletes a WebSocket session once its connection is gone and its running step has answered: by
    # then the cancelled step's answer has been sent, and would be read as the next step's.
    async with server_side(server) as http:
        for _ in range(200):  # up to 10 s, only to end a failing run: a session the server kept stays for good
            if (await http.get(f"/sessions/{env.session_id}")).status_code == 404:
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("the server kept the cancelled step's session")
    with pytest.raises(RemoteEnvError) as gone:
        await env.step(say("w0"))
    assert gone.value.code == "connection_lost"
    await env.close()


async def test_connection_errors_are_retried_with_backoff_then_reported():
    port = free_port()
    config = RemoteConfig(connect_retries=2, backoff_s=0.1)
    for scheme in TRANSPORTS:
        start = time.perf_counter()
        with pytest.raises(RemoteConnectionError) as caught:
            await RemoteEnv(f"{scheme}://127.0.0.1:{port}/x", remote=config).reset()
        assert time.perf_counter() - start >= 0.3  # waited 0.1 s, then 0.2 s, between the three attempts
        assert caught.value.code == "connect_error" and "after 3 attempts" in str(caught.value)


@pytest.mark.parametrize("scheme", TRANSPORTS)
def test_a_server_that_comes_up_late_is_reached_by_retrying(scheme: str):
    port = free_port()
    started: list[Server] = []
    starter = threading.Timer(0.5, lambda: started.append(envkit_serve(SCRIPTED, port=port)))
    starter.start()
    try:
        config = RemoteConfig(connect_retries=8, backoff_s=0.2)
        with envkit.SyncEnv(envkit.make(f"{scheme}://127.0.0.1:{port}/{SCRIPTED}", remote=config)) as env:
            assert env.tasks("train") is None  # the task list's request is retried too (ScriptedEnv lists none)
            env.reset(seed=2)
            assert env.step("w2").reward == 1.0
    finally:
        starter.join()
        for srv in started:
            srv.stop()


async def test_many_remote_envs_in_one_loop(server: Server):
    async def episode(i: int, scheme: str) -> float:
        async with envkit.make(url(server, scheme), remote=CONFIG, prefix=f"{i}:") as env:
            messages, _ = await env.reset(seed=i)
            assert messages[0]["content"] == f"{i}:say w{i}"
            return (await env.step(say(f"w{i}"))).reward

    rewards = await asyncio.gather(*(episode(i, TRANSPORTS[i % 2]) for i in range(32)))
    assert rewards == [1.0] * 32


def test_remote_envs_run_on_uvloop_too(server: Server):
    """Rollout drivers often run uvloop, whose transports do not subclass asyncio's."""
    async def episodes() -> list[float]:
        rewards = []
        for scheme in TRANSPORTS:
            async with envkit.make(url(server, scheme), remote=CONFIG) as env:
                await env.reset(seed=7)
                assert (await env.step(say("no"))).observation == [{"role": "user", "content": "no"}]
                rewards.append((await env.step(say("w7"))).reward)
        return rewards

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.run(episodes()) == [1.0, 1.0]


def test_bad_urls_are_refused():
    with pytest.raises(ValueError, match="http://host:port/NAME"):
        RemoteEnv("ftp://somewhere/x")


def test_import_envkit_stays_light_and_make_imports_only_the_client():
    code = ("import sys, envkit; heavy = ('fastapi', 'uvicorn', 'httpx', 'websockets', 'pydantic'); "
            "assert not [m for m in heavy if m in sys.modules], sys.modules.keys(); "
            "assert not [m for m in sys.modules if m.startswith('envkit.remote')], sys.modules.keys(); "
            "envkit.make('ws://127.0.0.1:1/x'); "
            "assert 'envkit.remote.client' in sys.modules, sys.modules.keys(); "
            "server = [m for m in sys.modules if m.startswith('envkit.remote.server') or m in ('fastapi', 'uvicorn')]; "
            "assert not server, server")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_server_side_imports_no_client():
    """envkit.remote re-exports RemoteEnv lazily, so `envkit serve` (in every sandbox) never loads httpx."""
    code = ("import sys, envkit.remote.server; "
            "assert not [m for m in ('envkit.remote.client', 'httpx') if m in sys.modules], sys.modules.keys()")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@contextlib.contextmanager
def answering(status: int, body: bytes) -> Iterator[str]:
    """A loopback HTTP server that answers every GET with ``status`` and ``body``; yields its host:port."""
    import http.server

    class Fixed(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Fixed)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(("status", "body", "why"), [
    (200, b"<html>not json</html>", "not JSON"),
    (200, b'{"split": "train", "total": 1000000000000, "offset": 0, "tasks": [{"id": "a"}]}', "short page"),
    (200, b'{"split": "train", "total": 2, "offset": 0, "tasks": ["a", "b"]}', "tasks not dicts"),
    (200, b'{"split": "train", "offset": 0, "tasks": []}', "no total"),
    (200, b'{"split": "train", "total": -1, "offset": 0, "tasks": []}', "negative total"),
    (502, b"Bad Gateway", "an error page"),
])
def test_a_hostile_or_broken_server_cannot_feed_a_trainer_a_bogus_task_list(status: int, body: bytes, why: str):
    """A task list the trainer reads whole must be what the protocol promises, page by page: a server claiming a
    trillion tasks with one-task pages, or answering garbage, gets a RemoteEnvError, not a hang or a wrong task."""
    with answering(status, body) as where:
        env = envkit.make(f"ws://{where}/arithmetic")
        with pytest.raises(RemoteEnvError) as caught:
            env.tasks("train")
        assert caught.value.status == status, why
        assert caught.value.code == ("bad_answer" if status == 200 else "http_error"), why


def test_a_remote_env_lists_the_tasks_of_its_own_kwargs():
    """``make(URL, level=3).tasks()`` are the tasks its level-3 sessions play, not the served default's (the trainer
    trained and evaluated such an env on level 1's tasks); each kwargs set has its own list on one server."""
    with envkit_serve("arithmetic") as server:
        for scheme in TRANSPORTS:
            remote = f"{scheme}://127.0.0.1:{server.port}/arithmetic"
            for split in ("train", "test"):
                assert list(envkit.make(remote, level=3).tasks(split)) == list(envkit.make("arithmetic", level=3)
                                                                               .tasks(split))
                assert list(envkit.make(remote).tasks(split)) == list(envkit.make("arithmetic").tasks(split))
            with envkit.SyncEnv(envkit.make(remote, level=3)) as env:
                task = env.tasks("test")[0]
                assert task["id"].startswith("test-3") and env.reset(task=task)[0][-1]["content"] == task["question"]


def test_a_server_that_ignores_kwargs_in_its_task_list_is_refused():
    """An older server answers ``/tasks`` with its served env's list whatever the kwargs: the client sees no echo
    of them and refuses the list, instead of training on another level's tasks."""
    page = b'{"split": "train", "total": 1, "offset": 0, "tasks": [{"id": "train-1-0"}]}'
    with answering(200, page) as where:
        assert [t["id"] for t in envkit.make(f"http://{where}/arithmetic").tasks("train")] == ["train-1-0"]
        with pytest.raises(RemoteEnvError) as caught:
            envkit.make(f"http://{where}/arithmetic", level=3).tasks("train")
        assert caught.value.code == "kwargs_ignored" and "{'level': 3}" in str(caught.value)
