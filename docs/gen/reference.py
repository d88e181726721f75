"""The site's generated reference pages (a mkdocs-gen-files script): the Python API, the ``envkit`` CLI and the
``python -m trainer`` configuration, each written from the code at build time so that it cannot drift from it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import os
import sys
import textwrap
import typing
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import mkdocs_gen_files

from trainer import CONF_DIR

sys.path.insert(0, str(Path(__file__).resolve().parent))
from griffe_roles import to_markdown

API: dict[str, list[str]] = {
    "envkit": ["envkit", "envkit.multi_agent", "envkit.table", "envkit.errors", "envkit.registry", "envkit.tasks",
               "envkit.rewards.rubrics",
               "envkit.rewards.judges", "envkit.remote.client", "envkit.integrations.gym_bridge",
               "envkit.integrations.mcp_env", "envkit.integrations.trl"],
    "generators": ["generators", "generators.seats", "generators.parsers", "generators.reward_model"],
    "trainer": ["trainer", "trainer.algorithms"],
    "sandboxes": ["sandboxes", "sandboxes.docker", "sandboxes.pool", "sandboxes.tools", "sandboxes.agent"],
}
"""Each API page (a package) and the modules it documents: the package's public names, then the modules a user
imports from directly."""

API_INTRO = {
    "envkit": "The protocol: the Env contract, messages, tools, the registry, and the rooms users import from.",
    "generators": "Rollouts: inference engines, the Generator, trajectories, parsers and reward models.",
    "trainer": "Training from Python: `trainer.run(overrides)` is `python -m trainer OVERRIDES`. Every setting is "
               "in the [configuration reference](../config.md).",
    "sandboxes": "Containers for envs, untrusted code and agents: sandboxes, warm pools, code tools.",
}


def api_page(package: str) -> str:
    """The API page of ``package``: a mkdocstrings block per module."""
    parts = [f"# `{package}`\n", API_INTRO[package] + "\n"]
    for module in API[package]:
        if module != package:
            parts.append(f"## `{module}`\n")
        heading = 2 if module == package else 3
        parts.append(f"::: {module}\n    options:\n      show_root_heading: {str(module != package).lower()}\n"
                     f"      show_root_toc_entry: false\n      heading_level: {heading}\n")
    return "\n".join(parts)


# -- the envkit CLI -------------------------------------------------------------------------------------------------


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, tuple[str, argparse.ArgumentParser]]:
    """Each subcommand of ``parser``: its name, its one-line help and its parser."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            return {name: (helps.get(name, ""), sub) for name, sub in action.choices.items()}
    return {}


def cli_page() -> str:
    """The ``envkit`` command's reference: every subcommand (plugins included) with its ``--help``."""
    from envkit.cli.commands import COMMAND_GROUP, build_parser

    os.environ["COLUMNS"] = "110"  # argparse wraps to the terminal: the page is the same on every machine
    parser = build_parser()
    parser.prog = "envkit"
    subcommands = _subcommands(parser)
    missing = [ep.name for ep in entry_points(group=COMMAND_GROUP) if ep.name not in subcommands]
    if missing:  # a plugin that failed to import would leave its command off the page
        raise SystemExit(f"envkit commands that did not load, so cannot be documented: {missing}")
    lines = ["# The `envkit` command\n",
             "Every subcommand and option, from the parsers themselves (`envkit --help`, `envkit COMMAND --help`). "
             f"Packages add subcommands through the `{COMMAND_GROUP}` entry-point group: `eval` and `judge-check` "
             "come from `generators`, `build` from `sandboxes`. `python -m envkit.cli` is the same command where "
             "the console script is not on `PATH`.\n",
             "| command | what it does |", "|---|---|"]
    lines += [f"| [`envkit {name}`](#envkit-{name}) | {help_} |" for name, (help_, _) in subcommands.items()]
    lines += ["", "```text", parser.format_help().rstrip(), "```", ""]
    for name, (help_, sub) in subcommands.items():
        sub.prog = f"envkit {name}"
        lines += [f"## `envkit {name}` {{#envkit-{name}}}\n", f"{help_}\n" if help_ else "",
                  "```text", sub.format_help().rstrip(), "```", ""]
    return "\n".join(lines)


# -- the configuration ----------------------------------------------------------------------------------------------


def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass's fields, through its bases (the first line of each)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body  # type: ignore[attr-defined]
        for node, after in zip(body, [*body[1:], None], strict=True):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
                docs[node.target.id] = to_markdown(" ".join(inspect.cleandoc(after.value.value).split()))
    return docs


def _type_name(hint: Any) -> str:
    text = hint.__name__ if isinstance(hint, type) else str(hint)
    return text.replace("typing.", "").replace("trainer.config.", "").replace("NoneType", "None").replace(" | ", " or ")


def _value(value: Any) -> str:
    """A default as an override writes it: ``[a, b]``, ``{k: v}``, ``null``, ``true``."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_value(v)}" for k, v in value.items()) + "}"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def config_keys(cls: type, composed: Any, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """Every key under ``cls``: (dotted key, type, default as composed, doc line), sections before their keys."""
    rows: list[tuple[str, str, str, str]] = []
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    # a section's own keys first, then its subsections: each section's keys are one table
    for f in sorted(dataclasses.fields(cls), key=lambda f: dataclasses.is_dataclass(hints[f.name])):
        key, value = prefix + f.name, getattr(composed, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            class_doc = " ".join(inspect.cleandoc(hints[f.name].__doc__ or "").split("\n\n")[0].split())
            rows.append((key, "section", "", docs.get(f.name, "") or class_doc))
            rows += config_keys(hints[f.name], value, key + ".")
        else:
            rows.append((key, _type_name(hints[f.name]), _value(value), docs.get(f.name, "")))
    return rows


def config_page() -> str:
    """The configuration reference: every key of ``python -m trainer``, its type, default and doc, and each group."""
    import trainer
    from trainer.config import REFUSED, Config

    rows = config_keys(Config, trainer.compose([]))
    undocumented = [key for key, kind, _, doc in rows if not doc and kind != "section"]
    if undocumented:
        raise SystemExit(f"config keys without a doc line (an attribute docstring in the config dataclass): "
                         f"{undocumented}")
    lines = ["# Configuration reference\n",
             "`python -m trainer` is a [Hydra](https://hydra.cc) app: every setting below is an override "
             "(`python -m trainer trainer.steps=50 algorithm=dr_grpo`), and `python -m trainer --cfg job` prints "
             "the composed config. The defaults are `trainer/conf/config.yaml` over the config dataclasses of "
             "`trainer/config.py`, which check every value before anything starts (`config error: ...`). "
             "This page is generated from both.\n",
             "Keys that hold a dict or list of your own (`env.kwargs`, `env.tasks.columns`) take new entries "
             "with a `+`: `+env.kwargs.level=3`.\n"]
    section = ""
    for key, kind, default, doc in rows:
        if kind == "section":
            section = key
            lines += ["", f"## `{key}`\n", f"{doc}\n", "| key | type | default | what it sets |", "|---|---|---|---|"]
            continue
        if not section or not key.startswith(section + "."):
            if section or not lines[-1].startswith("|"):
                lines += ["", "## Top level\n", "| key | type | default | what it sets |", "|---|---|---|---|"]
            section = ""
        default, doc = default.replace("|", "\\|"), doc.replace("|", "\\|")
        lines.append(f"| `{key}` | `{kind}` | `{default}` | {doc} |")
    lines += ["", "## Combinations refused\n",
              "Each section checks its own values; then a run refuses these combinations before anything starts, "
              "in this order, with the reason as its `config error`. This table is `trainer.config.REFUSED`; "
              "*not built yet* marks a combination that could work and awaits its code, the others cannot work as "
              "asked.\n",
              "| settings | why | |", "|---|---|---|"]
    lines += [f"| {r.when} | {r.why} | {'not built yet' if r.unbuilt else ''} |" for r in REFUSED]
    lines += ["", "## Config groups\n",
              "A group is chosen by name (`algorithm=ppo`, `+recipe=tool_agent`): its file sets the keys it lists "
              "over the defaults, and later overrides win.\n"]
    for group in sorted(p for p in CONF_DIR.iterdir() if p.is_dir()):
        lines.append(f"### `{group.name}`\n")
        for option in sorted(group.glob("*.yaml")):
            lines += [f"`{group.name}={option.stem}`" if group.name != "recipe" else f"`+recipe={option.stem}`",
                      "", "```yaml", option.read_text().strip(), "```", ""]
    return "\n".join(lines)


PAGES = {"reference/cli.md": cli_page, "reference/config.md": config_page,
         **{f"reference/api/{package}.md": (lambda package=package: api_page(package)) for package in API}}


# mkdocs-gen-files runs this file for each build: every page goes into the site being built
for path, page in PAGES.items():
    with mkdocs_gen_files.open(path, "w") as out:
        out.write(page())
