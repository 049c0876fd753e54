"""GPFL (Zhang et al., ICCV 2023, Eqs. 3-11): local SGD on L^P + L^alg + λ·L^mlg + (μ/2)·(‖C‖² + ‖V‖²) over the
body φ, the personal head ψ_i, the Conditional Valve V and the Global Category Embedding C; the server averages φ, V
and C; client i predicts with ψ_i(CoV(φ(x), p_i)), the generic model with cos(CoV(φ(x), g), C). Everything below is
written out by hand, independently of the module's code."""

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from pflbed.algorithms.base import Budget, ClientContext
from pflbed.algorithms.training import index_batches
from pflbed.config import validate_config
from pflbed.engine.build import prepare
from pflbed.engine.executor import update_client

from ..tiny import TINY

TABLE = "gce.weight"


def _algo(batch_size=16, epochs=2, **options):
    train = {**TINY["train"], "local_epochs": epochs, "momentum": 0.0, "batch_size": batch_size}
    return prepare(validate_config({**TINY, "algorithm": {"name": "gpfl", **options}, "executor": {"threads": 1},
                                    "train": train}))  # fmt: skip


def _update(algo, server, state, cid=0, seed=7):
    return algo.client_update(server, state, algo.ctx.client_data(cid),
                              ClientContext(1, cid, torch.Generator().manual_seed(seed)))  # fmt: skip


def _blocks(model, w, names, x):
    for name in names:
        pre = f"blocks.{name}."
        x = functional_call(model.blocks[name], {k[len(pre) :]: v for k, v in w.items() if k.startswith(pre)}, (x,))
    return x


def _valve(w, c, f):
    """Eqs. 3-4: σ[(γ(c) + 1) ⊙ f + β(c)], γ, β = LayerNorm(ReLU(Linear(c))), LayerNorm written out."""

    def side(name):
        h = F.relu(w[f"cov.{name}.0.weight"] @ c + w[f"cov.{name}.0.bias"])
        h = (h - h.mean()) / torch.sqrt(h.var(unbiased=False) + 1e-5)
        return h * w[f"cov.{name}.2.weight"] + w[f"cov.{name}.2.bias"]

    return torch.relu((side("gamma") + 1) * f + side("beta"))


def _cos(f, table):
    return (f / f.norm(dim=1, keepdim=True)) @ (table / table.norm(dim=1, keepdim=True)).T


def _g(table):
    return sum(table[u] for u in range(len(table))) / len(table)


def _p(table, prior):
    return sum(prior[u] * table[u] for u in range(len(table)))


def _hand(algo, server, head, g, p, cid=0, seed=7, lam=0.0, mu=0.0, mlg="sample"):
    """E epochs of SGD on L^P + L^alg + λ·L^mlg + (μ/2)(‖C‖² + ‖V‖²), Ĉ the received C, every tensor together."""
    model, t, data = algo.ctx.model, algo.ctx.cfg.train, algo.ctx.client_data(cid)
    model.train()
    w = {k: v.clone() for k, v in {**server, **head}.items()}
    frozen = server[TABLE].clone()
    for b in index_batches(data.train, t.batch_size, t.local_epochs, torch.Generator().manual_seed(seed)):
        x, y = data.x[b], data.y[b]
        w = {k: v.detach().requires_grad_() for k, v in w.items()}
        f = _blocks(model, w, model.body_blocks(), x).flatten(1)
        f_g, f_p = _valve(w, g, f), _valve(w, p, f)
        personal = F.cross_entropy(_blocks(model, w, model.head_blocks(), f_p), y)  # Eq. 10
        angle = -_cos(f_g, w[TABLE]).log_softmax(1)[torch.arange(len(y)), y].mean()  # Eq. 8
        gap = f_g - frozen[y]  # Eq. 9
        magnitude = gap.norm(dim=1).mean() if mlg == "sample" else gap.pow(2).sum().sqrt()
        decay = sum(v.pow(2).sum() for k, v in w.items() if k.startswith(("cov.", "gce.")))
        loss = personal + angle + lam * magnitude + mu / 2 * decay
        grads = torch.autograd.grad(loss, list(w.values()))
        w = {k: v.detach() - t.lr * gr for (k, v), gr in zip(w.items(), grads, strict=True)}
    return w


def _close(a, b, keys, atol=1e-5):
    return all(torch.allclose(a[k], b[k], atol=atol) for k in keys)


@pytest.mark.parametrize("mlg", ["sample", "batch"])
def test_the_client_update_is_sgd_on_the_gpfl_loss_with_g_and_p_from_the_received_embedding(mlg):
    lam, mu = 0.5, 0.3
    algo = _algo(lam=lam, mu=mu, mlg=mlg)
    server, state = algo.init_server(), algo.init_client(0)
    reply, new = _update(algo, server, state)
    head_keys = [k for k in state if k != "prior"]
    table, prior = server[TABLE], algo.ctx.client_data(0).prior
    w = _hand(algo, server, {k: state[k] for k in head_keys}, _g(table), _p(table, prior), lam=lam, mu=mu, mlg=mlg)
    assert set(reply) == set(server)  # φ, V, C; the head stays home
    assert _close(reply, w, server)
    assert set(new) == {*head_keys, "prior"} and _close(new, w, head_keys) and torch.equal(new["prior"], prior)
    plain = _hand(algo, server, {k: state[k] for k in head_keys}, _g(table), _p(table, prior))
    assert not _close(reply, plain, server)  # λ and μ acted


def test_local_conditional_inputs_start_at_zero_and_come_from_the_clients_trained_embedding():
    """`conditional: local` (the authors' code): g = p = 0 before a client first trains; afterwards the g, p of the
    C it trained, kept in its state and used for its next update and its P-FL model."""
    algo = _algo(conditional="local", lam=0.2, mu=0.1)
    server, state = algo.init_server(), algo.init_client(0)
    head_keys = [k for k in state if k != "prior"]
    zero = torch.zeros(len(server[TABLE][0]))
    x = algo.ctx.client_data(0).x[:8]
    assert torch.allclose(algo.personal_model(server, state).logits(x), _predict(algo, server, state, zero, x))
    reply, new = _update(algo, server, state)
    w = _hand(algo, server, {k: state[k] for k in head_keys}, zero, zero, lam=0.2, mu=0.1)
    assert _close(reply, w, server) and _close(new, w, head_keys)
    prior = algo.ctx.client_data(0).prior
    assert torch.allclose(new["g"], _g(reply[TABLE]), atol=1e-6)
    assert torch.allclose(new["p"], _p(reply[TABLE], prior), atol=1e-6)
    server2 = {k: v + 0.01 for k, v in reply.items()}  # another C is received: the kept g, p still rule
    reply2, _ = _update(algo, server2, new, seed=8)
    w2 = _hand(algo, server2, {k: new[k] for k in head_keys}, new["g"], new["p"], seed=8, lam=0.2, mu=0.1)
    assert _close(reply2, w2, server)
    assert torch.allclose(algo.personal_model(server2, new).logits(x), _predict(algo, server2, new, new["p"], x),
                          atol=1e-5)  # fmt: skip


def _predict(algo, server, state, p, x):
    """ψ_i(CoV(φ(x), p)) by hand."""
    model = algo.ctx.model
    model.eval()
    with torch.no_grad():
        f = _blocks(model, server, model.body_blocks(), x).flatten(1)
        return _blocks(model, state, model.head_blocks(), _valve(server, p, f))


def _round(algo, cids=(0, 1, 2)):
    server = algo.init_server()
    out = {c: update_client(algo, 1, c, server, algo.init_client(c)) for c in cids}
    return server, {c: r for c, (r, _) in out.items()}, {c: s for c, (_, s) in out.items()}


def test_the_server_averages_the_body_valve_and_embedding_weighted_by_training_samples():
    algo = _algo(mu=0.1)
    server, replies, states = _round(algo)
    weights = {c: float(algo.ctx.client_data(c).num_train) for c in replies}
    new = algo.aggregate(1, server, replies, weights)
    assert set(new) == set(server) and not any(k.startswith("blocks.classifier") for k in new)
    total = sum(weights.values())
    for k in new:
        assert torch.allclose(new[k], sum(weights[c] * replies[c][k] for c in replies) / total, atol=1e-6)
    assert not torch.equal(new[TABLE], server[TABLE])  # C is trained and shared


def test_the_personal_model_is_the_own_head_on_the_valve_with_p_from_the_servers_embedding_and_the_generic_cosine():
    algo = _algo()
    server, replies, states = _round(algo)
    new = algo.aggregate(1, server, replies, {c: 1.0 for c in replies})
    data = algo.ctx.client_data(1)
    x = data.x[data.train[:20]]
    p = _p(new[TABLE], data.prior)
    assert torch.allclose(algo.personal_model(new, states[1]).logits(x), _predict(algo, new, states[1], p, x),
                          atol=1e-5)  # fmt: skip
    model = algo.ctx.model
    with torch.no_grad():
        f = _blocks(model, new, model.body_blocks(), x).flatten(1)
        generic = _cos(_valve(new, _g(new[TABLE]), f), new[TABLE])
    assert torch.allclose(algo.generic_model(new).logits(x), generic, atol=1e-5)
    assert torch.equal(algo.zero_shot(new, data).logits(x), algo.generic_model(new).logits(x))


def test_a_per_sample_and_a_batch_magnitude_term_agree_on_batches_of_one():
    """With one sample per batch the mean of per-sample norms (Eq. 9) is the code's batch Frobenius norm."""
    one = _algo(batch_size=1, epochs=1, lam=0.5, mlg="sample")
    server, state = one.init_server(), one.init_client(2)
    a, _ = _update(one, server, state, cid=2)
    b, _ = _update(_algo(batch_size=1, epochs=1, lam=0.5, mlg="batch"), server, state, cid=2)
    assert _close(a, b, server, atol=1e-6)
    c, _ = _update(_algo(batch_size=16, lam=0.5, mlg="batch"), server, state, cid=2)
    d, _ = _update(_algo(batch_size=16, lam=0.5, mlg="sample"), server, state, cid=2)
    assert not _close(c, d, server)


def test_a_new_clients_linear_probe_trains_the_initial_head_on_the_frozen_personalized_features():
    """`lp`: the initial head trained by SGD with the budget's momentum on CoV(φ(x), p) (φ, V and p = α·C of the
    server's, frozen); the predictor carries all it needs (φ, V, its own p), so that another new client's
    personalization in between changes none of its predictions. `ft` moves V with φ and ψ, and predicts with them."""
    algo = _algo()
    server, replies, _ = _round(algo)
    new = algo.aggregate(1, server, replies, {c: 1.0 for c in replies})
    data = algo.ctx.client_data(4)
    budget = Budget("lp", 2, 0.1, 16, momentum=0.5)
    last = list(algo.personalize(new, data, budget, torch.Generator().manual_seed(3)))[-1]
    model = algo.ctx.model
    head_keys = model.state_keys(model.head_blocks())
    init = {k: algo.ctx.initial_params[k] for k in head_keys}
    p = _p(new[TABLE], data.prior)
    with torch.no_grad():
        f = _blocks(model, new, model.body_blocks(), data.x[data.train]).flatten(1)
        z = _valve(new, p, f)
    w, buf = dict(init), {}
    for b in index_batches(torch.arange(len(z)), 16, 2, torch.Generator().manual_seed(3)):
        w = {k: v.detach().requires_grad_() for k, v in w.items()}
        loss = F.cross_entropy(_blocks(model, w, model.head_blocks(), z[b]), data.y[data.train][b])
        grads = torch.autograd.grad(loss, list(w.values()))
        buf = {k: 0.5 * buf[k] + g if k in buf else g for k, g in zip(w, grads, strict=True)}  # torch.optim.SGD's
        w = {k: v.detach() - 0.1 * buf[k] for k, v in w.items()}
    assert all(torch.allclose(last.params["net." + k], w[k], atol=1e-5) for k in head_keys)
    x = data.x[data.train[:10]]
    list(algo.personalize(new, algo.ctx.client_data(5), budget, torch.Generator().manual_seed(4)))  # another client
    assert not torch.allclose(_p(new[TABLE], algo.ctx.client_data(5).prior), p)
    assert torch.allclose(last.logits(x), _predict(algo, new, w, p, x), atol=1e-5)
    ft = list(algo.personalize(new, data, Budget("ft", 1, 0.1, 16), torch.Generator().manual_seed(3)))[-1]
    assert last.params.keys() == ft.params.keys()
    assert not torch.equal(ft.params["cov.gamma.0.weight"], new["cov.gamma.0.weight"])  # V fine-tuned with φ, ψ
    body = {k: ft.params["net." + k] for k in model.state_keys(model.body_blocks())}
    head = {k: ft.params["net." + k] for k in head_keys}
    valve = {k: v for k, v in ft.params.items() if k.startswith("cov.")}
    assert torch.allclose(ft.logits(x), _predict(algo, {**body, **valve}, head, p, x), atol=1e-5)


def test_the_valve_and_the_embedding_start_from_the_runs_seed():
    """V and C are drawn from the run's seed (its INIT stream): the same seed the same start, another seed another
    start (of the randomly drawn tensors: the LayerNorms start at 1 and 0)."""
    first = _algo().shared_init
    again = _algo().shared_init
    other = prepare(validate_config({**TINY, "seed": 1, "algorithm": {"name": "gpfl"}})).shared_init
    assert first.keys() == again.keys() == other.keys() and len(first) >= 2
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert all(not torch.equal(first[k], other[k]) for k in (TABLE, "cov.gamma.0.weight", "cov.beta.0.weight"))


@pytest.mark.parametrize("mlg", ["sample", "batch"])
def test_mu_acts_as_the_authors_weight_decay_on_the_valve_and_the_embedding_only(mlg):
    """The authors' code applies μ as the weight decay of V's and C's SGD optimizers: a gradient of + μ·tensor, the
    gradient of (μ/2)‖·‖² (the paper's Eq. 11 writes μ‖·‖₂, not squared: the code is followed). So the objective's
    gradient with μ minus that without is μ·V and μ·C on those tensors and 0 on the body and head."""
    mu = 0.3
    grads = []
    for m in (mu, 0.0):
        algo = _algo(mu=m, mlg=mlg)
        server, state = algo.init_server(), algo.init_client(0)
        plan = algo.sgd_plan(server, state, algo.ctx.client_data(0))
        data = algo.ctx.client_data(0)
        x, y = data.x[data.train[:8]], data.y[data.train[:8]]
        params = {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in plan.start.items()}
        algo.ctx.model.train()
        loss = plan.objective(algo.ctx.model, params, plan.consts, x, y, None)
        trained = [k for k, v in params.items() if v.requires_grad]
        grads.append(dict(zip(trained, torch.autograd.grad(loss, [params[k] for k in trained]), strict=True)))
    decayed = [k for k in grads[0] if k.startswith(("cov.", "gce."))]
    assert decayed and len(decayed) < len(grads[0])
    for k in grads[0]:
        expected = mu * plan.start[k] if k in decayed else torch.zeros_like(plan.start[k])
        assert torch.allclose(grads[0][k] - grads[1][k], expected, atol=1e-6), k
