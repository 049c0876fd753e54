"""FedProx (Li et al., MLSys 2020, Eq. 2): local SGD on F_k(w) + μ/2·‖w − w^t‖²; μ = 0 is FedAvg bit for bit."""

import torch
import torch.nn.functional as F

import pflbed
from pflbed.algorithms.base import ClientContext
from pflbed.algorithms.training import index_batches, load_params
from pflbed.config import validate_config
from pflbed.engine.build import prepare

from ..tiny import TINY, same_tensors


def _cfg(name, **options):
    return validate_config({**TINY, "algorithm": {"name": name, **options}, "executor": {"threads": 1}})


def test_mu_zero_is_fedavg_bit_for_bit():
    prox = pflbed.run(_cfg("fedprox", mu=0.0), write=False)
    avg = pflbed.run(_cfg("fedavg"), write=False)
    assert same_tensors(prox.server, avg.server)
    assert prox.summary["final"] == avg.summary["final"]


def test_local_update_is_sgd_on_the_proximal_objective():
    """The client's reply equals SGD written out by hand on CE + μ/2·‖w − w^t‖², batch by batch (same batches),
    from a w^t that is not the starting point of every step: the proximal pull acts from the second step on."""
    mu = 0.5
    cfg = validate_config({**TINY, "train": {**TINY["train"], "local_epochs": 2, "momentum": 0.0},
                           "algorithm": {"name": "fedprox", "mu": mu}, "executor": {"threads": 1}})  # fmt: skip
    algo = prepare(cfg)
    server = algo.init_server()
    data = algo.ctx.client_data(0)
    reply, _ = algo.client_update(server, {}, data, ClientContext(1, 0, torch.Generator().manual_seed(7)))

    model, t = algo.ctx.model, cfg.train
    load_params(model, server)
    model.train()
    params = dict(model.named_parameters())
    w = {k: server[k].clone() for k in params}
    for b in index_batches(data.train, t.batch_size, t.local_epochs, torch.Generator().manual_seed(7)):
        load_params(model, w)
        grads = torch.autograd.grad(F.cross_entropy(model(data.x[b]), data.y[b]), list(params.values()))
        w = {k: w[k] - t.lr * (g + mu * (w[k] - server[k])) for (k, g) in zip(params, grads, strict=True)}
    assert all(torch.allclose(reply[k], w[k], atol=1e-6) for k in params)
    plain = {k: v for k, v in reply.items()}
    assert not all(torch.allclose(plain[k], server[k]) for k in params)  # it moved


def test_the_proximal_term_keeps_clients_closer_to_the_global_model():
    cfg_prox = _cfg("fedprox", mu=1.0)
    algo = prepare(cfg_prox)
    server = algo.init_server()
    data = algo.ctx.client_data(0)
    prox, _ = algo.client_update(server, {}, data, ClientContext(1, 0, torch.Generator().manual_seed(3)))
    avg_algo = prepare(_cfg("fedavg"))
    avg, _ = avg_algo.client_update(server, {}, data, ClientContext(1, 0, torch.Generator().manual_seed(3)))
    dist = lambda r: sum(float(((r[k] - server[k]) ** 2).sum()) for k in dict(algo.ctx.model.named_parameters()))  # noqa: E731
    assert dist(prox) < dist(avg)
