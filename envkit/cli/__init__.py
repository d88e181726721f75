"""The ``envkit`` command line: :mod:`envkit.cli.commands` builds the parser and runs the commands (``list``, ``info``,
``check``, ``replay``, ``new``, ``serve`` and those other packages add through ``envkit.commands``);
:mod:`envkit.cli.check` is ``envkit check`` (an env's contract, played), :mod:`envkit.cli.scaffold` is ``envkit new``
(a new env package, rendered from ``templates/``). The console script is ``envkit.cli:main``."""

from envkit.cli.commands import build_parser, main

__all__ = ["build_parser", "main"]
