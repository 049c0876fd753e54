"""PFLBED protocol: the split, domain transforms and the class-weighted domain evaluation."""

from dataclasses import replace

import numpy as np
import pytest
import torch

import pflbed
from pflbed.config import DatasetConfig, FederationConfig, validate_config
from pflbed.config.federation import UNREAD_BY_PFLBED
from pflbed.data import load_source
from pflbed.data.domains import TRANSFORMS, with_domains
from pflbed.data.synthetic import make_synthetic
from pflbed.errors import ConfigError, DataError
from pflbed.federation import build_federation
from pflbed.federation.pflbed import _balanced_holdout, pflbed_split

from ..tiny import TINY


def _rot4(n_train=4000):
    return with_domains(make_synthetic(n_train=n_train, n_test=200, seed=3), ["rot0", "rot90", "rot180", "rot270"])


PF = {"protocol": "pflbed", "alpha": 0.3, "min_size": 5,
      "pflbed": {"clients_per_domain": 4, "new_clients_per_domain": 2}}  # fmt: skip


def test_pflbed_split_properties():
    src = _rot4()
    fed = build_federation(src, FederationConfig(**PF), seed=0, use_disk_cache=False)
    y, dom = src.train.y, src.train.domain
    assert len(fed.participated) == 16 and len(fed.new) == 8
    assert fed.domain_test and len(fed.domain_test) == len(fed.domain_val) == 4
    all_shared = torch.cat(fed.domain_test + fed.domain_val)
    assert len(all_shared.unique()) == len(all_shared)  # test and val sets disjoint
    for d in range(4):
        n_d = int((dom == d).sum())
        for idx, frac in ((fed.domain_test[d], 0.15), (fed.domain_val[d], 0.05)):
            counts = torch.bincount(y[idx], minlength=10)
            assert (counts == counts[0]).all() and counts[0] == int(frac * n_d / 10)  # class-balanced
            assert (dom[idx] == d).all()
    shared = set(all_shared.tolist())
    seen: set[int] = set()
    for cl in fed.clients:
        train = set(cl.train.tolist())
        assert train.isdisjoint(shared) and train.isdisjoint(seen)  # no leak, no overlap between clients
        seen |= train
        assert (dom[cl.train] == cl.domain).all()  # every client from one domain
        assert torch.allclose(cl.prior, torch.bincount(y[cl.train], minlength=10).float() / len(cl.train))
    for d in range(4):  # participated ≈ 60 %, new ≈ 20 % of the domain
        n_d = int((dom == d).sum())
        part = sum(len(fed.clients[c].train) for c in fed.participated if fed.clients[c].domain == d)
        new = sum(len(fed.clients[c].train) for c in fed.new if fed.clients[c].domain == d)
        assert abs(part - 0.6 * n_d) <= 1 and abs(new - 0.2 * n_d) <= 1


def test_pflbed_errors():
    no_domains = (r"^federation.protocol=pflbed needs a dataset with domains; 'synthetic' has none \(use fmnist-rot4, "
                  r"digits-rot4, a folder dataset, or set dataset.domains\)$")
    with pytest.raises(DataError, match=no_domains):
        build_federation(make_synthetic(), FederationConfig(**PF), 0, use_disk_cache=False)
    with pytest.raises(DataError, match="class-balanced"):
        build_federation(_rot4(120), FederationConfig(**PF), 0, use_disk_cache=False)


@pytest.mark.parametrize("key", ["clients_per_domain", "new_clients_per_domain"])
def test_a_portion_of_exactly_clients_times_min_size_is_split_and_one_sample_less_is_refused(key):
    """Rule: a domain's participated (new) portion must hold m × min_size samples for its m clients. _rot4 has 1,000
    samples a domain: 600 participated (4 clients) and 200 new (here 1 client beside 4 participated, 2 beside 1).
    At min_size = portion / m each client gets exactly min_size; at one more the split is refused, naming the field
    and the domain."""
    portion, m, counts = {"clients_per_domain": (600, 4, (4, 1)), "new_clients_per_domain": (200, 2, (1, 2))}[key]
    pf = {"clients_per_domain": counts[0], "new_clients_per_domain": counts[1]}
    split = pflbed_split(_rot4(), FederationConfig(**{**PF, "min_size": portion // m, "pflbed": pf}),
                         np.random.default_rng(0))  # fmt: skip
    ids = split.participated if key == "clients_per_domain" else split.new
    assert {len(split.clients[c][0]) for c in ids} == {portion // m}
    over = FederationConfig(**{**PF, "min_size": portion // m + 1, "pflbed": pf})
    with pytest.raises(DataError, match=rf"^federation.pflbed.{key}: domain 'rot0' has {portion} samples for {m} "
                                        rf"clients × min_size {portion // m + 1}$"):  # fmt: skip
        pflbed_split(_rot4(), over, np.random.default_rng(0))


def test_fractions_over_one_is_a_config_error():
    from pflbed.errors import ConfigError

    with pytest.raises(ConfigError, match="federation.pflbed: .*exceeds 1"):
        pflbed.load_config(overrides=["federation.pflbed.participated=0.9"])


def test_rotation_domains_are_exact_and_balanced():
    base = make_synthetic(n_train=400, n_test=200, seed=3)
    src = _rot4(400)
    d = src.train.domain
    assert torch.equal(src.train.x[d == 0], base.train.x[d == 0])
    assert torch.equal(src.train.x[d == 1], torch.rot90(base.train.x[d == 1], 1, dims=(-2, -1)))
    for c in range(10):  # each class spread evenly over the domains
        counts = torch.bincount(d[src.train.y == c], minlength=4)
        assert counts.max() - counts.min() <= 1
    assert torch.equal(_rot4(400).train.x, src.train.x)  # deterministic


def test_invert_is_one_minus_pixel_in_normalized_space():
    x = torch.rand(2, 1, 4, 4)
    mean, std = 0.3, 0.4
    inv = TRANSFORMS["invert"]((x - mean) / std, (mean, std), torch.Generator())
    assert torch.allclose(inv * std + mean, 1 - x, atol=1e-6)


def test_builtin_digits_rot4_and_unknown_transform():
    src = load_source(DatasetConfig(name="digits-rot4"))
    assert src.domain_names == ("rot0", "rot90", "rot180", "rot270") and src.train.domain is not None
    with pytest.raises(DataError, match="dataset.domains"):
        load_source(DatasetConfig(name="digits", domains=["rot45"]))


def test_pflbed_run_reports_domain_weighted_pfl_and_new_clients():
    cfg = {**TINY, "dataset": {"name": "digits-rot4"},
           "federation": {**PF, "pflbed": {"clients_per_domain": 2, "new_clients_per_domain": 1}},
           "eval": {"every": 2, "finetune": [], "new_clients": {"epochs": 2, "lrs": [0.01, 0.05]}}}  # fmt: skip
    res = pflbed.run(cfg, write=False)
    nc = res.summary["new_clients"]
    assert nc["clients"] == 4 and set(nc["methods"]) == {"ft", "lp"} and nc["zero_shot"] is not None
    for r in nc["methods"]["ft"].values():
        assert set(r["per_lr"]) == {"0.01", "0.05"}
        assert r["delta"] == pytest.approx(r["best"] - r["last"])
        assert r["last"] == r["per_lr"][f"{r['lr_last']:g}"]["last"]
    # P-FL under PFLBED is the class-weighted accuracy on the client's domain test set: recompute one client.
    algo = res.executor.algo
    fed, src = algo.ctx.federation, algo.ctx.source
    c = fed.participated[0]
    cl = fed.clients[c]
    idx = fed.domain_test[cl.domain]
    pred = algo.personal_model(res.server, {}).logits(src.train.x[idx]).argmax(1)
    w = cl.prior[src.train.y[idx]].double()
    expected = float((w * (pred == src.train.y[idx]).double()).sum() / w.sum())
    assert res.summary["per_client"]["pfl_acc"][0] == pytest.approx(expected)
    assert np.isclose(res.summary["final"]["pfl_acc"], np.mean(res.summary["per_client"]["pfl_acc"]))


def test_folder_dataset_runs_end_to_end_under_pflbed(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for d, dom in enumerate(("photo", "sketch")):
        for c, cls in enumerate(("cat", "dog", "fish")):
            folder = tmp_path / "tree" / dom / cls
            folder.mkdir(parents=True)
            for i in range(40):
                base = np.full((10, 10, 3), 40 + 70 * c, dtype=np.uint8)  # at most 220: no clipping, no copies
                img = (base + rng.integers(0, 30, base.shape) + 40 * d).astype(np.uint8)
                Image.fromarray(img).save(folder / f"{i}.{'png' if i % 2 else 'jpg'}")
    cfg = {**TINY, "dataset": {"name": "folder", "path": str(tmp_path / "tree"), "image_size": 8},
           "federation": {**PF, "pflbed": {"clients_per_domain": 2, "new_clients_per_domain": 1}},
           "eval": {"every": 2, "finetune": [],
                    "new_clients": {"epochs": 1, "lrs": [0.05], "methods": ["lp"]}}}  # fmt: skip
    res = pflbed.run(cfg, write=False)
    assert res.summary["dataset"] == "folder" and res.summary["clients"] == {"participated": 4, "new": 2}
    assert res.summary["final"]["gfl_acc"] > 1 / 3  # 3 well-separated colours: better than chance


def test_a_source_with_unnamed_domains_splits_as_one_with_named_ones():
    """A data source may carry domain ids without names (a user's own `DataSource`): its domains are then 0 … D−1
    by id, the same split as with names; the names only label errors. Called directly, below the federation cache
    (whose key does not hold the names)."""
    src, cfg = _rot4(), FederationConfig(**PF)
    named = pflbed_split(src, cfg, np.random.default_rng(4))
    unnamed = pflbed_split(replace(src, domain_names=()), cfg, np.random.default_rng(4))
    assert len(named.clients) == len(unnamed.clients) == 24 and len(unnamed.domain_test) == 4
    assert all(np.array_equal(a, b) and d == e for (a, d), (b, e) in zip(named.clients, unnamed.clients, strict=True))
    assert all(map(np.array_equal, named.domain_test + named.domain_val, unnamed.domain_test + unnamed.domain_val))
    y = src.train.y.clone()  # a copy: the synthetic source is cached
    y[src.train.domain == 1] = 0  # domain 1 holds class 0 only: no class-balanced test set
    one_class = replace(src, train=replace(src.train, y=y), domain_names=())
    with pytest.raises(DataError, match="domain '1' class 1 has 0 samples"):
        pflbed_split(one_class, cfg, np.random.default_rng(4))


def test_the_class_balanced_holdout_takes_down_to_one_sample_a_class_and_refuses_less():
    """Rule (`_balanced_holdout`): ⌊fraction·|domain|/classes⌋ test (val) samples of every class, at least one
    each; a class with exactly test + val samples gives them all; fewer, or a fraction below one a class, is
    refused naming the domain (and the class)."""
    labels = np.repeat(np.arange(10), 2)  # 20 samples, 2 a class
    test, val, rest = _balanced_holdout(np.arange(20), labels, 10, 0.5, 0.5, "d", np.random.default_rng(0))
    assert sorted(labels[test]) == sorted(labels[val]) == list(range(10)) and len(rest) == 0
    with pytest.raises(DataError, match=r"^federation.pflbed: domain 'd' has 20 samples, too few for a class-balanced "
                                        r"test and val set over 10 classes \(test 0.5, val 0.04\)$"):  # fmt: skip
        _balanced_holdout(np.arange(20), labels, 10, 0.5, 0.04, "d", np.random.default_rng(0))
    short = labels.copy()
    short[7] = 4  # class 3 has one sample
    with pytest.raises(DataError, match=r"^federation.pflbed: domain 'd' class 3 has 1 samples; a class-balanced "
                                        r"test \+ val set needs 2 per class$"):  # fmt: skip
        _balanced_holdout(np.arange(20), short, 10, 0.5, 0.5, "d", np.random.default_rng(0))


def test_public_data_under_pflbed_is_held_by_no_client_and_the_domains_split_the_rest():
    """`federation.public` under pflbed: drawn from the whole pool first (held by no client, in no shared val or
    test set), the domains' splits taken from what is left; public 0 is the split it always was."""
    src = _rot4()
    plain = build_federation(src, FederationConfig(**PF), seed=0, use_disk_cache=False)
    fed = build_federation(src, FederationConfig(**PF, public=300), seed=0, use_disk_cache=False)
    assert plain.public.numel() == 0 and len(fed.public.unique()) == 300
    public = set(fed.public.tolist())
    held = torch.cat([*(c.train for c in fed.clients), *fed.domain_val, *fed.domain_test])
    assert public.isdisjoint(held.tolist())
    # the domains' fractions apply to what is left of each domain
    for d in range(4):
        left = int((src.train.domain == d).sum()) - sum(src.train.domain[i] == d for i in public)
        assert len(fed.domain_test[d]) == 10 * int(0.15 * left / 10)
    assert len(plain.domain_test[0]) == 10 * int(0.15 * int((src.train.domain == 0).sum()) / 10)


def test_ktpfl_runs_on_the_pflbed_protocol_with_public_data():
    cfg = {**TINY, "dataset": {"name": "digits-rot4"}, "train": {**TINY["train"], "rounds": 2},
           "federation": {**PF, "public": 64, "pflbed": {"clients_per_domain": 2, "new_clients_per_domain": 0}},
           "algorithm": {"name": "ktpfl", "architectures": ["mlp"], "distill_steps": 2}}  # fmt: skip
    res = pflbed.run(cfg, write=False, progress=False)
    assert res.executor.algo.ctx.federation.public.numel() == 64 and len(res.summary["per_client"]["pfl_acc"]) == 8


@pytest.mark.parametrize("key", sorted(UNREAD_BY_PFLBED))
def test_a_standard_setting_pflbed_does_not_read_is_refused_naming_it_and_its_default_passes(key):
    default = FederationConfig.model_fields[key].default
    changed = {"clients": 7, "new_clients": 1, "partition": "iid", "classes_per_client": 3, "min_samples": 3,
               "train_per_client": 50, "val_fraction": 0.2, "test_fraction": 0.3}[key]  # fmt: skip
    assert changed != default
    with pytest.raises(ConfigError, match=rf"^federation: {key} is not read by protocol pflbed; \S"):
        validate_config({**TINY, "federation": {**PF, key: changed}})
    cfg = validate_config({**TINY, "federation": {**PF, key: default}})
    validate_config(cfg.model_dump(mode="json"))  # a config dumped and read again (a run dir, a worker) carries all
    validate_config({**TINY, "federation": {**PF, key: changed, "protocol": "standard", "pflbed": {}}})


def test_the_pflbed_split_set_under_the_standard_protocol_is_refused_and_its_default_passes():
    for key, value in {"clients_per_domain": 3, "new_clients_per_domain": 0, "participated": 0.5, "new": 0.1,
                       "val": 0.01, "test": 0.1}.items():  # fmt: skip
        with pytest.raises(ConfigError, match=rf"^federation: pflbed.{key} is read only by protocol pflbed; set "):
            validate_config({**TINY, "federation": {**TINY["federation"], "pflbed": {key: value}}})
    cfg = validate_config({**TINY, "federation": {**TINY["federation"], "pflbed": {"clients_per_domain": 20}}})
    validate_config(cfg.model_dump(mode="json"))


def test_pfl_test_global_under_pflbed_is_refused_naming_it():
    """PFLBED scores each client on its domain's test set; `eval.pfl_test: global` would be ignored."""
    with pytest.raises(ConfigError, match=r"eval\.pfl_test: global is not read by federation\.protocol pflbed"):
        validate_config({**TINY, "federation": PF, "eval": {**TINY["eval"], "pfl_test": "global"}})
    validate_config({**TINY, "federation": PF, "eval": {**TINY["eval"], "pfl_test": "local"}})
    validate_config({**TINY, "eval": {**TINY["eval"], "pfl_test": "global"}})
