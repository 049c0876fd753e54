"""`federation.exclude_test_of`: a federation that never trains or validates on other seeds' test samples."""

import pytest
import torch

from pflbed.config import FederationConfig, validate_config
from pflbed.data.domains import with_domains
from pflbed.data.synthetic import make_synthetic
from pflbed.errors import ConfigError
from pflbed.federation import build_federation

REPORTED = [0, 1, 2]


def _overlap(trial, reported) -> int:
    seen = set(trial.seen_indices().tolist())
    return sum(len(seen & set(f.test_indices().tolist())) for f in reported)


@pytest.mark.parametrize("protocol", ["standard", "pflbed"])
def test_a_federation_excluding_the_reported_seeds_never_sees_their_test_samples(protocol):
    if protocol == "standard":
        src = make_synthetic(n_train=3000, n_test=200, seed=5)
        settings = {"clients": 10, "new_clients": 2, "public": 100}
    else:
        src = with_domains(make_synthetic(n_train=6000, n_test=200, seed=5), ["rot0", "rot90"])
        settings = {"protocol": "pflbed", "alpha": 0.3, "min_size": 5,
                    "pflbed": {"clients_per_domain": 4, "new_clients_per_domain": 2}}  # fmt: skip
    reported = [build_federation(src, FederationConfig(**settings), s, use_disk_cache=False) for s in REPORTED]
    plain = build_federation(src, FederationConfig(**settings), 100, use_disk_cache=False)
    assert _overlap(plain, reported) > 0  # the check can fail: another seed's partition of the same pool overlaps
    cfg = FederationConfig(**settings, exclude_test_of=REPORTED)
    trial = build_federation(src, cfg, 100, use_disk_cache=False)
    assert _overlap(trial, reported) == 0
    assert trial.key != plain.key
    assert len(trial.seen_indices()) > 0.3 * len(plain.seen_indices())  # a usable federation is left


def test_unset_exclusion_keeps_every_federation_key():
    src = make_synthetic(n_train=600, n_test=100, seed=1)
    a = build_federation(src, FederationConfig(clients=4), 0, use_disk_cache=False)
    b = build_federation(src, FederationConfig(clients=4, exclude_test_of=[]), 0, use_disk_cache=False)
    assert a.key == b.key and all(torch.equal(x.train, y.train) for x, y in zip(a.clients, b.clients, strict=True))


def test_exclusion_with_a_manifest_is_refused():
    with pytest.raises(ConfigError, match="exclude_test_of"):
        validate_config({"federation": {"manifest": "m.json", "exclude_test_of": [0]}})
