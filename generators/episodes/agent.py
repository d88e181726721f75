"""Agent episodes: an :class:`~envkit.agents.agent.AgentEnv`'s agent plays the task with its own loop, calling the
policy through the capture gateway (generators/gateway/), whose recorded calls become the trajectory's token
sequences; the env grades what the agent returned."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from envkit import Env, Task, tracing
from envkit.agents.agent import AgentEnv
from generators.config import GeneratorConfig
from generators.engines.base import InferenceEngine
from generators.episodes.base import AtTurn, Rollout
from generators.parsers import OutputParser
from generators.tool_prompt import ToolPrompt
from generators.trajectory import StopReason

if TYPE_CHECKING:
    from generators.chat import ChatTokenizer
    from generators.gateway import Gateway  # fastapi, uvicorn: only agent envs need it


class AgentEpisodes:
    """Agent envs' episodes, through one capture gateway that starts on first use and stops when the last rollout
    using it ends (:meth:`serving`)."""

    def __init__(self, engine: InferenceEngine | None, tokenizer: ChatTokenizer | None, config: GeneratorConfig,
                 parser: OutputParser, tool_prompt: ToolPrompt) -> None:
        self.engine, self.tokenizer, self.config = engine, tokenizer, config
        self.parser, self.tool_prompt = parser, tool_prompt
        self._gateway: Gateway | None = None
        self._lock = asyncio.Lock()
        self._users = 0

    def accepts(self, env: Env) -> bool:
        return isinstance(env.unwrapped, AgentEnv)

    async def play(self, env: Env, state: Rollout, task: Task | None, seed: int | None, *,
                   at_turn: AtTurn | None = None, resumed: bool = False) -> StopReason:
        """An agent that fails after a budget refused its call (max_turns, max_tokens) or right after the token
        limit cut its last reply (an SDK may raise on a truncated response) scores 0; one that fails otherwise
        fails the rollout."""
        agent = env.unwrapped
        assert isinstance(agent, AgentEnv)
        if at_turn is not None or resumed:
            raise ValueError(f"generator.branch_at needs an env the generator steps; {type(agent).__name__}'s agent "
                             "runs its own loop")
        traj = state.traj
        t0 = time.perf_counter()
        with tracing.span("env.reset"):
            traj.messages, _ = await env.reset(seed=seed, task=task)
        state.env_s += time.perf_counter() - t0
        gateway = await self._started()
        failed = False
        with tracing.span("agent.run"):
            episode = gateway.open()  # in the span: the agent's calls through the gateway are its children
            try:
                result = await agent.run(gateway.client(episode))
            except Exception:
                if episode.stop is None and not episode.last_cut:
                    raise
                failed = True
                episode.stop = episode.stop or "max_tokens"
            finally:
                segments = gateway.end(episode)
            tracing.annotate(turns=episode.calls, stop_reason=episode.stop)
        state.generate_s += episode.generate_s
        if segments:
            first = segments[0]
            traj.prompt_ids, traj.response_ids = first.prompt_ids, first.response_ids
            traj.loss_mask, traj.rollout_logprobs = first.loss_mask, first.rollout_logprobs
            traj.version_spans, traj.messages = first.version_spans, first.messages
            traj.policy_version = first.version_spans[0][1] if first.version_spans else traj.policy_version
            traj.segments = [segment.sequence() for segment in segments[1:]]
        traj.num_turns, traj.tool_log, traj.template_mismatches = episode.calls, episode.tool_log, episode.skewed
        traj.refused_calls = episode.refused
        t0 = time.perf_counter()
        if not failed:
            with tracing.span("agent.score"):
                score = await agent.score(result)
                tracing.annotate(reward=score.value)
            traj.reward, traj.scores = score.value, score.breakdown
        state.env_s += time.perf_counter() - t0
        traj.step_rewards = [traj.reward]
        return episode.stop or "done"

    async def _started(self) -> Gateway:
        """The gateway, started on first use."""
        from generators.gateway import Gateway, Limits

        async with self._lock:
            if self._gateway is None:
                if self.engine is None or self.tokenizer is None:
                    raise ValueError("agent envs need a token-in/token-out engine and its tokenizer: the capture "
                                     "gateway records token ids")
                cfg = self.config
                gateway = Gateway(self.engine, self.tokenizer, self.parser, self.tool_prompt,
                                  Limits(cfg.sampling, cfg.max_turns, cfg.max_total_tokens, cfg.check_template),
                                  host=cfg.gateway_host)
                await gateway.start()
                self._gateway = gateway
            return self._gateway

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        """Rollouts in progress: the gateway, if one started, stops once the last of them ends."""
        self._users += 1
        try:
            yield
        finally:
            self._users -= 1
            if self._users == 0 and self._gateway is not None:
                gateway, self._gateway = self._gateway, None
                await gateway.stop()
