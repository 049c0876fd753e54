"""FEMNIST from LEAF's JSON shards (Caldas et al. 2018): EMNIST's 62 classes, with each sample's writer.

Layout, as LEAF's `femnist/preprocess.sh` writes it under `femnist/data/` (LEAF ships scripts, not the data):

- `all_data/all_data_<k>.json` (the whole dataset), and, once split by LEAF (`-t sample`),
- `train/*.json` and `test/*.json`.

Each shard: `{"users": [...], "num_samples": [...], "user_data": {user: {"x": [[784 floats]], "y": [...]}}}`,
`x` one 28×28 image per row, row-major, upright, pixel values in [0, 1] (LEAF keeps NIST's polarity: 1 is the
paper, 0 the ink); `y` 0–9 digits, 10–35 upper-case, 36–61 lower-case letters.

With `train/` and `test/` present, they are the splits. With `all_data/` only, each writer's samples are split
here, with a fixed seed: a random `TEST_FRACTION` (10 %, LEAF's default) to `test`, at least one sample for a
writer with two or more, the rest to `train`. Either way each sample keeps its writer: `user` holds indices into
`user_names` (writer ids sorted), the same writer the same index in both splits — what a natural (per-writer)
partition needs. Inputs are (x − 0.5) / 0.5, the fixed [−1, 1] scaling used for image folders.

Refused with a one-line error naming the shard: a writer found in two shards of one split (shards of two LEAF runs
left side by side: its samples would be doubled and split two ways), and pixels outside [0, 1] (a copy rescaled to
0–255 would load as blank paper).
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from pflbed.data import store
from pflbed.data.arrays import ArrayDataset, DataSource, held_out
from pflbed.errors import DataError

NAME, TITLE = "femnist", "FEMNIST"
TOPS = ("data", "femnist/data")
NUM_CLASSES, SIDE = 62, 28
TEST_FRACTION = 0.1
SPLIT_SEED = 0
MEAN, STD = 0.5, 0.5
HOW_TO_GET = ("run LEAF's femnist/preprocess.sh (github.com/TalwalkarLab/leaf; it downloads NIST SD19 and "
              f"writes data/all_data/*.json), then point dataset.path or $PFLBED_DATA/{NAME} at its femnist/data")


def _jsons(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob("*.json") if p.is_file()) if directory.is_dir() else []


def shards(directory: Path) -> dict[str, list[Path]] | None:
    """{"train": [...], "test": [...]} (LEAF's split) or {"all": [...]} (all_data), or None if neither is there."""
    train, test = _jsons(directory / "train"), _jsons(directory / "test")
    if train and test:
        return {"train": train, "test": test}
    for d in (directory / "all_data", directory):
        found = [p for p in _jsons(d) if p.name.startswith("all_data")]
        if found:
            return {"all": found}
    return None


def _holds(directory: Path) -> bool:
    return shards(directory) is not None


def find_femnist(path: str | os.PathLike[str] | None = None) -> Path | None:
    return store.find(NAME, path, TOPS, _holds)


def _read_shard(path: Path) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(writer, x float32 [n, 784], y int64 [n]) per writer of one shard, in the shard's order, checked."""
    try:
        with path.open("rb") as fh:
            blob = json.load(fh)
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise DataError(f"{path}: not a readable LEAF JSON shard, truncated? ({store.one_line(exc)})") from None
    ok = isinstance(blob, dict) and isinstance(blob.get("users"), list) and isinstance(blob.get("user_data"), dict)
    if not ok:
        raise DataError(f"{path}: a LEAF shard needs \"users\" (a list) and \"user_data\" (a mapping)")
    counts = blob.get("num_samples")
    out = []
    for i, user in enumerate(blob["users"]):
        data = blob["user_data"].get(user)
        if not isinstance(data, dict) or "x" not in data or "y" not in data:
            raise DataError(f"{path}: user {user!r} is listed but has no user_data with x and y")
        try:
            x = np.asarray(data["x"], dtype=np.float32)
            given = np.asarray(data["y"])
            y = given.astype(np.int64)
            whole = np.array_equal(given, y)  # the cast alone takes 1.5 as 1 and "3" as 3
        except (TypeError, ValueError, OverflowError):
            whole = False
        if not whole:
            raise DataError(f"{path}: user {user!r}: x must be rows of {SIDE * SIDE} numbers, y integers")
        if x.ndim != 2 or x.shape[1] != SIDE * SIDE or y.shape != (len(x),):
            raise DataError(f"{path}: user {user!r}: x {list(x.shape)} and y {list(y.shape)}; expected "
                            f"[n, {SIDE * SIDE}] and [n]")  # fmt: skip
        if isinstance(counts, list) and i < len(counts) and counts[i] != len(y):
            raise DataError(f"{path}: user {user!r}: num_samples says {counts[i]}, user_data holds {len(y)}")
        if len(y) and (y.min() < 0 or y.max() >= NUM_CLASSES):
            raise DataError(f"{path}: user {user!r}: label {int(y.max() if y.max() >= NUM_CLASSES else y.min())} "
                            f"out of range 0..{NUM_CLASSES - 1}")  # fmt: skip
        if not np.isfinite(x).all():
            raise DataError(f"{path}: user {user!r}: x holds NaN or infinite values")
        if x.size and (x.min() < 0 or x.max() > 1):
            raise DataError(f"{path}: user {user!r}: pixel values must lie in [0, 1], as LEAF writes them; got "
                            f"{float(x.min()):g}..{float(x.max()):g} (a copy rescaled to 0–255?)")  # fmt: skip
        out.append((str(user), x, y))
    return out


def _by_user(paths: list[Path]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each writer's samples from the one shard of `paths` that holds it. LEAF writes every writer to exactly one
    shard of a split, and names its shards after the run's options; so a writer in two shards means shards of two
    runs side by side (LEAF's README: delete the old folders before running it again), whose samples would be
    doubled and split two ways: a one-line error naming both."""
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    where: dict[str, Path] = {}
    for path in paths:
        for user, x, y in _read_shard(path):
            if user in where:
                raise DataError(f"{path}: writer {user!r} is also in {where[user].name}: shards of two LEAF runs? "
                                "keep one run's shards in the folder")  # fmt: skip
            where[user], out[user] = path, (x, y)
    return out


def _dataset(users: dict[str, tuple[np.ndarray, np.ndarray]], index: dict[str, int]) -> ArrayDataset:
    names = sorted(users)
    xs = [users[u][0] for u in names] or [np.zeros((0, SIDE * SIDE), np.float32)]
    ys = [users[u][1] for u in names] or [np.zeros(0, np.int64)]
    x = torch.from_numpy(np.concatenate(xs)).view(-1, 1, SIDE, SIDE).sub_(MEAN).div_(STD)
    user = np.concatenate([np.full(len(users[u][1]), index[u], dtype=np.int64) for u in names] or [ys[0]])
    return ArrayDataset(x=x.contiguous(), y=torch.from_numpy(np.concatenate(ys)), user=torch.from_numpy(user))


def _split_users(users: dict[str, tuple[np.ndarray, np.ndarray]]):
    """Each writer's samples split train/test with a fixed seed per writer (its rank in sorted order)."""
    train, test = {}, {}
    for rank, u in enumerate(sorted(users)):
        x, y = users[u]
        is_test = held_out(len(y), TEST_FRACTION, SPLIT_SEED, rank)
        train[u], test[u] = (x[~is_test], y[~is_test]), (x[is_test], y[is_test])
    return train, test


@lru_cache(maxsize=2)
def _load_cached(directory: str, stamp: tuple) -> DataSource:
    del stamp  # only part of the cache key
    found = shards(Path(directory))
    if found is None:
        raise DataError(f"{directory}: FEMNIST shards disappeared while loading")
    if "all" in found:
        train, test = _split_users(_by_user(found["all"]))
    else:
        train, test = _by_user(found["train"]), _by_user(found["test"])
    names = tuple(sorted(set(train) | set(test)))
    if not names:
        raise DataError(f"{directory}: the FEMNIST shards hold no users")
    index = {u: i for i, u in enumerate(names)}
    return DataSource(name=NAME, train=_dataset(train, index), test=_dataset(test, index), num_classes=NUM_CLASSES,
                      origin=directory, pixel_norm=(MEAN, STD), user_names=names)  # fmt: skip


def load_femnist(path: str | os.PathLike[str] | None = None, download: bool = False) -> DataSource:
    """FEMNIST: x float32 [N, 1, 28, 28], y int64 0–61, `user` = writer index into `user_names`.

    There is no official archive of the JSON shards, so `download=True` only explains how to make them.
    Cached per unchanged files; read-only.
    """
    directory = store.locate(NAME, TITLE, path, TOPS, _holds, HOW_TO_GET, download)
    found = shards(directory) or {}
    return _load_cached(str(directory), store.stamp(p for ps in found.values() for p in ps))
