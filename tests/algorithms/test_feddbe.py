"""FedDBE (Zhang et al., NeurIPS 2023): FedAvg + DBE — a personal memory z̄_i^p added to the representation before
the head (PRBM), and κ·mean ½(z̄_i^g − z̄^g)² pulling the round's running mean of the representations toward a
consensus mean (MR) that an initialization period (every client, cross-entropy alone, models discarded) sets
once, n-weighted."""

import pytest
import torch
import torch.nn.functional as F

import pflbed
from pflbed.algorithms.base import Budget, ClientContext
from pflbed.algorithms.feddbe import CONSENSUS, PRBM, RUNNING
from pflbed.algorithms.local_sgd import run_plan
from pflbed.algorithms.training import finetune_epochs, get_params, index_batches, load_params
from pflbed.config import validate_config
from pflbed.engine.build import prepare
from pflbed.errors import ConfigError
from pflbed.evaluation.evaluate import last

from ..tiny import TINY, same_tensors


def _algo(name="feddbe", train=None, **options):
    return prepare(validate_config({**TINY, "algorithm": {"name": name, **options}, "executor": {"threads": 1},
                                    "train": {**TINY["train"], "local_epochs": 2, "momentum": 0.0,
                                              **(train or {})}}))  # fmt: skip


def _update(algo, payload, state, cid=0, seed=7):
    ctx = ClientContext(1, cid, torch.Generator().manual_seed(seed))
    return algo.client_update(payload, state, algo.ctx.client_data(cid), ctx)


def _hand(algo, start, prbm, consensus, cid, seed, *, m, kappa, prbm_lr, head=1):
    """SGD written out: per batch the representation z = f(x), the running mean r ← (1 − m)·r + m·mean(z) (its
    history a constant), the loss CE(h(z + p), y) + κ·mean ½(r − g)² — or, without a consensus, CE(h(z), y) alone
    with p untouched; every parameter steps at train.lr, p at prbm_lr. Returns (model, p, r)."""
    model, t, data = algo.ctx.model, algo.ctx.cfg.train, algo.ctx.client_data(cid)
    names = model.block_names()
    body, top = names[:-head], names[-head:]
    params = dict(model.named_parameters())
    w = {k: start[k].clone() for k in params}
    p, r = prbm.clone(), torch.zeros_like(prbm)
    model.train()
    for b in index_batches(data.train, t.batch_size, t.local_epochs, torch.Generator().manual_seed(seed)):
        load_params(model, w)
        q = p.clone().requires_grad_()
        z = data.x[b]
        for name in body:
            z = model.blocks[name](z)
        r_new = (1 - m) * r + m * z.mean(0)
        logits = z if consensus is None else z + q
        for name in top:
            logits = model.blocks[name](logits)
        loss = F.cross_entropy(logits, data.y[b])
        if consensus is not None:
            loss = loss + kappa * (0.5 * (r_new - consensus) ** 2).mean()
        grads = torch.autograd.grad(loss, [*params.values(), q], allow_unused=True)
        w = {k: w[k] - t.lr * g for k, g in zip(params, grads, strict=False)}
        if consensus is not None:
            p = p - prbm_lr * grads[-1]
        r = r_new.detach()
    return w, p, r


def _close(a, b, atol=1e-5):
    return a.keys() <= b.keys() and all(torch.allclose(a[k], b[k], atol=atol) for k in a)


def _after_init(algo):
    """The server after the initialization period (every participated client), and the clients' replies."""
    server = algo.init_server()
    payloads = algo.configure(1, server, [0])
    replies = {c: _update(algo, p, algo.init_client(c), c)[0] for c, p in payloads.items()}
    agg = algo.aggregator(1, server, {0: 1.0})
    for c in sorted(replies):
        agg.add(c, replies[c])
    return agg.result(), replies


def test_the_initialization_period_trains_every_client_on_ce_and_sets_the_n_weighted_consensus():
    """Round 1 sends θ^0 (no consensus) to every participated client, not only the sample; each trains on CE alone
    (no memory) and replies its running mean of z, keeping its state; the server keeps θ^0 and adds
    z̄^g = Σ n_i z̄_i^g / Σ n_i over all clients."""
    m = 0.3
    algo = _algo(mean_momentum=m, kappa=5.0)
    fed = algo.ctx.federation
    server = algo.init_server()
    payloads = algo.configure(1, server, [fed.participated[0]])
    assert sorted(payloads) == sorted(fed.participated) and all(p is server for p in payloads.values())
    zero = algo.init_client(2)
    reply, state = _update(algo, server, zero, cid=2, seed=3)
    assert set(reply) == {RUNNING} and same_tensors(state, zero)
    _, _, r = _hand(algo, server, zero[PRBM], None, 2, 3, m=m, kappa=5.0, prbm_lr=0.1)
    assert torch.allclose(reply[RUNNING], r, atol=1e-6)

    after, replies = _after_init(algo)
    n = {c: float(fed.num_train(c)) for c in replies}
    assert len(set(n.values())) > 1  # unequal sizes: the weighting shows
    want = sum(n[c] * replies[c][RUNNING] for c in replies) / sum(n.values())
    assert torch.allclose(after[CONSENSUS], want, atol=1e-6)
    assert same_tensors({k: v for k, v in after.items() if k != CONSENSUS}, server)  # the trained models discarded


def test_the_initialization_period_trains_as_fedavg_does():
    """Its local training is FedAvg's (cross-entropy of the plain model), bit for bit; only the running mean
    leaves the client."""
    algo, avg = _algo(), _algo("fedavg")
    server, data = algo.init_server(), algo.ctx.client_data(1)
    zero, gen = algo.init_client(1)[PRBM], torch.Generator().manual_seed(4)
    consumed = list(algo.local_epochs(server, zero, None, data, gen, epochs=2, batch_size=16, lr=0.1, prbm_lr=0.1,
                                      momentum=0.0, weight_decay=0.0))  # fmt: skip
    assert len(consumed) == 2 and not consumed[-1][0].any()  # the memory never trained
    plain, _ = _update(avg, server, {}, cid=1, seed=4)
    assert same_tensors(get_params(algo.ctx.model), plain)


@pytest.mark.parametrize("head", [1, 2])
def test_a_dbe_round_is_sgd_on_ce_of_the_shifted_representation_plus_kappa_mr(head):
    """m = 1 (the plan): the reply is θ after SGD on CE(h(f(x) + z̄^p)) + κ·mean ½(mean_batch f(x) − z̄^g)², the
    new state z̄^p after SGD at prbm_lr (≠ train.lr); the consensus is the payload's, not moved."""
    kappa, prbm_lr = 3.0, 0.03
    algo = _algo(kappa=kappa, prbm_lr=prbm_lr, head_blocks=head)
    server, _ = _after_init(algo)
    g = torch.Generator().manual_seed(0)
    consensus = server[CONSENSUS] + 0.3 * torch.rand(server[CONSENSUS].shape, generator=g)
    payload = {**server, CONSENSUS: consensus}
    prbm = 0.2 * torch.randn(algo.init_client(0)[PRBM].shape, generator=g)
    assert algo.sgd_plan(payload, {PRBM: prbm}, algo.ctx.client_data(0)) is not None
    reply, state = _update(algo, payload, {PRBM: prbm}, cid=0, seed=11)
    w, p, _ = _hand(algo, server, prbm, consensus, 0, 11, m=1.0, kappa=kappa, prbm_lr=prbm_lr, head=head)
    assert set(reply) == set(algo.model_keys) and _close(reply, w)
    assert set(state) == {PRBM} and torch.allclose(state[PRBM], p, atol=1e-6)
    assert torch.equal(payload[CONSENSUS], consensus)
    without, _ = _update(_algo(kappa=0.0, prbm_lr=prbm_lr, head_blocks=head), payload, {PRBM: prbm}, seed=11)
    assert not _close(without, reply, atol=1e-6)  # MR acted


def test_with_m_below_1_the_running_mean_carries_the_earlier_batches_as_constants():
    """m < 1 (client by client): the regularized mean is (1 − m)·r + m·mean_batch(z), r the previous batches'
    running mean (from 0 at the round's start) held constant."""
    m, kappa = 0.4, 20.0
    algo = _algo(kappa=kappa, mean_momentum=m)
    server, _ = _after_init(algo)
    prbm = 0.1 * torch.randn(algo.init_client(0)[PRBM].shape, generator=torch.Generator().manual_seed(1))
    assert algo.sgd_plan(server, {PRBM: prbm}, algo.ctx.client_data(3)) is None
    reply, state = _update(algo, server, {PRBM: prbm}, cid=3, seed=5)
    w, p, _ = _hand(algo, server, prbm, server[CONSENSUS], 3, 5, m=m, kappa=kappa, prbm_lr=algo.ctx.cfg.train.lr)
    assert _close(reply, w) and torch.allclose(state[PRBM], p, atol=1e-6)


def test_the_loop_at_m_1_is_the_plan_bit_for_bit_and_new_clients_ft_runs_it():
    """The client-by-client update (m < 1, new clients' +FT) at m = 1 is the plan's, bit for bit: `personalize`
    "ft" with the round's budget lands on a client's DBE update from a zero memory."""
    algo = _algo(kappa=4.0, prbm_lr=0.05, train={"momentum": 0.5, "weight_decay": 0.01})
    server, _ = _after_init(algo)
    data, zero = algo.ctx.client_data(4), algo.init_client(4)
    plan = algo.sgd_plan(server, zero, data)
    t = algo.ctx.cfg.train
    reply, state = run_plan(algo.ctx.model, plan, data, t, torch.Generator().manual_seed(2))
    *_, (memory, _) = algo.local_epochs(algo.model_params(server), zero[PRBM], server[CONSENSUS], data,
                                        torch.Generator().manual_seed(2), epochs=2, batch_size=16, lr=0.1,
                                        prbm_lr=0.05, momentum=0.5, weight_decay=0.01)  # fmt: skip
    assert same_tensors(get_params(algo.ctx.model), reply) and torch.equal(memory, state[PRBM])
    tuned = _algo(kappa=4.0)  # prbm_lr = train.lr, as a budget trains every tensor at its lr
    plan = tuned.sgd_plan(server, zero, data)
    reply, state = run_plan(tuned.ctx.model, plan, data, tuned.ctx.cfg.train, torch.Generator().manual_seed(2))
    ft = last(tuned.personalize(server, data, Budget("ft", 2, 0.1, 16), torch.Generator().manual_seed(2)))
    assert same_tensors(ft.params, {**{"net." + k: v for k, v in reply.items()}, PRBM: state[PRBM]})


def test_the_server_averages_the_model_as_fedavg_and_keeps_the_consensus_fixed():
    algo = _algo()
    server, _ = _after_init(algo)
    cids = [0, 2, 5]
    weights = {c: float(algo.ctx.federation.num_train(c)) for c in cids}
    replies = {c: _update(algo, server, algo.init_client(c), c)[0] for c in cids}
    new = algo.aggregate(2, server, replies, weights)
    total = sum(weights.values())
    assert _close({k: sum(weights[c] / total * replies[c][k] for c in cids) for k in algo.model_keys}, new, 1e-6)
    assert torch.equal(new[CONSENSUS], server[CONSENSUS]) and set(new) == set(server)
    assert sorted(algo.configure(2, new, cids)) == cids  # after the initialization period: the sample only


@pytest.mark.parametrize("head", [1, 2])
def test_the_personal_model_adds_the_client_s_memory_before_the_head_and_the_generic_model_has_none(head):
    algo = _algo(head_blocks=head)
    server, _ = _after_init(algo)
    model, x = algo.ctx.model, algo.ctx.source.test.x[:32]
    memory = torch.randn(algo.init_client(0)[PRBM].shape, generator=torch.Generator().manual_seed(9))
    load_params(model, algo.model_params(server))
    model.eval()
    names = model.block_names()
    with torch.no_grad():
        z = x
        for name in names[:-head]:
            z = model.blocks[name](z)
        want, plain = z + memory, model(x)
        for name in names[-head:]:
            want = model.blocks[name](want)
    assert torch.allclose(algo.personal_model(server, {PRBM: memory}).logits(x), want, atol=1e-6)
    assert torch.equal(algo.generic_model(server).logits(x), plain)
    assert torch.allclose(algo.personal_model(server, algo.init_client(0)).logits(x), plain, atol=1e-6)


def test_a_run_keeps_the_consensus_of_round_1_and_checks_its_replies():
    """End to end: the consensus after the last round is the one round 1 set; honest replies fit
    (`reply_fits`), and a running mean of another shape or a dropped model entry does not."""
    cfg = {**TINY, "train": {**TINY["train"], "rounds": 1}, "algorithm": {"name": "feddbe"}}
    first = pflbed.run(cfg, write=False, progress=False)
    full = pflbed.run({**cfg, "train": {**TINY["train"], "rounds": 3}}, write=False, progress=False)
    assert torch.equal(first.server[CONSENSUS], full.server[CONSENSUS])
    algo = full.executor.algo
    assert not same_tensors(algo.model_params(full.server), algo.model_params(first.server))  # it trained
    init = algo.init_server()
    reply, _ = _update(algo, init, algo.init_client(0))
    assert algo.reply_fits(init, reply) is None
    assert algo.reply_fits(init, {RUNNING: reply[RUNNING][:-1]}) is not None
    dbe, _ = _update(algo, full.server, algo.init_client(0))
    assert algo.reply_fits(full.server, dbe) is None
    dropped = dict(dbe)
    dropped.pop(algo.model_keys[0])
    assert algo.reply_fits(full.server, dropped) is not None


def test_a_head_of_every_block_is_refused_in_one_line_naming_the_option():
    blocks = len(_algo().ctx.model.block_names())
    with pytest.raises(ConfigError, match=rf"^algorithm.head_blocks: the model has {blocks} blocks; choose 1 to "
                       rf"{blocks - 1} \(got {blocks}\)$"):  # fmt: skip
        _algo(head_blocks=blocks)


def test_a_new_clients_linear_probe_is_the_librarys_on_the_global_model_without_a_memory():
    """Deviation 7: "lp" fine-tunes the head of θ̄ on the client's own generator; no memory enters."""
    algo = _algo()
    server, _ = _after_init(algo)
    data, budget = algo.ctx.client_data(4), Budget("lp", 2, 0.1, 16)
    got = [dict(p.params) for p in algo.personalize(server, data, budget, torch.Generator().manual_seed(2))]
    want = [dict(p.params) for p in finetune_epochs(algo.ctx.model, algo.model_params(server), data, budget,
                                                    torch.Generator().manual_seed(2))]  # fmt: skip
    assert len(got) == 2 and all(same_tensors(g, w) for g, w in zip(got, want, strict=True))
    assert not same_tensors(got[-1], algo.model_params(server))
