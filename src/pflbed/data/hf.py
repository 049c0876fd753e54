"""Any Hugging Face dataset, read with the `datasets` library (the `hf` extra), offline only.

Where the data comes from, in order:

1. `path` (`dataset.path`): a directory written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`;
2. `id` (`dataset.hf.id`) naming a local directory: a `save_to_disk` directory, else data files `datasets` reads
   (Parquet, CSV, an image folder, ...);
3. `id` as a Hub id, read from the Hugging Face cache (`$HF_HOME`, `~/.cache/huggingface`) of an earlier
   `datasets.load_dataset(id)`. Nothing is downloaded: the Hub is never asked, and no dataset's own loading code is
   ever run (`trust_remote_code` is never set).

Samples become tensors like every other loader's: images (PIL images, or arrays [H, W], [H, W, C] or [C, H, W]) are
stacked into float32 [N, C, H, W]; a grey image has one channel, and when some images are colour every image is
RGB. Integer pixels are read as 0–255 and float pixels as already in [0, 1]; then x = (pixel / 255 − mean) / std with
(mean, std) = `normalize` (default (0.5, 0.5): [−1, 1], like the folder datasets). PIL images follow the same rule
by their mode, with their values kept (not squeezed through 8-bit "L", which zeroes floats and clips 16 bits):
8-bit modes span 0–255, 16-bit grey (`I;16`, as `datasets` stores uint16 arrays and Pillow reads 16-bit PNGs)
0–65535, 32-bit integers (`I`) must lie in 0–255 like integer arrays, and floats (`F`) are in [0, 1]. One split's
images share one range. Vectors [N, D] pass through the same normalization. Labels: a `ClassLabel` keeps its ids,
integers are used as they are, strings are numbered in sorted order over both splits. User ids (`user_column`)
likewise: integers as they are, strings in sorted order.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pflbed.data.arrays import ArrayDataset, DataSource
from pflbed.errors import DataError

_GREY_MODES = {"1", "L", "LA"}  # 8-bit grey; other 8-bit modes become RGB
# Modes whose values are not 8-bit: the raw range each spans (`_images`).
_WIDE_MODES = {"I;16": 65535.0, "I;16L": 65535.0, "I;16B": 65535.0, "I;16N": 65535.0, "I": 255.0, "F": 1.0}


def load_hf(
    path: str | os.PathLike[str] | None = None, id: str | None = None, subset: str | None = None,
    splits: tuple[str, ...] | list[str] = ("train", "test"), image_column: str = "image", label_column: str = "label",
    user_column: str | None = None, image_size: int | None = None,
    normalize: tuple[float, float] | list[float] = (0.5, 0.5),
) -> DataSource:  # fmt: skip
    """A `DataSource` of a Hugging Face dataset (see the module's docstring). Repeated calls with equal arguments on
    unchanged files return the same object: treat it as read-only."""
    if path is None and id is None:
        raise DataError("dataset.hf.id: name a Hugging Face dataset (a Hub id or a local directory), or set "
                        "dataset.path to a save_to_disk directory")  # fmt: skip
    where = Path(path).expanduser() if path is not None else None
    if where is None and id is not None and Path(id).expanduser().is_dir():
        where = Path(id).expanduser()
    stamp = _stamp(where) if where is not None else ()
    return _load_cached(str(where) if where is not None else None, id, subset, tuple(splits), image_column,
                        label_column, user_column, image_size, tuple(float(v) for v in normalize), stamp)  # fmt: skip


def _stamp(directory: Path) -> tuple[tuple[str, int, int], ...]:
    """(file, mtime, size) of every file under `directory`: a changed dataset misses the cache."""
    if not directory.is_dir():
        return ()
    files = sorted(f for f in directory.rglob("*") if f.is_file())
    return tuple((str(f), (st := f.stat()).st_mtime_ns, st.st_size) for f in files)


@lru_cache(maxsize=2)
def _load_cached(where: str | None, id: str | None, subset: str | None, splits: tuple[str, ...], image_column: str,
                 label_column: str, user_column: str | None, image_size: int | None, normalize: tuple[float, float],
                 stamp: tuple) -> DataSource:  # fmt: skip
    what = where if where is not None else id
    parts = _open(where, id, subset)
    missing = [s for s in splits if s not in parts]
    if missing:
        raise DataError(f"dataset.hf.splits: {what} has no split {missing[0]!r}; its splits: {', '.join(parts)}")
    chosen = [parts[s] for s in splits]
    for key, column in (("image_column", image_column), ("label_column", label_column), ("user_column", user_column)):
        for name, ds in zip(splits, chosen, strict=True):
            if column is not None and column not in ds.column_names:
                raise DataError(f"dataset.hf.{key}: no column {column!r} in {what}'s {name} split; its columns: "
                                f"{', '.join(ds.column_names)}")  # fmt: skip
    labels, num_classes = _labels(chosen, splits, label_column, what)
    users = _ids(chosen, user_column) if user_column is not None else [None] * len(chosen)
    pixels = [_pixels(ds, image_column, image_size, f"{what}'s {name} split") for name, ds in zip(splits, chosen,
                                                                                                  strict=True)]
    shapes = {p[0].shape[1:3] if p[0].ndim > 2 else p[0].shape[1:] for p in pixels}
    if len(shapes) > 1 or len({p[1] for p in pixels}) > 1:
        raise DataError(f"dataset.hf.image_column: the samples of {what}'s splits differ in shape or pixel type; set "
                        "dataset.hf.image_size to resize every image")  # fmt: skip
    colour = any(p[2] for p in pixels)
    mean, std = normalize
    built = []
    for (x, scale, _), y, user in zip(pixels, labels, users, strict=True):
        if colour and x.ndim == 3:  # a grey split beside a colour one: RGB, as Pillow's L → RGB (the value thrice)
            x = np.repeat(x[..., None], 3, axis=-1)
        t = torch.from_numpy(np.ascontiguousarray(x)).to(torch.float32)
        if scale != 1.0:
            t = t.div_(scale)
        t = t.sub_(mean).div_(std)
        if t.ndim == 4:
            t = t.permute(0, 3, 1, 2) if colour else t
        elif t.ndim == 3:
            t = t.unsqueeze(1)
        built.append(ArrayDataset(x=t.contiguous(), y=torch.from_numpy(y),
                                  user=None if user is None else torch.from_numpy(user)))  # fmt: skip
    if len(built) == 1:
        shape = built[0].x.shape[1:]
        built.append(ArrayDataset(x=torch.zeros((0, *shape)), y=torch.zeros(0, dtype=torch.int64),
                                  user=None if user_column is None else torch.zeros(0, dtype=torch.int64)))  # fmt: skip
    scale = pixels[0][1]
    return DataSource(name="hf", train=built[0], test=built[1], num_classes=num_classes,
                      origin=f"{what} (Hugging Face{', ' + subset if subset else ''})", pixel_norm=(mean, std),
                      raw_scale=scale, raw_channels_last=colour)  # fmt: skip


@contextlib.contextmanager
def _offline() -> Iterator[Any]:
    """`datasets` with the Hub switched off: only local files and the cache are read, whatever the environment."""
    import datasets
    import huggingface_hub.constants as hub

    saved = datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE, getattr(datasets.config, "HF_DATASETS_OFFLINE", None)
    datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    if saved[2] is not None:
        datasets.config.HF_DATASETS_OFFLINE = True
    try:
        with _quiet(datasets):
            yield datasets
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = saved[0], saved[1]
        if saved[2] is not None:
            datasets.config.HF_DATASETS_OFFLINE = saved[2]


@contextlib.contextmanager
def _quiet(datasets: Any) -> Iterator[None]:
    """No progress bars or warnings from `datasets` (the run has its own progress)."""
    bars = datasets.utils.are_progress_bars_disabled()
    level = datasets.logging.get_verbosity()
    datasets.utils.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    try:
        yield
    finally:
        if not bars:
            datasets.utils.enable_progress_bars()
        datasets.logging.set_verbosity(level)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _open(where: str | None, id: str | None, subset: str | None) -> dict[str, Any]:
    """Split name → `datasets.Dataset`, read offline."""
    with _offline() as datasets:
        if where is not None:
            d = Path(where)
            if not d.is_dir():
                raise DataError(f"dataset.path: {where}: no such directory (a save_to_disk directory of a Hugging "
                                "Face dataset)")  # fmt: skip
            if (d / "dataset_dict.json").is_file() or (d / "state.json").is_file():
                try:
                    loaded = datasets.load_from_disk(str(d))
                except Exception as e:  # a damaged directory: whatever `datasets` or Arrow raise
                    raise DataError(f"{where}: not a readable save_to_disk directory ({_one_line(e)})") from None
            elif id is None or Path(id).expanduser() != d:
                raise DataError(f"dataset.path: {where} is not a save_to_disk directory (no dataset_dict.json or "
                                "state.json); give data files with dataset.hf.id")  # fmt: skip
            else:
                loaded = _load_dataset(datasets, str(d), subset)
        else:
            loaded = _load_dataset(datasets, id, subset)
    if isinstance(loaded, datasets.Dataset):
        return {str(loaded.split) if loaded.split is not None else "train": loaded}
    return dict(loaded)


def _load_dataset(datasets: Any, id: str, subset: str | None) -> Any:
    kwargs: dict[str, Any] = {}
    if "trust_remote_code" in inspect.signature(datasets.load_dataset).parameters:
        kwargs["trust_remote_code"] = False  # `datasets` 3: never run a dataset's own code (4+ cannot)
    try:
        return datasets.load_dataset(id, subset, **kwargs)
    except Exception as e:  # not cached, no such files, a subset missing: `datasets` raises many kinds
        raise DataError(f"dataset.hf.id: cannot read {id!r} offline ({_one_line(e)[:300]}); download it once with "
                        f"datasets.load_dataset({id!r}).save_to_disk(DIR) and set dataset.path=DIR") from None


def _labels(parts: list[Any], splits: tuple[str, ...], column: str, what: str) -> tuple[list[np.ndarray], int]:
    """Labels per split as int64 and the number of classes (see the module's docstring)."""
    import datasets

    feature = parts[0].features[column]
    values = [ds.with_format(None)[column] for ds in parts]
    values = [list(v) for v in values]
    if any(v is None for vs in values for v in vs):
        raise DataError(f"dataset.hf.label_column: {column!r} of {what} has samples without a label")
    if isinstance(feature, datasets.ClassLabel):
        out = [np.asarray(v, dtype=np.int64) for v in values]
        k = feature.num_classes
    elif all(isinstance(v, str) for vs in values for v in vs):
        names = sorted({v for vs in values for v in vs})
        index = {n: i for i, n in enumerate(names)}
        out = [np.asarray([index[v] for v in vs], dtype=np.int64) for vs in values]
        k = len(names)
    elif all(isinstance(v, (int, np.integer)) for vs in values for v in vs):
        out = [np.asarray(v, dtype=np.int64) for v in values]
        k = 1 + max((int(o.max()) for o in out if len(o)), default=0)
    else:
        raise DataError(f"dataset.hf.label_column: {column!r} of {what} holds {feature}; labels must be a ClassLabel, "
                        "integers or strings")  # fmt: skip
    for name, o in zip(splits, out, strict=True):
        if len(o) and (int(o.min()) < 0 or int(o.max()) >= k):
            bad = int(o.min()) if int(o.min()) < 0 else int(o.max())
            raise DataError(f"dataset.hf.label_column: label {bad} in {what}'s {name} split is outside 0…{k - 1}"
                            + (" (−1: no label)" if bad == -1 else ""))  # fmt: skip
    if k < 2 and any(len(o) for o in out):  # no samples at all: `_pixels` says so
        raise DataError(f"dataset.hf.label_column: {column!r} of {what} has {k} class; need at least 2")
    return out, k


def _ids(parts: list[Any], column: str) -> list[np.ndarray]:
    """User ids per split as int64: integers as they are, strings numbered in sorted order over the splits."""
    values = [list(ds.with_format(None)[column]) for ds in parts]
    flat = [v for vs in values for v in vs]
    if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in flat):
        return [np.asarray(vs, dtype=np.int64) for vs in values]
    if all(isinstance(v, str) for v in flat):
        index = {n: i for i, n in enumerate(sorted(set(flat)))}
        return [np.asarray([index[v] for v in vs], dtype=np.int64) for vs in values]
    raise DataError(f"dataset.hf.user_column: {column!r} must hold integers or strings for every sample")


def _pixels(ds: Any, column: str, image_size: int | None, what: str) -> tuple[np.ndarray, float, bool]:
    """(samples, the raw scale they span, colour?): [N, H, W] grey, [N, H, W, 3] colour or [N, D] vectors."""
    import datasets

    if len(ds) == 0:
        raise DataError(f"dataset.hf.splits: {what} has no samples")
    if isinstance(ds.features[column], datasets.Image):
        return _images(ds, column, image_size, what)
    try:
        x = ds.with_format("numpy", columns=[column])[:][column]
    except Exception as e:  # ragged lists, strings, ...: Arrow or NumPy refuse them
        raise DataError(f"dataset.hf.image_column: {column!r} of {what} is not an array per sample ({_one_line(e)})"
                        ) from None  # fmt: skip
    if x.dtype == object:
        raise DataError(f"dataset.hf.image_column: the arrays of {what} differ in shape; store them as images and set "
                        "dataset.hf.image_size to resize them")  # fmt: skip
    colour = False
    if x.ndim == 1:
        raise DataError(f"dataset.hf.image_column: {column!r} of {what} holds one number per sample, not pixels")
    if x.ndim == 4:
        if x.shape[-1] in (1, 3):
            colour = x.shape[-1] == 3
            x = x if colour else x[..., 0]
        elif x.shape[1] in (1, 3):  # [N, C, H, W]
            colour = x.shape[1] == 3
            x = x.transpose(0, 2, 3, 1) if colour else x[:, 0]
        else:
            raise DataError(f"dataset.hf.image_column: arrays of shape {list(x.shape[1:])} in {what}: need [H, W], "
                            "[H, W, C] or [C, H, W] with 1 or 3 channels")  # fmt: skip
    elif x.ndim not in (2, 3):
        raise DataError(f"dataset.hf.image_column: arrays of shape {list(x.shape[1:])} in {what}: need [H, W], "
                        "[H, W, C], [C, H, W] or a vector")  # fmt: skip
    if x.dtype == bool:
        return x.astype(np.float32), 1.0, colour
    if np.issubdtype(x.dtype, np.integer):
        lo, hi = int(x.min()), int(x.max())
        if lo < 0 or hi > 255:
            raise DataError(f"dataset.hf.image_column: integer pixels of {what} span {lo}…{hi}; need 0…255 (or "
                            "floats in [0, 1])")  # fmt: skip
        return x, 255.0, colour
    if not np.issubdtype(x.dtype, np.floating):
        raise DataError(f"dataset.hf.image_column: {column!r} of {what} holds {x.dtype}, not pixels")
    if not np.isfinite(x).all():
        raise DataError(f"dataset.hf.image_column: {column!r} of {what} holds non-finite values")
    return x.astype(np.float32), 1.0, colour


def _images(ds: Any, column: str, image_size: int | None, what: str) -> tuple[np.ndarray, float, bool]:
    from PIL import Image

    arrays, colour, scales = [], False, {}
    for i, img in enumerate(ds.with_format(None)[column]):
        if img is None:
            raise DataError(f"dataset.hf.image_column: sample {i} of {what} has no image")
        scale = _WIDE_MODES.get(img.mode, 255.0)
        if img.mode == "I":
            lo, hi = img.getextrema()
            if lo < 0 or hi > 255:
                raise DataError(f"dataset.hf.image_column: 32-bit integer image {i} of {what} spans {lo}…{hi}; "
                                "need 0…255 (store 16-bit images as I;16)")  # fmt: skip
        scales.setdefault(scale, img.mode)
        # Wide modes become floats with their values kept (and resize as floats); 8-bit ones stay 8-bit.
        img = img.convert("F" if img.mode in _WIDE_MODES else "L" if img.mode in _GREY_MODES else "RGB")
        if image_size is not None and img.size != (image_size, image_size):
            img = img.resize((image_size, image_size), Image.Resampling.BILINEAR)
        a = np.asarray(img)
        if a.dtype == np.float32 and not np.isfinite(a).all():
            raise DataError(f"dataset.hf.image_column: image {i} of {what} holds non-finite values")
        colour |= a.ndim == 3
        if arrays and a.shape[:2] != arrays[0].shape[:2]:
            raise DataError(f"dataset.hf.image_column: images of {what} differ in size ({arrays[0].shape[1]}×"
                            f"{arrays[0].shape[0]} and {a.shape[1]}×{a.shape[0]}); set dataset.hf.image_size to "
                            "resize them")  # fmt: skip
        arrays.append(a)
    if len(scales) > 1:
        raise DataError(f"dataset.hf.image_column: the images of {what} mix pixel ranges (modes "
                        f"{' and '.join(scales.values())}); store them in one mode")  # fmt: skip
    if colour:
        arrays = [np.repeat(a[..., None], 3, axis=-1) if a.ndim == 2 else a for a in arrays]
    return np.stack(arrays), next(iter(scales)), colour
