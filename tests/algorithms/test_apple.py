"""APPLE (Luo & Wu, IJCAI 2022): each client trains its own core model and its DR vector p on CE of
w_p = Σ_j p_j·w_{c,j} + λ(r)·‖p − p_0‖², the other cores frozen; the server stores and relays the cores, never
averaging them; λ(r) decays from μ over the first R_d rounds."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from pflbed.algorithms.apple import COEF, CORE, CORES, DR, P0
from pflbed.algorithms.base import Budget, ClientContext
from pflbed.algorithms.training import finetune_epochs, fresh_client_params, index_batches, train_from
from pflbed.config import validate_config
from pflbed.engine.build import prepare
from pflbed.errors import ConfigError

from ..tiny import TINY, same_tensors


def _cfg(rounds=4, momentum=0.0, model=None, **options):
    return validate_config({**TINY, "model": model or TINY["model"],
                            "train": {**TINY["train"], "rounds": rounds, "local_epochs": 2, "momentum": momentum},
                            "algorithm": {"name": "apple", **options}, "executor": {"threads": 1}})  # fmt: skip


def _update(algo, payload, state, cid, seed=7):
    data = algo.ctx.client_data(cid)
    return algo.client_update(payload, state, data, ClientContext(2, cid, torch.Generator().manual_seed(seed)))


def _params(algo):
    return [k for k, _ in algo.ctx.model.named_parameters()]


def test_every_core_starts_from_its_own_init_and_p_from_p0_the_training_shares_sent_by_the_server():
    algo = prepare(_cfg())
    fed, clients = algo.ctx.federation, algo.clients
    n = torch.tensor([float(fed.num_train(c)) for c in clients], dtype=torch.float64)
    server = algo.init_server()
    cores = [algo.core(server, c) for c in clients]
    for c, core in zip(clients, cores, strict=True):
        assert same_tensors(core, fresh_client_params(algo.ctx.model, algo.ctx.seed, c))
        assert same_tensors(algo.init_client(c), core)  # until it trains, a client holds its own initial core
    assert not torch.equal(cores[0][_params(algo)[0]], cores[1][_params(algo)[0]])  # independent initializations
    payload = algo.configure(1, server, [3])[3]
    assert torch.equal(payload[P0], (n / n.sum()).float())
    first = _update(algo, payload, algo.init_client(3), 3)  # no DR vector yet: p starts at p_0
    given = _update(algo, payload, {**algo.init_client(3), DR: payload[P0].clone()}, 3)
    assert same_tensors(first[0], given[0]) and same_tensors(first[1], given[1])
    shared = prepare(_cfg(core_init="shared"))
    assert all(same_tensors(shared.core(shared.init_server(), c), shared.ctx.initial_params) for c in clients)


@pytest.mark.parametrize("mu", [0.3, 1.0])
def test_lambda_decays_from_mu_over_the_first_r_d_rounds_then_is_zero(mu):
    for schedule, rounds, fraction, expected in [
        ("exponential", 20, 0.1, [mu, mu * 0.001 ** (1 / 2)] + [0.0] * 18),  # R_d = 2
        ("exponential", 10, 0.4, [mu * 0.001 ** (r / 4) for r in range(4)] + [0.0] * 6),
        ("cosine", 10, 0.4, [mu * (math.cos(math.pi * r / 4) + 1) / 2 for r in range(4)] + [0.0] * 6),
        ("exponential", 4, 0.1, [0.0] * 4),  # R_d = ⌊0.4⌋ = 0: never, as the authors' code
    ]:
        algo = prepare(_cfg(rounds=rounds, mu=mu, reg_fraction=fraction, schedule=schedule))
        server, c = algo.init_server(), algo.clients[0]
        got = [float(algo.configure(rnd, server, [c])[c][COEF]) for rnd in range(1, rounds + 1)]
        assert got == [float(torch.tensor(v)) for v in expected], (schedule, rounds, got)
    algo = prepare(_cfg(rounds=10, mu=0.0, reg_fraction=1.0))
    assert float(algo.configure(1, algo.init_server(), [0])[0][COEF]) == 0.0


def test_the_payload_is_every_stored_core_stacked_in_client_order_p0_and_the_own_core():
    algo = prepare(_cfg())
    server = algo.init_server()
    payloads = algo.configure(1, server, [1, 4])
    for c, payload in payloads.items():
        assert same_tensors({k: payload[k] for k in algo.keys}, algo.core(server, c))
        for k in _params(algo):
            assert torch.equal(payload[CORES + k], torch.stack([server[f"{CORE}{j}/{k}"] for j in algo.clients]))
        assert torch.equal(payload[P0], payloads[1][P0])


def test_the_client_update_is_sgd_on_ce_of_the_mixed_model_plus_the_pull_of_p_towards_p0():
    """Two epochs by hand: only the own core and p move (their own lrs), the other cores frozen as downloaded;
    ∂/∂p_j reaches every core, the own one at its current value. The reply is the new core; the state is p and
    the personalized model Σ_j p_j·w_{c,j} with the new core and the downloaded others."""
    mu, core_lr, dr_lr = 0.5, 0.07, 0.05
    algo = prepare(_cfg(mu=mu, reg_fraction=1.0, core_lr=core_lr, dr_lr=dr_lr))
    server, i = algo.init_server(), 1
    c = algo.clients[i]
    payload = algo.configure(2, server, [c])[c]
    noise = 0.05 * torch.randn(payload[P0].shape, generator=torch.Generator().manual_seed(0))
    state = {**algo.init_client(c), DR: payload[P0] + noise}  # a DR vector away from p_0: the pull acts
    reply, new = _update(algo, payload, state, c)

    model, t, data = algo.ctx.model, algo.ctx.cfg.train, algo.ctx.client_data(c)
    keys, n = _params(algo), len(algo.clients)
    cores = [algo.core(server, j) for j in algo.clients]
    p0, lam = payload[P0], mu * 0.001 ** (1 / 4)  # round 2 of 4, R_d = 4
    w, p = {k: cores[i][k].clone() for k in keys}, state[DR].clone()
    model.train()
    for b in index_batches(data.train, t.batch_size, t.local_epochs, torch.Generator().manual_seed(7)):
        wv = {k: v.clone().requires_grad_(True) for k, v in w.items()}
        pv = p.clone().requires_grad_(True)
        mixed = {k: sum(pv[j] * (wv[k] if j == i else cores[j][k]) for j in range(n)) for k in keys}
        loss = F.cross_entropy(functional_call(model, mixed, (data.x[b],)), data.y[b])
        loss = loss + lam * ((pv - p0) ** 2).sum()
        grads = torch.autograd.grad(loss, [*wv.values(), pv])
        w = {k: w[k] - core_lr * g for k, g in zip(keys, grads, strict=False)}
        p = p - dr_lr * grads[-1]
    assert set(reply) == set(algo.keys)
    assert all(torch.allclose(reply[k], w[k], atol=1e-6) for k in keys)
    assert torch.allclose(new[DR], p, atol=1e-6)
    assert (new[DR] - state[DR]).abs().max() > 1e-3  # p moved
    personal = {k: sum(p[j] * (w[k] if j == i else cores[j][k]) for j in range(n)) for k in keys}
    assert all(torch.allclose(new[k], personal[k], atol=1e-6) for k in keys)
    pred = algo.personal_model({}, new)  # P-FL: the state's model, whatever the server holds by then
    assert all(torch.equal(pred.params[k], new[k]) for k in keys)


def test_with_p_the_own_one_hot_frozen_and_no_pull_the_update_is_local_sgd_bit_for_bit():
    """p = e_i, dr_lr = 0, μ = 0: w_p is the own core alone, so the update is Local's SGD from it."""
    algo = prepare(_cfg(momentum=0.5, mu=0.0, dr_lr=0.0))
    server, c = algo.init_server(), algo.clients[2]
    payload = algo.configure(1, server, [c])[c]
    state = {**algo.init_client(c), DR: torch.zeros_like(payload[P0])}
    state[DR][2] = 1.0
    reply, new = _update(algo, payload, state, c)
    data, t = algo.ctx.client_data(c), algo.ctx.cfg.train
    local = train_from(algo.ctx.model, algo.core(server, c), data, t, torch.Generator().manual_seed(7))
    assert same_tensors(reply, local)
    assert torch.equal(new[DR], state[DR])
    assert all(torch.equal(new[k], local[k]) for k in algo.keys)


def test_the_server_stores_each_reply_as_its_core_and_averages_nothing():
    algo = prepare(_cfg())
    server = algo.init_server()
    cids = [0, 3]
    payloads = algo.configure(1, server, cids)
    replies = {c: _update(algo, payloads[c], algo.init_client(c), c)[0] for c in cids}
    out = algo.aggregate(1, server, replies, {c: 1.0 for c in cids})
    assert set(out) == set(server)
    for c in algo.clients:
        assert same_tensors(algo.core(out, c), replies[c] if c in cids else algo.core(server, c))


def test_a_new_client_starts_from_the_p0_weighted_mean_of_the_stored_cores():
    algo = prepare(_cfg())
    server = algo.init_server()
    p0 = algo.configure(1, server, [0])[0][P0]
    start = algo.zero_shot(server, algo.ctx.client_data(0)).params
    for k in algo.keys:
        assert torch.allclose(start[k], sum(p0[j] * algo.core(server, c)[k] for j, c in enumerate(algo.clients)),
                              atol=1e-6)  # fmt: skip
    assert algo.generic_model(server) is None and algo.finetune_methods(server, ["ft", "lp"]) == []
    x = algo.ctx.client_data(0).x[:5]
    assert torch.allclose(algo.zero_shot(server, algo.ctx.client_data(0)).logits(x),
                          functional_call(algo.ctx.model, start, (x,)), atol=1e-6)  # fmt: skip


def test_a_reply_must_be_a_core_model():
    algo = prepare(_cfg())
    server = algo.init_server()
    payload = algo.configure(1, server, [0])[0]
    reply, _ = _update(algo, payload, algo.init_client(0), 0)
    assert algo.reply_fits(payload, reply) is None
    k = _params(algo)[0]
    assert algo.reply_fits(payload, {**reply, k: reply[k][:1]}) == \
        f"has '{k}' of shape {[1, *reply[k].shape[1:]]}, expected {list(reply[k].shape)}"  # fmt: skip
    assert algo.reply_fits(payload, {**reply, DR: payload[P0]}) == \
        f"has key '{DR}', which this algorithm's clients do not reply"  # fmt: skip


def test_independent_cores_refuse_a_pretrained_start_and_shared_cores_start_from_it(tmp_path):
    """Independent initializations would discard `model.init_from`'s weights: refused in one line naming the
    option; `core_init: shared` starts every core from them."""
    pretrained = {k: v + 1.0 if v.is_floating_point() else v for k, v in prepare(_cfg()).ctx.initial_params.items()}
    torch.save(pretrained, tmp_path / "model.pt")
    model = {"name": "mlp", "init_from": str(tmp_path / "model.pt")}
    with pytest.raises(ConfigError, match=r"^algorithm.core_init: independent .* set core_init: shared$"):
        prepare(_cfg(model=model))
    shared = prepare(_cfg(model=model, core_init="shared"))
    assert all(same_tensors(shared.core(shared.init_server(), c), pretrained) for c in shared.clients)


def test_diagnostics_are_the_mean_own_weight_sum_and_distance_of_the_dr_vectors():
    """p_ii, Σ_j p_ij and ‖p_i − p_0‖ averaged over the participated clients; one that has not trained counts at
    p_0."""
    algo = prepare(_cfg())
    p0 = algo.configure(1, algo.init_server(), [0])[0][P0]
    g = torch.Generator().manual_seed(3)
    ps = {c: p0 + torch.randn(p0.shape, generator=g) for c in algo.clients[1:]}
    got = algo.diagnostics(1, algo.init_server(), lambda c: {DR: ps[c]} if c in ps else {})
    full = torch.stack([ps.get(c, p0) for c in algo.clients])
    assert got == {"dr_self": round(float(full.diagonal().mean()), 6), "dr_sum": round(float(full.sum(1).mean()), 6),
                   "dr_distance": round(float((full - p0).norm(dim=1).mean()), 6)}  # fmt: skip
    assert got["dr_self"] != round(float(full.mean()), 6)


@pytest.mark.parametrize("method", ["ft", "lp"])
def test_a_new_client_fine_tunes_from_the_p0_weighted_mean_on_its_own_generator(method):
    algo = prepare(_cfg())
    server = algo.init_server()
    data, budget = algo.ctx.client_data(5), Budget(method, 2, 0.1, 16)
    got = [dict(p.params) for p in algo.personalize(server, data, budget, torch.Generator().manual_seed(4))]
    assert len(got) == 2
    start = algo.zero_shot(server, data).params
    model = algo.ctx.model
    want = [dict(p.params) for p in finetune_epochs(model, start, data, budget, torch.Generator().manual_seed(4))]
    assert all(same_tensors(g, w) for g, w in zip(got, want, strict=True))
    body = [k for k in algo.keys if k not in set(model.state_keys(model.head_blocks()))]
    assert all(torch.equal(got[-1][k], start[k]) for k in body) is (method == "lp")
