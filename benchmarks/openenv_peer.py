"""The OpenEnv half of the remote-env benchmark, and the load driver both halves share.

- ``create_app()``: OpenEnv's echo env (the same logic as ``remote_env.EchoEnv``) in OpenEnv's own server
  (``create_app`` of openenv-core 0.3.0 or openenv 0.10.0, one env instance per WebSocket session, up to 1024
  sessions);
- ``drive()``: open N sessions, step them all concurrently for a fixed window, time every step;
- as a script: drive OpenEnv's own async client (``GenericEnvClient``, one WebSocket per session) against a running
  server and print the result as JSON.

Runs in an OpenEnv venv (``make install`` creates ``.venv-openenv`` with 0.3.0 and ``.venv-openenv10`` with 0.10.0;
the main venv installs neither)::

    PYTHONPATH=benchmarks .venv-openenv/bin/python -m uvicorn --factory openenv_peer:create_app --port 8001
    .venv-openenv/bin/python benchmarks/openenv_peer.py --url http://127.0.0.1:8001 --sessions 64 --seconds 3

Only the standard library is imported at module level, so ``remote_env.py`` (main venv) can import ``drive``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

MESSAGE = "hello"


class Session(Protocol):
    """One open session: ``step()`` sends MESSAGE and waits for the answer."""

    async def step(self) -> None: ...

    async def close(self) -> None: ...


async def drive(open_session: Callable[[], Awaitable[Session]], *, sessions: int, seconds: float,
                warmup: float) -> dict[str, Any]:
    """Open ``sessions`` sessions, then step all of them concurrently for ``warmup + seconds``.

    Steps that start inside the last ``seconds`` are counted and timed; a failed step ends its session's loop and
    is counted as an error.
    """
    opened = await asyncio.gather(*(open_session() for _ in range(sessions)))
    latencies: list[float] = []
    errors: list[str] = []
    start = time.perf_counter() + warmup
    end = start + seconds

    async def loop(session: Session) -> None:
        while (t0 := time.perf_counter()) < end:
            try:
                await session.step()
            except Exception as e:
                errors.append(f"{type(e).__name__}: {e}")
                return
            if t0 >= start:
                latencies.append(time.perf_counter() - t0)

    await asyncio.gather(*(loop(s) for s in opened))
    await asyncio.gather(*(s.close() for s in opened))
    latencies.sort()
    return {
        "sessions": sessions,
        "steps": len(latencies),
        "steps_per_s": len(latencies) / seconds,
        "p50_ms": 1000 * statistics.median(latencies) if latencies else float("nan"),
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else float("nan"),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
    }


def create_app() -> Any:
    """OpenEnv's server with the echo env: reward 0.1 x message length, done on "bye" (as remote_env.EchoEnv for
    the benchmark's message); also the OpenEnv server of the interop tests (tests/test_openenv.py)."""
    from uuid import uuid4

    from openenv.core.env_server.http_server import create_app as openenv_app
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State

    class EchoAction(Action):
        message: str

    class EchoObservation(Observation):
        echoed_message: str
        message_length: int = 0

    class EchoEnvironment(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            super().__init__()
            self._state = State(episode_id=str(uuid4()), step_count=0)

        def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> EchoObservation:
            self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
            return EchoObservation(echoed_message=f"Echo environment ready! seed={seed}", done=False, reward=0.0)

        def step(self, action: EchoAction, timeout_s: float | None = None, **kwargs: Any) -> EchoObservation:
            self._state.step_count += 1
            text = action.message
            return EchoObservation(echoed_message=text, message_length=len(text), done=text == "bye",
                                   reward=0.1 * len(text), metadata={"step": self._state.step_count})

        @property
        def state(self) -> State:
            return self._state

    return openenv_app(EchoEnvironment, EchoAction, EchoObservation, env_name="echo_env", max_concurrent_envs=1024)


class _OpenEnvSession:
    def __init__(self, client: Any) -> None:
        self.client = client

    async def step(self) -> None:
        result = await self.client.step({"message": MESSAGE})
        assert result.observation["echoed_message"] == MESSAGE

    async def close(self) -> None:
        await self.client.disconnect()


async def _open_openenv_session(url: str) -> _OpenEnvSession:
    from openenv.core.generic_client import GenericEnvClient

    client = GenericEnvClient(base_url=url)
    await client.connect()
    await client.reset()
    return _OpenEnvSession(client)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True, help="the OpenEnv server, e.g. http://127.0.0.1:8001")
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=3.0, help="timed window")
    parser.add_argument("--warmup", type=float, default=0.5, help="untimed steps before the window")
    args = parser.parse_args()
    result = asyncio.run(drive(lambda: _open_openenv_session(args.url), sessions=args.sessions,
                               seconds=args.seconds, warmup=args.warmup))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
