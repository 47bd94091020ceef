"""What the benchmarks share that belongs to this checkout: its recipes and data sets.

The rest (stand-in models, the timed-step loop, the results writer, report helpers) is the
harness, :mod:`gossamer.bench`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gossamer.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"  # the data sets' folder beside the checkout
#: the run directory of a ``gossamer compare`` entry (``"a:k=v"``) under its output folder
RUN_DIR_UNSAFE = r"[^A-Za-z0-9_.=-]+"


def split_entry(entry: str) -> tuple[str, dict[str, str]]:
    """A ``gossamer compare`` entry as its name and options: ``"qsr:period=4"`` ->
    ``("qsr", {"period": "4"})``."""
    name, *pairs = entry.strip().split(":")
    return name, dict(pair.split("=", 1) for pair in pairs)


def recipe_config(recipe: str, data_path: str | Path, *, steps: int | None = None,
                  **overrides: Any) -> TrainConfig:
    """The training settings of ``recipes/RECIPE`` reading ``data_path``, with ``overrides``
    (and ``steps`` unless None: a benchmark's ``--steps``, a shorter check of it)."""
    from gossamer.train.config import TrainConfig, load_recipe

    settings = {**load_recipe(ROOT / "recipes" / recipe), "data_path": str(data_path),
                **overrides}
    if steps is not None:
        settings["steps"] = steps
    return TrainConfig(**settings)


def mnist_cnn(data: str | Path, *, steps: int | None = None) -> TrainConfig:
    """recipes/mnist-cnn.yaml on ``data/mnist``, quiet: the task of the accuracy benchmarks."""
    return recipe_config("mnist-cnn.yaml", Path(data) / "mnist", steps=steps, quiet=True)


def add_steps_argument(parser: argparse.ArgumentParser) -> None:
    """``--steps N``: override the recipe's steps (a shorter check of the benchmark, or a
    longer run)."""
    parser.add_argument("--steps", type=int, default=None,
                        help="override the recipe's steps (a shorter check of the benchmark, "
                             "or a longer run)")


def cnn_bytes() -> int:
    """Bytes of the MNIST CNN's parameters in float32."""
    from gossamer.train.models import build_model

    return 4 * sum(p.numel() for p in build_model("cnn", (1, 28, 28), 10).parameters())


def add_data_argument(parser: argparse.ArgumentParser) -> None:
    """``--data DIR``: the folder holding mnist/ and tinyshakespeare.txt."""
    parser.add_argument("--data", type=Path, default=DATA,
                        help="folder holding mnist/ and tinyshakespeare.txt (default: "
                        "../shared/data beside the checkout)")
