"""A user's own model or data set, named ``pkg.module:factory`` on the command line.

:func:`is_factory` tells such a name from a built-in one, :func:`import_factory` imports the
callable and :func:`call_factory` calls it with the arguments it declares. Every failure is a
``ValueError`` that names the setting (``model`` or ``dataset``), so the command line reports
it with exit status 2 instead of a traceback.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

__all__ = ["call_factory", "import_factory", "is_factory", "parameters"]


def is_factory(name: str) -> bool:
    """Whether ``name`` names a factory (``pkg.module:factory``) rather than a built-in."""
    return ":" in name


@contextlib.contextmanager
def _cwd_on_path() -> Iterator[None]:
    # As `python -m` does, so that a user's own mymodels.py in the current directory imports
    # when gossamer is started by its console script (whose sys.path[0] is the script's).
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def import_factory(spec: str, setting: str) -> Callable[..., Any]:
    """The callable that ``spec`` (``pkg.module:attr``, attr may be dotted) names.

    Args:
        spec: ``MODULE:ATTRIBUTE``; the module is imported with the current directory on
            ``sys.path``.
        setting: the setting being resolved (``"model"`` or ``"dataset"``), named in errors.
    """
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute or ":" in attribute:
        raise ValueError(f"{setting} {spec!r} is not MODULE:FACTORY (e.g. mymodels:make)")
    with _cwd_on_path():
        try:
            target: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            # A module the user's module imports that is missing is its own error: keep it.
            if error.name is None or not module_name.startswith(error.name):
                raise
            raise ValueError(
                f"{setting} {spec!r}: no module named {module_name!r} (looked in the current "
                f"directory {os.getcwd()} and on sys.path)"
            ) from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ValueError(f"{setting} {spec!r}: {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(
            f"{setting} {spec!r}: {attribute!r} is a {type(target).__name__}, not callable"
        )
    return target


def call_factory(factory: Callable[..., Any], spec: str, setting: str,
                 kwargs: Mapping[str, Any], hint: str = "") -> Any:
    """Call ``factory(**kwargs)`` with the current directory on ``sys.path`` (for imports it
    does when called); ``ValueError`` naming ``setting`` if its signature does not take them.

    Args:
        hint: appended to that error, e.g. what the factory should take.
    """
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as error:
        given = ", ".join(kwargs) or "no arguments"
        raise ValueError(f"{setting} {spec!r}: the factory cannot be called with {given} "
                         f"({error}){hint}") from None
    except ValueError:  # no signature (some builtins): let the call itself decide
        pass
    with _cwd_on_path():
        return factory(**kwargs)


def parameters(factory: Callable[..., Any]) -> set[str]:
    """The keyword arguments ``factory`` takes by name (all, if it takes ``**kwargs``)."""
    try:
        params = inspect.signature(factory).parameters.values()
    except ValueError:
        return set()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return {"*"}
    return {p.name for p in params
            if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
