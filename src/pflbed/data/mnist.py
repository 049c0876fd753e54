"""MNIST (LeCun et al. 1998) from its four IDX files, raw or gzipped.

Layout: `train-images-idx3-ubyte`, `train-labels-idx1-ubyte` (60,000), `t10k-images-idx3-ubyte`,
`t10k-labels-idx1-ubyte` (10,000), each optionally `.gz`, in one directory (also found under `MNIST/raw/`, where
torchvision keeps them). Downloads (`download=True`) come from PyTorch's mirror of the original files (the
original site no longer serves them reliably), each checked against its pinned SHA-256.

`read_idx_pair` is shared with EMNIST, which stores the same format.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from pflbed.data import store
from pflbed.data.arrays import ArrayDataset, DataSource
from pflbed.data.idx import read_idx, read_idx_shape
from pflbed.errors import DataError

NAME, TITLE = "mnist", "MNIST"
TOPS = ("MNIST/raw",)
FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
         "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}  # fmt: skip
MIRROR = "https://ossci-datasets.s3.amazonaws.com/mnist/"
SHA256 = {
    "train-images-idx3-ubyte.gz": "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
    "train-labels-idx1-ubyte.gz": "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
    "t10k-images-idx3-ubyte.gz": "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
    "t10k-labels-idx1-ubyte.gz": "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
}
# The training set's pixel statistics, fixed (as for Fashion-MNIST): subsets and copies normalize alike.
MEAN, STD = 0.1307, 0.3081
HOW_TO_GET = (f"put the four IDX files (from {MIRROR} or yann.lecun.com/exdb/mnist) into dataset.path or "
              f"$PFLBED_DATA/{NAME}, or set dataset.download=true")  # fmt: skip


def remotes() -> tuple[store.Remote, ...]:
    return tuple(store.Remote(MIRROR + name, f"sha256:{digest}") for name, digest in SHA256.items())


def _holds(directory: Path) -> bool:
    return store.has_any(*(f for pair in FILES.values() for f in pair))(directory)


def find_mnist(path: str | os.PathLike[str] | None = None) -> Path | None:
    return store.find(NAME, path, TOPS, _holds)


def idx_sizes(directory: Path, files: dict[str, tuple[str, str]], title: str) -> tuple[int, int]:
    """(train, test) sizes from the label files' headers alone (cheap: for listings)."""
    return tuple(read_idx_shape(store.file_in(directory, files[s][1], title))[0] for s in ("train", "test"))  # type: ignore[return-value]


def read_idx_pair(images_path: Path, labels_path: Path, labels_range: tuple[int, int], side: int = 28,
                  transpose: bool = False) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """uint8 images [N, side, side] (transposed per image when `transpose`) and int64 labels in
    `labels_range` = [lo, hi), checked against each other; errors name the offending file."""
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.dtype != np.uint8 or images.ndim != 3 or images.shape[1:] != (side, side):
        raise DataError(f"{images_path}: expected uint8 images [N, {side}, {side}], got {images.dtype} "
                        f"{list(images.shape)}")  # fmt: skip
    if labels.dtype != np.uint8 or labels.ndim != 1:
        raise DataError(f"{labels_path}: expected 1-D uint8 labels, got {labels.dtype} {list(labels.shape)}")
    if len(images) != len(labels):
        raise DataError(f"{images_path}: {len(images)} images but {labels_path.name} has {len(labels)} labels")
    lo, hi = labels_range
    if len(labels) and (int(labels.min()) < lo or int(labels.max()) >= hi):
        bad = int(labels.min()) if int(labels.min()) < lo else int(labels.max())
        raise DataError(f"{labels_path}: label {bad} out of range {lo}..{hi - 1}")
    if transpose:
        images = np.ascontiguousarray(images.transpose(0, 2, 1))
    return images, labels.astype(np.int64)


def to_dataset(images: np.ndarray, labels: np.ndarray, mean: float, std: float) -> ArrayDataset:
    x = torch.from_numpy(images).to(torch.float32).div_(255.0).sub_(mean).div_(std).unsqueeze(1)
    return ArrayDataset(x=x.contiguous(), y=torch.from_numpy(labels))


@lru_cache(maxsize=2)
def _load_cached(directory: str, stamp: tuple) -> DataSource:
    d = Path(directory)
    splits = {}
    for split, (images, labels) in FILES.items():
        pair = read_idx_pair(store.file_in(d, images, TITLE), store.file_in(d, labels, TITLE), (0, 10))
        splits[split] = to_dataset(*pair, MEAN, STD)
    return DataSource(name=NAME, train=splits["train"], test=splits["test"], num_classes=10, origin=directory,
                      pixel_norm=(MEAN, STD), raw_scale=255.0)  # fmt: skip


def load_mnist(path: str | os.PathLike[str] | None = None, download: bool = False) -> DataSource:
    """MNIST: x float32 [N, 1, 28, 28] (60,000 train / 10,000 test), y int64 0–9. Cached; read-only."""
    directory = store.locate(NAME, TITLE, path, TOPS, _holds, HOW_TO_GET, download, remotes())
    files = [store.file_in(directory, f, TITLE) for pair in FILES.values() for f in pair]
    return _load_cached(str(directory), store.stamp(files))
