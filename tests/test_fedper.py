import pytest
import torch

import pflbed
from pflbed.algorithms.base import Budget, ClientContext
from pflbed.algorithms.partial import block_params
from pflbed.algorithms.training import get_params, load_params, local_sgd
from pflbed.config import validate_config
from pflbed.engine.loop import prepare
from pflbed.errors import ConfigError
from pflbed.evaluation.evaluate import last

from .tiny import TINY


def make(**opts):
    return prepare(validate_config({**TINY, "algorithm": {"name": "fedper", **opts}}))


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def sgd(model, data, t, generator, blocks=None, epochs=None):
    """Reference: plain local SGD on `blocks` (default all) with the run's train settings."""
    params = block_params(model, blocks) if blocks is not None else None
    local_sgd(model, data, epochs=epochs or t.local_epochs, batch_size=t.batch_size, lr=t.lr, generator=generator,
              params=params)  # fmt: skip


def test_only_the_base_is_uploaded_and_aggregated():
    algo = make()
    m, t = algo.ctx.model, algo.ctx.cfg.train
    personal = set(m.state_keys(m.head_blocks()))
    server = algo.init_server()
    assert set(server) == set(m.state_dict()) - personal
    cids = algo.ctx.federation.participated[:2]
    payloads = algo.configure(1, server, cids)
    replies, states = {}, {}
    for c in cids:
        state0 = algo.init_client(c)
        assert set(state0) == personal
        data = algo.ctx.client_data(c)
        reply, state = algo.client_update(payloads[c], state0, data, ClientContext(1, c, gen(c)))
        assert set(reply) == set(server)  # personal layers are never uploaded
        assert set(state) == personal and all(not torch.equal(state[k], state0[k]) for k in personal)
        load_params(m, {**server, **state0})  # by hand: the whole model trains locally
        sgd(m, data, t, gen(c))
        ref = get_params(m)
        assert all(torch.allclose({**reply, **state}[k], ref[k], atol=1e-6) for k in ref)
        replies[c], states[c] = reply, state
    new = algo.aggregate(1, server, replies, {cids[0]: 1.0, cids[1]: 3.0})
    assert set(new) == set(server)
    for k in new:
        assert torch.allclose(new[k], 0.25 * replies[cids[0]][k] + 0.75 * replies[cids[1]][k], atol=1e-6)
    p = algo.personal_model(new, states[cids[0]]).params  # server base + own personal layers
    assert all(p[k] is new[k] for k in new) and all(p[k] is states[cids[0]][k] for k in personal)


def test_head_finetune_trains_the_personal_layers_first_with_the_base_frozen():
    algo = make(head_finetune_epochs=1)
    m, t = algo.ctx.model, algo.ctx.cfg.train
    c = algo.ctx.federation.participated[0]
    data, server, state0 = algo.ctx.client_data(c), algo.init_server(), algo.init_client(c)
    reply, state = algo.client_update(server, state0, data, ClientContext(1, c, gen(7)))
    g = gen(7)
    load_params(m, {**server, **state0})
    sgd(m, data, t, g, blocks=m.head_blocks(), epochs=1)
    assert all(torch.equal(get_params(m)[k], server[k]) for k in server)  # the head phase leaves the base alone
    sgd(m, data, t, g)
    ref = get_params(m)
    assert all(torch.allclose({**reply, **state}[k], ref[k], atol=1e-6) for k in ref)


def test_two_personal_blocks_are_the_top_two():
    algo = make(personal_blocks=2)
    m = algo.ctx.model
    names = m.block_names()
    assert set(algo.init_server()) == set(m.state_keys(names[:-2]))
    assert set(algo.init_client(0)) == set(m.state_keys(names[-2:]))
    server = algo.init_server()
    data = algo.ctx.client_data(algo.ctx.federation.participated[0])
    start = {**server, **algo.init_client(0)}
    for method, trained in (("lp", names[-2:]), ("ft", names)):
        p = last(algo.personalize(server, data, Budget(method, 2, 0.1, 8), gen(1))).params
        changed = {k for k in start if not torch.equal(start[k], p[k])}
        assert changed == set(m.state_keys(trained)), method
    with pytest.raises(ConfigError, match="personal_blocks"):
        make(personal_blocks=len(names))


def test_fedper_learns_end_to_end_and_personalizes_new_clients():
    cfg = {
        **TINY,
        "federation": {**TINY["federation"], "clients": 8, "new_clients": 2},
        "eval": {**TINY["eval"], "new_clients": {"epochs": 1, "lrs": [0.05], "fractions": [1.0]}},
        "algorithm": {"name": "fedper"},
    }
    res = pflbed.run(cfg, write=False, progress=False)
    f = res.summary["final"]
    assert f["gfl_acc"] is None and f["pfl_acc"] > 0.3  # 10 classes: chance is 0.1
    nc = res.summary["new_clients"]
    assert nc["zero_shot"] is None and set(nc["methods"]) == {"ft", "lp"}
    assert all(nc["methods"][m]["S"]["last"] > 0.1 for m in ("ft", "lp"))
    m = res.executor.algo.ctx.model
    base_bytes = sum(v.numel() * v.element_size() for k, v in m.state_dict().items() if k in res.server)
    assert set(res.server) == set(m.state_keys(m.body_blocks()))
    assert res.summary["communication"]["up_bytes_per_round"] == base_bytes * 3  # 3 of 6 sampled, base only
