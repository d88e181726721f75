"""A command-line agent: reads a task (JSON) on stdin, plays it with an openai-SDK tool loop against the endpoint in
``OPENAI_BASE_URL``/``OPENAI_API_KEY``/``OPENAI_MODEL``, and prints its answer, as coding CLIs do.

    echo '{"question": "What is 2 + 3?"}' | OPENAI_BASE_URL=... python cli_agent.py --max-tokens 24
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from agent_envs import tool_loop

from envkit.agent import AgentClient


def main() -> None:
    """Parse the flags, play the task from stdin, print the final answer."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=48, help="the completion limit per model call")
    parser.add_argument("--turns", type=int, default=3, help="model calls at most")
    args = parser.parse_args()
    task = json.load(sys.stdin)
    client = AgentClient(base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"],
                         model=os.environ.get("OPENAI_MODEL", "policy"), episode_url=os.environ["OPENAI_BASE_URL"])
    print(asyncio.run(tool_loop(task, client, turns=args.turns, max_tokens=args.max_tokens)))


if __name__ == "__main__":
    main()
