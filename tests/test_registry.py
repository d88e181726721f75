"""Registry and discovery: names, make/overrides, suggestions, duplicates, and real pip-installed env packages
selected by name in fresh subprocesses (including a broken package that must not hide the others)."""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import pytest

import envkit
from envkit import ContractChecker, Env, EnvSpec, Registry, StepResult
from envkit.errors import DuplicateEnvError, EnvLoadError, EnvNotFoundError, InvalidEnvNameError

registry_module = importlib.import_module("envkit.registry")  # envkit.registry is the default Registry

BUNDLED_ENVS = {
    "arithmetic": "envkit-arithmetic",
    "calculator": "envkit-calculator",
    "guess-number": "envkit-guess-number",
    "frozenlake": "envkit-frozenlake",
    "referential": "envkit-referential",
    "duel": "envkit-duel",
}


class EchoEnv(Env):
    """Echoes the action back."""

    def __init__(self, prefix: str = "", repeat: int = 1) -> None:
        self.prefix, self.repeat = prefix, repeat

    async def reset(self, *, seed=None, task=None):
        return [envkit.user("say something")], {}

    async def step(self, action):
        return StepResult([envkit.user(self.prefix + action["content"] * self.repeat)], terminated=True)


@pytest.fixture
def reg() -> Registry:
    return Registry(group="envkit.test-no-such-group")


def test_register_make_with_defaults_and_overrides(reg):
    reg.register("echo", EchoEnv, prefix=">", repeat=2)
    env = reg.make("echo", repeat=3)
    assert isinstance(env, ContractChecker) and isinstance(env.unwrapped, EchoEnv)
    assert (env.unwrapped.prefix, env.unwrapped.repeat) == (">", 3)
    assert env.spec.kwargs == {"prefix": ">", "repeat": 3} and env.spec.description == "Echoes the action back."
    assert reg.spec("echo").kwargs == {"prefix": ">", "repeat": 2}  # the registered defaults are untouched
    assert not isinstance(reg.make("echo", checked=False), ContractChecker)


def test_an_env_ref_makes_its_env_and_round_trips_as_json():
    ref = envkit.EnvRef(f"{__name__}:EchoEnv", {"prefix": ">", "repeat": 2}, label="echo")
    env = ref.make()
    assert isinstance(env, ContractChecker) and (env.unwrapped.prefix, env.unwrapped.repeat) == (">", 2)
    assert not isinstance(ref.make(checked=False), ContractChecker)
    assert ref.to_json() == {"name": f"{__name__}:EchoEnv", "kwargs": {"prefix": ">", "repeat": 2}, "sandbox": None,
                             "label": "echo"}
    assert envkit.EnvRef(**json.loads(json.dumps(ref.to_json()))) == ref


@pytest.mark.parametrize(("name", "label", "shown"), [
    ("arithmetic", None, "arithmetic"), ("arithmetic", "sums", "sums"), ("gym:Blackjack-v1", None, "Blackjack-v1"),
    ("openenv:http://127.0.0.1:1", None, "openenv"), ("ws://127.0.0.1:1/arithmetic", None, "arithmetic"),
    ("http://127.0.0.1:1/", None, "remote"), ("my_pkg.envs:MazeEnv", None, "MazeEnv"),
])
def test_an_env_refs_display_name(name, label, shown):
    assert envkit.EnvRef(name, label=label).display_name == shown


@pytest.mark.parametrize(("make_ref", "message"), [
    (lambda: envkit.EnvRef(""), "non-empty string"),
    (lambda: envkit.EnvRef("arithmetic", {"not valid": 1}), "'not valid' is not a valid Python identifier"),
    (lambda: envkit.EnvRef("arithmetic", {"sandbox": "docker", "level": 1}), "sandbox cannot be env kwargs"),
    (lambda: envkit.EnvRef("arithmetic", pool=object()), "a warm pool but no sandbox"),
])
def test_an_env_ref_refuses_what_make_could_not_take(make_ref, message):
    with pytest.raises(ValueError, match=message):
        make_ref()


def test_a_pool_without_a_sandbox_and_the_old_pool_option_are_refused():
    with pytest.raises(TypeError, match="needs sandbox="):
        envkit.make("arithmetic", pool=object())
    with pytest.raises(TypeError, match=r"a warm pool is make\(\)'s pool="):
        envkit.make("arithmetic", sandbox="local", sandbox_options={"pool": object()})


def test_register_by_entry_point_string_and_spec_json_round_trip(reg):
    spec = reg.register("echo-str", f"{__name__}:EchoEnv", description="by string", prefix="#")
    again = EnvSpec.from_json(json.loads(json.dumps(spec.to_json())))
    assert again == spec and again.entry_point == f"{__name__}:EchoEnv"
    assert isinstance(reg.make("echo-str").unwrapped, EchoEnv)


def test_unknown_name_suggests_close_matches(reg):
    reg.register("guess-number", EchoEnv)
    reg.register("arithmetic", EchoEnv)
    with pytest.raises(EnvNotFoundError) as e:
        reg.make("arithmetc")
    assert e.value.suggestions == ["arithmetic"]
    assert "Did you mean: 'arithmetic'?" in str(e.value) and "envkit list" in str(e.value)
    with pytest.raises(EnvNotFoundError) as e:
        reg.make("Guess-Numbr")
    assert e.value.suggestions == ["guess-number"]
    with pytest.raises(EnvNotFoundError) as e:
        reg.make("zzz")
    assert e.value.suggestions == [] and "Did you mean" not in str(e.value)


@pytest.mark.parametrize("bad", ["", "-lead", "has space", "a/b/c", "http://x/y", "ünïcode"])
def test_invalid_names_are_rejected(reg, bad):
    with pytest.raises(InvalidEnvNameError, match="Invalid env name"):
        reg.register(bad, EchoEnv)


def test_duplicate_registration_names_both_sources_but_identical_reregistration_is_fine(reg):
    reg.register("echo", EchoEnv)
    assert reg.register("echo", EchoEnv) is reg.spec("echo")
    with pytest.raises(DuplicateEnvError, match=r"registered twice: by register\(\) at .*test_registry.py"):
        reg.register("echo", "other.module:Env")


def test_construction_failure_and_non_env_factory_raise_load_errors(reg):
    reg.register("echo", EchoEnv)
    with pytest.raises(EnvLoadError, match=re.escape("failed to construct with kwargs {'colour': 'red'}")):
        reg.make("echo", colour="red")
    reg.register("not-env", dict)
    with pytest.raises(EnvLoadError, match="returned dict, not an Env"):
        reg.make("not-env")
    reg.register("missing", "no_such_module_xyz:Env")
    with pytest.raises(EnvLoadError, match="ModuleNotFoundError"):
        reg.make("missing")


def _run(code: str, *, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


SCHEMES = {
    "http://127.0.0.1:1/echo": ("http", "envkit.remote.client:make_remote", "envkit.remote.client:RemoteEnv"),
    "https://127.0.0.1:1/echo": ("https", "envkit.remote.client:make_remote", "envkit.remote.client:RemoteEnv"),
    "ws://127.0.0.1:1/echo": ("ws", "envkit.remote.client:make_remote", "envkit.remote.client:RemoteEnv"),
    "wss://127.0.0.1:1/echo": ("wss", "envkit.remote.client:make_remote", "envkit.remote.client:RemoteEnv"),
    "openenv:http://127.0.0.1:1": ("openenv", "envkit.remote.openenv:make_openenv",
                                   "envkit.remote.openenv:OpenEnvEnv"),
    "gym:FrozenLake-v1": ("gym", "envkit.integrations.gym_bridge:make_gym",
                          "envkit.integrations.gym_bridge:GymTextEnv"),
    "mcp+stdio:python my_server.py": ("mcp", "envkit.integrations.mcp_env:make_mcp",
                                      "envkit.integrations.mcp_env:MCPToolEnv"),
    "mcp+http://127.0.0.1:1/mcp": ("mcp", "envkit.integrations.mcp_env:make_mcp",
                                   "envkit.integrations.mcp_env:MCPToolEnv"),
}


def test_schemes_resolve_through_the_envkit_schemes_entry_points(reg):
    installed = {ep.name: ep.value for ep in entry_points(group="envkit.schemes")}
    for name, (scheme, provider, made) in SCHEMES.items():
        assert installed.get(scheme) == provider, (scheme, installed)
        env = reg.make(name)  # a constructor only: nothing connects before init()
        assert isinstance(env, ContractChecker) and env.spec.name == name and env.spec.entry_point == made


def test_the_registry_imports_no_env_kind_to_resolve_names():
    source = Path(registry_module.__file__).read_text()
    imported = [ast.unparse(node) for node in ast.walk(ast.parse(source))
                if isinstance(node, ast.Import | ast.ImportFrom)]
    assert not [i for i in imported if "remote" in i or "gym" in i or "openenv" in i or "sync" in i], imported
    out = _run("import sys, envkit.registry as r; r.make('envkit_arithmetic:ArithmeticEnv'); "
               "print(sorted(m for m in sys.modules "
               "if m.startswith(('envkit.remote', 'envkit.integrations.gym_bridge'))))")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_names_that_only_look_like_schemes_behave_as_before(reg, monkeypatch):
    assert isinstance(reg.make(f"{__name__}:EchoEnv").unwrapped, EchoEnv)  # module:Class, not a scheme
    with pytest.raises(EnvLoadError, match=re.escape("entry point string given to make()): ModuleNotFoundError: "
                                                     "No module named 'ftp'")):
        reg.make("ftp://127.0.0.1:1/echo")
    with pytest.raises(EnvNotFoundError):
        reg.make("ws")  # a registered name, not a scheme: only the part before a ':' is one
    monkeypatch.setattr(registry_module, "_entry_points", lambda group: {})  # envkit installed without its schemes
    with pytest.raises(EnvLoadError, match=re.escape(
            "unknown scheme 'ws' (known: none installed); the 'ws' scheme comes with envkit's server extra: "
            "pip install 'envkit-rl[server]'")):
        reg.make("ws://127.0.0.1:1/echo")
    with pytest.raises(EnvLoadError, match=re.escape("pip install 'envkit-rl[gym]'")):
        reg.make("gym:FrozenLake-v1")
    with pytest.raises(EnvLoadError, match=re.escape("unknown scheme 'mcp' (known: none installed); the 'mcp' scheme "
                                                     "comes with envkit's mcp extra: pip install 'envkit-rl[mcp]'")):
        reg.make("mcp+stdio:python my_server.py")  # the scheme is the part before ':' up to a '+'


def test_bundled_env_packages_are_selected_by_name_in_a_fresh_process():
    out = _run("from envkit.cli import main; main(['list', '--json'])")
    assert out.returncode == 0, out.stderr
    listed = {e["name"]: e for e in json.loads(out.stdout)["envs"]}
    for name, package in BUNDLED_ENVS.items():
        assert listed[name]["package"] == package
        assert listed[name]["version"] == "0.1.0" and listed[name]["description"]
    out = _run(
        "import envkit; e = envkit.SyncEnv(envkit.make('arithmetic')); m, _ = e.reset(seed=0); "
        "print(m[-1]['content']); r = e.step('The answer is 0'); print(r.terminated); e.close()"
    )
    assert out.returncode == 0, out.stderr
    question, terminated = out.stdout.strip().splitlines()
    assert question.startswith("What is") and terminated == "True"


def _write_package(root: Path, dist: str, module: str, entry_points: dict[str, str], source: str) -> Path:
    pkg = root / dist
    (pkg / module).mkdir(parents=True)
    (pkg / module / "__init__.py").write_text(textwrap.dedent(source))
    eps = "\n".join(f'{name} = "{target}"' for name, target in entry_points.items())
    (pkg / "pyproject.toml").write_text(textwrap.dedent(f"""\
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "{dist}"
        version = "1.2.3"
        dependencies = ["envkit-rl"]

        [tool.setuptools]
        packages = ["{module}"]

        [project.entry-points."envkit.envs"]
        """) + eps + "\n")
    return pkg


GOOD_ENV = '''
import envkit

class HelloEnv(envkit.Env):
    """Says hello, rewards a greeting."""

    async def reset(self, *, seed=None, task=None):
        return [envkit.user("hello?")], {"seed": seed}

    async def step(self, action):
        return envkit.StepResult([], reward=float("hello" in action["content"].lower()), terminated=True)
'''


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A directory with three real pip-installed env packages: a good one, a broken one, and a name clash."""
    root = tmp_path_factory.mktemp("pkgs")
    target = root / "site"
    packages = [
        _write_package(root, "hello-env", "hello_env", {"hello": "hello_env:HelloEnv", "dup": "hello_env:HelloEnv"},
                       GOOD_ENV),
        _write_package(root, "broken-env", "broken_env", {"broken": "broken_env:Env"},
                       "raise ImportError('this package is broken on purpose')\n"),
        _write_package(root, "clash-env", "clash_env", {"dup": "clash_env:Env"}, "import envkit\nEnv = None\n"),
    ]
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target),
         *map(str, packages)],
        check=True, timeout=300,
    )
    return target


def test_installed_package_is_made_by_name_in_a_fresh_process(site):
    out = _run(
        "import envkit; e = envkit.SyncEnv(envkit.make('hello')); print(e.reset(seed=3)); "
        "print(e.step('Hello there').reward); print(envkit.spec('hello').package, envkit.spec('hello').version)",
        pythonpath=site,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["([{'role': 'user', 'content': 'hello?'}], {'seed': 3})", "1.0",
                                       "hello-env 1.2.3"]


def test_broken_package_and_clash_are_reported_without_hiding_the_others(site):
    out = _run("from envkit.cli import main; main(['list', '--json'])", pythonpath=site)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    names = {e["name"] for e in data["envs"]}
    assert {"hello", *BUNDLED_ENVS} <= names and not {"broken", "dup"} & names
    broken = {b["name"]: b for b in data["broken"]}
    assert "ImportError: this package is broken on purpose" in broken["broken"]["error"]
    assert "broken-env 1.2.3" in broken["broken"]["source"]
    assert "hello-env 1.2.3" in broken["dup"]["error"] and "clash-env 1.2.3" in broken["dup"]["error"]

    out = _run("import envkit; envkit.make('broken')", pythonpath=site)
    assert out.returncode == 1 and "EnvLoadError" in out.stderr and "broken on purpose" in out.stderr
    out = _run("import envkit; envkit.make('dup')", pythonpath=site)
    assert "DuplicateEnvError" in out.stderr and "clash-env" in out.stderr and "hello-env" in out.stderr


def test_cli_list_table_and_info(site):
    env = {**os.environ, "PYTHONPATH": str(site), "COLUMNS": "200"}
    out = subprocess.run([sys.executable, "-m", "envkit.cli", "list"], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert "hello-env" in out.stdout and "Says hello, rewards a greeting." in out.stdout
    assert "broken broken" in out.stdout and "broken on purpose" in out.stdout
    out = subprocess.run([sys.executable, "-m", "envkit.cli", "info", "calculator", "--json"],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["package"] == "envkit-calculator" and info["tools"][0]["name"] == "calculator"
    assert info["tasks"]["train"] > 0 and info["tasks"]["test"] > 0
    out = subprocess.run([sys.executable, "-m", "envkit.cli", "info", "arithmetik"],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 2 and "Did you mean: 'arithmetic'?" in out.stderr
    # `python -m envkit` is the same command; info shows the constructor's defaults under the kwargs it is given,
    # and the task counts of the env made with them
    out = subprocess.run([sys.executable, "-m", "envkit", "info", "arithmetic", "--json", "--kwargs",
                          '{"level": 3, "num_test": 7}'], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["kwargs"]["level"] == 3 and info["kwargs"]["num_train"] == 10_000 and info["kwargs"]["followups"] == 0
    assert info["tasks"] == {"train": 10_000, "test": 7}
    out = subprocess.run([sys.executable, "-m", "envkit", "info", "arithmetic", "--kwargs", "[3]"],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 2 and "--kwargs must be a JSON object" in out.stderr
