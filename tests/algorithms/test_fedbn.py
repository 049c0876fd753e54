import pytest
import torch
from torch import nn

import pflbed
from pflbed.algorithms.base import Budget, ClientContext, Predictor
from pflbed.algorithms.training import get_params, load_params, sgd_epochs
from pflbed.config import validate_config
from pflbed.engine.build import prepare
from pflbed.engine.executor import LoopExecutor
from pflbed.evaluation.evaluate import Predictions, client_scores
from pflbed.federation import sample_clients
from pflbed.models import MODELS, BlockNet

from ..tiny import TINY

BN_KINDS = (nn.BatchNorm1d, nn.BatchNorm2d)
CNN_BN = {**TINY, "model": {"name": "cnn_bn"}, "algorithm": {"name": "fedbn"}}


def _one_round(cfg: dict, sample_fraction: float = 1.0):
    """prepare + one strict round by hand, so payloads and replies can be inspected."""
    cfg = {**cfg, "federation": {**cfg["federation"], "sample_fraction": sample_fraction}}
    algo = prepare(validate_config(cfg))
    ex = LoopExecutor(algo, strict=True)
    server = algo.init_server()
    cids = sample_clients(0, 1, algo.ctx.federation.participated, sample_fraction)
    payloads = algo.configure(1, server, cids)
    replies = ex.run(1, payloads)
    weights = {c: algo.ctx.federation.num_train(c) for c in cids}
    return algo, ex, server, payloads, replies, weights, algo.aggregate(1, server, replies, weights)


def test_bn_parameters_and_statistics_stay_local():
    algo, ex, server, payloads, replies, weights, new_server = _one_round(CNN_BN)
    model = algo.ctx.model
    bn = set(model.module_state_keys(BN_KINDS))
    assert len(bn) == 15 and all(isinstance(model.get_submodule(k.rsplit(".", 1)[0]), BN_KINDS) for k in bn)
    everything = set(model.state_dict())
    for c in replies:
        assert not bn & set(payloads[c]) and not bn & set(replies[c])  # BN never crosses the wire
        assert set(replies[c]) == everything - bn
        assert set(ex.states[c]) == bn  # ... it is the client's state
    assert set(server) == set(new_server) == everything - bn  # the server keeps no BN entry at all
    means = [k for k in bn if k.endswith("running_mean")]
    cids = list(replies)
    for k in means:  # every client re-estimated its statistics on its own data
        for i, a in enumerate(cids):
            assert not torch.equal(ex.states[a][k], algo.ctx.initial_params[k])
            for b in cids[i + 1 :]:
                assert not torch.allclose(ex.states[a][k], ex.states[b][k])
    total = sum(weights.values())
    for k, v in new_server.items():
        if v.is_floating_point():
            assert torch.allclose(v, sum(weights[c] / total * replies[c][k] for c in cids), atol=1e-6), k


def test_client_trains_from_its_own_bn_state():
    algo, ex, server, payloads, replies, weights, new_server = _one_round(CNN_BN, sample_fraction=0.5)
    trained, untrained = list(replies), [c for c in algo.ctx.federation.participated if c not in replies]
    assert untrained  # a client never sampled keeps the initial BN entries
    init_bn = algo.init_client(untrained[0])
    assert all(torch.equal(ex.state(untrained[0])[k], v) for k, v in init_bn.items())
    from pflbed.algorithms.base import ClientContext

    c = trained[0]
    data = algo.ctx.client_data(c)
    out = [algo.client_update(new_server, s, data, ClientContext(2, c, torch.Generator().manual_seed(1)))
           for s in (ex.states[c], init_bn)]  # fmt: skip
    assert any(not torch.equal(out[0][0][k], out[1][0][k]) for k in out[0][0])
    # the personal model = server's shared entries + the client's own BN
    p = algo.personal_model(new_server, ex.states[c])
    assert all(p.params[k] is ex.states[c][k] for k in ex.states[c])
    assert all(p.params[k] is new_server[k] for k in new_server)


def test_bn_is_chosen_by_type_not_name(monkeypatch):
    """A BatchNorm in a block named like a linear layer is local; a Linear named 'bn' is aggregated."""

    def odd(input_shape, num_classes):
        d = int(torch.tensor(input_shape).prod())
        inner = nn.Sequential(nn.Flatten(), nn.Linear(d, 16))
        inner.add_module("fc", nn.BatchNorm1d(16))
        return BlockNet([("linear", inner), ("bn", nn.Linear(16, num_classes))])

    monkeypatch.setitem(MODELS, "odd", odd)
    cfg = {**CNN_BN, "model": {"name": "odd"}}
    algo, ex, server, payloads, replies, *_ = _one_round(cfg)
    local = {f"blocks.linear.fc.{k}" for k in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")}
    assert set(algo.bn_keys) == local
    assert set(server) == {"blocks.linear.1.weight", "blocks.linear.1.bias", "blocks.bn.weight", "blocks.bn.bias"}
    assert all(set(ex.states[c]) == local for c in replies)


def test_without_batchnorm_fedbn_is_fedavg():
    cfg = {**TINY, "train": {**TINY["train"], "rounds": 2}, "eval": {"every": 1, "finetune": ["ft", "lp"]}}
    res = {a: pflbed.run({**cfg, "algorithm": {"name": a}}, write=False, progress=False) for a in ("fedavg", "fedbn")}
    avg, bn = res["fedavg"], res["fedbn"]
    assert set(avg.server) == set(bn.server)
    assert all(torch.equal(avg.server[k], bn.server[k]) for k in avg.server)
    assert avg.history == bn.history  # G-FL, P-FL and communication, round by round
    assert avg.summary["final"] == bn.summary["final"]  # FedAvg+FT / +LP included
    assert all(s == {} for s in bn.executor.states.values())  # no client state
    algo = prepare(validate_config({**cfg, "algorithm": {"name": "fedbn"}}))
    zs = algo.zero_shot(bn.server, algo.ctx.client_data(0))  # without BN a new client has FedAvg's model
    assert zs is not None and all(torch.equal(zs.params[k], bn.server[k]) for k in bn.server)
    x = algo.ctx.source.test.x[:50]  # ... and it classifies as FedAvg's global model does
    assert torch.equal(zs.logits(x), avg.executor.algo.generic_model(avg.server).logits(x))


@pytest.mark.parametrize("method", ["ft", "lp"])
def test_new_client_personalization_learns_bn(method):
    algo, ex, server, payloads, replies, weights, new_server = _one_round(CNN_BN)
    model = algo.ctx.model
    bn = set(model.module_state_keys(BN_KINDS))
    head = set(model.state_keys(model.head_blocks()))
    preds = list(algo.personalize(new_server, algo.ctx.client_data(0), Budget(method, 2, 0.05, 16), torch.Generator()))
    assert len(preds) == 2
    p = preds[-1]
    assert set(p.params) == set(model.state_dict())
    init = algo.ctx.initial_params
    changed = {k for k in new_server if not torch.equal(new_server[k], p.params[k])}
    changed |= {k for k in bn if not torch.equal(init[k], p.params[k])}  # BN started from the initial BN
    if method == "ft":
        assert changed == set(model.state_dict())
    else:
        assert changed == bn | head
    assert algo.generic_model(new_server) is None and algo.zero_shot(new_server, algo.ctx.client_data(0)) is None


def _bn_mlp(input_shape, num_classes):
    """A tiny model with one BatchNorm1d in the body, fast enough for exact reference runs."""
    d = int(torch.tensor(input_shape).prod())
    return BlockNet([("body", nn.Sequential(nn.Flatten(), nn.Linear(d, 8), nn.BatchNorm1d(8), nn.ReLU())),
                     ("head", nn.Linear(8, num_classes))])  # fmt: skip


@pytest.mark.parametrize("method", ["ft", "lp"])
def test_new_client_personalization_is_sgd_from_the_server_and_the_initial_bn(monkeypatch, method):
    """New client: start from the server's shared entries and the *initial* BN entries (not whatever BN the model
    object last held — here a trained client's), then SGD in training mode with the budget's lr and momentum on
    every parameter (ft) or on the BN affine parameters + head, found by type (lp)."""
    monkeypatch.setitem(MODELS, "bn_mlp", _bn_mlp)
    algo = prepare(validate_config({**CNN_BN, "model": {"name": "bn_mlp"}}))
    server = {k: v + 0.05 * torch.randn_like(v) for k, v in algo.init_server().items()}
    c = algo.ctx.federation.participated[0]
    cctx = ClientContext(1, c, torch.Generator().manual_seed(0))
    algo.client_update(server, algo.init_client(c), algo.ctx.client_data(c), cctx)  # the model now holds c's BN
    data = algo.ctx.client_data(1)
    budget = Budget(method, 2, 0.05, 16, momentum=0.5)
    got = list(algo.personalize(server, data, budget, torch.Generator().manual_seed(2)))[-1].params
    ref = _bn_mlp(algo.ctx.source.input_shape, algo.ctx.source.num_classes)
    load_params(ref, {**server, **algo.init_client(1)})
    bn = next(m for m in ref.modules() if isinstance(m, nn.BatchNorm1d))
    params = list(ref.parameters()) if method == "ft" else [*bn.parameters(), *ref.blocks.head.parameters()]
    for _ in sgd_epochs(ref, data, epochs=2, batch_size=16, lr=0.05, momentum=0.5, params=params,
                        generator=torch.Generator().manual_seed(2)):  # fmt: skip
        pass
    expected = get_params(ref)
    assert set(got) == set(expected)
    for k, v in expected.items():
        assert torch.allclose(got[k], v, atol=1e-6), k


def test_fedbn_learns_end_to_end_in_strict_mode():
    cfg = {
        **CNN_BN,
        "train": {**TINY["train"], "local_epochs": 2, "batch_size": 32, "lr": 0.05},  # a CNN on Gaussian "images"
        "federation": {**CNN_BN["federation"], "new_clients": 2},
        "eval": {"every": 2, "finetune": ["ft", "lp"],
                 "new_clients": {"epochs": 2, "lrs": [0.05], "fractions": [1.0]}},
    }  # fmt: skip
    res = pflbed.run(cfg, write=False, progress=False)
    f = res.summary["final"]
    algo = res.executor.algo
    # reference: the same clients' scores under the initial model that never trained (seed 0: 0.41 vs 0.09)
    untrained, _ = client_scores({c: Predictor(algo.ctx.model, algo.ctx.initial_params)
                                  for c in algo.ctx.federation.participated},
                                 algo.ctx, Predictions(algo.ctx.source, 1024))  # fmt: skip
    assert f["pfl_acc"] > sum(untrained.values()) / len(untrained) + 0.2
    assert f["gfl_acc"] is None and "ft" not in f  # no global model
    nc = res.summary["new_clients"]
    assert nc["zero_shot"] is None
    assert all(nc["methods"][m]["S"]["last"] > 0.3 for m in ("ft", "lp"))
    comm = res.summary["communication"]
    n_shared = sum(v.numel() * v.element_size() for v in res.server.values())
    fed = algo.ctx.federation
    bn = algo.ctx.model.module_state_keys(BN_KINDS)
    assert not set(res.server) & set(bn)
    for k in bn:  # the initial BN entries, which new clients and unsampled clients start from, were never mutated
        v = algo.ctx.initial_params[k]
        assert torch.equal(v, torch.ones_like(v) if k.endswith(("weight", "running_var")) else torch.zeros_like(v)), k
    sampled = len(sample_clients(0, 4, fed.participated, 0.5))
    assert comm["down_bytes_per_round"] == comm["up_bytes_per_round"] == n_shared * sampled  # BN excluded


def test_client_update_is_the_configured_sgd_from_server_and_own_bn(monkeypatch):
    """Client m: load the server's non-BN entries and its own BN entries, run the configured local SGD with the
    round's client generator; reply = the non-BN entries, new state = the BN entries (Algorithm 1)."""
    from pflbed.algorithms.training import train_from

    monkeypatch.setitem(MODELS, "bn_mlp", _bn_mlp)
    cfg = {**CNN_BN, "model": {"name": "bn_mlp"}, "train": {**TINY["train"], "momentum": 0.5, "local_epochs": 2}}
    algo = prepare(validate_config(cfg))
    torch.manual_seed(0)
    server = {k: v + 0.05 * torch.randn_like(v) for k, v in algo.init_server().items()}
    own_bn = {k: v + 0.3 * torch.rand_like(v) if v.is_floating_point() else v + 4  # some trained BN state
              for k, v in algo.init_client(0).items()}  # fmt: skip
    c = algo.ctx.federation.participated[0]
    data = algo.ctx.client_data(c)
    reply, state = algo.client_update(server, own_bn, data, ClientContext(1, c, torch.Generator().manual_seed(6)))
    ref = train_from(algo.ctx.new_model(), {**server, **own_bn}, data, algo.ctx.cfg.train,
                     torch.Generator().manual_seed(6))  # fmt: skip
    assert set(reply) == set(server) and set(state) == set(own_bn)
    for k, v in {**reply, **state}.items():
        assert torch.equal(v, ref[k]), k


def test_an_incomplete_model_state_is_an_error():
    """A personal model needs every shared entry (from the server) and every BN entry (from the client): a missing
    one is a KeyError naming it, never a model silently completed by whatever the model object last held."""
    algo = prepare(validate_config(CNN_BN))
    server, bn = algo.init_server(), algo.init_client(0)
    shared_key, bn_key = next(iter(server)), algo.bn_keys[0]
    with pytest.raises(KeyError, match=f"incomplete model state, missing.*{bn_key}"):
        algo.personal_model(server, {k: v for k, v in bn.items() if k != bn_key})
    with pytest.raises(KeyError, match=f"incomplete model state, missing.*{shared_key}"):
        algo.personal_model({k: v for k, v in server.items() if k != shared_key}, bn)
    assert set(algo.personal_model(server, bn).params) == set(algo.ctx.model.state_dict())
