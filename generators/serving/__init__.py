"""Serving the policy to real clients and keeping, with consent, what it served: the first half of learning from live
traffic (``envkit serve-policy``; docs/serving.md).

Clients call an OpenAI-compatible endpoint (chat completions, Responses, Anthropic Messages; streamed or not) with
keys of their own. Every call is sampled by the capture gateway's machinery (:mod:`generators.gateway`), so what the
model read and sampled is known exactly, token ids and logprobs; calls that send a reply back continue its
conversation, linked as the gateway links an agent's calls. A call of a consenting client, in a sampled
conversation, not opted out, passes the redaction hook and is written to a :class:`CallStore` (SQLite, fsync'd)
before its response goes out: an answered call is a stored one. Feedback on a response is taken from the key it was
served to and no other.
"""

from generators.serving.server import CAPTURE_HEADER, VERSION_HEADER, Client, PolicyServer, Redactor, ServingConfig
from generators.serving.store import CallStore, Feedback, StoredCall

__all__ = ["CAPTURE_HEADER", "VERSION_HEADER", "CallStore", "Client", "Feedback", "PolicyServer", "Redactor",
           "ServingConfig", "StoredCall"]
