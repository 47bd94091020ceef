"""No module of the package reaches into another module's privates: what one module offers
another has a public name (and a docstring), so that renaming or reworking a private name
only ever concerns the module that defines it.

The rule, read from each module's syntax tree (``ast``), over every module of
``src/gossamer``:

- ``from gossamer.x import _name`` (or a relative import) of another module's private name;
- ``x._name`` where ``x`` is another module of the package (``ckpt._prune``);
- ``obj._name`` on an object that is not the method's own (``self``, ``cls``, ``super()``,
  ``type(self)``) where ``_name`` is a private attribute that a class of another module
  defines (a method, a class attribute, a dataclass field, or a ``self._name = ...`` /
  ``cls._name = ...`` assignment), and

  - no class of this module defines it (the attribute can only be another module's), or
  - a class of this module defines it, and so does a class of another module that may stand
    in for it: a subclass or a base of it, or a class that defines two or more of the same
    private methods in a module that imports this one or is imported by it (a duck-typed
    stand-in, as MirrorWorld is for SimWorld): a call here may run the other module's code.

Private means one leading underscore and not a dunder. Attributes that no class of the package
defines (torch's own privates, which gossamer.torch_internals keeps in one place) are not this
rule's concern, and neither is a class's use of its own or its bases' privates on ``self``. A
private name that two unrelated classes of two modules happen to share (``_record``, ``_seq``)
is no violation: each module uses its own.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "gossamer"
OWN = {"self", "cls"}  # the names of a method's own object
STAND_IN_METHODS = 2  # private methods two classes share to be taken for one interface


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@dataclass
class ClassInfo:
    module: str
    name: str
    bases: list[ast.expr]
    members: set[str] = field(default_factory=set)  # private names it defines
    methods: set[str] = field(default_factory=set)  # private methods among them

    @property
    def key(self) -> tuple[str, str]:
        return self.module, self.name


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    is_package: bool
    classes: list[ClassInfo] = field(default_factory=list)
    names: dict[str, str] = field(default_factory=dict)  # local name -> what it imports
    imports: set[str] = field(default_factory=set)  # the modules (and names) it imports
    import_froms: list[ast.ImportFrom] = field(default_factory=list)
    accesses: list[ast.Attribute] = field(default_factory=list)  # x._name, anywhere in it

    def absolute(self, node: ast.ImportFrom) -> str:
        """The module an ``ImportFrom`` names, relative ones resolved."""
        if not node.level:
            return node.module or ""
        parts = self.name.split(".")
        base = parts if self.is_package else parts[:-1]
        base = base[:len(base) - node.level + 1]
        return ".".join(base + ([node.module] if node.module else []))


def _class_info(module: str, node: ast.ClassDef) -> ClassInfo:
    """What the body of the class ``node`` defines (its ``self._x = ...`` are added by
    :func:`load`, which goes through its methods)."""
    info = ClassInfo(module, node.name, list(node.bases))
    is_dataclass = any(
        (_dotted(d.func if isinstance(d, ast.Call) else d) or "").split(".")[-1] == "dataclass"
        for d in node.decorator_list)
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            info.members.add(stmt.name)
            info.methods.add(stmt.name)
        elif isinstance(stmt, ast.ClassDef):
            info.members.add(stmt.name)
        elif isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                info.members.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            # a bare annotation only declares a type, except a dataclass's field
            if stmt.value is not None or is_dataclass:
                info.members.add(stmt.target.id)
    info.members = {m for m in info.members if private(m)}
    info.methods = {m for m in info.methods if private(m)}
    return info


def load(src: Path, package: str = PACKAGE) -> dict[str, Module]:
    """Every module of ``package`` under ``src``, by dotted name, gone through once."""
    modules = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        module = Module(name, path, ast.parse(path.read_text(), str(path)), is_package)
        todo: list[tuple[ast.AST, ClassInfo | None]] = [(module.tree, None)]  # (node, its class)
        while todo:
            node, owner = todo.pop()
            if isinstance(node, ast.ClassDef):
                owner = _class_info(name, node)
                module.classes.append(owner)
            elif isinstance(node, ast.Attribute) and private(node.attr):
                module.accesses.append(node)
                if (owner is not None and isinstance(node.ctx, ast.Store)
                        and isinstance(node.value, ast.Name) and node.value.id in OWN):
                    owner.members.add(node.attr)  # self._x = ... / cls._x = ...
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        module.names[alias.asname] = alias.name
                    else:
                        module.names[alias.name.split(".")[0]] = alias.name.split(".")[0]
                    module.imports.add(alias.name)
            elif isinstance(node, ast.ImportFrom):
                source = module.absolute(node)
                module.imports.add(source)
                module.import_froms.append(node)
                for alias in node.names:
                    module.names[alias.asname or alias.name] = f"{source}.{alias.name}"
                    module.imports.add(f"{source}.{alias.name}")
            todo.extend((child, owner) for child in ast.iter_child_nodes(node))
        modules[name] = module
    return modules


class Index:
    """The package's classes, what each defines, and which may stand in for which."""

    def __init__(self, modules: dict[str, Module]) -> None:
        self.modules = modules
        self.classes = {c.key: c for m in modules.values() for c in m.classes}
        self.owners: dict[str, list[ClassInfo]] = defaultdict(list)
        for c in self.classes.values():
            for member in c.members:
                self.owners[member].append(c)
        self.ancestors = {key: self._ancestors(key) for key in self.classes}

    def resolve(self, module: str, dotted: str, depth: int = 0) -> str | None:
        """The package module or ``module.Class`` that ``dotted`` names in ``module``."""
        head, _, rest = dotted.partition(".")
        target = self.modules[module].names.get(head) if module in self.modules else None
        if target is None:
            if module in self.modules and any(c.name == head and c.module == module
                                              for c in self.modules[module].classes):
                return f"{module}.{dotted}"
            return None
        full = f"{target}.{rest}" if rest else target
        if full in self.modules:
            return full
        owner, _, name = full.rpartition(".")
        if owner in self.modules and depth < 10:
            found = self.resolve(owner, name, depth + 1)  # a name the module imported itself
            if found is not None:
                return found
            return full if (owner, name) in self.classes else None
        return None

    def _ancestors(self, key: tuple[str, str]) -> set[tuple[str, str]]:
        seen: set[tuple[str, str]] = set()
        todo = [key]
        while todo:
            c = self.classes[todo.pop()]
            for base in c.bases:
                dotted = _dotted(base)
                found = self.resolve(c.module, dotted) if dotted else None
                if found is None:
                    continue
                parent = tuple(found.rsplit(".", 1))
                if parent in self.classes and parent not in seen:
                    seen.add(parent)
                    todo.append(parent)
        return seen

    def related(self, a: ClassInfo, b: ClassInfo) -> str:
        """How ``b`` (of another module) may stand in for ``a``: "" when it may not."""
        if b.key in self.ancestors[a.key]:
            return "a base of it"
        if a.key in self.ancestors[b.key]:
            return "a subclass of it"
        shared = a.methods & b.methods
        linked = (b.module in self.modules[a.module].imports
                  or a.module in self.modules[b.module].imports)
        if linked and len(shared) >= STAND_IN_METHODS:
            return "a stand-in for it (the same private methods: " + ", ".join(sorted(shared)) + ")"
        return ""


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return f"{head}.{node.attr}" if head else None
    return None


def _own(node: ast.expr) -> bool:
    """Whether ``node`` is a method's own object: self, cls, super(), type(self)."""
    if isinstance(node, ast.Name):
        return node.id in OWN
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and (node.func.id == "super"
                 or node.func.id == "type" and len(node.args) == 1 and _own(node.args[0])))


def violations(src: Path, package: str = PACKAGE) -> list[str]:
    """Every access of one module to another module's privates, as ``file:line: what``, in
    the order of the files and lines."""
    modules = load(src, package)
    index = Index(modules)
    found: set[tuple[str, int, str]] = set()
    for module in modules.values():
        where = module.path.relative_to(src).as_posix()
        for node in module.import_froms:
            source = module.absolute(node)
            if source.split(".")[0] == package and source != module.name:
                for alias in node.names:
                    if private(alias.name):
                        found.add((where, node.lineno, f"imports {alias.name} from {source}"))
        for node in module.accesses:
            if _own(node.value):
                continue
            name = node.attr
            dotted = _dotted(node.value)
            target = index.resolve(module.name, dotted) if dotted else None
            if target in modules:  # x._name with x a module of the package
                if target != module.name:
                    found.add((where, node.lineno, f"{dotted}.{name}: a private name of "
                                                   f"{target}"))
                continue
            owners = index.owners.get(name, [])
            foreign = [c for c in owners if c.module != module.name]
            if not foreign:
                continue
            mine = [c for c in module.classes if name in c.members]
            text = ast.unparse(node)
            if not mine:
                defined = ", ".join(sorted(f"{c.module}.{c.name}" for c in foreign))
                found.add((where, node.lineno,
                           f"{text}: {name} is defined only in another module ({defined})"))
                continue
            for a in mine:
                why = next(((b, index.related(a, b)) for b in foreign if index.related(a, b)),
                           None)
                if why is not None:
                    b, how = why
                    found.add((where, node.lineno,
                               f"{text}: {name} of {a.name} is also {b.module}.{b.name}'s, {how}"))
                    break
    return [f"{where}:{line}: {what}" for where, line, what in sorted(found)]


def test_no_module_uses_another_modules_privates():
    found = violations(ROOT / "src")
    assert not found, (f"{len(found)} uses of another module's private names (give what is "
                       "shared a public, documented name):\n" + "\n".join(found))


def test_the_rule_finds_what_it_should_and_nothing_else(tmp_path):
    """The rule on a small package: each kind of violation is found, once, and the accesses
    that are no violation are not."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        "import torch\n"
        "class World:\n"
        "    def __init__(self):\n"
        "        self._queue = []\n"
        "    def _sync(self, w): pass\n"
        "    def _block(self, w): pass\n"
        "    def _run(self): self._sync(0)\n"
        "class Comm:\n"
        "    def __init__(self, world):\n"
        "        self._world = world\n"
        "    def _record(self): pass\n"
        "    def wait(self):\n"
        "        self._world._sync(1)\n"          # line 13: World's, and b.Twin's
        "        self._world._queue.append(2)\n"  # World's alone: fine
        "        torch._C._get_tracing_state()\n"  # torch's own: not this rule's
        "    def merge(self, other):\n"
        "        other._record()\n"              # line 17: b.Sub overrides it
        "def _helper(): pass\n"
    )
    (pkg / "b.py").write_text(
        "from pkg.a import Comm, _helper\n"   # line 1: a private import
        "from pkg import a\n"
        "class Twin:\n"
        "    def _sync(self, w): pass\n"
        "    def _block(self, w): pass\n"
        "class Sub(Comm):\n"
        "    def _record(self): pass\n"
        "    def peek(self, other):\n"
        "        a._helper()\n"              # line 9: a module's private
        "        other._world._queue\n"      # line 10: only a's
        "        other._local()\n"           # b's own: fine
        "        self._world._queue\n"       # line 12: self._world is not self
        "    def _local(self): pass\n"
    )
    (pkg / "c.py").write_text(
        "from pkg.a import Comm\n"
        "class Unrelated:\n"
        "    def _record(self): pass\n"
        "def use(x, comm: Comm):\n"
        "    x._record()\n"                  # c's own _record (a's Comm shares the name only)
        "    comm._record()\n"               # the same name: which one is not known, fine
    )
    (pkg / "d.py").write_text(
        "from pkg.a import Comm\n"
        "def count(comm: Comm):\n"
        "    comm._record()\n"               # line 3: d defines no _record
    )
    found = violations(tmp_path, "pkg")
    lines = [v.split(": ", 1)[0] for v in found]
    assert lines == ["pkg/a.py:13", "pkg/a.py:17", "pkg/b.py:1", "pkg/b.py:9", "pkg/b.py:10",
                     "pkg/b.py:10", "pkg/b.py:12", "pkg/d.py:3"], "\n".join(found)
    assert "a stand-in for it" in found[0] and "_block, _sync" in found[0]
    assert "pkg.b.Sub's, a subclass of it" in found[1]
