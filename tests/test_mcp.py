"""MCP both ways, against real servers and clients of the official SDK: MCPToolEnv on tests/mcp_server.py over stdio
and streamable HTTP (tools as OpenAI schemas, calls as tool messages, errors, timeouts, no process left behind, in
Generator rollouts too), and `envkit serve ENV --mcp` used by the SDK's client (list, call, the token)."""

from __future__ import annotations

import asyncio
import shlex
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import psutil
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from remote_envs import Server, envkit_serve, error_code, free_port

import envkit
from envkit import Task, ToolCall, assistant
from envkit.errors import InvalidTaskError, MCPServerError
from envkit.integrations.mcp_env import DEFAULT_SYSTEM_PROMPT, MCPTimeouts, MCPToolEnv
from generators.engines.base import ChatCompletion, InferenceEngine, SamplingParams
from generators.rollout import Generator, GeneratorConfig

TESTS = Path(__file__).resolve().parent
SERVER_ARGV = [sys.executable, str(TESTS / "mcp_server.py")]
STDIO = "mcp+stdio:" + shlex.join(SERVER_ARGV)
TOOLS = ["add", "lookup", "sleep", "count", "pid", "picture"]
TOKEN = "mcp-s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
QUESTION: Task = {"question": "What is 19 + 23?", "answer": 42}


def call(name: str, arguments: str, call_id: str = "call_0") -> ToolCall:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


async def tool_reply(env: envkit.Env, name: str, arguments: str) -> str:
    """The content of the tool message that answers one native tool call."""
    result = await env.step(assistant(None, [call(name, arguments)]))
    [message] = result.observation
    assert message["role"] == "tool" and message["tool_call_id"] == "call_0" and message["name"] == name
    return message["content"] or ""


def running(pid: int) -> bool:
    """True while process ``pid`` exists and is not a zombie."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="module")
def http_server() -> Iterator[Server]:
    """tests/mcp_server.py over streamable HTTP on loopback."""
    port = free_port()
    with Server([*SERVER_ARGV, "--http", str(port)], port=port, health="/health") as server:
        yield server


@pytest.fixture()
async def stdio_env() -> AsyncIterator[envkit.Env]:
    env = envkit.make(STDIO, tasks=[QUESTION])
    try:
        yield env
    finally:
        await env.close()


# ---- MCP server -> env ---------------------------------------------------------------------------------------------


async def test_the_env_lists_the_servers_tools_as_openai_schemas(stdio_env: envkit.Env):
    await stdio_env.init()
    assert [t.name for t in stdio_env.tools] == TOOLS
    add = stdio_env.tools[0].to_openai()
    assert add["type"] == "function" and add["function"]["name"] == "add"
    assert add["function"]["description"] == "Add two integers."
    params = add["function"]["parameters"]
    assert params["type"] == "object" and params["required"] == ["a", "b"]
    assert {k: v["type"] for k, v in params["properties"].items()} == {"a": "integer", "b": "integer"}
    assert stdio_env.spec is not None and stdio_env.spec.name == STDIO


async def test_a_tool_call_reaches_the_server_and_comes_back_as_a_tool_message(stdio_env: envkit.Env):
    messages, info = await stdio_env.reset(seed=0)
    assert info["task"] == QUESTION and messages[-1] == {"role": "user", "content": "What is 19 + 23?"}
    system = messages[0]["content"] or ""  # the tools' schemas, for templates that leave `tools` out
    assert system.startswith("You can call these tools:") and '"name": "lookup"' in system and "{tools}" not in system
    assert await tool_reply(stdio_env, "add", '{"a": 19, "b": 23}') == "42"
    assert await tool_reply(stdio_env, "lookup", '{"key": "capital:japan"}') == "Tokyo"
    text_call = await stdio_env.step(assistant('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'))
    assert text_call.observation == [{"role": "tool", "content": "3", "tool_call_id": "call_0", "name": "add"}]
    assert not text_call.done and text_call.info["tool_calls"] == 1
    final = await stdio_env.step(assistant("19 + 23 = 42. The answer is 42."))
    assert (final.reward, final.terminated, final.info["correct"]) == (1.0, True, True)


async def test_tool_errors_are_messages_for_the_model_and_the_episode_goes_on(stdio_env: envkit.Env):
    await stdio_env.reset(task={"question": "Find the capital of Peru.", "answer": "Lima"})
    assert await tool_reply(stdio_env, "lookup", '{"key": "capital:peru"}') == (
        "Error: Error executing tool lookup: no entry for 'capital:peru'; keys: capital:france, capital:japan, secret")
    assert await tool_reply(stdio_env, "nope", "{}") == (
        "Error: unknown tool 'nope'. Available: add, lookup, sleep, count, pid, picture.")
    assert await tool_reply(stdio_env, "add", '{"a": "x", "b": 1}') == (
        "Error: argument 'a' must be of type integer, got str")
    assert await tool_reply(stdio_env, "add", '{"a": 1}') == "Error: missing required argument(s): b"
    assert await tool_reply(stdio_env, "add", '{"a": 1,') == (
        "Error: arguments are not valid JSON: Expecting property name enclosed in double quotes")
    assert await tool_reply(stdio_env, "picture", "{}") == "[image of type image/gif, not shown]"
    assert await tool_reply(stdio_env, "add", '{"a": 2, "b": 2}') == "4"  # the session survived all of that
    final = await stdio_env.step(assistant("I could not find it; maybe lima?"))
    assert (final.reward, final.info) == (1.0, {"turn": 8, "correct": True, "expected": "Lima"})


async def test_a_slow_tool_times_out_as_an_error_message_and_the_session_lives_on():
    env = envkit.make(STDIO, tasks=[QUESTION], timeouts=MCPTimeouts(call_s=0.5))
    try:
        await env.reset(seed=0)
        # The reply is the 0.5 s call timeout's error, so it fired. The 30 s guard only ends a wait for the tool: 60x
        # that timeout, and the tool's 600 s sleep it guards against is 20x beyond it.
        slow = await asyncio.wait_for(tool_reply(env, "sleep", '{"seconds": 600}'), 30)
        assert slow == "Error: the tool 'sleep' did not answer within 0.5 s"
        assert await tool_reply(env, "add", '{"a": 2, "b": 3}') == "5"
    finally:
        await env.close()


async def test_every_episode_gets_a_fresh_session_and_close_stops_the_server():
    env = envkit.make(STDIO, tasks=[QUESTION])
    await env.reset(seed=0)
    first = int(await tool_reply(env, "pid", "{}"))
    assert [await tool_reply(env, "count", "{}") for _ in range(2)] == ["1", "2"]
    await env.reset(seed=0)  # the last episode called tools: a new session, a new process
    second = int(await tool_reply(env, "pid", "{}"))
    assert second != first and not running(first)
    assert await tool_reply(env, "count", "{}") == "1"
    await env.close()
    assert not running(second)
    await env.close()  # idempotent


async def test_a_server_that_cannot_start_fails_init_clearly_and_leaves_nothing_running(tmp_path: Path):
    with pytest.raises(MCPServerError, match=r"cannot start or reach the MCP server /no/such/server: "
                                             r"FileNotFoundError"):
        await envkit.make("mcp+stdio:/no/such/server").init()
    with pytest.raises(MCPServerError, match=r"cannot start or reach the MCP server .* -c 'raise SystemExit\(3\)'"):
        await MCPToolEnv([sys.executable, "-c", "raise SystemExit(3)"]).init()
    pidfile = tmp_path / "pid"
    mute = [sys.executable, "-c", "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); "
                                  "time.sleep(600)", str(pidfile)]  # starts, never speaks MCP
    # The error is the 1 s connect timeout's, so it fired. The 60 s guard only ends a wait for the mute server: 12x
    # the 5 s at most that timeout and the stdio client's stop (SIGTERM after 2 s, SIGKILL 2 s later) take, and the
    # server's 600 s sleep it guards against is 10x beyond it. Its TimeoutError is not the MCPServerError expected.
    with pytest.raises(MCPServerError, match=r"did not finish the handshake within 1 s \(MCPTimeouts.connect_s\)"):
        await asyncio.wait_for(MCPToolEnv(mute, timeouts={"connect_s": 1}).init(), 60)
    assert not running(int(pidfile.read_text()))


async def test_a_server_that_dies_mid_episode_fails_the_step_not_hangs(stdio_env: envkit.Env):
    await stdio_env.reset(seed=0)
    psutil.Process(int(await tool_reply(stdio_env, "pid", "{}"))).kill()
    with pytest.raises(MCPServerError, match=r"the MCP server .* closed the connection during tools/call 'add'"):
        await asyncio.wait_for(stdio_env.step(assistant(None, [call("add", '{"a": 1, "b": 1}')])), 10)


async def test_tasks_graders_and_allowed_tools():
    async def exact(reply: str, task: Task) -> tuple[float, dict[str, Any]]:
        return float(reply.strip() == str(task["answer"])), {"graded_by": "exact"}

    env = MCPToolEnv(SERVER_ARGV, tasks={"train": [QUESTION], "test": []}, grader=exact, allowed_tools=["add"],
                     system_prompt="")
    try:
        assert env.tasks("train") == [QUESTION] and env.tasks("test") == []
        messages, _ = await env.reset(seed=5)
        assert messages == [{"role": "user", "content": "What is 19 + 23?"}] and [t.name for t in env.tools] == ["add"]
        assert await tool_reply(env, "lookup", '{"key": "secret"}') == "Error: unknown tool 'lookup'. Available: add."
        assert (await env.step(assistant("42"))).info == {"turn": 2, "graded_by": "exact"}
    finally:
        await env.close()
    by_path = MCPToolEnv(SERVER_ARGV, grader="envkit.integrations.mcp_env:match_answer")
    assert by_path.grader is not None and by_path.grader("The answer is 42.", QUESTION)[0] == 1.0
    with pytest.raises(ValueError, match="grader 'no_such_module:f' could not be loaded: ModuleNotFoundError"):
        MCPToolEnv(SERVER_ARGV, grader="no_such_module:f")
    nothing_to_grade = MCPToolEnv(SERVER_ARGV)
    try:
        with pytest.raises(InvalidTaskError, match="MCPToolEnv has no tasks to pick from"):
            await nothing_to_grade.reset(seed=0)
        with pytest.raises(InvalidTaskError, match="task must have a 'answer'"):
            await nothing_to_grade.reset(task={"question": "Why?"})
        with pytest.raises(ValueError, match=r"allowed_tools names \['delete'\] that the MCP server"):
            await MCPToolEnv(SERVER_ARGV, allowed_tools=["delete"]).init()
    finally:
        await nothing_to_grade.close()
    with pytest.raises(ValueError, match="names no MCP transport"):
        envkit.make("mcp+ftp://127.0.0.1/mcp")
    with pytest.raises(ValueError, match="headers= go with an HTTP server's requests"):
        MCPToolEnv(SERVER_ARGV, headers=AUTH)


async def test_the_same_env_over_streamable_http(http_server: Server):
    env = envkit.make(f"mcp+{http_server.url}/mcp", tasks=[QUESTION])
    try:
        await env.reset(seed=0)
        assert [t.name for t in env.tools] == TOOLS
        assert await tool_reply(env, "add", '{"a": 40, "b": 2}') == "42"
        assert (await tool_reply(env, "lookup", '{"key": "x"}')).startswith("Error: Error executing tool lookup: no "
                                                                          "entry for 'x'")
    finally:
        await env.close()
    with pytest.raises(MCPServerError, match=r"cannot start or reach the MCP server http://127.0.0.1:\d+/mcp: "
                                             r"ConnectError"):
        await envkit.make(f"mcp+http://127.0.0.1:{free_port()}/mcp").init()


# ---- the env in Generator rollouts (a scripted chat engine; the bundled model is the e2e test below) ---------------


class ToolCaller(InferenceEngine):
    """A chat engine that makes the tool calls it is given, one per turn, then answers with the last result."""

    supports_token_ids = False
    model_name = "tool-caller"

    def __init__(self, *calls: tuple[str, str]) -> None:
        self.calls = list(calls)
        self.seen_tools: list[str] = []

    @property
    def base_url(self) -> str:
        return "scripted://"

    async def chat(self, messages: list[dict[str, Any]], sampling: SamplingParams,
                   tools: list[dict[str, Any]] | None = None) -> ChatCompletion:
        self.seen_tools = [t["function"]["name"] for t in tools or []]
        turn = sum(m["role"] == "assistant" for m in messages)
        if turn < len(self.calls):
            return ChatCompletion("", tool_calls=[call(*self.calls[turn], call_id=f"call_{turn}")])
        return ChatCompletion(f"The answer is {messages[-1]['content']}.")


async def test_a_generator_rollout_calls_the_servers_tools():
    engine = ToolCaller(("add", '{"a": 19, "b": 23}'))
    [traj] = await Generator(engine, None, GeneratorConfig(max_turns=4)).generate(
        lambda: envkit.make(STDIO, tasks=[QUESTION]), seeds=[0])
    assert traj.stop_reason == "done" and traj.reward == 1.0 and traj.num_turns == 2
    assert engine.seen_tools == TOOLS
    assert traj.messages[3] == {"role": "tool", "content": "42", "tool_call_id": "call_0", "name": "add"}


async def test_a_rollout_that_times_out_mid_call_leaves_no_server_running():
    engine = ToolCaller(("pid", "{}"), ("sleep", '{"seconds": 600}'))
    # The stop reason says the rollout's 3 s timeout fired: without it the call would end at its 60 s call_s and the
    # rollout as "done". The 120 s guard only ends a hang: 17x the 7 s at most that timeout and the stdio server's
    # stop (SIGTERM after 2 s, SIGKILL 2 s later) take.
    [traj] = await asyncio.wait_for(Generator(engine, None, GeneratorConfig(max_turns=4, timeout_s=3)).generate(
        lambda: envkit.make(STDIO, tasks=[QUESTION]), seeds=[0]), 120)
    assert traj.stop_reason == "timeout" and traj.messages[-1]["role"] == "assistant"
    assert not running(int(traj.messages[3]["content"] or "0"))  # close() waited for the server to exit


# ---- env -> MCP server: envkit serve --mcp ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mcp_serve() -> Iterator[Server]:
    """`envkit serve calculator --mcp` with a token on loopback."""
    server = envkit_serve("calculator", "--mcp", env={"ENVKIT_TOKEN": TOKEN})
    yield server
    server.stop()


async def test_serve_mcp_lists_and_calls_the_envs_tools(mcp_serve: Server):
    async with (httpx2.AsyncClient(headers=AUTH) as http,
                Client(streamable_http_client(mcp_serve.url + "/mcp", http_client=http)) as client):
        [tool] = (await client.list_tools()).tools
        assert tool.name == "calculator"
        assert tool.description == "Evaluate an arithmetic expression and return the result."
        assert tool.input_schema["required"] == ["expression"]
        result = await client.call_tool("calculator", {"expression": "37*24-158"})
        assert (result.content[0].text, result.is_error) == ("730", False)  # type: ignore[union-attr]
        bad = await client.call_tool("calculator", {"expr": "1+1"})
        assert bad.is_error and bad.content[0].text == "missing required argument(s): expression"  # type: ignore[union-attr]
        unknown = await client.call_tool("shell", {})
        assert unknown.is_error and unknown.content[0].text == "unknown tool 'shell'. Available: calculator."  # type: ignore[union-attr]
    async with httpx.AsyncClient(headers=AUTH) as http1:
        metrics = (await http1.get(mcp_serve.url + "/metrics")).text
    assert 'envkit_requests_total{op="tool_call",transport="mcp"} 3' in metrics
    assert 'envkit_sessions_closed_total{reason="mcp"} 3' in metrics  # one env per call, each closed


async def test_serve_mcp_refuses_calls_without_the_token(mcp_serve: Server):
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    accept = {"Accept": "application/json, text/event-stream"}
    async with httpx.AsyncClient(base_url=mcp_serve.url) as http:
        r = await http.post("/mcp", json=body, headers=accept)
        assert (r.status_code, error_code(r)) == (401, "unauthorized")
        # A loopback server answers only requests that name a loopback host: no DNS rebinding from a browser.
        rebinding = await http.post("/mcp", json=body, headers={**AUTH, **accept, "Host": "evil.example"})
        assert rebinding.status_code in (400, 421)
    with pytest.raises(Exception) as refused:  # the SDK client reports the refused request from its task group
        async with Client(streamable_http_client(mcp_serve.url + "/mcp")) as client:
            await client.list_tools()
    assert "error response" in repr(refused.value)


async def test_an_env_made_from_envkit_serve_mcp_both_ways(mcp_serve: Server):
    env = envkit.make(f"mcp+{mcp_serve.url}/mcp", headers=AUTH, tasks=[{"question": "37*24-158?", "answer": 730}])
    try:
        await env.reset(seed=0)
        assert await tool_reply(env, "calculator", '{"expression": "37*24-158"}') == "730"
    finally:
        await env.close()


def test_serve_mcp_needs_a_tool_env():
    out = subprocess.run([sys.executable, "-m", "envkit.cli", "serve", "arithmetic", "--mcp", "--port",
                          str(free_port())], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "--mcp serves the tools of a ToolEnv one call at a time; 'arithmetic' runs its tools inside step()" in (
        " ".join(out.stdout.split()))


# ---- e2e: the bundled model on vLLM (run with the e2e tests) -------------------------------------------------------


class SecretEnv(MCPToolEnv):
    """The opening carries a lookup made over MCP at reset; the answer is the secret number."""

    async def start_episode(self, *, seed: int | None, task: Task | None) -> tuple[list[envkit.Message], dict]:
        secret = await self.run_tool("lookup", {"key": "secret"})
        self.task = {"question": "What is the secret number?", "answer": 42}
        return self.opening(f"The lookup tool answered: {secret}\nWhat is the secret number? You may call add or "
                            "lookup first."), {"task": self.task}


async def test_mcp_tools_in_a_rollout_with_the_bundled_model(vllm_engine, chat_tokenizer):
    """The server's lookup at reset and its tools' schemas reach what the model reads. Whether the untaught bundled
    model then calls a tool is chance, so the calls' round trip through the generator is checked with scripted
    calls (test_a_generator_rollout_calls_the_servers_tools), not here."""
    gen = Generator(vllm_engine, chat_tokenizer, GeneratorConfig(max_turns=3, max_tokens=48, samples_per_prompt=2))
    trajs = await gen.generate(lambda: SecretEnv(SERVER_ARGV), seeds=[0, 1])
    assert len(trajs) == 4  # 2 seeds x 2 samples: the checks below ran on each
    for traj in trajs:
        assert not traj.failed, traj.error
        assert traj.stop_reason in ("done", "max_turns", "max_tokens") and traj.num_turns >= 1
        system, question = traj.messages[0]["content"] or "", traj.messages[1]["content"] or ""
        assert "The secret number is 42." in question  # fetched from the server over MCP at reset
        prompt = chat_tokenizer.decode(traj.prompt_ids)
        assert system.startswith(DEFAULT_SYSTEM_PROMPT.split("{tools}")[0]) and system in prompt
        assert all(f'"name": "{name}"' in prompt for name in TOOLS)  # the schemas reached what the model read
