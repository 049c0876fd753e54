"""A `Federation`: which samples each client holds, and which clients train.

It is a pure function of (dataset content, partition config, seed) and is cached under a hash of that triple —
in memory and on disk (`$PFLBED_CACHE`, default `~/.cache/pflbed`) — so sweeps over algorithms reuse it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pflbed.config import FederationConfig
from pflbed.data.arrays import DataSource
from pflbed.errors import DataError
from pflbed.federation import partition

_PARTITION_KEYS = (
    "clients",
    "partition",
    "alpha",
    "classes_per_client",
    "min_size",
    "new_clients",
    "val_fraction",
    "test_fraction",
)
_FORMAT = 1


@dataclass(frozen=True)
class ClientSplit:
    """One client's data: index tensors into the source's train split, and its training class prior P_m(y)."""

    train: torch.Tensor
    val: torch.Tensor
    test: torch.Tensor
    prior: torch.Tensor


@dataclass(frozen=True)
class Federation:
    clients: list[ClientSplit]
    participated: list[int]
    new: list[int]
    global_test: torch.Tensor  # class-balanced indices into the source's test split
    num_classes: int
    key: str

    def num_train(self, cid: int) -> int:
        return int(self.clients[cid].train.numel())


def cache_dir() -> Path:
    return Path(os.environ.get("PFLBED_CACHE", Path.home() / ".cache" / "pflbed"))


def federation_key(source: DataSource, cfg: FederationConfig, seed: int) -> str:
    spec = {k: getattr(cfg, k) for k in _PARTITION_KEYS}
    blob = json.dumps({"data": source.fingerprint(), "fed": spec, "seed": seed, "v": _FORMAT}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


_MEMORY: dict[str, Federation] = {}


def build_federation(source: DataSource, cfg: FederationConfig, seed: int, use_disk_cache: bool = True) -> Federation:
    key = federation_key(source, cfg, seed)
    if key in _MEMORY:
        return _MEMORY[key]
    path = cache_dir() / "federations" / f"{key}.pt"
    fed = _load_cached(path, key) if use_disk_cache else None
    if fed is None:
        fed = _partition(source, cfg, seed, key)
        if use_disk_cache:
            _save_cached(fed, path)
    _MEMORY[key] = fed
    return fed


def _partition(source: DataSource, cfg: FederationConfig, seed: int, key: str) -> Federation:
    rng = np.random.default_rng([seed, 0xFED])
    labels = source.train.y.numpy()
    if cfg.clients > len(labels):
        raise DataError(f"federation.clients: {cfg.clients} clients but the training pool has {len(labels)} samples")
    if cfg.partition == "iid":
        parts = partition.iid(labels, cfg.clients, rng)
    elif cfg.partition == "dirichlet":
        parts = partition.dirichlet(labels, cfg.clients, cfg.alpha, cfg.min_size, rng)
    else:
        parts = partition.classes_per_client(labels, cfg.clients, cfg.classes_per_client, source.num_classes, rng)
    clients = []
    for cid, part in enumerate(parts):
        tr, va, te = partition.split_local(part, labels, cfg.val_fraction, cfg.test_fraction, rng)
        if len(tr) == 0:
            raise DataError(f"federation: client {cid} has no training samples; lower federation.clients")
        prior = np.bincount(labels[tr], minlength=source.num_classes).astype(np.float32)
        clients.append(
            ClientSplit(
                *(torch.from_numpy(a.astype(np.int64)) for a in (tr, va, te)),
                prior=torch.from_numpy(prior / prior.sum()),
            )
        )
    new = sorted(int(c) for c in rng.choice(cfg.clients, cfg.new_clients, replace=False))
    participated = [c for c in range(cfg.clients) if c not in set(new)]
    return Federation(clients, participated, new, balanced_subset(source.test.y.numpy(), rng), source.num_classes, key)


def balanced_subset(labels: np.ndarray, rng: np.random.Generator) -> torch.Tensor:
    """Equal count per class present (the smallest class's count), chosen at random."""
    classes, counts = np.unique(labels, return_counts=True)
    m = counts.min()
    picks = [rng.choice(np.flatnonzero(labels == c), m, replace=False) for c in classes]
    return torch.from_numpy(np.sort(np.concatenate(picks)).astype(np.int64))


def _save_cached(fed: Federation, path: Path) -> None:
    blob = {
        "key": fed.key,
        "num_classes": fed.num_classes,
        "participated": torch.tensor(fed.participated, dtype=torch.int64),
        "new": torch.tensor(fed.new, dtype=torch.int64),
        "global_test": fed.global_test,
        "clients": [{"train": c.train, "val": c.val, "test": c.test, "prior": c.prior} for c in fed.clients],
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        torch.save(blob, tmp)
        tmp.replace(path)
    except OSError:
        pass  # a cache that cannot be written is only slower


def _load_cached(path: Path, key: str) -> Federation | None:
    try:
        blob = torch.load(path, weights_only=True)
        if blob["key"] != key:
            return None
        return Federation(
            [ClientSplit(**c) for c in blob["clients"]],
            blob["participated"].tolist(),
            blob["new"].tolist(),
            blob["global_test"],
            int(blob["num_classes"]),
            key,
        )
    except Exception:  # missing or corrupt cache entry: recompute
        return None


def sample_clients(seed: int, rnd: int, participated: list[int], fraction: float) -> list[int]:
    """Clients trained in round `rnd`: a fixed stream per seed, identical for every algorithm and on resume."""
    m = max(1, round(fraction * len(participated)))
    rng = np.random.default_rng([seed, rnd, 0x5A4D])
    return sorted(int(c) for c in rng.choice(participated, m, replace=False))
