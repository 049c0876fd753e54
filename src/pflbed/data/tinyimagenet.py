"""Tiny ImageNet (Stanford CS231n): 200 ImageNet classes at 64×64, from the official `tiny-imagenet-200.zip`.

Layout (`tiny-imagenet-200/`): `wnids.txt` (the 200 class ids, one a line); `train/<wnid>/images/*.JPEG` (500 per
class); `val/images/*.JPEG` with `val/val_annotations.txt` (tab-separated: file name, wnid, bounding box), 50 per
class; `test/` has no labels and is not read. The labelled validation set is the `test` split, as is usual.

Class `c` is the c-th wnid in sorted order (the order of an image-folder listing of `train/`), whatever the
order of `wnids.txt`. Images are decoded with Pillow to RGB (a few are greyscale JPEGs) and kept at 64×64 unless
`image_size` asks for another square size. Inputs are scaled to [−1, 1] with the fixed (0.5, 0.5) used for image
folders. Download (`download=True`): the official zip, checked against the MD5 widely pinned for it (the course
page lists no digest).
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from pflbed.data import store
from pflbed.data.arrays import ArrayDataset, DataSource
from pflbed.errors import DataError
from pflbed.memory import check_decoded

NAME, TITLE, TOP = "tinyimagenet", "Tiny ImageNet", "tiny-imagenet-200"
REMOTE = store.Remote("http://cs231n.stanford.edu/tiny-imagenet-200.zip", "md5:90528d7ca1a48142e341f4ef8d21d0de")
NATIVE = 64
MEAN, STD = 0.5, 0.5
IMAGE_EXTENSIONS = frozenset({".jpeg", ".jpg", ".png"})
HOW_TO_GET = (f"unzip {REMOTE.url} (its folder {TOP}/) into dataset.path or $PFLBED_DATA/{NAME}, "
              "or set dataset.download=true (0.25 GB)")  # fmt: skip
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError, UnidentifiedImageError)


def _holds(directory: Path) -> bool:
    return (directory / "wnids.txt").is_file()


def find_tinyimagenet(path: str | os.PathLike[str] | None = None) -> Path | None:
    return store.find(NAME, path, (TOP,), _holds)


def _read_text(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise DataError(f"{path}: no such file: the {TITLE} copy in {path.parent} is incomplete") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read ({store.one_line(exc)})") from None


def _images_in(folder: Path) -> list[Path]:
    if not folder.is_dir():
        raise DataError(f"{folder}: no such folder: the {TITLE} copy is incomplete")
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS and not p.name.startswith("."))


def scan(directory: Path) -> tuple[tuple[str, ...], list[tuple[str, int]], list[tuple[str, int]]]:
    """(sorted wnids, train (file, class) pairs, val (file, class) pairs) from the listing alone: no image opened."""
    wnids = [w.strip() for w in _read_text(directory / "wnids.txt") if w.strip()]
    if not wnids or len(set(wnids)) != len(wnids):
        raise DataError(f"{directory / 'wnids.txt'}: needs one or more distinct class ids, one a line")
    classes = tuple(sorted(wnids))
    index = {w: i for i, w in enumerate(classes)}
    train_root = directory / "train"
    listed = sorted(train_root.iterdir()) if train_root.is_dir() else []
    extra = [p.name for p in listed if p.is_dir() and p.name not in index]
    if extra:
        raise DataError(f"{train_root / extra[0]}: class folder not listed in {directory / 'wnids.txt'}")
    train: list[tuple[str, int]] = []
    for w in classes:
        files = _images_in(train_root / w / "images")
        if not files:
            raise DataError(f"{train_root / w / 'images'}: no images")
        train += [(str(p), index[w]) for p in files]
    val: list[tuple[str, int]] = []
    annotations = directory / "val" / "val_annotations.txt"
    for n, line in enumerate(_read_text(annotations), 1):
        fields = line.split("\t")
        if not line.strip():
            continue
        if len(fields) < 2 or fields[1] not in index:
            raise DataError(f"{annotations}:{n}: expected <file>\\t<wnid listed in wnids.txt>…, got {line[:80]!r}")
        if not store.is_file_name(fields[0]):
            raise DataError(f"{annotations}:{n}: the image must be a file name in val/images/, got {fields[0][:80]!r}")
        image = directory / "val" / "images" / fields[0]
        if not image.is_file():
            raise DataError(f"{image}: no such file (listed in {annotations}:{n})")
        val.append((str(image), index[fields[1]]))
    return classes, train, sorted(val)


def _decode(path: str, size: int) -> np.ndarray:
    try:
        with Image.open(path) as img:
            img.load()
            rgb = img.convert("RGB")
            if rgb.size != (size, size):
                rgb = rgb.resize((size, size), Image.Resampling.BILINEAR)
            return np.array(rgb, dtype=np.uint8)
    except _DECODE_ERRORS as exc:
        raise DataError(f"{path}: cannot read image ({store.one_line(exc)})") from None


def _split(files: list[tuple[str, int]], size: int) -> ArrayDataset:
    x = torch.empty((len(files), 3, size, size), dtype=torch.float32)
    for i, (path, _) in enumerate(files):
        x[i] = torch.from_numpy(_decode(path, size)).permute(2, 0, 1)
    x.div_(255.0).sub_(MEAN).div_(STD)
    return ArrayDataset(x=x, y=torch.tensor([c for _, c in files], dtype=torch.int64))


@lru_cache(maxsize=2)
def _load_cached(directory: str, image_size: int, stamp: tuple) -> DataSource:
    del stamp  # only part of the cache key
    classes, train, val = scan(Path(directory))
    check_decoded(len(train) + len(val), image_size, f"{TITLE}'s {len(train) + len(val):,} images")
    return DataSource(name=NAME, train=_split(train, image_size), test=_split(val, image_size),
                      num_classes=len(classes), origin=directory, pixel_norm=(MEAN, STD), raw_scale=255.0,
                      raw_channels_last=True)  # fmt: skip


def load_tinyimagenet(
    path: str | os.PathLike[str] | None = None, download: bool = False, image_size: int = NATIVE
) -> DataSource:
    """Tiny ImageNet: x float32 [N, 3, S, S] (S = `image_size`, default 64), 100,000 train / 10,000 test (the
    labelled val set), y int64 in sorted-wnid order. Cached per unchanged listing; read-only."""
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 1:
        raise DataError(f"dataset.image_size: a positive integer, got {image_size!r}")
    directory = store.locate(NAME, TITLE, path, (TOP,), _holds, HOW_TO_GET, download, (REMOTE,))
    _, train, val = scan(directory)
    return _load_cached(str(directory), image_size, store.stamp(Path(p) for p, _ in (*train, *val)))
