from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from pflbed.config import FederationConfig
from pflbed.data.synthetic import make_synthetic
from pflbed.errors import DataError
from pflbed.federation import build_federation, sample_clients
from pflbed.federation import federation as F
from pflbed.federation import partition as P
from pflbed.federation.federation import cache_dir, draw_subset, new_client_train

from ..data_formats import Evil
from .test_manifest import _same


def _labels(n_per_class=100, classes=10):
    return np.repeat(np.arange(classes), n_per_class)


def _is_partition(parts, n):
    allidx = np.concatenate(parts)
    return len(allidx) == n and len(np.unique(allidx)) == n


def test_iid_equal_sizes_and_disjoint():
    parts = P.iid(_labels(), 7, np.random.default_rng(0))
    assert _is_partition(parts, 1000)
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


@pytest.mark.parametrize("alpha", [0.05, 0.3, 10.0])
def test_dirichlet_min_size_and_partition(alpha):
    labels = _labels()
    parts = P.dirichlet(labels, 20, alpha, 15, np.random.default_rng(1))
    assert _is_partition(parts, len(labels))
    assert min(map(len, parts)) >= 15


def test_dirichlet_small_alpha_is_skewed_large_alpha_is_not():
    labels = _labels(300)

    def mean_classes(alpha):
        parts = P.dirichlet(labels, 20, alpha, 5, np.random.default_rng(2))
        return np.mean([(np.bincount(labels[p], minlength=10) / len(p) > 0.05).sum() for p in parts])

    assert mean_classes(0.05) < 4 < 9 < mean_classes(100.0)


def test_dirichlet_min_size_guaranteed_even_when_resampling_fails():
    # α tiny and min_size at the feasibility limit: resampling essentially never succeeds, the repair must.
    labels = _labels(10)
    parts = P.dirichlet(labels, 10, 0.01, 10, np.random.default_rng(3))
    assert _is_partition(parts, 100)
    assert sorted(map(len, parts)) == [10] * 10


def test_dirichlet_infeasible_raises():
    with pytest.raises(DataError, match=r"federation.clients: 5 clients × min_size 10 needs 50 samples, .* has 10$"):
        P.dirichlet(_labels(1), 5, 0.3, 10, np.random.default_rng(0))


def test_a_dirichlet_draw_that_meets_min_size_is_kept():
    """Rule: a draw is resampled only while a client has *fewer* than `min_size` samples. At min_size 0 every draw
    meets it, so the partition is the first draw (one Dirichlet vector per class); a rule that also resamples a
    client at exactly min_size would redraw here, and repair what it never fixes."""

    class Counting:
        def __init__(self, rng):
            self.rng, self.dirichlets = rng, 0

        def dirichlet(self, alpha):
            self.dirichlets += 1
            return self.rng.dirichlet(alpha)

        def permutation(self, x):
            return self.rng.permutation(x)

    rng = Counting(np.random.default_rng(5))
    parts = P.dirichlet(_labels(3), 20, 0.05, 0, rng)  # α small, 3 samples a class: most clients get none
    assert min(map(len, parts)) == 0 and rng.dirichlets == 10


def test_the_repair_moves_only_what_the_small_client_lacks_and_the_donor_can_spare():
    """Rule (`_repair_min_size`): the smallest client takes min(what it lacks, what the largest holds above
    min_size), so it ends at min_size exactly where the donor has a surplus, and no donor is taken below min_size
    (each keeps at least min_size of its own samples)."""
    parts = P._repair_min_size([np.arange(2), np.arange(2, 42)], 5, np.random.default_rng(0))
    assert [len(p) for p in parts] == [5, 37]
    before = [np.arange(0), np.arange(6), np.arange(6, 15)]  # 0, 6 and 9 samples: 15 = 3 × 5
    after = P._repair_min_size(before, 5, np.random.default_rng(0))
    assert [len(p) for p in after] == [5, 5, 5] and _is_partition(after, 15)
    assert [len(np.intersect1d(a, b)) for a, b in zip(after, before, strict=True)] == [0, 5, 5]


def test_classes_per_client_counts():
    labels = _labels(100)
    parts = P.classes_per_client(labels, 10, 2, 10, np.random.default_rng(4))
    assert _is_partition(parts, 1000)
    per_client = [set(np.unique(labels[p])) for p in parts]
    assert all(len(s) == 2 for s in per_client)
    holders = np.bincount([c for s in per_client for c in s], minlength=10)
    assert (holders == 2).all()  # every class held by exactly 2 clients, split 50/50
    assert all(len(p) == 100 for p in parts)


def test_classes_per_client_too_many_raises():
    with pytest.raises(DataError, match="classes_per_client"):
        P.classes_per_client(_labels(), 5, 11, 10, np.random.default_rng(0))


def test_classes_per_client_up_to_every_class_and_classes_nobody_holds():
    """k = the number of classes is allowed (each client holds them all: an even split of every class); with
    fewer holders than classes, the classes no one holds are left out and every held class still goes whole to
    its holders."""
    labels = _labels(30)
    parts = P.classes_per_client(labels, 3, 10, 10, np.random.default_rng(6))
    assert _is_partition(parts, 300) and all((np.bincount(labels[p], minlength=10) == 10).all() for p in parts)
    parts = P.classes_per_client(labels, 3, 2, 10, np.random.default_rng(6))  # 6 of 10 classes held, one each
    held = [np.unique(labels[p]) for p in parts]
    assert [len(h) for h in held] == [2, 2, 2] and len(np.unique(np.concatenate(held))) == 6
    assert all(len(p) == 60 for p in parts)


def test_classes_per_client_refuses_a_client_left_without_samples():
    # one sample per class, two holders per class: one of them gets none
    with pytest.raises(DataError, match="^federation.clients: 20 clients leave some client without samples$"):
        P.classes_per_client(_labels(1), 20, 1, 10, np.random.default_rng(0))


def test_split_local_is_stratified_and_exact():
    labels = _labels(50, 4)
    idx = np.arange(200)
    tr, va, te = P.split_local(idx, labels, 0.1, 0.2, np.random.default_rng(5))
    assert (len(tr), len(va), len(te)) == (140, 20, 40)
    assert _is_partition([tr, va, te], 200)
    assert (np.bincount(labels[te]) == 10).all() and (np.bincount(labels[va]) == 5).all()


def test_federation_is_deterministic_cached_and_balanced():
    src = make_synthetic(n_train=1200, n_test=300, seed=0)
    cfg = FederationConfig(clients=12, partition="dirichlet", alpha=0.3, new_clients=3)
    a = build_federation(src, cfg, seed=7, use_disk_cache=False)
    b = build_federation(src, cfg, seed=7)  # memory/disk cache path
    c = build_federation(src, cfg, seed=8, use_disk_cache=False)
    assert a.key == b.key != c.key
    assert all(
        (x.train == y.train).all() and (x.test == y.test).all() for x, y in zip(a.clients, b.clients, strict=True)
    )
    assert len(a.new) == 3 and sorted(a.new + a.participated) == list(range(12))
    counts = np.bincount(src.test.y[a.global_test].numpy())
    assert (counts == counts[0]).all()
    for cl in a.clients:
        assert abs(float(cl.prior.sum()) - 1) < 1e-6
        assert set(cl.train.tolist()).isdisjoint(cl.test.tolist())


def test_the_disk_cache_is_read_where_asked_under_its_key_only_and_rebuilt_when_corrupt(tmp_path, monkeypatch):
    monkeypatch.setenv("PFLBED_CACHE", str(tmp_path / "cache"))  # made, with its parents, by the first save
    monkeypatch.setattr(F, "_MEMORY", {})
    src = make_synthetic(n_train=600, n_test=100, seed=1)
    cfg = FederationConfig(clients=5, partition="iid", public=10, new_clients=1)
    fed = build_federation(src, cfg, seed=0)
    [path] = (tmp_path / "cache" / "federations").iterdir()
    assert path.name == f"{fed.key}.pt" and _same(F._load_cached(path, fed.key), fed)  # every field, as built

    def built(**kw):
        F._MEMORY.clear()
        return build_federation(src, cfg, seed=0, **kw).participated

    marked = replace(fed, participated=fed.participated[::-1])  # an entry told apart from a fresh build
    F._save_cached(marked, path)
    assert built() == marked.participated  # read from disk
    assert built(use_disk_cache=False) == fed.participated
    F._save_cached(replace(marked, key="0" * 20), path)  # a file of another federation under this name
    assert built() == fed.participated
    torch.save({"key": fed.key, "clients": Evil(f"touch {tmp_path / 'opened'}")}, path)  # a planted pickle: not run
    assert built() == fed.participated and not (tmp_path / "opened").exists()
    path.write_bytes(b"not a cache")
    assert built() == fed.participated and _same(F._load_cached(path, fed.key), fed)  # corrupt: rebuilt, rewritten
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
    monkeypatch.setenv("PFLBED_CACHE", str(path))  # a cache folder that cannot be made: only slower
    assert built() == fed.participated


def test_federation_keys_stay_what_they_were():
    """A key names a federation's cache file and is what a pretraining record was checked against: computed another
    way, every cache is rebuilt and every record stops matching. Change how it is computed only with `_FORMAT`, and
    these values with it (an unset `exclude_test_of` leaves the key it had before the option existed)."""
    src = make_synthetic(n_train=600, n_test=100, seed=1)
    users = replace(src, train=replace(src.train, user=torch.as_tensor(np.arange(600) % 5)))
    assert src.fingerprint() == "cb6019c7c28caedf"
    assert F.federation_key(src, FederationConfig(clients=4), 0) == "233a413c0442e74c3f01"
    assert F.federation_key(src, FederationConfig(clients=4, exclude_test_of=[1]), 0) == "d2f1340bbe17eee98cc3"
    assert F.federation_key(users, FederationConfig(clients=5, partition="natural"), 0) == "81c9dd6a3d1ae35ffee3"


@pytest.mark.parametrize("disk", [True, False])
def test_the_federations_of_the_excluded_seeds_use_the_disk_cache_as_asked(tmp_path, monkeypatch, disk):
    monkeypatch.setenv("PFLBED_CACHE", str(tmp_path))
    monkeypatch.setattr(F, "_MEMORY", {})
    src = make_synthetic(n_train=600, n_test=100, seed=1)
    build_federation(src, FederationConfig(clients=5, partition="iid", exclude_test_of=[1, 2]), 0, disk)
    assert len(list(tmp_path.glob("federations/*.pt"))) == (3 if disk else 0)


def test_sampling_stream_is_fixed_per_seed_and_round():
    part = list(range(0, 100, 3))
    assert sample_clients(0, 5, part, 0.2) == sample_clients(0, 5, part, 0.2)
    assert sample_clients(0, 5, part, 0.2) != sample_clients(0, 6, part, 0.2)
    s = sample_clients(1, 1, part, 0.2)
    assert len(s) == len(set(s)) == round(0.2 * len(part)) and set(s) <= set(part)  # without replacement
    assert all(len(sample_clients(0, r, part, 0.9)) == len(set(sample_clients(0, r, part, 0.9))) for r in range(20))
    assert len(sample_clients(0, 1, part, 0.001)) == 1  # at least one client


def test_train_per_client_caps_only_the_training_split():
    src = make_synthetic(n_train=2000, n_test=200, seed=2)
    full = build_federation(src, FederationConfig(clients=5, partition="iid"), 0, use_disk_cache=False)
    capped = build_federation(src, FederationConfig(clients=5, partition="iid", train_per_client=30), 0,
                              use_disk_cache=False)  # fmt: skip
    assert full.key != capped.key
    for a, b in zip(full.clients, capped.clients, strict=True):
        assert len(b.train) == 30 and set(b.train.tolist()) <= set(a.train.tolist())
        assert torch.equal(a.test, b.test) and torch.equal(a.val, b.val)


def test_public_split_is_disjoint_from_clients_and_leaves_partitions_alone_when_zero():
    src = make_synthetic(n_train=1200, n_test=100, seed=4)
    plain = build_federation(src, FederationConfig(clients=6), 0, use_disk_cache=False)
    again = build_federation(src, FederationConfig(clients=6, public=0), 0, use_disk_cache=False)
    assert all(torch.equal(a.train, b.train) for a, b in zip(plain.clients, again.clients, strict=True))
    assert plain.public.shape == (0,)
    fed = build_federation(src, FederationConfig(clients=6, public=300), 0, use_disk_cache=False)
    assert len(fed.public) == 300 and len(fed.public.unique()) == 300
    held = torch.cat([torch.cat([c.train, c.val, c.test]) for c in fed.clients])
    assert set(held.tolist()).isdisjoint(fed.public.tolist())
    assert len(held) + 300 == 1200
    with pytest.raises(DataError, match="federation.public"):
        build_federation(src, FederationConfig(clients=6, public=1200), 0, use_disk_cache=False)


def test_to_moves_every_index_tensor_and_prior_and_keeps_the_federation_where_it_already_is():
    """`Federation.to` on another device (meta here; CUDA in `tests/engine/test_cuda.py`): every index tensor and
    class prior is there, of its own size (a client's, the public set's, the shared sets', a manifest's new-client
    subsets); on the device where it is, the same object."""
    src = make_synthetic(n_train=600, n_test=100, seed=1)
    fed = build_federation(src, FederationConfig(clients=5, partition="iid", public=20), 0, use_disk_cache=False)
    fed = replace(fed, domain_val=[torch.arange(3)], domain_test=[torch.arange(4)],
                  new_subsets={4: [torch.arange(2), torch.arange(5)]})  # fmt: skip
    assert fed.to("cpu") is fed
    moved = fed.to("meta")

    def tensors(f):
        per_client = [t for c in f.clients for t in (c.train, c.val, c.test, c.prior)]
        return [*per_client, f.global_test, f.public, *f.domain_val, *f.domain_test, *f.new_subsets[4]]

    assert [t.device.type for t in tensors(moved)] == ["meta"] * len(tensors(fed))
    assert [t.shape for t in tensors(moved)] == [t.shape for t in tensors(fed)]
    assert [c.domain for c in moved.clients] == [c.domain for c in fed.clients] == [0] * 5  # no domains: domain 0
    assert (moved.participated, moved.new, moved.key, moved.num_classes) == (fed.participated, fed.new, fed.key, 10)


def test_a_federation_by_classes_per_client_and_one_of_exactly_one_sample_a_client():
    """`partition: classes` through `build_federation` (each client k labels, each label split evenly among its
    holders); a pool of exactly one sample per client is enough (one more client is refused, naming the field); a
    dataset without a test split is refused, pointing to the protocol that needs none."""
    src = make_synthetic(n_train=1000, n_test=100, seed=4)
    fed = build_federation(src, FederationConfig(clients=10, partition="classes", classes_per_client=3), 0,
                           use_disk_cache=False)  # fmt: skip
    y = src.train.y
    held = [torch.cat([c.train, c.val, c.test]) for c in fed.clients]
    assert [len(set(y[h].tolist())) for h in held] == [3] * 10 and len(torch.cat(held).unique()) == 1000
    even = build_federation(src, FederationConfig(clients=10, partition="dirichlet", alpha=100.0), 0,
                            use_disk_cache=False)  # fmt: skip
    assert min(len(set(y[torch.cat([c.train, c.val, c.test])].tolist())) for c in even.clients) >= 8  # Dir(100): all
    tiny = replace(src, train=replace(src.train, x=src.train.x[:6], y=src.train.y[:6]))
    fed = build_federation(tiny, FederationConfig(clients=6, partition="iid"), 0, use_disk_cache=False)
    assert [len(c.train) for c in fed.clients] == [1] * 6
    with pytest.raises(DataError, match="^federation.clients: 7 clients but the training pool has 6 samples$"):
        build_federation(tiny, FederationConfig(clients=7, partition="iid"), 0, use_disk_cache=False)
    no_test = replace(src, test=replace(src.test, x=src.test.x[:0], y=src.test.y[:0]))
    with pytest.raises(DataError, match=r"^dataset 'synthetic' has no test split; use federation.protocol=pflbed$"):
        build_federation(no_test, FederationConfig(clients=6), 0, use_disk_cache=False)


def test_the_federation_cache_is_under_pflbed_cache_or_the_user_s_cache_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("PFLBED_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("PFLBED_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "pflbed"


def test_scored_indices_hold_the_global_test_set_only_where_it_comes_from_the_training_pool():
    fed = build_federation(make_synthetic(n_train=600, n_test=100, seed=1), FederationConfig(clients=5), 0,
                           use_disk_cache=False)  # fmt: skip
    own = set(torch.cat([c.test for c in fed.clients]).tolist())
    assert set(fed.test_indices().tolist()) == own
    pooled = replace(fed, global_split="train", global_test=torch.tensor([0, 1, 2]))
    assert set(pooled.test_indices().tolist()) == own | {0, 1, 2}


def test_a_new_client_s_subsets_take_a_fraction_at_least_one_from_a_stream_of_the_run_s_seed_and_the_client():
    g = torch.Generator().manual_seed(0)
    assert len(draw_subset(torch.arange(10), 0.01, g)) == 1 and len(draw_subset(torch.arange(10), 0.45, g)) == 5
    cfg = FederationConfig(clients=8, partition="iid", new_clients=2)
    fed = build_federation(make_synthetic(n_train=1200, n_test=100, seed=1), cfg, 0, use_disk_cache=False)
    a, b = fed.new
    assert len(fed.clients[a].train) == len(fed.clients[b].train)  # iid: equal sizes, so equal draws would show

    def positions(cid, seed):  # where in its training split each chosen sample sits
        train = fed.clients[cid].train.tolist()
        return [train.index(i) for i in new_client_train(fed, cid, 0, 0.5, seed).tolist()]

    assert positions(a, 0) == positions(a, 0) != positions(b, 0)  # each client its own stream
    assert positions(a, 0) != positions(a, 1)  # and the run's seed in it


def test_the_public_set_the_caps_and_the_global_test_set_are_drawn_from_the_seed_and_balanced():
    """What a federation draws comes from its seed (rebuilt without any cache: the same; another seed: not): the
    public set and each client's capped training split (distinct samples: drawn without replacement); the global
    test set is class-balanced at the smallest class's count of the source's test split."""
    src = make_synthetic(n_train=1200, n_test=300, seed=6)
    cfg = FederationConfig(clients=5, partition="iid", public=100, train_per_client=60)

    def built(seed):
        F._MEMORY.clear()
        return build_federation(src, cfg, seed, use_disk_cache=False)

    a, b, other = built(0), built(0), built(1)
    assert torch.equal(a.public, b.public) and not torch.equal(a.public, other.public)
    assert all(torch.equal(x.train, y.train) for x, y in zip(a.clients, b.clients, strict=True))
    assert all(len(c.train) == len(c.train.unique()) == 60 for c in a.clients)
    counts = torch.bincount(src.test.y[a.global_test], minlength=10)  # this test split is balanced: all of it
    assert (counts == torch.bincount(src.test.y, minlength=10).min()).all() and len(a.global_test.unique()) == 300
