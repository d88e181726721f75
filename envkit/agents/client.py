"""AgentClient: where an agent reaches the policy for one episode, as its env hands it over.

A leaf of :mod:`envkit.agents`: the env (:mod:`envkit.agents.agent`), the host processes agents run in
(:mod:`envkit.agents.process`) and the gateway that serves the endpoint all name this type, so it sits below them.
Importable from :mod:`envkit.agents.agent` too.
"""

from __future__ import annotations

from dataclasses import dataclass

from envkit.tracing import TRACEPARENT_ENV


@dataclass(frozen=True, slots=True)
class AgentClient:
    """Where an agent reaches the policy for one episode: an OpenAI-compatible ``base_url`` (ending in ``/v1``),
    the episode's ``api_key``, and the ``model`` name to request. ``episode_url`` carries the key in the path, for
    agents that cannot set one (``OPENAI_BASE_URL`` alone). ``channel_url`` is the episode's own port of the
    gateway, which refuses every other episode's key: isolated agent processes are relayed to it."""

    base_url: str
    api_key: str
    model: str
    episode_url: str
    channel_url: str | None = None
    traceparent: str | None = None
    """The episode's trace context (W3C), when the run is traced: an agent's own spans can join its rollout's trace
    (its process gets it as ``TRACEPARENT``)."""

    def environ(self) -> dict[str, str]:
        """The variables an agent process reads: the OpenAI SDK's and most CLIs', the Anthropic SDK's (whose
        base URL is the server's root; the gateway also serves ``/v1/messages``), and OpenTelemetry's
        ``TRACEPARENT`` when traced."""
        return {"OPENAI_BASE_URL": self.base_url, "OPENAI_API_KEY": self.api_key, "OPENAI_MODEL": self.model,
                "ANTHROPIC_BASE_URL": self.base_url.removesuffix("/v1"), "ANTHROPIC_API_KEY": self.api_key,
                **({TRACEPARENT_ENV: self.traceparent} if self.traceparent else {})}
