"""Your own model and data set for `gossamer train` (see docs/training.md, "Your own model and
data set"). From this directory:

    gossamer train --model mydata:make_model --dataset mydata:make_dataset --steps 40 --quiet

The data set is four Gaussian blobs in 8 dimensions, one class each: a toy task that a small
network learns in a few dozen steps.
"""

import torch
from torch import nn
from torch.utils.data import Dataset


class Blobs(Dataset):
    """``size`` points around four fixed centres; item i is (x, its blob's index)."""

    classes = ("north", "east", "south", "west")  # gossamer reads num_classes from this

    def __init__(self, size: int = 1000, features: int = 8, seed: int = 1):
        # the same centres for every seed; the seed draws the points
        centres = 2.0 * torch.randn(len(self.classes), features,
                                    generator=torch.Generator().manual_seed(0))
        generator = torch.Generator().manual_seed(seed)
        self.y = torch.randint(len(self.classes), (size,), generator=generator)
        self.x = centres[self.y] + torch.randn(size, features, generator=generator)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.x[i], int(self.y[i])


def make_dataset() -> Dataset:
    """One data set: gossamer holds 20% of it out for evaluation."""
    return Blobs()


def make_split() -> tuple[Dataset, Dataset]:
    """Or a pair (train, test), split your own way."""
    return Blobs(800, seed=1), Blobs(200, seed=2)


def make_model(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Any nn.Module; gossamer passes one example's shape and the number of classes."""
    return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], 32), nn.ReLU(),
                         nn.Linear(32, num_classes))
