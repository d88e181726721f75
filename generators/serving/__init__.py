"""Serving the policy to real clients and keeping, with consent, what it served: the first half of learning from live
traffic (``envkit serve-policy``; docs/serving.md).

Clients call an OpenAI-compatible endpoint (chat completions, Responses, Anthropic Messages; streamed or not) with
keys of their own. Every call is sampled by the capture gateway's machinery (:mod:`generators.gateway`), so what the
model read and sampled is known exactly, token ids and logprobs; calls that send a reply back continue its
conversation, linked as the gateway links an agent's calls. A call of a consenting client, in a sampled
conversation, not opted out, passes the redaction hook and is written to a :class:`CallStore` (SQLite, fsync'd)
before its response goes out: an answered call is a stored one. Feedback on a response is taken from the key it was
served to and no other.

The parts: :mod:`~generators.serving.server` (``PolicyServer``), :mod:`~generators.serving.store` (``CallStore``),
:mod:`~generators.serving.episodes` (calls into trajectories), :mod:`~generators.serving.users` (simulated users).
This module imports none of them: ``envkit`` loads the ``serve-policy`` command (:mod:`~generators.serving.cli`) on
every call, and the server imports torch.
"""

ADMIN_KEY_ENV = "ENVKIT_ADMIN_KEY"
"""Where the admin key is read from (never the command line, which other processes can read in /proc)."""
