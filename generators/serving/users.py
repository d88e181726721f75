"""A simulated user population, for tests and demos of learning from live traffic: each user is a process of its own
that asks an env's tasks through the openai SDK at a steady rate (open loop: a slow answer does not slow the asking),
and scores each answer by a preference the served policy is never told, as ``POST /v1/feedback``.

    python -m generators.serving.users --url http://127.0.0.1:8000 --clients clients.json --rate 0.5 \\
        --duration 600 --out runs/users

Preferences (:data:`PREFERENCES`), each on the env's own grade of the answer: ``correct`` (the env's reward), ``brief``
(the reward, halved for an answer over 12 words), ``short`` (shorter is better, whatever it says). ``--invert``
scores 1 - that: a population that rewards the wrong thing, whose traffic trains a candidate the gate must refuse.
Every call is counted by outcome (200, 4xx, 429, 5xx,
timeout, connection error) with its latency and the weight version that answered: ``summarize`` reads them back.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import envkit
from generators.serving.server import VERSION_HEADER

PREFERENCES: dict[str, Callable[[float, str], float]] = {
    "correct": lambda reward, reply: reward,
    "brief": lambda reward, reply: reward * (1.0 if len(reply.split()) <= 12 else 0.5),
    "short": lambda reward, reply: max(0.0, 1.0 - len(reply.split()) / 40),
}
"""A user's hidden preference: its score of an answer, from the env's reward and the reply's text."""


@dataclass(frozen=True)
class User:
    """One simulated user: its key, what it asks and how it scores."""

    name: str
    key: str
    preference: str = "correct"
    env: str = "arithmetic"
    env_kwargs: tuple[tuple[str, Any], ...] = ()
    rate: float = 0.5
    """Calls per second, on a fixed schedule."""
    invert: bool = False
    seed: int = 0
    timeout_s: float = 60.0


async def _ask(user: User, api: Any, http: Any, task: dict[str, Any], log: list[dict[str, Any]],
               t_start: float) -> None:
    import httpx
    import openai

    env = envkit.make(user.env, **dict(user.env_kwargs))
    event: dict[str, Any] = {"user": user.name, "t": time.time() - t_start, "task": task.get("id")}
    t0 = time.perf_counter()
    try:
        messages, _ = await env.reset(task=task)
        raw = await api.chat.completions.with_raw_response.create(model="policy", messages=list(messages))
        reply = raw.parse()
        event.update(status=200, version=int(raw.headers.get(VERSION_HEADER, -1)), id=reply.id)
        text = reply.choices[0].message.content or ""
        graded = await env.step(envkit.assistant(text))
        score = PREFERENCES[user.preference](graded.reward, text)
        score = 1.0 - score if user.invert else score
        event.update(score=score, words=len(text.split()))
        try:
            sent = await http.post("/v1/feedback", json={"response_id": reply.id, "score": score})
            event["feedback_status"] = sent.status_code
        except httpx.HTTPError as e:  # the call was answered; only its feedback was lost
            event["feedback_status"] = type(e).__name__
    except openai.APITimeoutError:
        event["status"] = "timeout"
    except openai.APIStatusError as e:
        event["status"] = e.status_code
    except openai.APIConnectionError:
        event["status"] = "connection"
    finally:
        event["latency_s"] = time.perf_counter() - t0
        await env.close()
        log.append(event)


async def _play(user: User, url: str, duration_s: float, out: Path, stop: Any) -> None:
    import httpx
    import openai

    env = envkit.make(user.env, **dict(user.env_kwargs))
    tasks = list(env.tasks("train") or [])
    await env.close()
    rng = random.Random(user.seed)
    log: list[dict[str, Any]] = []
    t_start = time.time()
    asks: list[asyncio.Task[None]] = []
    # one client for the calls and one for feedback, kept as an app keeps them: not a connection and TLS context
    # made per call
    async with (openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=user.key, max_retries=0,
                                   timeout=user.timeout_s) as api,
                httpx.AsyncClient(base_url=url, timeout=user.timeout_s,
                                  headers={"authorization": f"Bearer {user.key}"}) as http):
        for i in range(int(duration_s * user.rate)):
            await asyncio.sleep(max(0.0, t_start + i / user.rate - time.time()))
            if stop is not None and stop.is_set():
                break
            asks.append(asyncio.create_task(_ask(user, api, http, rng.choice(tasks), log, t_start)))
        await asyncio.gather(*asks)
    text = "".join(json.dumps({**e, "t_abs": t_start + e["t"]}) + "\n" for e in log)
    await asyncio.to_thread(out.write_text, text)


def _run(user: User, url: str, duration_s: float, out: Path, stop: Any) -> None:
    asyncio.run(_play(user, url, duration_s, out, stop))


def run_users(users: Sequence[User], url: str, duration_s: float, out: Path, *, stop: Any = None
              ) -> list[dict[str, Any]]:
    """Each user in a process of its own for ``duration_s``, or until ``stop`` (a ``multiprocessing`` event made
    with the spawn context) is set; returns every call's event (also in ``out``)."""
    out.mkdir(parents=True, exist_ok=True)
    spawn = multiprocessing.get_context("spawn")
    processes = [spawn.Process(target=_run, args=(u, url, duration_s, out / f"{u.name}.jsonl", stop), daemon=True)
                 for u in users]
    for p in processes:
        p.start()
    for p in processes:
        p.join()
    return [json.loads(line) for u in users if (out / f"{u.name}.jsonl").is_file()
            for line in (out / f"{u.name}.jsonl").read_text().splitlines()]


def summarize(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Outcomes counted (failed: anything but 200), latency percentiles, and the mean score by weight version."""
    outcomes = Counter(str(e["status"]) for e in events)
    latencies = sorted(e["latency_s"] for e in events if e["status"] == 200)
    by_version: dict[int, list[float]] = {}
    for e in events:
        if "score" in e:
            by_version.setdefault(e["version"], []).append(e["score"])
    return {"calls": len(events), "outcomes": dict(outcomes), "failed": len(events) - outcomes.get("200", 0),
            "latency": percentiles(latencies),
            "score_by_version": {v: mean_and_error(s) for v, s in sorted(by_version.items())}}


def percentiles(values: list[float]) -> dict[str, float]:
    """p50 and p99 of ``values`` (sorted), in seconds."""
    if not values:
        return {}
    return {"p50": values[len(values) // 2], "p99": values[min(len(values) - 1, int(len(values) * 0.99))],
            "n": len(values)}


def mean_and_error(values: list[float]) -> dict[str, float]:
    """The mean, its standard error and the count."""
    error = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")
    return {"mean": statistics.fmean(values), "se": error, "n": len(values)}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m generators.serving.users``: run the population against a served policy and print the summary."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="the policy server's root URL")
    p.add_argument("--clients", type=Path, required=True, help="the clients file: one user per client")
    p.add_argument("--preference", choices=sorted(PREFERENCES), default="correct")
    p.add_argument("--env", default="arithmetic", help="the env whose training tasks the users ask")
    p.add_argument("--rate", type=float, default=0.5, help="calls per second per user (default: 0.5)")
    p.add_argument("--duration", type=float, default=60.0, metavar="SECONDS")
    p.add_argument("--invert", action="store_true", help="score 1 - the preference: a population that misleads")
    p.add_argument("--out", type=Path, default=Path("runs/users"))
    args = p.parse_args(argv)
    clients = json.loads(args.clients.read_text())
    users = [User(c["name"], c["key"], args.preference, args.env, rate=args.rate, invert=args.invert, seed=i)
             for i, c in enumerate(clients)]
    summary = summarize(run_users(users, args.url, args.duration, args.out))
    print(json.dumps(summary, indent=2))
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
