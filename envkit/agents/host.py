"""``python -m envkit.agents.host REF``: the host process of a Python agent run with ``agent_process=True``, the
serving end of a :class:`~envkit.agents.process.HostedAgent` (see :mod:`envkit.agents.process`). It hosts the agent
``REF`` (``module:qualname``, or ``/path/to/script.py:name``) and answers each ``{"op": "run", "task": {...},
"client": {...}}`` line with what the agent returned (as JSON)."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from envkit.agents.agent import AgentClient, as_async_agent
from envkit.agents.line_server import Server, stdout_for_answers
from envkit.agents.process import load_agent


def main() -> None:
    """Host the agent named on the command line (see the module docstring)."""
    out = stdout_for_answers()
    agent = as_async_agent(load_agent(sys.argv[1]))

    async def run(request: dict[str, Any]) -> Any:
        result = await agent(request["task"], AgentClient(**request["client"]))
        try:
            json.dumps(result)
        except (TypeError, ValueError) as e:
            raise TypeError(f"the agent returned a {type(result).__name__}, which is not JSON ({e}): a hosted "
                            "agent's result crosses processes; return strings, numbers, lists and dicts") from None
        return result

    server = Server({"run": run}, out)
    server.answer({"id": None, "result": {"ready": sys.argv[1]}})
    asyncio.run(server.serve())


if __name__ == "__main__":
    main()
