"""pFedDF: FedDF, then each client's personal model is its architecture's global model fine-tuned locally."""

import torch

import pflbed
from pflbed import rng
from pflbed.algorithms.base import ClientContext
from pflbed.algorithms.training import get_params, load_params, local_sgd, train_from
from pflbed.config import validate_config
from pflbed.engine.build import prepare

from .test_feddf import CFG, FED, HETERO

PFEDDF = {**HETERO, "name": "pfeddf"}
PCFG = {**CFG, "algorithm": PFEDDF}


def _cctx(cid: int) -> ClientContext:
    return ClientContext(1, cid, torch.Generator().manual_seed(7))


def test_personal_state_is_the_finetuned_global_and_the_reply_is_feddfs():
    algo = prepare(validate_config(PCFG))
    plain = prepare(validate_config(CFG))
    server = algo.init_server()
    cid = 2
    payload = algo.configure(1, server, [cid])[cid]
    data = algo.ctx.client_data(cid)
    reply, state = algo.client_update(payload, algo.init_client(cid), data, _cctx(cid))
    ref, _ = plain.client_update(payload, plain.init_client(cid), data, _cctx(cid))
    assert all(torch.equal(reply[k], ref[k]) for k in ref)  # local training untouched by the fine-tuning
    personal = algo.personal_model(server, state).params
    assert set(personal) == set(payload)
    assert any(not torch.equal(personal[k], payload[k]) for k in payload if payload[k].is_floating_point())
    assert any(not torch.equal(personal[k], reply[k]) for k in reply if reply[k].is_floating_point())
    # a client never sampled falls back to its architecture's global model
    fallback = algo.personal_model(server, algo.init_client(0))
    assert fallback.params is algo.global_params(server, "lenet5")


def test_end_to_end_strict_same_global_models_as_feddf():
    """Strict run against reference runs: the global models equal FedDF's on the same seed (the reply is FedDF's),
    and every client's personal model equals, rebuilt by hand, g_3 of a 3-round FedDF run trained (the reply) and
    then reloaded and fine-tuned for E epochs on the client's (seed, round 4, id) stream."""
    res = pflbed.run(PCFG, write=False)
    ref = pflbed.run(CFG, write=False)
    assert set(res.server) == set(ref.server)
    assert all(torch.equal(res.server[k], ref.server[k]) for k in ref.server)
    f = res.summary["final"]
    assert f["pfl_acc"] > 0.3 and f["gfl_acc"] is None
    assert res.summary["communication"] == ref.summary["communication"]
    algo = res.executor.algo
    prev = pflbed.run({**CFG, "train": {**CFG["train"], "rounds": 3}}, write=False).server
    t = algo.ctx.cfg.train
    for c in range(4):
        a = algo.arch_of(c)
        g3 = {k[len(f"g/{a}/") :]: v for k, v in prev.items() if k.startswith(f"g/{a}/")}
        model, data = algo.models[a], algo.ctx.client_data(c)
        seed = rng.derive_seed(0, rng.CLIENT, 4, c)
        torch.manual_seed(seed)
        gen = torch.Generator().manual_seed(seed)
        train_from(model, g3, data, t, gen)
        load_params(model, g3)
        local_sgd(model, data, epochs=t.local_epochs, batch_size=t.batch_size, lr=t.lr, generator=gen)
        p = algo.personal_model(res.server, res.executor.state(c))
        assert p.model is algo.models[a]
        assert all(torch.allclose(p.params[k], v, atol=1e-6) for k, v in get_params(model).items())


def test_finetuning_beats_feddf_under_label_skew():
    """Dirichlet α = 0.1: the global models fit no client; one local epoch adapts them (measured margin ≥ 0.1)."""
    fed = {**FED, "alpha": 0.1}
    p = pflbed.run({**PCFG, "federation": fed}, write=False).summary["final"]["pfl_acc"]
    g = pflbed.run({**CFG, "federation": fed}, write=False).summary["final"]["pfl_acc"]
    assert p > g + 0.05


def test_finetuning_defaults_to_the_local_epochs():
    """The paper fine-tunes for "several epochs": by default as many as the clients' local training."""
    train = {**PCFG["train"], "local_epochs": 2}

    def personal(**opts) -> dict[str, torch.Tensor]:
        algo = prepare(validate_config({**PCFG, "train": train, "algorithm": {**PFEDDF, **opts}}))
        server = algo.init_server()
        payload = algo.configure(1, server, [1])[1]
        _, state = algo.client_update(payload, algo.init_client(1), algo.ctx.client_data(1), _cctx(1))
        return algo.personal_model(server, state).params

    default, two, one = personal(), personal(finetune_epochs=2), personal(finetune_epochs=1)
    assert all(torch.equal(default[k], two[k]) for k in two)
    assert any(not torch.equal(default[k], one[k]) for k in one if one[k].is_floating_point())


def test_personal_model_is_the_received_global_finetuned_after_fedavgs_training_on_the_same_stream():
    """Exact order: (1) FedDF's local training from the received g (the reply), (2) reload g — not the trained
    model — and run `finetune_epochs` epochs of SGD at train.lr (train.momentum and train.weight_decay included),
    the batch order continuing the client's stream."""
    train = {**PCFG["train"], "local_epochs": 1, "momentum": 0.5, "weight_decay": 0.01}
    algo = prepare(validate_config({**PCFG, "train": train, "algorithm": {**PFEDDF, "finetune_epochs": 2}}))
    server = algo.init_server()
    cid = 3
    payload = algo.configure(1, server, [cid])[cid]
    data, t = algo.ctx.client_data(cid), algo.ctx.cfg.train
    model = algo.models[algo.arch_of(cid)]
    g = torch.Generator().manual_seed(7)
    reply_ref = train_from(model, payload, data, t, g)
    load_params(model, payload)
    local_sgd(model, data, epochs=2, batch_size=t.batch_size, lr=t.lr, momentum=0.5, weight_decay=0.01,
              generator=g)  # fmt: skip
    personal_ref = get_params(model)
    reply, state = algo.client_update(payload, algo.init_client(cid), data, _cctx(cid))
    assert all(torch.equal(reply[k], v) for k, v in reply_ref.items())
    personal = algo.personal_model(server, state).params
    assert all(torch.equal(personal[k], v) for k, v in personal_ref.items())
