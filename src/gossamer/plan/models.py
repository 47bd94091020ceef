"""The models `gossamer plan` predicts for: by name, or any parameter count.

Only the parameters' shapes matter to the prediction (buckets, per-tensor compression, low-rank
factors), so each model here is a plain ``nn.Module`` holding its parameters and buffers in
the order a real one registers them, with no forward: the timing-only simulator builds it on
the ``meta`` device, where it costs no memory whatever its size.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["DIGITS_MLP", "MODELS", "mlp", "model_builder", "parameter_count", "resnet50",
           "transformer"]


class _Shapes(nn.Module):
    """Parameters (and BatchNorm-like buffers) of given shapes, registered in order."""

    def __init__(self, layers: list[tuple[str, tuple[int, ...], bool]]) -> None:
        super().__init__()
        for name, shape, is_buffer in layers:
            if is_buffer:
                self.register_buffer(name, torch.zeros(shape))
            else:
                self.register_parameter(name, nn.Parameter(torch.randn(shape) * 0.01))


def _batchnorm(name: str, width: int) -> list[tuple[str, tuple[int, ...], bool]]:
    return [(f"{name}_weight", (width,), False), (f"{name}_bias", (width,), False),
            (f"{name}_running_mean", (width,), True), (f"{name}_running_var", (width,), True)]


def resnet50() -> nn.Module:
    """ResNet-50's 25,557,032 parameters (161 tensors, torchvision's order) and its
    BatchNorm statistics; He et al., "Deep Residual Learning for Image Recognition" (2016)."""
    layers = [("conv1", (64, 3, 7, 7), False), *_batchnorm("bn1", 64)]
    width_in = 64
    for stage, (blocks, width) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512),
                                                strict=True)):
        for block in range(blocks):
            p = f"layer{stage + 1}_{block}"
            layers += [(f"{p}_conv1", (width, width_in, 1, 1), False),
                       *_batchnorm(f"{p}_bn1", width),
                       (f"{p}_conv2", (width, width, 3, 3), False),
                       *_batchnorm(f"{p}_bn2", width),
                       (f"{p}_conv3", (4 * width, width, 1, 1), False),
                       *_batchnorm(f"{p}_bn3", 4 * width)]
            if block == 0:
                layers += [(f"{p}_downsample", (4 * width, width_in, 1, 1), False),
                           *_batchnorm(f"{p}_downsample_bn", 4 * width)]
            width_in = 4 * width
    layers += [("fc_weight", (1000, 2048), False), ("fc_bias", (1000,), False)]
    return _Shapes(layers)


def transformer(parameters: int) -> nn.Module:
    """A stand-in of exactly ``parameters`` parameters shaped like a transformer: blocks of
    four d x d attention matrices and a d x 4d, 4d x d MLP (12 d^2 each), the rest in one
    embedding-like tensor; d is the power of two that gives at least 4 blocks (at most 4096)."""
    if parameters < 1:
        raise ValueError(f"parameters must be >= 1, got {parameters}")
    d = 2 ** max(3, min(12, int(math.log2(math.sqrt(parameters / 48)))))
    blocks = parameters // (12 * d * d)
    layers: list[tuple[str, tuple[int, ...], bool]] = []
    rest = parameters - blocks * 12 * d * d
    if rest:
        layers.append(("embedding", (rest,), False))
    for b in range(blocks):
        layers += [(f"block{b}_{name}", shape, False) for name, shape in (
            ("q", (d, d)), ("k", (d, d)), ("v", (d, d)), ("o", (d, d)),
            ("up", (4 * d, d)), ("down", (d, 4 * d)))]
    return _Shapes(layers)


DIGITS_MLP = (64, 128, 10)  # 9,610 parameters: the digits task's MLP


def mlp(*widths: int) -> nn.Sequential:
    """An MLP of ``widths`` (Linear layers with a ReLU between them), initialised from
    ``torch.manual_seed(0)``.

    Every worker that builds it starts from the same model, as a broadcast would give. The
    global generator is seeded on purpose: some benchmarks then draw their fixed batch from it,
    and their published figures were measured that way.

    Example::

        model = mlp(*DDP_MLP)  # 784-1024-256-10
    """
    if len(widths) < 2:
        raise ValueError(f"widths must name at least an input and an output, got {widths}")
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(len(widths) - 1):
        layers.append(nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _digits_mlp() -> nn.Module:
    return mlp(*DIGITS_MLP)


#: name -> (builder, what it is)
MODELS: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "digits-mlp": (_digits_mlp, "the digits task's MLP 64-128-10 (9,610 parameters)"),
    "resnet50": (resnet50, "ResNet-50 (25.6M parameters, 161 tensors, BatchNorm)"),
    "gpt-1b": (lambda: transformer(10**9), "a 1B-parameter transformer stand-in (d = 4096)"),
}

_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9}


def parameter_count(text: str) -> int | None:
    """``"25.6M"``, ``"1e9"``, ``"1B"`` or ``"350000"`` as a number of parameters; None
    if ``text`` is not a count."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbg]?)\s*", text.lower())
    if match is None:
        return None
    return int(round(float(match.group(1)) * _SUFFIX[match.group(2)]))


def model_builder(model: str) -> tuple[Callable[[], nn.Module], str]:
    """(builder, label) for a model name of :data:`MODELS` or a parameter count (a
    :func:`transformer` stand-in); ValueError naming ``model`` otherwise."""
    if model in MODELS:
        return MODELS[model][0], model
    count = parameter_count(model)
    if count is None or count < 1:
        raise ValueError(f"model must be one of {', '.join(MODELS)} or a parameter count "
                         f"such as 25.6M or 1e9, got {model!r}")
    return (lambda: transformer(count)), f"{count:,} parameters"
