"""FedPAC (Xu, Tong & Huang, ICLR 2023): head phase then feature-aligned body phase on the client; FedAvg of the
bodies, sample-count-weighted global prototypes and, per client, simplex weights α_i minimizing
‖Σ_j α_ij (h_i − h_j)‖² + Σ_j α_ij² V_j/n_j, giving the personalized head Σ_j α_ij w_j."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from pflbed.algorithms.base import Budget, ClientContext
from pflbed.algorithms.fedpac import (
    HEAD,
    class_statistics,
    combination_weights,
    fw_gap,
    project_simplex,
    simplex_qp,
)
from pflbed.algorithms.partial import block_params, blocks_for, personalize_blocks
from pflbed.algorithms.training import get_params, index_batches, load_params, local_sgd
from pflbed.config import validate_config
from pflbed.engine.build import prepare

from ..tiny import TINY, same_tensors


def make(train: dict | None = None, **opts):
    cfg = {**TINY, "train": {**TINY["train"], "momentum": 0.0, **(train or {})},
           "algorithm": {"name": "fedpac", **opts}, "executor": {"threads": 1}}  # fmt: skip
    return prepare(validate_config(cfg))


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def bound(alpha, i, h, v):
    """The estimated test-loss bound of client i, written out independently: ‖Σ_j α_j (h_i − h_j)‖² + Σ_j α_j² v_j."""
    bias = sum(a * (h[i] - h[j]) for j, a in enumerate(alpha))
    return float((bias * bias).sum()) + sum(float(a) ** 2 * float(v[j]) for j, a in enumerate(alpha))


def payload_with_protos(algo, seed=0):
    """A payload whose global prototypes are random (far from any local mean) and one class without a prototype."""
    c = algo.ctx.federation.participated[0]
    server = algo.init_server()
    g = gen(seed)
    server["protos"] = torch.randn(server["protos"].shape, generator=g)
    server["proto_mask"] = torch.ones_like(server["proto_mask"])
    server["proto_mask"][0] = 0.0
    return c, algo.configure(1, server, [c])[c]


# --- the quadratic program ---------------------------------------------------------------------------------------
def test_two_client_weights_match_the_closed_form_with_the_variance_term():
    """Client 0 of two: P = [[v0, 0], [0, D + v1]] (D = ‖h0 − h1‖²), so α_00 = (D + v1)/(v0 + D + v1). Without the
    variance term α_00 would be 1; without the bias term it would be v1/(v0 + v1)."""
    g = gen(1)
    h = torch.randn(2, 12, generator=g, dtype=torch.float64)
    d = float(((h[0] - h[1]) ** 2).sum())
    for v in ([0.3, 0.9], [2.0, 0.1], [d, 5 * d]):
        alpha = combination_weights(h, torch.tensor(v, dtype=torch.float64), 1e-12, 50000)
        a00 = (d + v[1]) / (v[0] + d + v[1])
        a11 = (d + v[0]) / (v[1] + d + v[0])
        assert torch.allclose(alpha[0], torch.tensor([a00, 1 - a00], dtype=torch.float64), atol=1e-6)
        assert torch.allclose(alpha[1], torch.tensor([1 - a11, a11], dtype=torch.float64), atol=1e-6)


def test_equal_statistics_give_inverse_variance_weights():
    """Identical h_j (no bias): min Σ α_j² v_j on the simplex is α_j ∝ 1/v_j (Lagrange, closed form)."""
    h = torch.ones(4, 6, dtype=torch.float64)
    v = torch.tensor([0.5, 1.0, 2.0, 4.0], dtype=torch.float64)
    alpha = combination_weights(h, v, 1e-12, 50000)
    want = (1 / v) / (1 / v).sum()
    assert torch.allclose(alpha, want.expand(4, 4), atol=1e-6)


def test_three_client_weights_match_a_brute_force_grid_over_the_simplex():
    """The solver's α_i reaches the minimum of the bound over a fine grid of the 2-simplex (step 1/300), and lies
    within the grid's resolution of the grid's minimizer — for every client, on a case with corner and interior
    optima."""
    g = gen(7)
    h = torch.randn(3, 5, generator=g, dtype=torch.float64)
    h[2] = 0.5 * (h[0] + h[1]) + 0.05 * torch.randn(5, generator=g, dtype=torch.float64)
    v = torch.tensor([0.4, 1.5, 0.2], dtype=torch.float64)
    alpha = combination_weights(h, v, 1e-12, 50000)
    steps = 300
    grid = torch.tensor([(a / steps, b / steps, (steps - a - b) / steps) for a in range(steps + 1)
                         for b in range(steps + 1 - a)], dtype=torch.float64)  # fmt: skip
    for i in range(3):
        values = ((grid @ (h[i] - h)) ** 2).sum(1) + (grid**2) @ v  # `bound` at every grid point at once
        best = int(values.argmin())
        assert bound(grid[best].tolist(), i, h, v) == pytest.approx(float(values[best]), rel=1e-12)
        assert bound(alpha[i].tolist(), i, h, v) <= float(values[best]) + 1e-9
        assert torch.allclose(alpha[i], grid[best], atol=2.0 / steps)


def test_weights_are_on_the_simplex_and_certified_optimal():
    """Many clients: every row α_i ≥ 0, Σ α_i = 1, and the Frank–Wolfe gap (≥ f(α) − f*) is within tolerance."""
    g = gen(3)
    m = 40
    h = torch.randn(m, 30, generator=g, dtype=torch.float64) * torch.rand(m, 1, generator=g, dtype=torch.float64)
    v = torch.rand(m, generator=g, dtype=torch.float64) * 3
    alpha = combination_weights(h, v, 1e-10, 50000)
    assert (alpha >= 0).all() and torch.allclose(alpha.sum(1), torch.ones(m, dtype=torch.float64), atol=1e-12)
    for i in range(m):
        diff = h[i] - h
        p = diff @ diff.T + torch.diag(v)
        grad = 2 * p @ alpha[i]
        assert float(grad @ alpha[i] - grad.min()) <= 1e-8 * float(p.abs().max())


def test_simplex_projection_is_exact():
    """project_simplex(v) is the nearest point of the simplex: it beats every grid point of the 2-simplex."""
    for v in (torch.tensor([0.9, 0.7, -0.2]), torch.tensor([3.0, -1.0, 0.5]), torch.tensor([0.1, 0.1, 0.1])):
        v = v.double()
        p = project_simplex(v)
        assert (p >= 0).all() and abs(float(p.sum()) - 1) < 1e-12
        grid = [torch.tensor([a / 100, b / 100, (100 - a - b) / 100], dtype=torch.float64)
                for a, b in itertools.product(range(101), range(101)) if a + b <= 100]  # fmt: skip
        assert float(((p - v) ** 2).sum()) <= min(float(((q - v) ** 2).sum()) for q in grid) + 1e-12


def test_solver_is_deterministic_and_handles_degenerate_inputs():
    p = torch.tensor([[1.0, 0.2], [0.2, 3.0]], dtype=torch.float64)
    assert torch.equal(simplex_qp(p), simplex_qp(p.clone()))
    assert torch.equal(simplex_qp(torch.zeros(3, 3, dtype=torch.float64)), torch.full((3,), 1 / 3, dtype=torch.float64))
    assert torch.equal(simplex_qp(torch.ones(1, 1, dtype=torch.float64)), torch.ones(1, dtype=torch.float64))


# --- client statistics and local update ---------------------------------------------------------------------------
def test_class_statistics_are_prior_weighted_means_and_the_variance_of_f_times_onehot():
    g = gen(4)
    z = torch.randn(11, 3, generator=g)
    y = torch.tensor([0, 0, 2, 2, 2, 0, 3, 3, 0, 2, 2])
    s = class_statistics(z, y, 5)
    n = len(y)
    for k in range(5):
        rows = z[y == k].double()
        assert s["count"][k] == len(rows)
        if len(rows):
            assert torch.allclose(s["proto"][k], rows.mean(0))
            assert torch.allclose(s["h"][k], len(rows) / n * rows.mean(0))
        else:
            assert (s["proto"][k] == 0).all() and (s["h"][k] == 0).all()
    var = 0.0  # E‖f(x)·e_yᵀ − h‖²_F, one sample at a time
    for zi, yi in zip(z.double(), y, strict=True):
        outer = torch.zeros(5, 3, dtype=torch.float64)
        outer[yi] = zi
        var += float(((outer - s["h"]) ** 2).sum()) / n
    assert abs(float(s["v"]) - var) < 1e-10 and float(s["n"]) == n


def test_head_phase_trains_only_the_head():
    algo = make(head_epochs=1, body_epochs=0)
    c, payload = payload_with_protos(algo)
    reply, _ = algo.client_update(payload, algo.init_client(c), algo.ctx.client_data(c), ClientContext(1, c, gen(2)))
    assert all(torch.equal(reply[k], payload[k]) for k in algo.body_keys)
    assert all(not torch.equal(reply[k], payload[k]) for k in algo.head_keys)


def test_body_phase_trains_only_the_body():
    algo = make(head_epochs=0, body_epochs=1)
    c, payload = payload_with_protos(algo)
    reply, _ = algo.client_update(payload, algo.init_client(c), algo.ctx.client_data(c), ClientContext(1, c, gen(2)))
    assert all(torch.equal(reply[k], payload[k]) for k in algo.head_keys)
    assert any(not torch.equal(reply[k], payload[k]) for k in algo.body_keys)


def hand_body_phase(algo, payload, data, g, lam, lr, batch_size, epochs=1, weight_decay=0.0):
    """The body phase by hand: per batch, autograd of CE + λ·(1/B)·Σ_b mask[y_b]·‖f(x_b) − c_{y_b}‖² (the payload's
    GLOBAL prototypes, a Python loop over samples) w.r.t. the body only, plain SGD step."""
    m = algo.ctx.model
    protos, mask = payload["protos"], payload["proto_mask"]
    body = [p for p in block_params(m, m.body_blocks())]
    for b in index_batches(data.train, batch_size, epochs, g):
        m.train()
        x, y = data.x[b], data.y[b]
        z = m.features(x)
        align = sum(mask[yb] * ((zb.flatten() - protos[yb]) ** 2).sum() for zb, yb in zip(z, y, strict=True))
        loss = F.cross_entropy(m.classify(z), y) + lam * align / len(y)
        grads = torch.autograd.grad(loss, body)
        with torch.no_grad():
            for p, gr in zip(body, grads, strict=True):
                p -= lr * (gr + weight_decay * p)
    return get_params(m)


def test_alignment_pulls_features_to_the_global_prototype_of_the_sample_class():
    """Body phase = SGD on CE + λ·(1/B)Σ‖f(x) − c_y‖² with c_y the received global prototype (masked classes
    excluded), head frozen: the reply equals the hand loop to float tolerance; a different λ gives a different body
    (the term is active)."""
    lam, lr = 0.7, 0.05
    algo = make({"lr": lr}, head_epochs=0, body_epochs=1, lam=lam, align_reduction="sum")
    c, payload = payload_with_protos(algo, seed=3)
    data = algo.ctx.client_data(c)
    reply, _ = algo.client_update(payload, algo.init_client(c), data, ClientContext(1, c, gen(9)))
    load_params(algo.ctx.model, {k: payload[k] for k in (*algo.body_keys, *algo.head_keys)})
    ref = hand_body_phase(algo, payload, data, gen(9), lam, lr, algo.ctx.cfg.train.batch_size)
    assert all(torch.allclose(reply[k], ref[k], atol=1e-6) for k in algo.body_keys)
    mean = make({"lr": lr}, head_epochs=0, body_epochs=1, lam=lam * algo.dim, align_reduction="mean")
    reply_mean, _ = mean.client_update(payload, mean.init_client(c), data, ClientContext(1, c, gen(9)))
    assert all(torch.allclose(reply_mean[k], ref[k], atol=1e-5) for k in algo.body_keys)  # mean: λ·d ≡ sum: λ
    load_params(algo.ctx.model, {k: payload[k] for k in (*algo.body_keys, *algo.head_keys)})
    other = hand_body_phase(algo, payload, data, gen(9), 0.0, lr, algo.ctx.cfg.train.batch_size)
    assert any(not torch.allclose(reply[k], other[k], atol=1e-4) for k in algo.body_keys)


def test_update_is_head_phase_then_aligned_body_phase_with_their_own_lrs():
    """E_w head epochs (body frozen, plain CE, head_lr) THEN E_φ body epochs (new head frozen, aligned loss,
    body_lr); `train.local_epochs` unused. The statistics h, V use the RECEIVED body; the prototypes the trained
    one."""
    algo = make({"local_epochs": 3}, head_epochs=2, body_epochs=1, head_lr=0.2, body_lr=0.05, lam=0.5,
                align_reduction="sum")  # fmt: skip
    m, t = algo.ctx.model, algo.ctx.cfg.train
    c, payload = payload_with_protos(algo, seed=5)
    data = algo.ctx.client_data(c)
    reply, _ = algo.client_update(payload, algo.init_client(c), data, ClientContext(1, c, gen(5)))
    g = gen(5)
    load_params(m, {k: payload[k] for k in (*algo.body_keys, *algo.head_keys)})
    m.eval()
    with torch.no_grad():
        received = class_statistics(m.features(data.x[data.train]).flatten(1), data.y[data.train], algo.num_classes)
    local_sgd(m, data, epochs=2, batch_size=t.batch_size, lr=0.2, generator=g, params=block_params(m, algo.head))
    ref = hand_body_phase(algo, payload, data, g, 0.5, 0.05, t.batch_size)
    assert all(torch.allclose(reply[k], ref[k], atol=1e-6) for k in ref)
    m.eval()
    with torch.no_grad():
        trained = class_statistics(m.features(data.x[data.train]).flatten(1), data.y[data.train], algo.num_classes)
    assert torch.allclose(reply["h"], received["h"]) and torch.allclose(reply["v"], received["v"])
    assert torch.allclose(reply["proto"], trained["proto"].float(), atol=1e-6)
    assert torch.equal(reply["count"], trained["count"].float())


# --- server ------------------------------------------------------------------------------------------------------
def hand_replies(algo, specs):
    """Replies built by hand: {cid: (n, counts, seed)} → model state + statistics."""
    init = algo.ctx.initial_params
    C, d = algo.num_classes, algo.dim
    out = {}
    for c, (n, counts, seed) in specs.items():
        g = gen(seed)
        state = {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in init.items()}
        out[c] = {**state, "proto": torch.randn(C, d, generator=g), "count": torch.tensor(counts, dtype=torch.float),
                  "h": torch.randn(C, d, generator=g, dtype=torch.float64),
                  "v": torch.rand((), generator=g, dtype=torch.float64) * 5,
                  "n": torch.tensor(float(n), dtype=torch.float64)}  # fmt: skip
    return out


def test_global_prototypes_are_the_sample_count_weighted_mean_of_local_ones():
    algo = make()
    C = algo.num_classes
    counts = {0: [5.0, 0.0] + [1.0] * (C - 2), 1: [1.0, 0.0] + [3.0] * (C - 2), 2: [2.0, 0.0] + [0.0] * (C - 2)}
    replies = hand_replies(algo, {c: (sum(v), v, 10 + c) for c, v in counts.items()})
    out = algo.aggregate(1, algo.init_server(), replies, {c: sum(v) for c, v in counts.items()})
    for k in range(C):
        tot = sum(counts[c][k] for c in replies)
        if tot == 0:
            assert out["proto_mask"][k] == 0
            continue
        want = sum(counts[c][k] * replies[c]["proto"][k] for c in replies) / tot
        assert out["proto_mask"][k] == 1 and torch.allclose(out["protos"][k], want, atol=1e-6)


def test_combined_head_is_the_alpha_combination_of_the_rounds_heads():
    """Two repliers: client 0's head is α_00·w_0 + α_01·w_1 with α_00 = (D + v1/n1)/(v0/n0 + D + v1/n1) (closed
    form), the body is the n-weighted FedAvg, and the personal model / next payload carry the combined head."""
    algo = make()
    C = algo.num_classes
    replies = hand_replies(algo, {0: (40, [4.0] * C, 1), 3: (10, [1.0] * C, 2)})
    replies[0]["v"] = torch.tensor(0.3, dtype=torch.float64)  # V below 1 (only negative V is clipped, to 0) …
    replies[3]["h"] = replies[0]["h"] + 0.01 * torch.randn(replies[0]["h"].shape, generator=gen(8), dtype=torch.float64)
    # … and close statistics h, so that the variance terms decide α
    weights = {0: 40.0, 3: 10.0}
    server = algo.init_server()
    out = algo.aggregate(1, server, replies, weights)
    added = {k for k in out if k not in server}  # the repliers' heads; the replies' statistics stay out
    assert added == {f"{HEAD}{c}/{k}" for c in (0, 3) for k in algo.head_keys}
    r0, r1 = replies[0], replies[3]
    dist = float(((r0["h"] - r1["h"]) ** 2).sum())
    v0, v1 = float(r0["v"]) / 40, float(r1["v"]) / 10
    for c, (own, other, vo, vt) in {0: (r0, r1, v0, v1), 3: (r1, r0, v1, v0)}.items():
        a = (dist + vt) / (vo + dist + vt)
        for k in algo.head_keys:
            assert torch.allclose(out[f"{HEAD}{c}/{k}"], a * own[k] + (1 - a) * other[k], atol=1e-5)
    for k in algo.body_keys:
        assert torch.allclose(out[k], 0.8 * r0[k] + 0.2 * r1[k], atol=1e-6)
    p = algo.personal_model(out, algo.init_client(0)).params
    assert all(torch.equal(p[k], out[f"{HEAD}0/{k}"]) for k in algo.head_keys)
    assert all(p[k] is out[k] for k in algo.body_keys)
    payloads = algo.configure(2, out, [0, 1])
    assert all(torch.equal(payloads[0][k], out[f"{HEAD}0/{k}"]) for k in algo.head_keys)
    assert all(torch.equal(payloads[1][k], algo.ctx.initial_params[k]) for k in algo.head_keys)  # never sampled


def test_an_uninformative_variance_term_changes_the_weights():
    """The variance term enters the server's QP: the same h's with a larger V_1 move weight away from client 1."""
    algo = make()
    C = algo.num_classes
    base = hand_replies(algo, {0: (20, [2.0] * C, 1), 1: (20, [2.0] * C, 2)})
    big = {c: dict(r) for c, r in base.items()}
    big[1]["v"] = base[1]["v"] + 1000.0
    w = {0: 20.0, 1: 20.0}
    k = algo.head_keys[0]
    a = algo.aggregate(1, algo.init_server(), base, w)[f"{HEAD}0/{k}"]
    b = algo.aggregate(1, algo.init_server(), big, w)[f"{HEAD}0/{k}"]
    assert (b - base[0][k]).abs().max() < (a - base[0][k]).abs().max()


@pytest.mark.parametrize("c", [1e-3, 1 / 3, 1.0, 1e3])
def test_simplex_qp_is_scale_free(c):
    """argmin over the simplex of αᵀ(c·p)α does not depend on c > 0: for p = [[1, .2], [.2, 3]], α_1 =
    (p22 − p12)/(p11 − 2p12 + p22) = 2.8/3.6, whether p's entries are small (an early round's class statistics),
    at most exactly 1 (c = 1/3) or large."""
    p = c * torch.tensor([[1.0, 0.2], [0.2, 3.0]], dtype=torch.float64)
    a = simplex_qp(p)
    assert a.tolist() == pytest.approx([2.8 / 3.6, 0.8 / 3.6], abs=1e-7)


def test_the_body_phase_applies_train_weight_decay():
    lam, lr, wd = 0.7, 0.05, 0.02
    algo = make({"lr": lr, "weight_decay": wd}, head_epochs=0, body_epochs=1, lam=lam, align_reduction="sum")
    c, payload = payload_with_protos(algo, seed=3)
    data = algo.ctx.client_data(c)
    reply, _ = algo.client_update(payload, algo.init_client(c), data, ClientContext(1, c, gen(9)))
    load_params(algo.ctx.model, {k: payload[k] for k in (*algo.body_keys, *algo.head_keys)})
    ref = hand_body_phase(algo, payload, data, gen(9), lam, lr, algo.ctx.cfg.train.batch_size, weight_decay=wd)
    assert all(torch.allclose(reply[k], ref[k], atol=1e-6) for k in algo.body_keys)


def test_class_statistics_by_hand_with_a_single_sample_class_and_an_absent_one():
    """Counts, per-class means (absent class: zero), h = sums/n and V = E‖f‖² − ‖h‖²_F, written out."""
    z = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])
    s = class_statistics(z, torch.tensor([0, 0, 1, 2]), 4)
    assert s["count"].tolist() == [2, 1, 1, 0] and float(s["n"]) == 4
    assert s["proto"].tolist() == [[2, 3], [5, 6], [7, 8], [0, 0]]
    assert s["h"].tolist() == [[1.0, 1.5], [1.25, 1.5], [1.75, 2.0], [0, 0]]
    assert float(s["v"]) == pytest.approx(204 / 4 - (1 + 2.25 + 1.5625 + 2.25 + 3.0625 + 4))
    one = class_statistics(torch.tensor([[1.0, 2.0]]), torch.tensor([1]), 2)
    assert one["h"].tolist() == [[0, 0], [1, 2]] and float(one["v"]) == 0.0


def test_min_weight_zeroes_small_weights_and_renormalizes():
    """The official code's pruning (`min_weight`): weights below it become 0, the rest are scaled to sum to 1."""
    g = gen(11)
    h = torch.randn(6, 4, generator=g, dtype=torch.float64)
    v = torch.rand(6, generator=g, dtype=torch.float64)
    full = combination_weights(h, v, 1e-12, 50000)
    cut = float(full[full > 0].min()) * 1.01  # drops at least the smallest positive weight of the matrix
    pruned = combination_weights(h, v, 1e-12, 50000, min_weight=cut)
    kept = torch.where(full >= cut, full, torch.zeros_like(full))
    assert torch.allclose(pruned, kept / kept.sum(1, keepdim=True), atol=1e-12)
    assert (pruned == 0).sum() > (full == 0).sum()


def test_frank_wolfe_gap_by_hand():
    """g = 2pα; gap = gᵀα − min_j g_j: zero at the optimum, and written out at the uniform weights."""
    p = torch.tensor([[1.0, 0.2], [0.2, 3.0]], dtype=torch.float64)
    u = torch.tensor([0.5, 0.5], dtype=torch.float64)
    g = 2 * p @ u  # (1.2, 3.2)
    assert fw_gap(p, u) == pytest.approx(float(g @ u) - 1.2)
    assert fw_gap(p, torch.tensor([2.8 / 3.6, 0.8 / 3.6], dtype=torch.float64)) == pytest.approx(0.0, abs=1e-12)


def test_weights_are_certified_optimal_across_sizes_scales_and_corner_optima():
    """Every row of 60 problems (2–10 clients, 2–12 statistics each, from 10⁻² to 10² in scale, a third with one
    client nearly between two others: optima on faces of the simplex) meets the stopping rule the solver promises
    — the Frank–Wolfe gap, written out here, ≤ tol·max|p| — whatever path its iterations take. (With a single
    statistic per client, rank-one p, 2 rows of 8 stopped at qp_max_iter with a gap of 1.5e-8·max|p|.)"""
    g = gen(0)
    tol = 1e-10
    for i in range(60):
        m, d = 2 + i % 9, 2 + (i * 7) % 11
        h = torch.randn(m, d, generator=g, dtype=torch.float64) * 10.0 ** ((i % 5) - 2)
        if i % 3 == 0:
            h[1] = 0.5 * (h[0] + h[-1]) + 1e-3 * torch.randn(d, generator=g, dtype=torch.float64)
        v = torch.rand(m, generator=g, dtype=torch.float64) * 10.0 ** ((i % 4) - 2)
        alpha = combination_weights(h, v, tol, 20000)
        assert (alpha >= 0).all() and torch.allclose(alpha.sum(1), torch.ones(m, dtype=torch.float64), atol=1e-12)
        for j in range(m):
            diff = h[j] - h
            p = diff @ diff.T + torch.diag(v)
            grad = 2 * p @ alpha[j]
            assert float(grad @ alpha[j] - grad.min()) <= tol * float(p.abs().max()) * (1 + 1e-9), (i, j)


def test_a_new_client_starts_from_the_body_and_the_sample_share_weighted_mean_head():
    """Zero-shot: the aggregated body with the mean of the round's heads weighted by n_i/n (0.8 / 0.2); FT / LP
    personalize from there with the client's data, budget and generator (`personalize_blocks`: LP the head)."""
    algo = make()
    C = algo.num_classes
    replies = hand_replies(algo, {0: (40, [4.0] * C, 1), 3: (10, [1.0] * C, 2)})
    out = algo.aggregate(1, algo.init_server(), replies, {0: 40.0, 3: 10.0})
    zero = algo.zero_shot(out, algo.ctx.client_data(5))
    assert zero.model is algo.ctx.model and zero.feature_key is not None
    for k in algo.head_keys:
        assert torch.allclose(zero.params[k], 0.8 * replies[0][k] + 0.2 * replies[3][k], atol=1e-6)
    assert all(zero.params[k] is out[k] for k in algo.body_keys)
    data = algo.ctx.client_data(5)
    for method in ("ft", "lp"):
        budget = Budget(method, 2, 0.05, 8)
        got = [p.params for p in algo.personalize(out, data, budget, gen(4))]
        blocks = blocks_for(budget, algo.ctx.model, lp=algo.head)
        want = [p.params for p in personalize_blocks(algo.ctx.model, dict(zero.params), data, budget, gen(4), blocks)]
        assert len(got) == 2 and all(same_tensors(a, b) for a, b in zip(got, want, strict=True))
        moved = {k for k in zero.params if not torch.equal(got[-1][k], zero.params[k])}
        assert moved == (set(algo.head_keys) if method == "lp" else set(zero.params))
