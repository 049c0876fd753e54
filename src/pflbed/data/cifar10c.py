"""CIFAR-10-C (Hendrycks & Dietterich, ICLR 2019) as a cross-domain dataset: one domain per corruption.

Layout, as unpacked from `CIFAR-10-C.tar` (Zenodo record 2535967): `CIFAR-10-C/<corruption>.npy`, uint8
[50000, 32, 32, 3] (H, W, C): the 10,000 CIFAR-10 test images corrupted at severity 1, then the same images at
severity 2, … 5; and `labels.npy`, their 50,000 labels (the 10,000 test labels, once per severity). Reads take
only the chosen severity's block of each file (memory-mapped), never the whole file.

Options: `corruptions` (default: the 15 of the benchmark, `BENCHMARK`, in the order of `CORRUPTIONS`; the paper's
4 extra ones, `EXTRA`, meant for validation, only when named), each one domain, in the order given;
`severity` 1–5 (default 5, the level most robustness results report). All selected images form one pool in
`train`, with their corruption as domain label, and `test` is empty: the PFLBED protocol
(`federation.protocol=pflbed`) carves each domain's shared val and test sets out of the pool, as for image
folders. Normalized like CIFAR-10 (its constants), since the images are CIFAR-10 images.

Download (`download=True`): the 2.9 GB tar, checked against the MD5 Zenodo lists for it (its only digest).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from pflbed.data import store
from pflbed.data.arrays import ArrayDataset, DataSource
from pflbed.data.cifar import SPECS as CIFAR_SPECS
from pflbed.errors import DataError

NAME, TITLE, TOP = "cifar10c", "CIFAR-10-C", "CIFAR-10-C"
CORRUPTIONS = ("brightness", "contrast", "defocus_blur", "elastic_transform", "fog", "frost", "gaussian_blur",
               "gaussian_noise", "glass_blur", "impulse_noise", "jpeg_compression", "motion_blur", "pixelate",
               "saturate", "shot_noise", "snow", "spatter", "speckle_noise", "zoom_blur")  # fmt: skip
EXTRA = ("gaussian_blur", "saturate", "spatter", "speckle_noise")  # Hendrycks & Dietterich's held-out extras
BENCHMARK = tuple(c for c in CORRUPTIONS if c not in EXTRA)  # the 15 the benchmark reports
SEVERITIES = 5
REMOTE = store.Remote("https://zenodo.org/records/2535967/files/CIFAR-10-C.tar",
                      "md5:56bf5dcef84df0e2308c6dcbcbbd8499")  # fmt: skip
NORM = CIFAR_SPECS["cifar10"]["norm"]
HOW_TO_GET = (f"unpack {REMOTE.url} (its folder {TOP}/) into dataset.path or $PFLBED_DATA/{NAME}, "
              "or set dataset.download=true (2.9 GB)")  # fmt: skip


def _holds(directory: Path) -> bool:
    return (directory / "labels.npy").is_file()


def find_cifar10c(path: str | os.PathLike[str] | None = None) -> Path | None:
    return store.find(NAME, path, (TOP,), _holds)


def _open(path: Path) -> np.ndarray:
    """A memory map of an .npy file (no pickles); a missing or damaged file is a one-line error naming it."""
    if not path.is_file():
        raise DataError(f"{path}: no such file: the {TITLE} copy in {path.parent} is incomplete")
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise DataError(f"{path}: not a readable .npy file, truncated? ({store.one_line(exc)})") from None
    if not isinstance(array, np.ndarray):  # np.load opens a zip (.npz) archive whatever the file is called
        array.close()
        raise DataError(f"{path}: an .npz archive, not the .npy array {TITLE} ships")
    return array


def sizes(directory: Path) -> int:
    """Images per severity, from the header of `labels.npy` (cheap: for listings)."""
    labels = _open(directory / "labels.npy")
    if labels.ndim != 1 or len(labels) % SEVERITIES:
        raise DataError(f"{directory / 'labels.npy'}: expected 1-D labels, 5 severities × N, got {list(labels.shape)}")
    return len(labels) // SEVERITIES


@lru_cache(maxsize=2)
def _load_cached(directory: str, corruptions: tuple[str, ...], severity: int, stamp: tuple) -> DataSource:
    del stamp  # only part of the cache key
    d = Path(directory)
    n = sizes(d)
    block = slice((severity - 1) * n, severity * n)
    labels = np.asarray(_open(d / "labels.npy")[block])
    if not np.issubdtype(labels.dtype, np.integer) or (n and (labels.min() < 0 or labels.max() > 9)):
        raise DataError(f"{d / 'labels.npy'}: labels must be integers 0..9")
    x = torch.empty((n * len(corruptions), 3, 32, 32), dtype=torch.float32)
    for c, name in enumerate(corruptions):
        images = _open(d / f"{name}.npy")
        if images.dtype != np.uint8 or images.shape != (SEVERITIES * n, 32, 32, 3):
            raise DataError(f"{d / f'{name}.npy'}: expected uint8 [{SEVERITIES * n}, 32, 32, 3] (5 severities × "
                            f"{n} images, as labels.npy), got {images.dtype} {list(images.shape)}")  # fmt: skip
        try:
            x[c * n : (c + 1) * n] = torch.from_numpy(np.array(images[block])).permute(0, 3, 1, 2)
        except OSError as exc:
            raise DataError(f"{d / f'{name}.npy'}: cannot read ({store.one_line(exc)})") from None
    mean, std = NORM
    x.div_(255.0).sub_(mean).div_(std)
    y = torch.from_numpy(labels.astype(np.int64)).repeat(len(corruptions))
    domain = torch.arange(len(corruptions), dtype=torch.int64).repeat_interleave(n)
    empty = ArrayDataset(x=x[:0].clone(), y=y[:0].clone(), domain=domain[:0].clone())
    return DataSource(
        name=NAME if corruptions == BENCHMARK else f"{NAME}[{','.join(corruptions)}]",
        train=ArrayDataset(x=x, y=y, domain=domain),
        test=empty,
        num_classes=10,
        origin=directory,
        pixel_norm=NORM,
        domain_names=corruptions,
        raw_scale=255.0,
        raw_channels_last=True,
    )


def load_cifar10c(
    path: str | os.PathLike[str] | None = None, download: bool = False,
    corruptions: Sequence[str] | None = None, severity: int = 5,
) -> DataSource:  # fmt: skip
    """CIFAR-10-C at one severity: x float32 [N·|corruptions|, 3, 32, 32], domain = index into `corruptions`.

    Cached per (directory, files, corruptions, severity): repeated calls return the same object; read-only.
    """
    chosen = tuple(BENCHMARK if corruptions is None else corruptions)
    unknown = [c for c in chosen if c not in CORRUPTIONS]
    if unknown or not chosen or len(set(chosen)) != len(chosen):
        what = f"unknown {unknown}" if unknown else f"need one or more distinct corruptions, got {list(chosen)}"
        raise DataError(f"dataset.corruptions: {what}; {TITLE} has {', '.join(CORRUPTIONS)}")
    if isinstance(severity, bool) or not isinstance(severity, int) or not 1 <= severity <= SEVERITIES:
        raise DataError(f"dataset.severity: {TITLE} severities are 1..{SEVERITIES}, got {severity!r}")
    directory = store.locate(NAME, TITLE, path, (TOP,), _holds, HOW_TO_GET, download, (REMOTE,))
    files = [directory / "labels.npy", *(directory / f"{c}.npy" for c in chosen)]
    for f in files:
        _open(f)  # a missing or damaged file is named before anything is decoded
    return _load_cached(str(directory), chosen, severity, store.stamp(files))
