"""Label-based partitions of a training pool into clients.

Each function maps labels (numpy int array) to a list of index arrays, one per client, and is a pure function
of its arguments and the numpy `Generator` it is given.
"""

from __future__ import annotations

import numpy as np

from pflbed.errors import DataError

_DIRICHLET_TRIES = 20


def iid(labels: np.ndarray, clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Uniformly random, equal-size shards."""
    return [np.sort(part) for part in np.array_split(rng.permutation(len(labels)), clients)]


def dirichlet(
    labels: np.ndarray, clients: int, alpha: float, min_size: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Per class, split its samples among clients by proportions ~ Dir(α) (Hsu et al. 2019).

    Small α gives a few dominant classes per client. Like the usual implementation we resample while a client
    has fewer than `min_size` samples — but only `_DIRICHLET_TRIES` times; after that the smallest clients take
    random samples from the largest ones, so the guarantee holds and the loop always ends.
    """
    n = len(labels)
    if n < clients * min_size:
        raise DataError(
            f"federation.clients: {clients} clients × min_size {min_size} needs {clients * min_size} "
            f"samples, the training pool has {n}"
        )
    classes = np.unique(labels)
    for _ in range(_DIRICHLET_TRIES):
        parts: list[list[np.ndarray]] = [[] for _ in range(clients)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            cuts = (np.cumsum(rng.dirichlet(np.full(clients, alpha)))[:-1] * len(idx)).astype(int)
            for k, chunk in enumerate(np.split(idx, cuts)):
                parts[k].append(chunk)
        out = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(p) for p in out) >= min_size:
            return out
    return _repair_min_size(out, min_size, rng)


def _repair_min_size(parts: list[np.ndarray], min_size: int, rng: np.random.Generator) -> list[np.ndarray]:
    parts = [rng.permutation(p) for p in parts]
    while True:
        sizes = np.array([len(p) for p in parts])
        small = int(sizes.argmin())
        if sizes[small] >= min_size:
            return [np.sort(p) for p in parts]
        big = int(sizes.argmax())
        take = min(min_size - sizes[small], sizes[big] - min_size)
        parts[small] = np.concatenate([parts[small], parts[big][:take]])
        parts[big] = parts[big][take:]


def classes_per_client(
    labels: np.ndarray, clients: int, k: int, num_classes: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Each client gets `k` distinct labels; each label's samples are split evenly among its holders.

    Labels are dealt from a cyclic random order of the classes (client i takes positions i·k … i·k+k−1), so
    every class is held by the same number of clients (±1) and no client draws a class twice.
    """
    if k > num_classes:
        raise DataError(f"federation.classes_per_client: {k} exceeds the dataset's {num_classes} classes")
    order = rng.permutation(num_classes)
    held = [[int(order[(i * k + j) % num_classes]) for j in range(k)] for i in range(clients)]
    parts: list[list[np.ndarray]] = [[] for _ in range(clients)]
    for c in range(num_classes):
        holders = [i for i in range(clients) if c in held[i]]
        if not holders:
            continue
        idx = rng.permutation(np.flatnonzero(labels == c))
        for i, chunk in zip(holders, np.array_split(idx, len(holders)), strict=True):
            parts[i].append(chunk)
    out = [np.sort(np.concatenate(p)) for p in parts]  # k ≥ 1: every client holds a class, even if 0 samples of it
    if min(len(p) for p in out) == 0:
        raise DataError(f"federation.clients: {clients} clients leave some client without samples")
    return out


def split_local(
    indices: np.ndarray, labels: np.ndarray, val_fraction: float, test_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stratified train / val / test split of one client's indices.

    Indices are ordered by class (random within a class) and the test and val picks are spread evenly along that
    order, so each split has (up to rounding) the client's class mix and the totals are exact.
    """
    order = indices[np.lexsort((rng.random(len(indices)), labels[indices]))]
    test_mask = _evenly(len(order), test_fraction)
    rest = order[~test_mask]
    val_mask = _evenly(len(rest), val_fraction / (1 - test_fraction))
    return np.sort(rest[~val_mask]), np.sort(rest[val_mask]), np.sort(order[test_mask])


def _evenly(n: int, fraction: float) -> np.ndarray:
    p = np.arange(n)
    return np.floor((p + 1) * fraction) > np.floor(p * fraction)
