"""pFedMe (Dinh et al., NeurIPS 2020, Alg. 1): K inner steps θ ← θ − η_p(∇f(θ; D) + λ(θ − w_i)) per batch, then
w_i ← w_i − ηλ(w_i − θ); the reply is w_i, the personal model θ_i; the server mixes w ← (1 − β)w + β·mean(w_i)."""

import torch
import torch.nn.functional as F

from pflbed.algorithms.base import ClientContext
from pflbed.algorithms.training import index_batches, load_params
from pflbed.config import validate_config
from pflbed.engine.loop import prepare

from .tiny import TINY

OPTS = {"lam": 3.0, "K": 2, "personal_lr": 0.05}


def _algo(**options):
    return prepare(validate_config({**TINY, "algorithm": {"name": "pfedme", **OPTS, **options},
                                    "executor": {"threads": 1}}))  # fmt: skip


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


def test_server_mixes_with_beta():
    algo = _algo(beta=2.0)
    server = algo.init_server()
    g = torch.Generator().manual_seed(0)
    replies = {c: {k: v + 0.1 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
                   for k, v in server.items()} for c in (1, 4)}  # fmt: skip
    agg = algo.aggregator(1, server, {1: 1.0, 4: 1.0})
    for c in (1, 4):
        agg.add(c, replies[c])
    out = agg.result()
    for k, v in server.items():
        if v.is_floating_point():
            mean = 0.5 * (replies[1][k] + replies[4][k])
            assert torch.allclose(out[k], -1.0 * v + 2.0 * mean, atol=1e-6)
