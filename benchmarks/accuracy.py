"""Accuracy on real data: the CNN on MNIST and the character transformer on tiny Shakespeare,
both with AllReduce in the simulator, from the shipped recipes.

    python -m benchmarks.accuracy --data ../shared/data

MNIST: the first 8,000 t10k images train, the last 2,000 evaluate, 8 simulated workers; target
>= 97% eval accuracy. Tiny Shakespeare: validation loss against a unigram model's.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.common import write_result


def main() -> None:
    from gossamer.train.config import TrainConfig, load_recipe
    from gossamer.train.data import load_text, unigram_loss
    from gossamer.train.loop import run_training

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="../shared/data", help="directory of the data sets")
    parser.add_argument("--tasks", nargs="+", default=["mnist", "text"])
    args = parser.parse_args()
    recipes = Path(__file__).resolve().parents[1] / "recipes"
    data = Path(args.data)
    rows = {}
    if "mnist" in args.tasks:
        config = TrainConfig(**load_recipe(recipes / "mnist-cnn.yaml"),
                             data_path=str(data / "mnist"), quiet=True)
        start = time.perf_counter()
        result = run_training(config)
        rows["mnist"] = {"recipe": "recipes/mnist-cnn.yaml", "workers": config.sim,
                         "steps": config.steps, "eval_accuracy": result["eval_accuracy"],
                         "eval_loss": result["eval_loss"],
                         "simulated_wall_clock_s": result["wall_clock"],
                         "real_seconds": time.perf_counter() - start}
        print(f"MNIST CNN, {config.sim} workers: eval accuracy "
              f"{100 * result['eval_accuracy']:.2f}% ({rows['mnist']['real_seconds']:.0f} s)")
    if "text" in args.tasks:
        path = data / "tinyshakespeare.txt"
        config = TrainConfig(**load_recipe(recipes / "shakespeare-char.yaml"),
                             data_path=str(path), quiet=True)
        start = time.perf_counter()
        result = run_training(config)
        baseline = unigram_loss(load_text(path, block_size=config.block_size))
        rows["text"] = {"recipe": "recipes/shakespeare-char.yaml", "workers": config.sim,
                        "steps": config.steps, "validation_loss": result["eval_loss"],
                        "unigram_loss": baseline,
                        "real_seconds": time.perf_counter() - start}
        print(f"char transformer, {config.sim} workers: validation loss "
              f"{result['eval_loss']:.3f} nats/char, unigram {baseline:.3f} "
              f"({rows['text']['real_seconds']:.0f} s)")
    print(f"wrote {write_result('accuracy', rows)}")


if __name__ == "__main__":
    main()
