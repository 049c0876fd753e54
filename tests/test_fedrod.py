import math

import pytest
import torch
import torch.nn.functional as F

import pflbed
from pflbed.algorithms.base import Budget, ClientContext
from pflbed.algorithms.fedrod import (
    AdditivePredictor,
    PersonalHead,
    balanced_softmax_loss,
    class_counts,
    personal_loss,
)
from pflbed.algorithms.training import get_params, load_params, sgd_epochs
from pflbed.config import validate_config
from pflbed.engine.loop import prepare
from pflbed.evaluation.evaluate import last
from pflbed.models import build_model

from .tiny import TINY

WITH_NEW = {
    **TINY,
    "federation": {**TINY["federation"], "new_clients": 2},
    "eval": {**TINY["eval"], "new_clients": {"epochs": 1, "lrs": [0.05]}},
}


def _algo(name="fedrod", **options):
    return prepare(validate_config({**TINY, "algorithm": {"name": name, **options}}))


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


@pytest.fixture(scope="module")
def e2e():
    return pflbed.run({**WITH_NEW, "algorithm": {"name": "fedrod"}}, write=False)


def test_fedrod_learns_end_to_end_in_strict_mode(e2e):
    f = e2e.summary["final"]
    assert f["gfl_acc"] > 0.3 and f["pfl_acc"] > 0.3  # 10 balanced classes: chance is 0.1
    nc = e2e.summary["new_clients"]
    assert nc["clients"] == 2 and nc["zero_shot"]["acc"] > 0.2
    for method in ("ft", "lp"):
        assert all(size["last"] > 0.2 for size in nc["methods"][method].values())
    # communication: f and h_G up and down, nothing personal
    from pflbed.federation import sample_clients

    fed = e2e.executor.algo.ctx.federation
    k = len(sample_clients(0, TINY["train"]["rounds"], fed.participated, TINY["federation"]["sample_fraction"]))
    n = sum(v.numel() * v.element_size() for v in e2e.server.values())
    comm = e2e.summary["communication"]
    assert comm["up_bytes_per_round"] == comm["down_bytes_per_round"] == n * k
    assert all(set(s) == {"personal.weight", "personal.bias"} for s in e2e.executor.states.values())


def test_personal_heads_help_under_label_skew():
    """Dir(0.3): the clients' additive personal models beat the generic model on the clients' own test data."""
    from pflbed.evaluation.evaluate import Predictions, client_scores

    cfg = {**TINY, "federation": {**TINY["federation"], "alpha": 0.3}, "algorithm": {"name": "fedrod"}}
    res = pflbed.run(cfg, write=False)
    algo, fed = res.executor.algo, res.executor.algo.ctx.federation
    generic = algo.generic_model(res.server)
    g, _ = client_scores({c: generic for c in fed.participated}, algo.ctx, Predictions(algo.ctx.source, 1024))
    assert res.summary["final"]["pfl_acc"] > sum(g.values()) / len(g)
