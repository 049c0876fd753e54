"""L2GD (Hanzely & Richtárik, 2020, Alg. 1) in rounds: a run of a averaging steps (x_i − x̄ contracted by
(1 − θ)^a, θ = ηλ(1 − p)/p), then l local SGD steps; a ~ Geometric(1 − p), l ~ Geometric(p), drawn per round."""

import pytest
import torch
import torch.nn.functional as F

from pflbed.algorithms.base import ClientContext
from pflbed.algorithms.training import index_batches, load_params
from pflbed.config import validate_config
from pflbed.engine.loop import prepare
from pflbed.errors import ConfigError

from .tiny import TINY


def _algo(**options):
    return prepare(validate_config({**TINY, "algorithm": {"name": "l2gd", **options}, "executor": {"threads": 1}}))


def test_run_lengths_are_the_coins_geometric_runs():
    algo = _algo(p=0.2)
    draws = [algo.runs(r) for r in range(1, 4001)]
    assert draws[:5] == [algo.runs(r) for r in range(1, 6)]  # from (seed, round) alone
    a = sum(d[0] for d in draws) / len(draws)
    l_ = sum(d[1] for d in draws) / len(draws)
    assert min(min(d) for d in draws) == 1
    assert a == pytest.approx(1 / 0.8, rel=0.05) and l_ == pytest.approx(1 / 0.2, rel=0.05)


def test_client_contracts_toward_the_mean_then_takes_its_local_steps():
    algo = _algo(p=0.3, lam=1.5)
    model, t = algo.ctx.model, algo.ctx.cfg.train
    server, data = algo.init_server(), algo.ctx.client_data(2)
    g = torch.Generator().manual_seed(5)
    x_i = {k: v + 0.1 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v for k, v in server.items()}
    rnd = next(r for r in range(1, 100) if algo.runs(r)[0] >= 2)  # several averaging steps: (1 − θ)^a, not 1 − θ
    payload = algo.configure(rnd, server, [2])[2]
    a, l_ = algo.runs(rnd)
    new, state = algo.client_update(payload, x_i, data, ClientContext(rnd, 2, torch.Generator().manual_seed(8)))
    theta = t.lr * 1.5 * 0.7 / 0.3
    x = {k: server[k] + (1 - theta) ** a * (v - server[k]) if v.is_floating_point() else v for k, v in x_i.items()}
    load_params(model, x)
    model.train()
    names = [k for k, _ in model.named_parameters()]
    w = {k: x[k].clone() for k in names}
    batches = index_batches(data.train, t.batch_size, l_, torch.Generator().manual_seed(8))
    for _, b in zip(range(l_), batches, strict=False):
        load_params(model, w)
        params = dict(model.named_parameters())
        grads = torch.autograd.grad(F.cross_entropy(model(data.x[b]), data.y[b]), [params[k] for k in names])
        w = {k: w[k] - t.lr * gr for k, gr in zip(names, grads, strict=True)}
    assert all(torch.allclose(new[k], w[k], atol=1e-6) for k in names)
    assert state is new and algo.personal_model(server, state).params is state


def test_an_averaging_step_beyond_the_mean_is_refused():
    """θ = 1 lands on the mean (allowed); any θ > 1 overshoots it."""
    assert _algo(p=0.5, lam=10.0).theta == 1.0  # lr 0.1
    with pytest.raises(ConfigError, match=r"algorithm.lam: the averaging step θ .* must be ≤ 1"):
        _algo(p=0.5, lam=10.01)
    with pytest.raises(ConfigError, match=r"θ = .* = 9 must be ≤ 1; lower lam or train.lr, or raise p"):
        _algo(p=0.1, lam=10.0)


def test_the_two_runs_are_independent_and_drawn_from_the_seed():
    """a and l come from two independent uniforms of the round's coin, which the run's seed sets: with p = 0.2,
    P(a ≥ 2) = 0.2 and P(l ≥ 2) = 0.8, so both hold in 16 % of rounds (20 % if one uniform drew both)."""
    algo = _algo(p=0.2)
    draws = [algo.runs(r) for r in range(1, 4001)]
    both = sum(a >= 2 and l_ >= 2 for a, l_ in draws) / len(draws)
    assert both == pytest.approx(0.16, abs=0.02)
    other = prepare(validate_config({**TINY, "seed": 1, "algorithm": {"name": "l2gd", "p": 0.2},
                                     "executor": {"threads": 1}}))  # fmt: skip
    assert [other.runs(r) for r in range(1, 41)] != draws[:40]


def test_a_client_starts_at_the_initial_model():
    algo = _algo()
    assert all(torch.equal(v, algo.ctx.initial_params[k]) for k, v in algo.init_client(3).items())
    assert algo.init_client(3).keys() == algo.ctx.initial_params.keys()
