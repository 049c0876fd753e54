import pytest
import torch

import pflbed
from pflbed.algorithms.base import Budget, ClientContext
from pflbed.algorithms.training import get_params, load_params, local_sgd
from pflbed.config import validate_config
from pflbed.engine.loop import prepare
from pflbed.errors import ConfigError
from pflbed.evaluation.evaluate import last

from .tiny import TINY


def make(**opts):
    return prepare(validate_config({**TINY, "algorithm": {"name": "lg_fedavg", **opts}}))


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("k", [1, 2])
def test_reply_is_exactly_the_last_blocks(k):
    algo = make(global_blocks=k)
    m, t = algo.ctx.model, algo.ctx.cfg.train
    names = m.block_names()
    c = algo.ctx.federation.participated[0]
    data, server, state0 = algo.ctx.client_data(c), algo.init_server(), algo.init_client(c)
    reply, state = algo.client_update(algo.configure(1, server, [c])[c], state0, data, ClientContext(1, c, gen(c)))
    assert set(reply) == set(server) == set(m.state_keys(names[-k:]))  # the LAST blocks are global…
    assert not set(reply) & set(m.state_keys(names[:1]))  # …never the first
    assert set(state) == set(state0) == set(m.state_keys(names[:-k]))
    assert all(not torch.equal(state[k_], state0[k_]) for k_ in state0)  # local blocks train and stay on the client
    load_params(m, {**state0, **server})  # by hand: the whole model trains jointly
    local_sgd(m, data, epochs=t.local_epochs, batch_size=t.batch_size, lr=t.lr, generator=gen(c))
    ref = get_params(m)
    assert all(torch.allclose({**reply, **state}[k_], ref[k_], atol=1e-6) for k_ in ref)
    p = algo.personal_model(reply, state).params  # own lower blocks + global top
    assert all(p[k_] is state[k_] for k_ in state) and all(p[k_] is reply[k_] for k_ in reply)


def test_aggregate_is_weighted_mean_of_the_global_top():
    algo = make()
    server = algo.init_server()
    a = {k: torch.zeros_like(v) for k, v in server.items()}
    b = {k: torch.full_like(v, 4.0) for k, v in server.items()}
    new = algo.aggregate(1, server, {3: a, 4: b}, {3: 1, 4: 1})
    assert set(new) == set(server) and all(torch.allclose(v, torch.full_like(v, 2.0)) for v in new.values())


@pytest.mark.parametrize(("method", "lp", "trained"), [("ft", "local", "all"), ("lp", "local", "lower"),
                                                        ("lp", "head", "head")])  # fmt: skip
def test_new_client_personalization_trains_the_documented_blocks(method, lp, trained):
    algo = make(lp=lp)
    m = algo.ctx.model
    server = algo.init_server()
    data = algo.ctx.client_data(algo.ctx.federation.participated[0])
    p = last(algo.personalize(server, data, Budget(method, 2, 0.1, 8), gen(0))).params
    changed = {k for k in p if not torch.equal(p[k], algo.ctx.initial_params[k])}
    blocks = {"all": m.block_names(), "lower": m.block_names()[:-1], "head": m.head_blocks()}[trained]
    assert changed == set(m.state_keys(blocks))
    assert all(p.requires_grad for p in m.parameters())  # nothing left frozen on the shared model


def test_invalid_global_blocks():
    with pytest.raises(ConfigError, match="global_blocks"):
        make(global_blocks=3)


def test_lg_fedavg_learns_end_to_end_in_strict_mode():
    res = pflbed.run({**TINY, "algorithm": {"name": "lg_fedavg"}}, write=False, progress=False)
    f = res.summary["final"]
    assert f["gfl_acc"] is None and f["pfl_acc"] > 0.3  # 10 classes: chance is 0.1
    m = res.executor.algo.ctx.model
    assert set(res.server) == set(m.state_keys(m.top_blocks(1)))
