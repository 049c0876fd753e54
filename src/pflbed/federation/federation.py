"""A `Federation`: which samples each client holds, and which clients train.

It is a pure function of (dataset content, partition config, seed) and is cached under a hash of that triple —
in memory and on disk (`$PFLBED_CACHE`, default `~/.cache/pflbed`) — so sweeps over algorithms reuse it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from pflbed import rng as streams
from pflbed.data.arrays import DataSource
from pflbed.errors import DataError
from pflbed.federation import partition
from pflbed.federation.pflbed import pflbed_split

if TYPE_CHECKING:
    from pflbed.config import FederationConfig  # annotations only

_PARTITION_KEYS = (
    "protocol",
    "pflbed",
    "clients",
    "partition",
    "alpha",
    "classes_per_client",
    "min_size",
    "new_clients",
    "val_fraction",
    "train_per_client",
    "public",
    "test_fraction",
    "exclude_test_of",
)
_FORMAT = 2


@dataclass(frozen=True)
class ClientSplit:
    """One client's data: index tensors into the source's train split, and its training class prior P_m(y)."""

    train: torch.Tensor
    val: torch.Tensor
    test: torch.Tensor
    prior: torch.Tensor
    domain: int = 0


@dataclass(frozen=True)
class Federation:
    clients: list[ClientSplit]
    participated: list[int]
    new: list[int]
    global_test: torch.Tensor  # class-balanced indices into the source split named by `global_split`
    num_classes: int
    key: str
    global_split: str = "test"
    # PFLBED: per domain, shared class-balanced val and test sets (indices into the train pool)
    domain_val: list[torch.Tensor] = field(default_factory=list)
    domain_test: list[torch.Tensor] = field(default_factory=list)
    # Public data (KT-pFL, FedMD, FedDF): training-pool indices no client holds; algorithms use them unlabelled.
    public: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64, device="cpu"))
    # New clients' S/M/L training subsets fixed by a manifest (client id → one index tensor per size, for the
    # `new_fractions` they were made for); empty: drawn from the run's seed (`new_client_train`).
    new_subsets: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    new_fractions: list[float] = field(default_factory=list)

    def num_train(self, cid: int) -> int:
        return int(self.clients[cid].train.numel())

    def used_indices(self) -> dict[str, torch.Tensor]:
        """Every sample the federation uses, per source split ("train", "test"): the clients' (participated and
        new) train/val/test indices, the public set, the shared validation and test sets and the global test set.
        What a pretraining source must avoid (`check_disjoint`)."""
        train = [t for c in self.clients for t in (c.train, c.val, c.test)] + [self.public]
        train += [*self.domain_val, *self.domain_test]
        used = {"train": train, "test": []}
        used[self.global_split].append(self.global_test)
        return {k: torch.unique(torch.cat([t.cpu() for t in v])) if v else torch.zeros(0, dtype=torch.int64)
                for k, v in used.items()}  # fmt: skip

    def test_indices(self) -> torch.Tensor:
        """The training-pool samples its reported test figures are scored on: every client's (participated and new)
        test split and the shared per-domain test sets (PFLBED). Its global test set, where it is the source's
        test split, is not among them: nothing is ever drawn from that split to train or validate."""
        parts = [c.test for c in self.clients] + list(self.domain_test)
        if self.global_split == "train":
            parts.append(self.global_test)
        return torch.unique(torch.cat([t.cpu() for t in parts]))

    def seen_indices(self) -> torch.Tensor:
        """The training-pool samples a run trains or validates on (labelled or not): every client's training and
        validation split, the public set and the shared per-domain validation sets."""
        parts = [t for c in self.clients for t in (c.train, c.val)] + [self.public, *self.domain_val]
        return torch.unique(torch.cat([t.cpu() for t in parts]))

    def to(self, device: torch.device | str) -> Federation:
        """Every index tensor and class prior on `device`, the data's device, so that indexing the data and
        weighting by a prior never mixes devices; the same object where they are already there (the CPU)."""
        device = torch.device(device)
        if self.global_test.device == device:
            return self
        clients = [replace(c, train=c.train.to(device), val=c.val.to(device), test=c.test.to(device),
                           prior=c.prior.to(device)) for c in self.clients]  # fmt: skip
        return replace(self, clients=clients, global_test=self.global_test.to(device), public=self.public.to(device),
                       domain_val=[t.to(device) for t in self.domain_val],
                       domain_test=[t.to(device) for t in self.domain_test],
                       new_subsets={c: [t.to(device) for t in v] for c, v in self.new_subsets.items()})  # fmt: skip


def draw_subset(train: torch.Tensor, fraction: float, generator: torch.Generator) -> torch.Tensor:
    """The first ⌈fraction·n⌉ (at least one) of a fixed random order of the indices `train` (S ⊂ M ⊂ L)."""
    order = train[torch.randperm(int(train.numel()), generator=generator, device=generator.device)]
    return order[: max(1, math.ceil(fraction * int(train.numel())))]


def new_client_train(fed: Federation, cid: int, size: int, fraction: float, seed: int) -> torch.Tensor:
    """New client `cid`'s training indices for size number `size` (S, M, L) at `fraction`: the federation's own
    subset where a manifest fixed one, else `draw_subset` from the client's stream of the run's seed."""
    fixed = fed.new_subsets.get(cid)
    if fixed is not None:
        return fixed[size]
    return draw_subset(fed.clients[cid].train, fraction, streams.generator(seed, streams.NEWCLIENT, 0, cid))


def check_disjoint(fed: Federation, dataset: str, source: dict, what: str) -> None:
    """Refuse a pretraining `source` (a `pflbed pretrain` record: base dataset, split, sample indices) that shares
    a sample with what `fed`, a federation of `dataset` (its base dataset name), uses. Sources of other datasets
    share nothing. Why: a body pretrained on a client's test samples inflates every score built on it."""
    if source.get("dataset") != dataset:
        return
    split = source["split"]
    shared = np.intersect1d(source["indices"].cpu().numpy(), fed.used_indices()[split].numpy())
    if len(shared):
        raise DataError(f"{what}: the pretraining source ({len(source['indices'])} samples of {dataset}'s {split} "
                        f"split) shares {len(shared)} samples with this federation's client data or evaluation "
                        "sets; choose a split or domains it does not use (under federation.protocol pflbed all "
                        "of them come from the train split, so pretrain.split test is free)")  # fmt: skip


def cache_dir() -> Path:
    return Path(os.environ.get("PFLBED_CACHE", Path.home() / ".cache" / "pflbed"))


def federation_key(source: DataSource, cfg: FederationConfig, seed: int) -> str:
    spec = {k: v for k, v in cfg.model_dump(mode="json").items() if k in _PARTITION_KEYS}
    if not spec["exclude_test_of"]:  # unset: the key every federation had before it existed (caches stay valid)
        del spec["exclude_test_of"]
    if cfg.partition == "natural" and cfg.protocol == "standard":  # the users decide the clients
        users, kind = natural_users(source)
        spec.update(min_samples=cfg.min_samples, users=[kind, hashlib.sha256(users.tobytes()).hexdigest()[:16]])
    blob = json.dumps({"data": source.fingerprint(), "fed": spec, "seed": seed, "v": _FORMAT}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


_MEMORY: dict[str, Federation] = {}


def _partition(source: DataSource, cfg: FederationConfig, seed: int, key: str,
               excluded: np.ndarray | None = None) -> Federation:  # fmt: skip
    """The federation of `source` under `cfg` and `seed`, its pool the training split less `excluded`."""
    rng = np.random.default_rng([seed, 0xFED])
    labels = source.train.y.numpy()
    pool = np.arange(len(labels)) if excluded is None else np.setdiff1d(np.arange(len(labels)), excluded)
    if cfg.protocol == "standard" and len(source.test) == 0:
        raise DataError(f"dataset {source.name!r} has no test split; use federation.protocol=pflbed")
    public = np.zeros(0, dtype=np.int64)
    if cfg.public:
        if cfg.public >= len(pool):
            raise DataError(
                f"federation.public: {cfg.public} public samples leave none of the {len(pool)} for clients"
            )
        perm = pool[np.random.default_rng([seed, 0x9B1C]).permutation(len(pool))]  # own stream: clients as before
        public, pool = np.sort(perm[: cfg.public]), np.sort(perm[cfg.public :])
    if cfg.protocol == "pflbed":  # the domains' splits from what is left
        return _pflbed(source, cfg, rng, key, pool, public)
    if cfg.clients > len(pool):
        raise DataError(f"federation.clients: {cfg.clients} clients but the training pool has {len(pool)} samples")
    pool_labels = labels[pool]
    if cfg.partition == "natural":
        parts = natural(natural_users(source)[0][pool], cfg.clients, cfg.min_samples, seed)
    elif cfg.partition == "iid":
        parts = partition.iid(pool_labels, cfg.clients, rng)
    elif cfg.partition == "dirichlet":
        parts = partition.dirichlet(pool_labels, cfg.clients, cfg.alpha, cfg.min_size, rng)
    else:
        parts = partition.classes_per_client(pool_labels, cfg.clients, cfg.classes_per_client, source.num_classes, rng)
    parts = [pool[p] for p in parts]
    clients = []
    for cid, part in enumerate(parts):
        tr, va, te = partition.split_local(part, labels, cfg.val_fraction, cfg.test_fraction, rng)
        if cfg.train_per_client is not None and len(tr) > cfg.train_per_client:
            # own stream per client: capping never changes any other client's split; val/test keep their mix
            cap_rng = np.random.default_rng([seed, 0xCA9, cid])
            tr = np.sort(cap_rng.choice(tr, cfg.train_per_client, replace=False))
        if len(tr) == 0:
            raise DataError(f"federation: client {cid} has no training samples; lower federation.clients")
        clients.append(client_split(tr, va, te, labels, source.num_classes))
    new = sorted(int(c) for c in rng.choice(cfg.clients, cfg.new_clients, replace=False))
    participated = [c for c in range(cfg.clients) if c not in set(new)]
    return Federation(clients, participated, new, balanced_subset(source.test.y.numpy(), rng), source.num_classes, key,
                      public=torch.from_numpy(public.astype(np.int64)))  # fmt: skip


def natural_users(source: DataSource) -> tuple[np.ndarray, str]:
    """Each training sample's user for `partition: natural`, and what they are: the data's own per-sample users
    (a Hugging Face `user_column`, a dataset's writers), else its domains (one client per domain)."""
    if source.train.user is not None:
        return source.train.user.cpu().numpy().astype(np.int64), "user"
    if source.train.domain is not None:
        return source.train.domain.cpu().numpy().astype(np.int64), "domain"
    raise DataError(f"federation.partition: natural needs per-sample users, and {source.name!r} has none: set "
                    "dataset.hf.user_column, or use a dataset with writers or domains")  # fmt: skip


def natural(users: np.ndarray, clients: int, min_samples: int, seed: int) -> list[np.ndarray]:
    """One client per user (positions into `users`, ascending): users with fewer than `min_samples` samples are
    dropped; of the rest, `clients` users are drawn from the seed's own stream (all when there are that many), and
    client ids follow the users' order (the smallest user id is client 0)."""
    ids, counts = np.unique(users, return_counts=True)
    kept = ids[counts >= min_samples]
    if clients > len(kept):
        raise DataError(f"federation.clients: {clients} clients, but federation.partition natural finds {len(kept)} "
                        f"users (of {len(ids)}) with at least federation.min_samples {min_samples} samples"
                        )  # fmt: skip
    if clients < len(kept):
        kept = np.sort(np.random.default_rng([seed, 0x05E2]).choice(kept, clients, replace=False))
    order = np.argsort(users, kind="stable")  # positions grouped by user, ascending within each user
    ordered = users[order]
    starts, ends = np.searchsorted(ordered, kept, "left"), np.searchsorted(ordered, kept, "right")
    return [order[a:b] for a, b in zip(starts, ends, strict=True)]


def client_split(
    tr: np.ndarray, va: np.ndarray, te: np.ndarray, labels: np.ndarray, k: int, domain: int = 0
) -> ClientSplit:
    """A client of train / val / test positions `tr`, `va`, `te`, its prior from the training labels."""
    prior = np.bincount(labels[tr], minlength=k).astype(np.float32)
    tensors = (torch.from_numpy(a.astype(np.int64)) for a in (tr, va, te))
    return ClientSplit(*tensors, prior=torch.from_numpy(prior / prior.sum()), domain=domain)


def _pflbed(source: DataSource, cfg: FederationConfig, rng: np.random.Generator, key: str,
            pool: np.ndarray | None, public: np.ndarray) -> Federation:  # fmt: skip
    split = pflbed_split(source, cfg, rng, pool)
    labels, empty = source.train.y.numpy(), np.zeros(0, dtype=np.int64)
    clients = [client_split(tr, empty, empty, labels, source.num_classes, d) for tr, d in split.clients]
    as_t = [torch.from_numpy(a.astype(np.int64)) for a in split.domain_test]
    return Federation(
        clients, split.participated, split.new, torch.cat(as_t), source.num_classes, key, global_split="train",
        domain_val=[torch.from_numpy(a.astype(np.int64)) for a in split.domain_val], domain_test=as_t,
        public=torch.from_numpy(public.astype(np.int64)),
    )  # fmt: skip


def balanced_subset(labels: np.ndarray, rng: np.random.Generator) -> torch.Tensor:
    """Equal count per class present (the smallest class's count), chosen at random."""
    classes, counts = np.unique(labels, return_counts=True)
    m = counts.min()
    picks = [rng.choice(np.flatnonzero(labels == c), m, replace=False) for c in classes]
    return torch.from_numpy(np.sort(np.concatenate(picks)).astype(np.int64))


def _save_cached(fed: Federation, path: Path) -> None:
    blob = {f.name: getattr(fed, f.name) for f in fields(fed)}
    blob["clients"] = [{f.name: getattr(c, f.name) for f in fields(c)} for c in fed.clients]
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
        blob["clients"] = [ClientSplit(**c) for c in blob["clients"]]
        return Federation(**blob)
    except Exception:  # missing or corrupt cache entry: recompute
        return None


def sample_clients(seed: int, rnd: int, participated: list[int], fraction: float, poisson: bool = False,
                   entropy: bool = False) -> list[int]:  # fmt: skip
    """Clients trained in round `rnd`: by default a fixed stream per seed, identical for every algorithm and on
    resume.

    Fixed: round(fraction × N) clients (at least one) without replacement. Poisson (`federation.sampling`): each
    client independently with probability `fraction` — what privacy's accountant assumes; a round may then have
    none. With `entropy` (`privacy.randomness: os`) the draw comes from the operating system's random source
    instead (`pflbed.rng.os_uniform`; `seed` and `rnd` unused): the accountant's amplification by sampling holds
    only if no one can tell in advance who is drawn, and the seed is in the config that every site receives."""
    n = len(participated)
    if entropy:
        u = streams.os_uniform(n)
        if poisson:
            return sorted(int(c) for c, x in zip(participated, u, strict=True) if x < fraction)
        return sorted(int(participated[i]) for i in np.argsort(u)[: max(1, round(fraction * n))])
    rng = np.random.default_rng([seed, rnd, 0x5A4D])
    if poisson:
        return sorted(int(c) for c, u in zip(participated, rng.random(n), strict=True) if u < fraction)
    m = max(1, round(fraction * n))
    return sorted(int(c) for c in rng.choice(participated, m, replace=False))
