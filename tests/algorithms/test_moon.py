"""MOON (Li, He & Song, CVPR 2021, Eqs. 2-3): local SGD on ℓ_sup + μ·ℓ_con, ℓ_con contrasting the body's
representation with the global model's (positive) and the client's previous model's (negative); FedAvg's
aggregation; the client keeps its trained model."""

import torch
import torch.nn.functional as F

import pflbed
from pflbed.algorithms.base import ClientContext
from pflbed.algorithms.training import index_batches, load_params
from pflbed.config import validate_config
from pflbed.engine.build import prepare

from ..tiny import TINY, same_tensors


def _cfg(name, **options):
    return validate_config({**TINY, "train": {**TINY["train"], "local_epochs": 2, "momentum": 0.0},
                            "algorithm": {"name": name, **options}, "executor": {"threads": 1}})  # fmt: skip


def _update(algo, server, state, seed=7):
    data = algo.ctx.client_data(0)
    return algo.client_update(server, state, data, ClientContext(1, 0, torch.Generator().manual_seed(seed)))


def test_mu_zero_is_fedavg_bit_for_bit():
    moon = pflbed.run(_cfg("moon", mu=0.0), write=False)
    avg = pflbed.run(_cfg("fedavg"), write=False)
    assert same_tensors(moon.server, avg.server) and moon.summary["final"] == avg.summary["final"]


def test_a_first_participation_trains_on_the_supervised_loss_alone_and_keeps_its_model():
    algo, avg = prepare(_cfg("moon", mu=5.0)), prepare(_cfg("fedavg"))
    server = algo.init_server()
    reply, state = _update(algo, server, {})
    plain, _ = _update(avg, server, {})
    assert same_tensors(reply, plain)
    assert same_tensors(state, reply)  # its previous model for the next time


def test_the_client_update_is_sgd_on_eq_3_with_the_global_model_positive_and_its_previous_model_negative():
    mu, tau = 2.0, 0.3
    algo = prepare(_cfg("moon", mu=mu, tau=tau))
    server = algo.init_server()
    previous, _ = _update(algo, {k: v + 0.05 * torch.randn_like(v) if v.is_floating_point() else v
                                 for k, v in server.items()}, {}, seed=3)  # a model of its own, not w^t
    reply, state = _update(algo, server, previous)
    model, t, data = algo.ctx.model, algo.ctx.cfg.train, algo.ctx.client_data(0)
    body = model.body_blocks()

    def rep(params, x):
        load_params(model, params)
        for name in body:
            x = model.blocks[name](x)
        return x.flatten(1)

    params = dict(model.named_parameters())
    w = {k: server[k].clone() for k in server}
    for b in index_batches(data.train, t.batch_size, t.local_epochs, torch.Generator().manual_seed(7)):
        x, y = data.x[b], data.y[b]
        with torch.no_grad():
            model.eval()
            z_glob, z_prev = rep(server, x), rep(previous, x)
        model.train()
        load_params(model, w)
        z = model.blocks[body[0]](x)
        for name in body[1:]:
            z = model.blocks[name](z)
        logits = z
        for name in model.head_blocks():
            logits = model.blocks[name](logits)
        z = z.flatten(1)
        pos, neg = F.cosine_similarity(z, z_glob) / tau, F.cosine_similarity(z, z_prev) / tau
        con = -torch.log(torch.exp(pos) / (torch.exp(pos) + torch.exp(neg)))
        loss = F.cross_entropy(logits, y) + mu * con.mean()
        grads = torch.autograd.grad(loss, list(params.values()))
        w = {**w, **{k: w[k] - t.lr * g for k, g in zip(params, grads, strict=True)}}
    assert all(torch.allclose(reply[k], w[k], atol=1e-5) for k in params)
    assert same_tensors(state, reply)
    first, _ = _update(algo, server, {})
    assert not all(torch.allclose(reply[k], first[k]) for k in params)  # the contrastive term acted


def test_the_frozen_models_run_in_eval_mode_and_keep_their_statistics(monkeypatch):
    """With BatchNorm: the global and previous models' representations use their running statistics (eval mode,
    as the paper's code freezes them), and their statistics in the plan's constants are not moved by the forward."""
    cfg = validate_config({**TINY, "model": {"name": "cnn_bn"}, "train": {**TINY["train"], "momentum": 0.0},
                           "dataset": {"name": "digits"}, "algorithm": {"name": "moon", "mu": 1.0},
                           "executor": {"threads": 1}})  # fmt: skip
    algo = prepare(cfg)
    server = algo.init_server()
    previous, _ = algo.client_update(server, {}, algo.ctx.client_data(0), ClientContext(1, 0, torch.Generator()))
    plan = algo.sgd_plan(server, previous, algo.ctx.client_data(0))
    consts = {k: v.clone() for k, v in plan.consts.items()}
    data = algo.ctx.client_data(0)
    x, y = data.x[data.train[:16]], data.y[data.train[:16]]
    model = algo.ctx.model
    model.train()
    params = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    seen = {}
    import pflbed.algorithms.moon as moon

    real = moon.run_blocks

    def spy(m, p, names, inp):
        if p is not params:  # a frozen model's forward
            seen.setdefault("modes", []).append(m.training)
        return real(m, p, names, inp)

    monkeypatch.setattr(moon, "run_blocks", spy)
    algo.objective(model, params, plan.consts, x, y, None)
    assert seen["modes"] == [False, False] and model.training
    assert all(torch.equal(consts[k], plan.consts[k]) for k in consts)
