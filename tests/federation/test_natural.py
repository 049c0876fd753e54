"""`federation.partition: natural`: each user of the data (per-sample user ids, else domains) is one client."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from pflbed.config import FederationConfig
from pflbed.data import load_dataset
from pflbed.data.domains import with_domains
from pflbed.data.synthetic import make_synthetic
from pflbed.errors import DataError
from pflbed.federation import build_federation
from pflbed.federation.federation import natural


def with_users(source, users):
    return replace(source, train=replace(source.train, user=torch.as_tensor(users, dtype=torch.int64)))


@pytest.fixture(scope="module")
def source():
    """2000 synthetic samples; user u holds samples ≡ u (mod 13), plus a small user 100 (7 samples)."""
    s = load_dataset("synthetic")
    users = np.arange(len(s.train)) % 13
    users[[5, 50, 500, 900, 1200, 1500, 1999]] = 100
    return with_users(s, users)


def test_one_client_per_user_in_user_order_small_users_dropped():
    users = np.array([7, 3, 7, 9, 3, 7, 2, 9, 9, 9])
    parts = natural(users, 3, 2, seed=0)  # user 2 (one sample) is dropped; 3, 7, 9 remain: clients 0, 1, 2
    assert [p.tolist() for p in parts] == [[1, 4], [0, 2, 5], [3, 7, 8, 9]]
    assert [p.tolist() for p in natural(users, 4, 1, seed=0)] == [[6], [1, 4], [0, 2, 5], [3, 7, 8, 9]]
    with pytest.raises(DataError, match=r"federation\.clients: 4 clients, but .* finds 3 users \(of 4\) with at least "
                                        r"federation\.min_samples 2"):  # fmt: skip
        natural(users, 4, 2, seed=0)


def test_fewer_clients_than_users_are_drawn_from_the_seed():
    users = np.repeat(np.arange(50), 3)
    draws = {s: [int(users[p[0]]) for p in natural(users, 5, 1, seed=s)] for s in range(4)}
    assert all(d == sorted(d) and len(set(d)) == 5 for d in draws.values())  # distinct users, in user order
    assert draws[0] == [int(users[p[0]]) for p in natural(users, 5, 1, seed=0)]  # the same seed, the same users
    assert len({tuple(d) for d in draws.values()}) == 4  # other seeds, other users
    for p in natural(users, 5, 1, seed=1):
        assert (users[p] == users[p[0]]).all() and len(p) == 3  # every sample of the user, and only its


def test_federation_of_users_composes_with_local_splits_new_clients_and_public(source):
    """Each client's train ∪ val ∪ test is exactly its user's samples (minus public ones), split by val_fraction /
    test_fraction; held-out new clients are users too; the user below min_samples is no client."""
    cfg = FederationConfig(partition="natural", clients=13, min_samples=10, new_clients=3, public=100,
                           val_fraction=0.1, test_fraction=0.2)  # fmt: skip
    fed = build_federation(source, cfg, seed=0, use_disk_cache=False)
    users = source.train.user.numpy()
    public = set(fed.public.tolist())
    assert len(public) == 100 and len(fed.clients) == 13 and len(fed.new) == 3 and len(fed.participated) == 10
    for cid, c in enumerate(fed.clients):
        held = np.concatenate([c.train.numpy(), c.val.numpy(), c.test.numpy()])
        want = [i for i in np.flatnonzero(users == cid) if i not in public]
        assert sorted(held.tolist()) == want, cid
        n = len(want)
        assert len(c.test) == int(np.floor(n * 0.2)) and abs(len(c.val) - 0.1 * n) <= 1
    assert all(users[i] != 100 for c in fed.clients for i in c.train.tolist())


def test_domains_are_the_users_where_the_data_has_no_user_ids():
    s = with_domains(load_dataset("digits"), ("rot0", "rot90", "rot180"))
    fed = build_federation(s, FederationConfig(partition="natural", clients=3), seed=0, use_disk_cache=False)
    domain = s.train.domain.numpy()
    for d, c in enumerate(fed.clients):
        held = torch.cat([c.train, c.val, c.test]).numpy()
        assert sorted(held.tolist()) == np.flatnonzero(domain == d).tolist()


def test_the_cache_key_holds_the_users_and_min_samples(source):
    """Same samples and labels, other users (or another min_samples): another federation, never the cached one."""
    from pflbed.federation import federation

    cfg = FederationConfig(partition="natural", clients=5, min_samples=10)
    a = build_federation(source, cfg, seed=0)
    users = source.train.user.numpy().copy()
    users[users < 6] = 0  # users 0 … 5 merged
    merged = with_users(source, users)
    b = build_federation(merged, cfg, seed=0)
    c = build_federation(source, cfg.model_copy(update={"min_samples": 154}), seed=0)
    federation._MEMORY.clear()
    for fed, src, fc in ((b, merged, cfg), (c, source, cfg.model_copy(update={"min_samples": 154}))):
        fresh = build_federation(src, fc, seed=0, use_disk_cache=False)
        assert all(torch.equal(x.train, y.train) for x, y in zip(fed.clients, fresh.clients, strict=True))
    assert len({a.key, b.key, c.key}) == 3 and not torch.equal(a.clients[0].train, b.clients[0].train)
    dirichlet = FederationConfig(partition="dirichlet", clients=5)
    assert build_federation(source, dirichlet, 0).key == build_federation(merged, dirichlet, 0).key


def test_a_natural_partition_of_a_dataset_without_users_or_domains_is_refused_in_one_line():
    with pytest.raises(DataError, match=r"^federation.partition: natural needs per-sample users, and 'synthetic' has "
                                        r"none: set dataset.hf.user_column, or use a dataset with writers or domains$"):
        build_federation(make_synthetic(), FederationConfig(partition="natural", clients=3), 0, use_disk_cache=False)
