"""OpenEnvEnv against a real OpenEnv server process (OpenEnv's own server serving its echo env), for each version
`make install` installs: openenv-core 0.3.0 and openenv 0.10.0."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from remote_envs import OPENENV_PYTHONS, TESTS, Server, envkit_serve, openenv_server
from websockets.sync.client import connect as ws_connect

import envkit
from envkit.errors import EpisodeDoneError, RemoteInvalidActionError
from envkit.remote.openenv import OpenEnvEnv


@pytest.fixture(scope="module", params=["0.3", "0.10"])
def openenv_version(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def echo_server(openenv_version: str) -> Iterator[Server]:
    srv = openenv_server(openenv_version)
    yield srv
    srv.stop()


@pytest.mark.openenv
async def test_reset_and_step_map_to_the_env_contract(echo_server: Server):
    env = envkit.make(f"openenv:{echo_server.url}")
    assert isinstance(env.unwrapped, OpenEnvEnv)
    async with env:
        messages, info = await env.reset(seed=3, task={"id": "episode-7"})
        assert messages == [{"role": "user", "content": "Echo environment ready! seed=3"}]
        assert info["observation"]["message_length"] == 0
        assert env.unwrapped.action_key == "message" and env.unwrapped.observation_key == "echoed_message"
        result = await env.step(envkit.assistant("hello"))
        assert result.observation == [{"role": "user", "content": "hello"}]
        assert result.reward == pytest.approx(0.5) and not result.done
        assert result.info["observation"] == {"echoed_message": "hello", "message_length": 5}
        last = await env.step(envkit.assistant("bye"))
        assert last.terminated and last.reward == pytest.approx(0.3)
        with pytest.raises(EpisodeDoneError):
            await env.step(envkit.assistant("more"))
        await env.reset()  # the same session starts over
        assert (await env.step(envkit.assistant("again"))).reward == pytest.approx(0.5)


@pytest.mark.openenv
async def test_metadata_reaches_the_model_only_when_asked(echo_server: Server, openenv_version: str):
    """OpenEnv 0.10 sends an observation's metadata inside it (0.3 did not send it), where an env may keep what the
    model must not read: envkit puts it in info, and in the message only with show_metadata=True."""
    sent = {"step": 1} if openenv_version == "0.10" else None
    for show, shown in ((False, "hello"), (True, "hello" + ('\nmetadata: {"step": 1}' if sent else ""))):
        async with envkit.make(f"openenv:{echo_server.url}", show_metadata=show) as env:
            await env.reset(seed=0)
            result = await env.step(envkit.assistant("hello"))
            assert result.observation == [{"role": "user", "content": shown}]
            assert result.info.get("metadata") == sent
            assert "metadata" not in result.info["observation"]


@pytest.mark.openenv
async def test_concurrent_sessions_are_isolated(echo_server: Server):
    async def episode(i: int) -> list[str]:
        async with envkit.make(f"openenv:{echo_server.url}") as env:
            await env.reset(seed=i)
            return [(await env.step(envkit.assistant(f"{i}-{k}"))).observation[0]["content"] for k in range(3)]

    got = await asyncio.gather(*(episode(i) for i in range(16)))
    assert got == [[f"{i}-{k}" for k in range(3)] for i in range(16)]


@pytest.mark.openenv
async def test_custom_mapping_and_refused_actions(echo_server: Server):
    env = OpenEnvEnv(echo_server.url, to_action=lambda a: {"message": a["content"].upper()},
                     to_messages=lambda obs: [envkit.user(f"{obs['echoed_message']} ({obs['message_length']})")])
    try:
        await env.reset()
        assert (await env.step(envkit.assistant("abc"))).observation[0]["content"] == "ABC (3)"
    finally:
        await env.close()
    wrong = OpenEnvEnv(echo_server.url, action_key="text", observation_key="echoed_message")
    try:
        await wrong.reset()
        with pytest.raises(RemoteInvalidActionError) as caught:
            await wrong.step(envkit.assistant("hi"))
        assert caught.value.code == "validation_error"
    finally:
        await wrong.close()


@pytest.mark.openenv
def test_sync_facade(echo_server: Server):
    with envkit.SyncEnv(envkit.make(f"openenv:{echo_server.url}")) as env:
        env.reset(seed=0)
        assert env.step("four").reward == pytest.approx(0.4)
        assert env.tasks("train") is None  # no Task API (0.3), or an env that lists no tasks (0.10 answers 501)


@pytest.mark.e2e
@pytest.mark.openenv
async def test_the_generator_rolls_out_in_an_openenv_env(echo_server: Server, bundled_model: Path, chat_tokenizer):
    """The bundled model (in-process transformers engine) plays OpenEnv's echo env through the Generator."""
    from generators import Generator, GeneratorConfig, env_factory
    from generators.engines.hf import HFEngine

    async with HFEngine(bundled_model) as engine:
        generator = Generator(engine, chat_tokenizer,
                              GeneratorConfig(max_tokens=8, seed=0, max_turns=2))
        trajectories = await generator.generate(env_factory(f"openenv:{echo_server.url}"), seeds=[0, 1])
    assert len(trajectories) == 2
    for t in trajectories:
        assert t.stop_reason in ("done", "max_turns"), (t.stop_reason, t.error)
        replies = [m["content"] for m in t.messages if m["role"] == "assistant"]
        echoes = [m["content"] for m in t.messages[1:] if m["role"] == "user"]
        assert replies and echoes == replies[:len(echoes)]  # every reply came back as the env's observation
        assert t.reward == pytest.approx(sum(0.1 * len(r) for r in replies), abs=1e-6)
        assert len(t.response_ids) == len(t.loss_mask)


@pytest.mark.openenv
async def test_an_mcp_type_env_is_a_tool_env():
    """OpenEnv 0.10's MCPEnvironment (tests/openenv_mcp_env.py), found from its schema: its tools are the env's,
    each tool call a call_tool step, and a reply without one ends the episode."""
    with openenv_server("0.10", "openenv_mcp_env:create_app") as server:
        async with envkit.make(f"openenv:{server.url}") as env:
            messages, info = await env.reset(seed=0)
            assert messages == [{"role": "user", "content": "What is 2 + 3? Use the tools."}]
            assert info["metadata"] == {"answer": 5}  # the model does not see it
            assert {t.name: t.parameters["required"] for t in env.tools} == {"add": ["a", "b"], "submit": ["answer"]}

            def call(name: str, **arguments: Any) -> envkit.Message:
                return envkit.assistant(None, [{"id": f"c-{name}", "type": "function",
                                                "function": {"name": name, "arguments": json.dumps(arguments)}}])

            added = await env.step(call("add", a=2, b=3))
            assert added.observation == [{"role": "tool", "content": "5", "tool_call_id": "c-add", "name": "add"}]
            assert (added.reward, added.done, added.info["tool_results"]) == (0.0, False, [{"name": "add",
                                                                                            "status": "ok"}])
            # written in the text, as a model writes it; the env's own refusals come back as errors
            bad = await env.step(envkit.assistant('<tool_call>{"name": "add", "arguments": {"a": "x"}}</tool_call>'
                                                  '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'))
            assert [m["content"].split(":")[0] for m in bad.observation] == ["Error", "Error"]
            assert "Unknown tool: 'nope'" in bad.observation[1]["content"] and not bad.done
            assert [r["status"] for r in bad.info["tool_results"]] == ["error", "error"]
            done = await env.step(call("submit", answer=5))
            assert (done.reward, done.terminated) == (1.0, True)
            await env.reset(seed=1)
            ended = await env.step(envkit.assistant("The answer is 5."))
            assert (ended.reward, ended.terminated, ended.observation) == (0.0, True, [])
            # the Task API: the server's splits as task lists, and a task's split and index select it at reset
            train, test = env.tasks("train"), env.tasks("test")
            assert [t["id"] for t in train] == [f"train-{i}" for i in range(5)] and len(test) == 3
            assert test[2] == {"id": "test-2", "split": "test", "index": 2, "spec": {"id": "test-2", "a": 102,
                                                                                      "b": 103}}
            messages, _ = await env.reset(task=test[2])
            assert messages[0]["content"] == "What is 102 + 103? Use the tools."
            assert (await env.step(call("submit", answer=205))).reward == 1.0
            with pytest.raises(ValueError, match=r"has splits \['train', 'test'\], not 'dev'"):
                env.tasks("dev")


@pytest.fixture(scope="module")
def envkit_arithmetic() -> Iterator[Server]:
    with envkit_serve("arithmetic") as server:
        yield server


@pytest.mark.openenv
def test_openenvs_own_client_plays_an_envkit_env(envkit_arithmetic: Server, openenv_version: str):
    """The other direction: `envkit serve` answers OpenEnv's protocol at /openenv, and OpenEnv's GenericEnvClient
    (from the OpenEnv venv of that version) plays arithmetic there (tests/openenv_client.py)."""
    run = subprocess.run([str(OPENENV_PYTHONS[openenv_version]), str(TESTS / "openenv_client.py"),
                          f"{envkit_arithmetic.url}/openenv"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.splitlines()[-1])
    with envkit.SyncEnv(envkit.make("arithmetic")) as env:
        opening, info = env.reset(seed=0)
    reset = seen["reset"]
    assert (reset["reward"], reset["done"]) == (None, False)
    assert reset["observation"]["messages"] == opening
    assert reset["observation"]["metadata"] == info and reset["observation"]["tools"] == []
    assert (seen["right"]["reward"], seen["right"]["done"]) == (1.0, True)
    assert (seen["wrong"]["reward"], seen["wrong"]["done"]) == (0.0, True)
    assert not seen["right"]["observation"]["truncated"]
    assert "step() after the episode ended" in seen["after_done"] and "(code: EPISODE_DONE)" in seen["after_done"]
    assert "(code: VALIDATION_ERROR)" in seen["bad_action"]
    assert seen["state"]["step_count"] == 2 and seen["state"]["episode_id"]
    # the connection's session goes with it (the server sees the disconnect after the client has exited)
    deadline = time.monotonic() + 10  # only ends a failing run: the disconnect is seen at once; a leak is for good
    while (open_sessions := httpx.get(f"{envkit_arithmetic.url}/info").json()["sessions"]) and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert open_sessions == 0


def test_malformed_openenv_frames_get_error_frames_and_the_connection_lives(envkit_arithmetic: Server):
    with ws_connect(envkit_arithmetic.url.replace("http", "ws") + "/openenv/ws") as ws:
        for frame, code in (("not json", "VALIDATION_ERROR"), ('{"type": "dance"}', "VALIDATION_ERROR"),
                            ('{"type": "reset", "data": {"seed": "x"}}', "VALIDATION_ERROR"),
                            ('{"type": "step", "data": {"content": "The answer is 1."}}', "RESET_NEEDED"),
                            ('[1, 2]', "VALIDATION_ERROR")):
            ws.send(frame)
            answer = json.loads(ws.recv(timeout=10))
            assert (answer["type"], answer["data"]["code"]) == ("error", code), (frame, answer)
        ws.send('{"type": "reset", "data": {"seed": 3}}')
        answer = json.loads(ws.recv(timeout=10))
        assert answer["type"] == "observation" and answer["data"]["observation"]["messages"][-1]["role"] == "user"
    assert httpx.get(f"{envkit_arithmetic.url}/openenv/health").json() == {"status": "healthy"}
    schema = httpx.get(f"{envkit_arithmetic.url}/openenv/schema").json()
    assert set(schema) == {"action", "observation", "state"} and "content" in schema["action"]["properties"]


def test_openenv_core_is_not_needed_in_the_main_venv():
    assert "openenv" not in sys.modules
