"""APFL (Deng et al., 2020, Alg. 1, Eq. 3, 10): per step, w ← w − η∇f(w); v ← v − ηα∇f(v̄); α ← α − η_α⟨v − w, ∇f(v̄)⟩
with v̄ = αv + (1 − α)w, all at the step's starting values; P-FL scores v̄ with the global w."""

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from pflbed.algorithms.base import ClientContext
from pflbed.algorithms.training import index_batches, load_params
from pflbed.config import validate_config
from pflbed.engine.build import prepare

from ..tiny import TINY


def _algo(model=TINY["model"], train=TINY["train"], **options):
    algorithm = {"name": "apfl", "alpha": 0.3, "alpha_lr": 0.5, **options}
    return prepare(validate_config({**TINY, "model": model, "train": train, "algorithm": algorithm,
                                    "executor": {"threads": 1}}))  # fmt: skip


@pytest.mark.parametrize("model", [TINY["model"], {"name": "alexnet_small_x025"}])
def test_simultaneous_updates_of_w_v_and_alpha(model):
    """On a dropout model too: each step's w forward draws its masks first, then v̄'s (torch's global RNG)."""
    algo = _algo(model)
    model, t = algo.ctx.model, algo.ctx.cfg.train
    server, data = algo.init_server(), algo.ctx.client_data(0)
    g0 = torch.Generator().manual_seed(9)
    v0 = {k: x + 0.05 * torch.randn(x.shape, generator=g0) if x.is_floating_point() else x for k, x in server.items()}
    state = {**v0, "alpha": torch.tensor(0.3)}
    torch.manual_seed(7)
    reply, new = algo.client_update(server, state, data, ClientContext(1, 0, torch.Generator().manual_seed(4)))

    model.train()
    names = [k for k, _ in model.named_parameters()]
    bufs = {k: x.clone() for k, x in server.items() if k not in names}
    grad = torch.func.grad(lambda p, b: F.cross_entropy(functional_call(model, {**bufs, **p}, (data.x[b],)), data.y[b]))
    w = {k: server[k].clone() for k in names}
    v = {k: v0[k].clone() for k in names}
    a = 0.3
    torch.manual_seed(7)
    for b in index_batches(data.train, t.batch_size, t.local_epochs, torch.Generator().manual_seed(4)):
        gw = grad(w, b)
        gbar = grad({k: a * v[k] + (1 - a) * w[k] for k in names}, b)  # ∇f at v̄
        da = sum(float(((v[k] - w[k]) * gbar[k]).sum()) for k in names)
        w, v, a = ({k: w[k] - t.lr * gw[k] for k in names}, {k: v[k] - t.lr * a * gbar[k] for k in names},
                   min(max(a - 0.5 * da, 0.0), 1.0))  # fmt: skip
    assert all(torch.allclose(reply[k], w[k], atol=1e-5) for k in names)
    assert all(torch.allclose(new[k], v[k], atol=1e-5) for k in names)
    assert abs(float(new["alpha"]) - a) < 1e-4 and abs(a - 0.3) > 1e-3  # α moved


def test_fixed_alpha_and_the_personal_model_is_the_mixture_with_the_global_model():
    algo = _algo(adaptive=False)
    server, data = algo.init_server(), algo.ctx.client_data(1)
    _, new = algo.client_update(server, algo.init_client(1), data, ClientContext(1, 1, torch.Generator()))
    assert float(new["alpha"]) == float(torch.tensor(0.3))  # unchanged
    other = {k: x + 1.0 if x.is_floating_point() else x for k, x in server.items()}  # a later global model
    pred = algo.personal_model(other, new)
    for k, x in other.items():
        if x.is_floating_point():
            assert torch.allclose(pred.params[k], 0.3 * new[k] + 0.7 * x)


@pytest.mark.parametrize(("sign", "bound"), [(-1.0, 1.0), (1.0, 0.0)])
def test_alpha_is_kept_in_zero_one(sign, bound):
    """One full-batch step with a huge η_α: v = w ∓ s∇f(w) makes ⟨v − w, ∇f(v̄)⟩ negative (α rises past 1) or
    positive (α falls below 0); α stops at the bound."""
    algo = _algo(train={**TINY["train"], "batch_size": 10_000, "local_epochs": 1}, alpha_lr=1e6)
    model = algo.ctx.model
    server, data = algo.init_server(), algo.ctx.client_data(0)
    names = [k for k, _ in model.named_parameters()]
    load_params(model, server)
    model.train()
    params = dict(model.named_parameters())
    g = torch.autograd.grad(F.cross_entropy(model(data.x[data.train]), data.y[data.train]), [params[k] for k in names])
    v = {**server, **{k: server[k] + sign * 0.1 * gk for k, gk in zip(names, g, strict=True)}}
    _, new = algo.client_update(server, {**v, "alpha": torch.tensor(0.5)}, data,
                                ClientContext(1, 0, torch.Generator().manual_seed(1)))  # fmt: skip
    assert float(new["alpha"]) == bound


def test_with_batchnorm_only_parameters_mix_and_the_personal_statistics_are_tracked():
    """BatchNorm (the module docstring): v̄'s running statistics and counters are v_i's own, updated by v̄'s
    training forwards, and w's by w's; the personal model mixes the parameters alone, on the run's model."""
    algo = _algo(model={"name": "cnn_bn"})
    model = algo.ctx.model
    server, data = algo.init_server(), algo.ctx.client_data(0)
    state = algo.init_client(0)
    reply, new = algo.client_update(server, state, data, ClientContext(1, 0, torch.Generator().manual_seed(2)))
    names = {k for k, _ in model.named_parameters()}
    stats = [k for k in server if k not in names]
    assert any(not server[k].is_floating_point() for k in stats)  # counters among them
    for k in stats:
        assert new[k].dtype == server[k].dtype and reply[k].dtype == server[k].dtype
        assert not torch.equal(new[k], state[k]) and not torch.equal(reply[k], server[k])  # both tracked
        assert not torch.equal(new[k], reply[k]) or not new[k].is_floating_point()  # on different forwards
    pred = algo.personal_model(reply, new)
    assert pred.model is model
    a = new["alpha"]
    for k in server:
        want = new[k] if k in stats else a * new[k] + (1 - a) * reply[k]
        assert torch.equal(pred.params[k], want), k


@pytest.mark.parametrize(("mean", "expected"), [("size", 2.8), ("uniform", 2.0)])
def test_the_server_mean_is_size_weighted_or_the_authors_uniform_mean(mean, expected):
    """Two clients of 10 and 90 samples replying all-ones and all-threes: (10·1 + 90·3)/100 = 2.8 weighted by size;
    (1 + 3)/2 = 2 under Algorithm 1's and the authors' code's 1/|S|."""
    algo = _algo(server_mean=mean)
    server = algo.init_server()
    mean_of = algo.aggregator(1, server, {0: 10.0, 1: 90.0})
    for cid, value in ((0, 1.0), (1, 3.0)):
        mean_of.add(cid, {k: torch.full_like(v, value) for k, v in server.items()})
    out = mean_of.result()
    assert all(torch.allclose(out[k], torch.full_like(v, expected), atol=1e-6) for k, v in server.items())
