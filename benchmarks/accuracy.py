"""Accuracy on real data: the MNIST CNN and the character transformer, AllReduce, simulated.

The CNN on MNIST and the character transformer on tiny Shakespeare, both with AllReduce in the
simulator, from the shipped recipes.

    gossamer bench accuracy --data ../shared/data

MNIST: the first 8,000 t10k images train, the last 2,000 evaluate, 8 simulated workers; target
>= 97% eval accuracy. Tiny Shakespeare: validation loss against a unigram model's.
"""

from __future__ import annotations

import argparse
import time

from benchmarks.common import add_data_argument, add_steps_argument, mnist_cnn, recipe_config
from gossamer.bench import Results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_data_argument(parser)
    parser.add_argument("--tasks", nargs="+", default=["mnist", "text"])
    add_steps_argument(parser)


def run(args: argparse.Namespace, results: Results) -> int:
    from gossamer.train.data import load_text, unigram_loss
    from gossamer.train.run import run_training

    rows = {}
    if "mnist" in args.tasks:
        config = mnist_cnn(args.data, steps=args.steps)
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
        path = args.data / "tinyshakespeare.txt"
        config = recipe_config("shakespeare-char.yaml", path, quiet=True, steps=args.steps)
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
    results.write("accuracy", rows)
    return 0
