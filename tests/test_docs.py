"""Every Python example of README.md and docs/ runs as it is written, so that none goes stale.

A block that is a fragment (a loop to put around the reader's own model, a script to start
under torchrun) says so on the line before it, ``<!-- fragment: why -->``; it must still be
valid Python. Every other block runs in a fresh process, in an empty directory.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.slow
@pytest.mark.parametrize("where, code", [(w, c) for w, c, why in BLOCKS if why is None],
                         ids=[w for w, _, why in BLOCKS if why is None])
def test_every_python_example_runs(where, code, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"{where}:\n{done.stderr[-3000:]}"
