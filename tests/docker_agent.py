"""A command-line agent for DockerCommand's and Command's tests, on the standard library alone (the base image has no
SDK): the task as JSON on stdin, two chat calls to $OPENAI_BASE_URL, the last reply on stdout. ``probe HOST:PORT...``
instead tries a TCP connection to each address and a DNS lookup, and prints what each gave, as JSON. ``hostile`` plays
a policy-driven process gone bad and prints what it got, as JSON: the keys of other episodes it finds in /proc, what
its endpoint answers to a peer's key (by header and by path), and what each of the task's ``targets`` answers.
``scout FILE HOST:PORT...`` asks the question once and prints, as JSON, its answer with what an agent on a cluster's
node may reach for: its uid, each address (a TCP connection), the file (read) and other episodes' keys in /proc.
``seat`` plays one turn of a multi-agent env's seat (the task's ``messages``: its chat so far) with one call, and
prints, as JSON, its ``move`` and what it found of other seats' secrets: the tasks of other agent processes, read
from their environment in /proc, for up to ``SECONDS``."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import urllib.error
import urllib.request


def chat(messages: list[dict]) -> str:
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions", method="POST",
        data=json.dumps({"model": os.environ["OPENAI_MODEL"], "messages": messages}).encode(),
        headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        return json.load(answer)["choices"][0]["message"]["content"] or ""


def attempt(action, *args) -> str:
    try:
        action(*args)
        return "ok"
    except OSError as e:
        return f"{type(e).__name__}: {e}"


def connect(host: str, port: str) -> None:
    socket.create_connection((host, int(port)), timeout=3).close()


def probe(addresses: list[str]) -> dict[str, str]:
    seen = {address: attempt(connect, *address.rsplit(":", 1)) for address in addresses}
    seen["dns"] = attempt(socket.getaddrinfo, "pypi.org", 443)
    return seen


def status(url: str, key: str = "", body: dict | None = None) -> int | str:
    """The HTTP status ``url`` answers (POST when there is a ``body``), or why nothing answered."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Authorization": f"Bearer {key}",
                                                               "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, urllib.error.URLError) as e:
        return f"unreachable: {e}"


def peers(variable: str, own: str) -> list[str]:
    """``variable`` in the environment of every process whose environment this one may read, but its own value."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                variables = f.read().split(b"\0")
        except OSError:
            continue
        found |= {v.split(b"=", 1)[1].decode() for v in variables if v.startswith(variable.encode() + b"=")}
    return sorted(found - {own})


def seat(task: dict, seconds: float) -> dict:
    move = chat(task["messages"])
    deadline, found = time.monotonic() + seconds, []
    while not found and time.monotonic() < deadline:  # the other seat's process may start a moment later
        found = peers("ENVKIT_TASK", os.environ.get("ENVKIT_TASK", ""))
        time.sleep(0.05)
    return {"move": move, "found": found, "uid": os.getuid()}


def hostile(task: dict) -> dict:
    own, base = os.environ["OPENAI_API_KEY"], os.environ["OPENAI_BASE_URL"]
    root = base.removesuffix("/v1")
    found = peers("OPENAI_API_KEY", own)
    peer = task["peer_key"]
    return {"env": sorted(os.environ), "task": task, "found_keys": found,
            "peer_key": {"header": status(f"{base}/models", peer), "path": status(f"{root}/e/{peer}/v1/models")},
            "own_key": status(f"{base}/models", own),
            "targets": {name: status(url, peer, body) for name, (url, body) in task["targets"].items()}}


def read(path: str) -> None:
    with open(path) as f:
        f.read()


def scout(task: dict, path: str, addresses: list[str]) -> dict:
    answer = chat([{"role": "user", "content": task["question"]}])
    return {"answer": answer, "uid": os.getuid(), "reached": probe(addresses), "read": attempt(read, path),
            "found_keys": peers("OPENAI_API_KEY", os.environ["OPENAI_API_KEY"])}


def main() -> None:
    if sys.argv[1:2] == ["probe"]:
        print(json.dumps(probe(sys.argv[2:])))
        return
    task = json.load(sys.stdin)
    if sys.argv[1:2] == ["hostile"]:
        print(json.dumps(hostile(task)))
        return
    if sys.argv[1:2] == ["scout"]:
        print(json.dumps(scout(task, sys.argv[2], sys.argv[3:])))
        return
    if sys.argv[1:2] == ["seat"]:
        print(json.dumps(seat(task, float(sys.argv[2]))))
        return
    if sys.argv[1:2] == ["hold"]:
        chat([{"role": "user", "content": task["question"]}])
        time.sleep(float(sys.argv[2]))
        return
    messages = [{"role": "user", "content": task["question"]}]
    first = chat(messages)
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "Say only the number."}]
    print(chat(messages))


if __name__ == "__main__":
    main()
