import torch

import pflbed

from .tiny import TINY


def test_local_only_shares_nothing_and_trains_only_sampled_clients():
    res = pflbed.run({**TINY, "algorithm": {"name": "local"}}, write=False)
    algo, states = res.executor.algo, res.executor.states
    assert res.server == {}
    assert res.summary["final"]["gfl_acc"] is None and "ft" not in res.summary["final"]
    comm = res.summary["communication"]
    assert comm["up_bytes_per_round"] == comm["down_bytes_per_round"] == 0
    from pflbed.federation import sample_clients

    trained = {c for r in range(1, 5) for c in sample_clients(0, r, algo.ctx.federation.participated, 0.5)}
    for c in algo.ctx.federation.participated:
        moved = any(not torch.equal(states[c][k], algo.ctx.initial_params[k]) for k in states[c])
        assert moved == (c in trained)


def test_local_only_state_equals_plain_sgd_on_own_data():
    cfg = {**TINY, "train": {**TINY["train"], "rounds": 1}}
    res = pflbed.run({**cfg, "algorithm": {"name": "local"}}, write=False)
    algo = res.executor.algo
    c = next(iter(res.executor.states))
    from pflbed.algorithms.base import ClientContext
    from pflbed.engine import rng

    gen = torch.Generator().manual_seed(rng.derive_seed(0, rng.CLIENT, 1, c))
    _, state = algo.client_update({}, dict(algo.ctx.initial_params), algo.ctx.client_data(c), ClientContext(1, c, gen))
    assert all(torch.equal(state[k], res.executor.states[c][k]) for k in state)
