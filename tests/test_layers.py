"""The package's structure: every module imports only from the layers below its own
(docs/design.md; the contracts are in pyproject.toml), and no import cycle exists in the
package or in benchmarks/, function-local imports included."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]


def cycles(package: str) -> list[list[str]]:
    """The import cycles among the modules of ``package`` (each a strongly connected set of
    two or more modules, as import statements anywhere in a module connect them)."""
    graph = grimp.build_graph(package)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph.modules):  # Tarjan's algorithm, iteratively
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(
                        graph.find_modules_directly_imported_by(child)))))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_every_module_imports_only_from_the_layers_below_it():
    code = "import sys, importlinter.cli as c; sys.exit(c.lint_imports_command())"
    result = subprocess.run([sys.executable, "-c", code,
                             str(ROOT / "pyproject.toml"), "--no-cache"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "1 kept, 0 broken" in result.stdout


@pytest.mark.parametrize("package", ["gossamer", "benchmarks"])
def test_no_import_cycle(package, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    assert cycles(package) == []


def test_a_cycle_is_found(tmp_path, monkeypatch):
    """The check itself: a cycle through a function-local import is one."""
    package = tmp_path / "looped"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from looped import b\n")
    (package / "b.py").write_text("def f():\n    from looped import c\n")
    (package / "c.py").write_text("import looped.a\n")
    (package / "d.py").write_text("import looped.a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cycles("looped") == [["looped.a", "looped.b", "looped.c"]]
