"""Train an agent written with the OpenAI Agents SDK, unmodified: it runs its own loop, and every model call it makes
goes through envkit's capture gateway, which records the exact token ids the policy sampled.

    python examples/train_agent_sdk.py [trainer overrides ...]

`make_env` is an ordinary AgentEnv: an `agent(task, client)` that builds the SDK's Agent on the episode's endpoint
(`client.base_url`, `client.api_key`), runs it, and returns its final output; a grader scores that. The trainer
finds it by name (`env.name=train_agent_sdk:make_env`, this file's directory being on the path). The SDK's default
model class speaks the Responses API, which the gateway serves; LangGraph, pydantic-ai or a CLI agent
(`envkit.Command`) plug in the same way. Needs the agents extra (`pip install 'envkit-rl[agents]'`; `make install`
has it).
"""

from __future__ import annotations

import json
import sys

import openai

import trainer
from envkit import AgentClient, AgentEnv, Task
from envkit.parsing import grade_number


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


async def solve(task: Task, client: AgentClient) -> str:
    """One episode: the SDK's agent with an `add` tool, pointed at the episode's endpoint."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner, function_tool

    sdk = openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0)
    agent = Agent(name="adder", instructions="Use the add tool, then answer.", tools=[function_tool(add)],
                  model=OpenAIResponsesModel(model=client.model, openai_client=sdk),
                  model_settings=ModelSettings(max_tokens=48))
    # No tracing: it would export each run to OpenAI's servers.
    result = await Runner.run(agent, task["question"], max_turns=10, run_config=RunConfig(tracing_disabled=True))
    return str(result.final_output)


def grade(task: Task, answer: str) -> float:
    """1 for the right sum, 0.1 for another number (so a group's rewards differ early on), 0 for no number."""
    if grade_number(answer, task["answer"])["correct"]:
        return 1.0
    return 0.1 if any(c.isdigit() for c in answer or "") else 0.0


def make_env() -> AgentEnv:
    """One-digit sums; pairs with a first number of 8 or 9 are held out."""
    tasks = [{"id": f"sum-{a}-{b}", "question": f"What is {a} + {b}? End with 'The answer is N.'", "answer": a + b}
             for a in range(1, 10) for b in range(1, 4)]
    return AgentEnv(agent=solve, grader=grade, tasks={"train": tasks[:21], "test": tasks[21:]})


if __name__ == "__main__":
    results = trainer.run(["env.name=train_agent_sdk:make_env", "generator.max_tokens=48", *sys.argv[1:]])
    print(json.dumps(results, indent=2))
