"""OpenEnv's own client (``GenericEnvClient``) playing the env `envkit serve` serves at ``/openenv``. Run by
tests/test_openenv.py with an OpenEnv venv's python (0.3 or 0.10); prints what it saw as one JSON object.

    .venv-openenv10/bin/python tests/openenv_client.py http://127.0.0.1:8000/openenv
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from openenv.core.generic_client import GenericEnvClient


def seen(result: Any) -> dict[str, Any]:
    return {"observation": result.observation, "reward": result.reward, "done": result.done}


async def error_of(step: Any) -> str:
    try:
        await step
    except Exception as e:  # OpenEnv's client raises what the server's error frame said
        return f"{type(e).__name__}: {e}"
    return "no error"


async def main(url: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    client = GenericEnvClient(base_url=url)
    await client.connect()
    try:
        first = await client.reset(seed=0)
        out["reset"] = seen(first)
        answer = first.observation["metadata"]["task"]["answer"]  # an env's answer travels as metadata
        out["right"] = seen(await client.step({"content": f"The answer is {answer}."}))
        out["after_done"] = await error_of(client.step({"content": "The answer is 1."}))
        await client.reset(task=first.observation["metadata"]["task"])
        out["wrong"] = seen(await client.step({"content": "The answer is -1."}))
        out["state"] = await client.state()
        await client.reset(seed=1)
        out["bad_action"] = await error_of(client.step({"content": 5}))
    finally:
        await client.close()
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1]))))
