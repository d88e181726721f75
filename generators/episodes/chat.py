"""Chat episodes: the generator steps the env, turn by turn, token-in/token-out.

    messages = env.reset(task)            → prompt_ids (chat template)
    while not done:
        message = turn(env, rollout)      → model tokens  (loss_mask 1, sampler logprobs)
        result  = env.step(message)       → reward, observation
        ids    += close_turn + observation → env tokens    (loss_mask 0)

Who writes each assistant turn is the runner's :data:`TurnWriter`: :class:`ModelTurns` samples it from the policy,
:class:`~generators.episodes.demonstration.DemoTurns` takes the env's demonstration.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from envkit import Env, Message, Task, tracing
from envkit.agents.agent import AgentEnv
from generators.config import GeneratorConfig
from generators.engines.base import Completion, InferenceEngine, SamplingParams, generate_turn, request_seed
from generators.episodes.base import AtTurn, Rollout
from generators.parsers import OutputParser
from generators.tool_prompt import ToolPrompt
from generators.trajectory import StopReason, Trajectory

if TYPE_CHECKING:
    from generators.chat import ChatTokenizer

TurnWriter = Callable[[Env, Rollout, int], Awaitable[tuple[Message, Completion, str]]]
"""Who writes an assistant turn: ``(env, rollout, max_tokens) -> (message, completion, text written)``."""


class ChatEpisodes:
    """Episodes the generator steps itself: every env but an agent env (whose agent runs its own loop)."""

    def __init__(self, tokenizer: ChatTokenizer | None, config: GeneratorConfig, tool_prompt: ToolPrompt,
                 turn: TurnWriter) -> None:
        self.tokenizer, self.config, self.tool_prompt, self.turn = tokenizer, config, tool_prompt, turn

    def accepts(self, env: Env) -> bool:
        return not isinstance(env.unwrapped, AgentEnv)

    async def play(self, env: Env, state: Rollout, task: Task | None, seed: int | None, *,
                   at_turn: AtTurn | None = None, resumed: bool = False) -> StopReason:
        traj, cfg = state.traj, self.config
        if not resumed:
            await self._reset(env, state, task, seed)
        while True:
            if at_turn is not None:
                await at_turn(env, state)
            if traj.num_turns >= cfg.max_turns:
                return "max_turns"
            budget = cfg.max_total_tokens - len(state.ids) - len(state.pending)
            if budget <= 0:
                return "max_tokens"
            state.append(state.pending, None)
            state.pending = []
            action, completion, text = await self.turn(env, state, min(cfg.sampling.max_tokens, budget))
            state.written[len(traj.messages)] = text
            traj.messages.append(action)
            traj.num_turns += 1

            t0 = time.perf_counter()
            with tracing.span("env.step", turn=traj.num_turns):
                result = await env.step(action)
                tracing.annotate(reward=result.reward, done=result.done)
            state.env_s += time.perf_counter() - t0
            traj.step_rewards.append(result.reward)
            traj.reward += result.reward
            traj.messages.extend(result.observation)
            traj.tool_log.extend(tool_log(traj.num_turns, action, result.info))
            if result.done:
                traj.truncated = result.truncated and not result.terminated
                traj.scores = dict(result.info.get("rubric") or {})
                return "done"
            if self.tokenizer is not None:
                self._observe(state, completion, list(result.observation))

    async def _reset(self, env: Env, state: Rollout, task: Task | None, seed: int | None) -> None:
        """The opening messages, with the env's tools where the chat template wants them, and their ids."""
        traj = state.traj
        t0 = time.perf_counter()
        with tracing.span("env.reset"):
            messages, _ = await env.reset(seed=seed, task=task)
        state.env_s += time.perf_counter() - t0
        state.tools = [t.to_openai() for t in env.tools] or None
        traj.messages, state.template_tools = self.tool_prompt.apply(list(messages), state.tools)
        if self.tokenizer is not None:
            traj.prompt_ids = self.tokenizer.prompt_ids(traj.messages, state.template_tools)
            state.ids = list(traj.prompt_ids)

    def _observe(self, state: Rollout, completion: Completion, observation: list[Message]) -> None:
        """The env's reply as pending tokens (the turn's end, then the observation), checked against a re-render."""
        assert self.tokenizer is not None
        traj = state.traj
        state.pending = self.tokenizer.close_turn(completion.token_ids)
        state.pending += self.tokenizer.observation_ids(observation, state.template_tools)
        if self.config.check_template and self.tokenizer.render(_as_written(traj.messages, state.written),
                                                                state.template_tools) != state.ids + state.pending:
            traj.template_mismatches += 1


class ModelTurns:
    """The policy writes each turn: sampled from the engine (token ids, or chat mode where there are none)."""

    def __init__(self, engine: InferenceEngine, tokenizer: ChatTokenizer | None, config: GeneratorConfig,
                 parser: OutputParser) -> None:
        self.engine, self.tokenizer, self.config, self.parser = engine, tokenizer, config, parser

    async def __call__(self, env: Env, state: Rollout, max_tokens: int) -> tuple[Message, Completion, str]:
        """One model turn: the assistant message the env sees, the completion, and the text the model wrote."""
        sampling = replace(self.config.sampling, max_tokens=max_tokens)
        t0 = time.perf_counter()
        if self.tokenizer is None:  # chat mode: no token ids; the endpoint's tool calls, else ones in the text
            with tracing.span("generate", max_tokens=max_tokens):
                chat = await self.engine.chat(state.traj.messages, self._seeded(sampling, state, 0),
                                              state.template_tools)
            state.mark_version(chat.weight_version)
            state.generate_s += time.perf_counter() - t0
            text = chat.content or ""
            action = self.parser.parse(text, state.tools, native_calls=chat.tool_calls, reasoning=chat.reasoning)
            return action, Completion([], [], chat.finish_reason, chat.weight_version), text
        ids: list[int] = []
        async for part in generate_turn(self.engine, state.ids, sampling,
                                        lambda params, k: self._seeded(params, state, k)):
            if part.token_ids or part.finish_reason != "abort":  # stopped before its first token: no token has it
                state.mark_version(part.weight_version)
            state.append(part.token_ids, part.logprobs)
            ids += part.token_ids
        state.generate_s += time.perf_counter() - t0
        text = self.tokenizer.decode(ids)
        completion = Completion(ids, [], part.finish_reason, part.weight_version)
        return self.parser.parse(text, state.tools), completion, text

    def _seeded(self, sampling: SamplingParams, state: Rollout, continuation: int) -> SamplingParams:
        if sampling.seed is None:
            return sampling
        # one seed per request, so samples of a group differ yet reproduce
        return replace(sampling, seed=_request_seed(sampling.seed, state.traj, self.engine.weight_version,
                                                    continuation))


def tool_log(turn: int, action: Message, info: dict[str, Any]) -> list[dict[str, Any]]:
    """The entries of :attr:`Trajectory.tool_log` for one step: each call the model wrote, with how it went as the
    env reports it (``info["tool_results"]``, :class:`envkit.ToolEnv`'s), else status unknown; and each call it
    wrote that could not be read."""
    calls = action.get("tool_calls") or []
    results = info.get("tool_results") if isinstance(info, dict) else None
    if not (isinstance(results, list) and len(results) == len(calls) and all(isinstance(r, dict) for r in results)):
        results = [{"name": c["function"]["name"], "status": "unknown"} for c in calls]
    unread = [{"turn": turn, "name": None, "status": "unparsed"} for _ in action.get("tool_call_errors") or []]
    return [{"turn": turn, **r} for r in results] + unread


def _request_seed(base: int, traj: Trajectory, version: int, continuation: int = 0) -> int:
    """The request's seed from the rollout's identity, its turn, the weight version and, for a turn continued after
    a weight update, which continuation."""
    return request_seed(base, traj.group_id, traj.sample_index, traj.num_turns, version,
                        *([continuation] if continuation else []))


def _as_written(messages: list[Message], written: dict[int, str]) -> list[Message]:
    """The chat with the model's turns as the plain text it wrote (parsed reasoning and tool calls are ours)."""
    return [{"role": "assistant", "content": written[i]} if i in written else m for i, m in enumerate(messages)]
