"""pFedMe (Dinh et al., NeurIPS 2020, Alg. 1): K inner steps θ ← θ − η_p(∇f(θ; D) + λ(θ − w_i)) per batch, then
w_i ← w_i − ηλ(w_i − θ); the reply is w_i, the personal model θ_i; the server mixes w ← (1 − β)w + β·mean(w_i),
the mean |D_i|-weighted, on the parameters (BatchNorm statistics: the mean)."""

import pytest
import torch
import torch.nn.functional as F

import pflbed
from pflbed.algorithms.base import ClientContext
from pflbed.algorithms.training import index_batches, load_params
from pflbed.config import validate_config
from pflbed.engine.loop import prepare

from .test_scaffold import BN_RUN, bn_replies
from .tiny import TINY, same_tensors

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


def test_momentum_and_weight_decay_are_not_used():
    """Eq. 7–8 are plain gradient steps: `train.momentum` and `train.weight_decay` change nothing (documented)."""
    out = []
    for train in ({}, {"momentum": 0.9, "weight_decay": 0.1}):
        algo = prepare(_cfg(train=train))
        server, data = algo.init_server(), algo.ctx.client_data(0)
        out.append(algo.client_update(server, algo.init_client(0), data,
                                      ClientContext(1, 0, torch.Generator().manual_seed(6))))  # fmt: skip
    assert same_tensors(out[0][0], out[1][0]) and same_tensors(out[0][1], out[1][1])
