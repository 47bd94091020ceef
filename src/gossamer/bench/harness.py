"""Finding the benchmarks: the modules of a source checkout's ``benchmarks/`` folder.

A benchmark is a module ``benchmarks/NAME.py`` that defines ``add_arguments(parser)`` and
``run(args, results) -> int``; its docstring's first line is its one-line summary. The other
modules there are helpers (the emulated-network runner, the workers' tasks). They are found
without importing anything, so that a list is quick and a broken helper breaks only the
benchmarks that use it.

The benchmarks stay in the checkout, not in the installed package: they read the recipes and
data sets beside it, and the network suite starts worker processes as ``python -m
benchmarks.emulation`` from its root.
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["available", "find_root", "load"]


def find_root() -> Path:
    """The source checkout whose ``benchmarks/`` is run: the one ``gossamer`` is installed from
    (``pip install -e .``), else the current directory.

    Raises:
        FileNotFoundError: neither holds ``benchmarks/__init__.py``.
    """
    import gossamer

    installed = Path(gossamer.__file__).resolve().parents[2]  # src/gossamer/__init__.py
    for root in (installed, Path.cwd()):
        if (root / "benchmarks" / "__init__.py").is_file():
            return root
    raise FileNotFoundError(
        f"no benchmarks/ folder in {installed} (where gossamer is installed from) or in "
        f"{Path.cwd()}: gossamer bench runs the benchmarks of a source checkout; install it "
        "with `pip install -e .` or run from its root")


def _summary(path: Path) -> str | None:
    """The first docstring line of ``path`` if it defines a benchmark, else None."""
    tree = ast.parse(path.read_text(), filename=str(path))
    defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    if not {"add_arguments", "run"} <= defined:
        return None
    doc = (ast.get_docstring(tree) or "").strip()
    return doc.splitlines()[0] if doc else ""


def available(root: Path) -> dict[str, str]:
    """Every benchmark of ``root/benchmarks``: name -> one-line summary, sorted by name."""
    found = {}
    for path in sorted((root / "benchmarks").glob("*.py")):
        if path.stem.startswith("_"):
            continue
        summary = _summary(path)
        if summary is not None:
            found[path.stem] = summary
    return found


def load(root: Path, name: str) -> ModuleType:
    """Import the benchmark ``name`` of ``root/benchmarks``.

    Raises:
        ValueError: there is no such benchmark; the message lists the known ones.
    """
    known = available(root)
    if name not in known:
        raise ValueError(f"no benchmark named {name!r}; known: {', '.join(known)}")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))  # benchmarks/ is not installed
    package = importlib.import_module("benchmarks")
    where = Path(package.__file__).resolve().parent
    if where != (root / "benchmarks").resolve():
        raise ValueError(f"a benchmarks package from {where} is already imported, not "
                         f"{root / 'benchmarks'}")
    return importlib.import_module(f"benchmarks.{name}")
