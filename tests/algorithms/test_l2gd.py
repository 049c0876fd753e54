"""L2GD (Hanzely & Richtárik, 2020, Alg. 1) in rounds: a run of a averaging steps (x_i − x̄ contracted by
(1 − θ)^a, θ = ηλ(1 − p)/p), then l local SGD steps; a ~ Geometric(1 − p), l ~ Geometric(p), drawn per round."""

import pytest
import torch
import torch.nn.functional as F

import pflbed
from pflbed.algorithms.base import ClientContext
from pflbed.algorithms.training import index_batches, load_params, weighted_mean
from pflbed.config import validate_config
from pflbed.engine.build import prepare
from pflbed.errors import ConfigError
from pflbed.federation import sample_clients

from ..tiny import TINY


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


def test_p_is_bounded_where_the_local_run_would_never_end():
    """p = 5e-324 crashed (log(1 − p) = 0) and p = 1e-9 drew a local run of some 10^9 steps: below 0.001 (1,000
    steps a round on average) p is refused; at 0.001 the run lengths are drawn."""
    for p in (5e-324, 1e-9, 0.000999):
        with pytest.raises(ConfigError, match=r"^algorithm.p: Input should be greater than or equal to 0.001"):
            _algo(p=p, lam=0.0)
    assert all(d[1] >= 1 for d in map(_algo(p=0.001, lam=0.0).runs, range(1, 20)))


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


def test_the_mean_is_the_size_weighted_mean_of_the_rounds_repliers_only():
    """x̄ after round 2 is Σ |D_i| x_i / Σ |D_i| over the clients sampled in round 2 (their replies are their states):
    not uniform over them, and without the clients that trained in round 1 only."""
    cfg = validate_config({**TINY, "train": {**TINY["train"], "rounds": 2}, "algorithm": {"name": "l2gd"},
                           "executor": {"threads": 1}})  # fmt: skip
    r = pflbed.run(cfg, write=False)
    fed = r.executor.algo.ctx.federation
    first, second = (sample_clients(cfg.seed, rnd, fed.participated, cfg.federation.sample_fraction) for rnd in (1, 2))
    sizes = {c: fed.num_train(c) for c in second}
    assert set(first) - set(second) and len(set(sizes.values())) > 1
    mean = weighted_mean({c: r.executor.states[c] for c in second}, sizes)
    assert all(torch.allclose(r.server[k], mean[k], atol=1e-6) for k in mean)
    uniform = weighted_mean({c: r.executor.states[c] for c in second}, dict.fromkeys(second, 1.0))
    assert not all(torch.allclose(r.server[k], uniform[k], atol=1e-6) for k in mean)


def test_momentum_and_weight_decay_are_not_used():
    """Algorithm 1's local steps are plain gradient steps: `train.momentum` and `train.weight_decay` change nothing
    (documented)."""
    out = []
    for train in ({}, {"momentum": 0.9, "weight_decay": 0.1}):
        algo = prepare(validate_config({**TINY, "train": {**TINY["train"], **train}, "algorithm": {"name": "l2gd"},
                                        "executor": {"threads": 1}}))  # fmt: skip
        rnd = next(r for r in range(1, 100) if algo.runs(r)[1] >= 3)  # a few local steps for momentum to act on
        server = algo.init_server()
        payload = algo.configure(rnd, server, [1])[1]
        out.append(algo.client_update(payload, algo.init_client(1), algo.ctx.client_data(1),
                                      ClientContext(rnd, 1, torch.Generator().manual_seed(3))))  # fmt: skip
    assert all(torch.equal(out[0][0][k], out[1][0][k]) for k in out[0][0])
