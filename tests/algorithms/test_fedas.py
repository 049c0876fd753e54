"""FedAS (Yang, Huang & Ye, CVPR 2024; reconstructed from the authors' code): parameter alignment of the received
body to the prototypes of the client's old local body (PA), local training of the aligned body with the client's
own head (LT), the trace of the empirical Fisher information of the trained model (FIM) and the server's
Fisher-weighted mean of the whole models (CS)."""

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import pflbed
from pflbed.algorithms.base import ClientContext
from pflbed.algorithms.local_sgd import run_plan
from pflbed.algorithms.training import index_batches, load_params, weighted_mean
from pflbed.config import validate_config
from pflbed.engine.build import prepare

from ..tiny import TINY, same_tensors


def _cfg(name="fedas", model=None, **options):
    extra = {"model": {"name": model}, "dataset": {"name": "digits"}} if model else {}
    return validate_config({**TINY, "train": {**TINY["train"], "local_epochs": 2, "momentum": 0.0},
                            "algorithm": {"name": name, **options}, "executor": {"threads": 1}, **extra})  # fmt: skip


def _moved(params, seed, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) if v.is_floating_point() else v.clone()
            for k, v in params.items()}  # fmt: skip


def _update(algo, payload, state, cid=0, seed=7):
    data = algo.ctx.client_data(cid)
    return algo.client_update(payload, state, data, ClientContext(1, cid, torch.Generator().manual_seed(seed)))


def _setup(**options):
    """The algorithm, a global model and a client-0 local model of its own (body and head both differ)."""
    algo = prepare(_cfg(**options))
    server = _moved(algo.init_server(), 1)
    state = _moved(algo.init_client(0), 2)
    return algo, server, state


def _sgd(w, keys, grads, lr):
    return {**w, **{k: w[k] - lr * g for k, g in zip(keys, grads, strict=True)}}


def test_the_payload_is_the_global_body_alone():
    algo, server, _ = _setup()
    payload = algo.configure(1, server, [0, 3])
    assert set(payload[0]) == set(algo.body_keys) and payload[0] is payload[3]
    assert all(torch.equal(payload[0][k], server[k]) for k in algo.body_keys)


def test_the_client_aligns_the_received_body_to_its_old_prototypes_then_trains_the_whole_model():
    """PA: prototypes P_c of the *old* local body, one epoch of plain SGD at η_PA on the received body on
    Σ_{c ∈ batch} MSE(f(x_c), P_c) (the code's loss, written here as the code writes it); then LT: E epochs of
    cross-entropy SGD on the aligned body with the client's own head, on the same generator. The reply and the new
    local model are the trained model."""
    lr_pa = 0.05
    algo, server, state = _setup(align_lr=lr_pa)
    payload = algo.configure(1, server, [0])[0]
    reply, new_state = _update(algo, payload, state)
    model, t, data = algo.ctx.model, algo.ctx.cfg.train, algo.ctx.client_data(0)
    params = dict(model.named_parameters())
    body = [k for k in params if k in set(algo.body_keys)]

    load_params(model, state)  # prototypes of the old local body
    model.eval()
    with torch.no_grad():
        z = model.features(data.x[data.train]).flatten(1)
    ys = data.y[data.train]
    protos = {int(c): z[ys == c].mean(0) for c in ys.unique()}

    gen = torch.Generator().manual_seed(7)
    w = {**{k: payload[k].clone() for k in algo.body_keys}, **{k: state[k].clone() for k in algo.head_keys}}
    model.train()
    for b in index_batches(data.train, t.batch_size, 1, gen):
        x, y = data.x[b], data.y[b]
        load_params(model, w)
        f = model.features(x).flatten(1)
        loss = sum(F.mse_loss(f[y == c], protos[int(c)].expand_as(f[y == c])) for c in y.unique())
        w = _sgd(w, body, torch.autograd.grad(loss, [params[k] for k in body]), lr_pa)
    aligned = dict(w)
    for b in index_batches(data.train, t.batch_size, t.local_epochs, gen):
        load_params(model, w)
        loss = F.cross_entropy(model(data.x[b]), data.y[b])
        w = _sgd(w, list(params), torch.autograd.grad(loss, list(params.values())), t.lr)

    assert set(reply) == {*w, "fim"} and set(new_state) == set(w)
    assert all(torch.allclose(reply[k], w[k], atol=1e-5) for k in w)
    assert same_tensors(new_state, {k: reply[k] for k in w})
    assert not all(torch.allclose(aligned[k], payload[k]) for k in body)  # the alignment moved the body
    unaligned, _ = _update(prepare(_cfg(align_epochs=0)), payload, state)
    assert not all(torch.allclose(reply[k], unaligned[k], atol=1e-4) for k in body)


def test_without_alignment_the_received_body_is_installed_under_the_clients_own_head():
    """align_epochs 0 (the code's --wo_local): LT from (f^g, h_i) — the head the client's, not the server's."""
    algo, server, state = _setup(align_epochs=0)
    payload = algo.configure(1, server, [0])[0]
    reply, _ = _update(algo, payload, state)
    model, t, data = algo.ctx.model, algo.ctx.cfg.train, algo.ctx.client_data(0)
    params = dict(model.named_parameters())
    w = {**{k: payload[k].clone() for k in algo.body_keys}, **{k: state[k].clone() for k in algo.head_keys}}
    model.train()
    for b in index_batches(data.train, t.batch_size, t.local_epochs, torch.Generator().manual_seed(7)):
        load_params(model, w)
        loss = F.cross_entropy(model(data.x[b]), data.y[b])
        w = _sgd(w, list(params), torch.autograd.grad(loss, list(params.values())), t.lr)
    assert all(torch.allclose(reply[k], w[k], atol=1e-5) for k in w)


def _by_hand_trace(model, trained, data, batch_size):
    """Σ over the batches (stored order) of Σ_θ ‖∇_θ mean −log softmax(model(x))_y‖², eval mode (the code's)."""
    load_params(model, trained)
    model.eval()
    total = 0.0
    for b in data.train.split(batch_size):
        x, y = data.x[b], data.y[b]
        out = model(x)
        nll = -F.log_softmax(out, dim=1)[range(len(y)), y].mean()
        total += sum(float((g.double() ** 2).sum()) for g in torch.autograd.grad(nll, list(model.parameters())))
    return total


@pytest.mark.parametrize("model", [None, "cnn_bn"])
def test_the_reply_s_trace_is_the_empirical_fisher_of_the_trained_model_summed_over_batches(model):
    """FIM after training, in eval mode (with BatchNorm: the running statistics, left unmoved), summed — not
    averaged — over the batches of one pass of the client's training data."""
    algo = prepare(_cfg(model=model))
    server = algo.init_server()
    payload = algo.configure(1, server, [0])[0]
    reply, state = _update(algo, payload, algo.init_client(0))
    data, t = algo.ctx.client_data(0), algo.ctx.cfg.train
    assert len(data.train.split(t.batch_size)) > 2
    trained = {k: reply[k] for k in state}
    expected = _by_hand_trace(algo.ctx.model, trained, data, t.batch_size)
    assert reply["fim"].dtype == torch.float64 and reply["fim"].shape == ()
    assert float(reply["fim"]) == pytest.approx(expected, rel=1e-5)
    assert same_tensors(state, trained)  # the trace's forwards moved no statistic


def _replies(algo, cids=(0, 1, 2)):
    server = algo.init_server()
    payloads = algo.configure(1, server, list(cids))
    return server, {c: _update(algo, payloads[c], algo.init_client(c), cid=c)[0] for c in cids}


@pytest.mark.parametrize(("model", "fims"), [(None, {0: 1.0, 1: 3.0, 2: 0.5}), ("cnn_bn", {0: 0.1, 1: 0.3, 2: 0.05})])
def test_the_server_averages_whole_models_with_the_fisher_weights(model, fims):
    """CS: θ^g = Σ_i F_i/Σ_j F_j · θ_i over every entry, the head included, whatever the scale of the traces (a
    sum below 1 too); the sample counts play no part. Integer entries (BatchNorm's counters) take the maximum."""
    algo = prepare(_cfg(model=model))
    server, replies = _replies(algo)
    for c, f in fims.items():
        replies[c]["fim"] = torch.tensor(f, dtype=torch.float64)
        for k, v in replies[c].items():
            if not v.is_floating_point():
                replies[c][k] = v + 5 * (c == 1)
    weights = {0: 10.0, 1: 1.0, 2: 100.0}
    out = algo.aggregate(1, server, replies, weights)
    assert set(out) == set(algo.keys) and set(algo.head_keys) <= set(out)
    total = sum(fims.values())
    for k in algo.keys:
        if not out[k].is_floating_point():
            assert torch.equal(out[k], replies[1][k]) and out[k].dtype == replies[1][k].dtype, k
            continue
        expected = sum(fims[c] / total * replies[c][k].double() for c in replies)
        assert torch.allclose(out[k].double(), expected, atol=1e-6), k
        assert out[k].dtype == replies[0][k].dtype
    by_samples = weighted_mean(replies, weights, algo.keys)
    assert not all(torch.allclose(out[k], by_samples[k]) for k in algo.head_keys)


def test_a_vanishing_trace_sum_falls_back_to_the_sample_weights_and_samples_weighting_is_fedavg_s():
    algo = prepare(_cfg())
    server, replies = _replies(algo)
    for r in replies.values():
        r["fim"] = torch.zeros((), dtype=torch.float64)
    weights = {0: 10.0, 1: 1.0, 2: 100.0}
    assert same_tensors(algo.aggregate(1, server, replies, weights), weighted_mean(replies, weights, algo.keys))
    plain = prepare(_cfg(weighting="samples"))
    replies[1]["fim"] = torch.tensor(5.0, dtype=torch.float64)
    assert same_tensors(plain.aggregate(1, server, replies, weights), weighted_mean(replies, weights, algo.keys))


def test_without_alignment_and_with_sample_weights_the_shared_body_and_heads_are_fedper_s_bit_for_bit():
    """align_epochs 0 and weighting samples (both ablations of the code): FedPer with the classifier personal —
    the same server body and the same personal heads, every round."""
    fedas = pflbed.run(_cfg(align_epochs=0, weighting="samples"), write=False)
    fedper = pflbed.run(_cfg("fedper"), write=False)
    algo = fedas.executor.algo
    assert same_tensors({k: fedas.server[k] for k in algo.body_keys}, fedper.server)
    assert fedas.executor.states.keys() == fedper.executor.states.keys()
    for c, state in fedper.executor.states.items():
        assert same_tensors({k: fedas.executor.states[c][k] for k in algo.head_keys}, state)


def test_the_alignment_loss_weighs_each_class_s_samples_alike_in_a_batched_step():
    """L_PA with the batched step's weights (1/n on real samples, 0 on padding) equals the loop's value."""
    algo, server, state = _setup()
    model, data = algo.ctx.model, algo.ctx.client_data(0)
    plan = algo.sgd_plan(algo.configure(1, server, [0])[0], state, data)
    params = {k: v for k, v in plan.start.items() if k in dict(model.named_parameters())}
    b = data.train[:11]
    x, y = data.x[b], data.y[b]
    pad = torch.cat([torch.arange(11), torch.zeros(5, dtype=torch.long)])
    w = torch.cat([torch.full((11,), 1 / 11), torch.zeros(5)])
    model.train()
    loop = algo.objective(model, params, plan.consts, x, y, None)
    batched = algo.objective(model, params, plan.consts, x[pad], y[pad], w)
    assert torch.allclose(loop, batched, atol=1e-6) and float(loop) > 0


def test_personal_models_are_the_clients_local_models_and_the_generic_model_the_global_one():
    algo, server, state = _setup()
    x = algo.ctx.source.test.x[:8]
    mine = algo.personal_model(server, state).logits(x)
    load_params(algo.ctx.model, state)
    assert torch.equal(mine, algo.ctx.model.eval()(x).detach())
    assert algo.generic_model(server).params is server
    assert algo.zero_shot(server, algo.ctx.client_data(0)).params is server


def test_honest_replies_fit_and_a_wrong_trace_is_refused():
    algo, server, state = _setup()
    payload = algo.configure(1, server, [0])[0]
    reply, _ = _update(algo, payload, state)
    assert algo.reply_fits(payload, reply) is None
    for small in (0.0, 0.5):  # a model at a stationary point, a small trace: honest
        assert algo.reply_fits(payload, {**reply, "fim": torch.tensor(small, dtype=torch.float64)}) is None
    for bad in (-1.0, math.inf, math.nan):
        why = algo.reply_fits(payload, {**reply, "fim": torch.tensor(bad, dtype=torch.float64)})
        assert why is not None and "'fim'" in why
    assert "'fim'" in algo.reply_fits(payload, {**reply, "fim": reply["fim"].float()})
    head = algo.head_keys[0]
    assert f"'{head}'" in algo.reply_fits(payload, {k: v for k, v in reply.items() if k != head})


def test_the_alignment_is_plain_sgd_whatever_the_training_momentum_and_weight_decay():
    """PA 2 steps at η_PA without momentum or weight decay (the code's fresh plain SGD); `train.momentum` and
    `train.weight_decay` are the LT phase's."""
    algo, server, state = _setup(align_lr=0.05)
    tree = _cfg(align_lr=0.05).model_dump(mode="json")
    tree["train"].update(momentum=0.9, weight_decay=0.1)
    heavy = prepare(validate_config(tree))
    payload = algo.configure(1, server, [0])[0]
    data = algo.ctx.client_data(0)
    aligned = []
    for a in (algo, heavy):
        plan = a.sgd_plan(payload, state, data)
        assert len(plan.phases) == 2
        aligned.append(run_plan(a.ctx.model, replace(plan, phases=plan.phases[:1]), data, a.ctx.cfg.train,
                                torch.Generator().manual_seed(7))[1])  # fmt: skip
    assert same_tensors(*aligned) and not all(torch.equal(aligned[0][k], v) for k, v in payload.items())
