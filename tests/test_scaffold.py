"""`envkit new NAME`: the package it writes passes its own tests and lint as generated, and once installed (into a
throwaway venv layered on this one) `envkit list`, `envkit info`, `envkit serve` and the image plan of `envkit build`
find it through its entry point. Names are checked and nothing is overwritten.

The e2e test goes the user's whole way: `envkit new demo`, `pip install -e .`, `pytest`, serve and play it remotely,
and a 2-step training run with real updates against the session's vLLM server.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatch
from importlib.metadata import distribution
from pathlib import Path

import pytest
from remote_envs import Server, free_port
from tiny import tiny_model_dir
from weights import changed_tensors

import envkit
import envkit.cli.scaffold
from envkit.cli import main
from envkit.cli.scaffold import KINDS, envkit_distribution, new_env, package_names, render
from envkit.errors import ScaffoldError

REPO = Path(__file__).resolve().parent.parent
# One name per kind, so '-' and '_' in names are covered too.
NAMES = {"single": "demo", "multi": "demo-multi", "tool": "demo_tool"}
TESTS_PER_KIND = {"single": 7, "multi": 9, "tool": 14}


def _env() -> dict[str, str]:
    """This process's environment with this checkout first on PYTHONPATH, so subprocesses run the code under test."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def _run(argv: list[str | Path], *, cwd: Path, extra_path: Path | None = None,
         timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = _env()
    if extra_path is not None:
        env["PYTHONPATH"] = f"{extra_path}{os.pathsep}{env['PYTHONPATH']}"
    result = subprocess.run([str(a) for a in argv], capture_output=True, text=True, cwd=cwd, env=env,
                            timeout=timeout)
    assert result.returncode == 0, f"{argv} exited {result.returncode}:\n{result.stdout[-3000:]}\n" \
                                   f"{result.stderr[-3000:]}"
    return result


def layered_venv(where: Path) -> Path:
    """A venv that also sees this interpreter's packages (a .pth line adds its site-packages, editable installs
    included): packages installed into it stay out of the shared venv. Returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    site_dir = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                              capture_output=True, text=True, check=True).stdout.strip()
    parent = sysconfig.get_path("purelib")
    (Path(site_dir) / "_parent_site.pth").write_text(f"import site; site.addsitedir({parent!r})\n")
    return python


def pip_install_editable(python: Path, project: Path) -> None:
    """``pip install -e '.[test]'`` offline: the package's dependencies must already be installed, so a wrong
    dependency name (not the distribution that provides envkit) fails here."""
    _run([python, "-m", "pip", "install", "--disable-pip-version-check", "-q", "--no-index", "--no-build-isolation",
          "-e", ".[test]"], cwd=project)


def _generated_tests(project: Path) -> int:
    """Run the package's own tests the way its README says; returns how many passed."""
    out = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=project, extra_path=project)
    assert " failed" not in out.stdout and " error" not in out.stdout, out.stdout
    return int(re.search(r"(\d+) passed", out.stdout).group(1))


# --- writing the package ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
def test_new_writes_a_package_that_passes_its_own_tests_and_lint(kind: str, tmp_path: Path) -> None:
    name = NAMES[kind]
    names = package_names(name)
    assert main(["new", name, "--kind", kind, "--dir", str(tmp_path)]) == 0
    project = tmp_path / name
    assert sorted(str(p.relative_to(project)) for p in project.rglob("*") if p.is_file()) == sorted([
        "pyproject.toml", "README.md", f"{names.module}/__init__.py", f"{names.module}/env.py",
        f"tests/test_{names.module}.py"])
    assert _generated_tests(project) == TESTS_PER_KIND[kind]
    _run([sys.executable, "-m", "ruff", "check", "--no-cache", "--select", "E,F,W,I,B,UP,RUF,SIM,ASYNC", "."],
         cwd=project)


@pytest.mark.parametrize("kind", list(KINDS))
def test_pyproject_registers_the_env_and_depends_on_the_installed_envkit(kind: str, tmp_path: Path) -> None:
    name = NAMES[kind]
    names = package_names(name)
    project = new_env(name, kind=kind, parent=tmp_path)
    meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    assert meta["name"] == name and meta["description"] == KINDS[kind]
    assert meta["entry-points"]["envkit.envs"] == {name: f"{names.module}:{names.class_name}"}
    dist, version = envkit_distribution()
    assert meta["dependencies"] == [f"{dist}>={version}"]
    assert distribution(dist).version == envkit.__version__  # the distribution really is the envkit imported here
    readme = (project / "README.md").read_text()
    for command in (f"envkit info {name}", f"envkit serve {name}", f"envkit build {name}", f"envkit eval {name}",
                    f"python -m trainer env.name={name}", "pip install -e '.[test]'", "pytest"):
        assert command in readme


def test_the_dependency_names_whichever_distribution_provides_envkit() -> None:
    files = render(package_names("demo"), "single", ("envkit-rl", "0.3.0+g1a2b3c"))
    assert tomllib.loads(files["pyproject.toml"])["project"]["dependencies"] == ["envkit-rl>=0.3.0"]
    assert "pip install 'envkit-rl[" in files["README.md"]


@pytest.mark.parametrize(("provided", "error"), [
    ({}, "comes from no installed distribution"),
    ({"envkit": ["envkit", "envkit-rl"]}, "several installed distributions provide the envkit package"),
])
def test_no_or_several_envkit_distributions_are_refused(provided: dict, error: str, monkeypatch,
                                                         tmp_path: Path) -> None:
    monkeypatch.setattr(envkit.cli.scaffold, "packages_distributions", lambda: provided)
    with pytest.raises(ScaffoldError, match=error):
        new_env("demo", parent=tmp_path)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(("name", "error"), [
    ("My-Env", "invalid package name 'My-Env'"),
    ("2048", "invalid package name"),
    ("word--count", "invalid package name"),
    ("class", "'class' cannot be a Python package name"),
    ("tests", "'tests' cannot be a Python package name"),
    ("json", "a module 'json' is already importable here"),
    ("pyyaml", "a distribution PyYAML"),
    ("arithmetic", "an env named 'arithmetic' is already installed (package envkit-arithmetic)"),
])
def test_a_name_it_cannot_use_is_refused_with_the_reason(name: str, error: str, tmp_path: Path, capsys) -> None:
    assert main(["new", name, "--dir", str(tmp_path)]) == 2
    assert error in " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert not any(tmp_path.iterdir())


def test_class_names_end_in_env_once() -> None:
    assert [package_names(n).class_name for n in ("demo", "word-count", "my_env", "env")] == [
        "DemoEnv", "WordCountEnv", "MyEnv", "EnvEnv"]


def test_it_never_overwrites(tmp_path: Path, capsys) -> None:
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "pyproject.toml").write_text("mine")
    assert main(["new", "demo", "--dir", str(tmp_path)]) == 2
    assert "already exists: envkit new never overwrites" in " ".join(capsys.readouterr().err.split())
    assert [p.name for p in (tmp_path / "demo").iterdir()] == ["pyproject.toml"]
    assert (tmp_path / "demo" / "pyproject.toml").read_text() == "mine"
    (tmp_path / "empty").mkdir()
    assert new_env("empty", parent=tmp_path) == tmp_path / "empty"  # an empty directory is no one's work
    assert (tmp_path / "empty" / "pyproject.toml").is_file()


def test_a_write_that_fails_halfway_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    # The second file needs a directory where the first one is a file.
    monkeypatch.setattr(envkit.cli.scaffold, "render", lambda *_: {"demo/env.py": "x", "demo/env.py/oops": "y"})
    with pytest.raises(OSError):
        new_env("demo", parent=tmp_path)
    assert not any(tmp_path.iterdir())
    (tmp_path / "was-empty").mkdir()
    with pytest.raises(OSError):
        new_env("was-empty", parent=tmp_path)
    assert (tmp_path / "was-empty").is_dir() and not any((tmp_path / "was-empty").iterdir())


def test_help_shows_the_command_and_its_kinds(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    assert re.search(r"^\s+new\s+start a new environment package", capsys.readouterr().out, re.MULTILINE)
    with pytest.raises(SystemExit):
        main(["new", "--help"])
    out = capsys.readouterr().out
    assert "usage: envkit new [-h] [--kind {single,multi,tool}] [--dir PATH] NAME" in out
    for line in ("single  one question", "multi   several turns", "tool    the model calls tools", "envkit new shop"):
        assert line in out


def test_the_templates_ship_in_the_wheel_and_in_env_images() -> None:
    from sandboxes.images import _SOURCE_SUFFIXES

    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["envkit.cli"]
    cli = REPO / "envkit" / "cli"
    templates = [p.relative_to(cli) for p in (cli / "templates").rglob("*") if p.is_file()]
    assert len(templates) == 9
    for path in templates:
        assert any(fnmatch(str(path), g) for g in globs), f"{path} is not package data: add it to pyproject.toml"
        assert path.suffix in _SOURCE_SUFFIXES, f"{path} would be left out of envkit's wheel in env images"


# --- once installed ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Installed:
    """A generated package, installed editable into a layered venv."""

    kind: str
    name: str
    project: Path
    python: Path

    def envkit(self, *args: str) -> str:
        """Run ``envkit ARGS`` with the venv's python in the package's directory; returns stdout."""
        return _run([self.python, "-m", "envkit.cli", *args], cwd=self.project).stdout


@pytest.fixture(scope="module", params=list(KINDS))
def installed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Installed:
    kind = request.param
    root = tmp_path_factory.mktemp(f"new-{kind}")
    name = NAMES[kind]
    project = new_env(name, kind=kind, parent=root)
    python = layered_venv(root / "venv")
    pip_install_editable(python, project)
    return Installed(kind, name, project, python)


def test_envkit_list_finds_it_through_its_entry_point(installed: Installed) -> None:
    listing = json.loads(installed.envkit("list", "--json"))
    [spec] = [s for s in listing["envs"] if s["name"] == installed.name]
    names = package_names(installed.name)
    assert (spec["package"], spec["version"]) == (installed.name, "0.1.0")
    assert spec["entry_point"] == f"{names.module}:{names.class_name}"
    assert spec["description"] and installed.name not in {b["name"] for b in listing["broken"]}


def test_envkit_info_shows_its_tasks_and_tools(installed: Installed) -> None:
    info = json.loads(installed.envkit("info", installed.name, "--json"))
    assert info["tasks"]["train"] > info["tasks"]["test"] > 0
    assert [t["name"] for t in info["tools"]] == (["price"] if installed.kind == "tool" else [])
    assert info["package"] == installed.name


def test_envkit_check_passes_on_it(installed: Installed) -> None:
    """Every row passes; the snapshot row where episodes have a second step to restore to (the multi-turn kind's:
    the default snapshot of its plain state), and is skipped where an episode is one step."""
    rows = {r["check"]: r["status"] for r in json.loads(installed.envkit("check", installed.name, "--json"))}
    assert rows == {"contract": "pass", "same start": "pass", "close twice": "pass", "isolated sessions": "pass",
                    "ws round trip": "pass", "snapshot": "pass" if installed.kind == "multi" else "skip",
                    "disjoint splits": "pass", "reward range": "pass", "speed": "info"}


def test_envkit_build_would_put_the_package_in_the_image(installed: Installed) -> None:
    # plan() is everything `envkit build` decides before Docker: the tag, the distributions, the requirements.
    code = ("import json, sys; from sandboxes.images import plan; tag, sources, req = plan(sys.argv[1]); "
            "print(json.dumps({'tag': tag, 'req': req.split(), "
            "'dirs': {k: str(s.project_dir) for k, s in sources.items() if s.project_dir}}))")
    out = json.loads(_run([installed.python, "-c", code, installed.name], cwd=installed.project).stdout)
    dist, _ = envkit_distribution()
    assert out["tag"].startswith(f"envkit-env-{installed.name.lower()}:")
    assert f"{installed.name}==0.1.0" in out["req"] and any(r.startswith(f"{dist}==") for r in out["req"])
    assert Path(out["dirs"][installed.name.replace("_", "-")]) == installed.project


def _single(env: envkit.SyncEnv, task: envkit.Task) -> None:
    result = env.step(f"The answer is {task['answer']}.")
    assert result.reward == 1.0 and result.terminated


def _multi(env: envkit.SyncEnv, task: envkit.Task) -> None:
    result = env.step(f"The answer is {task['numbers'][0]}.")
    assert result.reward == pytest.approx(1 / 3) and not result.done
    assert result.observation[0]["content"].startswith("Right. The next number is")


def _tool(env: envkit.SyncEnv, task: envkit.Task) -> None:
    call: envkit.ToolCall = {"id": "c1", "type": "function",
                             "function": {"name": "price", "arguments": '{"item": "apple"}'}}
    looked_up = env.step(envkit.assistant(None, [call]))
    assert looked_up.observation == [{"role": "tool", "content": "3", "tool_call_id": "c1", "name": "price"}]
    result = env.step(f"The answer is {task['answer']}.")
    assert result.reward == pytest.approx(1.1) and result.terminated


PLAY: dict[str, Callable[[envkit.SyncEnv, envkit.Task], None]] = {"single": _single, "multi": _multi, "tool": _tool}
"""A right first move for each kind, and what it must earn."""


def serve_and_play(python: Path, name: str, kind: str) -> None:
    """``envkit serve NAME`` with ``python`` on loopback, then a RemoteEnv (here) plays one episode's first move."""
    port = free_port()
    with Server([str(python), "-m", "envkit.cli", "serve", name, "--port", str(port)], port=port, env=_env()):
        env = envkit.SyncEnv(envkit.make(f"ws://127.0.0.1:{port}/{name}"))
        try:
            messages, info = env.reset(seed=1)
            assert messages[-1]["role"] == "user" and info["task"] == env.tasks("train")[1]
            PLAY[kind](env, info["task"])
        finally:
            env.close()


def test_envkit_serve_serves_it_to_a_remote_env(installed: Installed) -> None:
    serve_and_play(installed.python, installed.name, installed.kind)


# --- the whole way, with a training run --------------------------------------------------------------------------


@pytest.mark.e2e
def test_a_new_env_installs_passes_its_tests_serves_and_trains(tiny_url: str, tmp_path: Path) -> None:
    """The README's way, with the default kind (the installed fixture above serves every kind), trained on the tiny
    model (tests/tiny.py) with a reward no group of its replies is flat under: the step updates the weights."""
    kind = "single"
    _run([sys.executable, "-m", "envkit.cli", "new", "demo"], cwd=tmp_path)
    project = tmp_path / "demo"
    python = layered_venv(tmp_path / "venv")
    pip_install_editable(python, project)
    out = _run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=project)
    assert f"{TESTS_PER_KIND[kind]} passed" in out.stdout, out.stdout
    serve_and_play(python, "demo", kind)

    run = tmp_path / "run"
    _run([python, "-m", "trainer", "env.name=demo", "+env.kwargs.rubric=tiny:graded", f"inference.url={tiny_url}",
          f"model.path={tiny_model_dir()}", f"trainer.output_dir={run}", "trainer.steps=1", "trainer.lr=1e-3",
          "generator.samples_per_prompt=4", "generator.max_tokens=16", "generator.prompts_per_step=2",
          "trainer.eval_tasks=0", "trainer.warmup_steps=0", "logging.progress=false"],
         cwd=project, extra_path=Path(__file__).parent, timeout=900)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "reward/mean" in r}
    assert sorted(steps) == [1]
    assert "train/skipped_update" not in steps[1] and steps[1]["rollout/trained"] == 8, steps[1]
    assert steps[1]["rollout/failed"] == 0, steps[1]
    assert changed_tensors(run / "weights" / "v1", tiny_model_dir()) > 0
