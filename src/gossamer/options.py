"""Documented options: a dataclass field that carries its own help text, and the conversion of
``KEY=VALUE`` strings (command line, recipes) to a field's type.

Every configuration class of gossamer (a training run, an algorithm, a compressor) declares
each option once, with its default and its help, and everything that shows or parses options
(``--help``, ``gossamer algorithms``, ``--option KEY=VALUE``, YAML recipes) reads them from
there. Example::

    @dataclass(frozen=True, kw_only=True)
    class Example:
        ratio: float = option(0.01, "fraction of elements sent; lower: fewer bytes")

    option_help(Example)           # {"ratio": "fraction of elements sent; lower: fewer bytes"}
    convert("ratio", "1e-3", float)  # 0.001
"""

from __future__ import annotations

import dataclasses
import re
import sys
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["convert", "converted", "describe_options", "option", "option_help"]

_MISSING: Any = dataclasses.MISSING


def option(default: Any = _MISSING, help: str = "", *,  # noqa: A002 - argparse's word
           factory: Callable[[], Any] | None = None) -> Any:
    """A dataclass field with ``default`` (or ``factory``) and its ``help`` text."""
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


def option_of(cls: type, name: str) -> Any:
    """A dataclass field with the default and help of the field ``name`` of the dataclass
    ``cls``: an option declared where it is implemented, offered again elsewhere."""
    source = {f.name: f for f in dataclasses.fields(cls)}[name]
    return option(source.default, source.metadata.get("help", ""))


def option_help(cls: type) -> dict[str, str]:
    """The help text of each init field of the dataclass ``cls`` ("" where none is given)."""
    return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(cls) if f.init}


def describe_options(cls: type) -> list[tuple[str, str, Any, str]]:
    """(option, type, default, help) of each init field of the dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        rows.append((f.name, type_name(hints[f.name]), default, f.metadata.get("help", "")))
    return rows


#: in ``retired`` of :func:`converted`: any value of the option is dropped
ANY_VALUE = object()


def converted(cls: type, options: Mapping[str, Any], owner: str,
              renamed: Mapping[str, str] | None = None,
              retired: Mapping[str, tuple[Any, str]] | None = None) -> dict[str, Any]:
    """``options`` as keyword arguments of the dataclass ``cls``: each name checked against its
    init fields (ValueError naming ``owner``, e.g. ``"algorithm 'sgp'"``, and listing them) and
    each string converted to the field's type (:func:`convert`). ``renamed`` maps an option's
    old name to its new one: the old name is read with a note on stderr (both: an error).
    ``retired`` maps an option that ``cls`` no longer has to (the one value it could take,
    or :data:`ANY_VALUE` where it had no effect; why): that value is dropped with a note on
    stderr, so that files written before still load; another is an error saying why."""
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls) if f.init]
    options = dict(options)
    read_renamed(options, renamed or {}, owner, "option")
    for key, (value, why) in (retired or {}).items():
        if key not in options:
            continue
        given = options.pop(key)
        if value is not ANY_VALUE and not _same_value(given, value):
            raise ValueError(f"{owner}: option {key}={given!r} is not taken: {why}")
        print(f"note: {owner}: option {key!r} is no longer read ({why}); "
              f"{key}={given!r} is ignored", file=sys.stderr)
    kwargs = {}
    for key, value in options.items():
        if key not in known:
            raise ValueError(f"{owner} has no option {key!r}; its options: "
                             f"{', '.join(sorted(known)) or 'none'}")
        kwargs[key] = convert(key, value, hints[key], owner=owner)
    return kwargs


def _same_value(given: Any, value: Any) -> bool:
    """Whether ``given`` (a value, or a string from a command line) is ``value``."""
    if isinstance(given, str) and not isinstance(value, str):
        if value is None:
            return given.lower() in ("none", "null")
        try:
            return float(given) == value
        except ValueError:
            return False
    return bool(given == value)


def read_renamed(settings: dict[str, Any], renamed: Mapping[str, str], where: str,
                 what: str) -> None:
    """Move each setting given under an old name of ``renamed`` (old -> new) to its new name,
    with a note on stderr naming both; ValueError where both are given. ``where`` and
    ``what`` name them in the messages (e.g. ``"algorithm 'diloco'"`` and ``"option"``)."""
    for old, new in renamed.items():
        if old in settings:
            if new in settings:
                raise ValueError(f"{where}: {old!r} and {new!r} are the same {what} ({old!r} "
                                 f"is its old name); keep {new!r}")
            print(f"note: {where}: {what} {old!r} is now {new!r} (the old name is read for "
                  "one more release)", file=sys.stderr)
            settings[new] = settings.pop(old)


def type_name(tp: Any) -> str:
    """``float``, ``int | None``, ...: a type as a reader writes it."""
    if isinstance(tp, type):
        return tp.__name__
    return re.sub(r"\b(?:[a-z_][a-z0-9_]*\.)+([A-Za-z_]\w*)", r"\1", str(tp))


def convert(key: str, value: Any, tp: Any, owner: str = "") -> Any:
    """``value`` converted to the type ``tp`` when it is a string; other values pass through.

    Booleans accept 1/0, true/false, yes/no, on/off; ``none``/``null`` gives None where the
    type allows it; a union tries its members in order. ``owner`` names what the option
    belongs to in the error (e.g. ``"algorithm 'sgp'"``).
    """
    if not isinstance(value, str):
        return value
    origin = typing.get_origin(tp)
    candidates = typing.get_args(tp) if origin in (typing.Union, types.UnionType) else (tp,)
    if value.lower() in ("none", "null") and type(None) in candidates:
        return None
    for candidate in candidates:
        try:
            if candidate is bool:
                if value.lower() in ("1", "true", "yes", "on"):
                    return True
                if value.lower() in ("0", "false", "no", "off"):
                    return False
                continue
            if candidate in (int, float, str):
                return candidate(value)
        except ValueError:
            continue
    where = f" of {owner}" if owner else ""
    raise ValueError(f"option {key}={value!r}{where} is not a valid {type_name(tp)}")
