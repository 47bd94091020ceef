"""Where a benchmark's figures go: one JSON file per result, with the machine and the command
that made it."""

from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Results", "machine"]


def machine() -> str:
    """A one-line description of this machine (CPU model, cores, torch and Python versions)."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"Python {platform.python_version()}")


@dataclass
class Results:
    """The output folders of one benchmark run, and what it wrote there.

    Raw numbers go to ``folder/NAME.json``; figures meant for BENCHMARKS.md to ``figures``.
    """

    folder: Path  # JSON results, run directories, drafts (benchmarks/results, not committed)
    figures: Path  # figures BENCHMARKS.md shows (benchmarks/figures)
    command: str  # the command line that ran the benchmark, kept with its results
    written: list[Path] = field(default_factory=list)  # in the order written

    def write(self, name: str, data: dict[str, Any]) -> Path:
        """Write ``data`` to ``folder/NAME.json`` with the machine and the command; say so."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{name}.json"
        path.write_text(json.dumps({"machine": machine(), "command": self.command, **data},
                                   indent=2))
        return self.wrote(path)

    def wrote(self, path: Path) -> Path:
        """Record (and print) a file the benchmark wrote itself: a figure, a draft."""
        self.written.append(path)
        print(f"wrote {path}", flush=True)
        return path

    def figure_path(self, name: str) -> Path:
        """``figures/NAME``, the folder made if needed."""
        self.figures.mkdir(parents=True, exist_ok=True)
        return self.figures / name
