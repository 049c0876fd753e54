"""The model zoo: small classifiers sized from the data's input shape.

Fully connected sizes are computed by a dummy forward so every model works on 28×28 (Fashion-MNIST) and 8×8
(digits) inputs alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from pflbed.models.blocks import BlockNet


def _flat_size(layers: nn.Module, input_shape: tuple[int, ...]) -> int:
    with torch.no_grad():
        return int(layers(torch.zeros(1, *input_shape)).numel())


def mlp(input_shape: tuple[int, ...], num_classes: int, hidden: int = 200) -> BlockNet:
    """Two hidden layers of 200 units (the MLP of McMahan et al. 2017)."""
    d = math.prod(input_shape)
    return BlockNet(
        [
            ("fc1", nn.Sequential(nn.Flatten(), nn.Linear(d, hidden), nn.ReLU())),
            ("fc2", nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU())),
            ("classifier", nn.Linear(hidden, num_classes)),
        ]
    )


def _conv_block(cin: int, cout: int, k: int, pad: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, padding=pad), nn.ReLU(), nn.MaxPool2d(2))


def fedavg_cnn(input_shape: tuple[int, ...], num_classes: int) -> BlockNet:
    """The CNN of McMahan et al. 2017: conv5×5(32) → pool → conv5×5(64) → pool → FC 512 → FC classes."""
    c = input_shape[0]
    conv1, conv2 = _conv_block(c, 32, 5, 2), _conv_block(32, 64, 5, 2)
    flat = _flat_size(nn.Sequential(conv1, conv2), input_shape)
    return BlockNet(
        [
            ("conv1", conv1),
            ("conv2", conv2),
            ("fc1", nn.Sequential(nn.Flatten(), nn.Linear(flat, 512), nn.ReLU())),
            ("classifier", nn.Linear(512, num_classes)),
        ]
    )


def lenet5(input_shape: tuple[int, ...], num_classes: int) -> BlockNet:
    """LeNet-5 (LeCun et al. 1998): conv6 → pool → conv16 → pool → FC120 → FC84 → classes."""
    c = input_shape[0]
    conv1, conv2 = _conv_block(c, 6, 5, 2), _conv_block(6, 16, 5, 0 if input_shape[-1] >= 16 else 2)
    flat = _flat_size(nn.Sequential(conv1, conv2), input_shape)
    return BlockNet(
        [
            ("conv1", conv1),
            ("conv2", conv2),
            ("fc1", nn.Sequential(nn.Flatten(), nn.Linear(flat, 120), nn.ReLU())),
            ("fc2", nn.Sequential(nn.Linear(120, 84), nn.ReLU())),
            ("classifier", nn.Linear(84, num_classes)),
        ]
    )


MODELS: dict[str, Callable[[tuple[int, ...], int], BlockNet]] = {
    "mlp": mlp,
    "cnn": fedavg_cnn,
    "lenet5": lenet5,
}


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int) -> BlockNet:
    """Build a zoo model; its initial weights come from torch's global RNG, which the caller seeds."""
    try:
        factory = MODELS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {sorted(MODELS)}") from None
    return factory(input_shape, num_classes)
