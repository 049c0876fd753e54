import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pflbed
from pflbed.algorithms.base import Budget, ClientContext, Same
from pflbed.algorithms.fedrod import (
    AdditivePredictor,
    PersonalHead,
    balanced_softmax_loss,
    class_counts,
    log_count_offsets,
    personal_loss,
)
from pflbed.algorithms.training import get_params, load_params, sgd_epochs
from pflbed.config import validate_config
from pflbed.engine.build import prepare
from pflbed.evaluation.evaluate import last
from pflbed.models import MODELS, BlockNet, build_model

from ..tiny import TINY, same_tensors

WITH_NEW = {  # label skew Dir(0.3), as in the slides' setups
    **TINY,
    "federation": {**TINY["federation"], "alpha": 0.3, "new_clients": 2},
    "eval": {**TINY["eval"], "new_clients": {"epochs": 1, "lrs": [0.05]}},
}


def _bn_mlp(input_shape, num_classes):
    """A tiny model with a BatchNorm1d in the body (its running statistics tell eval from training mode)."""
    d = int(torch.tensor(input_shape).prod())
    return BlockNet([("body", nn.Sequential(nn.Flatten(), nn.Linear(d, 8), nn.BatchNorm1d(8), nn.ReLU())),
                     ("head", nn.Linear(8, num_classes))])  # fmt: skip


def _algo(name="fedrod", train=None, **options):
    return prepare(validate_config({**TINY, "train": {**TINY["train"], **(train or {})},
                                    "algorithm": {"name": name, **options}}))  # fmt: skip


def _hand_batches(idx, batch_size, epochs, seed):
    """The documented batching rule: a fresh permutation of `idx` per epoch, cut into `batch_size` pieces."""
    g = torch.Generator().manual_seed(seed)
    return [b for _ in range(epochs) for b in idx[torch.randperm(len(idx), generator=g)].split(batch_size)]


def _hand_step(params, grads, bufs, lr, momentum=0.0, weight_decay=0.0):
    """torch.optim.SGD's update written out: d = g + wd·p; b = d (first step) or μ·b + d; p ← p − lr·b."""
    with torch.no_grad():
        for i, (p, g) in enumerate(zip(params, grads, strict=True)):
            d = g + weight_decay * p
            bufs[i] = d.clone() if bufs[i] is None else momentum * bufs[i] + d
            p -= lr * bufs[i]


def _nll(logits, y):
    return -logits.log_softmax(1)[torch.arange(len(y)), y].mean()


def _hand_decoupled(net, personal, data, train, *, gamma, personal_lr, seed, generate=None):
    """Eq. 8 and Eq. 9 by hand, on the same mini-batches: f, h_G take an SGD step on the balanced softmax loss
    (exact label counts N_{m,c}, zero counts floored at 1e-12), the personal parameters one on the plain CE of
    h_G(z) + h_P(z) with f and h_G held fixed. `personal` are the leaves the P-loss trains; `generate(personal)`
    gives h_P's (weight, bias) — the identity for a free head, the hypernetwork for the hyper variant."""
    generate = generate or (lambda ps: ps)
    counts = torch.bincount(data.y[data.train], minlength=len(data.prior)).double()
    offsets = (gamma * counts.clamp_min(1e-12).log()).float()
    net_params = list(net.parameters())
    bufs_g, bufs_p = [None] * len(net_params), [None] * len(personal)
    for b in _hand_batches(data.train, train.batch_size, train.local_epochs, seed):
        net.train()
        x, y = data.x[b], data.y[b]
        z = net.features(x)
        g = net.classify(z)
        w, bias = generate(personal)
        loss_g = _nll(g + offsets, y)
        loss_p = _nll(g.detach() + z.detach().flatten(1) @ w.T + bias, y)
        grads_g = torch.autograd.grad(loss_g, net_params)
        grads_p = torch.autograd.grad(loss_p, personal)
        _hand_step(net_params, grads_g, bufs_g, train.lr, train.momentum, train.weight_decay)
        _hand_step(personal, grads_p, bufs_p, personal_lr, train.momentum, train.weight_decay)


def _net_and_head(seed=0):
    torch.manual_seed(seed)
    net = build_model("mlp", (4,), 3)
    head = PersonalHead(200, 3)
    torch.nn.init.normal_(head.weight)  # non-zero, so gradients through h_P to z would exist if not detached
    return net, head, torch.randn(5, 4), torch.tensor([0, 1, 2, 1, 0])


def test_bsm_is_cross_entropy_with_log_count_offsets():
    g = torch.tensor([[1.0, 2.0, 0.0], [0.5, -1.0, 3.0]])
    y = torch.tensor([1, 0])
    counts = torch.tensor([1.0, 4.0, 2.0])

    def by_hand(row, label, gamma, n=counts):  # −log(N_y^γ e^{g_y} / Σ_c N_c^γ e^{g_c})
        den = sum(float(n[c]) ** gamma * math.exp(g[row, c]) for c in range(3))
        return -math.log(float(n[label]) ** gamma * math.exp(g[row, label]) / den)

    for gamma in (1.0, 0.5):
        expected = (by_hand(0, 1, gamma) + by_hand(1, 0, gamma)) / 2
        assert balanced_softmax_loss(g, y, counts, gamma).item() == pytest.approx(expected, rel=1e-6)
    assert torch.allclose(balanced_softmax_loss(g, y, torch.full((3,), 7.0)), F.cross_entropy(g, y))  # uniform
    assert torch.allclose(balanced_softmax_loss(g, y, counts, gamma=0.0), F.cross_entropy(g, y))
    # a zero count is floored: the class drops out of the denominator, the loss stays finite
    zero = torch.tensor([0.0, 4.0, 2.0])
    got = balanced_softmax_loss(g[:1], y[:1], zero)
    assert torch.isfinite(got) and got.item() == pytest.approx(-math.log(4 * math.e**2 / (4 * math.e**2 + 2)), abs=1e-6)


def test_log_count_offsets_floor_zero_counts_at_1e_12():
    """Deviation 3: γ·log N_{m,c} with N floored at 1e-12, so an absent class sits ≈ −27.6·γ below (dropped from
    the softmax denominator), while present classes keep their exact log counts."""
    got = log_count_offsets(torch.tensor([0.0, 4.0, 1.0]), gamma=0.5)
    assert torch.allclose(got, torch.tensor([0.5 * math.log(1e-12), 0.5 * math.log(4.0), 0.0], dtype=got.dtype))


def test_class_counts_are_the_training_label_counts():
    algo = _algo()
    for c in algo.ctx.federation.participated:
        data = algo.ctx.client_data(c)
        exact = torch.bincount(data.y[data.train], minlength=algo.ctx.source.num_classes).double()
        assert torch.allclose(class_counts(data), exact, atol=1e-3)


def test_p_loss_trains_only_the_personal_head():
    net, head, x, y = _net_and_head()
    z = net.features(x)
    personal_loss(net.classify(z), z, y, head).backward()
    assert all(p.grad is None or not p.grad.any() for p in net.parameters())
    assert head.weight.grad.abs().sum() > 0 and head.bias.grad.abs().sum() > 0


def test_bsm_loss_gives_no_gradient_to_the_personal_head():
    net, head, x, y = _net_and_head()
    z = net.features(x)
    g = net.classify(z)
    _ = personal_loss(g, z, y, head)  # built on the same forward, but not backpropagated
    balanced_softmax_loss(g, y, torch.tensor([3.0, 1.0, 0.0])).backward()
    assert head.weight.grad is None and head.bias.grad is None
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in net.parameters())


def test_generic_training_is_exactly_bsm_sgd():
    """f and h_G after a client update == plain SGD on the BSM loss alone (same batches): h_P never interferes."""
    algo = _algo(personal_lr=0.3)
    c = algo.ctx.federation.participated[0]
    data = algo.ctx.client_data(c)
    reply, _ = algo.client_update(
        algo.init_server(), algo.init_client(c), data, ClientContext(1, c, torch.Generator().manual_seed(7))
    )
    t = algo.ctx.cfg.train
    model = algo.ctx.new_model()
    load_params(model, algo.ctx.initial_params)
    counts = class_counts(data)
    for _ in sgd_epochs(model, data, epochs=t.local_epochs, batch_size=t.batch_size, lr=t.lr,
                        generator=torch.Generator().manual_seed(7),
                        loss_fn=lambda out, yy: balanced_softmax_loss(out, yy, counts)):  # fmt: skip
        pass
    expected = get_params(model)
    assert set(reply) == set(expected)
    for k, v in expected.items():
        assert torch.allclose(reply[k], v, atol=1e-6), k


@pytest.mark.parametrize(
    ("options", "train", "start_head"),
    [
        ({}, {}, "zero"),  # defaults: γ = 1, personal_lr = train.lr, h_P from init_client's zeros
        ({"gamma": 0.5, "personal_lr": 0.3}, {"momentum": 0.5, "weight_decay": 0.01, "local_epochs": 2}, "random"),
    ],
)
def test_client_update_is_eq8_and_eq9_on_the_same_batches(options, train, start_head):
    """One client update == hand-written Eq. 8 (f, h_G: SGD on L^BSM with the option γ) and Eq. 9 (h_P: SGD on the
    P-loss at personal_lr, same momentum / weight decay) on the same batches, h_P starting from the client's stored
    head; the reply is f and h_G, the new state is h_P. Called twice, it gives the same result (both optimizers
    restart every round)."""
    algo = _algo(train=train, **options)
    c = algo.ctx.federation.participated[1]
    data, t = algo.ctx.client_data(c), algo.ctx.cfg.train
    state = algo.init_client(c)
    if start_head == "random":  # φ*_m of an earlier round
        state = {k: 0.1 * torch.randn_like(v) for k, v in state.items()}
    payload = {k: v + 0.01 * torch.randn_like(v) for k, v in algo.init_server().items()}
    net = algo.ctx.new_model()
    load_params(net, payload)
    personal = [state["personal.weight"].clone().requires_grad_(), state["personal.bias"].clone().requires_grad_()]
    plr = options.get("personal_lr", t.lr)
    _hand_decoupled(net, personal, data, t, gamma=options.get("gamma", 1.0), personal_lr=plr, seed=11)
    expected = get_params(net)
    for _ in range(2):
        cctx = ClientContext(3, c, torch.Generator().manual_seed(11))
        reply, new_state = algo.client_update(payload, state, data, cctx)
        assert set(reply) == set(expected) and set(new_state) == {"personal.weight", "personal.bias"}
        for k, v in expected.items():
            assert torch.allclose(reply[k], v, atol=1e-5), k
        assert torch.allclose(new_state["personal.weight"], personal[0].detach(), atol=1e-5)
        assert torch.allclose(new_state["personal.bias"], personal[1].detach(), atol=1e-5)


def test_client_update_keeps_the_personal_head_local_and_aggregation_is_weighted():
    algo = _algo()
    server = algo.init_server()
    model_keys = set(algo.ctx.model.state_dict())
    replies, states = {}, {}
    for i, c in enumerate(algo.ctx.federation.participated[:2]):
        state = algo.init_client(c)
        assert set(state) == {"personal.weight", "personal.bias"} and not any(v.any() for v in state.values())
        replies[c], states[c] = algo.client_update(
            server, state, algo.ctx.client_data(c), ClientContext(1, c, torch.Generator().manual_seed(i))
        )
        assert set(replies[c]) == model_keys  # f and h_G only: no personal key is ever uploaded
        assert set(states[c]) == set(state) and states[c]["personal.weight"].abs().sum() > 0
    (a, b) = replies
    out = algo.aggregate(1, server, replies, {a: 1, b: 3})
    assert set(out) == model_keys
    for k in model_keys:
        assert torch.allclose(out[k], 0.25 * replies[a][k] + 0.75 * replies[b][k], atol=1e-6)
    # the personal predictor is f + h_G + h_P, and with the zero initial head it equals the generic model
    x = algo.ctx.source.test.x[:50]
    personal = algo.personal_model(out, states[a])
    assert isinstance(personal.model, AdditivePredictor)
    z = algo.generic_model(out).features(x)
    expected = algo.generic_model(out).classify(z) + F.linear(
        z, states[a]["personal.weight"], states[a]["personal.bias"]
    )
    assert torch.allclose(personal.logits(x), expected, atol=1e-5)
    fresh = algo.personal_model(out, algo.init_client(0))
    assert torch.allclose(fresh.logits(x), algo.generic_model(out).logits(x))
    # a new client's zero-shot model is the generic model (ŷ_P with h_P at its zero initialisation)
    assert torch.equal(algo.zero_shot(out, algo.ctx.client_data(0)).logits(x), algo.generic_model(out).logits(x))


@pytest.mark.parametrize("method", ["ft", "lp"])
def test_personalize_lp_trains_only_the_personal_head(method):
    algo = _algo()
    server = algo.init_server()
    p = last(algo.personalize(server, algo.ctx.client_data(0), Budget(method, 1, 0.1, 8), torch.Generator()))
    start = {"net." + k: v for k, v in server.items()}
    changed = {k for k, v in p.params.items() if not torch.equal(v, start.get(k, torch.zeros_like(v)))}
    float_keys = {k for k, v in start.items() if v.is_floating_point()}
    assert changed == ({"personal.weight", "personal.bias"} | (float_keys if method == "ft" else set()))
    assert (p.feature_key is not None) == (method == "lp")


@pytest.mark.parametrize("method", ["ft", "lp"])
def test_personalize_is_sgd_on_the_additive_predictor_from_a_zero_head(monkeypatch, method):
    """New client (deviation 9), from θ̄, ψ̄ and h_P = 0 with the budget's lr and momentum, no weight decay:
    lp trains h_P alone with the P-loss on body features computed once in eval mode (a BatchNorm body, so train-
    mode features would differ); ft trains f, h_G and h_P together with plain CE on h_G(z) + h_P(z), no
    stop-gradient, in training mode."""
    monkeypatch.setitem(MODELS, "bn_mlp", _bn_mlp)
    algo = prepare(validate_config({**TINY, "model": {"name": "bn_mlp"}, "algorithm": {"name": "fedrod"}}))
    server = {k: v + 0.05 * torch.randn_like(v) if v.is_floating_point() else v for k, v in algo.init_server().items()}
    data = algo.ctx.client_data(algo.ctx.federation.participated[0])
    budget = Budget(method, 2, 0.1, 16, momentum=0.5)
    got = last(algo.personalize(server, data, budget, torch.Generator().manual_seed(5))).params
    net = algo.ctx.new_model()
    load_params(net, server)
    w, b = (torch.zeros_like(v).requires_grad_() for v in (algo.head.weight, algo.head.bias))
    if method == "lp":
        net.eval()
        with torch.no_grad():
            z = net.features(data.x[data.train])
            g = net.classify(z)
        params, bufs = [w, b], [None, None]
        for idx in _hand_batches(torch.arange(len(z)), 16, 2, 5):
            loss = _nll(g[idx] + z[idx] @ w.T + b, data.y[data.train][idx])
            _hand_step(params, torch.autograd.grad(loss, params), bufs, 0.1, 0.5)
    else:
        params = [*net.parameters(), w, b]
        bufs = [None] * len(params)
        net.train()
        for idx in _hand_batches(data.train, 16, 2, 5):
            z = net.features(data.x[idx])
            loss = _nll(net.classify(z) + z @ w.T + b, data.y[idx])
            _hand_step(params, torch.autograd.grad(loss, params), bufs, 0.1, 0.5)
    expected = {**{"net." + k: v for k, v in get_params(net).items()}, "personal.weight": w, "personal.bias": b}
    assert set(got) == set(expected)
    for k, v in expected.items():
        assert torch.allclose(got[k], v.detach(), atol=1e-5), k


@pytest.fixture(scope="module")
def e2e():
    return pflbed.run({**WITH_NEW, "algorithm": {"name": "fedrod"}}, write=False)


def test_fedrod_learns_end_to_end_in_strict_mode(e2e):
    """References: chance (0.1) for the generic model; for new clients, their zero-shot model (the generic model,
    h_P = 0), which adapting h_P (lp) or everything (ft) on the client's own data must beat under label skew
    (seed 0: zero-shot 0.39, adapted 0.55–0.57)."""
    f = e2e.summary["final"]
    assert f["gfl_acc"] > 0.3 and f["pfl_acc"] > 0.3  # 10 balanced classes: chance is 0.1
    nc = e2e.summary["new_clients"]
    assert nc["clients"] == 2 and nc["zero_shot"]["acc"] > 0.2
    for method in ("ft", "lp"):
        assert all(size["last"] > nc["zero_shot"]["acc"] + 0.08 for size in nc["methods"][method].values())
    # communication: f and h_G up and down, nothing personal
    from pflbed.federation import sample_clients

    fed = e2e.executor.algo.ctx.federation
    k = len(sample_clients(0, TINY["train"]["rounds"], fed.participated, TINY["federation"]["sample_fraction"]))
    n = sum(v.numel() * v.element_size() for v in e2e.server.values())
    comm = e2e.summary["communication"]
    assert comm["up_bytes_per_round"] == comm["down_bytes_per_round"] == n * k
    assert all(set(s) == {"personal.weight", "personal.bias"} for s in e2e.executor.states.values())


def test_personal_heads_help_under_label_skew():
    """Dir(0.3): the clients' additive personal models beat the generic model (the same run with h_P left at zero)
    on the clients' own test data, by a margin (seed 0: 0.58 vs 0.48) that a head not fitted to the client's
    labels (e.g. trained with the balanced loss, or never kept between rounds) does not reach."""
    from pflbed.evaluation.evaluate import Predictions, client_scores

    cfg = {**TINY, "federation": {**TINY["federation"], "alpha": 0.3}, "algorithm": {"name": "fedrod"}}
    res = pflbed.run(cfg, write=False)
    algo, fed = res.executor.algo, res.executor.algo.ctx.federation
    generic = algo.generic_model(res.server)
    g, _ = client_scores({c: generic for c in fed.participated}, algo.ctx, Predictions(algo.ctx.source, 1024))
    assert res.summary["final"]["pfl_acc"] > sum(g.values()) / len(g) + 0.05


def test_feature_dim_is_the_size_of_one_samples_body_output():
    """Deviation 5: h_P is Linear(d, C) on the flattened body output, d = the size of ONE sample's body output —
    here a conv body whose output is (2, 6, 6) per 3×8×8 sample, so d = 72 (not a size of a batch-less input)."""
    from pflbed.algorithms.fedrod import feature_dim

    net = BlockNet([("body", nn.Conv2d(3, 2, 3)), ("head", nn.Sequential(nn.Flatten(), nn.Linear(72, 4)))])
    net.train()
    assert feature_dim(net, (3, 8, 8)) == 72 and net.training  # training mode restored


def _assert_cached_predictions_are_each_models_own(preds, source):
    """One `Predictions` cache shared by predictors on different server states must give every predictor its own
    predictions: the feature key that shares body features must be tied to the body (the server state)."""
    from pflbed.evaluation.evaluate import Predictions

    P = Predictions(source, 1024)
    idx = torch.arange(200)
    for p in preds:
        assert torch.equal(P(p, "test", idx), p.logits(source.test.x[idx]).argmax(1))


def _two_servers(algo):
    s1 = algo.init_server()
    torch.manual_seed(3)
    s2 = {k: v + 0.5 * torch.randn_like(v) if v.is_floating_point() else v for k, v in s1.items()}
    return s1, s2


def test_cached_body_features_are_keyed_by_the_server_state():
    """`additive` (personal models) and `personalize` lp declare a shared body with feature_key = (tag, server): two
    server states alive together (one evaluation cache) must not share features."""
    algo = _algo()
    s1, s2 = _two_servers(algo)
    c = algo.ctx.federation.participated[0]
    state = {k: torch.randn_like(v) for k, v in algo.init_client(c).items()}
    personal = [algo.personal_model(s, state) for s in (s1, s2)]
    data = algo.ctx.client_data(c)
    lp = [last(algo.personalize(s, data, Budget("lp", 1, 0.1, 16), torch.Generator().manual_seed(0))) for s in (s1, s2)]
    _assert_cached_predictions_are_each_models_own(personal + lp, algo.ctx.source)


# --- `pfl_body` (deviation 8): the P-FL model on the server's body or on the client's own ------------------------
LOCAL_BODIES = {  # label skew; 3 rounds of 3 of the 6 clients: some sampled twice, one last in round 2, two never
    **TINY,
    "federation": {**TINY["federation"], "alpha": 0.3},
    "train": {**TINY["train"], "rounds": 3},
}


def run_recording_replies(monkeypatch, cfg):
    """A run, and every reply the server took in, by (round, client): θ*_m, ψ*_m as the client uploaded them."""
    from pflbed.algorithms.fedrod import FedRoD

    replies, make = {}, FedRoD.aggregator

    def aggregator(self, rnd, server, weights):
        agg = make(self, rnd, server, weights)
        add = agg.add

        def recording_add(cid, reply):
            replies[(rnd, cid)] = {k: v.clone() for k, v in reply.items()}
            add(cid, reply)

        agg.add = recording_add
        return agg

    monkeypatch.setattr(FedRoD, "aggregator", aggregator)
    return pflbed.run(cfg, write=False, progress=False), replies


def last_rounds(replies, fed, rounds):
    """Each participated client's last round with a reply (None: never sampled); checks the run has every case."""
    last = {c: max((r for r, cc in replies if cc == c), default=None) for c in fed.participated}
    assert None in last.values()  # a client never sampled
    assert any(r is not None and r < rounds for r in last.values())  # one whose body is older than the server's
    assert any(sum(cc == c for _, cc in replies) > 1 for c in fed.participated)  # one sampled more than once
    return last


def additive_logits(algo, body, weight, bias, x):
    """ŷ_P by hand: a fresh model with `body` loaded, h_G(f(x)) + W·f(x) + b, in eval mode."""
    net = algo.ctx.new_model()
    load_params(net, {k: body[k] for k in algo.ctx.model.state_dict()})
    net.eval()
    with torch.no_grad():
        z = net.features(x)
        return net.classify(z) + F.linear(z.flatten(1), weight, bias)


def test_local_pfl_body_is_the_clients_own_body_of_its_last_round(monkeypatch):
    """`pfl_body: local`: client m's P-FL predictor is f, h_G = θ*_m, ψ*_m it uploaded in its last participated
    round (not θ̄, ψ̄, not another client's, not an older round's) + its φ*_m; a client never sampled gets θ̄, ψ̄
    with φ = 0, i.e. the generic model. Each reference is computed directly, and shown to differ from the others."""
    cfg = {**LOCAL_BODIES, "algorithm": {"name": "fedrod", "pfl_body": "local"}}
    res, replies = run_recording_replies(monkeypatch, cfg)
    algo, server = res.executor.algo, res.server
    last = last_rounds(replies, algo.ctx.federation, LOCAL_BODIES["train"]["rounds"])
    model_keys = set(algo.ctx.model.state_dict())
    x = algo.ctx.source.test.x[:300]
    trained = [c for c, r in last.items() if r is not None]
    for c, r in last.items():
        state = res.executor.state(c)
        got = algo.personal_model(server, state)
        assert got.feature_key is None or r is None  # a client's own body shares no cached features
        if r is None:
            assert set(state) == {"personal.weight", "personal.bias"}
            assert torch.equal(got.logits(x), algo.generic_model(server).logits(x))
            continue
        assert set(state) == {"personal.weight", "personal.bias"} | {"local." + k for k in model_keys}
        w, b = state["personal.weight"], state["personal.bias"]
        expected = additive_logits(algo, replies[(r, c)], w, b, x)
        assert torch.allclose(got.logits(x), expected, atol=1e-5), c
        # the alternatives the rule excludes give other predictions here
        other = next(o for o in trained if o != c)
        wrong = [server, replies[(last[other], other)]] + [v for (rr, cc), v in replies.items() if cc == c and rr != r]
        for body in wrong:
            assert not torch.allclose(additive_logits(algo, body, w, b, x), expected, atol=1e-3), c


def test_pfl_body_changes_the_pfl_model_only():
    """Training, the server, G-FL, the personal heads and the new-client results are the same under both options
    (the replies are); `server` keeps φ_m alone in the state and scores it on θ̄, ψ̄, `local` differs in P-FL."""
    cfg = {**WITH_NEW, "train": {**WITH_NEW["train"], "rounds": 3}}
    runs = {body: pflbed.run({**cfg, "algorithm": {"name": "fedrod", "pfl_body": body}}, write=False, progress=False)
            for body in ("server", "local")}  # fmt: skip
    on_server, on_local = runs["server"], runs["local"]
    assert same_tensors(on_server.server, on_local.server)
    assert [h["gfl_acc"] for h in on_server.history] == [h["gfl_acc"] for h in on_local.history]
    assert on_server.summary["new_clients"] == on_local.summary["new_clients"]
    assert on_server.summary["communication"] == on_local.summary["communication"]
    algo = on_server.executor.algo
    for c, s in on_server.executor.states.items():
        assert set(s) == {"personal.weight", "personal.bias"}
        assert all(torch.equal(s[k], on_local.executor.states[c][k]) for k in s)
        assert algo.personal_model(on_server.server, s).feature_key == ("fedrod-body", Same(on_server.server))
    assert on_server.summary["final"]["pfl_acc"] != on_local.summary["final"]["pfl_acc"]


@pytest.mark.parametrize("pfl_test", ["local", "global"])
def test_local_bodies_are_scored_each_on_its_own_features(pfl_test):
    """The evaluation (one prediction cache for all clients; the global test set is the same for every client) must
    give each client the score of its own model, computed alone with a fresh cache: no body features shared
    between clients with `pfl_body: local`. Test and validation, per client and averaged."""
    from pflbed.evaluation.evaluate import Predictions, client_score, evaluate

    cfg = {**LOCAL_BODIES, "eval": {**TINY["eval"], "pfl_test": pfl_test},
           "algorithm": {"name": "fedrod", "pfl_body": "local"}}  # fmt: skip
    res = pflbed.run(cfg, write=False, progress=False)
    algo, ctx = res.executor.algo, res.executor.algo.ctx
    scores, per_client = evaluate(algo, res.server, res.executor.state)

    def alone(c, which):
        pred = algo.personal_model(res.server, res.executor.state(c))
        return client_score(pred, c, ctx, Predictions(ctx.source, 1024), which)

    test = {c: alone(c, "test") for c in ctx.federation.participated}
    val = [alone(c, "val") for c in ctx.federation.participated]
    assert per_client == test
    assert scores["pfl_acc"] == pytest.approx(sum(test.values()) / len(test), abs=1e-9)
    assert scores["pfl_val"] == pytest.approx(sum(v for v in val if v == v) / len(val), abs=1e-9)
    assert res.summary["final"]["pfl_acc"] == scores["pfl_acc"]
