"""``envkit serve``: the server side of remote envs (see :mod:`.app`)."""

from envkit.remote.server.app import (
    TOKEN_ENV,
    EnvServer,
    RedactSecrets,
    ServeConfig,
    ServerLimits,
    create_app,
    is_loopback,
    serve,
)

__all__ = ["TOKEN_ENV", "EnvServer", "RedactSecrets", "ServeConfig", "ServerLimits", "create_app", "is_loopback",
           "serve"]
