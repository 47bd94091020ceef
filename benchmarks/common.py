"""Shared helpers of the benchmarks: the machine's description and where results go."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> str:
    """A one-line description of this machine (CPU model, cores, torch version)."""
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


def write_result(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    data = {"machine": machine(), **data}
    path.write_text(json.dumps(data, indent=2))
    return path
