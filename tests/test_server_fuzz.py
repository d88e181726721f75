"""Fuzz every route of a real `envkit serve` (schemathesis from its published OpenAPI, plus raw bodies and WebSocket
frames), and a bounded load test: 256 concurrent sessions over REST and WebSocket, zero errors, zero leaks."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from remote_envs import Server, envkit_serve
from schemathesis import checks
from websockets.sync.client import connect as ws_connect

import envkit
from envkit.remote import RemoteConfig

TOKEN = "fuzz-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
EXAMPLES_PER_OPERATION_AND_MODE = 150  # routes with few distinct inputs (GET /health) run out sooner
# Checked on every generated request: no 5xx, and the answer is one the OpenAPI schema documents.
CHECKS = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
          checks.response_schema_conformance]
FUZZ_SETTINGS = settings(max_examples=EXAMPLES_PER_OPERATION_AND_MODE, deadline=None, database=None,
                         derandomize=True, phases=[Phase.explicit, Phase.generate],
                         suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """The real arithmetic env: fuzzed tasks and actions reach its reset and grader."""
    srv = envkit_serve("arithmetic", "--max-request-bytes", "65536", "--max-sessions", "64",
                       env={"ENVKIT_TOKEN": TOKEN})
    yield srv
    srv.stop()


def open_sessions(url: str) -> int:
    return httpx.get(url + "/info", headers=AUTH).json()["sessions"]


def test_schema_fuzz_of_every_route_finds_no_server_error(server: Server, capsys: pytest.CaptureFixture[str]):
    # schemathesis adds headers to the dicts it is given (Connection: keep-alive...): hand it copies.
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json", headers=dict(AUTH))
    http = requests.Session()
    http.headers.update(AUTH)
    statuses: Counter[int] = Counter()
    operations: Counter[str] = Counter()

    def real_session(seed: int | None) -> str:
        sid = http.post(server.url + "/sessions", json={}).json()["session_id"]
        if seed is not None:  # None leaves it without an episode: steps must answer 409
            http.post(f"{server.url}/sessions/{sid}/reset", json={"seed": seed})
        return sid

    def fuzz_operation(operation: schemathesis.APIOperation, mode: schemathesis.GenerationMode) -> None:
        @FUZZ_SETTINGS
        @given(case=operation.as_strategy(generation_mode=mode), use_real=st.booleans(),
               seed=st.none() | st.integers(0, 99))
        def fuzz(case: schemathesis.Case, use_real: bool, seed: int | None) -> None:
            sid = None
            if "session_id" in (case.path_parameters or {}) and use_real:  # reach the env, not only 404s
                sid = case.path_parameters["session_id"] = real_session(seed)
            response = case.call(base_url=server.url, session=http, headers=dict(AUTH), timeout=30)
            statuses[response.status_code] += 1
            operations[operation.label] += 1
            case.validate_response(response, checks=CHECKS, headers=dict(AUTH))
            if sid is not None:
                http.delete(f"{server.url}/sessions/{sid}")
            if operation.label == "POST /sessions" and response.status_code == 201:
                http.delete(f"{server.url}/sessions/{response.json()['session_id']}")

        try:
            fuzz()
        except Unsatisfiable:  # no negative input exists for a route without parameters (GET /health)
            assert mode is schemathesis.GenerationMode.NEGATIVE and not operation.body

    for result in schema.get_all_operations():
        for mode in schemathesis.GenerationMode:
            fuzz_operation(result.ok(), mode)
    total = sum(statuses.values())
    with capsys.disabled():
        print(f"\nschema fuzz: {total} generated requests over {len(operations)} operations, "
              f"status codes {dict(sorted(statuses.items()))}")
    assert total >= 1000 and len(operations) == 13  # GET /tasks, the two OpenEnv GETs, snapshot and restore included
    assert not [s for s in statuses if s >= 500]
    assert {200, 201, 204, 404, 409, 422} <= set(statuses)  # the fuzz reached envs, not only validation
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert open_sessions(server.url) == 0


@settings(max_examples=150, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(route=st.sampled_from(["/sessions", "/sessions/{sid}/reset", "/sessions/{sid}/step"]),
       body=st.one_of(st.binary(max_size=256),
                      st.recursive(st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=20),
                                   lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                                       st.sampled_from(["action", "kwargs", "seed", "task", "role", "content",
                                                        "tool_calls", "x"]), inner, max_size=4),
                                   max_leaves=12).map(lambda v: json.dumps(v, allow_nan=True).encode())),
       content_type=st.sampled_from(["application/json", "text/plain", ""]))
def test_raw_bodies_never_cause_server_errors(server: Server, route: str, body: bytes, content_type: str):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as http:
        sid = http.post("/sessions", json={}).json()["session_id"]
        http.post(f"/sessions/{sid}/reset", json={})
        headers = {"content-type": content_type} if content_type else {}
        response = http.post(route.format(sid=sid), content=body, headers=headers)
        assert response.status_code < 500, response.text
        assert response.status_code < 300 or set(response.json()["error"]) == {"code", "message", "status"}
        if route == "/sessions" and response.status_code == 201:
            http.delete(f"/sessions/{response.json()['session_id']}")
        http.delete(f"/sessions/{sid}")


def test_websocket_frame_fuzz_keeps_the_connection_and_server_healthy(server: Server):
    frames = st.one_of(
        st.text(max_size=64),
        st.fixed_dictionaries({"op": st.sampled_from(["create", "reset", "step", "state", "delete", "boom"])},
                              optional={"seed": st.integers() | st.text(max_size=3), "task": st.dictionaries(
                                  st.text(max_size=8), st.integers() | st.text(max_size=8), max_size=3),
                                  "kwargs": st.dictionaries(st.sampled_from(["level", "x"]), st.integers(-2, 7)),
                                  "action": st.fixed_dictionaries({"role": st.sampled_from(["assistant", "user"])},
                                                                  optional={"content": st.none() | st.text()})},
                              ).map(json.dumps))
    answered = 0
    with ws_connect(server.url.replace("http", "ws") + "/ws", additional_headers=AUTH) as ws:
        @settings(max_examples=300, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(frame=frames)
        def fuzz(frame: str) -> None:
            nonlocal answered
            ws.send(frame)
            answer = json.loads(ws.recv(timeout=30))
            answered += 1
            if "error" in answer:
                assert answer["error"]["status"] < 500, answer

        fuzz()
        ws.send(json.dumps({"op": "delete"}))
        ws.recv(timeout=30)
    assert answered >= 300
    assert httpx.get(server.url + "/health").status_code == 200
    assert open_sessions(server.url) == 0


async def test_load_256_concurrent_sessions_step_without_errors_or_leaks(capsys: pytest.CaptureFixture[str]):
    sessions, seconds = 256, 3.0
    with envkit_serve("remote_envs:ScriptedEnv", "--max-sessions", str(sessions)) as srv:
        config = RemoteConfig(timeout_s=60)
        envs = [envkit.make(f"{'ws' if i % 2 else 'http'}://127.0.0.1:{srv.port}/remote_envs:ScriptedEnv",
                            remote=config) for i in range(sessions)]
        await asyncio.gather(*(env.init() for env in envs))  # all 256 open at once: the server is full
        async with httpx.AsyncClient() as client:
            info = (await client.get(srv.url + "/info")).json()
        assert info["sessions"] == sessions
        deadline = time.monotonic() + seconds

        async def work(i: int, env: envkit.Env) -> int:
            steps = 0
            while time.monotonic() < deadline:
                await env.reset(seed=i)
                for _ in range(3):
                    result = await env.step(envkit.assistant("x"))
                    assert result.observation == [{"role": "user", "content": "x"}] and not result.done
                assert (await env.step(envkit.assistant(f"w{i}"))).terminated
                steps += 4
            return steps

        results = await asyncio.gather(*(work(i, env) for i, env in enumerate(envs)), return_exceptions=True)
        await asyncio.gather(*(env.close() for env in envs))
        errors = [r for r in results if isinstance(r, BaseException)]
        steps = sum(r for r in results if isinstance(r, int))
        async with httpx.AsyncClient() as client:
            metrics = (await client.get(srv.url + "/metrics")).text
            info = (await client.get(srv.url + "/info")).json()
    with capsys.disabled():
        print(f"\nload: {sessions} sessions (REST and WebSocket), {steps} steps in {seconds:g} s, {len(errors)} errors")
    assert errors == []
    assert steps >= sessions * 4
    assert info["sessions"] == 0
    assert f'envkit_sessions_closed_total{{reason="deleted"}} {sessions}' in metrics
    assert not re.search(r"^envkit_errors_total", metrics, re.MULTILINE)
    served = sum(int(n) for n in re.findall(r'envkit_requests_total\{op="step",transport="\w+"\} (\d+)', metrics))
    assert served == steps
