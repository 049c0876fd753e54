"""Ditto (Li et al., ICML 2021, Alg. 1, Eq. 2): the reply is FedAvg's local update of w^t; the personal model takes
SGD steps on F_k(v) + λ/2·‖v − w^t‖² anchored at the *received* w^t; λ = 0 is Local's update, a large λ the
global model."""

import torch
import torch.nn.functional as F

import pflbed
from pflbed.algorithms.base import ClientContext
from pflbed.algorithms.training import index_batches, load_params, train_from
from pflbed.config import validate_config
from pflbed.engine.build import prepare

from ..tiny import TINY, same_tensors


def _cfg(name="ditto", rounds=4, fraction=0.5, **options):
    return validate_config({**TINY, "train": {**TINY["train"], "rounds": rounds, "momentum": 0.0},
                            "federation": {**TINY["federation"], "sample_fraction": fraction},
                            "algorithm": {"name": name, **options}, "executor": {"threads": 1}})  # fmt: skip


def _setup(lam):
    algo = prepare(_cfg(lam=lam))
    server = algo.init_server()
    data = algo.ctx.client_data(0)
    # a personal model that is neither w^t nor w^0: the anchor and the starting point must differ
    v = {k: x + 0.05 * torch.randn(x.shape, generator=torch.Generator().manual_seed(1)) if x.is_floating_point()
         else x for k, x in server.items()}  # fmt: skip
    return algo, server, data, v


def test_reply_is_the_global_update_and_the_personal_update_is_proximal_to_the_received_model():
    lam = 0.7
    algo, server, data, v = _setup(lam)
    reply, personal = algo.client_update(server, v, data, ClientContext(1, 0, torch.Generator().manual_seed(5)))

    model, t = algo.ctx.model, algo.ctx.cfg.train
    gen = torch.Generator().manual_seed(5)
    assert same_tensors(reply, train_from(model, server, data, t, gen))  # UPDATE_GLOBAL = FedAvg's, drawn first
    load_params(model, v)
    model.train()
    params = dict(model.named_parameters())
    w = {k: v[k].clone() for k in params}
    for b in index_batches(data.train, t.batch_size, t.local_epochs, gen):  # the same generator, continued
        load_params(model, w)
        grads = torch.autograd.grad(F.cross_entropy(model(data.x[b]), data.y[b]), list(params.values()))
        w = {k: w[k] - t.lr * (g + lam * (w[k] - server[k])) for (k, g) in zip(params, grads, strict=True)}
    assert all(torch.allclose(personal[k], w[k], atol=1e-6) for k in params)


def test_lambda_zero_is_locals_update_of_the_personal_model():
    algo, server, data, v = _setup(0.0)
    _, personal = algo.client_update(server, v, data, ClientContext(1, 0, torch.Generator().manual_seed(5)))
    gen = torch.Generator().manual_seed(5)
    train_from(algo.ctx.model, server, data, algo.ctx.cfg.train, gen)  # the global update's draws
    assert same_tensors(personal, train_from(algo.ctx.model, v, data, algo.ctx.cfg.train, gen))


def test_a_large_lambda_holds_the_personal_model_at_the_global_one():
    """λ → ∞: each personal step lands at w^t − η_p∇F(v) when η_pλ = 1, so with a tiny η_p the personal model is
    the received global model w^t. Every client sampled every round: Ditto's final P-FL is then FedAvg's P-FL of
    the model it sent in the last round (FedAvg's record one round earlier), and the global model is FedAvg's."""
    t = _cfg().train
    lam = 1.0 / t.lr
    algo, server, data, v = _setup(lam)
    _, near = algo.client_update(server, v, data, ClientContext(1, 0, torch.Generator().manual_seed(5)))
    algo0, *_ = _setup(0.0)
    _, free = algo0.client_update(server, v, data, ClientContext(1, 0, torch.Generator().manual_seed(5)))
    dist = lambda s: sum(float(((s[k] - server[k]) ** 2).sum()) for k in dict(algo.ctx.model.named_parameters()))  # noqa: E731
    assert dist(near) < 0.1 * dist(free)

    every = {"eval": {**TINY["eval"], "every": 1}}
    cfg = _cfg(lam=1e5, personal_lr=1e-5, fraction=1.0).model_dump(mode="json") | every
    ditto = pflbed.run(cfg, write=False)
    fedavg = pflbed.run(_cfg("fedavg", fraction=1.0).model_dump(mode="json") | every, write=False)
    assert same_tensors(ditto.server, fedavg.server)  # the global model is FedAvg's, whatever λ
    assert abs(ditto.history[-1]["pfl_acc"] - fedavg.history[-2]["pfl_acc"]) < 1e-3
    local = pflbed.run(_cfg(lam=0.0, fraction=1.0).model_dump(mode="json") | every, write=False)
    assert abs(local.history[-1]["pfl_acc"] - fedavg.history[-2]["pfl_acc"]) > 1e-3  # λ = 0 is not held there


def test_personal_epochs_count_the_personal_update_not_the_global_one():
    """`personal_epochs` sets the personal update's epochs whatever `train.local_epochs` is: 0 leaves v_k as it was
    (the reply is still FedAvg's update), and 2 go on from where 1 stops."""
    _, server, data, v = _setup(0.7)
    steps = {}
    for epochs in (0, 1, 2):
        algo = prepare(_cfg(lam=0.7, personal_epochs=epochs))
        reply, personal = algo.client_update(server, v, data, ClientContext(1, 0, torch.Generator().manual_seed(5)))
        assert same_tensors(reply, train_from(algo.ctx.model, server, data, algo.ctx.cfg.train,
                                              torch.Generator().manual_seed(5)))  # fmt: skip
        steps[epochs] = personal
    assert same_tensors(steps[0], v)
    assert not same_tensors(steps[1], v) and not same_tensors(steps[2], steps[1])
