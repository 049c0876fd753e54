"""A user's own labelled samples, read from a file (`pflbed personalize --data FILE`).

Two formats:
- `.npz` with arrays `x` (raw samples in the run's dataset's native format: digits' 8×8 images in 0–16,
  Fashion-MNIST's 28×28 uint8 images, generated data's feature vectors) and `y` (integer labels);
- a folder of class sub-folders named by their label (`0/`, `1/`, …) holding image files, decoded to the
  dataset's sample shape (grey or colour, resized) with values 0–255.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from pflbed.data.arrays import DataSource
from pflbed.errors import DataError

IMAGE_EXTS = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"}


def read_samples(path: str | Path, source: DataSource) -> tuple[np.ndarray, np.ndarray, float | None]:
    """(x, y, scale): raw samples, labels, and their raw range where it is not the dataset's own (images: 255)."""
    path = Path(path)
    if path.is_dir():
        return (*read_image_folder(path, source), 255.0)
    if not path.is_file():
        raise DataError(f"{path}: no such file or folder")
    x, y = read_npz_arrays(path)
    if x.ndim == 0 or y.ndim == 0:  # len() of a 0-d array raises: a scalar holds no samples
        raise DataError(f"{path}: {'x' if x.ndim == 0 else 'y'} is a single number, not an array of samples")
    if len(x) != len(y):
        raise DataError(f"{path}: {len(x)} samples in x but {len(y)} labels in y")
    return x, y, None


def read_npz_arrays(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Arrays `x` and `y` of the `.npz` file `path`, read without unpickling; `DataError` naming the file when it is
    no such archive (numpy's own message would blame pickled data for any file that is not a zip), a lone `.npy`
    array, or lacks either array."""
    try:
        with open(path, "rb") as f:
            magic = f.read(6)
        if not magic.startswith(b"PK"):
            kind = "one array, a .npy" if magic == b"\x93NUMPY" else "not a zip archive"
            raise DataError(f"{path}: not a readable .npz file ({kind}; save x and y with numpy.savez)")
        with np.load(path, allow_pickle=False) as f:
            if "x" not in f.files or "y" not in f.files:
                raise DataError(f"{path}: an .npz with arrays x (samples) and y (labels) is needed; it has "
                                f"{', '.join(f.files) or 'none'}")  # fmt: skip
            return f["x"], f["y"]
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise DataError(f"{path}: not a readable .npz file ({e})") from None


def read_image_folder(path: Path, source: DataSource) -> tuple[np.ndarray, np.ndarray]:
    from PIL import Image, UnidentifiedImageError

    shape = source.raw_shape
    if len(shape) not in (2, 3):
        raise DataError(f"{path}: {source.name} samples are not images; give an .npz file with x and y")
    classes = sorted((d for d in path.iterdir() if d.is_dir()), key=lambda d: d.name)
    bad = [d.name for d in classes if not d.name.isdigit() or int(d.name) >= source.num_classes]
    if bad or not classes:
        raise DataError(f"{path}: needs class sub-folders named 0…{source.num_classes - 1}; found {bad or 'none'}")
    xs, ys = [], []
    h, w = shape[:2]
    mode = "L" if len(shape) == 2 else "RGB"
    for d in classes:
        for f in sorted(d.iterdir()):
            if f.suffix.lower() not in IMAGE_EXTS:
                continue
            try:
                with Image.open(f) as img:
                    xs.append(np.asarray(img.convert(mode).resize((w, h), Image.Resampling.BILINEAR), dtype=np.uint8))
            except (OSError, UnidentifiedImageError) as e:
                raise DataError(f"{f}: cannot read image ({e})") from None
            ys.append(int(d.name))
    if not xs:
        raise DataError(f"{path}: no images in its class sub-folders")
    return np.stack(xs), np.asarray(ys, dtype=np.int64)
