"""miniImageNet (Vinyals et al. 2016; the class split of Ravi & Larochelle 2017) from the cache pickles.

Layout: `mini-imagenet-cache-train.pkl`, `-val.pkl`, `-test.pkl` (64 / 16 / 20 classes of 600 images), each a
pickled dict `{"image_data": uint8 [N, 84, 84, 3], "class_dict": {wnid: [row indices]}}`.

Why this layout: it is the most widely mirrored form of the dataset (the files learn2learn and many few-shot and
federated codebases download) and it is pixel-exact: the images are already cropped and resized to 84×84, so two
copies give identical tensors. The alternative — Ravi & Larochelle's CSV split files plus the images — needs the
full ImageNet training set and leaves the resize to each reader, so copies differ. The pickles are read through
`safepickle` (arrays and containers only; a file that would call anything else is refused).

The few-shot splits are class-disjoint, which classification cannot use, so all 100 classes are pooled (class
`c` = the c-th wnid in sorted order) and each class's last `TEST_FRACTION` (1/6: 100 of 600) images, in
`class_dict` order, form `test`, the rest `train` (50,000 / 10,000). There is no official archive (the data
derive from ImageNet, under its terms), so `download=True` only says where to get the files. Inputs are scaled to
[−1, 1] with the fixed (0.5, 0.5) used for image folders.
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

NAME, TITLE = "miniimagenet", "miniImageNet"
TOPS = ("mini-imagenet",)
# Each split's pickle, under every name its published copies give it: the validation split is `-val` in the cache's
# first release and in most copies of it, `-validation` where learn2learn and Zenodo serve it.
NAMES = (("mini-imagenet-cache-train.pkl",), ("mini-imagenet-cache-val.pkl", "mini-imagenet-cache-validation.pkl"),
         ("mini-imagenet-cache-test.pkl",))
TEST_FRACTION = 1 / 6
MEAN, STD = 0.5, 0.5
HOW_TO_GET = (f"put {NAMES[0][0]}, {NAMES[1][0]} (or {NAMES[1][1]}), {NAMES[2][0]} (the miniImageNet cache "
              f"pickles, e.g. as learn2learn downloads them) into dataset.path or $PFLBED_DATA/{NAME}")  # fmt: skip


def _holds(directory: Path) -> bool:
    return any(f.is_file() for f in _files(directory))


def _files(directory: Path) -> list[Path]:
    """Each split's pickle in `directory`: the first of its names that is there, else its first name (the one a
    refusal names)."""
    return [next((directory / f for f in names if (directory / f).is_file()), directory / names[0]) for names in NAMES]


def find_miniimagenet(path: str | os.PathLike[str] | None = None) -> Path | None:
    return store.find(NAME, path, TOPS, _holds)


def _read(path: Path) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    blob = as_str_keys(load_pickle(path, TITLE), path, TITLE)
    images, classes = blob.get("image_data"), blob.get("class_dict")
    if not isinstance(images, np.ndarray) or images.dtype != np.uint8 or images.ndim != 4 or images.shape[3] != 3:
        got = f"{images.dtype} {list(images.shape)}" if isinstance(images, np.ndarray) else type(images).__name__
        raise DataError(f"{path}: image_data must be uint8 [N, H, W, 3], got {got}")
    if images.shape[1] != images.shape[2]:
        raise DataError(f"{path}: image_data must hold square images, got {list(images.shape[1:3])}")
    if not isinstance(classes, dict) or not classes:
        raise DataError(f"{path}: class_dict must map each wnid to its rows of image_data")
    out, seen = {}, np.zeros(len(images), dtype=bool)
    for wnid, rows in classes.items():
        idx = int_vector(rows)
        if idx is None:
            raise DataError(f"{path}: class_dict[{wnid!r}] is not a list of row indices")
        if len(idx) and (idx.min() < 0 or idx.max() >= len(images)):
            raise DataError(f"{path}: class_dict[{wnid!r}] points past image_data's {len(images)} rows")
        if seen[idx].any():
            raise DataError(f"{path}: class_dict[{wnid!r}] shares rows with another class")
        seen[idx] = True
        out[str(wnid)] = idx
    return images, out


@lru_cache(maxsize=1)
def _load_cached(directory: str, files: tuple[str, ...], stamp: tuple) -> DataSource:
    del stamp  # only part of the cache key
    parts = [(Path(f), *_read(Path(f))) for f in files]
    sides = {images.shape[1] for _, images, _ in parts}
    if len(sides) != 1:
        raise DataError(f"{directory}: the three files hold images of different sizes {sorted(sides)}")
    owner: dict[str, Path] = {}
    for path, _, classes in parts:
        for wnid in classes:
            if wnid in owner:
                raise DataError(f"{path}: class {wnid} is also in {owner[wnid].name} (the splits are class-disjoint)")
            owner[wnid] = path
    index = {w: i for i, w in enumerate(sorted(owner))}
    rows: dict[str, list[tuple[int, int, int]]] = {"train": [], "test": []}  # (part, row, class)
    for p, (_, _, classes) in enumerate(parts):
        for wnid, idx in classes.items():
            k = round(TEST_FRACTION * len(idx))
            rows["train"] += [(p, int(r), index[wnid]) for r in idx[: len(idx) - k]]
            rows["test"] += [(p, int(r), index[wnid]) for r in idx[len(idx) - k :]]
    side = sides.pop()
    splits = {}
    for name, chosen in rows.items():
        chosen.sort(key=lambda t: (t[2], t[0], t[1]))
        x = torch.empty((len(chosen), 3, side, side), dtype=torch.float32)
        for i, (p, r, _) in enumerate(chosen):  # row by row: no second full-size copy at the peak
            x[i] = torch.from_numpy(parts[p][1][r]).permute(2, 0, 1)
        x.div_(255.0).sub_(MEAN).div_(STD)
        splits[name] = ArrayDataset(x=x, y=torch.tensor([t[2] for t in chosen], dtype=torch.int64))
    return DataSource(name=NAME, train=splits["train"], test=splits["test"], num_classes=len(index), origin=directory,
                      pixel_norm=(MEAN, STD), raw_scale=255.0, raw_channels_last=True)  # fmt: skip


def load_miniimagenet(path: str | os.PathLike[str] | None = None, download: bool = False) -> DataSource:
    """miniImageNet, 100 classes pooled: x float32 [N, 3, 84, 84], 50,000 train / 10,000 test. Cached; read-only."""
    directory = store.locate(NAME, TITLE, path, TOPS, _holds, HOW_TO_GET, download)
    files = _files(directory)
    missing = next((f for f in files if not f.is_file()), None)
    if missing is not None:
        raise DataError(f"{missing}: no such file: the {TITLE} copy in {directory} is incomplete")
    return _load_cached(str(directory), tuple(map(str, files)), store.stamp(files))
