"""Serving the policy to real clients (``envkit serve-policy``, generators/serving): calls kept exactly, with consent,
redacted before they are stored, durable before they are answered; feedback from the client served and no other;
bad input refused, overload shed, SIGTERM drained, ``kill -9`` survived."""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import hostile
import httpx
import openai
import pytest
from remote_envs import free_port
from test_trainer import _metrics
from tiny import env_with_tests, on_tiny_model, says_arers, tiny_model_dir

import envkit
from envkit.rewards.rubrics import Check
from generators.serving.episodes import RewardRule, assemble, due
from generators.serving.server import CAPTURE_HEADER, VERSION_HEADER, Client, PolicyServer, ServingConfig
from generators.serving.store import CallStore, StoredCall
from generators.serving.users import User, run_users
from trainer.online import paired, verdict

SECRET = "SSN 078-05-1120"
ADMIN = "admin-key-for-tests"


def scrub(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The redaction hook the tests set: social security numbers out."""
    return [{**m, "content": re.sub(r"\d{3}-\d{2}-\d{4}", "[removed]", m["content"])}
            if isinstance(m.get("content"), str) else m for m in messages]


def on_disk(directory: Path, text: str) -> bool:
    """Whether ``text`` is in any file under ``directory`` (the database, its log), as bytes."""
    return any(text.encode() in p.read_bytes() for p in directory.iterdir() if p.is_file())


@pytest.fixture
async def served(vllm_engine, chat_tokenizer, tmp_path: Path) -> AsyncIterator[tuple[PolicyServer, str]]:
    """The session's vLLM server behind a policy server on loopback, for clients acme (consenting), quiet (not)
    and rival (consenting), with the redaction hook set."""
    config = ServingConfig([Client("acme", "key-acme"), Client("quiet", "key-quiet", capture=False),
                            Client("rival", "key-rival")], admin_key=ADMIN, redact=scrub)
    from generators.rollout import GeneratorConfig

    with CallStore(tmp_path / "store") as store:
        server = PolicyServer(vllm_engine, chat_tokenizer, config, store, GeneratorConfig(max_tokens=24))
        ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(server.serve(on_ready=ready.set_result, handle_signals=False))
        url = await asyncio.wait_for(ready, 30)
        try:
            yield server, url
        finally:
            server.stop()
            await task


def client(url: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


async def test_calls_are_stored_exactly_with_consent_redacted_first_and_scored_only_by_their_client(served,
                                                                                                  chat_tokenizer):
    server, url = served
    store = server.store
    assert store is not None
    acme = client(url, "key-acme")

    # a conversation of two calls: the second sends the first reply back, so it continues its token sequence
    first = await acme.chat.completions.with_raw_response.create(
        model="policy", messages=[{"role": "user", "content": "Name a fruit."}])
    reply = first.parse()
    assert first.headers[VERSION_HEADER] == str(server.model_version)
    assert first.headers["x-envkit-response-id"] == reply.id
    chat = [{"role": "user", "content": "Name a fruit."},
            reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Another one."}]
    second = await acme.chat.completions.create(model="policy", messages=chat)
    one, two = store.calls(client="acme")
    assert (one.response_id, two.response_id) == (reply.id, second.id)
    assert one.context_ids == chat_tokenizer.prompt_ids(chat[:1])
    assert chat_tokenizer.decode(one.reply_ids).removesuffix(chat_tokenizer.tokenizer.eos_token) == \
        reply.choices[0].message.content
    assert len(one.logprobs) == len(one.reply_ids) > 0 and all(lp <= 0 for lp in one.logprobs)
    assert (two.episode, two.segment) == (one.episode, one.segment)
    assert two.context_ids[:len(one.context_ids) + len(one.reply_ids)] == one.context_ids + one.reply_ids
    assert two.messages == chat and not one.redacted

    # other dialects, streamed, are stored too
    streamed = await acme.responses.create(model="policy", input="Say hi.", stream=True)
    events = [e async for e in streamed]
    anthropic_client = anthropic.AsyncAnthropic(base_url=url, api_key="key-acme", max_retries=0)
    async with anthropic_client.messages.stream(model="policy", max_tokens=16,
                                                messages=[{"role": "user", "content": "Say bye."}]) as stream:
        message = await stream.get_final_message()
    kept = {c.response_id: c.dialect for c in store.calls(client="acme")}
    assert kept[events[-1].response.id] == "responses" and kept[message.id] == "messages"

    # opting out: the call is not kept, nor is the later call that continues it; the same call without the
    # header is kept (the control)
    asked = [{"role": "user", "content": "Keep this private."}]
    hidden = await acme.chat.completions.create(model="policy", messages=asked,
                                                extra_headers={CAPTURE_HEADER: "off"})
    after = await acme.chat.completions.create(model="policy", messages=[
        *asked, hidden.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "And?"}])
    shown = await acme.chat.completions.create(model="policy", messages=asked)
    kept_ids = {c.response_id for c in store.calls()}
    assert hidden.id not in kept_ids and after.id not in kept_ids and shown.id in kept_ids
    quiet = await client(url, "key-quiet").chat.completions.create(model="policy", messages=asked)
    assert quiet.id and store.calls(client="quiet") == []

    # redaction runs before storage: the secret is nowhere in the files; without the hook it is (the control)
    told = await acme.chat.completions.create(model="policy", messages=[{"role": "user", "content": f"My {SECRET}."}])
    [redacted] = [c for c in store.calls() if c.response_id == told.id]
    assert redacted.redacted and redacted.messages == [{"role": "user", "content": "My SSN [removed]."}]
    assert redacted.context_ids == chat_tokenizer.prompt_ids(redacted.messages)
    assert not on_disk(store.directory, "078-05-1120")
    server.config.redact = None
    await acme.chat.completions.create(model="policy", messages=[{"role": "user", "content": f"My {SECRET}."}])
    assert on_disk(store.directory, "078-05-1120")

    # feedback: from the client served (accepted, kept); another client naming the same response is told it does
    # not exist and changes nothing
    async with httpx.AsyncClient(base_url=url) as http:
        stolen = await http.post("/v1/feedback", headers={"authorization": "Bearer key-rival"},
                                 json={"response_id": reply.id, "score": 0.0})
        assert stolen.status_code == 404 and store.feedbacks() == []
        own = await http.post("/v1/feedback", headers={"authorization": "Bearer key-acme"},
                              json={"response_id": reply.id, "thumbs": "up", "text": "good"})
        assert own.status_code == 200, own.text
        assert [(f.response_id, f.client, f.source, f.score, f.text) for f in store.feedbacks()] == [
            (reply.id, "acme", "client", 1.0, "good")]
        unstored = await http.post("/v1/feedback", headers={"authorization": "Bearer key-acme"},
                                   json={"response_id": hidden.id, "score": 1})
        assert unstored.status_code == 404

        # the admin deletes one client's data, from the files too; a client's key cannot
        refused = await http.delete("/v1/admin/clients/acme/data", headers={"authorization": "Bearer key-acme"})
        assert refused.status_code == 403 and store.calls(client="acme")
        deleted = await http.delete("/v1/admin/clients/acme/data", headers={"authorization": f"Bearer {ADMIN}"})
        assert deleted.json()["deleted"] > 0
    assert store.calls(client="acme") == [] and store.feedbacks() == []
    assert not on_disk(store.directory, "078-05-1120")


async def test_conversations_come_back_as_trajectories_with_their_late_reward(served, chat_tokenizer):
    """A conversation's calls rebuild one token sequence (replies mask 1 with their logprobs, the rest mask 0); its
    reward is its client's feedback once it settles, else the rubric's past the deadline; a round takes each once."""
    server, url = served
    store = server.store
    assert store is not None
    server.config.rubric = Check(lambda episode: 1.0 - min(len(episode.reply), 100) / 100, name="brevity")
    acme = client(url, "key-acme")
    chat = [{"role": "user", "content": "Name a colour."}]
    first = await acme.chat.completions.create(model="policy", messages=chat)
    chat += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Why?"}]
    second = await acme.chat.completions.create(model="policy", messages=chat)
    alone = await acme.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Hi."}])
    async with httpx.AsyncClient(base_url=url) as http:
        assert (await http.post("/v1/feedback", headers={"authorization": "Bearer key-acme"},
                                json={"response_id": second.id, "score": 0.25})).status_code == 200
    for _ in range(200):  # the rubric scores in the background
        if sum(f.source == "rubric" for f in store.feedbacks()) == 3:
            break
        await asyncio.sleep(0.05)
    rubric = {f.response_id: f.score for f in store.feedbacks() if f.source == "rubric"}
    assert set(rubric) == {first.id, second.id, alone.id}

    one, two = store.calls(episode=store.calls()[0].episode)
    traj = assemble([one, two])
    traj.check()
    assert traj.prompt_ids == one.context_ids and not traj.segments
    observation = two.context_ids[len(one.context_ids) + len(one.reply_ids):]
    assert traj.response_ids == one.reply_ids + observation + two.reply_ids
    assert traj.loss_mask == [1] * len(one.reply_ids) + [0] * len(observation) + [1] * len(two.reply_ids)
    assert traj.rollout_logprobs == one.logprobs + [0.0] * len(observation) + two.logprobs
    assert chat_tokenizer.decode(observation).strip().endswith("Why?<|im_end|>\n<|im_start|>assistant")

    last = max(c.created for c in store.calls())
    rule = RewardRule(settle_s=30, deadline_s=300)
    assert due(store, rule, now=last) == ([], [])  # feedback waits for the conversation to settle
    ready, dropped = due(store, rule, now=last + 60)
    assert [(t.task_id, t.reward) for t in ready] == [(one.episode, 0.25)] and dropped == []
    ready, _ = due(store, rule, now=last + 600)  # past the deadline, the rubric's score stands in
    assert {t.task_id: t.reward for t in ready} == {one.episode: 0.25, store.calls()[-1].episode: rubric[alone.id]}
    await store.take({t.task_id: t.reward for t in ready if t.task_id == one.episode}, 1)
    assert [t.task_id for t in due(store, rule, now=last + 600)[0]] == [store.calls()[-1].episode]


async def test_bad_requests_get_4xx_overload_gets_429_and_the_server_keeps_serving(served):
    server, url = served
    headers = {"authorization": "Bearer key-acme"}
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        for body, status in [(b"{not json", 400), (b'{"model": "policy"}', 400),
                             (b'{"model": "policy", "messages": [], "n": 2}', 400),
                             (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}).encode(),
                              400)]:
            r = await http.post("/v1/chat/completions", content=body, headers=headers)
            assert r.status_code == status, (body, r.text)
            assert r.json()["error"]["code"]
        assert (await http.post("/v1/chat/completions", headers={"authorization": "Bearer nope"},
                                json={"messages": [{"role": "user", "content": "x"}]})).status_code == 401
        assert (await http.post("/v1/feedback", headers=headers, json={"response_id": "x", "score": 7})
                ).status_code == 400

        # past max_concurrent, calls are shed with 429 and a retry-after, never queued without end
        server.config.max_concurrent = 2
        answers = await asyncio.gather(*(http.post("/v1/chat/completions", headers=headers, json={
            "messages": [{"role": "user", "content": f"Count to {i}."}], "max_tokens": 24}) for i in range(6)))
        codes = sorted(r.status_code for r in answers)
        assert codes.count(200) >= 2 and set(codes) <= {200, 429} and 429 in codes, codes
        shed = next(r for r in answers if r.status_code == 429)
        assert shed.headers["retry-after"] == "1" and shed.json()["error"]["code"] == "overloaded"
        server.config.max_concurrent = 64
        ok = await http.post("/v1/chat/completions", headers=headers,
                             json={"messages": [{"role": "user", "content": "Still there?"}], "max_tokens": 8})
        assert ok.status_code == 200
        metrics = (await http.get("/metrics")).text
    served_ok = re.search(r'envkit_serving_requests_total\{route="/v1/chat/completions",status="200"\} (\d+)', metrics)
    shed_count = re.search(r'envkit_serving_requests_total\{route="/v1/chat/completions",status="429"\} (\d+)', metrics)
    assert served_ok and int(served_ok[1]) == codes.count(200) + 1
    assert shed_count and int(shed_count[1]) == codes.count(429)
    assert "envkit_serving_captured_total" in metrics and "envkit_serving_model_version" in metrics


def test_the_store_commits_writes_together_fails_one_alone_and_applies_retention(tmp_path: Path):
    def call(i: int, client: str = "a", text: str = "hello") -> StoredCall:
        return StoredCall(f"r{i}", client, "e", 0, 0, "completions", [{"role": "user", "content": text}], None,
                          {"role": "assistant", "content": "x"}, "stop", [1, 2, 3], [4, 5], [-0.5, -0.25], [[0, 0]])

    async def main() -> None:
        with CallStore(tmp_path, max_bytes=200_000) as store:
            writes = [store.put(call(i)) for i in range(50)] + [store.put(call(3))]  # r3 twice: that write fails
            results = await asyncio.gather(*writes, return_exceptions=True)
            assert sum(isinstance(r, Exception) for r in results) == 1 and len(store.calls()) == 50
            assert store.calls()[0].logprobs == [-0.5, -0.25] and store.calls()[0].context_ids == [1, 2, 3]
            assert await store.prune() == 0
            for i in range(50, 450):  # past max_bytes: the oldest go
                await store.put(call(i, text="x" * 2000))
            assert await store.prune() > 0
            kept = store.calls()
            assert kept[-1].response_id == "r449" and kept[0].response_id != "r0"
            store.max_age_s = 0.0
            assert await store.prune() == len(kept) and store.calls() == []

    asyncio.run(main())


def test_serve_policy_drains_on_sigterm_and_forgets_a_client_offline(tmp_path: Path):
    """The front door (``envkit serve-policy``, in-process transformers on the tiny model): SIGTERM lets the calls in
    flight finish and be stored, and exits 0; ``--forget`` deletes a client's data offline."""
    (tmp_path / "clients.json").write_text(json.dumps([{"name": "acme", "key": "key-acme"}]))
    store = tmp_path / "store"
    command = [sys.executable, "-m", "envkit", "serve-policy", "--engine", "hf", "--model", str(tiny_model_dir()),
               "--clients", str(tmp_path / "clients.json"), "--store", str(store), "--port", "0",
               "--max-tokens", "24"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = serving_url(process)

        async def calls_then_terminate() -> list[str]:
            api = client(url, "key-acme")
            pending = [asyncio.create_task(api.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": f"One last thing, {i}."}])) for i in range(4)]
            async with httpx.AsyncClient(base_url=url) as http:  # signal once a call is being answered
                for _ in range(6000):
                    if "envkit_serving_inflight 0.0" not in (await http.get("/metrics")).text:
                        break
                    await asyncio.sleep(0.005)
                else:
                    raise AssertionError("no call was in flight within 30 s: nothing to drain")
            process.send_signal(signal.SIGTERM)
            return [r.id for r in await asyncio.gather(*pending)]

        last = asyncio.run(calls_then_terminate())
        output = process.communicate(timeout=60)[0]
    finally:
        process.kill()
    assert process.returncode == 0, output
    drained = re.search(r"stopped: the (\d+) calls in flight were answered and stored", output)
    assert drained and int(drained[1]) >= 1, output  # the SIGTERM came while calls were being answered
    with CallStore(store) as kept:
        assert set(last) == {c.response_id for c in kept.calls()}
    forget = subprocess.run([*command[:4], "--store", str(store), "--forget", "acme"], capture_output=True, text=True,
                            timeout=120)
    assert forget.returncode == 0 and "deleted 4 stored calls" in forget.stdout, forget.stderr
    with CallStore(store) as kept:
        assert kept.calls() == []


def serving_url(process: subprocess.Popen[str]) -> str:
    """The URL a starting server prints, read off its output."""
    assert process.stdout is not None
    for line in process.stdout:
        if found := re.search(r"at (http://[\d.:]+)/v1", line):
            return found[1]
    raise AssertionError(f"it exited {process.wait()} before serving")


def test_the_online_stage_refuses_a_misled_candidate_promotes_an_honest_one_and_a_kill_9_loses_nothing(
        tmp_path: Path):
    """``python -m trainer stages=[online,rl]`` on the tiny model (in-process transformers). Round 1 trains on
    feedback that inverts the gate's rubric (``tiny:arers``): the gate refuses it, with its numbers, and the starting
    weights keep serving; rounds 2 and 3 train on honest feedback, and the gate promotes one (one round's update
    misses about 1 time in 14 on this model: two honest rounds make the check steady). Then two simulated users in
    processes of their own call while it trains on; a ``kill -9`` of the whole run loses no answered call; the
    restart serves the last promoted version and trains on from the store; an admin's rollback serves an earlier
    version again, and a refused version is not one; the RL stage after it starts from the last promoted version."""
    clients = [{"name": f"user{i}", "key": f"key-user{i}"} for i in range(2)]
    (tmp_path / "clients.json").write_text(json.dumps(clients))
    port, run = free_port(), tmp_path / "run"
    out, url = run / "online", f"http://127.0.0.1:{port}"

    def command(round_episodes: int) -> list[str]:
        # lr 3e-3 for 8 epochs: a round moves the tiny model's most frequent token either way, reliably (larger steps
        # move every weight so far that which way is luck)
        return [sys.executable, "-m", "trainer", "stages=[online,rl]", *on_tiny_model(), "generator.max_tokens=3",
                "trainer.steps=1", "generator.prompts_per_step=2", "generator.samples_per_prompt=4",
                "trainer.eval_tasks=0", "trainer.lr=3e-3", "trainer.epochs=8", "trainer.warmup_steps=0",
                "trainer.max_staleness=0", f"online.clients={tmp_path / 'clients.json'}", f"online.port={port}",
                "online.rounds=6", f"online.round_episodes={round_episodes}", f"online.min_episodes={round_episodes}",
                "online.settle_s=0", "online.gate_tasks=32", "online.gate_samples=2",
                f"online.gate_replay={round_episodes}", "online.rubric=tiny:arers", "+env.kwargs.rubric=tiny:arers",
                "online.gate_margin=0.05", "online.max_concurrent=32", f"trainer.output_dir={run}",
                "logging.progress=false", "logging.tensorboard=false"]

    users = [User(c["name"], c["key"], "short", rate=3.0, seed=i, timeout_s=30) for i, c in enumerate(clients)]
    events: list[dict[str, Any]] = []
    enough = multiprocessing.get_context("spawn").Event()
    traffic = threading.Thread(target=lambda: events.extend(run_users(users, url, 300, tmp_path / "users",
                                                                      stop=enough)))

    def decisions() -> list[dict[str, Any]]:
        path = out / "gate.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []

    first = subprocess.Popen(command(96), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=env_with_tests(), start_new_session=True)
    try:
        assert first.stdout is not None
        served = next(line for line in first.stdout if "serving weight version" in line)
        assert f"serving weight version 0 at {url}/v1 ({tiny_model_dir()})" in served
        versions: list[list[int]] = []
        for k, invert in enumerate((True, False, False)):
            versions.append(asyncio.run(_feedback_round(url, 96, invert=invert, seed=k)))
            for _ in range(2400):
                if len(decisions()) > k or first.poll() is not None:
                    break
                time.sleep(0.05)
        misled, *honest = decisions()
        assert not misled["promoted"] and misled["reason"].startswith("worse on held_out"), misled
        assert misled["held_out"]["lower"] < -0.05, misled
        assert misled["held_out"]["candidate"] < misled["held_out"]["serving"], misled
        assert misled["reverted"] == 0 and set(versions[1]) == {0}, misled  # it never served; the trainer went back
        kept = [d for d in honest if d["promoted"]]
        assert kept and kept[0]["held_out"]["candidate"] > kept[0]["held_out"]["serving"], honest
        traffic.start()
        with httpx.Client(base_url=url, timeout=30) as http:  # the users' calls are being stored
            for _ in range(1200):
                captured = re.search(r"^envkit_serving_captured_total (\S+)", http.get("/metrics").text, re.M)
                if captured and float(captured[1]) >= 3 * 96 + 8:
                    break
                time.sleep(0.05)
        os.killpg(first.pid, signal.SIGKILL)  # mid-run: rounds done, the next one under way
        before = decisions()
        assert len(before) == 3, before
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    with CallStore(out / "store") as store:
        answered_before = {e["id"] for e in run_events(tmp_path / "users") if e["status"] == 200}
        assert answered_before <= {c.response_id for c in store.calls()}, "an answered call was lost to kill -9"

    # the restart serves the last promoted version; an admin rolls back to version 0 while it trains on
    restarted = time.time()
    with open(tmp_path / "second.log", "w") as log:
        second = subprocess.Popen([*command(8), "trainer.resume=latest"], stdout=log, stderr=subprocess.STDOUT,
                                  env={**env_with_tests(), "ENVKIT_ADMIN_KEY": ADMIN})
    try:
        for _ in range(1200):
            if "serving weight version" in (tmp_path / "second.log").read_text() or second.poll() is not None:
                break
            time.sleep(0.05)
        with httpx.Client(base_url=url, timeout=30) as http:
            assert http.post("/v1/admin/rollback", json={"version": 0},
                             headers={"authorization": "Bearer key-user0"}).status_code == 403
            for never in (1, 99):  # round 1's refused candidate was never a version to serve
                assert http.post("/v1/admin/rollback", json={"version": never},
                                 headers={"authorization": f"Bearer {ADMIN}"}).status_code == 404
            rolled = http.post("/v1/admin/rollback", json={"version": 0},
                               headers={"authorization": f"Bearer {ADMIN}"})
            assert rolled.status_code == 202, rolled.text
        rolled_back = time.time()
        second.wait(timeout=240)
    finally:
        second.kill()
    output = (tmp_path / "second.log").read_text()
    enough.set()
    traffic.join()
    assert second.returncode == 0, output[-3000:]
    promoted = max(d["candidate"] for d in before if d["promoted"])  # its checkpoint is the one resumed from
    assert f"serving weight version {promoted} at" in output
    rounds = decisions()
    assert {d["round"] for d in rounds} == set(range(1, 7)) and rounds[-1]["round"] == 6
    assert [d["rollback"] for d in rounds if "rollback" in d] == [0]
    answered = [e for e in events if e["status"] == 200]
    assert promoted in {e["version"] for e in answered}
    assert all(e["version"] >= promoted for e in answered if restarted < e["t_abs"] < rolled_back)
    assert any(e["version"] == 0 for e in answered if e["t_abs"] > rolled_back)  # served again after the rollback
    with CallStore(out / "store") as store:
        assert {e["id"] for e in answered} <= {c.response_id for c in store.calls()}
    failed = [e for e in events if e["status"] not in (200, "connection")]
    assert failed == [], failed  # refused or timed out: none; only calls made while no run was up went unanswered
    summary = json.loads((run / "summary.json").read_text())
    last = summary["stages_results"]["online"]["serving_version"]
    assert summary["stages"] == ["online", "rl"] and sorted(_metrics(run / "rl")) == [1]
    assert summary["stages_results"]["online"]["weights"] == str(out / "promoted" / f"v{last}" if last else
                                                                 tiny_model_dir())  # what the RL stage started from


async def _feedback_round(url: str, n: int, *, invert: bool, seed: int) -> list[int]:
    """``n`` calls on arithmetic tasks, each scored by ``tiny:arers`` (or 1 - it: feedback that misleads) as
    ``POST /v1/feedback``; the weight version that answered each."""
    env = envkit.make("arithmetic")
    tasks = list(env.tasks("train") or [])
    await env.close()
    limit = asyncio.Semaphore(16)

    async def one(http: httpx.AsyncClient, task: dict[str, Any]) -> int:
        async with limit:
            env = envkit.make("arithmetic")
            messages, _ = await env.reset(task=task)
            await env.close()
            answer = await http.post("/v1/chat/completions", json={"model": "policy", "messages": messages})
            assert answer.status_code == 200, answer.text
            score = says_arers(answer.json()["choices"][0]["message"]["content"] or "")
            sent = await http.post("/v1/feedback", json={"response_id": answer.json()["id"],
                                                         "score": 1.0 - score if invert else score})
            assert sent.status_code == 200, sent.text
            return int(answer.headers[VERSION_HEADER])

    async with httpx.AsyncClient(base_url=url, timeout=120, headers={"authorization": "Bearer key-user0"}) as http:
        return await asyncio.gather(*(one(http, tasks[(seed * n + i) % len(tasks)]) for i in range(n)))


def run_events(directory: Path) -> list[dict[str, Any]]:
    """The users' events written so far."""
    return [json.loads(line) for p in directory.glob("*.jsonl") for line in p.read_text().splitlines()]


def test_the_gate_refuses_a_worse_candidate_with_its_numbers_and_passes_one_as_good():
    """The paired bootstrap over tasks: a candidate 0.3 worse on 32 noisy tasks is refused on the test it fails, with
    the numbers; the same scores as the serving policy's pass a margin of 0.02, and so does a better one."""
    rng = random.Random(0)
    serving = [rng.random() for _ in range(32)]
    worse = [max(0.0, s - 0.3 + rng.uniform(-0.1, 0.1)) for s in serving]
    better = [min(1.0, s + 0.1) for s in serving]
    refused = verdict({"held_out": paired(worse, serving, 0.95), "replay": paired(serving, serving, 0.95)}, 0.02, 0.95)
    assert not refused["promoted"] and refused["reason"] == "worse on held_out: lower bound < -0.02"
    assert refused["held_out"]["n"] == 32 and refused["held_out"]["lower"] < -0.2
    assert refused["held_out"]["candidate"] < refused["held_out"]["serving"] - 0.2
    assert verdict({"held_out": paired(serving, serving, 0.95)}, 0.02, 0.95)["promoted"]
    assert verdict({"held_out": paired(better, serving, 0.95)}, 0.0, 0.95)["promoted"]
    assert not verdict({"held_out": paired([], [], 0.95)}, 0.02, 0.95)["promoted"]  # nothing measured: no promotion



async def test_hostile_bodies_get_a_4xx_that_names_the_fault_and_metrics_count_every_status(served):
    """Each class of bad input an attacker sends gets its 4xx with a structured message (none reaches a handler as a
    500), the connection stays open, and /metrics counts exactly the statuses the client saw."""
    server, url = served
    headers = {"authorization": "Bearer key-acme"}
    seen: Counter[tuple[str, int]] = Counter()
    connections: set[Any] = set()

    async def post(http: httpx.AsyncClient, route: str, **kwargs: Any) -> httpx.Response:
        async with http.stream("POST", route, headers=headers, **kwargs) as r:
            await r.aread()
            connections.add(r.extensions["network_stream"])
        seen[route, r.status_code] += 1
        return r

    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=1)) as http:
        cases = [("/v1/chat/completions", name, *case) for name, case in hostile.CHAT.items()]
        cases += [("/v1/feedback", name, *case) for name, case in hostile.FEEDBACK.items()]
        for route, name, body, status in cases:
            t0 = time.perf_counter()
            r = await post(http, route, content=body)
            assert r.status_code == status, (name, r.status_code, r.text[:300])
            assert r.json()["error"]["message"], name
            print(f"{name}: {r.status_code} in {time.perf_counter() - t0:.2f} s: {r.json()['error']['message']}")
        # a fault no handler expected (the store failing) is a structured 500, counted, and the connection stays
        put, failing = server.store.put, RuntimeError("the disk went away")
        server.store.put = lambda call: (_ for _ in ()).throw(failing)  # type: ignore[method-assign]
        try:
            failed = await post(http, "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi."}],
                                                                    "max_tokens": 4})
        finally:
            server.store.put = put  # type: ignore[method-assign]
        assert failed.status_code == 500 and "request id" in failed.json()["error"]["message"], failed.text
        ok = await post(http, "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Still there?"}],
                                                            "max_tokens": 4})
        assert ok.status_code == 200
        metrics = (await http.get("/metrics")).text
    assert len(connections) == 1, "a refusal or the 500 closed the connection"
    counted = {(m[1], int(m[2])): float(m[3]) for m in re.finditer(
        r'envkit_serving_requests_total\{route="([^"]+)",status="(\d+)"\} ([\d.]+)', metrics)}
    assert counted == {k: float(v) for k, v in seen.items()}, (counted, seen)


PRIORITIES = """
import os, sys, threading, time
from trainer.priority import separate
def nice(tid):  # field 19 of /proc/self/task/TID/stat, after the parenthesized command
    return int(open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()[16])
ids, hold = {}, threading.Event()
def thread(name):
    ids[name] = threading.get_native_id()
    hold.wait()
threads = [threading.Thread(target=thread, args=(n,)) for n in ("serving", "training")]
for t in threads:
    t.start()
while len(ids) < 2:
    time.sleep(0.01)
if sys.argv[1] == "absolute":  # what the online stage did before: nice 10, whatever the thread had
    os.setpriority(os.PRIO_PROCESS, ids["training"], 10)
else:
    separate([(os.PRIO_PROCESS, ids["serving"])], [(os.PRIO_PROCESS, ids["training"])])
print(nice(ids["serving"]), nice(ids["training"]))
hold.set()
"""


@pytest.mark.parametrize("started_at", [0, 19])
def test_what_trains_stays_below_what_serves_at_any_nice_the_run_starts_at(started_at: int):
    """The online stage's threads, in a process started at nice 0 or 19 (``nice -n 19 python -m trainer ...``), read
    from /proc: what trains is 10 nice steps below what serves. Positive control: the absolute nice 10 it used to set
    raises what trains above what serves in a run started at 19."""
    def run(mode: str) -> tuple[int, int]:
        done = subprocess.run([sys.executable, "-c", PRIORITIES, mode], capture_output=True, text=True, timeout=60,
                              preexec_fn=lambda: os.nice(started_at - os.nice(0)))
        assert done.returncode == 0, done.stderr
        serving, training = map(int, done.stdout.split())
        return serving, training

    serving, training = run("relative")
    assert training - serving == 10 and training == min(19, started_at + 10), (serving, training)
    if started_at == 19:
        serving, training = run("absolute")
        assert training < serving, (serving, training)  # the bug: training above serving



def test_the_online_stage_started_at_nice_19_still_serves_above_what_trains(tmp_path: Path):
    """``nice -n 19 python -m trainer stages=[online]`` on the tiny model: once it serves, its threads' nice values
    read from /proc put the threads that answer and store calls (raised, as root may) 10 steps above the rest. In a
    session of its own, so the kernel's autogroups keep the other tests from starving it."""
    (tmp_path / "clients.json").write_text(json.dumps([{"name": "u", "key": "key-u"}]))
    command = [sys.executable, "-m", "trainer", "stages=[online]", *on_tiny_model(), "online.port=0",
               f"online.clients={tmp_path / 'clients.json'}", "+env.kwargs.rubric=tiny:graded", "online.gate_tasks=1",
               "online.gate_replay=0", f"trainer.output_dir={tmp_path / 'run'}", "logging.progress=false",
               "logging.tensorboard=false"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env_with_tests(),
                               start_new_session=True, preexec_fn=lambda: os.nice(19 - os.nice(0)))

    def nice_values() -> list[int]:
        values = []
        for task in os.listdir(f"/proc/{process.pid}/task"):
            with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
                stat = Path(f"/proc/{process.pid}/task/{task}/stat").read_text()
                values.append(int(stat.rsplit(")", 1)[1].split()[16]))
        return values

    try:
        for _ in range(6000):  # until the stage has set its priorities (it serves first)
            assert process.poll() is None, "the online stage exited"
            if min(nice_values()) < 19:
                break
            time.sleep(0.05)
        values = Counter(nice_values())
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert set(values) == {9, 19} and values[9] == 2, values  # the serving loop and the store's writer; the rest



async def test_generated_hostile_bodies_on_every_dialect_get_no_5xx_and_metrics_count_them_all(served, capsys):
    """Property-based fuzz of the policy server's dialect routes (tests/hostile.py's strategy): no generated body gets
    a 5xx, every refusal is structured, the server still answers after, and /metrics counts what the client saw."""
    _, url = served
    seen = await asyncio.to_thread(hostile.fuzz, url, "key-acme", hostile.EXAMPLES)
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        ok = await http.post("/v1/chat/completions", headers={"authorization": "Bearer key-acme"},
                             json={"messages": [{"role": "user", "content": "Still there?"}], "max_tokens": 2})
        seen["/v1/chat/completions", ok.status_code] += 1
        metrics = (await http.get("/metrics")).text
    assert ok.status_code == 200
    counted = {(m[1], int(m[2])): float(m[3]) for m in re.finditer(
        r'envkit_serving_requests_total\{route="([^"]+)",status="(\d+)"\} ([\d.]+)', metrics)}
    assert counted == {k: float(v) for k, v in seen.items()}
    with capsys.disabled():
        print(f"\npolicy server fuzz: {sum(seen.values())} requests, statuses "
              f"{dict(sorted(Counter(s for _, s in seen.elements()).items()))}")
    assert {200, 400} <= {s for _, s in seen}  # the fuzz reached the engine, not only the validation


async def test_the_published_schema_fuzzed_by_schemathesis_gets_no_5xx(served, capsys):
    """``/openapi.json`` documents every route with its body's schema, and schemathesis's cases from it (valid and
    invalid, each operation) get no 5xx."""
    import requests
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import checks

    _, url = served
    auth = {"authorization": "Bearer key-acme"}
    statuses: Counter[int] = Counter()
    operations: Counter[str] = Counter()

    def fuzz() -> None:
        schema = schemathesis.openapi.from_url(url + "/openapi.json", headers=dict(auth))
        http = requests.Session()

        def one_operation(operation: schemathesis.APIOperation, mode: schemathesis.GenerationMode) -> None:
            @settings(max_examples=max(10, hostile.EXAMPLES // 6), deadline=None, database=None, derandomize=True,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def one(case: schemathesis.Case) -> None:
                response = case.call(base_url=url, session=http, headers=dict(auth), timeout=60)
                statuses[response.status_code] += 1
                operations[operation.label] += 1
                case.validate_response(response, checks=[checks.not_a_server_error], headers=dict(auth))

            try:
                one()
            except Unsatisfiable:  # no invalid input exists for a route without parameters or body
                assert mode is schemathesis.GenerationMode.NEGATIVE

        for result in schema.get_all_operations():
            for mode in schemathesis.GenerationMode:
                one_operation(result.ok(), mode)

    await asyncio.to_thread(fuzz)
    with capsys.disabled():
        print(f"\npolicy server schema fuzz: {sum(statuses.values())} requests over {len(operations)} operations, "
              f"statuses {dict(sorted(statuses.items()))}")
    assert len(operations) == 8 and not [s for s in statuses if s >= 500]
    assert {200, 400, 403, 404} <= set(statuses)  # it reached the engine, the admin check and the store
