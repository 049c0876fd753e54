import pytest
import torch

import pflbed
from pflbed.algorithms.base import Budget, ClientContext
from pflbed.algorithms.partial import block_params
from pflbed.algorithms.training import get_params, load_params, local_sgd
from pflbed.config import validate_config
from pflbed.engine.loop import prepare
from pflbed.evaluation.evaluate import last

from .tiny import TINY


def make(**opts):
    return prepare(validate_config({**TINY, "algorithm": {"name": "fedbabu", **opts}}))


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_clients_train_and_upload_only_the_body():
    algo = make()
    m, t, init = algo.ctx.model, algo.ctx.cfg.train, algo.ctx.initial_params
    head, body = m.state_keys(m.head_blocks()), m.state_keys(m.body_blocks())
    server = algo.init_server()
    replies = {}
    for c in algo.ctx.federation.participated[:2]:
        data = algo.ctx.client_data(c)
        reply, state = algo.client_update(server, {}, data, ClientContext(1, c, gen(c)))
        assert set(reply) == set(body) and state == {}
        trained = get_params(m)  # the model as the client left it: head still the initial one
        assert all(torch.equal(trained[k], init[k]) for k in head)
        assert all(not torch.equal(reply[k], init[k]) for k in body)
        load_params(m, server)  # by hand: SGD on the body only
        local_sgd(m, data, epochs=t.local_epochs, batch_size=t.batch_size, lr=t.lr, generator=gen(c),
                  params=block_params(m, m.body_blocks()))  # fmt: skip
        assert all(torch.allclose(reply[k], get_params(m)[k], atol=1e-6) for k in body)
        replies[c] = reply
    c0, c1 = replies
    new = algo.aggregate(1, server, replies, {c0: 1.0, c1: 1.0})
    assert set(new) == set(m.state_dict()) and all(torch.equal(new[k], init[k]) for k in head)
    assert all(torch.allclose(new[k], (replies[c0][k] + replies[c1][k]) / 2, atol=1e-6) for k in body)


@pytest.mark.parametrize(("finetune", "method", "trained"), [("full", "ft", "all"), ("head", "ft", "head"),
                                                             ("full", "lp", "head")])  # fmt: skip
def test_personalization_is_fine_tuning_of_the_global_model(finetune, method, trained):
    algo = make(finetune=finetune)
    m = algo.ctx.model
    server = algo.init_server()
    data = algo.ctx.client_data(algo.ctx.federation.participated[0])
    p = last(algo.personalize(server, data, Budget(method, 1, 0.1, 8), gen(0))).params
    changed = {k for k in server if not torch.equal(server[k], p[k])}
    assert changed == set(m.state_keys(m.block_names() if trained == "all" else m.head_blocks()))


def test_fedbabu_end_to_end_head_never_moves_and_ft_is_reported():
    cfg = {**TINY, "eval": {**TINY["eval"], "finetune": ["ft", "lp"]}, "algorithm": {"name": "fedbabu"}}
    res = pflbed.run(cfg, write=False, progress=False)
    algo = res.executor.algo
    m, init = algo.ctx.model, algo.ctx.initial_params
    assert all(torch.equal(res.server[k], init[k]) for k in m.state_keys(m.head_blocks()))
    assert any(not torch.equal(res.server[k], init[k]) for k in m.state_keys(m.body_blocks()))
    f = res.summary["final"]
    assert f["gfl_acc"] > 0.3 and f["ft"]["pfl_acc"] > 0.3  # 10 classes: chance is 0.1
    assert f["lp"]["pfl_acc"] is not None
