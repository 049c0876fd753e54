"""Fed-MTL (MOCHA's mean-regularized special case, Ω = I − 11ᵀ/m): clients take SGD steps on f_i(w_i) + λ‖w_i − w̄‖²
from their own model; the server keeps w̄ = the mean of every client's current model from their changes."""

import torch
import torch.nn.functional as F

import pflbed
from pflbed.algorithms.base import Budget, ClientContext
from pflbed.algorithms.training import finetune_epochs, index_batches, load_params
from pflbed.config import validate_config
from pflbed.engine.build import prepare

from ..tiny import TINY, same_tensors

LAM = 0.4


def _cfg(**train):
    return validate_config({**TINY, "train": {**TINY["train"], "momentum": 0.0, **train},
                            "algorithm": {"name": "fedmtl", "lam": LAM}, "executor": {"threads": 1}})  # fmt: skip


def test_client_descends_its_loss_plus_the_pull_to_the_task_mean():
    algo = prepare(_cfg())
    model, t = algo.ctx.model, algo.ctx.cfg.train
    g = torch.Generator().manual_seed(2)
    server = {k: v + 0.1 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
              for k, v in algo.init_server().items()}  # fmt: skip
    own, data = algo.init_client(1), algo.ctx.client_data(1)
    delta, new = algo.client_update(server, own, data, ClientContext(1, 1, torch.Generator().manual_seed(4)))
    model.train()
    names = [k for k, _ in model.named_parameters()]
    w = {k: own[k].clone() for k in names}
    for b in index_batches(data.train, t.batch_size, t.local_epochs, torch.Generator().manual_seed(4)):
        load_params(model, w)
        params = dict(model.named_parameters())
        grads = torch.autograd.grad(F.cross_entropy(model(data.x[b]), data.y[b]), [params[k] for k in names])
        w = {k: w[k] - t.lr * (gr + 2 * LAM * (w[k] - server[k])) for k, gr in zip(names, grads, strict=True)}
    assert all(torch.allclose(new[k], w[k], atol=1e-6) for k in names)
    assert all(torch.allclose(delta[k], new[k] - own[k]) for k in names)


def test_the_server_model_is_always_the_mean_of_every_clients_model():
    r = pflbed.run(_cfg(rounds=3), write=False)
    algo = r.executor.algo
    clients = algo.ctx.federation.participated
    states = [r.executor.states.get(c) or algo.init_client(c) for c in clients]
    for k, v in r.server.items():
        if v.is_floating_point():
            mean = sum(s[k] for s in states) / len(states)
            assert torch.allclose(v, mean, atol=1e-6), k
    assert algo.generic_model(r.server) is None and r.summary["final"].get("gfl_acc") is None


def test_a_new_task_starts_from_the_task_mean():
    """Zero-shot, a new client predicts with w̄; personalizing, it fine-tunes from w̄ with its own data, budget and
    generator (the epochs `finetune_epochs` yields from w̄)."""
    algo = prepare(_cfg())
    g = torch.Generator().manual_seed(3)
    server = {k: v + 0.1 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
              for k, v in algo.init_server().items()}  # fmt: skip
    data = algo.ctx.client_data(2)
    x = data.x[data.train]
    zero = algo.zero_shot(server, data)
    load_params(algo.ctx.model, server)
    algo.ctx.model.eval()
    with torch.no_grad():
        assert torch.equal(zero.logits(x), algo.ctx.model(x))
    budget = Budget("ft", 2, 0.05, 4)
    got = [p.params for p in algo.personalize(server, data, budget, torch.Generator().manual_seed(6))]
    want = [p.params for p in finetune_epochs(algo.ctx.model, server, data, budget, torch.Generator().manual_seed(6))]
    assert len(got) == 2 and all(same_tensors(a, b) for a, b in zip(got, want, strict=True))
    assert not same_tensors(got[0], server)
