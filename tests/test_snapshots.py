"""Env snapshots (``Env.snapshot``/``Env.restore``): a restored env's next steps equal the original's, in-process,
over ws:// and http:// (the server's signed token, across its workers and across servers sharing a key) and in
Docker sandboxes; a token a server did not seal, an env whose state is not plain data, and a snapshot of another
kind of env are refused with a clear error."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from remote_envs import Held, HeldButSaid, envkit_serve, error_code

import envkit
from envkit import Env, Snapshot
from envkit.cli.check import as_json
from envkit.errors import EpisodeDoneError, RemoteSnapshotError, SnapshotError
from envkit.remote import SNAPSHOT_KEY_ENV, RemoteConfig
from envkit.rewards.rubrics import Check, EnvReward, WeightedSum

TOKEN = "snapshot-token"


def call(expression: str) -> envkit.Message:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "calculator",
                                                      "arguments": f'{{"expression": "{expression}"}}'}}]}


# Per env: its kwargs, the seed, the steps before the snapshot and the steps after it (each a multi-turn episode
# whose state moves at every step: a secret's hints, the follow-up sums, the player's square, the tool turns).
EPISODES: dict[str, tuple[dict[str, Any], int, list[envkit.Message], list[envkit.Message]]] = {
    "guess-number": ({}, 5, [envkit.assistant("50")], [envkit.assistant(g) for g in ("25", "75", "60", "40")]),
    "arithmetic": ({"followups": 3}, 2, [envkit.assistant("7")], [envkit.assistant(n) for n in ("9", "12", "20")]),
    "frozenlake": ({}, 0, [envkit.assistant("Down")], [envkit.assistant(m) for m in ("Down", "Right", "Left")]),
    "calculator": ({}, 1, [call("2+3")], [call("5*7"), envkit.assistant("The answer is 35.")]),
}


async def play(env: Env, actions: list[envkit.Message]) -> list[Any]:
    """Each step's observation, reward, end flags and info, as they cross the wire; stops at the episode's end."""
    out = []
    for action in actions:
        result = await env.step(action)
        out.append(as_json([result.observation, result.reward, result.terminated, result.truncated, result.info]))
        if result.done:
            break
    return out


async def snapshot_and_go_on(env: Env, name: str) -> tuple[Snapshot, list[Any]]:
    """Play ``EPISODES[name]`` to its snapshot point, snapshot, and play on: the snapshot and what followed."""
    _, seed, before, after = EPISODES[name]
    await env.reset(seed=seed)
    await play(env, before)
    snapshot = await env.snapshot()
    return snapshot, await play(env, after)


@pytest.mark.parametrize("name", sorted(EPISODES))
async def test_a_restored_env_plays_on_as_the_original_did(name: str):
    """In-process: a fresh env restored from the snapshot, and the original restored after it played on (twice:
    the snapshot is not changed by what its env did since), take the same next steps."""
    kwargs, _, _, after = EPISODES[name]
    env, fresh = envkit.make(name, **kwargs), envkit.make(name, **kwargs)
    snapshot, original = await snapshot_and_go_on(env, name)
    assert len(original) >= 2
    await fresh.restore(snapshot)
    assert await play(fresh, after) == original
    for _ in range(2):
        await env.restore(snapshot)
        assert await play(env, after) == original
    await asyncio.gather(env.close(), fresh.close())


async def test_a_restored_episode_can_be_over_and_a_rubric_wrapper_keeps_its_own_state():
    """The episode state restores with the env: a snapshot taken at the end refuses a step, and a rubric's record of
    the episode (what it scores at the end) is the snapshot's, not the restoring env's."""
    first_reply = Check(lambda episode: float(episode.messages[2]["content"] == "1"), name="first_reply")
    kwargs = {"followups": 1, "rubric": WeightedSum({EnvReward(): 1.0, first_reply: 0.0})}
    env, other = envkit.make("arithmetic", **kwargs), envkit.make("arithmetic", **kwargs)
    await env.reset(seed=0)
    await env.step(envkit.assistant("1"))
    halfway = await env.snapshot()
    last = await env.step(envkit.assistant("2"))
    assert last.done
    over = await env.snapshot()
    await other.reset(seed=3)
    await other.step(envkit.assistant("x"))
    await other.restore(over)
    with pytest.raises(EpisodeDoneError):
        await other.step(envkit.assistant("3"))
    await other.restore(halfway)
    again = await other.step(envkit.assistant("2"))
    assert again.reward == last.reward and again.info["rubric"] == last.info["rubric"]
    assert last.info["rubric"]["first_reply"] == 1.0


async def test_state_that_is_not_plain_data_is_refused_unless_the_env_names_it_a_resource():
    held, said = Held(), HeldButSaid()
    await held.reset(seed=1)
    with pytest.raises(SnapshotError, match=r"Held's state is not plain data .*snapshot_exclude"):
        await held.snapshot()
    await said.reset(seed=1)
    await said.step(envkit.assistant("hello"))
    fresh = HeldButSaid()
    lock = fresh.lock
    await fresh.restore(await said.snapshot())
    assert fresh.lock is lock and fresh.turns == 1 and fresh.word == "w1"
    with pytest.raises(SnapshotError, match=r"a snapshot of .*HeldButSaid cannot restore .*GuessNumberEnv"):
        await envkit.make("guess-number").restore(await said.snapshot())


@pytest.fixture(scope="module")
def servers():
    """Servers of guess-number: two sharing a snapshot key, one with its own, one of 2 worker processes (whose key
    the parent draws for both); and one serving an env whose state is not plain data, with the shared key."""
    shared, own = {"ENVKIT_TOKEN": TOKEN, SNAPSHOT_KEY_ENV: "k" * 64}, {"ENVKIT_TOKEN": TOKEN}
    started = [envkit_serve("guess-number", env=shared), envkit_serve("guess-number", env=shared),
               envkit_serve("guess-number", env=own), envkit_serve("guess-number", "--workers", "2", env=own),
               envkit_serve("remote_envs:Held", env=shared)]
    yield started
    for server in started:
        server.stop()


def remote(server, scheme: str, name: str = "guess-number") -> Env:
    return envkit.make(f"{scheme}://127.0.0.1:{server.port}/{name}", remote=RemoteConfig(token=TOKEN))


async def sessions_per_worker(server) -> dict[int, int]:
    """The sessions each worker process of ``server`` holds, by pid (/metrics, from whichever worker answers, reads
    the count every worker keeps up to date at each session opened and closed)."""
    async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"},
                                 timeout=30) as client:
        text = (await client.get("/metrics")).text
    return {int(pid): int(n) for pid, n in re.findall(r'envkit_worker_sessions\{worker="(\d+)"\} (\d+)', text)}


async def settled(server, *, sessions: int) -> dict[int, int]:
    """The sessions per worker of ``server`` once both worker processes serve (/health answers as soon as one does)
    and together hold ``sessions`` (a closed session is let go in the background)."""
    deadline = time.monotonic() + 60
    while len(held := await sessions_per_worker(server)) < 2 or sum(held.values()) != sessions:
        assert time.monotonic() < deadline, f"the 2 workers hold {held} sessions, not {sessions}"
        await asyncio.sleep(0.2)
    return held


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """Worker ``pid`` paused (SIGSTOP): new connections go to the other worker. Kept to a few requests, well within
    the 5 s uvicorn's supervisor waits for a worker's health-check answer before replacing it."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@pytest.mark.parametrize(("taken", "restored"), [("ws", "ws"), ("http", "http"), ("ws", "http")])
async def test_a_remote_session_restores_into_another_on_any_worker_or_server_with_the_key(servers, taken, restored):
    """The token a session's snapshot gives restores any session of the env on a server holding the key: the same
    server, over either transport, and another server with the key; each then plays as the original did, and as
    the env does in-process. On a 2-worker server, each worker restores a snapshot of a session on one of them
    into 4 sessions (the other paused meanwhile, so that the connections come to it): a token restores on the
    worker that sealed it and on the other."""
    one, two, workers = servers[0], servers[1], servers[3]
    env = remote(one, taken)
    snapshot, original = await snapshot_and_go_on(env, "guess-number")
    local = envkit.make("guess-number")
    await local.reset(seed=EPISODES["guess-number"][1])
    await play(local, EPISODES["guess-number"][2])
    assert await play(local, EPISODES["guess-number"][3]) == original
    targets = [remote(one, restored), remote(two, restored)]
    for target in targets:
        await target.restore(snapshot)
        assert await play(target, EPISODES["guess-number"][3]) == original
    assert {(await t.state())["episodes"] for t in targets} == {0}  # restored, never reset
    first = remote(workers, "ws")
    snapshot, original = await snapshot_and_go_on(first, "guess-number")
    held = await settled(workers, sessions=1)  # first's alone: those of this test's earlier runs are closed
    sealer = next(pid for pid, n in held.items() if n == 1)
    other = next(pid for pid in held if pid != sealer)
    # A connection lands on whichever worker accepts it first, most often the same one (measured: 2 of 32 on the
    # other). So each worker in turn is paused while 4 sessions restore, which the other one then takes: first the
    # one that did not seal the token restores it, then the one that did
    others: list[Env] = []
    for paused in (sealer, other):
        batch = [remote(workers, "ws") for _ in range(4)]
        with stopped(paused):
            for target in batch:
                await target.restore(snapshot)
        others += batch
    assert await sessions_per_worker(workers) == {sealer: 1 + 4, other: 4}
    for target in others:
        assert await play(target, EPISODES["guess-number"][3]) == original
    await asyncio.gather(env.close(), first.close(), *(t.close() for t in targets + others))


async def test_a_token_a_server_did_not_seal_is_refused_and_the_server_stays_up(servers):
    """A server with another key, an altered token, a token of another env and a token that is not one are each
    refused with 422 invalid_snapshot (never unpickled); an env that cannot snapshot answers 501; the sessions work
    on after."""
    one, stranger, held = servers[0], servers[2], servers[4]
    env = remote(one, "ws")
    snapshot, _ = await snapshot_and_go_on(env, "guess-number")
    target = remote(stranger, "ws")
    with pytest.raises(RemoteSnapshotError, match="sealed by a server with another key") as caught:
        await target.restore(snapshot)
    assert caught.value.code == "invalid_snapshot" and caught.value.status == 422
    token = snapshot.state[1].state  # inside make()'s ContractChecker: the RemoteEnv's snapshot
    body, dot, mac = token.partition(".")
    flipped = body[:-2] + ("A" if body[-2] != "A" else "B") + body[-1]
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=one.url, headers=headers, timeout=30) as client:
        session = (await client.post("/sessions", json={})).json()["session_id"]
        for forged in (f"{flipped}{dot}{mac}", "not a token", "x.y", f"{body}{dot}"):
            answer = await client.post(f"/sessions/{session}/restore", json={"snapshot": forged})
            assert answer.status_code == 422 and error_code(answer) == "invalid_snapshot", answer.text
        answer = await client.post(f"/sessions/{session}/restore", json={"snapshot": 3})
        assert answer.status_code == 422 and error_code(answer) == "validation_error"
    async with httpx.AsyncClient(base_url=held.url, headers=headers, timeout=30) as client:
        elsewhere = (await client.post("/sessions", json={})).json()["session_id"]
        answer = await client.post(f"/sessions/{elsewhere}/restore", json={"snapshot": token})
        assert answer.status_code == 422 and "cannot restore a session of 'remote_envs:Held'" in answer.text
    async with httpx.AsyncClient(base_url=one.url, headers=headers, timeout=30) as client:
        await client.post(f"/sessions/{session}/reset", json={"seed": 5})
        assert (await client.post(f"/sessions/{session}/step",
                                  json={"action": {"role": "assistant", "content": "50"}})).status_code == 200
    other_env = remote(held, "ws", "remote_envs:Held")
    await other_env.reset(seed=1)
    with pytest.raises(RemoteSnapshotError, match="not plain data") as caught:
        await other_env.snapshot()
    assert caught.value.code == "snapshot_unsupported"
    assert (await other_env.step(envkit.assistant("hi"))).observation == [envkit.user("hi")]
    await target.reset(seed=5)
    assert (await target.step(envkit.assistant("50"))).info["turn"] == 1
    with pytest.raises(SnapshotError, match=r"cannot restore .*\(envkit-serve:remote_envs:Held\)"):
        await other_env.restore(snapshot)
    await asyncio.gather(env.close(), target.close(), other_env.close())
