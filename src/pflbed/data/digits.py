"""scikit-learn's bundled 8x8 handwritten digits: a real image dataset that needs no files and no network.

It ships with scikit-learn, so it is the dataset that always works (CI, smoke tests, first runs). It has no
official split, so the test split is drawn here: class-balanced and seeded, which keeps per-class test
accuracy comparable across classes and runs.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from pflbed.data.arrays import ArrayDataset, DataSource
from pflbed.errors import DataError

# Pixel statistics of all 1797 images after /16, computed once and frozen so that normalization does not
# depend on the split or seed.
MEAN = 0.3053
STD = 0.3760
NUM_CLASSES = 10
ORIGIN = "scikit-learn (bundled)"
SAMPLES = 1797  # the bundled file's images (`pflbed data list` counts them without importing scikit-learn)
TEST_PER_CLASS = 30


def _raw() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits  # local import: scikit-learn is slow to import

    bunch = load_digits()
    return np.asarray(bunch.images, dtype=np.float64), np.asarray(bunch.target, dtype=np.int64)


def _to_dataset(images: np.ndarray, labels: np.ndarray) -> ArrayDataset:
    x = torch.from_numpy(((images / 16.0 - MEAN) / STD).astype(np.float32)).unsqueeze(1)
    return ArrayDataset(x=x.contiguous(), y=torch.from_numpy(labels.copy()))


def load_digits_source(test_per_class: int = TEST_PER_CLASS, seed: int = 0) -> DataSource:
    """Digits as float32 [N, 1, 8, 8] with `test_per_class` test samples of every class, the rest train.

    The test indices are a seeded per-class permutation; both splits keep the original sample order.
    Cached per arguments, so callers must not modify the returned tensors.
    """
    return _build(int(test_per_class), int(seed))


@lru_cache(maxsize=8)
def _build(test_per_class: int, seed: int) -> DataSource:
    images, labels = _raw()
    counts = np.bincount(labels, minlength=NUM_CLASSES)
    if not 0 < test_per_class < int(counts.min()):
        raise DataError(
            f"digits: test_per_class must be between 1 and {int(counts.min()) - 1} "
            f"(the smallest class has {int(counts.min())} samples), got {test_per_class}"
        )
    rng = np.random.default_rng(seed)
    is_test = np.zeros(len(labels), dtype=bool)
    for c in range(NUM_CLASSES):
        members = np.flatnonzero(labels == c)
        is_test[rng.permutation(members)[:test_per_class]] = True
    return DataSource(
        name="digits",
        train=_to_dataset(images[~is_test], labels[~is_test]),
        test=_to_dataset(images[is_test], labels[is_test]),
        num_classes=NUM_CLASSES,
        origin=ORIGIN,
        pixel_norm=(MEAN, STD),
        raw_scale=16.0,
    )
