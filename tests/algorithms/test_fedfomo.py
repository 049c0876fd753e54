"""FedFomo (Zhang et al., ICLR 2021, §3): client i combines the models it downloads as
θ_i^t = θ_i^{t−1} + Σ_n w_n(θ_n − θ_i^{t−1}), w_n = max(L_i(θ_i^{t−1}) − L_i(θ_n), 0)/‖θ_n − θ_i^{t−1}‖ normalized to
sum 1 (all zero: it keeps its model), L_i on its *validation* data; then it trains locally. The server adds each
reply's weights to P[i, n] and sends client i the M models of highest P[i, ·], ε-greedily with a linearly decaying ε
drawn from (seed, round, client)."""

import math

import pytest
import torch
import torch.nn.functional as F

import pflbed
from pflbed.algorithms.base import Budget, ClientContext
from pflbed.algorithms.fedfomo import IDS, WEIGHTS, affinity_deltas, first_order_weights
from pflbed.algorithms.training import finetune_epochs, load_params, train_from
from pflbed.config import validate_config
from pflbed.engine.build import prepare
from pflbed.errors import ConfigError

from ..tiny import TINY

F64 = torch.float64


def _tree(fraction=0.5, federation=None, dataset=None, **options):
    tree = {**TINY, "train": {**TINY["train"], "momentum": 0.0},
            "federation": {**TINY["federation"], "sample_fraction": fraction, **(federation or {})},
            "algorithm": {"name": "fedfomo", **options}, "executor": {**TINY["executor"], "threads": 1}}  # fmt: skip
    if dataset:
        tree["dataset"] = dataset
    return tree


def _algo(**kw):
    return prepare(validate_config(_tree(**kw)))


def _shifted(params, key, index, by):
    """A copy of `params` with one entry of `key` moved by `by`: its distance to `params` is exactly |by|."""
    out = {k: v.clone() for k, v in params.items()}
    out[key][index] += by
    return out


def _fake_losses(algo, table):
    """Replace L_i by a table keyed on the parameter dict passed in (by identity)."""
    algo.loss = lambda params, x, y, sw: torch.tensor(table[id(params)], dtype=F64)


def _ce(algo, params, idx):
    """Mean cross-entropy of `params` on samples `idx`, eval mode, written out independently of the algorithm."""
    model, x, y = algo.ctx.model, algo.ctx.source.train.x[idx], algo.ctx.source.train.y[idx]
    load_params(model, params)
    model.eval()
    with torch.no_grad():
        return float(F.cross_entropy(model(x).double(), y))


def _by_hand(own_loss, losses, dists):
    raw = [max(own_loss - lo, 0.0) / d for lo, d in zip(losses, dists, strict=True)]
    total = sum(raw)
    return [r / total for r in raw] if total > 0 else [0.0] * len(raw)


def _dist(a, b, keys):
    return math.sqrt(sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in keys))


# --- the first-order update -------------------------------------------------------------------------------------
def test_three_clients_weights_are_clipped_gains_over_distance_normalized_and_combine_into_the_update():
    """Client 0 with three downloaded models: losses 1.0, 1.5, 2.5 against its own 2.0; distances 2, 0.5, 1.
    Raw weights (2 − 1)/2 = 0.5, (2 − 1.5)/0.5 = 1, (2 − 2.5)/1 = −0.5 → clipped 0.5, 1, 0 → normalized 1/3, 2/3, 0.
    θ^t = θ + (1/3)(θ_1 − θ) + (2/3)(θ_2 − θ): +2/3 on θ_1's entry, +1/3 on θ_2's, θ_3's untouched."""
    algo = _algo()
    own = algo.init_client(0)
    key = algo.param_keys[0]
    models = [_shifted(own, key, (0, 0), 2.0), _shifted(own, key, (0, 1), 0.5), _shifted(own, key, (0, 2), 1.0)]
    _fake_losses(algo, {id(own): 2.0, id(models[0]): 1.0, id(models[1]): 1.5, id(models[2]): 2.5})
    new, w, _ = algo.federated_update(own, models, algo.ctx.client_data(0))
    assert torch.allclose(w, torch.tensor([1 / 3, 2 / 3, 0.0], dtype=F64), atol=1e-12)
    expected = own[key].clone()
    expected[0, 0] += 2 / 3  # (1/3)·2
    expected[0, 1] += 1 / 3  # (2/3)·0.5
    assert torch.allclose(new[key], expected, atol=1e-6)
    assert all(torch.equal(new[k], own[k]) for k in own if k != key)
    assert float(first_order_weights(torch.tensor(2.0, dtype=F64), torch.tensor([1.0, 1.5, 2.5], dtype=F64),
                                     torch.tensor([2.0, 0.5, 1.0], dtype=F64)).sum()) == pytest.approx(1.0)  # fmt: skip


@pytest.mark.parametrize("norm", ["l2", "l1"])
def test_the_distance_is_euclidean_or_the_authors_l1_over_every_parameter(norm):
    """Two models that both lower the loss by 1: A moved by 1 in three entries (two of one tensor, one of another), B
    by 1.5 in one entry. Euclidean: ‖A‖ = √3, ‖B‖ = 1.5 → weights ∝ 1/√3, 1/1.5; L1: ‖A‖ = 3 → 1/3, 1/1.5."""
    algo = _algo(norm=norm)
    own = algo.init_client(0)
    first, last = algo.param_keys[0], algo.param_keys[-1]
    a = _shifted(_shifted(_shifted(own, first, (0, 0), 1.0), first, (0, 2), 1.0), last, (0,), -1.0)
    b = _shifted(own, first, (0, 1), 1.5)
    _fake_losses(algo, {id(own): 2.0, id(a): 1.0, id(b): 1.0})
    _, w, _ = algo.federated_update(own, [a, b], algo.ctx.client_data(0))
    raw = [1 / math.sqrt(3), 1 / 1.5] if norm == "l2" else [1 / 3, 1 / 1.5]
    assert torch.allclose(w, torch.tensor([r / sum(raw) for r in raw], dtype=F64), atol=1e-9)


def test_when_no_model_lowers_the_validation_loss_the_client_keeps_its_model():
    """All gains ≤ 0 (one candidate equal to θ itself: 0/0 counts as 0): every weight is 0, θ^t = θ bit for bit."""
    algo = _algo()
    own = algo.init_client(0)
    key = algo.param_keys[0]
    models = [_shifted(own, key, (0, 0), 1.0), _shifted(own, key, (0, 1), 3.0), {k: v.clone() for k, v in own.items()}]
    _fake_losses(algo, {id(own): 1.0, id(models[0]): 1.0, id(models[1]): 4.0, id(models[2]): 1.0})
    new, w, _ = algo.federated_update(own, models, algo.ctx.client_data(0))
    assert torch.equal(w, torch.zeros(3, dtype=F64))
    assert all(torch.equal(new[k], own[k]) for k in own)


def test_weights_are_measured_on_the_validation_split_with_real_losses():
    """Real models: trained on the data of clients 0 and 5 (they lower client 0's validation loss), of client 2 and
    wrecked by noise (they raise it: clipped to 0). The weights equal the rule applied to cross-entropies on the
    client's validation split computed here by hand, and differ from the same rule on its training split or its
    test split (so the check tells the splits apart)."""
    algo = _algo()
    own, data, t = algo.init_client(0), algo.ctx.client_data(0), algo.ctx.cfg.train
    models = [train_from(algo.ctx.model, own, algo.ctx.client_data(c), t, torch.Generator().manual_seed(c))
              for c in (0, 5, 2)]  # fmt: skip
    g = torch.Generator().manual_seed(9)
    models.append({k: v + 3.0 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
                   for k, v in own.items()})  # fmt: skip
    _, w, _ = algo.federated_update(own, models, data)

    dists = [_dist(m, own, algo.param_keys) for m in models]

    def rule(idx):
        return _by_hand(_ce(algo, own, idx), [_ce(algo, m, idx) for m in models], dists)

    on_val = rule(data.val)
    assert on_val[0] > 0 and on_val[1] > 0 and on_val[2] == on_val[3] == 0.0
    assert torch.allclose(w, torch.tensor(on_val, dtype=F64), atol=1e-9)
    for other in (data.train, algo.ctx.federation.clients[0].test):
        assert not torch.allclose(w, torch.tensor(rule(other), dtype=F64), atol=1e-4)


def test_client_update_is_the_federated_update_then_local_training():
    """The reply and the new state are train_from(θ^t) (local training after the federated update, the client's
    generator); the reply also carries the weights and the ids it was sent."""
    algo = _algo()
    server, t = algo.init_server(), algo.ctx.cfg.train
    server["last_upload"][:] = 1
    for c in algo.clients:  # every client uploaded a model trained once from θ^0 (some help client 0, some do not)
        trained = train_from(algo.ctx.model, algo.ctx.initial_params, algo.ctx.client_data(c), t,
                             torch.Generator().manual_seed(c))  # fmt: skip
        server.update({f"local/{c}/{k}": v for k, v in trained.items()})
    cid = algo.clients[0]
    payload = algo.configure(2, server, [cid])[cid]
    state, data = algo.init_client(cid), algo.ctx.client_data(cid)
    reply, new_state = algo.client_update(payload, state, data, ClientContext(2, cid, torch.Generator().manual_seed(7)))
    models = [algo.stored(server, int(n)) for n in payload[IDS]]
    start, w, _ = algo.federated_update(state, models, data)
    assert bool((w > 0).any()) and bool((w == 0).any())  # a real federated step, some models clipped
    expected = train_from(algo.ctx.model, start, data, algo.ctx.cfg.train, torch.Generator().manual_seed(7))
    assert all(torch.equal(reply[k], expected[k]) and torch.equal(new_state[k], expected[k]) for k in expected)
    assert torch.equal(reply[WEIGHTS], w) and torch.equal(reply[IDS], payload[IDS])
    assert set(new_state) == set(algo.ctx.initial_params)


# --- the server: affinity matrix and model sampling ---------------------------------------------------------------
def test_affinity_adds_each_replys_weights_at_its_own_row_and_the_received_columns():
    algo = _algo()
    server = algo.init_server()
    server["P"] += torch.arange(36, dtype=F64).reshape(6, 6) / 100  # asymmetric: P[i, n] ≠ P[n, i]
    params = algo.ctx.initial_params
    replies = {
        1: {**params, WEIGHTS: torch.tensor([0.25, 0.75], dtype=F64), IDS: torch.tensor([3, 0])},
        4: {**params, WEIGHTS: torch.tensor([1.0], dtype=F64), IDS: torch.tensor([1])},
        5: {**params, WEIGHTS: torch.zeros(0, dtype=F64), IDS: torch.zeros(0, dtype=torch.int64)},
    }
    out = algo.aggregate(3, server, replies, {1: 1.0, 4: 1.0, 5: 1.0})
    expected = server["P"].clone()
    expected[1, 3] += 0.25
    expected[1, 0] += 0.75
    expected[4, 1] += 1.0
    assert torch.equal(out["P"], expected)
    assert out["last_upload"].tolist() == [0, 3, 0, 0, 3, 3]
    assert all(torch.equal(out[f"local/{c}/{k}"], params[k]) for c in replies for k in params)
    assert "local/0/" + algo.keys[0] not in out


def _uploaded_server(algo, affinity_row0, uploaded=None):
    server = algo.init_server()
    for c in uploaded if uploaded is not None else algo.clients:
        server["last_upload"][algo.index[c]] = 1
        server.update({f"local/{c}/{k}": v for k, v in algo.ctx.initial_params.items()})
    server["P"][0] = torch.tensor(affinity_row0, dtype=F64)
    return server


def test_greedy_downloads_are_the_m_highest_affinities_of_uploaded_other_clients():
    """ε = 0: client 0 gets the M = 2 uploaded clients of highest P[0, ·], best first; never its own model, never
    a client that has not uploaded (client 5 has the highest affinity but no model yet). Round 1: nothing."""
    algo = _algo(M=2, epsilon=0.0)
    assert algo.configure(1, algo.init_server(), [0, 3])[0][IDS].numel() == 0
    server = _uploaded_server(algo, [9.0, 0.1, 0.7, 0.3, 0.5, 2.0], uploaded=[0, 1, 2, 3, 4])
    payload = algo.configure(4, server, [0, 2])[0]
    assert payload[IDS].tolist() == [2, 4]
    assert torch.equal(payload["m/0/" + algo.keys[0]], server["local/2/" + algo.keys[0]])
    assert algo.configure(4, server, [0])[0][IDS].tolist() == [2, 4]  # the other sampled clients do not matter


def _seeded(seed, **kw):
    return prepare(validate_config({**_tree(**kw), "seed": seed}))


def test_exploration_is_drawn_from_seed_round_and_client_and_decays_linearly_to_greedy():
    """ε_t = max(0, ε − δ(t − 1)). The picks depend on (seed, round, client) alone — not on torch's global RNG, the
    algorithm instance or the round's other clients; at ε = 1 they vary with the round and the seed; once ε has
    decayed to 0 they are the greedy ones."""
    row = [0.0, 0.1, 0.7, 0.3, 0.5, 0.2]  # greedy for client 0: 2, 4, 3, …
    algo = _algo(M=2, epsilon=1.0, epsilon_decay=0.25)
    assert [algo.epsilon(r) for r in (1, 2, 4, 5, 9)] == [1.0, 0.75, 0.25, 0.0, 0.0]
    server = _uploaded_server(algo, row)

    def picks(a, rnd, cids=(0,)):
        return tuple(a.configure(rnd, server, list(cids))[0][IDS].tolist())

    torch.manual_seed(1)
    first = picks(algo, 2)
    torch.manual_seed(2)
    assert picks(algo, 2) == first == picks(_algo(M=2, epsilon=1.0, epsilon_decay=0.25), 2, cids=(1, 0, 5))
    rounds = range(2, 12)
    explore = [picks(_algo(M=2, epsilon=1.0, epsilon_decay=0.0), r) for r in rounds]  # ε = 1 in every round
    assert len(set(explore)) > 2 and all(len(set(p)) == 2 and 0 not in p for p in explore)
    assert [picks(_seeded(7, M=2, epsilon=1.0, epsilon_decay=0.0), r) for r in rounds] != explore
    assert all(picks(algo, r) == (2, 4) for r in range(5, 15))  # ε decayed to 0: greedy


def test_each_download_slot_tosses_its_own_exploration_coin():
    """ε-greedy per slot: with ε = 0.5 each of the M = 2 slots explores or exploits on its own coin, so about half
    the draws mix the two (one slot the greedy pick, the other a random one), and about a quarter are greedy in
    both slots. One coin per client would make a draw all-greedy or all-random (mixed only when a random order
    happens to start with the top candidate: ≈ 5 % of draws; all-greedy ≈ 50 %)."""
    algo = _algo(M=2, epsilon=0.5, epsilon_decay=0.0)
    candidates = list(range(100, 120))
    affinity = [float(20 - j) for j in range(20)]  # greedy order: 100, 101, …
    picks = [algo.choose(r, c, candidates, affinity) for r in range(1, 41) for c in range(5)]
    greedy = [(p[0] == 100, p[1] == (101 if p[0] == 100 else 100)) for p in picks]
    mixed = sum(a != b for a, b in greedy) / len(picks)
    both = sum(a and b for a, b in greedy) / len(picks)
    assert 0.35 < mixed < 0.65 and 0.15 < both < 0.4


# --- validation data, new clients, a whole run ----------------------------------------------------------------
def test_a_client_without_validation_data_uses_its_domain_set_weighted_by_its_prior_else_its_training_split():
    algo = _algo(federation={"val_fraction": 0.0})
    data = algo.ctx.client_data(0)
    assert data.val.numel() == 0
    x, y, sw = algo.validation(data)
    assert torch.equal(x, data.x[data.train]) and torch.equal(y, data.y[data.train]) and sw is None

    split = {"clients_per_domain": 2, "new_clients_per_domain": 0}
    tree = _tree(dataset={"name": "digits-rot4"}, federation={"protocol": "pflbed", "pflbed": split})
    del tree["federation"]["clients"]  # the protocol's clients are its clients_per_domain
    algo = prepare(validate_config(tree))
    fed, data = algo.ctx.federation, algo.ctx.client_data(3)
    assert data.val.numel() == 0
    idx = fed.domain_val[fed.clients[3].domain]
    x, y, sw = algo.validation(data)
    assert torch.equal(x, data.x[idx]) and torch.equal(y, data.y[idx])
    assert torch.equal(sw, data.prior.double()[data.y[idx]])


def test_new_clients_start_from_one_first_order_update_of_the_initial_model_over_all_stored_models():
    new_clients = {"epochs": 1, "lrs": [0.05], "fractions": [1.0]}
    res = pflbed.run({**_tree(fraction=1.0, federation={"new_clients": 1}), "train": {**TINY["train"], "rounds": 2},
                      "eval": {"every": 2, "finetune": [], "new_clients": new_clients}}, write=False)  # fmt: skip
    algo, server = res.executor.algo, res.server
    new = algo.ctx.federation.new[0]
    data = algo.ctx.client_data(new)
    theta0 = algo.ctx.initial_params
    models = [algo.stored(server, c) for c in algo.clients]
    x, y, sw = algo.validation(data)
    assert sw is None and torch.equal(x, data.x[data.val])
    w = _by_hand(_ce(algo, theta0, data.val), [_ce(algo, m, data.val) for m in models],
                 [_dist(m, theta0, algo.param_keys) for m in models])  # fmt: skip
    assert sum(w) == pytest.approx(1.0)  # trained models beat the random initial one
    expected = {k: v + sum(wn * (m[k] - v) for wn, m in zip(w, models, strict=True)) if v.is_floating_point() else v
                for k, v in theta0.items()}  # fmt: skip
    zero = algo.zero_shot(server, data).params
    assert all(torch.allclose(zero[k], expected[k], atol=1e-5) for k in expected)
    budget = Budget("ft", 1, 0.05, 16)
    got = next(iter(algo.personalize(server, data, budget, torch.Generator().manual_seed(1)))).params
    ref = next(iter(finetune_epochs(algo.ctx.model, zero, data, budget, torch.Generator().manual_seed(1)))).params
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    assert res.summary["new_clients"]["zero_shot"] is not None


def test_a_strict_run_has_personal_models_no_global_model_and_affinity_rows_of_whole_replies():
    """Each reply's weights sum to 1 (or 0), so P's rows are whole numbers, at most the client's rounds after the
    first. IID clients: other models do lower a client's validation loss now and then (P is not all zero; under
    this config's Dirichlet labels they never do, and FedFomo stays Local)."""
    tree = _tree(fraction=1.0, federation={"partition": "iid"})
    res = pflbed.run({**tree, "eval": {**tree["eval"], "finetune": ["ft", "lp"]}}, write=False)
    f = res.summary["final"]
    assert f["gfl_acc"] is None and f["pfl_acc"] is not None
    assert "ft" not in f and "lp" not in f  # no generic model: `eval.finetune` does not run
    P = res.server["P"]
    assert (P >= 0).all() and float(P.sum()) > 0
    rows = P.sum(1)
    assert torch.allclose(rows, rows.round(), atol=1e-9) and (rows <= res.summary["rounds"] - 1).all()
    assert torch.equal(P.diagonal(), torch.zeros(6, dtype=F64))
    assert res.history[-1]["diag"]["federated_updates"] == pytest.approx(float(P.sum()))
    algo = res.executor.algo
    for c in algo.clients:  # the server's copy of each client's model is the client's personal model
        state = res.executor.state(c)
        assert all(torch.equal(res.server[f"local/{c}/{k}"], state[k]) for k in algo.keys)


def test_first_order_weights_at_the_edges_zero_distance_nan_loss_infinite_gain():
    """The docstring's edge cases: a zero distance gives 0 even with a gain; a NaN loss gives 0; an infinite gain
    (a subnormal distance) takes all the weight, shared equally if several are infinite."""
    w = first_order_weights(torch.tensor(1.0, dtype=F64), torch.tensor([0.5, 0.5], dtype=F64),
                            torch.tensor([0.0, 1.0], dtype=F64))  # fmt: skip
    assert w.tolist() == [0.0, 1.0]
    w = first_order_weights(torch.tensor(1.0, dtype=F64), torch.tensor([float("nan"), 0.5], dtype=F64),
                            torch.tensor([1.0, 1.0], dtype=F64))  # fmt: skip
    assert w.tolist() == [0.0, 1.0]
    w = first_order_weights(torch.tensor(1.0, dtype=F64), torch.tensor([0.5, 0.0, 0.2, 2.0], dtype=F64),
                            torch.tensor([1e-320, 1.0, 1e-320, 1.0], dtype=F64))  # fmt: skip
    assert w.tolist() == [0.5, 0.0, 0.5, 0.0]


def test_picks_differ_between_clients_and_ties_break_from_the_seed_not_torchs_global_rng():
    """Two clients choosing among the same candidates draw from their own (seed, round, client) streams: their
    explored orders differ. With every affinity tied (round 2 of a run: P is zero), the greedy order is the
    seeded random tie-break — the same under any state of torch's global RNG, and not one order for all."""
    algo = _algo(M=4, epsilon=1.0, epsilon_decay=0.0)
    candidates, flat = list(range(10, 20)), [0.0] * 10
    assert algo.choose(3, 0, candidates, flat) != algo.choose(3, 1, candidates, flat)
    greedy = _algo(M=4, epsilon=0.0)
    torch.manual_seed(1)
    first = [greedy.choose(2, c, candidates, flat) for c in range(4)]
    torch.manual_seed(2)
    assert [greedy.choose(2, c, candidates, flat) for c in range(4)] == first
    assert len({tuple(p) for p in first}) > 1


def test_diagnostics_count_federated_updates_and_partners():
    """P's sum (each federated update adds 1) and the mean number of clients each row has ever taken in."""
    algo = _algo()
    server = algo.init_server()
    server["P"][0, 1], server["P"][0, 2], server["P"][3, 1] = 0.25, 0.75, 1.0
    d = algo.diagnostics(5, server, lambda c: {})
    assert d == {"federated_updates": 2.0, "partners_per_client": pytest.approx(3 / 6)}


def test_the_validation_loss_weighs_each_sample_by_the_clients_prior_of_its_class():
    """L_i on a shared (domain) validation set: Σ_b w_{y_b}·CE_b / Σ_b w_{y_b}, in eval mode and float64; plain
    mean without weights."""
    algo = _algo()
    data = algo.ctx.client_data(0)
    x, y = data.x[data.train], data.y[data.train]
    params = algo.ctx.initial_params
    model = algo.ctx.model
    load_params(model, params)
    model.eval()
    with torch.no_grad():
        ce = F.cross_entropy(model(x).double(), y, reduction="none")
    prior = torch.linspace(0.1, 1.0, algo.ctx.source.num_classes, dtype=F64)
    sw = prior[y]
    assert float(algo.loss(params, x, y, sw)) == pytest.approx(float((sw * ce).sum() / sw.sum()), rel=1e-12)
    assert float(algo.loss(params, x, y, None)) == pytest.approx(float(ce.mean()), rel=1e-12)
    assert abs(float((sw * ce).sum() / sw.sum()) - float(ce.mean())) > 1e-4  # the weights matter here


def test_the_federated_update_measures_every_loss_with_the_validation_weights():
    """The own model's loss and each candidate's are measured on the same (x, y) with the same per-sample
    weights `validation` returns (a domain-set client's prior)."""
    algo = _algo()
    data = algo.ctx.client_data(0)
    x, y = data.x[data.train], data.y[data.train]
    sw = torch.linspace(0.5, 1.5, len(y), dtype=F64)
    algo.validation = lambda d: (x, y, sw)
    seen = []
    real = algo.loss
    algo.loss = lambda params, xx, yy, w: seen.append(w) or real(params, xx, yy, w)
    own = algo.ctx.initial_params
    models = [_shifted(own, algo.keys[0], 0, 0.5), _shifted(own, algo.keys[0], 1, -0.5)]
    algo.federated_update(own, models, data)
    assert len(seen) == 3 and all(w is sw for w in seen)


# --- the authors' rules as options: signed affinity, the latest round's pool ----------------------------------------
def test_the_authors_affinity_adds_signed_gains_over_the_absolute_sum():
    """δ / |Σδ|: 0.5, 1, −0.5 (sum 1) stay; 1, −3 (sum −2) → 0.5, −1.5; a zero sum is raised by 1e-9; infinite
    gains take the whole increment with their sign; an all-zero row adds nothing."""

    def f(*g):
        return affinity_deltas(torch.tensor(g, dtype=F64)).tolist()

    assert f(0.5, 1.0, -0.5) == [0.5, 1.0, -0.5]
    assert f(1.0, -3.0) == [0.5, -1.5]
    assert f(2e-10, -1e-10) == pytest.approx([2e-10 / 1.1e-9, -1e-10 / 1.1e-9], rel=1e-12)
    assert f(1.0, -1.0) == pytest.approx([1e9, -1e9], rel=1e-12)
    assert f(float("inf"), 1.0, float("-inf"), float("inf")) == [1 / 3, 0.0, -1 / 3, 1 / 3]
    assert f(0.0, 0.0) == [0.0, 0.0]


def _three_candidates(algo):
    """The three-model example above for client 0, as clients 1, 2, 3 (gains 0.5, 1, −0.5); client 4 received only
    a harmful model (gain −2), client 5 nothing. Each reply comes from `client_update` (which normalizes the gains
    under `deltas`), then one aggregation."""
    own = algo.init_client(0)
    key = algo.param_keys[0]
    models = [_shifted(own, key, (0, 0), 2.0), _shifted(own, key, (0, 1), 0.5), _shifted(own, key, (0, 2), 1.0)]
    _fake_losses(algo, {id(own): 2.0, id(models[0]): 1.0, id(models[1]): 1.5, id(models[2]): 2.5})
    _, w, gains = algo.federated_update(own, models, algo.ctx.client_data(0))
    measured = {0: ([1, 2, 3], w, gains), 4: ([3], torch.zeros(1, dtype=F64), torch.tensor([-2.0], dtype=F64)),
                5: ([], torch.zeros(0, dtype=F64), torch.zeros(0, dtype=F64))}  # fmt: skip
    replies = {}
    for c, (ids, wc, gc) in measured.items():
        algo.federated_update = lambda own, models, data, wc=wc, gc=gc: (dict(own), wc, gc)
        payload = {IDS: torch.tensor(ids, dtype=torch.int64),
                   **{f"m/{s}/{k}": v for s in range(len(ids)) for k, v in own.items()}}  # fmt: skip
        cctx = ClientContext(2, c, torch.Generator().manual_seed(c))
        replies[c], _ = algo.client_update(payload, own, algo.ctx.client_data(c), cctx)
    server = _uploaded_server(algo, [0.0] * 6)
    return algo.aggregate(2, server, replies, dict.fromkeys(replies, 1.0)), gains


@pytest.mark.parametrize("rule", ["weights", "deltas"])
def test_a_harmful_model_ranks_below_never_tried_ones_only_under_the_authors_affinity(rule):
    """`weights`: P[0, ·] += w = 1/3, 2/3, 0 — the model that raised the loss ties with the never-tried clients 4
    and 5. `deltas`: P[0, ·] += δ/|Σδ| = 0.5, 1, −0.5 — it ranks last in every greedy draw. The update itself
    uses the clipped weights under both."""
    algo = _algo(M=5, epsilon=0.0, affinity=rule)
    out, gains = _three_candidates(algo)
    assert torch.allclose(gains, torch.tensor([0.5, 1.0, -0.5], dtype=F64), atol=1e-12)
    added = [0.5, 1.0, -0.5] if rule == "deltas" else [1 / 3, 2 / 3, 0.0]
    assert torch.allclose(out["P"][0, 1:4], torch.tensor(added, dtype=F64), atol=1e-12)
    assert out["P"][4, 3] == (-1.0 if rule == "deltas" else 0.0)  # −2 / |−2|
    assert float(out["P"].abs().sum() - out["P"][0].abs().sum() - out["P"][4, 3].abs()) == 0.0
    lasts = {algo.configure(r, out, [0])[0][IDS].tolist()[-1] for r in range(2, 12)}
    assert lasts == {3} if rule == "deltas" else lasts != {3}
    if rule == "deltas":
        assert out["updates"].tolist() == [1, 0, 0, 0, 0, 0]
        assert algo.diagnostics(2, out, lambda c: {})["federated_updates"] == 1.0
        reply = {**algo.init_client(0), WEIGHTS: torch.tensor([1.0], dtype=F64), IDS: torch.tensor([2]),
                 "fomo/gain": torch.tensor([1.0], dtype=F64)}  # fmt: skip
        again = algo.aggregate(3, out, {0: reply}, {0: 1.0})  # a later round counts on
        assert again["updates"].tolist() == [2, 0, 0, 0, 0, 0] and float(again["P"][0, 2]) == pytest.approx(2.0)
    else:
        assert "updates" not in out


def test_the_authors_pool_is_the_latest_rounds_uploaders():
    """`candidates: last_round`: client 0 downloads only from the clients whose last upload is the latest round's
    (2, 3, 5 uploaded in round 3; 1 and 4 earlier); `uploaded` (default): from all five. Nobody uploaded: none.
    New clients draw on the same pool."""
    pools = {}
    for pool in ("uploaded", "last_round"):
        algo = _algo(M=5, epsilon=0.0, candidates=pool)
        assert algo.configure(1, algo.init_server(), [0])[0][IDS].numel() == 0
        server = _uploaded_server(algo, [0.0] * 6)
        server["last_upload"] = torch.tensor([0, 2, 3, 3, 1, 3])
        pools[pool] = sorted(algo.configure(4, server, [0])[0][IDS].tolist())
        seen = []
        algo.federated_update = lambda own, models, data, seen=seen: seen.append(len(models)) or (own, None, None)
        algo.zero_shot(server, algo.ctx.client_data(0))
        assert seen == [len(pools[pool])]  # client 0 has no stored model: like a new client, it draws on the pool
    assert pools == {"uploaded": [1, 2, 3, 4, 5], "last_round": [2, 3, 5]}
    algo = _algo(candidates="last_round")
    server = _uploaded_server(algo, [0.0] * 6)
    server["last_upload"] = torch.tensor([0, 1, 0, 1, 0, 0])  # after round 1
    assert algo.pool(server) == [1, 3]


def test_called_with_an_uploaded_clients_data_the_start_is_its_own_stored_model():
    """The path the engine never takes (`eval.finetune` does not run without a generic model), as documented:
    θ_prev is the client's stored model, the candidates the other stored models."""
    algo = _algo()
    server = _uploaded_server(algo, [0.0] * 6)
    key = algo.param_keys[0]
    server[f"local/2/{key}"] = server[f"local/2/{key}"] + 1.0
    seen = []
    algo.federated_update = lambda own, models, data: seen.append((own, len(models))) or (own, None, None)
    algo.zero_shot(server, algo.ctx.client_data(2))
    (own, n), = seen
    assert n == 5 and all(torch.equal(own[k], server[f"local/2/{k}"]) for k in algo.keys)


@pytest.mark.parametrize("key, value", [("affinity", "signed"), ("candidates", "latest"), ("norm", "l3")])
def test_an_unknown_rule_is_a_config_error(key, value):
    with pytest.raises(ConfigError, match=f"algorithm.{key}"):
        validate_config(_tree(**{key: value}))


def test_a_strict_run_with_the_authors_rules():
    """Both options together through the engine: P holds signed entries, the counter the federated updates."""
    res = pflbed.run(_tree(fraction=0.5, federation={"partition": "iid"}, affinity="deltas",
                           candidates="last_round"), write=False)  # fmt: skip
    assert res.summary["final"]["pfl_acc"] is not None
    assert res.history[-1]["diag"]["federated_updates"] == float(res.server["updates"].sum())
    assert float(res.server["P"].abs().sum()) > 0


def test_a_site_takes_only_up_to_m_distinct_other_clients_of_the_run_as_the_models_sent():
    """`payload_fits`: `fomo/ids` names up to M distinct participated clients other than the one trained, with one
    model `m/<s>/` per id; the generic structure check cannot see these values (`test_payload_fits.py`)."""
    algo = _algo(M=2, epsilon=0.0)
    server = _uploaded_server(algo, [9.0, 0.1, 0.7, 0.3, 0.5, 2.0], uploaded=[0, 1, 2, 3, 4])
    payload = algo.configure(4, server, [0])[0]
    assert payload[IDS].tolist() == [2, 4] and algo.payload_fits(4, 0, payload, {}) is None
    assert algo.payload_fits(1, 0, algo.configure(1, algo.init_server(), [0])[0], {}) is None  # none yet

    def ids(*chosen):
        return {**payload, IDS: torch.tensor(chosen, dtype=torch.int64)}

    why = "has 'fomo/ids' {}: not up to M = 2 distinct other clients of the run"
    for chosen in [(2, 2), (0, 4), (2, 99), (2, -1)]:
        assert algo.payload_fits(4, 0, ids(*chosen), {}) == why.format(list(chosen)), chosen
    assert algo.payload_fits(4, 0, ids(2, 4, 3), {}) == why.format([2, 4, 3])
    three = {**ids(2, 4, 3), **{f"m/2/{k}": v for k, v in algo.ctx.initial_params.items()}}
    assert algo.payload_fits(4, 0, three, {}) == why.format([2, 4, 3])  # more than M, whatever comes with them
    extra = f"m/1/{sorted(algo.keys)[0]}"
    assert algo.payload_fits(4, 0, ids(2), {}) == f"has key '{extra}', which this algorithm's server does not send"
    assert algo.payload_fits(4, 0, {**payload, IDS: payload[IDS].float()}, {}) == (
        "has 'fomo/ids' of shape [2] and dtype torch.float32, expected one dimension of int64")
    assert algo.payload_fits(4, 0, {k: v for k, v in payload.items() if k != IDS}, {}) == "lacks 'fomo/ids'"
    algo = _algo(M=9)  # every other client of the run at once; the line shows the first eight ids
    others = [c for c in algo.clients if c != 0]
    every = {IDS: torch.tensor(others, dtype=torch.int64),
             **{f"m/{s}/{k}": v for s in range(len(others)) for k, v in algo.ctx.initial_params.items()}}  # fmt: skip
    assert algo.payload_fits(4, 0, every, {}) is None
    assert algo.payload_fits(4, 0, ids(*range(1, 11)), {}) == ("has 'fomo/ids' [1, 2, 3, 4, 5, 6, 7, 8]: not up to "
                                                               "M = 9 distinct other clients of the run")  # fmt: skip
