"""A command-line agent for DockerCommand's tests, on the standard library alone (the base image has no SDK): the
task as JSON on stdin, two chat calls to $OPENAI_BASE_URL, the last reply on stdout. ``probe HOST:PORT...`` instead
tries a TCP connection to each address and a DNS lookup, and prints what each gave, as JSON."""

from __future__ import annotations

import json
import os
import socket
import sys
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


def main() -> None:
    if sys.argv[1:2] == ["probe"]:
        print(json.dumps(probe(sys.argv[2:])))
        return
    task = json.load(sys.stdin)
    messages = [{"role": "user", "content": task["question"]}]
    first = chat(messages)
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "Say only the number."}]
    print(chat(messages))


if __name__ == "__main__":
    main()
