"""CIFAR-10 and CIFAR-100 from the official "python version" archives (Krizhevsky 2009).

Layout, as unpacked from `cifar-10-python.tar.gz` / `cifar-100-python.tar.gz`:

- CIFAR-10: `cifar-10-batches-py/` with `data_batch_1` … `data_batch_5` (training, 10,000 images each) and
  `test_batch` (10,000);
- CIFAR-100: `cifar-100-python/` with `train` (50,000) and `test` (10,000).

Each file is a pickled dict: `data`, uint8 [N, 3072], one image per row as its red, green and blue 32×32 planes
(each row-major, top row first), so a row reshapes to [3, 32, 32] as is; and `labels` (CIFAR-10, 0–9) or
`fine_labels` (0–99) and `coarse_labels` (0–19, the 20 superclasses) for CIFAR-100. The files are read through
`safepickle`, which admits only what this format holds (a file that would call anything else is refused).

Downloads (`download=True`) are checked against the archives' MD5s as published on the CIFAR page, the only
digests it lists. Inputs are normalized with a fixed scalar mean/std per dataset: the pooled pixel statistics
implied by the published per-channel training-set means and standard deviations (constants, so any subset or
copy is normalized like the full set; a scalar, so `DataSource.pixel_norm` and the transform domains apply).
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from pflbed.data import store
from pflbed.data.arrays import ArrayDataset, DataSource
from pflbed.data.safepickle import as_str_keys, int_vector, load_pickle
from pflbed.errors import DataError

URL = "https://www.cs.toronto.edu/~kriz/"
SPECS = {
    "cifar10": {
        "title": "CIFAR-10",
        "top": "cifar-10-batches-py",
        "train": tuple(f"data_batch_{i}" for i in range(1, 6)),
        "test": ("test_batch",),
        "remote": store.Remote(URL + "cifar-10-python.tar.gz", "md5:c58f30108f718f92721af3b95e74349a"),
        # channel means (0.4914, 0.4822, 0.4465), stds (0.2470, 0.2435, 0.2616), pooled over the channels
        "norm": (0.4734, 0.2516),
    },
    "cifar100": {
        "title": "CIFAR-100",
        "top": "cifar-100-python",
        "train": ("train",),
        "test": ("test",),
        "remote": store.Remote(URL + "cifar-100-python.tar.gz", "md5:eb9058c3a382ffc7106e4002c42a8d85"),
        # channel means (0.5071, 0.4865, 0.4409), stds (0.2673, 0.2564, 0.2762), pooled over the channels
        "norm": (0.4782, 0.2682),
    },
}
# label option -> (pickle key, number of classes)
LABELS = {
    "cifar10": {"fine": ("labels", 10)},
    "cifar100": {"fine": ("fine_labels", 100), "coarse": ("coarse_labels", 20)},
}
SIDE = 32


def how_to_get(name: str) -> str:
    spec = SPECS[name]
    return (f"unpack {spec['remote'].url} (its folder {spec['top']}/) into dataset.path or $PFLBED_DATA/{name}, "
            "or set dataset.download=true")  # fmt: skip


def _holds(name: str):
    return lambda d: any((d / f).is_file() for f in (*SPECS[name]["train"], *SPECS[name]["test"]))


def find_cifar(name: str, path: str | os.PathLike[str] | None = None) -> Path | None:
    return store.find(name, path, (SPECS[name]["top"],), _holds(name))


def _batch(path: Path, label_key: str, num_classes: int, title: str) -> tuple[np.ndarray, np.ndarray]:
    """One pickled batch: (uint8 [n, 3072] rows, int64 [n] labels), each checked against the format."""
    batch = as_str_keys(load_pickle(path, title), path, title)
    missing = [k for k in ("data", label_key) if k not in batch]
    if missing:
        raise DataError(f"{path}: no {' or '.join(missing)} in this {title} batch (keys: {sorted(batch)})")
    data = batch["data"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * SIDE**2:
        got = f"{data.dtype} {list(data.shape)}" if isinstance(data, np.ndarray) else type(data).__name__
        raise DataError(f"{path}: data must be uint8 [N, 3072] (3 planes of 32×32), got {got}")
    labels = int_vector(batch[label_key])
    if labels is None:
        raise DataError(f"{path}: {label_key} is not a list of integers")
    if labels.shape != (len(data),):
        raise DataError(f"{path}: {len(data)} images but {labels.size} {label_key}")
    if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
        bad = int(labels.min() if labels.min() < 0 else labels.max())
        raise DataError(f"{path}: {label_key} value {bad} out of range 0..{num_classes - 1}")
    return data, labels


def _split(directory: Path, files: tuple[str, ...], label_key: str, num_classes: int, title: str,
           norm: tuple[float, float]) -> ArrayDataset:  # fmt: skip
    batches = [_batch(directory / f, label_key, num_classes, title) for f in files]
    n = sum(len(labels) for _, labels in batches)
    # Filled in place, one batch at a time: the peak is the float tensor plus one batch, not two copies of it.
    x = torch.empty((n, 3, SIDE, SIDE), dtype=torch.float32)
    start = 0
    for data, labels in batches:
        x[start : start + len(labels)] = torch.from_numpy(data).view(-1, 3, SIDE, SIDE)
        start += len(labels)
    mean, std = norm
    x.div_(255.0).sub_(mean).div_(std)
    return ArrayDataset(x=x, y=torch.from_numpy(np.concatenate([labels for _, labels in batches])))


@lru_cache(maxsize=4)
def _load_cached(name: str, directory: str, label: str, stamp: tuple) -> DataSource:
    del stamp  # only part of the cache key
    spec = SPECS[name]
    key, k = LABELS[name][label]
    d = Path(directory)
    return DataSource(
        name=name if label == "fine" else f"{name}-{label}",
        train=_split(d, spec["train"], key, k, spec["title"], spec["norm"]),
        test=_split(d, spec["test"], key, k, spec["title"], spec["norm"]),
        num_classes=k,
        origin=directory,
        pixel_norm=spec["norm"],
        raw_scale=255.0,
        raw_channels_last=True,
    )


def _load(name: str, path: str | os.PathLike[str] | None, download: bool, label: str) -> DataSource:
    spec = SPECS[name]
    if label not in LABELS[name]:
        raise DataError(f"dataset.label: {name} has labels {' or '.join(LABELS[name])}, got {label!r}")
    directory = store.locate(name, spec["title"], path, (spec["top"],), _holds(name), how_to_get(name),
                             download, (spec["remote"],))  # fmt: skip
    files = [store.file_in(directory, f, spec["title"], gz=False) for f in (*spec["train"], *spec["test"])]
    return _load_cached(name, str(directory), label, store.stamp(files))


def load_cifar10(path: str | os.PathLike[str] | None = None, download: bool = False) -> DataSource:
    """CIFAR-10: x float32 [N, 3, 32, 32] (50,000 train / 10,000 test), y int64 0–9, official split.

    Cached per unchanged files: repeated calls return the same object; treat it as read-only.
    """
    return _load("cifar10", path, download, "fine")


def load_cifar100(
    path: str | os.PathLike[str] | None = None, download: bool = False, label: str = "fine"
) -> DataSource:
    """CIFAR-100: x float32 [N, 3, 32, 32] (50,000 / 10,000); `label="fine"` (100 classes, default) or `"coarse"`
    (the 20 superclasses; the source is then named `cifar100-coarse`)."""
    return _load("cifar100", path, download, label)
