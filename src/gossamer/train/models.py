"""Models written in the project (no torchvision needed)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


class MLP(nn.Module):
    """A multi-layer perceptron with ReLU, for flat inputs such as digits' 64 pixels."""

    def __init__(self, in_features: int, num_classes: int, hidden: Sequence[int] = (128,)):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x):  # noqa: D102
        return self.net(x)


def build_model(name: str, input_shape: Sequence[int], num_classes: int) -> nn.Module:
    """A model by name for the given input shape; ValueError listing the known names."""
    features = 1
    for d in input_shape:
        features *= d
    if name == "mlp":
        return MLP(features, num_classes)
    raise ValueError(f"model {name!r} is unknown; known: mlp")
