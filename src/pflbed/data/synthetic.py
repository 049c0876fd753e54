"""Class-conditional Gaussian data: instant, deterministic and learnable, for tests and engine smoke runs.

Each class has a random mean; samples are that mean plus unit Gaussian noise. Means are drawn with per-
coordinate scale `separation * sqrt(2 / D)`, which makes the typical distance between two class means about
`2 * separation` noise standard deviations whatever the input size: separation=2 gives a problem a linear
model learns well but not perfectly, so algorithm differences remain visible.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch

from pflbed.data.arrays import ArrayDataset, DataSource
from pflbed.errors import DataError

ORIGIN = "generated"


CHUNK_VALUES = 2**22  # float64 values drawn at a time: 32 MiB beside the float32 samples


def _dataset(labels: np.ndarray, means: np.ndarray, shape: tuple[int, ...], rng: np.random.Generator) -> ArrayDataset:
    """Each sample its class mean plus noise, drawn in row chunks into float32: the draws (and so the samples) are
    those of one draw of all rows, but the float64 working set stays a chunk, not three times the data (4 GiB of
    samples would have needed 24 GiB more)."""
    dim = means.shape[1]
    x = np.empty((len(labels), dim), dtype=np.float32)
    rows = max(1, CHUNK_VALUES // dim)
    for start in range(0, len(labels), rows):
        part = labels[start : start + rows]
        x[start : start + len(part)] = means[part] + rng.standard_normal((len(part), dim))
    return ArrayDataset(x=torch.from_numpy(x.reshape((len(labels), *shape))),
                        y=torch.from_numpy(labels.astype(np.int64)))


@lru_cache(maxsize=16)
def _generate(
    num_classes: int, n_train: int, n_test: int, shape: tuple[int, ...], seed: int, separation: float
) -> DataSource:
    rng = np.random.default_rng(seed)
    dim = math.prod(shape)
    means = rng.standard_normal((num_classes, dim)) * (separation * math.sqrt(2.0 / dim))
    # Train: as balanced as n_train allows, in random order. Test: exactly n_test // num_classes per class.
    train_labels = rng.permutation(np.arange(n_train) % num_classes)
    test_labels = np.repeat(np.arange(num_classes), n_test // num_classes)
    return DataSource(
        name="synthetic",
        train=_dataset(train_labels, means, shape, rng),
        test=_dataset(test_labels, means, shape, rng),
        num_classes=num_classes,
        origin=ORIGIN,
    )


def make_synthetic(
    num_classes: int = 10,
    n_train: int = 2000,
    n_test: int = 500,
    shape: Sequence[int] = (1, 8, 8),
    seed: int = 0,
    separation: float = 2.0,
) -> DataSource:
    """Gaussian classes of the given input `shape`; the test split is class-balanced (n_test rounded down).

    Same arguments give the same object (cached), so callers must not modify its tensors.
    """
    shape = tuple(int(s) for s in shape)
    if num_classes < 2:
        raise DataError(f"synthetic: num_classes must be at least 2, got {num_classes}")
    if n_train < num_classes:
        raise DataError(f"synthetic: n_train ({n_train}) must be at least num_classes ({num_classes})")
    if n_test < num_classes:
        raise DataError(f"synthetic: n_test ({n_test}) must be at least num_classes ({num_classes})")
    if not shape or any(s < 1 for s in shape):
        raise DataError(f"synthetic: shape must be non-empty positive sizes, got {list(shape)}")
    if separation < 0:
        raise DataError(f"synthetic: separation must be >= 0, got {separation}")
    return _generate(int(num_classes), int(n_train), int(n_test), shape, int(seed), float(separation))
