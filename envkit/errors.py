"""Every exception envkit raises, split by whose fault it is.

The split tells a caller what to do: a contract error is a bug in the calling code (crash), an env error is a
fault inside one environment (record it on that rollout, keep the batch), a registry error is a setup problem
(fix the install or the name).

    EnvkitError
    ├── RegistryError            setup: names, packages, entry points
    │   ├── EnvNotFoundError     unknown name (carries close-match suggestions)
    │   ├── EnvLoadError         an env package failed to import or construct
    │   ├── DuplicateEnvError    two sources claim one name
    │   └── InvalidEnvNameError  a name that breaks the name grammar
    ├── ScaffoldError            setup: `envkit new` got a name it cannot use or a directory it would overwrite
    ├── ContractError            the caller misused the Env API
    │   ├── ResetNeededError     step() before reset()
    │   ├── EpisodeDoneError     step() after terminated/truncated
    │   ├── EnvClosedError       reset()/step() after close()
    │   ├── InvalidActionError   the action is not an assistant message
    │   └── InvalidTaskError     reset(task=...) got a task the env cannot use
    ├── SnapshotError            an env's state cannot be saved or restored: it holds resources it does not say how
    │                            to save, or the snapshot is of another kind of env, or forged
    ├── ToolCallError            the model's tool call cannot run (unknown tool, bad arguments, the tool failed):
    │                            a ToolEnv answers the model with the message, nothing crashed
    ├── EnvError                 the environment itself misbehaved
    │   ├── InvalidStepResultError  step()/reset() returned the wrong shape
    │   ├── MCPServerError       an MCP server behind an env could not be started or reached, or dropped the
    │   │                        connection (envkit.integrations.mcp_env)
    │   └── AgentProcessError    an agent env's command exited non-zero or ran past its deadline (envkit.agents.agent)
    └── RemoteEnvError           an env server (envkit serve, OpenEnv) refused a request or could not be reached;
        │                        ``.code`` is the server's error code, ``.status`` the HTTP status (None: no answer)
        ├── RemoteConnectionError       no connection after the retries (nothing was sent)
        ├── RemoteResetNeededError      also a ResetNeededError     (code reset_needed)
        ├── RemoteEpisodeDoneError      also an EpisodeDoneError    (code episode_done)
        ├── RemoteInvalidActionError    also an InvalidActionError  (code invalid_action)
        ├── RemoteInvalidTaskError      also an InvalidTaskError    (code invalid_task)
        ├── RemoteSnapshotError         also a SnapshotError        (codes invalid_snapshot, snapshot_unsupported)
        └── RemoteEnvCrashError         also an EnvError: the env raised or hung on the server
                                        (codes env_error, env_timeout)
"""

from __future__ import annotations

from collections.abc import Sequence


class EnvkitError(Exception):
    """Base class of every envkit exception."""


class RegistryError(EnvkitError):
    """A problem with env names, registration or installed env packages."""


class EnvNotFoundError(RegistryError, KeyError):
    """No environment is registered under the requested name."""

    def __init__(self, name: str, suggestions: Sequence[str] = (), *, fix: str | None = None) -> None:
        self.name = name
        self.suggestions = list(suggestions)
        hint = f" Did you mean: {', '.join(repr(s) for s in self.suggestions)}?" if self.suggestions else ""
        if fix is None:
            fix = "Run `envkit list` to see installed envs, or `pip install` the package that provides it."
        super().__init__(f"No environment named {name!r}.{hint} {fix}")

    def __str__(self) -> str:
        # KeyError.__str__ would wrap the message in quotes.
        return str(self.args[0])


class EnvLoadError(RegistryError):
    """An environment's package or class could not be imported or constructed."""


class DuplicateEnvError(RegistryError):
    """Two different sources register the same environment name."""


class InvalidEnvNameError(RegistryError, ValueError):
    """An environment name does not follow the name grammar."""


class ScaffoldError(EnvkitError, ValueError):
    """``envkit new`` cannot write the package: a bad or taken name, an existing directory, no envkit distribution."""


class ContractError(EnvkitError):
    """The caller used the Env API out of order or with a malformed argument."""


class ResetNeededError(ContractError):
    """step() was called before the first reset()."""


class EpisodeDoneError(ContractError):
    """step() was called after the episode terminated or was truncated."""


class EnvClosedError(ContractError):
    """reset() or step() was called after close()."""


class InvalidActionError(ContractError, ValueError):
    """The action passed to step() is not a well-formed assistant message."""


class InvalidTaskError(ContractError, ValueError):
    """reset(task=...) got a task that does not have the fields and types the env needs."""


class SnapshotError(EnvkitError):
    """An env's state could not be snapshotted or restored (see ``Env.snapshot``): the env holds something that is
    not plain data and does not override ``snapshot``/``restore``, or the snapshot was taken of another kind of env,
    or a server's snapshot token is forged or another server's."""


class ToolCallError(EnvkitError):
    """A tool call the model made cannot run: unknown tool, bad arguments, or the tool itself failed.

    The model's mistake, not a fault of the env: :meth:`envkit.ToolEnv.call_tool` answers it with a ``tool`` message
    reading ``Error: <message>`` and the episode goes on.
    """


class ToolTimeoutError(ToolCallError):
    """A tool call ran past its time limit; answered like any :class:`ToolCallError`, counted as a timeout."""


class EnvError(EnvkitError):
    """The environment implementation itself failed or misbehaved."""


class InvalidStepResultError(EnvError, TypeError):
    """reset() or step() returned a value that does not follow the contract."""


class MCPServerError(EnvError):
    """The MCP server an env gets its tools from could not be started or reached, did not finish the handshake in
    time, or dropped the connection; the rollout fails (a tool's own failure is a :class:`ToolCallError`)."""


class RubricError(EnvError):
    """A rubric could not score an episode (a judge that failed or answered without a score): the rollout fails,
    never scored a silent 0."""


class AgentProcessError(EnvError):
    """An agent env's command (:class:`envkit.agents.agent.Command`) exited non-zero or ran past its deadline; it and
    every process it started were killed, and that rollout fails."""


class RemoteEnvError(EnvkitError):
    """An env server answered a request with an error, or could not be reached.

    ``code`` is the server's machine-readable error code (``capacity``, ``session_not_found``, ...), ``status`` the
    HTTP status of the answer, or None when there was none (connection failures, timeouts).
    """

    def __init__(self, message: str, *, code: str, status: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.status = status

    def __str__(self) -> str:
        where = f"HTTP {self.status}, " if self.status is not None else ""
        return f"{self.args[0]} ({where}code {self.code})"


class RemoteConnectionError(RemoteEnvError, ConnectionError):
    """The env server could not be reached, even after retrying with backoff; the request was never sent."""


class RemoteResetNeededError(RemoteEnvError, ResetNeededError):
    """The server refused step(): the session has no active episode (never reset, or its last step failed)."""


class RemoteEpisodeDoneError(RemoteEnvError, EpisodeDoneError):
    """The server refused step(): the episode already terminated or was truncated."""


class RemoteInvalidActionError(RemoteEnvError, InvalidActionError):
    """The server refused the action: it is not a well-formed assistant message."""


class RemoteInvalidTaskError(RemoteEnvError, InvalidTaskError):
    """The server's env refused the task passed to reset()."""


class RemoteSnapshotError(RemoteEnvError, SnapshotError):
    """The server could not snapshot its env, or refused a snapshot token to restore."""


class RemoteEnvCrashError(RemoteEnvError, EnvError):
    """The env raised, hung past the step timeout, or broke the contract on the server; the server stays up."""
