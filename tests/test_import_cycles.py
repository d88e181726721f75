"""No import cycles in the product packages, counting imports inside functions and type-only ones.

The rule: every import statement in a module, function bodies and ``if TYPE_CHECKING:`` blocks included, is an edge
to the module it names: a type that two modules share lives one floor down, in a leaf module both import. ``from pkg
import name`` is an edge to ``pkg`` (its ``__init__`` runs first) and also to ``pkg.name`` where that is a submodule.
So a module inside a package imports its siblings, not the package's face. Run as a script to print the graph's
cycles: ``python tests/test_import_cycles.py``.

Also: ``envkit`` loads every plugin command's module on each call, so none of them may import torch at module level.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("envkit", "generators", "trainer", "sandboxes")


def modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Every module of ``packages`` by dotted name (``pkg/__init__.py`` is ``pkg``)."""
    found: dict[str, Path] = {}
    for package in packages:
        for path in (root / package).rglob("*.py"):
            if "templates" in path.relative_to(root).parts:  # scaffolding sources, not modules of the package
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in ``tree``, wherever it sits."""
    return [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]


def graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` its import statements name."""
    known = modules(root, packages)
    edges: dict[str, set[str]] = {}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in _imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
                continue
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names)
        edges[name] = {t for t in targets if t in known and t != name}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_product_packages_have_no_import_cycles() -> None:
    assert cycles(graph()) == []


def test_the_rule_counts_function_level_imports_and_package_faces(tmp_path: Path) -> None:
    """An import inside a function makes a cycle, and so does one under ``TYPE_CHECKING``; ``from p import m`` is an
    edge to ``p``'s ``__init__`` as well as to ``p.m``."""
    files = {
        "p/__init__.py": "from p.face import thing\n",
        "p/face.py": "thing = 1\n",
        "p/a.py": "def f():\n    from p.b import g\n",
        "p/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.e import E\nfrom . import a\n",
        "p/c.py": "from p import b\n",
        "p/e.py": "from p.b import g\nE = int\n",
        "p/d.py": "from p import face\n",
        "p/face2.py": "import p.d\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    edges = graph(tmp_path, ("p",))
    assert edges["p.d"] == {"p", "p.face"}
    assert edges["p.b"] == {"p", "p.a", "p.e"}  # the TYPE_CHECKING import of p.e is an edge
    assert cycles(edges) == [["p.a", "p.b", "p.e"]]
    (tmp_path / "p/face.py").write_text("import p.c\n")  # p -> p.face -> p.c -> p (through the package's face)
    assert cycles(graph(tmp_path, ("p",))) == [["p", "p.a", "p.b", "p.c", "p.e", "p.face"]]


def test_every_envkit_command_loads_without_torch() -> None:
    """The plugin commands' heavy imports wait for the command to run: importing the server of ``serve-policy`` at
    module level once made every ``envkit`` call, ``--help`` included, 3 s slower."""
    probe = ("import sys; from envkit.cli import build_parser; build_parser(); "
             "print(sorted(m for m in ('torch', 'transformers', 'fastapi', 'vllm') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0 and "warning" not in done.stdout, done.stdout + done.stderr
    assert done.stdout.strip() == "[]"


if __name__ == "__main__":
    found = cycles(graph())
    for component in found:
        print(" <-> ".join(component))
    print(f"{len(found)} import cycles in {', '.join(PACKAGES)}")
    sys.exit(1 if found else 0)
