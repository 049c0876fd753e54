"""FedAMP (Huang et al., AAAI 2021, arXiv 2007.03797): the server sends client i its personalized cloud model
u_i = Σ_j ξ_ij w_j with ξ_ij = α_k·A'(‖w_i − w_j‖²) = α_k·exp(−‖w_i − w_j‖²/σ)/σ (j ≠ i) and ξ_ii = 1 − Σ_{j≠i} ξ_ij,
over the stored models of the clients that have uploaded plus i's own (w^0 before its first upload); the client
takes SGD steps on F_i(w) + λ/(2α_k)·‖w − u_i‖² (μ = λ/α_k) from u_i and its reply replaces its stored model. A
self weight that can turn negative is an error, never clipped. HeurFedAMP: ξ_ii fixed, the rest a softmax of
σ·cos(w_i, w_j). The expected numbers below are written out from these formulas, not taken from the code."""

import math

import pytest
import torch
import torch.nn.functional as F

import pflbed
from pflbed.algorithms.base import Budget, ClientContext
from pflbed.algorithms.fedamp import cosine, heur_row
from pflbed.algorithms.training import finetune_epochs, index_batches, load_params, weighted_mean
from pflbed.config import validate_config
from pflbed.engine.build import prepare
from pflbed.engine.executor import update_client
from pflbed.errors import ConfigError
from pflbed.federation import sample_clients

from ..tiny import TINY, same_tensors


def _algo(model="mlp", epochs=1, **options):
    """FedAMP on TINY: 6 participated clients (ids 0–5), plain SGD."""
    train = {**TINY["train"], "momentum": 0.0, "local_epochs": epochs}
    algorithm = {"name": "fedamp", **options}
    return prepare(validate_config({**TINY, "model": {"name": model}, "train": train, "algorithm": algorithm,
                                    "executor": {"threads": 1}}))  # fmt: skip


def _shifted(algo, first=0.0, last=0.0, base=None):
    """A model equal to `base` (default w^0) but for entry 0 of the first parameter tensor (+first) and entry 0 of
    the last one (+last): distances between such models are written out by hand."""
    w = {k: v.clone() for k, v in (base or algo.ctx.initial_params).items()}
    w[algo.params[0]].view(-1)[0] += first
    w[algo.params[-1]].view(-1)[0] += last
    return w


def _entries(w, algo):
    """(entry 0 of the first parameter tensor, entry 0 of the last one) of model `w`."""
    return float(w[algo.params[0]].view(-1)[0]), float(w[algo.params[-1]].view(-1)[0])


def _rest_is(w, ref, algo):
    """Every other entry of `w` equals `ref`'s (up to float32 mixing)."""
    masked = {k: v.clone() for k, v in w.items()}
    for k in (algo.params[0], algo.params[-1]):
        masked[k].view(-1)[0] = ref[k].view(-1)[0]
    return all(torch.allclose(masked[k], ref[k], atol=1e-6) for k in ref)


def _stored(algo, models):
    """The server state after the clients in `models` uploaded them."""
    return algo.aggregate(1, algo.init_server(), models, {c: 1.0 for c in models})


def test_amp_weights_and_cloud_models_match_a_hand_computed_three_client_example():
    """w_0 = w^0, w_1 = w^0 + 1 (first tensor), w_2 = w^0 + 2 (last tensor): squared distances d01 = 1, d02 = 4,
    d12 = 1 + 4 = 5 — the distance is squared and runs over all parameter tensors together. α_k = 0.3, σ = 2."""
    algo = _algo(alpha_k=0.3, sigma=2.0)
    w0 = algo.ctx.initial_params
    server = _stored(algo, {0: _shifted(algo), 1: _shifted(algo, first=1.0), 2: _shifted(algo, last=2.0)})
    u = algo.configure(2, server, [0, 1, 2])

    xi = lambda d: 0.3 * math.exp(-d / 2.0) / 2.0  # noqa: E731  α_k·A'(d)
    x01, x02, x12 = xi(1.0), xi(4.0), xi(5.0)
    a, b = _entries(w0, algo)
    expected = {
        0: (a + x01 * 1.0, b + x02 * 2.0),  # ξ00·w0 + ξ01·w1 + ξ02·w2
        1: (a + (1 - x01 - x12) * 1.0, b + x12 * 2.0),  # own shift weighted by ξ11 = 1 − ξ10 − ξ12
        2: (a + x12 * 1.0, b + (1 - x02 - x12) * 2.0),
    }
    for c, (first, last) in expected.items():
        got = _entries(u[c], algo)
        assert got == pytest.approx((first, last), abs=1e-6), c
        assert _rest_is(u[c], w0, algo)


def test_heur_weights_are_a_fixed_self_weight_and_a_cosine_softmax_of_the_others():
    """Models zero but for two entries: w_0 = (1, 0), w_1 = (1, 1), w_2 = (0, 1), so cos01 = cos12 = 1/√2, cos02 = 0.
    ξ_ii = 0.4, σ = 3: client 1 sees both others alike (0.3 each); clients 0 and 2 favour client 1."""
    algo = _algo(variant="heur", self_weight=0.4, heur_sigma=3.0)
    zero = {k: torch.zeros_like(v) for k, v in algo.ctx.initial_params.items()}
    server = _stored(algo, {0: _shifted(algo, first=1.0, base=zero), 1: _shifted(algo, 1.0, 1.0, base=zero),
                            2: _shifted(algo, last=1.0, base=zero)})  # fmt: skip
    u = algo.configure(2, server, [0, 1, 2])

    e = math.exp(3.0 / math.sqrt(2.0))
    near, far = 0.6 * e / (e + 1.0), 0.6 / (e + 1.0)  # (1 − ξ_ii)·softmax over the two others
    assert _entries(u[0], algo) == pytest.approx((0.4 + near, near + far), abs=1e-6)  # 0.4·w0 + near·w1 + far·w2
    assert _entries(u[1], algo) == pytest.approx((0.4 + 0.3, 0.4 + 0.3), abs=1e-6)
    assert _entries(u[2], algo) == pytest.approx((far + near, 0.4 + near), abs=1e-6)
    assert _rest_is(u[1], zero, algo)


def test_cosine_is_over_all_keys_flattened_together_and_zero_for_a_zero_model():
    g = torch.Generator().manual_seed(0)
    a = {"x": torch.randn(3, 4, generator=g), "y": torch.randn(5, generator=g), "z": torch.randn(2, generator=g)}
    b = {k: torch.randn(v.shape, generator=g) for k, v in a.items()}
    flat = lambda t: torch.cat([t["x"].flatten(), t["y"]]).double()  # noqa: E731 - "z" left out
    assert cosine(a, b, ["x", "y"]) == pytest.approx(float(F.cosine_similarity(flat(a), flat(b), dim=0)), abs=1e-12)
    zero = {k: torch.zeros_like(v) for k, v in a.items()}
    assert cosine(zero, b, ["x", "y"]) == 0.0 and cosine(a, zero, ["x", "y"]) == 0.0


def test_heur_row_alone_keeps_its_model_and_a_tiny_sigma_does_not_overflow():
    """Alone in the pool, ξ_ii = 1. σ·cos up to 10⁴ (HeurFedAMP's σ is a temperature the user may push): the
    softmax is shifted by its maximum, so the row stays finite and sums to 1."""
    assert heur_row(3, {3: 1.0}, 5.0, 0.3) == {3: 1.0}
    row = heur_row(0, {0: 1.0, 1: 1.0, 2: 0.999}, 1e4, 0.3)
    assert math.fsum(row.values()) == pytest.approx(1.0) and row[0] == 0.3
    assert row[1] == pytest.approx(0.7 / (1 + math.exp(-10.0))) and row[2] == pytest.approx(0.7 - row[1])


def test_client_update_is_sgd_on_the_proximal_objective_with_strength_lam_over_alpha_k_from_and_at_u():
    """The reply equals SGD written out by hand on CE + μ/2·‖w − u‖² with μ = λ/α_k = 0.3/0.6 = 0.5 (not λ·α_k =
    0.18, not the paper's coefficient λ/(2α_k) = 0.25 passed as μ), starting from u and anchored at u, where u is
    not w^0; two epochs, so the pull acts. The client's state (its id) comes back unchanged."""
    lam, alpha = 0.3, 0.6
    algo = _algo(epochs=2, lam=lam, alpha_k=alpha, sigma=10.0)
    g = torch.Generator().manual_seed(1)
    u = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in algo.ctx.initial_params.items()}
    data, state = algo.ctx.client_data(3), algo.init_client(3)
    reply, new_state = algo.client_update(u, state, data, ClientContext(2, 3, torch.Generator().manual_seed(7)))

    model, t = algo.ctx.model, algo.ctx.cfg.train
    model.train()
    params = dict(model.named_parameters())
    w = {k: u[k].clone() for k in params}
    for b in index_batches(data.train, t.batch_size, 2, torch.Generator().manual_seed(7)):
        load_params(model, w)
        grads = torch.autograd.grad(F.cross_entropy(model(data.x[b]), data.y[b]), list(params.values()))
        w = {k: w[k] - t.lr * (g + lam / alpha * (w[k] - u[k])) for (k, g) in zip(params, grads, strict=True)}
    assert all(torch.allclose(reply[k], w[k], atol=1e-6) for k in params)
    assert same_tensors(new_state, state) and int(new_state["cid"]) == 3


def test_a_reply_replaces_its_clients_stored_model_and_the_others_keep_theirs():
    algo = _algo()
    old0, old1 = _shifted(algo, first=1.0), _shifted(algo, last=1.0)
    server = _stored(algo, {0: old0, 1: old1})
    new1, new2 = _shifted(algo, first=3.0), _shifted(algo, first=4.0)
    out = algo.aggregate(2, server, {1: new1, 2: new2}, {1: 1.0, 2: 1.0})
    assert algo.uploaded(out) == [0, 1, 2]
    assert same_tensors(algo.stored(out, 0), old0)
    assert same_tensors(algo.stored(out, 1), new1) and same_tensors(algo.stored(out, 2), new2)
    assert algo.stored(out, 3) is algo.ctx.initial_params  # never uploaded: w^0
    for c, want in ((1, new1), (3, algo.ctx.initial_params)):  # P-FL scores the stored model
        assert same_tensors(algo.personal_model(out, algo.init_client(c)).params, want)
    assert algo.generic_model(out) is None  # no global model: G-FL is null


def test_only_clients_that_uploaded_and_the_client_itself_enter_its_cloud_model():
    """Clients 0 (w^0 + 1, first tensor) and 1 (w^0 + 2, last tensor) have uploaded, 2–5 never did. u_0 mixes 0 and
    1 only (d01 = 1 + 4); client 2's own model is w^0 (d20 = 1, d21 = 4), and it takes part in u_2 alone of the
    never-trained ones. α_k = 0.3, σ = 2."""
    algo = _algo(alpha_k=0.3, sigma=2.0)
    w0 = algo.ctx.initial_params
    server = _stored(algo, {0: _shifted(algo, first=1.0), 1: _shifted(algo, last=2.0)})
    u = algo.configure(3, server, [0, 2])
    xi = lambda d: 0.3 * math.exp(-d / 2.0) / 2.0  # noqa: E731
    a, b = _entries(w0, algo)
    assert _entries(u[0], algo) == pytest.approx((a + (1 - xi(5.0)) * 1.0, b + xi(5.0) * 2.0), abs=1e-6)
    assert _entries(u[2], algo) == pytest.approx((a + xi(1.0) * 1.0, b + xi(4.0) * 2.0), abs=1e-6)
    assert _rest_is(u[0], w0, algo) and _rest_is(u[2], w0, algo)


@pytest.mark.parametrize("variant", ["amp", "heur"])
def test_first_round_sends_the_initial_model_to_every_client(variant):
    """Nobody has uploaded: each pool is the client's own w^0, so u_i is w^0 bit for bit."""
    algo = _algo(variant=variant)
    payloads = algo.configure(1, algo.init_server(), [0, 1, 2, 3, 4, 5])
    assert all(same_tensors(p, algo.ctx.initial_params) for p in payloads.values())


def test_alpha_k_too_large_for_sigma_and_the_clients_is_refused_before_the_run():
    """A' ≤ 1/σ, so α_k·(N − 1)/σ ≤ 1 keeps every ξ_ii ≥ 0: 0.2·5/1 = 1 is accepted (the boundary), 0.21·5 is refused
    with a one-line error naming the options; HeurFedAMP's weights are always valid."""
    _algo(alpha_k=0.2, sigma=1.0)
    with pytest.raises(ConfigError) as err:
        _algo(alpha_k=0.21, sigma=1.0)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("algorithm.alpha_k")
    assert all(name in msg for name in ("algorithm.sigma", "algorithm.weight_check=each_round", "variant=heur"))
    assert "alpha_k·(N − 1)/sigma = 0.21·5/1 = 1.05 > 1 with N = 6 participated clients" in msg
    _algo(alpha_k=0.21, sigma=1.0, variant="heur")
    _algo(alpha_k=0.21, sigma=1.0, weight_check="each_round")


def test_at_the_bound_identical_models_give_a_zero_self_weight_not_an_error():
    """α_k·(N − 1)/σ = 1 and six identical uploads: Σ_{j≠i} ξ_ij = 5·0.2 = 1 exactly, ξ_ii = 0."""
    algo = _algo(alpha_k=0.2, sigma=1.0)
    w = _shifted(algo, first=1.0)
    server = _stored(algo, {c: w for c in range(6)})
    models = {c: algo.stored(server, c) for c in range(6)}
    row = algo.weights(2, 0, models)
    assert row[0] == 0.0 and all(row[j] == pytest.approx(0.2, abs=1e-15) for j in range(1, 6))


def test_a_negative_self_weight_in_a_round_is_an_error_not_clipped():
    """weight_check=each_round, α_k = σ = 1: three models at squared distance 0.01 give Σ_{j≠i} ξ_ij ≈ 2·0.99 > 1 —
    the round stops with an error naming the fixes; the same models far apart (d ≥ 25) are fine."""
    algo = _algo(alpha_k=1.0, sigma=1.0, weight_check="each_round")
    close = _stored(algo, {0: _shifted(algo), 1: _shifted(algo, first=0.1), 2: _shifted(algo, last=0.1)})
    with pytest.raises(ConfigError) as err:
        algo.configure(4, close, [0])
    msg = str(err.value)
    assert "\n" not in msg and "round 4, client 0" in msg and "negative" in msg
    assert all(name in msg for name in ("algorithm.alpha_k", "algorithm.sigma", "variant=heur"))
    far = _stored(algo, {0: _shifted(algo), 1: _shifted(algo, first=5.0), 2: _shifted(algo, last=5.0)})
    models = {c: algo.stored(far, c) for c in (0, 1, 2)}
    row = algo.weights(4, 0, models)
    assert row[1] == pytest.approx(math.exp(-25.0)) and row[0] == pytest.approx(1 - 2 * math.exp(-25.0))


def test_sigma_to_zero_keeps_each_model_and_sigma_to_infinity_weighs_all_others_alike():
    """σ → 0 (α_k/σ fixed at 0.1): every A'(d > 0) underflows, u_i = w_i bit for bit (no message passing).
    σ → ∞ with α_k/σ = 0.2: ξ_ij → 0.2 for every other client whatever the distance (no attention left), ξ_ii = 0.6."""
    models = lambda algo: {0: _shifted(algo), 1: _shifted(algo, first=1.0), 2: _shifted(algo, last=2.0)}  # noqa: E731
    algo = _algo(alpha_k=1e-9, sigma=1e-8)
    server = _stored(algo, models(algo))
    u = algo.configure(2, server, [0, 1, 2])
    assert all(same_tensors(u[c], algo.stored(server, c)) for c in (0, 1, 2))

    algo = _algo(alpha_k=2e11, sigma=1e12)
    server = _stored(algo, models(algo))
    u = algo.configure(2, server, [0, 1, 2])
    a, b = _entries(algo.ctx.initial_params, algo)
    assert _entries(u[1], algo) == pytest.approx((a + 0.6 * 1.0, b + 0.2 * 2.0), abs=1e-6)


def test_in_the_uniform_limit_a_round_is_fedavg_with_equal_weights():
    """σ → ∞ with α_k = σ/N and λ = 0: every ξ_ij → 1/N (self weight included), so every u_i is the plain mean of
    the stored models and the client step is plain local SGD — FedAMP then follows FedAvg with equal (not |D_i|)
    weights, written out by hand with the same client seeds (every client in every round, strict)."""
    every = {**TINY["federation"], "sample_fraction": 1.0}
    cfg = {**TINY, "federation": every, "train": {**TINY["train"], "rounds": 3}, "eval": {"every": 3, "finetune": []},
           "executor": {"strict": True, "threads": 1},
           "algorithm": {"name": "fedamp", "sigma": 1e12, "alpha_k": 1e12 / 6, "lam": 0.0}}  # fmt: skip
    res = pflbed.run(cfg, write=False, progress=False)
    ref = prepare(validate_config({**cfg, "algorithm": {"name": "fedavg"}}))
    g = dict(ref.ctx.initial_params)
    for rnd in (1, 2, 3):
        replies = {c: update_client(ref, rnd, c, g, {})[0] for c in ref.ctx.federation.participated}
        g = weighted_mean(replies, dict.fromkeys(replies, 1.0))
    mean = res.executor.algo.mean_model(res.server)
    assert all(torch.allclose(mean[k], g[k], atol=1e-6) for k in g)


def test_batchnorm_statistics_are_mixed_with_the_weights_and_the_batch_counter_takes_the_maximum():
    """With BatchNorm: running statistics are floating-point state, mixed like the parameters (ξ from the
    parameters' distance alone); the integer batch counter cannot be mixed and takes the maximum."""
    algo = _algo(model="cnn_bn", alpha_k=0.3, sigma=2.0)
    w0 = algo.ctx.initial_params
    stat = next(k for k in w0 if k.endswith("running_mean"))
    count = next(k for k in w0 if k.endswith("num_batches_tracked"))
    w1 = _shifted(algo, first=1.0)
    w1[stat] = w1[stat] + 10.0  # buffers differ but do not count in the distance
    w1[count] = w1[count] + 7
    server = _stored(algo, {0: _shifted(algo), 1: w1})
    u = algo.configure(2, server, [0])
    xi = 0.3 * math.exp(-1.0 / 2.0) / 2.0
    assert torch.allclose(u[0][stat], w0[stat] + xi * 10.0, atol=1e-6)
    assert int(u[0][count]) == int(w0[count]) + 7


def test_a_new_client_starts_from_the_uniform_mean_of_the_stored_models():
    """Zero-shot: the plain mean of the uploaded models (not weighted by data size, never-trained clients left out);
    FT starts there. Before any upload: w^0."""
    algo = _algo()
    assert same_tensors(algo.zero_shot(algo.init_server(), algo.ctx.client_data(0)).params, algo.ctx.initial_params)
    w0, w3 = _shifted(algo, first=1.0), _shifted(algo, last=3.0)
    server = _stored(algo, {0: w0, 3: w3})
    zero = algo.zero_shot(server, algo.ctx.client_data(5))
    mean = zero.params
    assert zero.model is algo.ctx.model
    a, b = _entries(algo.ctx.initial_params, algo)
    assert _entries(mean, algo) == pytest.approx((a + 0.5, b + 1.5), abs=1e-6)
    assert _rest_is(mean, algo.ctx.initial_params, algo)

    budget = Budget("ft", epochs=2, lr=0.05, batch_size=16)
    data = algo.ctx.client_data(5)
    got = [p.params for p in algo.personalize(server, data, budget, torch.Generator().manual_seed(3))]
    want = [p.params for p in finetune_epochs(algo.ctx.model, mean, data, budget, torch.Generator().manual_seed(3))]
    assert len(got) == 2 and all(same_tensors(g, w) for g, w in zip(got, want, strict=True))


def test_a_round_is_cloud_models_then_proximal_client_steps_then_stored_replies():
    """End to end (strict, half the clients per round): after round 2 every client sampled in round 2 holds exactly
    the reply it computes from u_i built on the round-1 server; the server holds the clients sampled so far; the
    summary has P-FL and no G-FL."""
    cfg = {**TINY, "train": {**TINY["train"], "rounds": 2}, "eval": {"every": 1, "finetune": []},
           "algorithm": {"name": "fedamp", "alpha_k": 0.1, "sigma": 5.0, "lam": 0.05},
           "executor": {"strict": True, "threads": 1}}  # fmt: skip
    one = pflbed.run({**cfg, "train": {**cfg["train"], "rounds": 1}}, write=False, progress=False)
    two = pflbed.run(cfg, write=False, progress=False)
    algo, fed = two.executor.algo, two.executor.algo.ctx.federation
    sampled = [sample_clients(0, r, fed.participated, 0.5) for r in (1, 2)]
    assert algo.uploaded(two.server) == sorted(set(sampled[0]) | set(sampled[1]))
    for c in sampled[1]:
        u = algo.cloud_model(2, one.server, c)
        reply, _ = update_client(algo, 2, c, u, algo.init_client(c))
        assert same_tensors(reply, algo.stored(two.server, c))
    final = two.summary["final"]
    assert final["gfl_acc"] is None and 0.0 <= final["pfl_acc"] <= 1.0
