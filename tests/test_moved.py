"""The old paths of envkit's moved modules (envkit.judges, envkit.agent, envkit.adapters.*, ...) still import, as the
new module itself, with a DeprecationWarning that names the new path."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import envkit
from envkit.imports import import_ref
from envkit.moved import FINDER, MOVED, new_name
from envkit.rewards.judges import LLMJudge
from envkit.rewards.rubrics import GroupRubric

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """No old name imported yet in this test, so importing one warns again (the old names come back afterwards)."""
    for old in [m for m in sys.modules if new_name(m) is not None]:
        monkeypatch.delitem(sys.modules, old)


def test_an_old_path_imports_the_new_module_and_warns_naming_it(fresh: None) -> None:
    with pytest.warns(DeprecationWarning, match=r"envkit\.judges moved to envkit\.rewards\.judges") as caught:
        from envkit.judges import LLMJudge as old

    assert old is LLMJudge and old.__module__ == "envkit.rewards.judges"
    assert sys.modules["envkit.judges"] is sys.modules["envkit.rewards.judges"]
    assert sys.modules["envkit.judges"].__spec__.name == "envkit.rewards.judges"
    assert [w.filename for w in caught] == [__file__]  # the importing line, not the import system's


def test_a_ref_in_a_config_with_an_old_path_still_names_the_object(fresh: None) -> None:
    with pytest.warns(DeprecationWarning, match="envkit.rewards.rubrics"):
        assert import_ref("envkit.rubrics:GroupRubric") is GroupRubric
    with pytest.warns(DeprecationWarning, match="envkit.agents.agent"):
        assert import_ref("envkit.agent:Command") is envkit.Command


def test_a_moved_packages_submodules_follow_it(fresh: None) -> None:
    with pytest.warns(DeprecationWarning):
        from envkit.adapters import build
        from envkit.adapters.opponent import make_opponent
    integrations = importlib.import_module("envkit.integrations")
    assert build is integrations.build
    assert make_opponent is importlib.import_module("envkit.integrations.opponent").make_opponent
    assert new_name("envkit.adapters.anything") == "envkit.integrations.anything"
    assert new_name("envkit.agents.agent") is None and new_name("envkit.core") is None
    assert sys.meta_path[0] is FINDER  # before the path finder, which would load envkit.adapters.X a second time


def test_every_moved_module_is_where_the_table_says_and_gone_from_where_it_was() -> None:
    for old, new in MOVED.items():
        assert importlib.util.find_spec(new) is not None, new
        path = ROOT / Path(*old.split("."))
        assert not path.with_suffix(".py").exists() and not path.is_dir(), old


def test_python_dash_m_with_an_old_path_runs_the_new_module() -> None:
    out = subprocess.run([sys.executable, "-W", "always::DeprecationWarning", "-m", "envkit.agent_relay"],
                         capture_output=True, text=True, timeout=60)
    assert "envkit.agent_relay moved to envkit.agents.relay" in out.stderr
    assert "not enough values to unpack" in out.stderr  # relay.py's main ran, and wanted its arguments
    hosted = subprocess.run([sys.executable, "-W", "always::DeprecationWarning", "-m", "envkit.agent_process"],
                            capture_output=True, text=True, timeout=60)
    assert "envkit.agent_process moved to envkit.agents.host" in hosted.stderr  # the agent host's entry point
    assert "IndexError" in hosted.stderr  # host.py's main ran, and wanted the agent's ref
