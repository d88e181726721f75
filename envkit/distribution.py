"""The name envkit is published under. The import name is ``envkit``; the distribution is ``envkit-rl``, because
``envkit`` on the Python package index is an unrelated project (an environment-variable parser): a requirement on
``envkit`` would install that."""

DISTRIBUTION = "envkit-rl"


def install_hint(extra: str) -> str:
    """The pip command that installs envkit with ``extra``."""
    return f"pip install '{DISTRIBUTION}[{extra}]'"
