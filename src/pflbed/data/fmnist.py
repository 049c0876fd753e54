"""Fashion-MNIST from local IDX files, with an explicit, checksum-verified download.

Loading never touches the network unless asked to (`download=True`): experiments must be reproducible offline
and a silent 30 MB fetch inside a training run is a surprise. The directory is looked up in a fixed order, so
`origin` always tells which copy a run used:

1. the `path` argument;
2. `$PFLBED_DATA` (the directory itself, `$PFLBED_DATA/fashion-mnist` or torchvision's
   `$PFLBED_DATA/FashionMNIST/raw`);
3. `/usr/share/datasets/fashion-mnist` (Debian/Ubuntu package `dataset-fashion-mnist`);
4. the download cache, `$PFLBED_CACHE/fashion-mnist` or `~/.cache/pflbed/fashion-mnist`.

A directory qualifies when it holds all four files, each raw, gzipped or under the dotted name unpackers give
them (`store.spellings`). With an explicit `path`, its `fashion-mnist/` and `FashionMNIST/raw/` are tried too.
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

BASE_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
SUBDIR = "fashion-mnist"
TORCHVISION = Path("FashionMNIST", "raw")  # where torchvision.datasets.FashionMNIST(root) keeps the files

# (images, labels) file stems per split, as distributed upstream.
FILES: dict[str, tuple[str, str]] = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}

# SHA-256 of the official .gz files at BASE_URL. Their MD5s match the ones published in the upstream README.
# The Debian package ships the same deflate streams but with the gzip header normalized (file name dropped,
# mtime reset by strip-nondeterminism), so its .gz bytes hash differently; that is why local files are
# validated structurally by the IDX reader and only downloads are checked against these digests.
SHA256: dict[str, str] = {
    "train-images-idx3-ubyte.gz": "3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84",
    "train-labels-idx1-ubyte.gz": "a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845",
    "t10k-images-idx3-ubyte.gz": "346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073",
    "t10k-labels-idx1-ubyte.gz": "67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5",
}

# Fixed normalization (training-set pixel statistics): constants rather than per-load statistics so that a
# subset, a different copy or a test fixture is normalized exactly like the full dataset.
MEAN = 0.2860
STD = 0.3530
NUM_CLASSES = 10
IMAGE_SIZE = 28

HOW_TO_GET = (
    "install it with `apt-get install dataset-fashion-mnist`, point PFLBED_DATA at a directory holding "
    "the four IDX files, or load with download=True"
)


def cache_dir() -> Path:
    """Where downloads go: `$PFLBED_CACHE/fashion-mnist`, else `~/.cache/pflbed/fashion-mnist`."""
    root = os.environ.get("PFLBED_CACHE") or str(Path.home() / ".cache" / "pflbed")
    return Path(root).expanduser() / SUBDIR


def _file_in(directory: Path, stem: str) -> Path | None:
    """The file under the first of its `store.spellings` present: raw (cheaper to read), gzipped, dotted."""
    for name in store.spellings(stem):
        candidate = directory / name
        if candidate.is_file():
            return candidate
    return None


def _files_in(directory: Path) -> dict[str, Path] | None:
    found = {stem: _file_in(directory, stem) for pair in FILES.values() for stem in pair}
    if any(p is None for p in found.values()):
        return None
    return {stem: p for stem, p in found.items() if p is not None}


def _with_subdir(directory: Path) -> list[Path]:
    """The directory itself, its `fashion-mnist/`, and torchvision's layout, `FashionMNIST/raw/`."""
    return [directory, directory / SUBDIR, directory / TORCHVISION]


def _candidates(path: str | os.PathLike[str] | None) -> list[Path]:
    """Directories to try, in order; an explicit `path` is authoritative and disables the fallbacks."""
    if path is not None:
        return _with_subdir(Path(path).expanduser())
    dirs: list[Path] = []
    env = os.environ.get("PFLBED_DATA")
    if env:
        dirs += _with_subdir(Path(env).expanduser())
    dirs += [DEBIAN_DIR, cache_dir()]
    return dirs


def _describe_miss(directory: Path) -> str:
    if not directory.is_dir():
        return f"{directory} (no such directory)"
    present = sum(_file_in(directory, stem) is not None for pair in FILES.values() for stem in pair)
    return f"{directory} ({present} of 4 files)"


def find_fmnist(path: str | os.PathLike[str] | None = None) -> Path | None:
    """The first directory in the look-up order that holds all four files, or None; never downloads."""
    for directory in _candidates(path):
        if _files_in(directory) is not None:
            return directory
    return None


def fmnist_sizes(directory: Path) -> tuple[int, int]:
    """(train, test) sample counts read from the label headers only, for cheap listings."""
    files = _files_in(directory)
    if files is None:
        raise DataError(f"{directory}: not a complete Fashion-MNIST directory")
    return tuple(read_idx_shape(files[FILES[s][1]])[0] for s in ("train", "test"))  # type: ignore[return-value]


def remotes() -> list[store.Remote]:
    """The four official files, each with its pinned SHA-256 (read at call time: tests point BASE_URL elsewhere)."""
    return [store.Remote(BASE_URL + name, f"sha256:{digest}") for name, digest in SHA256.items()]


def download_fmnist(dest_dir: str | os.PathLike[str] | None = None) -> Path:
    """Download the four official .gz files into `dest_dir` (default: `cache_dir()`) and return it.

    Through pooch (`store.fetch`): each file goes to a temporary name, is checked against its pinned SHA-256 and
    only then renamed into place, so an interrupted or tampered download never leaves a file that a later load
    would pick up; a failure removes whatever this call wrote. Files already present with the right digest are
    kept, not fetched again.
    """
    return store.fetch(remotes(), Path(dest_dir).expanduser() if dest_dir is not None else cache_dir())


def _split(files: dict[str, Path], split: str) -> ArrayDataset:
    image_stem, label_stem = FILES[split]
    images, labels = read_idx(files[image_stem]), read_idx(files[label_stem])
    image_path, label_path = files[image_stem], files[label_stem]
    if images.dtype != np.uint8 or images.ndim != 3 or images.shape[1:] != (IMAGE_SIZE, IMAGE_SIZE):
        raise DataError(
            f"{image_path}: expected uint8 images of shape [N, 28, 28], got {images.dtype} {list(images.shape)}"
        )
    if labels.dtype != np.uint8 or labels.ndim != 1:
        raise DataError(f"{label_path}: expected 1-D uint8 labels, got {labels.dtype} {list(labels.shape)}")
    if len(images) != len(labels):
        raise DataError(f"{image_path}: {len(images)} images but {label_path.name} has {len(labels)} labels")
    if len(labels) and int(labels.max()) >= NUM_CLASSES:
        raise DataError(f"{label_path}: label {int(labels.max())} out of range 0..{NUM_CLASSES - 1}")
    x = torch.from_numpy(images).to(torch.float32).div_(255.0).sub_(MEAN).div_(STD).unsqueeze(1)
    y = torch.from_numpy(labels).to(torch.int64)
    return ArrayDataset(x=x.contiguous(), y=y)


@lru_cache(maxsize=4)
def _load_cached(directory: str, stamp: tuple[tuple[str, int, int], ...]) -> DataSource:
    """Decode once per (directory, file identity); `stamp` makes a replaced file miss the cache."""
    files = _files_in(Path(directory))
    if files is None:  # removed between look-up and load
        raise DataError(f"{directory}: Fashion-MNIST files disappeared while loading")
    return DataSource(
        name="fmnist",
        train=_split(files, "train"),
        test=_split(files, "test"),
        num_classes=NUM_CLASSES,
        origin=directory,
        pixel_norm=(MEAN, STD),
        raw_scale=255.0,
    )


def _stamp(files: dict[str, Path]) -> tuple[tuple[str, int, int], ...]:
    stats = [(str(p), p.stat()) for p in files.values()]
    return tuple((name, st.st_mtime_ns, st.st_size) for name, st in sorted(stats))


def load_fmnist(path: str | os.PathLike[str] | None = None, download: bool = False) -> DataSource:
    """Load Fashion-MNIST: images float32 [N, 1, 28, 28] normalized with fixed mean/std, labels int64.

    With `download=True` and nothing found, the files are fetched into `path` (when given) or `cache_dir()`.
    Repeated calls for the same unchanged files return the same object: callers must not modify its tensors.
    """
    directory = find_fmnist(path)
    if directory is None and download:
        try:
            directory = download_fmnist(path)
        except DataError as exc:
            raise store.download_failed("fmnist", "Fashion-MNIST", HOW_TO_GET, exc) from None
    if directory is None:
        looked = "; ".join(_describe_miss(d) for d in _candidates(path))
        raise DataError(f"dataset fmnist (Fashion-MNIST) not found (looked in: {looked}); {HOW_TO_GET}")
    files = _files_in(directory)
    if files is None:
        raise DataError(f"{directory}: Fashion-MNIST files disappeared while loading")
    return _load_cached(str(directory), _stamp(files))
