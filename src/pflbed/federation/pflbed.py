"""The PFLBED split (FedBasis paper §5, Fig. 3 and 13): cross-domain clients with shared, class-balanced tests.

Per domain:
1. carve a class-balanced test set and val set (`test`, `val` fractions of the domain, equal count per class),
   shared by every client of that domain;
2. of the rest, take the participated and new portions (`participated`, `new` fractions of the domain);
3. split each portion into clients by Dirichlet(α) over classes (Hsu et al. 2019) — each client holds images
   of one domain only.
A client's P-FL accuracy is then class-weighted accuracy on its domain's test set with its training class prior
as weights, which avoids the train/test P(y) mismatch of small per-client splits (paper: 0.77 L1 on FEMNIST).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pflbed.data.arrays import DataSource
from pflbed.errors import DataError
from pflbed.federation import partition

if TYPE_CHECKING:
    from pflbed.config import FederationConfig  # annotations only


@dataclass
class PflbedSplit:
    clients: list[tuple[np.ndarray, int]]  # (train indices, domain) per client id
    participated: list[int]
    new: list[int]
    domain_val: list[np.ndarray]
    domain_test: list[np.ndarray]


def pflbed_split(source: DataSource, cfg: FederationConfig, rng: np.random.Generator,
                 pool: np.ndarray | None = None) -> PflbedSplit:  # fmt: skip
    """Each domain's shared test and val sets, its clients and its new clients, drawn from the training samples
    in `pool` (default: all)."""
    labels = source.train.y.numpy()
    if source.train.domain is None:
        raise DataError(
            f"federation.protocol=pflbed needs a dataset with domains; {source.name!r} has none "
            "(use fmnist-rot4, digits-rot4, a folder dataset, or set dataset.domains)"
        )
    domains = source.train.domain.numpy()
    names = source.domain_names or tuple(str(d) for d in range(int(domains.max()) + 1))
    p = cfg.pflbed
    out = PflbedSplit([], [], [], [], [])
    new_clients: list[tuple[np.ndarray, int]] = []
    for d, dname in enumerate(names):
        idx_d = np.flatnonzero(domains == d)
        if pool is not None:
            idx_d = np.intersect1d(idx_d, pool)
        test, val, rest = _balanced_holdout(idx_d, labels, source.num_classes, p.test, p.val, dname, rng)
        rest = rng.permutation(rest)
        n_part, n_new = round(p.participated * len(idx_d)), round(p.new * len(idx_d))
        n_part = min(n_part, len(rest))
        portions = (
            (rest[:n_part], p.clients_per_domain, "clients_per_domain", out.clients),
            (rest[n_part : n_part + n_new], p.new_clients_per_domain, "new_clients_per_domain", new_clients),
        )
        for portion, m, key, sink in portions:
            if m == 0:
                continue
            if len(portion) < m * cfg.min_size:
                raise DataError(
                    f"federation.pflbed.{key}: domain {dname!r} has {len(portion)} samples for {m} clients "
                    f"× min_size {cfg.min_size}"
                )
            parts = partition.dirichlet(labels[portion], m, cfg.alpha, cfg.min_size, rng)
            sink += [(np.sort(portion[part]), d) for part in parts]
        out.domain_test.append(test)
        out.domain_val.append(val)
    out.participated = list(range(len(out.clients)))
    out.new = list(range(len(out.clients), len(out.clients) + len(new_clients)))
    out.clients += new_clients
    return out


def _balanced_holdout(
    idx: np.ndarray, labels: np.ndarray, num_classes: int, test: float, val: float, dname: str,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """Equal-count-per-class test and val sets of ≈ `test`/`val` × |domain| samples, and the remaining indices."""
    per_test = int(test * len(idx) / num_classes)
    per_val = int(val * len(idx) / num_classes)
    if per_test < 1 or per_val < 1:
        raise DataError(
            f"federation.pflbed: domain {dname!r} has {len(idx)} samples, too few for a class-balanced test and "
            f"val set over {num_classes} classes (test {test:g}, val {val:g})"
        )
    tests, vals, rests = [], [], []
    for c in range(num_classes):
        idx_c = rng.permutation(idx[labels[idx] == c])
        if len(idx_c) < per_test + per_val:
            raise DataError(
                f"federation.pflbed: domain {dname!r} class {c} has {len(idx_c)} samples; a class-balanced "
                f"test + val set needs {per_test + per_val} per class"
            )
        tests.append(idx_c[:per_test])
        vals.append(idx_c[per_test : per_test + per_val])
        rests.append(idx_c[per_test + per_val :])
    return np.sort(np.concatenate(tests)), np.sort(np.concatenate(vals)), np.concatenate(rests)
