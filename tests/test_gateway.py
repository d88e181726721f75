"""The capture gateway against the session's vLLM server: agents that run their own loop with the openai SDK, their
calls captured exactly as the engine sampled them, linked into segments, and refused cleanly where they must be."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import hostile
import httpx
import openai
import psutil
import pytest
from agent_envs import ADD, INSTRUCTIONS, add, hosted, llm, run_add, tool_loop

from envkit import Task
from envkit.agents import process as host_process
from envkit.agents.agent import AgentClient, AgentEnv
from envkit.errors import AgentProcessError
from generators.engines.base import ChatCompletion, Completion, InferenceEngine, SamplingParams
from generators.gateway.server import Gateway, Limits
from generators.rollout import Generator, GeneratorConfig
from generators.trajectory import Trajectory

pytestmark = pytest.mark.e2e

QUESTION = {"id": "q", "question": "What is 2 + 3?"}
STOPS = ["e", "a", "o", "t"]


class Recorded(InferenceEngine):
    """The session's vLLM engine, every generation it answered recorded as (prompt ids, completion)."""

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine
        self.model_name = engine.model_name
        self.calls: list[tuple[list[int], Completion]] = []

    @property
    def base_url(self) -> str:
        return self.engine.base_url

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Completion:
        completion = await self.engine.generate(prompt_ids, sampling)
        self.calls.append((list(prompt_ids), completion))
        return completion

    async def chat(self, messages: list[dict[str, Any]], sampling: SamplingParams,
                   tools: list[dict[str, Any]] | None = None) -> ChatCompletion:
        return await self.engine.chat(messages, sampling, tools)


def spans(t: Trajectory) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of model tokens, as positions in prompt + response."""
    out, start, offset = [], None, len(t.prompt_ids)
    for i, m in enumerate([*t.loss_mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((offset + start, offset + i))
            start = None
    return out


def canonical(t: Trajectory, span: tuple[int, int], tokenizer: Any) -> bool:
    """Whether the model's tokens in ``span`` are how the tokenizer encodes their text (sampling may write, say,
    "\n\n" as one token where encoding gives two: re-rendering the chat then differs, the captured ids do not)."""
    ids = (t.prompt_ids + t.response_ids)[span[0]:span[1]]
    ids = ids[:-1] if ids[-1] == tokenizer.eos_id else ids
    return tokenizer.tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False) == ids


def skew_bound(t: Trajectory, tokenizer: Any) -> int:
    """The most linked calls that can count as skewed: re-rendering differs only once the model sampled a
    non-canonical tokenization of its text, and each linked call re-renders the whole chat, so such a turn shows in
    every check after it."""
    odd = [not canonical(t, span, tokenizer) for span in spans(t)[:-1]]
    return sum(any(odd[:j + 1]) for j in range(len(odd)))


def assert_exact(trajectories: list[Trajectory], engine: Recorded) -> None:
    """Every run of model tokens in every sequence is one engine call: its prompt is everything before the run,
    its tokens and logprobs are the run's; and every engine call is used exactly once."""
    unused = list(range(len(engine.calls)))
    for t in trajectories:
        t.check()
        for sequence in t.sequences():
            ids = sequence.prompt_ids + sequence.response_ids
            for start, end in spans(sequence):
                match = [i for i in unused if engine.calls[i][0] == ids[:start]
                         and engine.calls[i][1].token_ids == ids[start:end]]
                assert match, f"no engine call sampled tokens {start}:{end} of {t.task_id}"
                completion = engine.calls[match[0]][1]
                lp = sequence.rollout_logprobs[start - len(sequence.prompt_ids):end - len(sequence.prompt_ids)]
                assert lp == completion.logprobs
                unused.remove(match[0])
    assert unused == [], "engine calls that no trajectory holds"


async def exited(pid: int, timeout_s: float) -> None:
    """Wait for process ``pid`` to exit without reaping it (its parent, the code under test, does that)."""
    for _ in range(int(timeout_s * 10)):
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"process {pid} still runs after {timeout_s} s")


def generator(engine: InferenceEngine, tokenizer: Any, **config: Any) -> Generator:
    return Generator(engine, tokenizer, GeneratorConfig(**{"max_tokens": 48, "max_turns": 3, **config}))


def agent_env(agent: Any, answers: list[Any] | None = None) -> Any:
    def grade(task: Task, result: Any) -> float:
        if answers is not None:
            answers.append(result)
        return 1.0 if "5" in str(result) else 0.0

    return lambda: AgentEnv(agent=agent, grader=grade, tasks=[QUESTION])



async def test_generated_hostile_bodies_get_no_5xx_from_the_gateway(vllm_engine, chat_tokenizer, capsys, caplog,
                                                                    monkeypatch):
    """The capture gateway under the policy server's fuzz (tests/hostile.py), in one open episode: no generated body on
    any dialect's route gets a 5xx, every refusal is structured, and the episode's key still gets answers after. A
    fault of its own (sampling that raises) is a structured 500 whose log names the route, not the key in the path."""
    config = GeneratorConfig(max_tokens=8)
    sampler = Generator(vllm_engine, chat_tokenizer, config)
    limits = Limits(config.sampling, 1 << 30, config.max_total_tokens, False)
    async with Gateway(vllm_engine, chat_tokenizer, sampler.parser, sampler.tool_prompt, limits) as gateway:
        episode = gateway.open()
        key = gateway.client(episode).api_key
        seen = await asyncio.to_thread(hostile.fuzz, gateway.url, key, hostile.EXAMPLES)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
            ok = await http.post("/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                                 json={"messages": [{"role": "user", "content": "Still there?"}], "max_tokens": 2})
            paths = (await http.get("/openapi.json")).json()["paths"]
            monkeypatch.setattr(gateway, "chat", lambda *_: (_ for _ in ()).throw(RuntimeError("the engine broke")))
            failed = await http.post(f"/e/{key}/v1/chat/completions", json={"messages": [{"role": "user",
                                                                                          "content": "Hi."}]})
        gateway.end(episode)
    assert failed.status_code == 500 and "request id" in failed.json()["error"]["message"], failed.text
    assert "/e/{key}/v1/chat/completions" in caplog.text and key not in caplog.text
    assert {route for route in hostile.DIALECT_ROUTES if "requestBody" in paths[route]["post"]} == set(
        hostile.DIALECT_ROUTES)  # the schema it publishes documents each dialect's body
    assert ok.status_code == 200, ok.text
    statuses = Counter(status for _, status in seen.elements())
    with capsys.disabled():
        print(f"\ngateway fuzz: {sum(statuses.values())} requests, statuses {dict(sorted(statuses.items()))}")
    assert {200, 400} <= set(statuses)  # the fuzz reached the engine, not only the validation


@pytest.mark.agent_frameworks
@pytest.mark.parametrize("stream", [False, True], ids=["json", "streamed"])
async def test_an_sdk_agents_calls_are_captured_as_the_engine_sampled_them(vllm_engine, chat_tokenizer, stream):
    """A 3-call tool loop: one linked sequence per episode, no re-tokenization skew, and what the agent was told is
    what the model wrote."""
    engine = Recorded(vllm_engine)
    answers: list[Any] = []
    gen = generator(engine, chat_tokenizer, samples_per_prompt=4)

    async def agent(task: Task, client: AgentClient) -> str:
        return await tool_loop(task, client, turns=3, stream=stream)

    trajs = await gen.generate(agent_env(agent, answers), tasks=[QUESTION])
    assert [t.stop_reason for t in trajs] == ["done"] * 4, [t.error for t in trajs]
    assert [t.num_turns for t in trajs] == [3] * 4
    assert all(t.segments == [] for t in trajs)
    assert len(engine.calls) == 12
    assert_exact(trajs, engine)
    assert all(t.template_mismatches <= skew_bound(t, chat_tokenizer) for t in trajs)
    # the tool outputs and the agent's prompts went in as observation tokens (mask 0) between the model's turns
    assert all(len(spans(t)) == 3 and t.loss_mask.count(0) > 0 for t in trajs)
    for t in trajs:
        # the last model turn as the parser reads it: the text the agent returned
        start, end = spans(t)[-1]
        reply = gen.parser.parse(chat_tokenizer.decode((t.prompt_ids + t.response_ids)[start:end]), [ADD])
        assert (reply.get("content") or "") in answers
        assert {m["role"] for m in t.messages} >= {"system", "user", "assistant"}
    assert sorted(t.reward for t in trajs) == sorted(1.0 if "5" in a else 0.0 for a in answers)


@pytest.mark.agent_frameworks
async def test_choices_not_continued_and_a_compressed_context_become_segments(vllm_engine, chat_tokenizer):
    """n=2, the agent continuing the second choice; then a call with a summarized history: three sequences (the
    continued one, the other choice, the new context), each exact, the episode's reward on all."""
    engine = Recorded(vllm_engine)

    async def agent(task: Task, client: AgentClient) -> str:
        chat = llm(client)
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": task["question"]}]
        first = await chat.chat.completions.create(model=client.model, messages=messages, n=2, max_tokens=24)
        assert len(first.choices) == 2
        messages += [first.choices[1].message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
        await chat.chat.completions.create(model=client.model, messages=messages, max_tokens=24)
        summary = [{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": f"Earlier: {task['question']} Say the answer."}]
        last = await chat.chat.completions.create(model=client.model, messages=summary, max_tokens=24)
        return last.choices[0].message.content

    [t] = await generator(engine, chat_tokenizer).generate(agent_env(agent), tasks=[QUESTION])
    assert t.stop_reason == "done", t.error
    assert t.num_turns == 3 and len(engine.calls) == 4
    assert t.template_mismatches <= skew_bound(t, chat_tokenizer)  # one linked call
    sequences = t.sequences()
    assert len(sequences) == 3 and len(t.segments) == 2
    assert [len(spans(s)) for s in sequences] == [2, 1, 1]
    first_prompt = engine.calls[0][0]
    assert sequences[0].prompt_ids == sequences[1].prompt_ids == first_prompt  # the two choices of one prompt
    assert sequences[2].prompt_ids != first_prompt
    assert_exact([t], engine)
    assert {s.reward for s in sequences} == {t.reward}


@pytest.mark.agent_frameworks
async def test_calls_are_refused_cleanly_and_the_gateway_stays_up(vllm_engine, chat_tokenizer):
    """Unknown key 401, a malformed body 400 with a structured error, a call after the episode ended 409, the call
    limit 429 (the episode stops on max_turns and scores 0), and good calls answered in between."""
    seen: dict[str, Any] = {}

    async def agent(task: Task, client: AgentClient) -> str:
        async with httpx.AsyncClient(base_url=client.base_url, timeout=60) as http:
            auth = {"Authorization": f"Bearer {client.api_key}"}
            seen["unknown"] = (await http.post("/chat/completions", json={"messages": [{"role": "user",
                                                                                      "content": "hi"}]},
                                               headers={"Authorization": "Bearer nope"})).json()
            seen["no_messages"] = await http.post("/chat/completions", json={"model": "policy"}, headers=auth)
            seen["bad_role"] = await http.post("/chat/completions", json={"messages": [{"role": "robot"}]},
                                               headers=auth)
            seen["not_json"] = await http.post("/chat/completions", content=b"{", headers=auth)
            for name, (body, _) in hostile.CHAT.items():
                seen[name] = await http.post("/chat/completions", content=body, headers=auth)
            seen["n17"] = await http.post("/chat/completions", headers=auth, json={
                "messages": [{"role": "user", "content": "hi"}], "n": 17})
            seen["stop5"] = await http.post("/chat/completions", headers=auth, json={
                "messages": [{"role": "user", "content": "hi"}], "stop": list("abcde")})
            seen["too_long"] = await http.post("/chat/completions", headers=auth, json={
                "messages": [{"role": "user", "content": "word " * 400}]})  # past max_total_tokens=256
            seen["models"] = (await http.get("/models", headers=auth)).json()
        via_path = openai.AsyncOpenAI(base_url=client.episode_url, api_key="unused", max_retries=0)
        capped = await via_path.chat.completions.create(model=client.model, max_tokens=1000, messages=[
            {"role": "user", "content": "Tell me a very long story about a dragon."}])
        seen["capped"] = (capped.usage.completion_tokens, capped.choices[0].finish_reason)
        chat = [{"role": "user", "content": task["question"]}]
        for _ in range(3):  # max_turns=3: the third of these is refused
            try:
                await via_path.chat.completions.create(model=client.model, messages=chat, max_tokens=8)
            except openai.RateLimitError as e:
                seen["limit"] = e.body
                raise
        return "unreachable"

    gen = generator(vllm_engine, chat_tokenizer, max_turns=3, max_tokens=16, max_total_tokens=256)
    env = agent_env(agent)
    [t] = await gen.generate(env, tasks=[QUESTION])
    assert seen["unknown"]["error"]["code"] == "invalid_api_key"
    for key in ("no_messages", "bad_role", "not_json", "n17", "stop5"):
        assert seen[key].status_code == 400 and seen[key].json()["error"]["code"] in ("invalid_request",
                                                                                      "invalid_message"), key
    for name, (_, status) in hostile.CHAT.items():  # each class of hostile body, refused as the policy server does
        assert seen[name].status_code == status and seen[name].json()["error"]["message"], (name, seen[name].text)
    assert "messages" in seen["no_messages"].json()["error"]["message"]
    assert "robot" in seen["bad_role"].json()["error"]["message"]
    assert seen["n17"].json()["error"]["message"].startswith("n:")
    assert "at most 4 stop strings" in seen["stop5"].json()["error"]["message"]
    too_long = seen["too_long"]
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    assert too_long.headers["x-should-retry"] == "false"  # SDKs would otherwise retry refusals (409, 429)
    # the agent asked for 1000 tokens; the run allows 16 a call (a story runs past them)
    tokens, finish = seen["capped"]
    assert tokens <= 16 and (finish != "length" or tokens == 16)
    assert seen["models"]["data"][0]["id"] == vllm_engine.model_name
    assert seen["limit"]["code"] == "call_limit"
    assert (t.stop_reason, t.reward, t.num_turns, t.failed) == ("max_turns", 0.0, 3, False)
    assert len(t.sequences()) >= 1 and sum(t.loss_mask) > 0  # the answered calls are kept

    # an episode's key is dead once it ends: a late call (an agent's stray task) gets 409
    ended: dict[str, Any] = {}

    async def leaves_a_call_behind(task: Task, client: AgentClient) -> str:
        ended["client"] = client
        reply = await llm(client).chat.completions.create(model=client.model, max_tokens=4,
                                                          messages=[{"role": "user", "content": "hi"}])
        return reply.choices[0].message.content or ""

    async with gen._agents.serving():  # the gateway held open past the rollout, as a training step's batch holds it
        await gen.rollout(agent_env(leaves_a_call_behind), task=QUESTION)
        client = ended["client"]
        async with httpx.AsyncClient() as http:
            late = await http.post(client.base_url + "/chat/completions", headers={"Authorization":
                                                                                   f"Bearer {client.api_key}"},
                                   json={"messages": [{"role": "user", "content": "hi"}]})
        assert late.status_code == 409 and late.json()["error"]["code"] == "episode_ended"


@pytest.mark.agent_frameworks
async def test_agents_that_crash_hang_or_run_concurrently_fail_alone_and_never_mix(vllm_engine, chat_tokenizer):
    """Of 8 concurrent episodes, one agent raises and one hangs past its rollout timeout: those two fail, the other
    six finish, each holding only its own question."""
    tasks = [{"id": f"t{i}", "question": f"What is {i} + {i + 1}? Question {i}."} for i in range(8)]

    async def agent(task: Task, client: AgentClient) -> str:
        if task["id"] == "t3":
            raise RuntimeError("the agent crashed")
        reply = await llm(client).chat.completions.create(
            model=client.model, max_tokens=16, messages=[{"role": "user", "content": task["question"]}])
        if task["id"] == "t5":
            await asyncio.sleep(3600)
        return reply.choices[0].message.content or ""

    def make() -> AgentEnv:
        return AgentEnv(agent=agent, grader=lambda task, text: 0.0, tasks=tasks)

    # Only the hanging episode runs under a short rollout deadline: a loaded machine cannot time the others out.
    gen = generator(vllm_engine, chat_tokenizer)
    trajs, hung = await asyncio.gather(gen.generate(make, tasks=[t for t in tasks if t["id"] != "t5"]),
                                       generator(vllm_engine, chat_tokenizer, timeout_s=5).generate(
                                           make, tasks=[tasks[5]]))
    by_id = {t.task_id: t for t in trajs + hung}
    assert by_id["t3"].stop_reason == "error" and "the agent crashed" in by_id["t3"].error
    assert by_id["t5"].stop_reason == "timeout"
    for i, t in by_id.items():
        if i in ("t3", "t5"):
            continue
        assert t.stop_reason == "done" and t.num_turns == 1, t.error
        text = chat_tokenizer.decode(t.prompt_ids)
        assert f"Question {i[1:]}." in text
        assert sum(f"Question {j}." in text for j in range(8)) == 1
    assert gen._agents._gateway is None  # the batch over, its gateway stopped


@pytest.mark.agent_frameworks
async def test_an_agent_in_a_host_process_is_captured_exactly_and_a_blocked_host_is_replaced(vllm_engine,
                                                                                              chat_tokenizer,
                                                                                              monkeypatch):
    """agent_process=True: every episode's agent runs in one host process, not this one, and is captured as
    exactly as in-process agents are. An agent that raises fails its rollout alone; one whose synchronous code
    blocks the host's event loop times out, and the host, unable to confirm the cancellation, is killed so that
    the next episodes get a fresh one. What an agent writes to fd 1 cannot answer for an episode."""
    engine = Recorded(vllm_engine)
    answers: list[Any] = []
    gen = generator(engine, chat_tokenizer, samples_per_prompt=4)

    def env(*tasks: Task) -> Any:
        def grade(task: Task, result: dict[str, Any]) -> float:
            answers.append(result)
            return float("5" in result["answer"])

        return lambda: AgentEnv(agent=hosted, grader=grade, tasks=list(tasks), agent_process=True)

    trajs = await gen.generate(env(QUESTION), tasks=[QUESTION])
    assert [t.stop_reason for t in trajs] == ["done"] * 4, [t.error for t in trajs]
    assert [t.num_turns for t in trajs] == [3] * 4
    assert_exact(trajs, engine)
    assert all(t.template_mismatches <= skew_bound(t, chat_tokenizer) for t in trajs)
    assert sorted(t.reward for t in trajs) == sorted(float("5" in a["answer"]) for a in answers)
    host = {a["pid"] for a in answers}
    assert len(host) == 1 and os.getpid() not in host

    crash = {"id": "crash", "question": "?"}
    trajs = await generator(vllm_engine, chat_tokenizer).generate(env(crash, QUESTION), tasks=[crash, QUESTION])
    assert [t.stop_reason for t in trajs] == ["error", "done"]
    assert "the agent crashed" in trajs[0].error and "AgentProcessError" in trajs[0].error

    # an agent writing answers to fd 1 (itself, and from a child) forges none: the host's answers are not on fd 1
    forge = {"id": "forge", "question": "?"}
    answers.clear()
    trajs = await generator(vllm_engine, chat_tokenizer).generate(env(forge, QUESTION), tasks=[forge, QUESTION])
    assert [t.stop_reason for t in trajs] == ["done", "done"], [t.error for t in trajs]
    assert sorted(a["answer"] == "honest" for a in answers) == [False, True] and "forged" not in str(answers)

    block = {"id": "block", "question": "?"}
    # the blocked host can never confirm: a short deadline to do so spares the test its 10 s wait
    monkeypatch.setattr(host_process, "CANCEL_ACK_S", 1.0)
    blocked = await generator(vllm_engine, chat_tokenizer, timeout_s=5).generate(env(block), tasks=[block])
    assert blocked[0].stop_reason == "timeout"
    await exited(host.pop(), host_process.CANCEL_ACK_S + 10)  # killed, having not confirmed
    answers.clear()
    trajs = await generator(vllm_engine, chat_tokenizer).generate(env(QUESTION), tasks=[QUESTION])
    assert trajs[0].stop_reason == "done", trajs[0].error
    assert answers[0]["pid"] not in {os.getpid(), *host}


async def test_a_hosted_agent_must_be_found_by_name_and_return_json():
    with pytest.raises(ValueError, match="module-level function"):
        AgentEnv(agent=lambda task, client: "", agent_process=True)
    env = AgentEnv(agent=hosted, tasks=[{"id": "set"}], agent_process=True)
    await env.reset(seed=0)
    client = AgentClient(base_url="http://127.0.0.1:9/v1", api_key="-", model="policy", episode_url="")
    with pytest.raises(AgentProcessError, match="returned a dict, which is not JSON"):
        await env.run(client)


@pytest.mark.agent_frameworks
async def test_a_gateway_on_every_interface_is_announced_at_this_nodes_address(vllm_engine, chat_tokenizer):
    """``gateway_host=0.0.0.0`` (agents on other nodes): the agent is given this node's address on its default
    route, where its call is served and captured, and its episode's own port there; loopback reaches the same
    gateway."""
    from generators.gateway import node_address

    reached: list[str] = []

    async def agent(task: Task, client: AgentClient) -> str:
        url = urlsplit(client.base_url)
        assert client.channel_url is not None and urlsplit(client.channel_url).hostname == url.hostname
        for host in (url.hostname, "127.0.0.1"):
            base = client.base_url.replace(f"//{url.hostname}:", f"//{host}:")
            models = await openai.AsyncOpenAI(base_url=base, api_key=client.api_key, max_retries=0).models.list()
            reached.append(f"{host} {models.data[0].id}")
        channel = openai.AsyncOpenAI(base_url=f"{client.channel_url}/v1", api_key=client.api_key, max_retries=0)
        reached.append(f"channel {(await channel.models.list()).data[0].id}")
        reply = await llm(client).chat.completions.create(
            model=client.model, max_tokens=8, messages=[{"role": "user", "content": task["question"]}])
        return reply.choices[0].message.content or ""

    [t] = await generator(vllm_engine, chat_tokenizer, gateway_host="0.0.0.0").generate(agent_env(agent),
                                                                                        tasks=[QUESTION])
    assert t.stop_reason == "done" and t.num_turns == 1, t.error
    assert reached == [f"{node_address()} {vllm_engine.model_name}", f"127.0.0.1 {vllm_engine.model_name}",
                       f"channel {vllm_engine.model_name}"]


@pytest.mark.agent_frameworks
async def test_responses_api_calls_link_and_refuse_as_chat_calls_do(vllm_engine, chat_tokenizer):
    """Four /v1/responses calls: the second resends the first's output items, the third continues by
    previous_response_id, the fourth continues the third streamed; one exact sequence, the stream's terminal
    Response carrying what the model sampled. A hosted tool and an unknown response id get 400s."""
    engine = Recorded(vllm_engine)
    refused: dict[str, Any] = {}
    streamed: dict[str, Any] = {}
    tools = [{"type": "function", "name": "add", "description": "Add two integers.",
              "parameters": ADD["function"]["parameters"]}]

    async def agent(task: Task, client: AgentClient) -> str:
        sdk = llm(client)
        first = await sdk.responses.create(model=client.model, instructions="Use the add tool, then answer.",
                                           input=task["question"], tools=tools, max_output_tokens=24)
        items: list[Any] = [{"role": "user", "content": task["question"]},
                            *[item.model_dump(exclude_none=True) for item in first.output]]
        items += [{"type": "function_call_output", "call_id": item.call_id, "output": run_add(item.arguments)}
                  for item in first.output if item.type == "function_call"]
        second = await sdk.responses.create(model=client.model, instructions="Use the add tool, then answer.",
                                            input=[*items, {"role": "user", "content": "Sure?"}], tools=tools,
                                            max_output_tokens=24)
        third = await sdk.responses.create(model=client.model, previous_response_id=second.id, tools=tools,
                                           instructions="Use the add tool, then answer.",  # not inherited
                                           input=[{"role": "user", "content": "Say it once more."}],
                                           max_output_tokens=24)
        events = [e async for e in await sdk.responses.create(
            model=client.model, previous_response_id=third.id, instructions="Use the add tool, then answer.",
            tools=tools, input="Once more, briefly.", max_output_tokens=16, stream=True)]
        streamed.update(kinds=[e.type for e in events], response=events[-1].response)
        for name, kwargs in [("hosted", {"tools": [{"type": "web_search"}]}),
                             ("unknown", {"previous_response_id": "resp_nope"})]:
            try:
                await sdk.responses.create(model=client.model, input="hi", **kwargs)
            except openai.BadRequestError as e:
                refused[name] = e.body
        return third.output_text

    [t] = await generator(engine, chat_tokenizer, max_turns=5).generate(agent_env(agent), tasks=[QUESTION])
    assert t.stop_reason == "done", t.error
    assert t.num_turns == 4 and len(engine.calls) == 4 and t.segments == []
    assert len(spans(t)) == 4
    assert_exact([t], engine)
    assert t.template_mismatches <= skew_bound(t, chat_tokenizer)
    last = engine.calls[-1][1]
    assert streamed["kinds"][:2] == ["response.created", "response.in_progress"]
    assert streamed["kinds"][-1] == ("response.incomplete" if last.finish_reason == "length" else "response.completed")
    assert streamed["response"].usage.output_tokens == len(last.token_ids)
    assert streamed["response"].output_text.strip() in chat_tokenizer.decode(last.token_ids)
    assert {name: body["code"] for name, body in refused.items()} == {
        "hosted": "unsupported", "unknown": "previous_response_not_found"}
    assert "web_search" in refused["hosted"]["message"]


AGENT_PROCESS = """
import json, os, subprocess, sys
task = json.load(sys.stdin)
mode = task["mode"]
if mode == "big":  # past the limit of one environment string: on stdin only
    assert "ENVKIT_TASK" not in os.environ and len(task["padding"]) == 200_000
else:
    assert json.loads(os.environ["ENVKIT_TASK"]) == task
if mode == "crash":
    sys.exit("the agent crashed")
if mode == "flood":
    sys.stdout.write("x" * (2 << 20))
    sys.exit(0)
if mode in ("hang", "outlive"):
    sleep = [sys.executable, "-c", "import time; time.sleep(3600)", task["marker"]]
    subprocess.Popen(sleep)
    os.execv(sys.executable, sleep)
import openai  # here, not first: importing it takes seconds on a loaded machine, past the hang's 3 s deadline
chat = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY: the episode's
reply = chat.chat.completions.create(model=os.environ["OPENAI_MODEL"], max_tokens=8,
                                     messages=[{"role": "user", "content": task["question"]}])
print("noise on stdout, then the answer:")
print(reply.choices[0].message.content or "", task["id"])
"""


@pytest.mark.agent_frameworks
async def test_an_agents_sdk_streamed_run_is_captured_as_its_calls_were_sampled(vllm_engine, chat_tokenizer):
    """The OpenAI Agents SDK's streamed runs (``Runner.run_streamed``, over the Responses API, the SDK's default
    model) go through the gateway unmodified: the events reach the agent, and each model call is captured exactly.
    (A reply the token limit cut ends the run as ``max_tokens``: the SDK raises on an incomplete response.)"""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner, function_tool

    engine = Recorded(vllm_engine)
    seen: list[list[str]] = []

    async def agent(task: Task, client: AgentClient) -> str:
        sdk = Agent(name="adder", instructions=INSTRUCTIONS, tools=[function_tool(add)],
                    model=OpenAIResponsesModel(model=client.model, openai_client=llm(client)),
                    model_settings=ModelSettings(max_tokens=64))
        run = Runner.run_streamed(sdk, task["question"], max_turns=3, run_config=RunConfig(tracing_disabled=True))
        events: list[str] = []
        seen.append(events)
        async for event in run.stream_events():
            if event.type == "raw_response_event":
                events.append(event.data.type)
        return str(run.final_output)

    trajs = await generator(engine, chat_tokenizer, max_turns=3, max_tokens=64).generate(agent_env(agent),
                                                                                         tasks=[QUESTION] * 2)
    assert {t.stop_reason for t in trajs} <= {"done", "max_tokens"}, [t.error for t in trajs]
    assert_exact(trajs, engine)
    assert len(engine.calls) == sum(t.num_turns for t in trajs) >= 2
    for events in seen:
        assert events[0] == "response.created" and events.count("response.output_item.done") >= 1
        assert events[-1] in ("response.completed", "response.incomplete")
    assert sum(events.count("response.created") for events in seen) == len(engine.calls)


@pytest.mark.agent_frameworks
async def test_command_agents_run_as_processes_and_fail_alone_with_their_process_tree_killed(
        vllm_engine, chat_tokenizer):
    """A process per episode, reaching the policy through OPENAI_BASE_URL/OPENAI_API_KEY: one answers (its stdout
    graded), one answers a task too big for the environment (on stdin only), one exits non-zero, one floods stdout
    past the output limit (failed, not graded cut), one hangs past its deadline and one past the rollout's, each
    with a child process: the failures fail alone, and no process of the hung agents is left."""

    from agent_envs import AGENT_PYTHON, watching

    from envkit.agents.agent import Command

    tasks = [{"id": m, "mode": m, "question": "What is 2 + 3?", "marker": f"envkit-agent-{m}-{os.getpid()}"}
             for m in ("answer", "big", "crash", "flood", "hang", "outlive")]
    tasks[1]["padding"] = "x" * 200_000
    answers: dict[str, str] = {}

    def grade(task: Task, text: str) -> float:
        answers[task["id"]] = text
        return 1.0

    def make() -> AgentEnv:
        def agent(task: Task, client: AgentClient) -> Any:
            deadline = {"hang": 3, "outlive": 3600}.get(task["mode"], 60)
            return Command([AGENT_PYTHON, "-c", AGENT_PROCESS], timeout_s=deadline)(task, client)

        return AgentEnv(agent=agent, grader=grade, tasks=tasks, agent_fields=("id", "mode", "question", "marker",
                                                                              "padding"))

    # Only "outlive" runs under a short rollout deadline (its own ends it): a loaded machine cannot time the others out.
    markers = [tasks[4]["marker"], tasks[5]["marker"]]
    (finished, cut), seen = await watching(markers, asyncio.gather(
        generator(vllm_engine, chat_tokenizer).generate(make, tasks=tasks[:-1]),
        generator(vllm_engine, chat_tokenizer, timeout_s=10).generate(make, tasks=tasks[-1:])))
    by_id = {t.task_id: t for t in finished + cut}
    assert by_id["answer"].stop_reason == "done" and by_id["answer"].num_turns == 1, by_id["answer"].error
    assert answers["answer"].startswith("noise on stdout") and answers["answer"].endswith("answer")
    assert sum(by_id["answer"].loss_mask) > 0
    assert by_id["big"].stop_reason == "done" and answers["big"].endswith("big"), by_id["big"].error
    assert by_id["crash"].stop_reason == "error" and "exited 1: the agent crashed" in by_id["crash"].error
    assert by_id["flood"].stop_reason == "error" and "bytes or more to stdout" in by_id["flood"].error
    assert by_id["hang"].stop_reason == "error" and "ran past 3 s" in by_id["hang"].error
    assert by_id["outlive"].stop_reason == "timeout"
    for marker in markers:
        assert len(seen[marker]) == 2, seen  # the agent and its child ran, and are gone
        assert not [p for p in seen[marker] if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], marker


async def _running(argv: list[str], timeout_s: float = 60.0) -> None:
    """Wait until a process of this one's runs ``python ARGV...`` itself (not a launcher holding it in its argv)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        for child in psutil.Process().children(recursive=True):
            try:
                if child.cmdline()[1:1 + len(argv)] == argv and "python" in Path(child.cmdline()[0]).name:
                    return
            except psutil.Error:  # gone meanwhile
                continue
        await asyncio.sleep(0.02)
    raise TimeoutError(f"no process ran {argv} within {timeout_s:.0f} s")


HOSTILE_FIELDS = ("id", "question", "peer_key", "targets")
DOCUMENTED_ENV = {"PATH", "LANG", "HOME", "OPENAI_BASE_URL", "OPENAI_API_KEY", "OPENAI_MODEL", "ANTHROPIC_BASE_URL",
                  "ANTHROPIC_API_KEY", "ENVKIT_TASK"}


async def test_a_command_agent_reaches_its_own_episode_and_nothing_else(vllm_engine, chat_tokenizer, monkeypatch):
    """A hostile agent process beside a live peer's: it looks for other keys in /proc, spends the peer's key (which
    it is handed, as if leaked) by header and by path, and calls the raw vLLM server's chat and admin routes and the
    gateway's shared port. Isolated (the default) it finds no key, every peer-key call is refused (403) and counted
    in its trajectory, nothing but its own port answers; its environment holds the documented variables only and
    its task no answer. The control, the same agent with isolate=False and inherit_env=True, wins every attack (but
    the PYTHONPATH and VIRTUAL_ENV that would undo its venv, never passed)."""
    from envkit.agents.agent import Command
    from envkit.agents.untrusted import python

    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.setenv("VIRTUAL_ENV", "/elsewhere")
    vllm = vllm_engine.base_url.removesuffix("/v1")
    chat = {"model": vllm_engine.model_name, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    run: dict[str, Any] = {}

    async def play(task: Task, client: AgentClient) -> str:
        if task["id"] == "victim":
            run["victim"] = client.api_key
            run["opened"].set()
            return await Command([python(), str(DOCKER_AGENT), "hold", "6"], **run["options"])(task, client)
        await run["opened"].wait()
        await _running([str(DOCKER_AGENT), "hold"])  # the victim's process is up, its key in its environment
        targets = {"engine_chat": (f"{vllm}/v1/chat/completions", chat),
                   "engine_admin": (f"{vllm}/reset_prefix_cache", {}), "gateway": (f"{client.base_url}/models", None)}
        thief = {**task, "peer_key": run["victim"], "targets": targets}
        return await Command([python(), str(DOCKER_AGENT), "hostile"], **run["options"])(thief, client)

    def grade(task: Task, result: str) -> float:
        if task["id"] == "thief":
            run["seen"] = json.loads(result)
        return 0.0

    tasks = [{"id": "victim", "question": "What is 2 + 3?", "answer": 5},
             {"id": "thief", "question": "What is 2 + 3?", "answer": 5}]
    outcome = {}
    for isolate in (True, False):
        run.clear()
        run["options"] = {"timeout_s": 60, "isolate": isolate, "inherit_env": not isolate}
        run["opened"] = asyncio.Event()
        trajs = await generator(vllm_engine, chat_tokenizer, max_turns=1, max_tokens=4).generate(
            lambda: AgentEnv(agent=play, grader=grade, tasks=tasks, agent_fields=HOSTILE_FIELDS), tasks=tasks)
        assert [t.stop_reason for t in trajs] == ["done", "done"], [t.error for t in trajs]
        outcome[isolate] = (run["seen"], next(t for t in trajs if t.task_id == "thief").refused_calls)

    seen, refused = outcome[True]
    assert seen["found_keys"] == []
    assert seen["peer_key"] == {"header": 403, "path": 403} and seen["own_key"] == 200
    assert refused == 2  # the peer-key calls, counted against the episode that made them
    assert all(str(answer).startswith("unreachable") for answer in seen["targets"].values()), seen["targets"]
    assert set(seen["env"]) == DOCUMENTED_ENV
    assert set(seen["task"]) == set(HOSTILE_FIELDS) and "answer" not in json.dumps(seen["task"])

    seen, refused = outcome[False]  # the control: every attack wins
    assert run["victim"] in seen["found_keys"]
    assert seen["peer_key"] == {"header": 200, "path": 200} and refused == 0
    assert seen["targets"] == {"engine_chat": 200, "engine_admin": 200, "gateway": 200}
    assert set(seen["env"]) > DOCUMENTED_ENV and not {"PYTHONPATH", "VIRTUAL_ENV"} & set(seen["env"])
    with pytest.raises(ValueError, match="answer"):
        AgentEnv(agent=play, grader=grade, tasks=tasks, agent_fields=("question", "answer"))


@pytest.mark.agent_frameworks
async def test_anthropic_messages_calls_link_stream_and_refuse_as_chat_calls_do(vllm_engine, chat_tokenizer):
    """An Anthropic-SDK agent: a call with a tool, then a streamed call resending the reply's blocks (tool results
    for its tool_use blocks) and a new user turn, then a call with stop sequences (its reply ends before the one
    that matched, which the reply names) and one resending that reply; one exact sequence. An unknown key gets the
    SDK's AuthenticationError, a body without max_tokens a 400 in Anthropic's error shape."""
    import anthropic

    engine = Recorded(vllm_engine)
    seen: dict[str, Any] = {}
    tools = [{"name": "add", "description": "Add two integers.", "input_schema": ADD["function"]["parameters"]}]

    async def agent(task: Task, client: AgentClient) -> str:
        root = client.base_url.removesuffix("/v1")
        sdk = anthropic.AsyncAnthropic(base_url=root, api_key=client.api_key, max_retries=0)
        messages: list[dict[str, Any]] = [{"role": "user", "content": task["question"]}]
        first = await sdk.messages.create(model=client.model, max_tokens=24, system="Use the add tool, then answer.",
                                          tools=tools, messages=messages)
        results = [{"type": "tool_result", "tool_use_id": b.id, "content": run_add(json.dumps(b.input))}
                   for b in first.content if b.type == "tool_use"]
        messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                     {"role": "user", "content": [*results, {"type": "text", "text": "Sure?"}]}]
        async with sdk.messages.stream(model=client.model, max_tokens=24, system="Use the add tool, then answer.",
                                       tools=tools, messages=messages) as stream:
            second = await stream.get_final_message()
        seen["stop_reasons"] = [first.stop_reason, second.stop_reason]
        messages += [{"role": "assistant", "content": [b.model_dump() for b in second.content]},
                     {"role": "user", "content": "Say it in words."}]
        third = await sdk.messages.create(model=client.model, max_tokens=24, system="Use the add tool, then answer.",
                                          tools=tools, messages=messages, stop_sequences=STOPS)
        seen["third"] = third
        messages += [{"role": "assistant", "content": [b.model_dump() for b in third.content]},
                     {"role": "user", "content": "Thanks."}]
        await sdk.messages.create(model=client.model, max_tokens=24, system="Use the add tool, then answer.",
                                  tools=tools, messages=messages, stop_sequences=STOPS)
        try:
            await anthropic.AsyncAnthropic(base_url=root, api_key="nope", max_retries=0).messages.create(
                model=client.model, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        except anthropic.AuthenticationError as e:
            seen["unknown"] = e.body
        async with httpx.AsyncClient(base_url=root, timeout=60) as http:
            seen["no_max_tokens"] = (await http.post("/v1/messages", headers={"x-api-key": client.api_key},
                                                     json={"messages": [{"role": "user", "content": "hi"}]}))
        return "".join(b.text for b in second.content if b.type == "text")

    # Greedy, so the third reply is the same each run ("2 + 3 is a"): a sampled one can miss every stop (one read
    # "2 + 3 2 + 3 2 + 3"), and then nothing here is about stop sequences.
    [t] = await generator(engine, chat_tokenizer, max_turns=4, temperature=0.0).generate(agent_env(agent),
                                                                                      tasks=[QUESTION])
    assert t.stop_reason == "done", t.error
    assert t.num_turns == 4 and len(engine.calls) == 4 and t.segments == [] and len(spans(t)) == 4
    assert_exact([t], engine)
    assert t.template_mismatches <= skew_bound(t, chat_tokenizer)
    assert set(seen["stop_reasons"]) <= {"end_turn", "max_tokens", "tool_use"}
    stopped, third = engine.calls[2][1], seen["third"]
    assert stopped.stop_string in STOPS
    assert (third.stop_reason, third.stop_sequence) == ("stop_sequence", stopped.stop_string)
    text = "".join(b.text for b in third.content if b.type == "text")
    assert chat_tokenizer.decode(stopped.token_ids).startswith(text + stopped.stop_string)
    assert stopped.stop_string not in text
    assert seen["unknown"]["error"]["type"] == "authentication_error"
    bad = seen["no_max_tokens"]
    assert bad.status_code == 400 and bad.json()["type"] == "error" and "max_tokens" in bad.json()["error"]["message"]


# ---- agents in Docker containers that reach nothing but their gateway --------------------------------------------

DOCKER_AGENT = Path(__file__).with_name("docker_agent.py")
AGENT_IN_CONTAINER = "/agent/docker_agent.py"


def docker_agent(*args: str, **options: Any) -> Any:
    from sandboxes.agent import DockerCommand

    return DockerCommand(["python3", AGENT_IN_CONTAINER, *args], mounts={str(DOCKER_AGENT): AGENT_IN_CONTAINER},
                         **options)


def agent_containers(docker_client: Any) -> list[str]:
    """This process's agent containers, running or not."""
    from sandboxes.base import owner_id
    from sandboxes.docker import OWNER_LABEL, SANDBOX_LABEL

    return [c.name for c in docker_client.containers.list(
        all=True, filters={"label": [f"{SANDBOX_LABEL}=agent", f"{OWNER_LABEL}={owner_id()}"]})]


async def test_a_docker_agent_plays_through_its_gateway_and_reaches_nothing_else(vllm_engine, chat_tokenizer,
                                                                                  docker_client):
    """An agent process in a container (no network, a stdlib HTTP client) makes its two calls through the relay to
    its episode's gateway, captured as any agent's. Probing from the same container, the gateway's own port, this
    host's addresses, the vLLM server, the outside and DNS are all out of reach; only the relay answers."""

    from sandboxes.agent import RELAY_PORT

    answers: list[str] = []
    trajs = await generator(vllm_engine, chat_tokenizer, samples_per_prompt=2).generate(
        agent_env(docker_agent(timeout_s=120), answers), tasks=[QUESTION])
    assert [t.stop_reason for t in trajs] == ["done"] * 2, [t.error for t in trajs]
    assert all(t.num_turns == 2 and t.loss_mask.count(0) > 0 for t in trajs) and len(answers) == 2

    host_ips = sorted({a.address for addresses in psutil.net_if_addrs().values() for a in addresses
                       if a.family == socket.AF_INET and not a.address.startswith("127.")})
    vllm = urlsplit(vllm_engine.base_url)
    seen: list[dict[str, str]] = []

    async def probe(task: Task, client: AgentClient) -> str:
        port = urlsplit(client.base_url).port
        targets = [f"127.0.0.1:{RELAY_PORT}", f"127.0.0.1:{port}", f"127.0.0.1:{vllm.port}", "1.1.1.1:443",
                   *(f"{ip}:{p}" for ip in host_ips for p in (port, vllm.port))]
        return await docker_agent("probe", *targets, timeout_s=120)(task, client)

    def grade(task: Task, result: str) -> float:
        seen.append(json.loads(result))
        return 0.0

    trajs = await generator(vllm_engine, chat_tokenizer).generate(
        lambda: AgentEnv(agent=probe, grader=grade, tasks=[QUESTION]), tasks=[QUESTION])
    assert trajs[0].stop_reason == "done", trajs[0].error
    reached = {target for target, outcome in seen[0].items() if outcome == "ok"}
    assert reached == {f"127.0.0.1:{RELAY_PORT}"}, seen[0]
    assert len(seen[0]) == 5 + 2 * len(host_ips) and host_ips
    assert agent_containers(docker_client) == []


async def test_a_docker_agent_that_fails_or_hangs_fails_its_rollout_and_its_container_is_removed(docker_client):
    from sandboxes.agent import DockerCommand

    client = AgentClient(base_url="http://127.0.0.1:9/v1", api_key="k", model="m",
                         episode_url="http://127.0.0.1:9/e/k/v1")
    with pytest.raises(AgentProcessError, match="ran past 2 s"):
        await DockerCommand(["sleep", "600"], timeout_s=2)(QUESTION, client)
    with pytest.raises(AgentProcessError, match="exited 3: bad task"):
        await DockerCommand(["python3", "-c", "import sys; print('bad task', file=sys.stderr); sys.exit(3)"])(
            QUESTION, client)
    flood = DockerCommand(["python3", "-c", "print('x' * 5000)"], output_limit=1000)
    with pytest.raises(AgentProcessError, match="1000 bytes or more"):
        await flood(QUESTION, client)
    # the task reaches it on stdin and in ENVKIT_TASK; as the nobody user it cannot write to its root or its task
    echo = DockerCommand(["python3", "-c", "import json, os, sys; task = json.load(sys.stdin); "
                          "ok = os.environ['ENVKIT_TASK'] == json.dumps(task); "
                          "print(task['id'], ok, os.getuid(), os.access('/', os.W_OK), os.access('/envkit', os.W_OK))"])
    assert await echo(QUESTION, client) == "q True 65534 False False"
    for delay in (0.0, 0.01, 0.05, 2.0):  # a rollout cancelled while its container is being created, and while it runs
        rollout = asyncio.ensure_future(DockerCommand(["sleep", "600"])(QUESTION, client))
        await asyncio.sleep(delay)
        rollout.cancel()
        with pytest.raises(asyncio.CancelledError):
            await rollout
        assert agent_containers(docker_client) == [], delay
