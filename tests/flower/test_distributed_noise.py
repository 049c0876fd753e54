"""Distributed noise (`privacy.noise: distributed`): each site adds its share of DP's Gaussian noise before SecAgg+
masks its update, so the server never sees a noise-free sum; the shares of any cohort SecAgg+ can unmask add up to
at least the variance the accountant counts."""

import json
import math

import pytest
import torch

from pflbed.config import validate_config
from pflbed.errors import ConfigError
from pflbed.privacy import Mechanism

pytest.importorskip("flwr")

from flwr.common import parameters_to_ndarrays  # noqa: E402

from pflbed.flower.secagg_node import (  # noqa: E402
    NoiseShare,
    noise_share,
    reconstruction_threshold,
    site_update,
)

N = 40_000  # entries: the empirical std is within 2 % of the true one (measured: its relative spread 0.44 %, so 2 %
# is 4.5 of those — the 1 % allowed before failed about one run in fifty; a share off by t/(t−1) = 3/2 in variance
# is 22 % off in std)


def _update(payload, replies, share):
    fitres = site_update(payload, replies, {}, share)
    return [torch.from_numpy(a) for a in parameters_to_ndarrays(fitres.parameters)], fitres


@pytest.mark.parametrize("sites, t", [(2, 2), (3, 2), (4, 2), (5, 2), (6, 3), (7, 4), (10, 5), (11, 6)])
def test_the_threshold_is_flower_s_for_every_site_holding_a_share(sites, t):
    """SecAgg+'s reconstruction threshold as Flower computes it for the workflow `flower.secagg` builds (all S sites
    hold shares, half of them needed): max(round(0.5·S), 2)."""
    from flwr.server.workflow.secure_aggregation.secaggplus_workflow import SecAggPlusWorkflow

    from pflbed.flower.secagg_node import NUM_SHARES, RECONSTRUCTION

    assert reconstruction_threshold(sites) == t
    workflow = SecAggPlusWorkflow(num_shares=NUM_SHARES, reconstruction_threshold=RECONSTRUCTION)
    shares = round(workflow.num_shares * sites)  # Flower's setup stage, for a fractional num_shares and threshold
    assert shares == sites and max(round(workflow.reconstruction_threshold * shares), 2) == t


def test_a_site_s_share_has_variance_sigma2_c2_over_t_and_is_scaled_to_the_release():
    payload = {"w": torch.zeros(N), "steps": torch.zeros(3, dtype=torch.int64)}
    share = NoiseShare.of(sigma=1.2, clip=0.5, sites=6, expected_clients=25.0)  # t = 3
    assert share.std == pytest.approx(1.2 * 0.5 / math.sqrt(3))
    (steps, w), fitres = _update(payload, [], share)  # no client sampled here: the share still goes in
    assert float(w.std()) * 25.0 == pytest.approx(share.std, rel=0.02) and abs(float(w.mean())) < 1e-3
    assert torch.equal(steps, torch.zeros(3, dtype=torch.float64))  # an integer instruction: never noised
    assert fitres.num_examples == 1 and json.loads(fitres.metrics["keys"]) == []
    (_, again), _ = _update(payload, [], share)
    assert not torch.equal(w, again)  # from the OS: a new draw each time, nobody can predict or replay it


def test_a_site_s_update_is_its_clients_summed_changes_plus_its_share_over_qn():
    payload = {"w": torch.ones(N)}
    r1, r2 = {"w": torch.full((N,), 1.5)}, {"w": torch.full((N,), 0.5 + 1.0)}
    share = NoiseShare(std=0.3, expected_clients=10.0)
    (v,), fitres = _update(payload, [(r1, 1), (r2, 1)], share)
    noise = v * 10.0 - 1.0  # Σ_c Δ_c = 0.5 + 0.5
    assert float(noise.std()) == pytest.approx(0.3, rel=0.02) and abs(float(noise.mean())) < 0.01
    assert fitres.num_examples == 1 and json.loads(fitres.metrics["keys"]) == ["w"]


def test_any_cohort_secagg_can_unmask_sums_to_at_least_the_accounted_variance():
    """S = 5 sites (t = 2): the two surviving sites' shares sum to variance σ²C² exactly, all five to 2.5 σ²C²."""
    sigma, clip, qn = 1.0, 1.0, 1.0
    share = NoiseShare.of(sigma, clip, 5, qn)
    updates = [_update({"w": torch.zeros(N)}, [], share)[0][0] for _ in range(5)]
    for cohort in (2, 5):
        total = torch.stack(updates[:cohort]).sum(0) * qn
        assert float(total.var()) == pytest.approx(cohort / 2 * sigma**2 * clip**2, rel=0.03)


def test_with_distributed_noise_the_server_adds_none_unless_no_site_was_asked():
    mech = Mechanism(clip=1.0, sigma=2.0, rate=0.5, clients=4, delta=1e-5, randomness="os", noise="distributed")
    w = {"w": torch.zeros(N)}
    replies = [(0, {"w": torch.full((N,), 0.25)}), (3, {"w": torch.full((N,), 0.25)})]
    out = dict(mech.replies(0, 1, w, iter(replies), count=2))
    # r' = w + (m/qN)(r − w): the sites' shares are in r already; nothing added on the server
    assert all(torch.equal(out[c]["w"], torch.full((N,), 0.25)) for c in (0, 3))
    (cid, alone), = mech.replies(0, 1, w, iter(()), count=0)  # nobody sampled: the server draws the noise itself
    assert cid == -1 and float(alone["w"].std()) * 2.0 == pytest.approx(2.0, rel=0.02)
    central = Mechanism(1.0, 2.0, 0.5, 4, 1e-5, "os", "rdp", "central")
    noised = dict(central.replies(0, 1, w, iter(replies), count=2))[0]["w"]
    assert float((noised - 0.25).std()) * 2.0 == pytest.approx(2.0, rel=0.02)


def _sites_tree(**privacy):
    return {"dataset": {"name": "synthetic"}, "executor": {"name": "flower"},
            "federation": {"clients": 4, "sample_fraction": 0.5},
            "sites": {"local": True, "secagg": True, "input_shape": [1, 8, 8], "num_classes": 10},
            "privacy": {"clip": 1.0, "noise_multiplier": 1.2, **privacy}}  # fmt: skip


def test_a_site_s_share_follows_the_run_s_config():
    cfg = validate_config(_sites_tree(noise="distributed"))
    share = noise_share(cfg, sites=4)
    assert share == NoiseShare(1.2 * 1.0 / math.sqrt(2), 0.5 * 4)
    assert noise_share(validate_config(_sites_tree()), sites=4) is None  # central: the server adds it
    derived = noise_share(validate_config(_sites_tree(noise="distributed", noise_multiplier=None,
                                                      target_epsilon=4.0)), sites=4)  # fmt: skip
    assert derived is not None and derived.std > 0


def test_distributed_noise_is_refused_without_secagg_or_with_the_seeded_stream():
    tree = _sites_tree(noise="distributed")
    with pytest.raises(ConfigError, match="privacy.noise: distributed needs sites.secagg=true"):
        validate_config({**tree, "sites": {**tree["sites"], "secagg": False}})
    with pytest.raises(ConfigError, match="privacy.randomness: seeded does not apply with privacy.noise=distributed"):
        validate_config(_sites_tree(noise="distributed", randomness="seeded"))
    with pytest.raises(ConfigError, match="noise needs privacy.clip"):
        validate_config({"dataset": {"name": "synthetic"}, "privacy": {"noise": "distributed"}})
