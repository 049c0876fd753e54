"""EMNIST (Cohen et al. 2017) from NIST's IDX files: `emnist-<split>-{train,test}-{images-idx3,labels-idx1}-ubyte`
(optionally `.gz`), as unpacked from NIST's `gzip.zip` (its folder `gzip/`).

Splits (`split`): `byclass` (62 classes: digits, upper- and lower-case letters), `bymerge` and `balanced` (47:
the lower-case letters that look like their capitals merged), `letters` (26), `digits` and `mnist` (10).

Two things differ from MNIST and are undone here:
- the images are stored transposed (each 28×28 image column-major): they are transposed back, so `x` holds them
  upright, as MNIST's are;
- `letters` labels are 1–26 on disk (a = 1): they are returned as 0–25 (a = 0), so labels index the classes.

Normalized with EMNIST's own pixel statistics, per split (`NORM`), not MNIST's: the source is NIST's, but EMNIST
converts it differently from MNIST (Gaussian blur, crop to the character's region, pad, resize to 28×28; Cohen et
al. 2017), and its pixels differ: a mean near 0.17 against MNIST's 0.13. The values are the mean and standard
deviation of pixel / 255 per split as published by PyTorch Lightning Bolts
(`pl_bolts/transforms/dataset_normalizations.py`, `emnist_normalization`), rounded to four places; fixed, like
MNIST's, so subsets and copies normalize alike. Download (`download=True`): NIST's `gzip.zip` (all splits, 0.5 GB),
checked against the MD5 torchvision and others pin for it (NIST lists no digest).
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

from pflbed.data import store
from pflbed.data.arrays import DataSource
from pflbed.data.mnist import idx_sizes, read_idx_pair, to_dataset
from pflbed.errors import DataError

NAME, TITLE = "emnist", "EMNIST"
TOPS = ("gzip", "EMNIST/raw")  # NIST's zip unpacked; torchvision.datasets.EMNIST(root)'s folder
# split -> (label range on disk [lo, hi), number of classes); letters' labels are shifted down by lo
SPLITS = {"byclass": ((0, 62), 62), "bymerge": ((0, 47), 47), "balanced": ((0, 47), 47), "letters": ((1, 27), 26),
          "digits": ((0, 10), 10), "mnist": ((0, 10), 10)}  # fmt: skip
# split -> (mean, std) of its pixels / 255 (see the module's docstring for the source)
NORM = {"byclass": (0.1736, 0.3316), "bymerge": (0.1736, 0.3316), "balanced": (0.1751, 0.3332),
        "letters": (0.1722, 0.3309), "digits": (0.1733, 0.3316), "mnist": (0.1733, 0.3317)}  # fmt: skip
REMOTE = store.Remote("https://biometrics.nist.gov/cs_links/EMNIST/gzip.zip", "md5:58c8d27c78d21e728a6bc7b3cc06412e")
HOW_TO_GET = (f"unzip {REMOTE.url} (its folder gzip/) into dataset.path or $PFLBED_DATA/{NAME}, "
              "or set dataset.download=true (0.5 GB)")  # fmt: skip


def files(split: str) -> dict[str, tuple[str, str]]:
    return {part: (f"emnist-{split}-{part}-images-idx3-ubyte", f"emnist-{split}-{part}-labels-idx1-ubyte")
            for part in ("train", "test")}  # fmt: skip


def _holds(split: str):
    return store.has_any(*(f for pair in files(split).values() for f in pair))


def find_emnist(path: str | os.PathLike[str] | None = None, split: str = "balanced") -> Path | None:
    return store.find(NAME, path, TOPS, _holds(split))


def sizes(directory: Path, split: str = "balanced") -> tuple[int, int]:
    return idx_sizes(directory, files(split), TITLE)


@lru_cache(maxsize=2)
def _load_cached(directory: str, split: str, stamp: tuple) -> DataSource:
    del stamp  # only part of the cache key
    d = Path(directory)
    (lo, hi), k = SPLITS[split]
    mean, std = NORM[split]
    out = {}
    for part, (images, labels) in files(split).items():
        x, y = read_idx_pair(store.file_in(d, images, TITLE), store.file_in(d, labels, TITLE), (lo, hi),
                             transpose=True)  # fmt: skip
        out[part] = to_dataset(x, y - lo, mean, std)
    return DataSource(name=f"{NAME}-{split}", train=out["train"], test=out["test"], num_classes=k, origin=directory,
                      pixel_norm=(mean, std), raw_scale=255.0)  # fmt: skip


def load_emnist(
    path: str | os.PathLike[str] | None = None, download: bool = False, split: str = "balanced"
) -> DataSource:
    """EMNIST `split` (default `balanced`): x float32 [N, 1, 28, 28], upright; y int64 0..classes−1 (letters:
    a = 0). The source is named `emnist-<split>`. Cached per unchanged files; read-only."""
    if split not in SPLITS:
        raise DataError(f"dataset.split: EMNIST splits are {', '.join(SPLITS)}; got {split!r}")
    directory = store.locate(NAME, TITLE, path, TOPS, _holds(split), HOW_TO_GET, download, (REMOTE,))
    paths = [store.file_in(directory, f, f"{TITLE} {split}") for pair in files(split).values() for f in pair]
    return _load_cached(str(directory), split, store.stamp(paths))
