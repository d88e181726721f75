"""The serving end of a host process: JSON requests a line on stdin, JSON answers a line on stdout.

A host process runs episodes for a process that must not run them in its own event loop: a verifiers env (its pins
clash with envkit's, :mod:`envkit.integrations.verifiers_driver`) or an agent run off the generator's loop
(:mod:`envkit.agents.process`). The protocol:

- ``{"id": 1, "op": NAME, ...}`` -> ``{"id": 1, "result": ...}``, or ``{"id": 1, "error": "..."}`` when the op
  raised; requests run concurrently;
- ``{"id": 1, "op": "cancel"}`` stops request 1 and answers ``{"id": 1, "cancelled": true}`` (the caller kills a
  host whose event loop is too blocked to answer it);
- the host writes ``{"id": null, "result": {"ready": ...}}`` once it can serve, and ends when its stdin closes.

Standard library only: the verifiers driver loads this file by path into a Python that has no envkit.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import traceback
from collections.abc import Awaitable, Callable
from typing import Any, TextIO

Op = Callable[[dict[str, Any]], Awaitable[Any]]
"""Answers one request (the whole request dict) with a JSON-serializable result."""


class Server:
    """Answers the requests on stdin with ``ops`` (by name), writing the answers to ``out``."""

    def __init__(self, ops: dict[str, Op], out: TextIO) -> None:
        self.ops, self.out = ops, out
        self.running: dict[Any, asyncio.Task] = {}

    def answer(self, message: dict[str, Any]) -> None:
        """Write one answer line."""
        self.out.write(json.dumps(message, default=str) + "\n")
        self.out.flush()

    async def handle(self, request: dict[str, Any]) -> None:
        """Answer one request; its failure is its answer, and the server goes on."""
        rid = request.get("id")
        try:
            op = self.ops.get(request["op"])
            if op is None:
                raise ValueError(f"unknown op {request['op']!r}")
            self.answer({"id": rid, "result": await op(request)})
        except asyncio.CancelledError:
            raise
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            self.answer({"id": rid, "error": f"{type(e).__name__}: {e}"})
        finally:
            self.running.pop(rid, None)

    async def serve(self) -> None:
        """Serve until stdin closes, then cancel what still runs."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 26)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            request = json.loads(line)
            if request.get("op") == "cancel":
                if (task := self.running.get(request.get("id"))) is not None:
                    task.cancel()
                self.answer({"id": request.get("id"), "cancelled": True})
                continue
            self.running[request.get("id")] = asyncio.ensure_future(self.handle(request))
        for task in list(self.running.values()):
            task.cancel()


def stdout_for_answers() -> TextIO:
    """The answer pipe (the stdout this process started with), moved off fd 1: from now on whatever writes to fd 1
    (``print``, native code, a child process) writes to stderr, so neither the served code nor a process it starts
    can corrupt the answers or forge one (the moved descriptor is not inherited)."""
    sys.stdout.flush()
    answers = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(answers, "w", buffering=1)
