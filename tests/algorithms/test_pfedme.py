"""pFedMe (Dinh et al., NeurIPS 2020, Alg. 1): K inner steps θ ← θ − η_p(∇f(θ; D) + λ(θ − w_i)) per batch, then
w_i ← w_i − ηλ(w_i − θ); the reply is w_i, the personal model θ_i; the server mixes w ← (1 − β)w + β·mean(w_i),
the mean |D_i|-weighted, on the parameters (BatchNorm statistics: the mean). `train_clients: all`: every client
trains, the sampled ones reply."""

import pytest
import torch
import torch.nn.functional as F

import pflbed
from pflbed.algorithms.base import ClientContext
from pflbed.algorithms.training import index_batches, load_params, weighted_mean
from pflbed.config import validate_config
from pflbed.engine import wire
from pflbed.engine.build import prepare
from pflbed.engine.executor import update_client
from pflbed.errors import ConfigError
from pflbed.federation import sample_clients

from ..tiny import TINY, same_tensors
from .test_scaffold import BN_RUN, bn_replies

OPTS = {"lam": 3.0, "K": 2, "personal_lr": 0.05}


def _cfg(train=None, **options):
    algorithm = {"name": "pfedme", **OPTS, **options}
    return validate_config({**TINY, "train": {**TINY["train"], **(train or {})}, "algorithm": algorithm,
                            "executor": {"threads": 1}})  # fmt: skip


def _algo(**options):
    return prepare(_cfg(**options))


def test_inner_and_outer_updates_are_eq_7_and_8():
    algo = _algo()
    server, data = algo.init_server(), algo.ctx.client_data(0)
    reply, theta = algo.client_update(server, algo.init_client(0), data,
                                      ClientContext(1, 0, torch.Generator().manual_seed(6)))  # fmt: skip
    model, t = algo.ctx.model, algo.ctx.cfg.train
    model.train()
    names = [k for k, _ in model.named_parameters()]
    th = {k: server[k].clone() for k in names}
    w = {k: server[k].clone() for k in names}
    for b in index_batches(data.train, t.batch_size, t.local_epochs, torch.Generator().manual_seed(6)):
        for _ in range(OPTS["K"]):
            load_params(model, th)
            params = dict(model.named_parameters())
            grads = torch.autograd.grad(F.cross_entropy(model(data.x[b]), data.y[b]), [params[k] for k in names])
            lr, lam = OPTS["personal_lr"], OPTS["lam"]
            th = {k: th[k] - lr * (g + lam * (th[k] - w[k])) for k, g in zip(names, grads, strict=True)}
        w = {k: w[k] - t.lr * OPTS["lam"] * (w[k] - th[k]) for k in names}
    assert all(torch.allclose(reply[k], w[k], atol=1e-6) for k in names)
    assert all(torch.allclose(theta[k], th[k], atol=1e-6) for k in names)
    assert algo.personal_model(server, theta).params is theta  # P-FL scores θ_i


@pytest.mark.parametrize("beta", [1.0, 2.0, 0.5])
def test_server_mixes_the_size_weighted_mean_with_beta(beta):
    """w ← (1 − β)w + β·Σ |D_i| w_i / Σ |D_i| (the authors' code weights by |D_i| too); β = 1: the mean itself."""
    algo = _algo(beta=beta)
    server = algo.init_server()
    g = torch.Generator().manual_seed(0)
    replies = {c: {k: v + 0.1 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
                   for k, v in server.items()} for c in (1, 4)}  # fmt: skip
    agg = algo.aggregator(1, server, {1: 1.0, 4: 3.0})
    for c in (1, 4):
        agg.add(c, replies[c])
    out = agg.result()
    assert out.keys() == server.keys()
    for k, v in server.items():
        mean = 0.25 * replies[1][k] + 0.75 * replies[4][k]
        assert torch.allclose(out[k], (1 - beta) * v + beta * mean, atol=1e-6)


@pytest.mark.parametrize("beta", [2.0, 0.5])
def test_beta_mixes_the_parameters_and_leaves_the_batchnorm_statistics_at_their_mean(beta):
    """β > 1 on the running statistics extrapolated the variances below zero (one round on cnn_bn at β = 2: 604 of
    608 negative, G-FL at chance): they take the |D_i|-weighted mean, the batch counters the maximum."""
    algo = prepare(validate_config({**BN_RUN, "algorithm": {"name": "pfedme", "beta": beta}}))
    server = algo.init_server()
    replies = bn_replies(algo, server, (1, 4), 7)
    agg = algo.aggregator(1, server, {1: 1.0, 4: 3.0})
    for c in (1, 4):
        agg.add(c, replies[c])
    out = agg.result()
    params = {k for k, _ in algo.ctx.model.named_parameters()}
    buffers = [k for k in server if k not in params]
    assert any(k.endswith("running_var") for k in buffers) and any(k.endswith("running_mean") for k in buffers)
    for k, v in server.items():
        mean = 0.25 * replies[1][k] + 0.75 * replies[4][k]
        if k in params:
            assert torch.allclose(out[k], (1 - beta) * v + beta * mean, atol=1e-6)
        elif v.is_floating_point():
            assert torch.allclose(out[k], mean, atol=1e-7)
        else:
            assert out[k].dtype == v.dtype and torch.equal(out[k], torch.maximum(replies[1][k], replies[4][k]))
    assert all(bool((out[k] > 0).all()) for k in buffers if k.endswith("running_var"))


def test_a_round_at_beta_2_on_a_batchnorm_model_keeps_every_variance_positive():
    r = pflbed.run({**BN_RUN, "algorithm": {"name": "pfedme", "beta": 2.0}}, write=False)
    var = [v for k, v in r.server.items() if k.endswith("running_var")]
    assert sum(v.numel() for v in var) == 608 and all(bool((v > 0).all()) for v in var)


@pytest.mark.parametrize("mode", ["sampled", "all"])
def test_sampled_clients_reply_and_with_all_every_client_trains(mode):
    """Alg. 1, lines 3–10: every client trains from w^t, the server mixes the sample's w_i (|D_i|-weighted) — in
    both modes the same server step; `all` also moves every other client's θ_i, and those reply nothing."""
    cfg = _cfg(train={"rounds": 1}, beta=2.0, train_clients=mode)
    r = pflbed.run(cfg, write=False)
    algo, fed = r.executor.algo, r.executor.algo.ctx.federation
    sampled = sample_clients(cfg.seed, 1, fed.participated, cfg.federation.sample_fraction)
    sizes = {c: fed.num_train(c) for c in sampled}
    assert len(set(sizes.values())) > 1 and len(sampled) < len(fed.participated)
    w0 = algo.init_server()
    updates = {c: update_client(algo, 1, c, w0, algo.init_client(c)) for c in fed.participated}
    mean = weighted_mean({c: updates[c][0] for c in sampled}, sizes)
    assert all(torch.allclose(r.server[k], -w0[k] + 2 * mean[k], atol=1e-6) for k in w0)
    trained = set(fed.participated) if mode == "all" else set(sampled)
    for c in fed.participated:
        assert not same_tensors(updates[c][1], algo.init_client(c))  # a trained θ_i moves
        assert same_tensors(r.executor.states[c], updates[c][1] if c in trained else algo.init_client(c))
    comm = r.summary["communication"]
    assert comm["up_bytes_per_round"] == sum(wire.num_bytes(updates[c][0]) for c in sampled)
    assert comm["down_bytes_per_round"] == sum(map(wire.num_bytes, algo.configure(1, w0, sampled).values()))
    assert comm["down_bytes_per_round"] == wire.num_bytes(w0) * len(trained) + 4 * (len(trained) - len(sampled))


def test_a_client_outside_the_sample_replies_nothing_and_without_the_samples_replies_w_stays():
    algo = _algo(train_clients="all", beta=2.0)
    server = algo.init_server()
    payloads = algo.configure(1, server, [0, 3])
    assert sorted(payloads) == sorted(algo.ctx.federation.participated)
    assert payloads[0] is server and payloads[3] is server and "pfedme/keep" in payloads[1]
    reply, theta = algo.client_update(payloads[1], algo.init_client(1), algo.ctx.client_data(1),
                                      ClientContext(1, 1, torch.Generator().manual_seed(2)))  # fmt: skip
    kept_reply, kept_theta = algo.client_update(server, algo.init_client(1), algo.ctx.client_data(1),
                                                ClientContext(1, 1, torch.Generator().manual_seed(2)))  # fmt: skip
    assert reply == {} and same_tensors(theta, kept_theta) and kept_reply.keys() == server.keys()
    agg = algo.aggregator(1, server, {})  # the sample's replies were lost, another client's came
    agg.add(1, reply)
    out = agg.result()
    assert same_tensors(out, server)


def test_momentum_and_weight_decay_are_not_used():
    """Eq. 7–8 are plain gradient steps: `train.momentum` and `train.weight_decay` change nothing (documented)."""
    out = []
    for train in ({}, {"momentum": 0.9, "weight_decay": 0.1}):
        algo = prepare(_cfg(train=train))
        server, data = algo.init_server(), algo.ctx.client_data(0)
        out.append(algo.client_update(server, algo.init_client(0), data,
                                      ClientContext(1, 0, torch.Generator().manual_seed(6))))  # fmt: skip
    assert same_tensors(out[0][0], out[1][0]) and same_tensors(out[0][1], out[1][1])


def test_an_unknown_train_clients_value_is_a_config_error():
    with pytest.raises(ConfigError, match=r"^algorithm.train_clients: Input should be 'sampled' or 'all'"):
        _cfg(train_clients="every")


def test_a_site_takes_the_keep_flag_only_where_the_run_trains_every_client():
    """`payload_fits`: the flag that tells a client outside the round's sample to keep its update comes only with
    `train_clients: all`, as a float scalar; the sampled clients' payload is the model alone either way."""
    for mode in ("all", "sampled"):
        algo = _algo(train_clients=mode)
        server = algo.init_server()
        keep = {**server, "pfedme/keep": torch.ones(())}
        assert algo.payload_fits(1, 0, server, {}) is None
        assert algo.payload_fits(1, 1, keep, {}) == (None if mode == "all" else "has key 'pfedme/keep', which this "
                                                     "algorithm's server does not send")  # fmt: skip
    algo = _algo(train_clients="all")
    assert algo.payload_fits(1, 1, {**keep, "pfedme/keep": torch.ones(2)}, {}) == ("has 'pfedme/keep' of shape [2], "
                                                                                     "expected []")  # fmt: skip
