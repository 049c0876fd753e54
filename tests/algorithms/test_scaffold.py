"""SCAFFOLD (Karimireddy et al., ICML 2020, Alg. 1): corrected local steps y ← y − η(g(y) − c_i + c), control
variates by option I / II, server x ← x + η_g·mean(y − x) and c ← c + ΣΔc_i / N."""

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import pflbed
from pflbed.algorithms.base import ClientContext
from pflbed.algorithms.training import index_batches, load_params
from pflbed.config import validate_config
from pflbed.engine.build import prepare

from ..tiny import TINY, same_tensors


def _cfg(name="scaffold", rounds=1, momentum=0.5, weight_decay=0.0, **options):
    train = {**TINY["train"], "rounds": rounds, "momentum": momentum, "weight_decay": weight_decay}
    return validate_config({**TINY, "train": train,
                            "algorithm": {"name": name, **options}, "executor": {"threads": 1}})  # fmt: skip


def _random_like(tensors, seed):
    g = torch.Generator().manual_seed(seed)
    return {k: 0.01 * torch.randn(v.shape, generator=g) for k, v in tensors.items()}


def test_first_round_with_zero_control_variates_is_fedavgs_first_round():
    scaffold = pflbed.run(_cfg(), write=False)
    fedavg = pflbed.run(_cfg("fedavg"), write=False)
    algo = prepare(_cfg())
    assert same_tensors(algo.model_part(scaffold.server), fedavg.server)
    assert any(float(scaffold.server[f"c/{k}"].abs().sum()) > 0 for k in algo.params)  # c moved, x did not differ


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_local_steps_are_corrected_and_option_ii_updates_the_control_variate(weight_decay):
    """Plain SGD steps y ← y − η(g − c_i + c), with `train.weight_decay` as in every local optimizer."""
    cfg = _cfg(momentum=0.0, weight_decay=weight_decay)
    algo = prepare(cfg)
    server = algo.init_server()
    c = _random_like({k: server[f"c/{k}"] for k in algo.params}, 1)
    ci = _random_like(algo.init_client(0), 2)
    payload = {**server, **{f"c/{k}": v for k, v in c.items()}}
    data = algo.ctx.client_data(0)
    reply, new_ci = algo.client_update(payload, ci, data, ClientContext(1, 0, torch.Generator().manual_seed(4)))

    model, t = algo.ctx.model, cfg.train
    load_params(model, {k: server[k] for k in algo.model_keys})
    model.train()
    named = dict(model.named_parameters())
    y = {k: server[k].clone() for k in named}
    steps = 0
    for b in index_batches(data.train, t.batch_size, t.local_epochs, torch.Generator().manual_seed(4)):
        load_params(model, y)
        grads = torch.autograd.grad(F.cross_entropy(model(data.x[b]), data.y[b]), list(named.values()))
        y = {k: y[k] - t.lr * (g + weight_decay * y[k] - ci[k] + c[k]) for (k, g) in zip(named, grads, strict=True)}
        steps += 1
    assert steps == t.local_epochs * math.ceil(data.num_train / t.batch_size)
    assert all(torch.allclose(reply[k], y[k], atol=1e-6) for k in named)
    expected = {k: ci[k] - c[k] + (server[k] - reply[k]) / (steps * t.lr) for k in named}
    assert all(torch.allclose(new_ci[k], expected[k], atol=1e-5) for k in named)
    assert all(torch.allclose(reply[f"dc/{k}"], new_ci[k] - ci[k]) for k in named)


@pytest.mark.parametrize("samples", [None, 1])
def test_option_i_control_variate_is_the_full_gradient_at_the_server_model(samples):
    """The mean gradient over the client's training samples (all of them; also a client holding one)."""
    algo = prepare(_cfg(option="I"))
    server = algo.init_server()
    data = algo.ctx.client_data(1)
    data = replace(data, train=data.train[:samples])
    _, new_ci = algo.client_update(server, algo.init_client(1), data, ClientContext(1, 1, torch.Generator()))
    model = algo.ctx.model
    load_params(model, {k: server[k] for k in algo.model_keys})
    model.train()
    named = dict(model.named_parameters())
    loss = F.cross_entropy(model(data.x[data.train]), data.y[data.train])
    grads = dict(zip(named, torch.autograd.grad(loss, list(named.values())), strict=True))
    assert all(torch.allclose(new_ci[k], grads[k], atol=1e-6) for k in named)


@pytest.mark.parametrize("eta", [0.5, 2.0])
def test_server_rule_steps_x_by_the_global_lr_and_adds_the_mean_control_change_over_all_clients(eta):
    algo = prepare(_cfg(server_lr=eta))
    server = {**algo.init_server(), **{f"c/{k}": v for k, v in _random_like(
        {k: algo.ctx.initial_params[k] for k in algo.params}, 3).items()}}  # fmt: skip
    replies = {}
    for cid in (0, 2):
        y = _random_like({k: server[k] for k in algo.model_keys if server[k].is_floating_point()}, 10 + cid)
        replies[cid] = {**{k: server[k] + y.get(k, 0) for k in algo.model_keys},
                        **{f"dc/{k}": v for k, v in _random_like(algo.init_client(cid), 20 + cid).items()}}  # fmt: skip
    weights = {0: 1.0, 2: 3.0}
    agg = algo.aggregator(1, server, weights)
    for cid in (0, 2):
        agg.add(cid, replies[cid])
    out = agg.result()
    assert out.keys() == server.keys()  # the state carries x and c only: the replies' Δc_i are not kept
    n = len(algo.ctx.federation.participated)
    for k in algo.params:
        mean = 0.25 * replies[0][k] + 0.75 * replies[2][k]
        assert torch.allclose(out[k], server[k] + eta * (mean - server[k]), atol=1e-6)
        dc = replies[0][f"dc/{k}"] + replies[2][f"dc/{k}"]
        assert torch.allclose(out[f"c/{k}"], server[f"c/{k}"] + dc / n, atol=1e-7)


def test_model_part_is_the_given_states_even_at_a_freed_states_address():
    """Evaluation reads the model part of each round's server state through a one-entry cache. CPython gives a new
    dict the address of one just freed, so a cache keyed by `id(server)` handed the next round's evaluation the
    previous round's model (a run's records then depended on the allocator); the cache holds the state instead."""
    algo = prepare(_cfg())
    first = algo.init_server()
    algo.model_part(first)
    del first
    nxt = {}  # the allocator's first candidate: the freed state's address, unless the cache holds that state
    nxt.update({k: v + 1 for k, v in algo.init_server().items()})
    assert all(algo.model_part(nxt)[k] is nxt[k] for k in algo.model_keys)


# --- BatchNorm statistics under η_g ≠ 1 ----------------------------------------------------------------------------
# One round of the synthetic data on `cnn_bn` (6 clients, half of them per round, lr 0.1, batch 16).
BN_RUN = {"dataset": {"name": "synthetic"}, "model": {"name": "cnn_bn"},
          "federation": {"clients": 6, "sample_fraction": 0.5}, "train": {"rounds": 1, "lr": 0.1, "batch_size": 16},
          "eval": {"finetune": []}, "executor": {"threads": 1}}  # fmt: skip


def bn_replies(algo, server, cids, seed):
    """Replies around `server` on a BatchNorm model: parameters moved, running variances well below the server's
    (extrapolating them past the server's would make them negative), counters advanced by unequal amounts."""
    g = torch.Generator().manual_seed(seed)
    replies = {}
    for i, cid in enumerate(cids):
        r = {}
        for k in algo.ctx.initial_params:
            v = server[k]
            if not v.is_floating_point():
                r[k] = v + 3 + 7 * i
            elif k.endswith("running_var"):
                r[k] = 0.05 + 0.25 * torch.rand(v.shape, generator=g)
            else:
                r[k] = v + 0.1 * torch.randn(v.shape, generator=g)
        replies[cid] = r
    return replies


@pytest.mark.parametrize("eta", [0.5, 2.0])
def test_server_lr_steps_the_parameters_and_leaves_the_batchnorm_statistics_at_their_mean(eta):
    """η_g extrapolates (η_g > 1) or damps the trainable parameters only: running means and variances are statistics
    of the clients' data, not a descent direction, and take the |D_i|-weighted mean (η_g = 2 on them left most
    variances negative); the batch counters take the maximum."""
    cfg = validate_config({**BN_RUN, "algorithm": {"name": "scaffold", "server_lr": eta}})
    algo = prepare(cfg)
    server = algo.init_server()
    replies = bn_replies(algo, server, (0, 2), 5)
    for r in replies.values():
        r.update({f"dc/{k}": torch.zeros_like(server[f"c/{k}"]) for k in algo.params})
    agg = algo.aggregator(1, server, {0: 1.0, 2: 3.0})
    for cid in (0, 2):
        agg.add(cid, replies[cid])
    out = agg.result()
    assert out.keys() == server.keys()
    buffers = [k for k in algo.model_keys if k not in algo.params]
    assert any(k.endswith("running_var") for k in buffers) and any(k.endswith("running_mean") for k in buffers)
    for k in buffers:
        if server[k].is_floating_point():
            assert torch.allclose(out[k], 0.25 * replies[0][k] + 0.75 * replies[2][k], atol=1e-7)
        else:
            assert out[k].dtype == server[k].dtype and torch.equal(out[k], torch.maximum(replies[0][k], replies[2][k]))
    assert all(bool((out[k] > 0).all()) for k in buffers if k.endswith("running_var"))
    for k in algo.params:
        mean = 0.25 * replies[0][k] + 0.75 * replies[2][k]
        assert torch.allclose(out[k], server[k] + eta * (mean - server[k]), atol=1e-6)


def test_a_round_at_server_lr_2_on_a_batchnorm_model_keeps_every_variance_positive():
    """The run that left 544 of 608 running variances negative (G-FL at chance, exit 0) when η_g stepped them too."""
    r = pflbed.run({**BN_RUN, "algorithm": {"name": "scaffold", "server_lr": 2.0}}, write=False)
    var = [v for k, v in r.server.items() if k.endswith("running_var")]
    assert sum(v.numel() for v in var) == 608 and all(bool((v > 0).all()) for v in var)
