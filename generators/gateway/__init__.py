"""The capture gateway: an OpenAI-compatible server in front of the run's engine, recording exactly what the policy
sampled for agents that run their own loop (:class:`envkit.agents.agent.AgentEnv`).

Each episode gets its own API key (also usable in the path: ``/e/KEY/v1``). A ``/v1/chat/completions`` call is
rendered by the model's chat template, with the tools written into the system message where the template drops them
(as the rollout loop does), sampled token-in/token-out on the engine, and recorded: prompt ids, sampled ids and their
logprobs, finish reason, tool calls, weight version. Sampling uses the run's settings, not the request's temperature
or seed: a training run must sample from the policy it trains. ``max_tokens`` (capped by the run's) and ``stop``
are honoured; as in OpenAI's API, a reply leaves out the stop string that ended it (its tokens stay in the
sequence: they were sampled).

**Dialects.** Each API the gateway speaks is a :class:`~generators.gateway.dialect.Dialect`: chat completions
(:mod:`~generators.gateway.chat`, whose request is the form every call is read into), OpenAI's Responses
(:mod:`~generators.gateway.responses`) and Anthropic's Messages (:mod:`~generators.gateway.anthropic`). A dialect
reads its request into the chat completions call it describes, and writes the reply, its stream events and its
refusals in its own shape; one handler (:mod:`~generators.gateway.app`) serves them all. A new dialect is one module
and one line in :data:`~generators.gateway.app.DIALECTS`.

**Segments.** A call whose messages are an earlier call's messages, then the reply the gateway gave, then new
messages continues that call's segment: the reply's sampled ids go in with loss mask 1, and the new messages as
observation tokens with loss mask 0, exactly as the rollout loop appends an env's turn, so nothing the model sampled
is ever re-tokenized. Any other call (a compressed context, a sub-agent, an edited history) starts a new segment of
the episode, and so does each choice of an ``n > 1`` call that the agent did not continue. Every segment trains as
a sequence of its own with the episode's reward and advantage (advantages are computed over a group's episodes; an
episode's segments share its advantage).

**Skew.** After each linked call, the whole chat is also rendered from scratch; where that differs from the linked
ids the call counts as skewed (``Trajectory.template_mismatches``). It is measured, never fixed up.
"""

from generators.gateway.app import DIALECTS
from generators.gateway.dialect import Call, Dialect
from generators.gateway.server import ANY_HOST, KEEP_ALIVE_S, Gateway, Limits, node_address
from generators.gateway.types import MAX_STOPS, ChatRequest, Choice, Episode, GatewayError, Segment, UnsupportedInput

__all__ = ["ANY_HOST", "DIALECTS", "KEEP_ALIVE_S", "MAX_STOPS", "Call", "ChatRequest", "Choice", "Dialect", "Episode",
           "Gateway", "GatewayError", "Limits", "Segment", "UnsupportedInput", "node_address"]
