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
    ├── ContractError            the caller misused the Env API
    │   ├── ResetNeededError     step() before reset()
    │   ├── EpisodeDoneError     step() after terminated/truncated
    │   ├── EnvClosedError       reset()/step() after close()
    │   └── InvalidActionError   the action is not an assistant message
    └── EnvError                 the environment itself misbehaved
        └── InvalidStepResultError  step()/reset() returned the wrong shape
"""

from __future__ import annotations

from collections.abc import Sequence


class EnvkitError(Exception):
    """Base class of every envkit exception."""


class RegistryError(EnvkitError):
    """A problem with env names, registration or installed env packages."""


class EnvNotFoundError(RegistryError, KeyError):
    """No environment is registered under the requested name."""

    def __init__(self, name: str, suggestions: Sequence[str] = ()) -> None:
        self.name = name
        self.suggestions = list(suggestions)
        hint = f" Did you mean: {', '.join(repr(s) for s in self.suggestions)}?" if self.suggestions else ""
        super().__init__(
            f"No environment named {name!r}.{hint} "
            "Run `envkit list` to see installed envs, or `pip install` the package that provides it."
        )

    def __str__(self) -> str:
        # KeyError.__str__ would wrap the message in quotes.
        return str(self.args[0])


class EnvLoadError(RegistryError):
    """An environment's package or class could not be imported or constructed."""


class DuplicateEnvError(RegistryError):
    """Two different sources register the same environment name."""


class InvalidEnvNameError(RegistryError, ValueError):
    """An environment name does not follow the name grammar."""


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


class EnvError(EnvkitError):
    """The environment implementation itself failed or misbehaved."""


class InvalidStepResultError(EnvError, TypeError):
    """reset() or step() returned a value that does not follow the contract."""
