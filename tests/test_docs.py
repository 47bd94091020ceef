"""Every Python example of README.md and docs/ runs as it is written, so that none goes stale.

A block that is a fragment (a loop to put around the reader's own model, a script to start
under torchrun) says so on the line before it, ``<!-- fragment: why -->``; it must still be
valid Python. Every other block runs in a process of its own (forked from a warm one:
gossamer.warm.run_python), in an empty directory, and prints what
the page shows it printing: in comment lines right below a ``print(...)`` call (``# `` and the
line; a number may be shown rounded), and in the console block right after it
(``$ python NAME.py``).
"""

from __future__ import annotations

import ast
import re
import shlex
from decimal import Decimal
from pathlib import Path

import pytest

from gossamer.warm import run_python

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:<!-- fragment: (?P<why>[^>]*) -->\n)?```python\n(?P<code>.*?)```", re.S)


def _blocks() -> list[tuple[str, str, str | None]]:
    found = []
    for path in FILES:
        text = path.read_text()
        for match in BLOCK.finditer(text):
            line = text[:match.start("code")].count("\n")
            found.append((f"{path.relative_to(ROOT)}:{line}", match["code"], match["why"]))
    return found


BLOCKS = _blocks()


def test_the_docs_have_examples_and_say_which_are_fragments():
    assert len(BLOCKS) >= 25
    assert sum(why is None for _, _, why in BLOCKS) >= 15  # most examples run


@pytest.mark.parametrize("where, code, why", BLOCKS, ids=[where for where, _, _ in BLOCKS])
def test_every_python_example_compiles(where, code, why):
    compile(code, where, "exec")


def _shown_in_comments(code: str) -> list[str]:
    """What a block shows it prints: the comment lines right below each ``print(...)`` call
    (its last line), at the call's indentation, ``# `` and the printed line."""
    lines = code.splitlines()
    shown = []
    for node in ast.walk(ast.parse(code)):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name) and node.value.func.id == "print"):
            comment = " " * node.col_offset + "# "
            for line in lines[node.end_lineno:]:
                if not line.startswith(comment):
                    break
                shown.append(line[len(comment):])
    return shown


NUMBER = re.compile(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def _rounded(shown: str, line: str) -> bool:
    """Whether ``line`` is ``shown`` but for numbers that ``shown`` gives rounded: the same
    text between the numbers, every integer the same, every other number within half a unit
    of the last place shown (``0.0125`` for 0.012500000000000002)."""
    shown, line = " ".join(shown.split()), " ".join(line.split())
    if NUMBER.split(shown) != NUMBER.split(line):
        return False
    for a, b in zip(NUMBER.findall(shown), NUMBER.findall(line), strict=True):
        if a == b:
            continue
        if "." not in a and "e" not in a:
            return False
        unit = 10.0 ** Decimal(a).as_tuple().exponent
        if not abs(float(b) - float(a)) <= unit / 2 * (1 + 1e-9):
            return False
    return True


def test_the_outputs_in_comments_are_read():
    code = ("x = 1\nprint(x / 3)\n# 0.333\nprint('a',\n      x)\n# a 1\n# (and more)\n"
            "for i in range(2):\n    print(i)  # prose\n    # 0\n    # 1\n# prose again\n")
    assert _shown_in_comments(code) == ["0.333", "a 1", "(and more)", "0", "1"]
    assert _rounded("lr 0.0125, 3 steps", "lr 0.012500000000000002, 3 steps")
    assert _rounded("1.2e-05", "1.23e-05") and not _rounded("1.2e-05", "1.26e-05")
    assert not _rounded("lr 0.0125, 3 steps", "lr 0.0125, 4 steps")
    assert _rounded("0.013", "0.0126") and not _rounded("0.013", "0.0124")
    assert not _rounded("lr 0.0125", "lr: 0.0125")


@pytest.mark.slow
@pytest.mark.parametrize("where, code", [(w, c) for w, c, why in BLOCKS if why is None],
                         ids=[w for w, _, why in BLOCKS if why is None])
def test_every_python_example_runs(where, code, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(code)
    done = run_python([str(script)], cwd=tmp_path, timeout=300)
    assert done.returncode == 0, f"{where}:\n{done.stderr[-3000:]}"
    printed = (done.stdout + done.stderr).splitlines()
    missing = [x for x in _shown_in_comments(code)
               if not any(_matches(x, [line]) or _rounded(x, line) for line in printed)]
    # the console block right after it, run here rather than a second time
    missing += [x for x in SCRIPT_OUTPUTS.get(code, []) if x.strip() and not _matches(x, printed)]
    assert not missing, (f"{where}: not printed: {missing}\nprinted:\n"
                         + "\n".join(printed[-40:]))


# --- Shell examples ---------------------------------------------------------------------------
#
# Every `gossamer ...` command of a ```bash, ```sh, ```console or ```text block (also under
# torchrun, srun, mpirun and `gossamer launch ... --`) is checked as the command line checks it,
# up to the point where training would start: `gossamer.cli.main` runs with the training (and
# compare's runs, and launch's workers) replaced by the checks made before any worker starts.
# The outputs that a console block shows are those of the command run for real (slow tier),
# unless the block says why they cannot be, ``<!-- output: not checked: why -->``.

DATA = ROOT.parent / "shared" / "data"
SHELL = re.compile(r"(?:<!-- output: not checked: (?P<why>[^>]*) -->\n)?(?P<indent>[ \t]*)"
                   r"```(?P<lang>bash|sh|console|text)\n(?P<body>.*?)^(?P=indent)```",
                   re.S | re.M)
LAUNCHERS = ("torchrun", "srun", "mpirun")
# Files that a command names and its page describes in words (relative to where it runs).
FILES_NAMED = {"bad.yaml": "batchsize: 32\n"}
# Commands that cannot be checked here, with the reason.
NOT_CHECKED = {
    "gossamer launch --cleanup":
        "removes network namespaces: needs root; its arguments are checked by running it",
    "gossamer launch --nproc 2 --emulate bandwidth=1gbit -- --steps 100":
        "the error shown is that of an unprivileged user: emulation needs root",
    "gossamer launch --nproc 2 --emulate delay=1ms -- --steps 100":
        "the error shown is that of a kernel without netem: emulation needs root",
}


# Commands that do not do what their page says, for a reason outside the pages: not run.
REPORTED: dict[str, str] = {}


class Command:
    """One command of a shell block: where it is, its words, and the output lines shown."""

    def __init__(self, where: str, line: str, output: list[str]):
        self.where, self.line, self.output = where, line, output
        words = shlex.split(line, comments=True)
        self.words = words[:words.index("|")] if "|" in words else words
        self.key = " ".join(self.words)  # the command without its comment and pipe
        self.argv, self.world, self.launched = None, None, False
        w = self.words
        if w[:1] == ["gossamer"]:
            self.argv = w[1:]
        elif "-m" in w and w[w.index("-m") + 1:w.index("-m") + 2] == ["gossamer"]:
            self.argv = w[w.index("-m") + 2:]
            self.launched = w[0] in LAUNCHERS
            self.world = _world_size(w)

    def error(self) -> str | None:
        """The error line that the page shows right after the command, if any."""
        return next((x for x in self.output[:1] if re.match(r"gossamer \w+: error: ", x)), None)


def _world_size(words: list[str]) -> int | None:
    def flag(*names: str) -> int | None:
        for name in names:
            if name in words:
                return int(words[words.index(name) + 1])
        return None

    if words[0] == "torchrun":
        return (flag("--nnodes") or 1) * (flag("--nproc-per-node") or 1)
    return flag("-np")  # mpirun; srun: from the batch script's settings, not checked here


def _join(lines: list[str]) -> list[tuple[int, str]]:
    """``(index, line)`` with ``\\`` continuations joined."""
    joined, i = [], 0
    while i < len(lines):
        start, line = i, lines[i]
        while line.endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line[:-1].rstrip() + " " + lines[i].strip()
        joined.append((start, line))
        i += 1
    return joined


def _shell_blocks() -> list[tuple[str, str, list[Command], str | None, str | None]]:
    """``(where, lang, commands, why its output is not checked, the Python block right before
    it)`` for every shell block."""
    found = []
    for path in FILES:
        text = path.read_text()
        for match in SHELL.finditer(text):
            first = text[:match.start("body")].count("\n") + 1
            page, where = path.relative_to(ROOT), f"{path.relative_to(ROOT)}:{first - 1}"
            lines = [x[len(match["indent"]):] for x in match["body"].splitlines()]
            commands: list[Command] = []
            prompt = match["lang"] == "console" or any(x.startswith("$ ") for x in lines)
            for i, line in _join(lines):
                if prompt and line.startswith("$ "):
                    commands.append(Command(f"{page}:{first + i}", line[2:].strip(), []))
                elif prompt and commands:
                    commands[-1].output.append(line)
                elif not prompt and line.strip() and not line.lstrip().startswith("#"):
                    commands.append(Command(f"{page}:{first + i}", line.strip(), []))
            script = next((m["code"] for m in BLOCK.finditer(text, 0, match.start())
                           if not text[m.end():match.start()].strip()), None)
            found.append((where, match["lang"], commands, match["why"], script))
    return found


SHELL_BLOCKS = _shell_blocks()
GOSSAMER = [c for _, _, cs, _, _ in SHELL_BLOCKS for c in cs if c.argv is not None]


def _real_paths(argv: list[str]) -> list[str]:
    """``path/to/NAME`` -> the shared data's NAME where it exists."""
    def real(word: str) -> str:
        match = re.fullmatch(r"(?i)path/to/(\S+)", word)
        if match and (DATA / match[1]).exists():
            return str(DATA / match[1])
        return word

    return [real(word) for word in argv]


def _workspace(where: Path) -> Path:
    """A fresh directory to run a page's commands in: the recipes and the examples at hand, and
    the files that the pages name."""
    (where / "recipes").symlink_to(ROOT / "recipes")
    for example in (ROOT / "docs" / "examples").glob("*.py"):
        (where / example.name).write_text(example.read_text())
    for name, text in FILES_NAMED.items():
        (where / name).write_text(text)
    return where


class _Checked(Exception):  # noqa: N818 - not an error: the command got as far as training
    pass


def _check_run(config, world_size: int | None) -> None:
    """What gossamer.train.run.run_training checks before any worker starts."""
    from gossamer.train.run import check_shards, prepare

    if config.data_path and not Path(config.data_path).exists():
        config.check_mode(simulated=config.sim > 0)  # no data here: the settings only
        return
    dataset = prepare(config)
    workers = config.sim or world_size
    if workers:
        config.algorithm.resolve(workers)
        check_shards(config, dataset, workers)


def _dry_run(command: Command, monkeypatch, capsys) -> tuple[int | None, str]:
    """Run ``command`` through ``gossamer.cli.main`` up to where training would start: the exit
    status (None: it got there) and what it wrote to stderr."""
    import gossamer.launch.cli as launch_cli
    import gossamer.train.compare as compare
    import gossamer.train.run as run
    from gossamer.cli import main

    world = [command.world]
    launch = launch_cli.run

    def training(config):
        _check_run(config, world[0])
        raise _Checked

    def comparing(algorithms, base, out_dir):
        for label, algorithm in compare.parse_algorithms(algorithms):
            _check_run(base.replace(algorithm=algorithm, run_dir=f"{out_dir}/{label}",
                                    resume=False, quiet=True), None)
        raise _Checked

    def launching(args):
        train_args = list(args.train_args)
        train_args = train_args[1:] if train_args[:1] == ["--"] else train_args
        if args.nproc is None or args.nproc < 1:
            return launch(args)  # the launcher's own error
        world[0] = args.nproc
        monkeypatch.setattr(run, "launched_by_launcher", lambda: True)
        status = main(["train", *train_args])
        raise AssertionError(f"train arguments of launch: exit {status}")

    monkeypatch.setattr(run, "run_training", training)
    monkeypatch.setattr(run, "launched_by_launcher", lambda: command.launched)
    monkeypatch.setattr(compare, "run_compare", comparing)
    monkeypatch.setattr(launch_cli, "run", launching)
    capsys.readouterr()
    try:
        status = main(_real_paths(command.argv))
    except _Checked:
        status = None
    except SystemExit as stop:  # argparse: --help, --version or a bad argument
        status = stop.code or None
    return status, capsys.readouterr().err


def test_the_docs_have_shell_examples():
    assert len(GOSSAMER) >= 60
    assert {c.argv[0] for c in GOSSAMER if c.argv} >= {
        "train", "compare", "plot", "topology", "launch", "algorithms"}
    assert {*NOT_CHECKED, *REPORTED} <= {c.key for c in GOSSAMER}, "an allow-listed command is gone"


@pytest.mark.parametrize("command", GOSSAMER, ids=[c.where for c in GOSSAMER])
def test_every_gossamer_command_is_valid(command, tmp_path, monkeypatch, capsys):
    if command.key in NOT_CHECKED:
        pytest.skip(NOT_CHECKED[command.key])
    monkeypatch.chdir(_workspace(tmp_path))
    if command.argv[:1] not in (["train"], ["compare"], ["launch"]):
        from gossamer.cli import build_parser

        build_parser().parse_args(command.argv)  # parsed only: the slow tier runs some
        return
    status, err = _dry_run(command, monkeypatch, capsys)
    shown = command.error()
    if shown is None:
        assert status is None, f"{command.where}: {command.line}\n{err}"
    else:
        assert status, f"{command.where}: {command.line} does not fail; the page says {shown}"
        assert _matches(shown, err.strip().splitlines()), f"{command.where}: {err}"


def test_every_resume_follows_a_run_that_writes_checkpoints():
    """A ``--resume`` example comes after (in the same page) the run it continues: one with
    the same run directory that writes checkpoints."""
    from gossamer.cli import build_parser
    from gossamer.train.config import config_from_args

    runs: dict[str, list] = {}
    resumed = 0
    for command in GOSSAMER:
        if command.argv[:1] != ["train"] or command.error():
            continue
        page = command.where.split(":")[0]
        settings = config_from_args(build_parser().parse_args(_real_paths(command.argv)))
        if settings.resume:
            resumed += 1
            assert any(c.run_dir == settings.run_dir and c.checkpoint_every
                       for c in runs.get(page, [])), \
                f"{command.where}: {command.line} continues no run of the page with checkpoints"
        runs.setdefault(page, []).append(settings)
    assert resumed >= 3


# --- Documented defaults ----------------------------------------------------------------------
#
# A table with a "default" column under a heading that names a command (`gossamer train`, or
# the page's title does) gives the default of each flag it lists; where that default is a
# value (not words), it must be what the command's parser says (its --help's "(default: ...)",
# else the argument's default).

HEADING_COMMAND = re.compile(r"^#+ .*`gossamer (\w+)`")


def _documented_defaults() -> list[tuple[str, str, str, str]]:
    """``(where, command, flag, default shown)`` for every row of such a table."""
    found = []
    for path in FILES:
        command, header, fence = None, None, False
        for number, line in enumerate(path.read_text().splitlines(), 1):
            fence = fence != line.startswith("```")
            heading = HEADING_COMMAND.match(line)
            if fence or heading or line.startswith("#"):
                command = heading[1] if heading else command
                continue
            if not line.startswith("|"):
                header = None
                continue
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if header is None:
                header = cells
            elif command and header[1:2] == ["default"]:
                flag = re.match(r"`(--[\w-]+)", cells[0])
                if flag:
                    found.append((f"{path.relative_to(ROOT)}:{number}", command, flag[1],
                                  cells[1]))
    return found


def _parser_default(command: str, flag: str) -> str | None:
    import argparse

    from gossamer.cli import build_parser

    commands = next(a for a in build_parser()._actions
                    if isinstance(a, argparse._SubParsersAction)).choices
    action = next((a for a in commands[command]._actions if flag in a.option_strings), None)
    if action is None:
        return None
    shown = re.search(r"\(default: (.*)\)$", action.help or "", re.S)
    return " ".join(shown[1].split()) if shown else repr(action.default)


def _same_default(documented: str, default: str) -> bool | None:
    """Whether a page's default is the parser's; None where the page says it in words."""
    from gossamer.comm.rate import parse_rate

    literal = re.fullmatch(r"`([^`]*)`", documented)
    text = literal[1] if literal else documented
    default = default.strip("'\"")
    if text == default:
        return True
    if not literal and " " in text:
        return None  # words ("the backend's"), or several values
    if text in ("none", "off"):
        return default in ("()", "[]", "None", "False")
    for read in (float, lambda t: parse_rate(t, arg="default")):
        try:
            return read(text) == float(default)
        except ValueError:
            pass
    return False


def test_the_documented_defaults_are_the_commands():
    rows = _documented_defaults()
    assert {command for _, command, _, _ in rows} >= {"train", "compare", "plot"}
    checked = 0
    for where, command, flag, documented in rows:
        default = _parser_default(command, flag)
        assert default is not None, f"{where}: gossamer {command} has no {flag}"
        same = _same_default(documented, default)
        assert same is not False, (f"{where}: {flag} defaults to {default} in gossamer "
                                   f"{command}; the page says {documented}")
        checked += same is True
    assert checked >= 20


def _matches(shown: str, lines: list[str]) -> bool:
    """Whether a line shown on a page is one of ``lines``: whitespace runs count as one space;
    ``...`` (or ``[...]``) stands for any text."""
    def squash(text: str) -> str:
        return " ".join(text.split())

    parts = re.split(r"\[\.\.\.\]|\.\.\.", squash(shown))
    pattern = re.compile(r".*?".join(re.escape(p) for p in parts)
                         + (r".*" if len(parts) > 1 else ""))
    return any(pattern.fullmatch(squash(line)) for line in lines)


# --- Printed outputs (slow tier) --------------------------------------------------------------

SIMULATED = (["train"], ["compare"], ["topology"], ["algorithms"])


def _runs_here(command: Command, script: str | None) -> bool:
    """Whether the command's output can be reproduced here, exactly: gossamer in the simulator
    on the embedded data set, or a Python script or one-liner of the page."""
    if command.argv is not None:
        return (not command.launched and command.world is None
                and command.argv[:1] in SIMULATED and "--data-path" not in command.argv)
    if command.words[:2] == ["python", "-c"]:
        return True
    return (command.words[:1] == ["python"] and len(command.words) == 2
            and command.words[1].endswith(".py") and script is not None)


CONSOLES = [(where, commands, why, script) for where, lang, commands, why, script
            in SHELL_BLOCKS if any(c.output for c in commands)]
CHECKED = [(where, commands, script) for where, commands, why, script in CONSOLES
           if why is None]


def _runs_script(command: Command, script: str | None) -> bool:
    """Whether ``command`` is ``python NAME.py`` of a Python block that
    test_every_python_example_runs runs: it checks the command's output from that run."""
    return (command.argv is None and command.words[:1] == ["python"]
            and len(command.words) == 2 and command.words[1].endswith(".py")
            and any(script == code and why is None for _, code, why in BLOCKS))


#: a Python block's code -> the lines that its console block shows it printing
SCRIPT_OUTPUTS: dict[str, list[str]] = {}
for _, _commands, _script in CHECKED:
    for _command in _commands:
        if _runs_script(_command, _script):
            SCRIPT_OUTPUTS.setdefault(_script, []).extend(_command.output)


def test_every_printed_output_is_checked_or_says_why_not():
    for where, commands, why, script in CONSOLES:
        if why is None:
            assert all(_runs_here(c, script) for c in commands), (
                f"{where}: its output cannot be reproduced here; say why before the block: "
                "<!-- output: not checked: why -->")
        else:
            assert len(why.strip()) > 10, f"{where}: say why its output is not checked"
    assert len(CHECKED) >= 12
    assert len(CONSOLES) - len(CHECKED) <= 12


@pytest.mark.slow
@pytest.mark.parametrize("where, commands, script", CHECKED, ids=[w for w, _, _ in CHECKED])
def test_every_printed_output_is_what_the_command_prints(where, commands, script, tmp_path):
    _workspace(tmp_path)
    for command in commands:
        if command.key in REPORTED:
            assert not command.output, f"{command.where}: shows an output it does not print"
            continue
        if _runs_script(command, script):
            continue  # checked in test_every_python_example_runs, from its run of the script
        if command.argv is not None:
            args = ["-m", "gossamer", *command.argv]
        else:
            args = command.words[1:]
            if command.words[1].endswith(".py"):
                (tmp_path / command.words[1]).write_text(script)
        done = run_python(args, cwd=tmp_path, timeout=300)
        printed = (done.stdout + done.stderr).splitlines()
        fails = any(re.match(r"gossamer \w+: ", x) for x in command.output)
        if not fails:  # a failure shows the command's message: "gossamer train: ..."
            assert done.returncode == 0, f"{command.where}: {command.line}\n{done.stderr}"
        missing = [x for x in command.output if x.strip() and not _matches(x, printed)]
        assert not missing, (f"{command.where}: {command.line}\nnot printed: {missing}\n"
                             "printed:\n" + "\n".join(printed[-40:]))
