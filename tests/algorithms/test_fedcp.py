"""FedCP (Zhang et al., KDD 2023, Figure 2): the policy {r_i, s_i} = Gumbel-softmax of Θ_i(h_i ⊙ v̂_i) splits each
feature between the frozen global head W^hd and the personalized head W_i^hd; local SGD on CE + λ·MMD²(h_i, h_i^g)
against the frozen received extractor; the server averages W^fe, the uploaded heads and Θ; v_i is the column sum of
W_i^hd. Every rule is recomputed here by hand on the tiny MLP (body fc1, fc2; head classifier)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pflbed import rng
from pflbed.algorithms.base import Budget, ClientContext
from pflbed.algorithms.fedcp import STREAM, context_of, mmd2
from pflbed.config import validate_config
from pflbed.engine.build import prepare
from pflbed.errors import ConfigError
from pflbed.models import BlockNet
from pflbed.models.zoo import MODELS

from ..tiny import TINY, same_tensors

BODY = ["blocks.fc1.1.weight", "blocks.fc1.1.bias", "blocks.fc2.0.weight", "blocks.fc2.0.bias"]
HEAD = ["blocks.classifier.weight", "blocks.classifier.bias"]
CPN = ["cpn.0.weight", "cpn.0.bias", "cpn.1.weight", "cpn.1.bias"]
PERSONAL = ["personal." + k for k in HEAD]


def _cfg(train=None, **options):
    return validate_config({**TINY, "train": {**TINY["train"], "local_epochs": 2, "momentum": 0.0, **(train or {})},
                            "algorithm": {"name": "fedcp", **options}, "executor": {"threads": 1}})  # fmt: skip


def _update(algo, server, state, cid=0, seed=7):
    data = algo.ctx.client_data(cid)
    return algo.client_update(server, state, data, ClientContext(1, cid, torch.Generator().manual_seed(seed)))


def _nudged(tensors, scale=0.05, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in tensors.items()}


def body(p, x):
    """h = φ(x; W^fe) of the tiny MLP."""
    h = F.relu(F.linear(x.flatten(1), p["blocks.fc1.1.weight"], p["blocks.fc1.1.bias"]))
    return F.relu(F.linear(h, p["blocks.fc2.0.weight"], p["blocks.fc2.0.bias"]))


def ensemble(p, h, glob, personal, v, noise=None, tau=1.0):
    """out = W^hd(r ⊙ h) + W_i^hd(s ⊙ h), (s, r) = softmax over the two rows of (ReLU(LN(Θ(h ⊙ v/‖v‖))) + noise)/τ."""
    a = F.linear(h * v / v.norm(), p["cpn.0.weight"], p["cpn.0.bias"])
    a = F.relu(F.layer_norm(a, (a.shape[1],), p["cpn.1.weight"], p["cpn.1.bias"])).view(len(h), 2, -1)
    pol = torch.softmax((a if noise is None else a + noise) / tau, dim=1)
    s, r = pol[:, 0], pol[:, 1]
    return F.linear(r * h, glob[HEAD[0]], glob[HEAD[1]]) + F.linear(s * h, personal[HEAD[0]], personal[HEAD[1]])


def mmd_by_hand(a, b, sigmas):
    def k(u, v):
        d = ((u[:, None, :] - v[None, :, :]) ** 2).sum(-1)
        return sum(torch.exp(-d / (2 * s)) for s in sigmas)

    return k(a, a).mean() + k(b, b).mean() - 2 * k(a, b).mean()


def _trained_state(algo, server):
    """A client state of its own: W_i^hd after one update from a perturbed model, and its v_i."""
    _, state = _update(algo, _nudged(server, seed=3), algo.init_client(0), seed=3)
    return state


@pytest.mark.parametrize(("momentum", "decay"), [(0.0, 0.0), (0.5, 0.01)])
def test_the_client_update_is_sgd_on_e_i_through_the_policy_with_w_hd_and_the_reference_frozen(momentum, decay):
    """E epochs of SGD (train.momentum and weight decay, one optimizer across the epochs) on CE + λ·MMD² (λ below 1
    too) through the policy, W^hd and the reference extractor frozen."""
    lam, tau, beta, sigmas = 0.5, 0.7, 0.3, [10.0, 15.0, 20.0, 50.0]
    algo = prepare(_cfg(lam=lam, tau=tau, upload_mix=beta, train={"momentum": momentum, "weight_decay": decay}))
    server = _nudged(algo.init_server(), seed=1)  # W^hd apart from the client's W_i^hd
    state = _trained_state(algo, server)
    sent = {k: v.clone() for k, v in server.items()}
    reply, new_state = _update(algo, server, state)
    assert same_tensors(server, sent)  # the payload (W^fe, W^hd, Θ) is never moved
    t, data = algo.ctx.cfg.train, algo.ctx.client_data(0)
    w = {k: server[k].clone().requires_grad_(True) for k in BODY + CPN}
    mine = {k: state["personal." + k].clone().requires_grad_(True) for k in HEAD}
    v = state["context"]
    g = torch.Generator().manual_seed(7)
    bufs = {}
    for _ in range(t.local_epochs):
        perm = data.train[torch.randperm(len(data.train), generator=g)]
        for b in perm.split(t.batch_size):
            x, y = data.x[b], data.y[b]
            noise = -torch.empty(len(b), 2, algo.k).exponential_(generator=g).log()
            h = body(w, x)
            out = ensemble(w, h, server, mine, v, noise, tau)
            loss = F.cross_entropy(out, y) + lam * mmd_by_hand(h, body(server, x).detach(), sigmas)
            leaves = [*w.values(), *mine.values()]
            grads = torch.autograd.grad(loss, leaves)
            with torch.no_grad():  # torch's SGD: d = g + wd·p; buf = m·buf + d (d at the first step); p − lr·buf
                new = []
                for i, (p, gr) in enumerate(zip(leaves, grads, strict=True)):
                    d = gr + decay * p
                    bufs[i] = d if i not in bufs else momentum * bufs[i] + d
                    new.append(p - t.lr * bufs[i])
            w = {k: p.requires_grad_(True) for k, p in zip(w, new[: len(w)], strict=True)}
            mine = {k: p.requires_grad_(True) for k, p in zip(mine, new[len(w) :], strict=True)}
    assert set(reply) == set(BODY + HEAD + CPN)
    for k in BODY + CPN:
        assert torch.allclose(reply[k], w[k], atol=1e-5), k
    for k in HEAD:  # the upload: (1 − β)·W_i^hd + β·W^hd
        assert torch.allclose(new_state["personal." + k], mine[k], atol=1e-5), k
        assert torch.allclose(reply[k], (1 - beta) * mine[k] + beta * server[k], atol=1e-5), k
    assert torch.allclose(new_state["context"], mine[HEAD[0]].sum(0), atol=1e-4)


def test_the_uploaded_head_is_the_personalized_head_itself_by_default_and_v_its_column_sum():
    algo = prepare(_cfg())
    server = _nudged(algo.init_server(), seed=1)
    reply, state = _update(algo, server, _trained_state(algo, server))
    assert all(torch.equal(reply[k], state["personal." + k]) for k in HEAD)
    assert torch.equal(state["context"], state["personal." + HEAD[0]].sum(0))
    assert not torch.equal(state["personal." + HEAD[0]], server[HEAD[0]])


def test_the_context_of_a_deeper_head_is_the_column_sum_of_its_linear_maps_product():
    """v = 1ᵀ·W_L·…·W_1 for a head of several linear layers (the code's column sum of the one head weight)."""
    g = torch.Generator().manual_seed(0)
    head = {k: torch.randn(*shape, generator=g) for k, shape in [("a", (6, 4)), ("b", (5, 6)), ("c", (3, 5))]}
    assert torch.allclose(context_of(head, ["a", "b", "c"]), (head["c"] @ head["b"] @ head["a"]).sum(0), atol=1e-6)
    assert torch.equal(context_of(head, ["c"]), head["c"].sum(0))


def test_the_server_averages_extractors_uploaded_heads_and_policy_networks_by_sample_counts():
    algo = prepare(_cfg(upload_mix=0.5))
    server = algo.init_server()
    replies = {c: _update(algo, server, algo.init_client(c), cid=c)[0] for c in (0, 2)}
    weights = {0: 3.0, 2: 1.0}
    out = algo.aggregate(1, server, replies, weights)
    assert set(out) == set(server)
    for k in server:
        assert torch.allclose(out[k], 0.75 * replies[0][k] + 0.25 * replies[2][k], atol=1e-6), k


def test_the_personal_model_is_figure_2a_with_the_server_s_modules_and_the_client_s_head_and_context():
    algo = prepare(_cfg())
    server = _nudged(algo.init_server(), seed=1)
    state = _trained_state(algo, server)
    x = algo.ctx.source.test.x[:40]
    with torch.no_grad():
        want = ensemble(server, body(server, x), server, {k: state["personal." + k] for k in HEAD}, state["context"])
        joining = ensemble(server, body(server, x), server, server, server[HEAD[0]].sum(0))
        generic = F.linear(body(server, x), server[HEAD[0]], server[HEAD[1]])
    assert torch.allclose(algo.personal_model(server, state).logits(x), want, atol=1e-5)
    assert torch.allclose(algo.zero_shot(server, algo.ctx.client_data(0)).logits(x), joining, atol=1e-5)
    assert torch.allclose(algo.generic_model(server).logits(x), generic, atol=1e-5)
    # r + s = 1: with W_i^hd = W^hd the ensemble is the generic model with its bias counted twice
    assert torch.allclose(joining, generic + server[HEAD[1]], atol=1e-4)


def test_a_client_starts_from_the_initial_head_and_its_context_or_a_random_context_of_its_own():
    """`initial_context: random` is the authors' code's v_i: each client's constructor draws torch.rand(1, K) in
    turn from one seeded generator, so every client starts from a context of its own."""
    algo = prepare(_cfg())
    init = algo.ctx.initial_params
    states = [algo.init_client(c) for c in (0, 1)]
    for s in states:
        assert all(torch.equal(s["personal." + k], init[k]) for k in HEAD)
        assert torch.equal(s["context"], init[HEAD[0]].sum(0))
    coded = prepare(_cfg(initial_context="random"))
    a, b = coded.init_client(0)["context"], coded.init_client(4)["context"]
    for cid, v in ((0, a), (4, b)):
        assert torch.equal(v, torch.rand(algo.k, generator=rng.generator(coded.ctx.seed, STREAM, 1, cid)))
    assert not torch.equal(a, b)
    _, trained = _update(coded, coded.init_server(), coded.init_client(0))
    assert torch.equal(trained["context"], trained["personal." + HEAD[0]].sum(0))


def test_mmd_is_the_biased_estimate_with_bandwidths_as_variances():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(7, 5, generator=g) * 3, torch.randn(7, 5, generator=g) * 3 + 1
    for sigmas in ([10.0, 15.0, 20.0, 50.0], [0.5]):
        assert torch.allclose(mmd2(a, b, sigmas), mmd_by_hand(a, b, sigmas), atol=1e-5)
    assert abs(float(mmd2(a, a.clone(), [10.0]))) < 1e-5


def test_lam_zero_drops_the_alignment_and_lam_changes_the_update():
    """λ = 0: no E_i^d, and no forward of the reference extractor (which would draw dropout masks and move
    statistics for nothing): one body forward per batch, two with λ > 0."""
    algo0, algo5 = prepare(_cfg(lam=0.0)), prepare(_cfg(lam=5.0))
    server = _nudged(algo0.init_server(), seed=1)
    state = _trained_state(algo0, server)
    forwards = []
    hooks = [a.ctx.model.blocks["fc1"].register_forward_hook(lambda *_: forwards.append(1)) for a in (algo0, algo5)]
    r0, _ = _update(algo0, server, state)
    n0 = len(forwards)
    r5, _ = _update(algo5, server, state)
    for h in hooks:
        h.remove()
    batches = 2 * -(-algo0.ctx.client_data(0).num_train // 16)  # two epochs of batches of 16
    assert (n0, len(forwards) - n0) == (batches, 2 * batches)
    assert not torch.allclose(r0[BODY[0]], r5[BODY[0]], atol=1e-6)
    assert not all(torch.equal(r0[k], r5[k]) for k in HEAD + CPN)


@pytest.mark.parametrize("method", ["ft", "lp"])
def test_a_new_client_personalizes_from_w_hd_never_training_it(method):
    algo = prepare(_cfg())
    server = _nudged(algo.init_server(), seed=1)
    data = algo.ctx.client_data(5)
    models = list(algo.personalize(server, data, Budget(method, 2, 0.1, 16), torch.Generator().manual_seed(0)))
    assert len(models) == 2
    p = models[-1].params
    assert all(torch.equal(p["net." + k], server[k]) for k in HEAD)  # W^hd frozen
    assert torch.equal(p["context"], p["personal." + HEAD[0]].sum(0))
    assert not torch.equal(p["personal." + HEAD[0]], server[HEAD[0]])  # W_i^hd starts at W^hd and trains
    moved = [k for k in BODY + CPN if not torch.equal(p["net." + k] if k in BODY else p[k], server[k])]
    assert moved == (BODY + CPN if method == "ft" else [])
    assert (models[-1].feature_key is None) == (method == "ft")  # lp keeps the server's extractor: shared features


def test_evaluation_noise_is_the_codes_gumbel_draw_and_reproducible():
    algo, noisy = prepare(_cfg()), prepare(_cfg(eval_noise=True))
    server = _nudged(algo.init_server(), seed=1)
    state = _trained_state(algo, server)
    x = algo.ctx.source.test.x[:20]
    clean = algo.personal_model(server, state).logits(x)
    first = noisy.personal_model(server, state).logits(x)
    g = rng.generator(noisy.ctx.seed, STREAM, 2)
    noise = -torch.empty(20, 2, algo.k).exponential_(generator=g).log()
    with torch.no_grad():
        want = ensemble(server, body(server, x), server, {k: state["personal." + k] for k in HEAD}, state["context"],
                        noise)  # fmt: skip
    assert torch.allclose(first, want, atol=1e-5) and not torch.allclose(first, clean, atol=1e-3)
    assert torch.equal(noisy.personal_model(server, state).logits(x), first)
    pred = noisy.personal_model(server, state)  # evaluation on shared features: the same draws in row order
    assert pred.feature_key is not None
    assert torch.allclose(pred.features(x), body(server, x), atol=1e-6)
    assert torch.allclose(pred.classify(pred.features(x, batch_size=3), batch_size=7), want, atol=1e-5)
    assert torch.allclose(pred.logits(x, batch_size=6), want, atol=1e-5)


def test_a_batchnorm_extractor_keeps_the_payload_and_moves_only_the_trained_statistics():
    cfg = validate_config({**TINY, "model": {"name": "cnn_bn"}, "dataset": {"name": "digits"},
                           "train": {**TINY["train"], "momentum": 0.0}, "algorithm": {"name": "fedcp"},
                           "executor": {"threads": 1}})  # fmt: skip
    algo = prepare(cfg)
    server = algo.init_server()
    sent = {k: v.clone() for k, v in server.items()}
    reply, _ = _update(algo, server, algo.init_client(0))
    assert same_tensors(server, sent)
    stats = [k for k in algo.body_keys if "running_mean" in k]
    assert stats and all(not torch.equal(reply[k], server[k]) for k in stats)


def _body(input_shape, width):
    return "body", nn.Sequential(nn.Flatten(), nn.Linear(int(torch.tensor(input_shape).prod()), width), nn.ReLU())


def _deep_head(input_shape, num_classes):
    """A head whose first linear layer reads the body's output, a hidden layer and a ReLU inside it: accepted."""
    head = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, num_classes))
    return BlockNet([_body(input_shape, 8), ("head", head)])


def _no_linear_head(input_shape, num_classes):
    return BlockNet([_body(input_shape, num_classes), ("head", nn.Softmax(1))])


def _wide_head(input_shape, num_classes):
    """The head's linear layer reads the body's output upsampled to twice its width: not the features FedCP weighs."""
    head = nn.Sequential(nn.Unflatten(1, (1, 8)), nn.Upsample(scale_factor=2), nn.Flatten(), nn.Linear(16, num_classes))
    return BlockNet([_body(input_shape, 8), ("head", head)])


@pytest.mark.parametrize(("factory", "features"), [(_deep_head, None), (_no_linear_head, 10), (_wide_head, 8)])
def test_a_model_without_a_linear_head_on_the_body_features_is_refused_in_one_line(factory, features, monkeypatch):
    monkeypatch.setitem(MODELS, "custom", factory)
    cfg = validate_config({**TINY, "model": {"name": "custom"}, "algorithm": {"name": "fedcp"}})
    if features is None:
        assert prepare(cfg).k == 8
        return
    with pytest.raises(ConfigError, match=r"^algorithm.name: fedcp needs a model whose head starts with a linear "
                       rf"layer on the flattened body output \({features} features\); custom has none$"):  # fmt: skip
        prepare(cfg)


def test_a_new_clients_fine_tuning_is_fedcps_local_learning_from_the_joining_state_without_weight_decay():
    """`ft`: E_i (the reference W^fe the server's) from the joining state at the budget's lr and momentum, no weight
    decay whatever `train.weight_decay`; each epoch's model with v_i of its trained W_i^hd."""
    algo = prepare(_cfg(train={"weight_decay": 0.1}))
    server = _nudged(algo.init_server(), seed=1)
    data, budget = algo.ctx.client_data(5), Budget("ft", 2, 0.1, 16, momentum=0.5)
    got = [dict(p.params) for p in algo.personalize(server, data, budget, torch.Generator().manual_seed(0))]
    start = algo.ensemble(server, algo.joining(server))
    list(algo.local_learning(start, data, algo.trainable, algo.model_params(server), 2, 16, 0.1, 0.5, 0.0,
                             torch.Generator().manual_seed(0)))  # fmt: skip
    want = dict(algo.ens.state_dict())
    assert all(torch.equal(got[-1][k], v) for k, v in want.items() if k != "context")
    assert torch.equal(got[-1]["context"], got[-1]["personal." + HEAD[0]].sum(0))


def _bn_head(input_shape, num_classes):
    """A head with BatchNorm between two linear layers: its statistics are entries of W_i^hd and of the upload."""
    from pflbed.models.zoo import SafeBatchNorm1d

    head = nn.Sequential(nn.Linear(8, 6), SafeBatchNorm1d(6), nn.ReLU(), nn.Linear(6, num_classes))
    return BlockNet([_body(input_shape, 8), ("head", head)])


def test_the_upload_mixes_a_heads_statistics_and_keeps_its_own_count_of_batches(monkeypatch):
    """Deviation 1 on every floating entry of the head, its running statistics included; W_i^hd's count of batches
    (an integer) is uploaded as it is, not mixed."""
    monkeypatch.setitem(MODELS, "bn_head", _bn_head)
    cfg = validate_config({**TINY, "model": {"name": "bn_head"}, "algorithm": {"name": "fedcp", "upload_mix": 0.5},
                           "train": {**TINY["train"], "momentum": 0.0}, "executor": {"threads": 1}})  # fmt: skip
    algo = prepare(cfg)
    server = algo.init_server()
    reply, state = _update(algo, server, algo.init_client(0))
    counts = [k for k in algo.head_keys if not server[k].is_floating_point()]
    assert counts and any("running_mean" in k for k in algo.head_keys)
    for k in algo.head_keys:
        mine = state["personal." + k]
        if k in counts:
            assert reply[k].dtype == server[k].dtype and torch.equal(reply[k], mine) and bool(mine > server[k])
        else:
            assert not torch.equal(mine, server[k]) and torch.allclose(reply[k], 0.5 * mine + 0.5 * server[k])


@pytest.mark.parametrize("model", ["mlp", "lenet5_bn"])
def test_a_new_clients_fine_tuning_trains_what_a_clients_update_trains(model):
    """`ft` at the budget's settings (no weight decay) is a client's update (`sgd_plan`, the rule tested above)
    from the joining state at the same settings as `train.*`: each batch's Gumbel noise, E_i^d against the frozen
    W^fe (its BatchNorm statistics copies of the server's), W^hd frozen — W_i^fe, Θ_i, W_i^hd and v_i bit for bit."""
    cfg = validate_config({**TINY, "dataset": {"name": "digits"}, "model": {"name": model},
                           "train": {**TINY["train"], "local_epochs": 2, "lr": 0.05, "momentum": 0.5,
                                     "weight_decay": 0.0},
                           "algorithm": {"name": "fedcp", "lam": 2.0}, "executor": {"threads": 1}})  # fmt: skip
    algo = prepare(cfg)
    server = algo.init_server()
    data = algo.ctx.client_data(5)
    budget = Budget("ft", 2, 0.05, cfg.train.batch_size, momentum=0.5)
    got = list(algo.personalize(server, data, budget, torch.Generator().manual_seed(0)))[-1].params
    reply, state = algo.client_update(server, algo.joining(server), data,
                                      ClientContext(1, 5, torch.Generator().manual_seed(0)))  # fmt: skip
    assert any("running_mean" in k for k in algo.body_keys) == (model == "lenet5_bn")
    assert all(torch.equal(got["net." + k], reply[k]) for k in algo.body_keys)
    assert all(torch.equal(got[k], reply[k]) for k in algo.cpn_keys)
    assert state.keys() <= got.keys() and all(torch.equal(got[k], v) for k, v in state.items())
    assert not torch.equal(got["net." + BODY[0]] if model == "mlp" else got[algo.cpn_keys[0]],
                           server[BODY[0]] if model == "mlp" else server[algo.cpn_keys[0]])  # it trained


def test_a_new_clients_linear_probe_draws_nothing_from_torchs_global_rng():
    """`lp` draws its batches and noise from the given generator alone; its loss (`LocalObjective`) is built once
    with the algorithm, not per call, which would initialize a policy network from torch's global RNG that later
    draws read on from."""
    algo = prepare(_cfg())
    server, data = algo.init_server(), algo.ctx.client_data(5)
    before = torch.get_rng_state()
    models = list(algo.personalize(server, data, Budget("lp", 1, 0.1, 16), torch.Generator().manual_seed(0)))
    assert models and torch.equal(torch.get_rng_state(), before)
