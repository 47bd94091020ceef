"""Data sets and how they are split across workers.

The embedded default is scikit-learn's bundled digits (1,797 8x8 images, 10 classes), which
needs no download, so ``gossamer train`` works on a fresh machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Dataset:
    """Train and test tensors of one data set."""

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """scikit-learn's digits, pixels scaled to [0, 1], split train/test by a seeded shuffle."""
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    from sklearn.datasets import load_digits as sklearn_digits

    bunch = sklearn_digits()
    x = torch.tensor(bunch.data / 16.0, dtype=torch.float32)
    y = torch.tensor(bunch.target, dtype=torch.int64)
    order = torch.tensor(np.random.default_rng(seed).permutation(len(y)))
    n_test = int(round(len(y) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return Dataset("digits", x[train], y[train], x[test], y[test], num_classes=10)


DATASETS = {"digits": load_digits}


def load_dataset(name: str, seed: int = 0) -> Dataset:
    """Load a data set by name; ValueError listing the known names otherwise."""
    if name not in DATASETS:
        raise ValueError(f"dataset {name!r} is unknown; known: {', '.join(sorted(DATASETS))}")
    return DATASETS[name](seed=seed)


def partition_iid(num_examples: int, world_size: int, seed: int) -> list[np.ndarray]:
    """Shuffle the example indices (seeded) and deal them into ``world_size`` near-equal shards."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if num_examples < world_size:
        raise ValueError(
            f"world_size={world_size} exceeds the {num_examples} training examples: "
            "every worker needs at least one"
        )
    order = np.random.default_rng(seed).permutation(num_examples)
    return [shard.copy() for shard in np.array_split(order, world_size)]


class ShardSampler:
    """Endless minibatches of one worker's shard, reshuffled every local epoch (seeded)."""

    def __init__(self, indices: np.ndarray, batch_size: int, seed: int) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.indices = indices
        self.batch_size = batch_size
        self.rng = np.random.default_rng(seed)
        self.epoch = 0
        self._order = self.rng.permutation(self.indices)
        self._position = 0

    def next_batch(self) -> torch.Tensor:
        batch = []
        while len(batch) < self.batch_size:
            if self._position == len(self._order):
                self._order = self.rng.permutation(self.indices)
                self._position = 0
                self.epoch += 1
            take = min(self.batch_size - len(batch), len(self._order) - self._position)
            batch.extend(self._order[self._position : self._position + take])
            self._position += take
        return torch.as_tensor(np.asarray(batch), dtype=torch.int64)
