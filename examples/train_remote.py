"""Train on an env served over WebSocket by `envkit serve`: where an env runs is a deployment choice.

    python examples/train_remote.py [trainer overrides ...]

This serves `arithmetic` on a free loopback port (in real use another host runs `envkit serve arithmetic`) and
trains on ws://127.0.0.1:PORT/arithmetic. The task lists come from the server (GET /tasks); each rollout is a
session of its own on the server.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx

import trainer


def serve(env: str) -> tuple[subprocess.Popen, int]:
    """`envkit serve ENV` on a free loopback port, once it answers /health."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "envkit.cli", "serve", env, "--port", str(port)])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return server, port
        except httpx.TransportError:
            time.sleep(0.2)
    server.kill()
    raise SystemExit(f"envkit serve {env} did not come up")


if __name__ == "__main__":
    server, port = serve("arithmetic")
    try:
        results = trainer.run([f"env.name=ws://127.0.0.1:{port}/arithmetic", *sys.argv[1:]])
    finally:
        server.terminate()
        server.wait()
    print(json.dumps(results, indent=2))
