"""`envkit serve` as a real subprocess on loopback: sessions, auth, limits, TTL, every error code, WS/REST parity."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from remote_envs import CLOSE_LOG_ENV, Server, envkit_serve, error_code
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect as ws_connect

from envkit.remote.protocol import ERROR_STATUS
from envkit.remote.server import ServerLimits, is_loopback

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SCRIPTED = "remote_envs:ScriptedEnv"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """ScriptedEnv with a token, a short step timeout and a small request limit."""
    close_log = tmp_path_factory.mktemp("close") / "closed.log"
    srv = envkit_serve(SCRIPTED, "--step-timeout", "0.5", "--max-request-bytes", "65536",
                       env={"ENVKIT_TOKEN": TOKEN, CLOSE_LOG_ENV: str(close_log)})
    srv.close_log = close_log  # type: ignore[attr-defined]
    yield srv
    srv.stop()


@pytest.fixture()
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=10.0) as client:
        yield client


def new_session(http: httpx.Client, **kwargs: object) -> str:
    r = http.post("/sessions", json={"kwargs": kwargs})
    assert r.status_code == 201, r.text
    return r.json()["session_id"]


def ws_open(server: Server, headers: dict[str, str] = AUTH):
    return ws_connect(server.url.replace("http", "ws") + "/ws", additional_headers=headers, compression=None)


def ws_call(ws, **frame: object) -> dict:
    ws.send(json.dumps(frame))
    return json.loads(ws.recv(timeout=10))


def say(content: str | None) -> dict:
    return {"action": {"role": "assistant", "content": content}}


# ---- auth, health, info ----------------------------------------------------------------------------------------


def test_health_needs_no_token_but_everything_else_does(server: Server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    for path in ("/info", "/metrics", "/tasks", "/openapi.json", "/docs"):
        r = httpx.get(server.url + path)
        assert r.status_code == 401, path
        assert error_code(r) == "unauthorized"
        assert r.headers["www-authenticate"] == "Bearer"
    wrong = httpx.post(server.url + "/sessions", json={}, headers={"Authorization": "Bearer nope"})
    assert (wrong.status_code, error_code(wrong)) == (401, "unauthorized")
    assert httpx.get(server.url + "/info", headers={"Authorization": f"Basic {TOKEN}"}).status_code == 401


def test_websocket_handshake_needs_the_token(server: Server):
    with pytest.raises(InvalidStatus) as caught:
        ws_open(server, headers={})
    assert caught.value.response.status_code == 401
    assert json.loads(caught.value.response.body)["error"]["code"] == "unauthorized"
    with pytest.raises(InvalidStatus) as caught:
        ws_connect(server.url.replace("http", "ws") + "/elsewhere", additional_headers=AUTH)
    assert caught.value.response.status_code == 403  # /ws is the only WebSocket route


def test_info_describes_env_protocol_and_limits(http: httpx.Client):
    info = http.get("/info").json()
    assert info["env"] == SCRIPTED
    assert info["protocol_version"] == 1
    assert [t["function"]["name"] for t in info["tools"]] == ["echo"]
    assert info["tasks"] == {}  # ScriptedEnv has no enumerable tasks
    assert info["step_timeout_s"] == 0.5 and info["max_request_bytes"] == 65536 and info["rest_sessions"] is True
    assert isinstance(info["envkit_version"], str)


def test_openapi_schema_lists_every_route(http: httpx.Client):
    paths = http.get("/openapi.json").json()["paths"]
    assert {"/health", "/info", "/metrics", "/sessions", "/sessions/{session_id}", "/sessions/{session_id}/reset",
            "/sessions/{session_id}/step"} <= set(paths)
    assert "409" in paths["/sessions/{session_id}/step"]["post"]["responses"]


# ---- sessions over REST ----------------------------------------------------------------------------------------


def test_rest_episode_and_state(http: httpx.Client):
    sid = new_session(http)
    opening = http.post(f"/sessions/{sid}/reset", json={"seed": 7}).json()
    assert opening == {"observation": [{"role": "user", "content": "say w7"}], "info": {"seed": 7, "word": "w7"}}
    first = http.post(f"/sessions/{sid}/step", json=say("hello")).json()
    assert first == {"observation": [{"role": "user", "content": "hello"}], "reward": 0.0, "terminated": False,
                     "truncated": False, "info": {"turn": 1}}
    last = http.post(f"/sessions/{sid}/step", json=say("w7!")).json()
    assert (last["reward"], last["terminated"]) == (1.0, True)
    state = http.get(f"/sessions/{sid}").json()
    assert (state["episode_active"], state["episodes"], state["steps"]) == (False, 1, 2)
    assert http.delete(f"/sessions/{sid}").status_code == 204
    assert error_code(http.get(f"/sessions/{sid}")) == "session_not_found"


def test_sessions_are_isolated(http: httpx.Client):
    a, b = new_session(http, prefix="A:"), new_session(http, prefix="B:")
    http.post(f"/sessions/{a}/reset", json={"seed": 1})
    http.post(f"/sessions/{b}/reset", json={"task": {"word": "zebra"}})
    for _ in range(3):
        assert http.post(f"/sessions/{a}/step", json=say("x")).json()["observation"][0]["content"] == "A:x"
    got = http.post(f"/sessions/{b}/step", json=say("zebra")).json()
    assert got["observation"][0]["content"] == "B:zebra" and got["reward"] == 1.0 and got["info"] == {"turn": 1}
    assert http.get(f"/sessions/{a}").json()["steps"] == 3
    assert http.get(f"/sessions/{b}").json()["steps"] == 1
    for sid in (a, b):
        http.delete(f"/sessions/{sid}")


def test_truncation_comes_through(http: httpx.Client):
    sid = new_session(http, max_turns=2)
    http.post(f"/sessions/{sid}/reset", json={})
    assert http.post(f"/sessions/{sid}/step", json=say("a")).json()["truncated"] is False
    assert http.post(f"/sessions/{sid}/step", json=say("b")).json()["truncated"] is True
    assert error_code(http.post(f"/sessions/{sid}/step", json=say("c"))) == "episode_done"
    http.delete(f"/sessions/{sid}")


# ---- every error code ------------------------------------------------------------------------------------------


def test_every_error_code_has_its_status_and_a_structured_body(server: Server, http: httpx.Client):
    seen: dict[str, int] = {}

    def expect(code: str, response: httpx.Response) -> None:
        body = response.json()
        assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "status"}, body
        assert body["error"]["code"] == code, body
        assert response.status_code == ERROR_STATUS[code] == body["error"]["status"]
        assert body["error"]["message"]
        seen[code] = response.status_code

    sid = new_session(http)
    step = f"/sessions/{sid}/step"
    expect("unauthorized", httpx.get(server.url + "/info"))
    expect("bad_request", http.post(step, content=b"{not json", headers={"content-type": "application/json"}))
    expect("bad_request", http.post(step, content=b"action=1", headers={"content-type": "text/plain"}))
    expect("not_found", http.get("/nope"))
    expect("method_not_allowed", http.get(step))
    expect("session_not_found", http.post("/sessions/missing/reset", json={}))
    expect("reset_needed", http.post(step, json=say("hi")))
    expect("validation_error", http.post(step, json={"action": {"content": "no role"}}))
    expect("validation_error", http.post(f"/sessions/{sid}/reset", json={"seed": "seven"}))
    expect("validation_error", http.post(f"/sessions/{sid}/reset", json={"seed": "7"}))  # strict: not read as 7
    expect("validation_error", http.post(f"/sessions/{sid}/reset", json={"seed": True}))
    expect("invalid_task", http.post(f"/sessions/{sid}/reset", json={"task": {"word": 3}}))
    expect("invalid_kwargs", http.post("/sessions", json={"kwargs": {"nonsense": 1}}))
    expect("invalid_kwargs", http.post("/sessions", json={"kwargs": {"name": "echo"}}))  # the fuzz's 500, once
    # where and how envs run is the operator's: a client cannot start a container on the server's host
    expect("invalid_kwargs", http.post("/sessions", json={"kwargs": {"sandbox": "docker"}}))
    expect("invalid_kwargs", http.post("/sessions", json={"kwargs": {"checked": False}}))
    expect("payload_too_large", http.post(step, json=say("x" * 70_000)))
    expect("payload_too_large", http.put("/exec/files", content=b"x" * 70_000))  # a sandbox's larger limit: not here
    http.post(f"/sessions/{sid}/reset", json={"seed": 1})
    expect("invalid_action", http.post(step, json=say(None)))
    expect("invalid_action", http.post(step, json={"action": {"role": "assistant", "content": None,
                                                              "tool_calls": []}}))
    expect("episode_done", (http.post(step, json=say("bye")), http.post(step, json=say("again")))[1])
    http.post(f"/sessions/{sid}/reset", json={"seed": 1})
    expect("env_error", http.post(step, json=say("crash")))
    http.post(f"/sessions/{sid}/reset", json={"seed": 1})
    expect("env_error", http.post(step, json=say("bad")))  # the server's ContractChecker caught a malformed result
    http.post(f"/sessions/{sid}/reset", json={"seed": 1})
    expect("env_timeout", http.post(step, json=say("hang")))
    expect("invalid_snapshot", http.post(f"/sessions/{sid}/restore", json={"snapshot": "not.sealed"}))
    http.delete(f"/sessions/{sid}")
    expect("no_tasks", http.get("/tasks"))  # ScriptedEnv lists no tasks
    with envkit_serve("arithmetic") as arithmetic:
        expect("invalid_split", httpx.get(arithmetic.url + "/tasks", params={"split": "dev"}))
        expect("validation_error", httpx.get(arithmetic.url + "/tasks", params={"limit": 0}))
        for kwargs in ("{not json", "[3]", '{"sandbox": "docker"}', '{"no_such_kwarg": 1}'):
            expect("invalid_kwargs", httpx.get(arithmetic.url + "/tasks", params={"kwargs": kwargs}))
        page = httpx.get(arithmetic.url + "/tasks", params={"split": "test", "offset": 18, "limit": 5}).json()
        assert (page["total"], page["offset"], len(page["tasks"])) == (19, 18, 1)  # level 1 owns 19 test problems
    with envkit_serve("remote_envs:Held") as held:  # a lock in its state: it cannot snapshot
        session = httpx.post(held.url + "/sessions", json={}).json()["session_id"]
        expect("snapshot_unsupported", httpx.post(f"{held.url}/sessions/{session}/snapshot"))
    with envkit_serve(SCRIPTED, "--max-sessions", "1") as small:
        assert httpx.post(small.url + "/sessions", json={}).status_code == 201
        full = httpx.post(small.url + "/sessions", json={})
        expect("capacity", full)
        assert full.headers["retry-after"] == "1"
    # half the headers, then nothing; one server each for the cap and the deadline, since with both a slow machine
    # can pass the deadline (which frees the connection) before the second client is refused
    half = b"POST /sessions HTTP/1.1\r\nHost: x\r\nContent-Le"
    with (envkit_serve(SCRIPTED, "--request-timeout", "600", "--max-connections", "1") as capped,
          socket.create_connection(("127.0.0.1", capped.port)) as stalled):
        stalled.sendall(half)
        with httpx.Client() as fresh:  # `stalled` holds the one connection allowed
            expect("capacity", fresh.get(capped.url + "/info"))
            expect("capacity", fresh.get(capped.url + "/info"))  # the 503 closed it: a new one, refused again
    with (envkit_serve(SCRIPTED, "--request-timeout", "0.5") as guarded,
          socket.create_connection(("127.0.0.1", guarded.port)) as stalled):
        stalled.sendall(half)
        timed_out = httpx.Response(408, content=stalled.recv(4096).split(b"\r\n\r\n", 1)[1])
        expect("request_timeout", timed_out)
        assert stalled.recv(1) == b""  # and closed
    with envkit_serve(SCRIPTED, "--workers", "2") as multi:
        expect("rest_unavailable", httpx.post(multi.url + "/sessions", json={}))
        with ws_connect(multi.url.replace("http", "ws") + "/ws") as ws:  # WebSocket sessions work on any worker
            ws_call(ws, op="create")
            ws_call(ws, op="reset", seed=4)
            assert ws_call(ws, op="step", action={"role": "assistant", "content": "w4"})["reward"] == 1.0
    with envkit_serve("referential") as seated:  # a multi-agent env: a session per seat, joined by its table
        first = httpx.post(seated.url + "/sessions", json={"seat": "speaker"}).json()
        expect("seat_taken", httpx.post(seated.url + "/sessions", json={"seat": "speaker", "table": first["table"]}))
        expect("table_not_found", httpx.post(seated.url + "/sessions", json={"seat": "listener", "table": "none"}))
    # Only a bug in the server itself answers internal_error; every other code must have been exercised here.
    assert set(seen) == set(ERROR_STATUS) - {"internal_error"}


def test_env_crash_is_contained_and_the_session_recovers(server: Server, http: httpx.Client):
    crashing, bystander = new_session(http), new_session(http)
    for sid in (crashing, bystander):
        http.post(f"/sessions/{sid}/reset", json={"seed": 2})
    crashed = http.post(f"/sessions/{crashing}/step", json=say("crash"))
    assert crashed.status_code == 500 and "deliberate crash" in crashed.json()["error"]["message"]
    assert error_code(http.post(f"/sessions/{crashing}/step", json=say("again"))) == "reset_needed"
    assert http.post(f"/sessions/{bystander}/step", json=say("fine")).status_code == 200
    assert http.post(f"/sessions/{crashing}/reset", json={"seed": 2}).status_code == 200
    assert http.post(f"/sessions/{crashing}/step", json=say("w2")).json()["reward"] == 1.0
    assert httpx.get(server.url + "/health").status_code == 200
    assert "deliberate crash" in server.output()  # reported in the server log, with its traceback
    for sid in (crashing, bystander):
        http.delete(f"/sessions/{sid}")


async def test_a_hanging_env_times_out_without_stalling_other_sessions():
    """A server of its own whose step timeout (5 s) leaves the other session's 10 steps a wide window, however
    loaded the machine: a server that handled one request at a time would answer them only after the hanging step's
    timeout had answered it."""
    with envkit_serve(SCRIPTED, "--step-timeout", "5", env={"ENVKIT_TOKEN": TOKEN}) as server:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=30) as client:
            hanging, other = [(await client.post("/sessions", json={})).json()["session_id"] for _ in range(2)]
            for sid in (hanging, other):
                await client.post(f"/sessions/{sid}/reset", json={"seed": 3})
            sent = asyncio.Event()

            async def trace(event: str, info: dict) -> None:  # httpcore's hook: the request is on the wire
                if event == "http11.send_request_body.complete":
                    sent.set()

            start = time.perf_counter()
            hung = asyncio.create_task(client.post(f"/sessions/{hanging}/step", json=say("hang"),
                                                   extensions={"trace": trace}))
            await asyncio.wait_for(sent.wait(), 10)
            for _ in range(10):
                assert (await client.post(f"/sessions/{other}/step", json=say("ping"))).status_code == 200
            assert not hung.done()
            response = await hung  # the client's 30 s timeout fails the test if the server never ends the step
            waited = time.perf_counter() - start
    assert error_code(response) == "env_timeout" and response.status_code == 504
    assert waited > 4.9  # the step timeout did not fire early


# ---- WebSocket and parity --------------------------------------------------------------------------------------


def test_websocket_and_rest_give_identical_episodes_and_errors(server: Server, http: httpx.Client):
    actions = ["hello", "w5 maybe", "late"]
    sid = new_session(http, prefix=">")
    rest = [http.post(f"/sessions/{sid}/step", json=say("early")).json(),
            http.post(f"/sessions/{sid}/reset", json={"seed": 5}).json()]
    rest += [http.post(f"/sessions/{sid}/step", json=say(a)).json() for a in actions]
    rest += [http.post(f"/sessions/{sid}/step", json=say(None)).json(),
             http.post(f"/sessions/{sid}/step", content=b'{"action": {}}',
                       headers={"content-type": "application/json"}).json()]
    http.delete(f"/sessions/{sid}")
    with ws_open(server) as ws:
        created = ws_call(ws, op="create", kwargs={"prefix": ">"})
        assert [t["function"]["name"] for t in created["tools"]] == ["echo"]
        ws_answers = [ws_call(ws, op="step", action={"role": "assistant", "content": "early"}),
                      ws_call(ws, op="reset", seed=5)]
        ws_answers += [ws_call(ws, op="step", action={"role": "assistant", "content": a}) for a in actions]
        ws_answers += [ws_call(ws, op="step", action={"role": "assistant", "content": None}),
                       ws_call(ws, op="step", action={})]
        state = ws_call(ws, op="state")
        assert (state["episodes"], state["steps"], state["episode_active"]) == (1, 2, False)
        assert ws_call(ws, op="delete") == {"deleted": created["session_id"]}

    def outcome(answer: dict) -> object:  # error messages may differ (REST names the body), codes may not
        return answer["error"]["code"] if "error" in answer else answer

    assert [outcome(r) for r in rest] == [outcome(r) for r in ws_answers]
    assert [r["error"]["code"] if "error" in r else None for r in rest] == [
        "reset_needed", None, None, None, "episode_done", "episode_done", "validation_error"]


def test_info_values_json_lacks_arrive_the_same_way_over_rest_and_websocket(server: Server, http: httpx.Client):
    sid = new_session(http)
    http.post(f"/sessions/{sid}/reset", json={"seed": 1})
    rest = [http.post(f"/sessions/{sid}/step", json=say(text)).json()["info"] for text in ("odd info", "big info")]
    with ws_open(server) as ws:
        ws_call(ws, op="create")
        ws_call(ws, op="reset", seed=1)
        ws_answers = [ws_call(ws, op="step", **say(text))["info"] for text in ("odd info", "big info")]
    assert rest == ws_answers == [{"loss": None, "3": "int key", "tags": ["a"], "pair": [1, 2]}, {"big": 2**70}]


def test_a_value_json_cannot_carry_is_an_env_error_naming_its_place(server: Server, http: httpx.Client):
    sid = new_session(http)
    http.post(f"/sessions/{sid}/reset", json={"seed": 1})
    answer = http.post(f"/sessions/{sid}/step", json=say("opaque info"))
    assert answer.status_code == 500 and error_code(answer) == "env_error"
    assert "['info']['log'][1]: builtins.object is not JSON" in answer.json()["error"]["message"]
    with ws_open(server) as ws:
        ws_call(ws, op="create")
        ws_call(ws, op="reset", seed=1)
        error = ws_call(ws, op="step", **say("opaque info"))["error"]
        assert error["code"] == "env_error" and "['info']['log'][1]" in error["message"]
        assert ws_call(ws, op="reset", seed=2)["info"] == {"seed": 2, "word": "w2"}  # the connection lives on


def test_websocket_malformed_frames_get_errors_and_the_connection_lives_on(server: Server):
    with ws_open(server) as ws:
        ws.send("{nope")
        assert json.loads(ws.recv(timeout=5))["error"]["code"] == "bad_request"
        ws.send(b"\x00\x01binary")
        assert json.loads(ws.recv(timeout=5))["error"]["code"] == "bad_request"
        assert ws_call(ws, op="explode")["error"]["code"] == "validation_error"
        assert ws_call(ws, op="reset")["error"]["code"] == "session_not_found"
        ws_call(ws, op="create")
        assert ws_call(ws, op="create")["error"]["code"] == "validation_error"
        assert ws_call(ws, op="reset", seed=1)["observation"] == [{"role": "user", "content": "say w1"}]
        ws.send(json.dumps({"op": "step", "action": {"role": "assistant", "content": "x" * 70_000}}))
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=5)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009  # over --max-request-bytes


def test_closing_the_websocket_deletes_its_session(server: Server, http: httpx.Client):
    before = http.get("/info").json()["sessions"]
    with ws_open(server) as ws:
        ws_call(ws, op="create")
        assert http.get("/info").json()["sessions"] == before + 1
    deadline = time.monotonic() + 10  # only ends a failing run: the server sees the close at once; a leak is for good
    while http.get("/info").json()["sessions"] != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert http.get("/info").json()["sessions"] == before
    assert 'envkit_sessions_closed_total{reason="disconnected"}' in http.get("/metrics").text


# ---- limits, TTL, metrics, shutdown ----------------------------------------------------------------------------


def test_capacity_frees_up_when_a_session_is_deleted():
    with envkit_serve(SCRIPTED, "--max-sessions", "2") as srv:
        first = httpx.post(srv.url + "/sessions", json={}).json()["session_id"]
        httpx.post(srv.url + "/sessions", json={})
        full = httpx.post(srv.url + "/sessions", json={})
        assert (full.status_code, error_code(full)) == (503, "capacity")
        with ws_connect(srv.url.replace("http", "ws") + "/ws") as ws:
            refused = ws_call(ws, op="create")["error"]
            assert (refused["code"], refused["status"]) == ("capacity", 503)
        assert httpx.delete(srv.url + f"/sessions/{first}").status_code == 204
        assert httpx.post(srv.url + "/sessions", json={}).status_code == 201


def test_idle_sessions_expire_and_their_envs_are_closed(tmp_path: Path):
    log = tmp_path / "closed.log"
    # A 2 s TTL, swept every 0.5 s: `busy` survives a 1.5 s stall of this test's process, and `idle` is gone after
    # the 4 s of steps.
    with envkit_serve(SCRIPTED, "--session-ttl", "2", env={CLOSE_LOG_ENV: str(log)}) as srv:
        idle = httpx.post(srv.url + "/sessions", json={"kwargs": {"prefix": "idle"}}).json()["session_id"]
        busy = httpx.post(srv.url + "/sessions", json={"kwargs": {"prefix": "busy"}}).json()["session_id"]
        httpx.post(srv.url + f"/sessions/{busy}/reset", json={})
        for _ in range(8):  # activity keeps `busy` alive past the TTL
            time.sleep(0.5)
            assert httpx.post(srv.url + f"/sessions/{busy}/step", json=say("x")).status_code == 200
        gone = httpx.post(srv.url + f"/sessions/{idle}/reset", json={})
        assert (gone.status_code, error_code(gone)) == (404, "session_not_found")
        assert log.read_text().split() == ["idle"]
        assert 'envkit_sessions_closed_total{reason="expired"} 1' in httpx.get(srv.url + "/metrics").text


def test_metrics_count_sessions_requests_errors_and_latency(http: httpx.Client):
    # its own refused request: under xdist, the test that sends one may run on the other worker's server
    assert httpx.post(str(http.base_url) + "/sessions", json={}).status_code == 401
    sid = new_session(http)
    http.post(f"/sessions/{sid}/reset", json={"seed": 0})
    for _ in range(5):
        http.post(f"/sessions/{sid}/step", json=say("m"))
    text = http.get("/metrics").text
    steps = int(re.search(r'envkit_requests_total\{op="step",transport="rest"\} (\d+)', text).group(1))
    assert steps >= 5
    count = int(re.search(r'envkit_op_seconds_count\{op="step",transport="rest"\} (\d+)', text).group(1))
    assert count == steps
    assert re.search(r'envkit_op_seconds_bucket\{op="step",transport="rest",le="\+Inf"\} \d+', text)
    assert re.search(r"^envkit_sessions \d+$", text, re.MULTILINE)
    assert 'envkit_errors_total{code="unauthorized"}' in text
    http.delete(f"/sessions/{sid}")


def test_shutdown_closes_every_env(tmp_path: Path):
    log = tmp_path / "closed.log"
    srv = envkit_serve(SCRIPTED, env={CLOSE_LOG_ENV: str(log)})
    try:
        for name in ("a", "b"):
            sid = httpx.post(srv.url + "/sessions", json={"kwargs": {"prefix": name}}).json()["session_id"]
            httpx.post(srv.url + f"/sessions/{sid}/reset", json={})
        with ws_connect(srv.url.replace("http", "ws") + "/ws") as ws:
            ws_call(ws, op="create", kwargs={"prefix": "ws"})
            # uvicorn shuts down gracefully, then re-raises the signal: the exit status says SIGTERM either way.
            assert srv.stop() in (0, -signal.SIGTERM)
    finally:
        srv.stop()
    assert sorted(log.read_text().split()) == ["a", "b", "ws"]
    assert "Traceback" not in srv.output()


# ---- configuration ---------------------------------------------------------------------------------------------


def test_no_credential_reaches_the_log_at_debug_level():
    """The WebSocket handshake's headers are logged at debug level: the token (and wrong ones) must not be."""
    wrong = "wrong-guess-7f3a"
    with envkit_serve(SCRIPTED, "--log-level", "debug", env={"ENVKIT_TOKEN": TOKEN}) as srv:
        with httpx.Client(base_url=srv.url, headers=AUTH, timeout=10.0) as http:
            sid = new_session(http)
            http.post(f"/sessions/{sid}/reset", json={"seed": 1})
            http.post(f"/sessions/{sid}/step", json=say("crash"))  # an env crash is logged with its traceback
            assert http.get("/info", headers={"Authorization": f"Bearer {wrong}"}).status_code == 401
        with ws_open(srv) as ws:
            ws_call(ws, op="create")
        with pytest.raises(InvalidStatus):
            ws_open(srv, {"Authorization": f"Bearer {wrong}"}).close()
        srv.stop()
    log = srv.output()
    assert "authorization: Bearer [redacted]" in log and "deliberate crash" in log  # debug logging did happen
    assert TOKEN not in log and wrong not in log


def test_loopback_detection_decides_the_exposure_warning():
    assert all(map(is_loopback, ["127.0.0.1", "127.0.0.2", "localhost", "::1"]))
    assert not any(map(is_loopback, ["0.0.0.0", "10.1.2.3", "::", "example.com"]))


def test_limits_reject_nonsense():
    with pytest.raises(ValueError, match="max_sessions must be a positive number"):
        ServerLimits(max_sessions=0)


def test_cli_reports_unknown_envs_and_bad_kwargs():
    unknown = subprocess.run([sys.executable, "-m", "envkit.cli", "serve", "arithmetc"], capture_output=True,
                             text=True, timeout=60)
    assert unknown.returncode == 2 and "Did you mean: 'arithmetic'" in " ".join(unknown.stderr.split())
    bad = subprocess.run([sys.executable, "-m", "envkit.cli", "serve", "arithmetic", "--kwargs", "[1]"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--kwargs must be a JSON object" in " ".join((bad.stdout + bad.stderr).split())


@pytest.mark.parametrize(("flags", "message"), [
    (["--port", "70000"], "the port must be an integer from 1 to 65535, got 70000"),
    (["--port", "0"], "the port must be an integer from 1 to 65535, got 0"),
    (["--workers", "0"], "workers must be an integer of at least 1, got 0"),
    (["--workers", "-3"], "workers must be an integer of at least 1, got -3"),
    (["--max-sessions", "-1"], "max_sessions must be a positive number, got -1"),
    (["--step-timeout", "nan"], "step_timeout_s must be a positive number, got nan"),
    (["--exec-user", "0", "--token", "t"], "exec_user must be a uid other than root's"),
    (["--port", "eighty"], "argument --port: invalid int value: 'eighty'"),
])
def test_cli_refuses_nonsense_before_binding_anything(flags: list[str], message: str):
    done = subprocess.run([sys.executable, "-m", "envkit.cli", "serve", "arithmetic", *flags], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and message in " ".join((done.stdout + done.stderr).split()), done
    assert "Uvicorn running" not in done.stderr


def test_with_several_workers_limits_metrics_and_info_describe_the_whole_server():
    with envkit_serve(SCRIPTED, "--workers", "2", "--max-sessions", "6") as srv:
        def scrape() -> tuple[str, dict[int, int]]:  # a new connection each time: either worker may answer
            text = httpx.get(srv.url + "/metrics").text
            gauges = re.findall(r'envkit_worker_sessions\{worker="(\d+)"\} (\d+)', text)
            return text, {int(worker): int(n) for worker, n in gauges}

        def step(ws, content: str = "x") -> None:
            assert ws_call(ws, op="step", action={"role": "assistant", "content": content})["reward"] == 0.0

        # Only ends a failing run (a worker that never starts): 120 s is over 10x the seconds the first one took.
        deadline = time.monotonic() + 120
        while len(scrape()[1]) < 2:  # /health answered as soon as one worker was up
            assert time.monotonic() < deadline, "the second worker never started"
            time.sleep(0.1)
        with contextlib.ExitStack() as stack:
            busy = stack.enter_context(ws_open(srv, {}))
            ws_call(busy, op="create")
            ws_call(busy, op="reset", seed=0)
            # While the busy worker's loop is blocked, new connections can only land on the other one.
            busy.send(json.dumps({"op": "step", "action": {"role": "assistant", "content": "block:2"}}))
            time.sleep(0.5)  # the frame reaches the busy worker, whose loop then stops
            others = [stack.enter_context(ws_open(srv, {})) for _ in range(5)]
            for i, ws in enumerate(others):
                assert "session_id" in ws_call(ws, op="create")
                ws_call(ws, op="reset", seed=i)
                for _ in range(i + 1):  # 15 steps here, 1 + 5 on the busy worker: 21
                    step(ws)
            assert json.loads(busy.recv(timeout=10))["reward"] == 0.0
            for _ in range(5):
                step(busy)
            with ws_open(srv, {}) as extra:  # the 7th session is refused whichever worker it reaches
                assert ws_call(extra, op="create")["error"]["code"] == "capacity"
            _, per_worker = scrape()
            assert sum(per_worker.values()) == 6 and min(per_worker.values()) >= 1, per_worker  # both hold some
            for _ in range(6):
                info = httpx.get(srv.url + "/info").json()
                assert info["sessions"] == 6 and info["worker"]["workers"] == 2, info
                assert info["worker"]["sessions"] == per_worker[info["worker"]["pid"]], (info, per_worker)
            deadline = time.monotonic() + 10  # 20x FLUSH_S (0.5 s); a count that is wrong never matches
            while True:  # the other worker's counters are at most FLUSH_S old
                text, _ = scrape()
                steps = re.search(r'envkit_requests_total\{op="step",transport="ws"\} (\d+)', text)
                created = re.search(r"envkit_sessions_created_total (\d+)", text)
                if (steps and int(steps.group(1)) == 21 and int(created.group(1)) == 6) or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert int(steps.group(1)) == 21 and int(created.group(1)) == 6, text
            assert re.search(r'envkit_op_seconds_count\{op="step",transport="ws"\} 21$', text, re.MULTILINE)
            assert "envkit_sessions 6\n" in text and "envkit_workers 2\n" in text
        deadline = time.monotonic() + 10  # only ends a failing run: closes arrive at once; a leaked slot is for good
        while httpx.get(srv.url + "/info").json()["sessions"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert httpx.get(srv.url + "/info").json()["sessions"] == 0  # closing the sockets gave every slot back


async def test_a_client_varying_kwargs_cannot_grow_the_servers_task_lists():
    """Each kwargs set's task list is kept for its later pages, but only the newest TASK_LISTS_KEPT of them."""
    from envkit.remote.server.sessions import TASK_LISTS_KEPT, EnvServer

    server = EnvServer("arithmetic")
    for seed in range(3 * TASK_LISTS_KEPT):
        page = await server.tasks("test", 0, 1, {"format_bonus": seed / 100})
        assert page["kwargs"] == {"format_bonus": seed / 100} and page["total"] == 19
    assert len(server._task_lists) == TASK_LISTS_KEPT


def test_text_that_is_not_unicode_or_nested_too_deep_never_reaches_the_env(server: Server, http: httpx.Client):
    """A lone surrogate (JSON may escape one) or an action nested past 64, over REST and WebSocket, in a step's action
    or a reset's task: refused (422 naming where it is over REST; a WebSocket frame's parser refuses it as not JSON)
    before the env sees it (the env never steps on it: its episode goes on), and the connection and session live on."""
    sid = new_session(http)
    assert http.post(f"/sessions/{sid}/reset", json={"seed": 1}).status_code == 200
    raw = {"content-type": "application/json"}
    bad = {"a lone surrogate": b'{"action": {"role": "assistant", "content": "a\\ud800b"}}',
           "nested past 64": b'{"action": {"role": "assistant", "content": "x", "extra": ' + b"[" * 500
                             + b"]" * 500 + b"}}"}
    for name, body in bad.items():
        r = http.post(f"/sessions/{sid}/step", content=body, headers=raw)
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_action", (name, r.text)
    assert "action.content: not valid Unicode" in http.post(f"/sessions/{sid}/step", content=bad["a lone surrogate"],
                                                            headers=raw).json()["error"]["message"]
    task = http.post(f"/sessions/{sid}/reset", content=b'{"task": {"id": "\\udfff"}}', headers=raw)
    assert task.status_code == 422 and "task.id: not valid Unicode" in task.json()["error"]["message"]
    assert http.post(f"/sessions/{sid}/step", json=say("x")).status_code == 200  # the episode was never stepped
    with ws_open(server) as ws:
        ws_call(ws, op="create")
        ws_call(ws, op="reset", seed=1)
        ws.send('{"op": "step", "action": {"role": "assistant", "content": "a\\ud800b"}}')
        assert json.loads(ws.recv(timeout=10))["error"]["code"] == "bad_request"  # the frame parser refuses it
        assert "observation" in ws_call(ws, **say("x"), op="step")
