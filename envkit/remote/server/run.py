"""Running ``envkit serve``: :func:`serve` under uvicorn, one process or ``--workers N`` (each builds its app from the
config the parent leaves in the environment), with every log line behind :class:`RedactSecrets`."""

from __future__ import annotations

import copy
import ipaddress
import json
import logging
import os
import re
import secrets
import signal
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI

import envkit.agents.untrusted as untrusted
from envkit.remote import KEEP_ALIVE_S, PARENT_ENV, SNAPSHOT_KEY_ENV, TOKEN_ENV
from envkit.remote.server.app import create_app
from envkit.remote.server.config import ServeConfig, ServerLimits
from envkit.remote.server.guard import GuardedHttp, descriptor_budget
from envkit.remote.server.sessions import EnvServer
from envkit.remote.server.workers import RUN_DIR_ENV, WorkerSlots

log = logging.getLogger(__name__)

_CONFIG_ENV = "ENVKIT_SERVE_CONFIG"  # hands the config to each worker process when --workers > 1


def is_loopback(host: str) -> bool:
    """True when ``host`` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _app_from_environ() -> FastAPI:
    """The app of one worker process (``--workers N``), built from the config the parent put in the environment."""
    config = ServeConfig.from_json(json.loads(os.environ[_CONFIG_ENV]))
    _guard_connections(config.limits)
    return create_app(config.env, env_kwargs=config.env_kwargs, token=config.token, limits=config.limits,
                      slots=WorkerSlots(os.environ[RUN_DIR_ENV], config.workers), mcp=config.mcp,
                      loopback=is_loopback(config.host))


def _guard_connections(limits: ServerLimits) -> None:
    """Arm this process's HTTP protocol with the read deadline and the connection cap its descriptors allow."""
    GuardedHttp.configure(request_timeout_s=limits.request_timeout_s,
                          max_connections=descriptor_budget(limits.max_connections, limits.max_sessions))


_CREDENTIALS = re.compile(r"(?i)(authorization:?\s*(?:bearer\s+)?|bearer\s+)\S+")


class RedactSecrets(logging.Filter):
    """Blanks bearer credentials (right or wrong) and the given secrets in every record a handler writes:
    uvicorn logs a WebSocket handshake's headers, ``Authorization`` included, at debug level."""

    def __init__(self, secrets: Sequence[str] = ()) -> None:
        super().__init__()
        self.secrets = [s for s in secrets if s]

    def redact(self, text: str) -> str:
        """``text`` with every credential and secret replaced by ``[redacted]``."""
        text = _CREDENTIALS.sub(r"\1[redacted]", text)
        for secret in self.secrets:
            text = text.replace(secret, "[redacted]")
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = self.redact(message)
        if clean != message:
            record.msg, record.args = clean, ()
        if record.exc_info and not record.exc_text:
            record.exc_text = self.redact(logging.Formatter().formatException(record.exc_info))
        return True


def _log_config(level: str, secrets: Sequence[str]) -> dict[str, Any]:
    """uvicorn's logging setup with every handler behind :class:`RedactSecrets`, and the root logger (envkit, the
    env, websockets) on the same handler and level."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["filters"] = {"redact": {"()": RedactSecrets, "secrets": list(secrets)}}
    for handler in config["handlers"].values():
        handler["filters"] = ["redact"]
    config["root"] = {"handlers": ["default"], "level": level.upper()}
    return config


def _end_with_parent() -> None:
    """SIGTERM this process once the process :data:`~envkit.remote.PARENT_ENV` names is gone (this one is reparented):
    a SIGKILLed owner closes nothing, and the sandboxes this server's envs opened would run on."""
    parent = os.environ.pop(PARENT_ENV, None)  # not for this server's own children: their owner is this process
    if parent is None:
        return

    def watch() -> None:
        while os.getppid() == int(parent):
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="envkit-parent-watch", daemon=True).start()


def serve(config: ServeConfig) -> None:
    """Serve until SIGINT/SIGTERM, then close every env. Warns when bound beyond loopback without a token."""
    import uvicorn

    if not is_loopback(config.host) and not config.token:
        log.warning("envkit serve is listening on %s without a token: anyone who can reach this port can run the "
                    "env. Set %s or pass --token.", config.host, TOKEN_ENV)
    # Workers share one snapshot key, so that a token restores on any of them.
    shared_key = config.workers > 1 and SNAPSHOT_KEY_ENV not in os.environ
    key = secrets.token_hex(32) if shared_key else os.environ.get(SNAPSHOT_KEY_ENV, "")
    common: dict[str, Any] = {
        "host": config.host, "port": config.port, "log_level": config.log_level, "access_log": False,
        "ws_max_size": config.limits.max_request_bytes, "timeout_keep_alive": KEEP_ALIVE_S, "lifespan": "on",
        "log_config": _log_config(config.log_level, [config.token or "", key]), "http": GuardedHttp,
    }
    if config.exec_user is not None and not config.token:
        raise ValueError("--exec-user serves /exec, which runs any command: it needs a token ($ENVKIT_TOKEN)")
    _guard_connections(config.limits)  # workers check again: each has descriptors of its own
    _end_with_parent()
    if config.workers == 1:
        workspace = untrusted.Workspace(config.exec_user, config.exec_dir) if config.exec_user is not None else None
        app = create_app(config.env, env_kwargs=config.env_kwargs, token=config.token, limits=config.limits,
                         workspace=workspace, mcp=config.mcp, loopback=is_loopback(config.host))
        # uvicorn shuts down gracefully, then raises the signal again with the handler it found. SIGTERM's default
        # would kill the process there, before asyncio.run cancels the loop's remaining tasks: what envs keep open for
        # the loop's life (code tools' sandbox pools, their local processes) would outlive the server. SIGINT's
        # handler ends the loop as Ctrl-C does.
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        uvicorn.run(app, **common)
        return
    if config.exec_user is not None:
        raise ValueError("--exec-user serves one workspace, so it needs --workers 1")
    probe = EnvServer(config.env, env_kwargs=config.env_kwargs, limits=config.limits)  # fail here, not in N workers
    if config.mcp:
        from envkit.remote.server.mcp import mcp_endpoint

        mcp_endpoint(probe, loopback=is_loopback(config.host))
    with tempfile.TemporaryDirectory(prefix="envkit-serve-") as run_dir:
        os.environ[_CONFIG_ENV] = json.dumps(config.to_json())
        os.environ[RUN_DIR_ENV] = run_dir
        if shared_key:
            os.environ[SNAPSHOT_KEY_ENV] = key
        try:
            uvicorn.run("envkit.remote.server.run:_app_from_environ", factory=True, workers=config.workers, **common)
        finally:
            os.environ.pop(_CONFIG_ENV, None)
            os.environ.pop(RUN_DIR_ENV, None)
            if shared_key:
                os.environ.pop(SNAPSHOT_KEY_ENV, None)
