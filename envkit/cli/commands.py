"""The ``envkit`` command line: list installed environments, inspect one, start a new one, serve one, and plugin
commands (``eval``, ``build``).

A plugin command is a function ``add_parser(subparsers)`` that adds its subparser and sets ``func(args, console)
-> int`` as its default; it is registered under the ``envkit.commands`` entry-point group.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import inspect
import json
import os
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

import envkit
from envkit.agents.untrusted import EXEC_USER_ENV
from envkit.cli.scaffold import KINDS, new_env
from envkit.distribution import install_hint
from envkit.errors import EnvkitError
from envkit.multi_agent import MultiAgentEnv
from envkit.registry import EnvSpec, _scheme
from envkit.tasks import task_counts

COMMAND_GROUP = "envkit.commands"


def _cmd_list(args: argparse.Namespace, console: Console) -> int:
    specs = envkit.list_envs()
    broken = envkit.broken_envs()
    if args.json:
        print(json.dumps({"envs": [s.to_json() for s in specs], "broken": [vars(b) for b in broken]}, indent=2))
        return 0
    table = Table(title="envkit environments", title_justify="left")
    for column in ("name", "package", "version", "description"):
        table.add_column(column, overflow="fold")
    for s in specs:
        table.add_row(s.name, s.package or "(registered in code)", s.version or "", s.description)
    console.print(table)
    if not specs:
        console.print("No environments installed. Try `pip install ./envs/arithmetic`.")
    for b in broken:
        console.print(f"[red]broken[/red] {b.name} ({b.source}): {b.error}", highlight=False)
    return 0


def _json_kwargs(text: str) -> dict[str, Any]:
    """A ``--kwargs`` option's JSON object."""
    try:
        kwargs = json.loads(text)
    except json.JSONDecodeError as e:
        raise EnvkitError(f"--kwargs is not JSON: {e}") from e
    if not isinstance(kwargs, dict):
        raise EnvkitError("--kwargs must be a JSON object, e.g. '{\"level\": 2}'")
    return kwargs


def _kwargs_in_effect(name: str, spec: EnvSpec) -> dict[str, Any]:
    """The kwargs the env was made with: a registered env's constructor defaults under the registered and given
    ones (a scheme's env, such as a URL's, has only those)."""
    if _scheme(name) is not None:
        return dict(spec.kwargs)
    params = inspect.signature(spec.load()).parameters.values()
    defaults = {p.name: p.default for p in params
                if p.default is not p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {**defaults, **spec.kwargs}


def _env_info(name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    env = envkit.make(name, **kwargs)
    spec = env.spec
    assert spec is not None  # make() always sets it
    try:
        return {
            "name": name,
            "description": spec.description,
            "entry_point": spec.entry_point,
            "package": spec.package,
            "version": spec.version,
            "kwargs": _kwargs_in_effect(name, spec),
            **_seats_and_tools(env),
            "tasks": task_counts(env),  # type: ignore[arg-type]
        }
    finally:
        asyncio.run(env.close())


def _seats_and_tools(env: envkit.Env | MultiAgentEnv) -> dict[str, Any]:
    """A single-agent env's tools and spaces; a multi-agent env's seats, each with its tools."""
    if isinstance(env, MultiAgentEnv):
        tools = {seat: [t.to_openai()["function"] for t in env.tools(seat)] for seat in env.seats}
        return {"seats": list(env.seats), "tools": [t for seat in env.seats for t in tools[seat]],
                "seat_tools": tools, "spaces": {"seats": ", ".join(env.seats) + ": each a chat of its own"}}
    return {"tools": [t.to_openai()["function"] for t in env.tools], "spaces": env.spaces()}


def _cmd_info(args: argparse.Namespace, console: Console) -> int:
    info = _env_info(args.name, _json_kwargs(args.kwargs))
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    console.print(f"[bold]{info['name']}[/bold] — {info['description']}", highlight=False)
    console.print(f"entry point: {info['entry_point']}   package: {info['package'] or '-'} {info['version'] or ''}")
    console.print(f"kwargs: {json.dumps(info['kwargs'], default=str)}", highlight=False)
    tasks = info["tasks"]
    console.print("tasks: " + (", ".join(f"{k}={v}" for k, v in tasks.items()) if tasks else "not enumerable"))
    if info.get("seats"):
        console.print(f"seats: {', '.join(info['seats'])} (a multi-agent env)")
    for key, value in info["spaces"].items():
        console.print(f"{key} space: {value}", highlight=False)
    if info["tools"]:
        table = Table(title="tools", title_justify="left")
        for column in ("name", "description", "parameters"):
            table.add_column(column, overflow="fold")
        for t in info["tools"]:
            table.add_row(t["name"], t["description"], json.dumps(t["parameters"].get("properties", {})))
        console.print(table)
    else:
        console.print("tools: none")
    return 0


def _cmd_check(args: argparse.Namespace, console: Console) -> int:
    from envkit.cli.check import check, failed
    from envkit.cli.check_seats import check_seats, has_seats

    kwargs = _json_kwargs(args.kwargs)
    checks = check_seats if has_seats(args.name, kwargs) else check  # a multi-agent env has rows of its own
    rows = checks(args.name, kwargs, seeds=args.seeds, max_steps=args.max_steps, serve=not args.no_serve)
    if args.json:
        print(json.dumps([vars(r) for r in rows], indent=2))
    else:
        style = {"pass": "green", "fail": "bold red", "skip": "yellow", "info": "cyan"}
        table = Table(title=f"envkit check {args.name}", title_justify="left")
        for column in ("check", "result", "detail"):
            table.add_column(column, overflow="fold")
        for r in rows:
            table.add_row(r.check, f"[{style[r.status]}]{r.status}[/]", r.detail)
        console.print(table)
    bad = failed(rows)
    if bad and not args.json:
        Console(stderr=True).print(f"[red]{len(bad)} check(s) failed:[/red] {', '.join(r.check for r in bad)}",
                                   highlight=False)
    return 1 if bad else 0


def _add_check_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check", help="conformance checks to run before publishing an env (exit 1 if one fails)",
        description="Play short scripted episodes and check the env contract, same seed -> same start, an "
                    "idempotent close, isolation between concurrent instances, the JSON round trip over ws:// "
                    "(envkit serve), disjoint task splits with string ids, rewards within reward_range; and report "
                    "reset latency and steps/s.")
    p.add_argument("name", help="env name as shown by `envkit list`, gym:<id>, a package.module:EnvClass, or a URL")
    p.add_argument("--kwargs", default="{}", metavar="JSON", help="JSON object of constructor kwargs")
    p.add_argument("--seeds", type=int, default=3, help="episodes started from seeds 0..N-1 (default 3), plus the "
                                                        "first 2 train tasks where the env lists tasks")
    p.add_argument("--max-steps", type=int, default=8, help="steps per episode at most (default 8)")
    p.add_argument("--no-serve", action="store_true", help="skip the ws:// round trip (starts envkit serve)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(func=_cmd_check)


def _cmd_replay(args: argparse.Namespace, console: Console) -> int:
    from envkit.recording import replay

    if not args.file.is_file():
        raise EnvkitError(f"no recording at {args.file}")
    kwargs = None if args.kwargs is None else _json_kwargs(args.kwargs)
    results = asyncio.run(replay(args.file, make=envkit.make, env=args.env, kwargs=kwargs, only=args.episode,
                                 ignore_info=args.ignore_info))
    if not results:
        raise EnvkitError(f"{args.file} holds no episode" + (" with those ids" if args.episode else ""))
    if args.json:
        print(json.dumps([vars(r) for r in results], indent=2))
    else:
        table = Table(title=f"envkit replay {args.file}", title_justify="left")
        for column in ("episode", "env", "start", "steps", "result"):
            table.add_column(column, overflow="fold")
        for r in results:
            verdict = "[green]same[/]" if r.difference is None else f"[bold red]differs[/] at {r.difference}"
            table.add_row(r.episode, r.env, r.start, str(r.steps), verdict)
        console.print(table)
    differ = [r for r in results if r.difference is not None]
    if differ and not args.json:
        Console(stderr=True).print(f"[red]{len(differ)} of {len(results)} episode(s) went otherwise than "
                                   "recorded[/red]", highlight=False)
    return 1 if differ else 0


def _add_replay_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "replay", help="play recorded episodes again against their env and name where they differ (exit 1 if one "
                       "does)",
        description="Play each episode of a recording (envkit.make(name, record=FILE), or +env.kwargs.record=FILE "
                    "in a training run) again in a fresh env made as recorded: the recorded seed or task, then the "
                    "recorded actions. Each answer (messages, reward, end flags, info) is compared with the "
                    "recorded one, and the first that differs is named with its step. A restored snapshot's "
                    "episode replays from its parent's start.",
        epilog="examples:\n  envkit replay runs/episodes.jsonl\n"
               "  envkit replay runs/episodes.jsonl --episode 3f2a9c0d1e4b5a6f --ignore-info elapsed_s\n\n"
               "To play a recording back without its env (tests, offline data): envkit.make(\"replay:FILE\").",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("file", type=Path, metavar="FILE", help="a recording (JSONL)")
    p.add_argument("--episode", action="append", default=[], metavar="ID", help="replay only this episode "
                                                                                "(repeatable)")
    p.add_argument("--env", help="replay against this env instead of the recorded one (with --kwargs)")
    p.add_argument("--kwargs", metavar="JSON", help="constructor kwargs instead of the recorded ones")
    p.add_argument("--ignore-info", action="append", default=[], metavar="KEY",
                   help="an info key whose value may differ, such as a timing (repeatable)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(func=_cmd_replay)


def _cmd_new(args: argparse.Namespace, console: Console) -> int:
    target = new_env(args.name, kind=args.kind, parent=args.dir)
    shown = os.path.relpath(target)
    files = "\n".join(f"  {os.path.relpath(p)}" for p in sorted(target.rglob("*")) if p.is_file())
    # markup=False: "[test]" is an extra, not a rich style.
    console.print(f"Created {shown}/ (--kind {args.kind}):\n{files}\n"
                  f"Next:\n  cd {shown}\n  pip install -e '.[test]'\n  pytest\n  envkit info {args.name}\n"
                  f"  envkit check {args.name}\n"
                  f"Then {os.path.join(shown, 'README.md')} shows how to serve, build, eval and train it.",
                  markup=False, highlight=False)
    return 0


def _add_new_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "new", help="start a new environment package: env class, tasks, tests and README, ready to edit",
        description="Write NAME/, an env package that passes its own tests as generated:\n"
                    "  pyproject.toml        registers the env as NAME (entry point group envkit.envs)\n"
                    "  MODULE/env.py         the env class, its train/test tasks, docstrings on what to change\n"
                    "  tests/test_MODULE.py  tests of reset, step, rewards and tasks\n"
                    "  README.md             how to install, test, serve, build, eval and train it\n"
                    "MODULE is NAME with '-' as '_'. Existing files are never overwritten.",
        epilog="kinds:\n"
               "  single  one question, one graded answer (envkit.Env)\n"
               "  multi   several turns, a reward for each; terminated vs truncated (envkit.Env)\n"
               "  tool    the model calls tools defined with @envkit.tool, then answers (envkit.ToolEnv)\n\n"
               "examples:\n  envkit new word-count\n  envkit new sokoban --kind multi --dir ~/envs\n"
               "  envkit new shop --kind tool",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("name", metavar="NAME", help="env, distribution and directory name: lowercase letters and "
                                               "digits, words joined by '-' or '_'")
    p.add_argument("--kind", choices=tuple(KINDS), default="single",
                   help="the kind of episode to start from (default: single)")
    p.add_argument("--dir", type=Path, default=Path("."), metavar="PATH",
                   help="where to create NAME/ (default: the current directory)")
    p.set_defaults(func=_cmd_new)


def _cmd_serve(args: argparse.Namespace, console: Console) -> int:
    try:
        from envkit.remote import TOKEN_ENV
        from envkit.remote.server import ServeConfig, ServerLimits, serve
    except ImportError as e:
        console.print(f"[red]error:[/red] envkit serve needs the server extra: {install_hint('server')} ({e})")
        return 2
    env_kwargs = _json_kwargs(args.kwargs)
    try:
        limits = ServerLimits(max_sessions=args.max_sessions, session_ttl_s=args.session_ttl,
                              step_timeout_s=args.step_timeout, max_request_bytes=args.max_request_bytes,
                              max_connections=args.max_connections, request_timeout_s=args.request_timeout,
                              idle_timeout_s=args.idle_timeout)
    except ValueError as e:
        console.print(f"[red]error:[/red] {e}", highlight=False)
        return 2
    exec_user = args.exec_user if args.exec_user is not None else os.environ.get(EXEC_USER_ENV) or None
    if exec_user is not None and not str(exec_user).isdigit():
        console.print(f"[red]error:[/red] ${EXEC_USER_ENV} must be a uid (a number), got {exec_user!r}",
                      highlight=False)
        return 2
    try:
        config = ServeConfig(env=args.name, env_kwargs=env_kwargs, host=args.host, port=args.port,
                             token=args.token or os.environ.get(TOKEN_ENV) or None, limits=limits,
                             workers=args.workers, log_level=args.log_level,
                             exec_user=int(exec_user) if exec_user is not None else None, exec_dir=args.exec_dir,
                             mcp=args.mcp)
    except ValueError as e:
        console.print(f"[red]error:[/red] {e}", highlight=False)
        return 2
    if args.mcp and importlib.util.find_spec("mcp") is None:
        console.print(f"[red]error:[/red] --mcp needs the MCP SDK: {install_hint('mcp')}", highlight=False)
        return 2
    auth = "bearer token" if config.token else "no auth"
    mcp = f", MCP at http://{args.host}:{args.port}/mcp" if args.mcp else ""
    Console(stderr=True).print(f"envkit serve {args.name} on http://{args.host}:{args.port} ({auth}, "
                               f"{args.workers} worker(s){mcp}); Ctrl-C to stop", highlight=False, soft_wrap=True)
    try:
        serve(config)
    except (PermissionError, ValueError) as e:
        console.print(f"[red]error:[/red] {e}", highlight=False)
        return 2
    return 0


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="serve an environment over REST and WebSocket (sessions, auth, limits, /metrics)",
        description="Serve one environment to remote clients: envkit.make('http://HOST:PORT/NAME') or "
                    "'ws://HOST:PORT/NAME' gives a RemoteEnv. Each session owns its env instance. Routes: "
                    "/health, /info, /metrics, /docs, /sessions (REST) and /ws (one session per WebSocket).",
        epilog="examples:\n  envkit serve arithmetic --port 8000\n"
               "  ENVKIT_TOKEN=secret envkit serve calculator --host 0.0.0.0 --max-sessions 512\n"
               "  envkit serve calculator --mcp    # also its calculator tool for any MCP client at /mcp\n"
               "  envkit serve my_pkg.envs:MyEnv --kwargs '{\"level\": 2}'",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("name", help="env name as shown by `envkit list`, or a package.module:EnvClass entry point")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; other addresses need --token)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    p.add_argument("--token", default=None,
                   help="bearer token required on every route but /health (default: $ENVKIT_TOKEN; prefer the "
                        "variable, command lines are visible to other users)")
    p.add_argument("--kwargs", default="{}", help="JSON object of env constructor defaults for every session")
    p.add_argument("--max-sessions", type=int, default=256,
                   help="concurrent sessions; one more answers 503 capacity (default 256)")
    p.add_argument("--session-ttl", type=float, default=600.0, metavar="SECONDS",
                   help="close a session (and its env) after this long idle (default 600)")
    p.add_argument("--step-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="longest env init/reset/step/close; past it the request answers 504 env_timeout (default 60)")
    p.add_argument("--max-request-bytes", type=int, default=1 << 20,
                   help="largest request body or WebSocket frame (default 1 MiB)")
    p.add_argument("--max-connections", type=int, default=4096,
                   help="open connections per process; one more answers 503 and is closed (default 4096, lowered "
                        "with a warning where `ulimit -n` cannot hold them)")
    p.add_argument("--request-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="a request's headers and body must arrive within this; past it 408 and the connection "
                        "closes (default 10)")
    p.add_argument("--idle-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="close a WebSocket that holds no session after this long without a frame (default 60; "
                        "one with a session gets --session-ttl)")
    p.add_argument("--workers", type=int, default=1,
                   help="worker processes sharing the port; sessions live in one process, so with more than one "
                        "only WebSocket sessions are served (default 1)")
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"),
                   help="server log level (default warning; env crashes are logged as errors)")
    p.add_argument("--exec-user", type=int, default=None, metavar="UID",
                   help="also serve /exec and /exec/scrub, running commands as this uid in --exec-dir (what sandbox "
                        f"containers do; needs root with CAP_SETUID/SETGID/KILL; default: ${EXEC_USER_ENV})")
    p.add_argument("--exec-dir", default="/work", help="where /exec commands run (default /work)")
    p.add_argument("--mcp", action="store_true",
                   help="also serve the env's tools as an MCP server (streamable HTTP at /mcp, behind the same token): "
                        "each tool call runs in a fresh env instance; needs a ToolEnv and the mcp extra")
    p.set_defaults(func=_cmd_serve)


def _add_plugin_commands(sub: argparse._SubParsersAction, console: Console) -> None:
    """Subcommands from other packages (``envkit eval`` lives in ``generators``): envkit imports none of them,
    they register through the ``envkit.commands`` entry-point group as ``name = "module:add_parser"``."""
    for ep in entry_points(group=COMMAND_GROUP):
        try:
            add_parser = ep.load()
        except Exception as e:  # a broken plugin must not take the core commands down with it
            console.print(f"[yellow]warning:[/yellow] envkit command {ep.name!r} failed to load: "
                          f"{type(e).__name__}: {e}", highlight=False)
            continue
        add_parser(sub)


def build_parser(console: Console | None = None) -> argparse.ArgumentParser:
    """The argument parser for ``envkit``, including plugin subcommands."""
    parser = argparse.ArgumentParser(
        prog="envkit",
        description="Environments for training LLM agents with RL. Envs are pip packages found by name.",
    )
    parser.add_argument("--version", action="version", version=f"envkit {envkit.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p_list = sub.add_parser("list", help="list installed environments (name, package, version, description)")
    p_list.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p_list.set_defaults(func=_cmd_list)

    p_info = sub.add_parser("info", help="show one environment: tools, task counts, spaces, the kwargs it is made with")
    p_info.add_argument("name", help="env name as shown by `envkit list`, gym:<gymnasium id>, or a served env's URL")
    p_info.add_argument("--kwargs", default="{}", metavar="JSON",
                        help="JSON object of constructor kwargs over the defaults, e.g. '{\"level\": 3}': the task "
                             "counts and tools shown are those of the env made with them")
    p_info.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p_info.set_defaults(func=_cmd_info)
    _add_check_parser(sub)
    _add_replay_parser(sub)
    _add_new_parser(sub)
    _add_serve_parser(sub)
    _add_plugin_commands(sub, console or Console(stderr=True))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``envkit`` console script."""
    console = Console()
    args = build_parser(Console(stderr=True)).parse_args(argv)
    try:
        return args.func(args, console)
    except EnvkitError as e:
        Console(stderr=True).print(f"[red]error:[/red] {e}", highlight=False)
        return 2


if __name__ == "__main__":
    sys.exit(main())
