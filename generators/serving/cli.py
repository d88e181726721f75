"""``envkit serve-policy``: serve a model to clients on an OpenAI-compatible endpoint, keeping their consenting calls
and feedback in a store (see :mod:`generators.serving`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from envkit.imports import import_ref
from envkit.rewards.rubrics import load_rubric
from generators.engines.base import EngineError
from generators.models import BUNDLED
from generators.serving import ADMIN_KEY_ENV
from generators.serving.store import CallStore

if TYPE_CHECKING:
    from generators.serving.server import Client, ServingConfig

_EPILOG = f"""\
clients file (JSON): a list of {{"name": ..., "key": ..., "capture": true|false}}; a client with
"capture": false is served but never stored. Keep this file private: the keys are the clients' credentials.

Clients call http://HOST:PORT/v1 with the openai or anthropic SDK (chat completions, Responses, Messages;
stream or not). Every response carries x-envkit-model-version and x-envkit-response-id. A request with the
header x-envkit-capture: off is not stored, nor is any later call of its conversation.

  POST /v1/feedback {{"response_id": ..., "score": 0..1 | "thumbs": "up"|"down", "text": ...}}
       a score for a stored response, from the key it was served to (any other key: 404)
  DELETE /v1/admin/clients/NAME/data   with the admin key (${ADMIN_KEY_ENV}): delete that client's data
  GET /metrics                          Prometheus metrics

examples:
  envkit serve-policy --clients clients.json --store runs/serving
  envkit serve-policy --clients clients.json --sample-rate 0.1 --redact mycompany.privacy:scrub
  envkit serve-policy --store runs/serving --forget acme      # delete one client's data, then exit

SIGTERM or Ctrl-C drains: calls in flight are answered and stored, then it exits 0.
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``envkit serve-policy`` on the ``envkit`` CLI."""
    p = subparsers.add_parser(
        "serve-policy", help="serve a model to clients (OpenAI/Anthropic APIs), keeping consenting calls and feedback",
        description="Serve a model on an OpenAI-compatible endpoint to keyed clients; store each consenting call\n"
                    "(exact token ids, redacted first) before answering it, and take feedback on it later.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=BUNDLED, help=f"'{BUNDLED}' (default: SmolLM2-135M-Instruct) or an HF "
                                                    "checkpoint dir")
    p.add_argument("--engine", choices=("vllm", "sglang", "hf"), default="vllm",
                   help="what samples: a managed vLLM or SGLang server, or in-process transformers (default: vllm)")
    p.add_argument("--clients", type=Path, metavar="FILE", help="the clients and their keys (JSON; see below)")
    p.add_argument("--store", type=Path, default=Path("runs/serving"), metavar="DIR",
                   help="where calls and feedback are kept (default: runs/serving)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="the port (default: 8000; 0 picks a free one)")
    p.add_argument("--sample-rate", type=float, default=1.0, metavar="P",
                   help="the share of consenting conversations stored (default: 1)")
    p.add_argument("--redact", metavar="MODULE:ATTR", help="a redaction hook run on each call before it is stored: "
                                                          "messages (the reply last) in, messages out")
    p.add_argument("--rubric", metavar="MODULE:ATTR",
                   help="an envkit rubric (e.g. an LLM judge) that scores stored calls in the background: the reward "
                        "of conversations no client scored in time")
    p.add_argument("--rubric-rate", type=float, default=1.0, metavar="P",
                   help="the share of stored calls the rubric scores (default: 1)")
    p.add_argument("--max-concurrent", type=int, default=64, metavar="N",
                   help="calls answered at once; past it, 429 with retry-after (default: 64)")
    p.add_argument("--max-age-days", type=float, metavar="DAYS", help="delete stored calls older than this")
    p.add_argument("--max-store-mb", type=float, metavar="MB", help="delete the oldest stored calls past this size")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default: 1)")
    p.add_argument("--max-tokens", type=int, default=512, help="max tokens per reply (default: 512)")
    p.add_argument("--max-total-tokens", type=int, default=2048,
                   help="max prompt plus reply tokens of a call (default: 2048)")
    p.add_argument("--forget", metavar="CLIENT", help="delete CLIENT's calls and feedback from --store, then exit")
    p.set_defaults(func=_cmd_serve_policy)


class _InputError(Exception):
    pass


def _clients(path: Path | None) -> list[Client]:
    from generators.serving.server import Client

    if path is None:
        raise _InputError("--clients FILE is required: the clients and their keys")
    try:
        rows = json.loads(path.read_text())
        return [Client(name=str(r["name"]), key=str(r["key"]), capture=bool(r.get("capture", True))) for r in rows]
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise _InputError(f"cannot read the clients from {path}: {type(e).__name__}: {e}") from None


def _serving_config(args: argparse.Namespace) -> ServingConfig:
    from generators.serving.server import ServingConfig

    redact = None
    if args.redact:
        try:
            redact = import_ref(args.redact)
        except (ImportError, AttributeError) as e:
            raise _InputError(f"cannot import the redaction hook {args.redact!r}: {e}") from None
        if not callable(redact):
            raise _InputError(f"the redaction hook {args.redact!r} is not callable")
    try:
        rubric = load_rubric(args.rubric) if args.rubric else None
        return ServingConfig(clients=_clients(args.clients), admin_key=os.environ.get(ADMIN_KEY_ENV) or None,
                             sample_rate=args.sample_rate, redact=redact, max_concurrent=args.max_concurrent,
                             rubric=rubric, rubric_rate=args.rubric_rate)
    except (ValueError, TypeError) as e:
        raise _InputError(str(e)) from None


def _store(args: argparse.Namespace) -> CallStore:
    return CallStore(args.store, max_age_s=args.max_age_days * 86400 if args.max_age_days else None,
                     max_bytes=int(args.max_store_mb * 2**20) if args.max_store_mb else None)


async def _forget(args: argparse.Namespace, console: Console) -> None:
    with _store(args) as store:
        deleted = await store.forget(args.forget)
    console.print(f"deleted {deleted} stored calls of {args.forget!r} (and their feedback) from {store.path}")


async def _serve(args: argparse.Namespace, config: ServingConfig, console: Console) -> None:
    from generators.chat import ChatTokenizer
    from generators.engines.factory import EngineConfig, make_engine
    from generators.models import resolve_model
    from generators.rollout import GeneratorConfig
    from generators.serving.server import PolicyServer

    try:
        generator = GeneratorConfig(temperature=args.temperature, max_tokens=args.max_tokens,
                                    max_total_tokens=args.max_total_tokens)
    except ValueError as e:
        raise _InputError(str(e)) from None
    path = await asyncio.to_thread(resolve_model, args.model)
    tokenizer = await asyncio.to_thread(ChatTokenizer.from_pretrained, path)
    engine = make_engine(EngineConfig(args.engine, max_model_len=args.max_total_tokens), path,
                         log_dir=args.store / "logs")
    with _store(args) as store:
        await engine.start()
        try:
            server = PolicyServer(engine, tokenizer, config, store, generator)

            def ready(url: str) -> None:
                console.print(f"serving {args.model} at {url}/v1 to {len(config.clients)} clients "
                              f"(weight version {server.model_version}); storing to {store.path}", highlight=False,
                              soft_wrap=True)

            await server.serve(args.host, args.port, on_ready=ready)
        finally:
            await engine.stop()
    console.print(f"stopped: the {server.drained} calls in flight were answered and stored")


def _cmd_serve_policy(args: argparse.Namespace, console: Console) -> int:
    errors = Console(stderr=True)
    logging.basicConfig(level=logging.WARNING)
    try:
        if args.forget:
            asyncio.run(_forget(args, console))
            return 0
        asyncio.run(_serve(args, _serving_config(args), console))
    except (_InputError, FileNotFoundError) as e:
        errors.print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
        return 2
    except EngineError as e:
        errors.print(f"[red]engine error:[/red] {e}", highlight=False, soft_wrap=True)
        return 1
    return 0
