import csv
import json
import math
import time
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import pflbed
from pflbed import rng
from pflbed.algorithms.base import Budget, ClientContext, Predictor
from pflbed.algorithms.basis import (
    DECAY,
    PSI,
    STEP,
    combine,
    entropy,
    kmeans,
    kmeans_pp_init,
    max_entropy,
    mean_pairwise_cosine,
    mixing_weights,
    sharpen,
    stack_bases,
    stat_update_shares,
    tracked_statistics,
)
from pflbed.algorithms.basis_plots import mixing_table
from pflbed.algorithms.fedbasis import STREAM, FedBasis
from pflbed.algorithms.training import finetune_epochs, get_params, train_from, weighted_mean
from pflbed.config import validate_config
from pflbed.engine.build import prepare
from pflbed.errors import ConfigError
from pflbed.models import BlockNet
from pflbed.models.zoo import SafeBatchNorm1d

from ..tiny import TINY


def make(options: dict | None = None, model: BlockNet | None = None, **sections) -> FedBasis:
    cfg = validate_config({**TINY, **sections, "algorithm": {"name": "fedbasis", "K": 2, **(options or {})}})
    algo = prepare(cfg)
    if model is not None:
        algo = FedBasis(replace(algo.ctx, model=model, initial_params=get_params(model)))
    return algo


def bn_net() -> BlockNet:
    """A tiny BatchNorm model on the synthetic 1×8×8 inputs."""
    return BlockNet(
        [
            ("fc1", nn.Sequential(nn.Flatten(), nn.Linear(64, 16, bias=False), SafeBatchNorm1d(16), nn.ReLU())),
            ("classifier", nn.Linear(16, 10)),
        ]
    )


def random_server(algo: FedBasis, seed: int = 0) -> dict[str, torch.Tensor]:
    """A server state past the warm start: K + 1 random models of the algorithm's architecture (BN statistics
    positive), so that every basis differs from every other."""
    g = torch.Generator().manual_seed(seed)

    def rand(v: torch.Tensor) -> torch.Tensor:
        return torch.rand(v.shape, generator=g) + 0.5 if v.is_floating_point() else v.clone()

    # parameters centred at 0, statistics positive, batch counters left integer
    models = [{k: rand(v) - 0.5 if k in algo.param_keys else rand(v) for k, v in algo.ctx.initial_params.items()}
              for _ in range(algo.opts.K + 1)]  # fmt: skip
    return algo.join(stack_bases(models[1:], algo.keys), models[0] if algo.opts.major else None)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- hand-written references (independent of `combine`, `sharpen` and torch.optim) ---------------------------------
FULL_BATCH = 512  # > every tiny client's training set: one batch per epoch, so the sample order cannot matter
SGD_TRAIN = {**TINY["train"], "batch_size": FULL_BATCH, "momentum": 0.5, "weight_decay": 0.01}


def ref_theta(algo: FedBasis, stacked, major, alpha: torch.Tensor, keys) -> dict[str, torch.Tensor]:
    """θ[key] = ½·v'[key] + ½·Σ_i α[row, i]·v_i[key] (Σ_i α[row, i]·v_i[key] without v'), written out term by
    term; the row is the key's block (paper: one vector per block), or row 0 for a single vector."""
    blocks = algo.ctx.model.block_names()
    out = {}
    for k in keys:
        row = alpha[blocks.index(k.split(".")[1]) if alpha.shape[0] > 1 else 0]
        mix = sum(row[i] * stacked[k][i] for i in range(row.numel()))
        out[k] = 0.5 * major[k] + 0.5 * mix if major is not None else mix
    return out


def ref_loss(algo: FedBasis, params: dict[str, torch.Tensor], data) -> torch.Tensor:
    """Training-mode cross-entropy of the model with `params` on the client's whole training set (BatchNorm
    normalizes with batch statistics in training mode, so the running statistics passed in do not matter)."""
    model = algo.ctx.model
    bufs = {k: v.clone() for k, v in model.state_dict().items() if k not in params}
    model.train()
    x, y = data.x[data.train], data.y[data.train]
    return F.cross_entropy(functional_call(model, {**params, **bufs}, (x,)), y)


def manual_sgd(leaves: dict, loss_of, steps: int, lr: dict, momentum: float, wd: dict):
    """Full-batch SGD written out, yielding the leaves after every step: d = ∇L + wd·p; b = d on the first step,
    else μ·b + d; p ← p − lr·b (torch.optim.SGD's rule with dampening 0, one optimizer for all steps)."""
    bufs: dict = {}
    for _ in range(steps):
        ps = {n: p.detach().requires_grad_() for n, p in leaves.items()}
        grads = torch.autograd.grad(loss_of(ps), list(ps.values()), allow_unused=True)
        for (n, p), g in zip(ps.items(), grads, strict=True):
            d = (g if g is not None else torch.zeros_like(p)) + wd[n] * p.detach()
            bufs[n] = d if n not in bufs else momentum * bufs[n] + d
            leaves[n] = p.detach() - lr[n] * bufs[n]
        yield dict(leaves)


def basis_leaves(algo: FedBasis, stacked, major) -> dict[str, torch.Tensor]:
    """The trainable tensors of V as named leaves: `s:<key>` the stacked (K, …) parameters, `m:<key>` v'."""
    out = {f"s:{k}": stacked[k].clone() for k in algo.param_keys}
    if major is not None:
        out.update({f"m:{k}": major[k].clone() for k in algo.param_keys})
    return out


def unpack(algo: FedBasis, leaves, major: bool):
    stacked = {k: leaves[f"s:{k}"] for k in algo.param_keys}
    return stacked, ({k: leaves[f"m:{k}"] for k in algo.param_keys} if major else None)


# --- pure pieces ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("major", [True, False])
def test_combination_is_the_explicit_layerwise_weighted_sum(major):
    algo = make({"K": 3, "major": major})
    server = random_server(algo)
    stacked, mj = algo.split(server)
    blocks = algo.ctx.model.block_names()
    assert algo.groups == blocks and len(blocks) == 3
    alpha = torch.softmax(torch.randn(len(blocks), 3), -1)
    alpha[blocks.index("classifier")] = torch.tensor([0.0, 1.0, 0.0])  # classifier row: basis 1 only
    theta = combine(stacked, alpha, algo.group_of, mj)
    for k in algo.keys:
        g = blocks.index(k.split(".")[1])
        s = sum(alpha[g, i] * server[f"basis{i}.{k}"] for i in range(3))
        expected = 0.5 * server[f"major.{k}"] + 0.5 * s if major else s
        assert torch.allclose(theta[k], expected, atol=1e-6), k
    w = "blocks.classifier.weight"
    b1 = server[f"basis1.{w}"]
    assert torch.allclose(theta[w], 0.5 * server[f"major.{w}"] + 0.5 * b1 if major else b1)
    # one vector for the whole model: every key uses row 0
    single = make({"K": 3, "major": major, "layerwise": False})
    assert set(single.group_of.values()) == {0} and single.groups == ["all"]


def test_sharpen_tends_to_one_hot_and_tau_one_is_identity():
    a = torch.tensor([[0.2, 0.5, 0.3], [0.4, 0.35, 0.25]])
    assert torch.allclose(sharpen(a, 1.0), a)
    assert torch.allclose(sharpen(a, 0.1).sum(-1), torch.ones(2))
    hard = sharpen(a, 1e-3)
    assert torch.allclose(hard, torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]), atol=1e-6)
    ent = [float(entropy(sharpen(a, t)).mean()) for t in (1.0, 0.5, 0.1, 0.01)]
    assert ent == sorted(ent, reverse=True) and ent[-1] < 1e-3
    psi = torch.randn(4, 5)
    assert torch.allclose(sharpen(torch.softmax(psi, -1), 0.1), torch.softmax(psi / 0.1, -1), atol=1e-6)


def test_diagnostic_and_kmeans_helpers_hand_computed():
    v = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    assert mean_pairwise_cosine(v) == pytest.approx((0 + 2 * math.sqrt(0.5)) / 3)
    assert mean_pairwise_cosine(v[:1]) is None
    assert float(entropy(torch.full((4,), 0.25))) == pytest.approx(math.log(4))
    assert float(entropy(torch.tensor([1.0, 0.0]))) == 0.0
    pts = torch.cat([torch.randn(5, 3) * 0.01 + 10, torch.randn(4, 3) * 0.01 - 10, torch.randn(3, 3) * 0.01])
    assign, cent = kmeans(pts, 3, 20, gen(1))
    groups = [set(assign[i : i + n].tolist()) for i, n in ((0, 5), (5, 4), (9, 3))]
    assert all(len(g) == 1 for g in groups) and len(set.union(*groups)) == 3
    for (i, n), g in zip(((0, 5), (5, 4), (9, 3)), groups, strict=True):
        assert torch.allclose(cent[g.pop()], pts[i : i + n].mean(0), atol=1e-5)
    assert torch.allclose(stat_update_shares(torch.tensor([0.5, 0.5, 0.0])), torch.tensor([1.0, 1.0, 0.0]))


def test_kmeans_returns_k_non_empty_clusters_even_from_duplicate_models():
    """The warm start needs K centroids (one per basis): with identical local models k-means++ must place two
    centres on one point, the second cluster starts empty, and Lloyd's step must refill it (not a NaN mean)."""
    pts = torch.tensor([[1.0, 2.0]] * 4)
    for seed in range(3):
        assign, cent = kmeans(pts, 2, 10, gen(seed))
        assert sorted(set(assign.tolist())) == [0, 1] and torch.isfinite(cent).all()


def test_tracked_statistics_move_the_combination_by_the_update_and_leave_an_unused_basis_alone():
    """`basis.tracked_statistics` on hand-built statistics (c = ½ for v', ½·α for the bases): afterwards the
    combined running mean is exactly `after` (Δ split by c_i / Σ c_j²); the basis with α = 0 keeps its statistic
    bit for bit; a batch counter grows by the whole count in v' and in every basis, used or not; a running
    variance whose share would take v' below zero (share 0.5 / 0.40625 > 1) is floored at 0; the inputs are
    left as they were (new tensors: it also runs inside a vmapped step)."""
    g = gen(3)
    stacked = {"mean": torch.randn(3, 4, generator=g), "var": torch.full((3, 4), 10.0),
               "n": torch.tensor([5, 6, 7])}  # fmt: skip
    major = {"mean": torch.randn(4, generator=g), "var": torch.full((4,), 0.01), "n": torch.tensor(9)}
    group_of, alpha = dict.fromkeys(stacked, 0), torch.tensor([[0.0, 0.25, 0.75]])
    before = combine(stacked, alpha, group_of, major)
    after = {"mean": before["mean"] + torch.randn(4, generator=g), "var": torch.zeros(4), "n": before["n"] + 2}
    unused, var_major = stacked["mean"][0].clone(), major["var"].clone()
    inputs = [{k: v.clone() for k, v in d.items()} for d in (stacked, major)]
    stacked, major = tracked_statistics(stacked, major, alpha, before, after, list(stacked), group_of, {"var"})
    assert all(torch.equal(v, inputs[0][k]) for k, v in inputs[0].items())
    assert torch.allclose(combine(stacked, alpha, group_of, major)["mean"], after["mean"], atol=1e-6)
    assert torch.equal(stacked["mean"][0], unused)
    assert stacked["n"].tolist() == [7, 8, 9] and int(major["n"]) == 11
    assert float(var_major[0] - 0.5 / 0.40625 * before["var"][0]) < 0  # the unfloored share would go negative
    assert torch.equal(major["var"], torch.zeros(4)) and bool((stacked["var"] > 0).all())


# --- gradients and coordinate descent ------------------------------------------------------------------------------
@pytest.mark.parametrize("major", [True, False])
def test_gradient_of_a_basis_is_its_coefficient_times_the_model_gradient(major):
    """Eq. 8: ∇v_k L = α[k]·∇θ L (× ½ with the major basis); ∇v' L = ½·∇θ L."""
    algo = make({"K": 3, "major": major})
    stacked, mj = algo.split(random_server(algo))
    alpha = torch.softmax(torch.randn(len(algo.groups), 3), -1)
    leaves = {k: stacked[k].clone().requires_grad_() for k in algo.param_keys}
    mleaves = {k: mj[k].clone().requires_grad_() for k in algo.param_keys} if major else None
    theta = combine(leaves, alpha, algo.group_of, mleaves, algo.param_keys)
    data = algo.ctx.client_data(0)
    x, y = data.x[data.train[:20]], data.y[data.train[:20]]
    loss = F.cross_entropy(functional_call(algo.ctx.model, theta, (x,)), y)
    keys = algo.param_keys
    inputs = [leaves[k] for k in keys] + [theta[k] for k in keys] + ([mleaves[k] for k in keys] if major else [])
    grads = torch.autograd.grad(loss, inputs)
    g_basis, g_theta = grads[: len(keys)], grads[len(keys) : 2 * len(keys)]
    scale = 0.5 if major else 1.0
    for k, gb, gt in zip(keys, g_basis, g_theta, strict=True):
        assert gt.abs().sum() > 0
        for i in range(3):
            assert torch.allclose(gb[i], scale * alpha[algo.group_of[k], i] * gt, atol=1e-7), (k, i)
    if major:
        for gm, gt in zip(grads[2 * len(keys) :], g_theta, strict=True):
            assert torch.allclose(gm, 0.5 * gt, atol=1e-7)


def test_each_coordinate_descent_step_leaves_the_frozen_part_untouched():
    algo = make(
        {"K": 3, "alpha_epochs": 2, "basis_epochs": 1}, model=bn_net(), train={**TINY["train"], "batch_size": 64}
    )
    stacked, mj = algo.split(random_server(algo))
    before = {k: v.clone() for k, v in stacked.items()}, {k: v.clone() for k, v in mj.items()}
    data = algo.ctx.client_data(0)
    psi = algo.alpha_step(stacked, mj, data, gen())
    assert psi.abs().sum() > 0  # α moved …
    for k in algo.keys:  # … and V (weights and statistics) did not
        assert torch.equal(stacked[k], before[0][k]) and torch.equal(mj[k], before[1][k]), k
    alpha = sharpen(torch.softmax(psi, -1), 0.1)
    frozen = alpha.clone()
    new_stacked, new_major = algo.basis_step(stacked, mj, alpha, data, gen())
    assert torch.equal(alpha, frozen)  # α† is not trained in the V step
    assert any(not torch.equal(new_stacked[k], stacked[k]) for k in algo.param_keys)
    assert any(not torch.equal(new_major[k], mj[k]) for k in algo.param_keys)
    for k in algo.keys:  # the inputs themselves were never written
        assert torch.equal(stacked[k], before[0][k]) and torch.equal(mj[k], before[1][k]), k


def test_a_basis_with_zero_coefficient_gets_no_update_and_bn_statistics_track_the_combination():
    """α† = (0, 1) without major basis: basis 0 is untouched (weights and statistics); the combined statistics
    after one batch are exactly those of the combined model run as an ordinary module on that batch."""
    algo = make({"K": 2, "major": False, "basis_epochs": 1}, model=bn_net(), train={**TINY["train"], "batch_size": 512})
    stacked, _ = algo.split(random_server(algo))
    data = algo.ctx.client_data(0)
    alpha = torch.tensor([[0.0, 1.0], [0.3, 0.7]])  # rows: fc1 (holds the BN), classifier
    new, _ = algo.basis_step(stacked, None, alpha, data, gen())
    for k in algo.keys:
        if algo.group_of[k] == 0 and stacked[k].is_floating_point():
            assert torch.equal(new[k][0], stacked[k][0]), k

    algo2 = make({"K": 2, "major": True, "basis_epochs": 1}, model=bn_net(), train={**TINY["train"], "batch_size": 512})
    stacked, mj = algo2.split(random_server(algo2, seed=3))
    alpha = torch.tensor([[0.3, 0.7], [0.5, 0.5]])
    theta0 = combine(stacked, alpha, algo2.group_of, mj)
    new, new_major = algo2.basis_step(stacked, mj, alpha, data, gen())  # one batch = all training samples
    ref = bn_net()
    ref.load_state_dict(theta0)
    ref.train()
    ref(data.x[data.train])
    after = combine(new, alpha, algo2.group_of, new_major, algo2.buffer_keys)
    for k, v in ref.state_dict().items():
        if k in algo2.buffer_keys:
            assert torch.allclose(after[k].to(v.dtype), v, atol=1e-5), k
    assert int(new_major["blocks.fc1.2.num_batches_tracked"]) == int(mj["blocks.fc1.2.num_batches_tracked"]) + 1


def test_training_never_writes_into_the_shared_model():
    algo = make({"K": 2, "alpha_epochs": 1, "basis_epochs": 1}, model=bn_net())
    template = {k: v.clone() for k, v in algo.ctx.model.state_dict().items()}
    payload = algo.configure(3, random_server(algo), [0])[0]
    reply, state = algo.client_update(payload, {}, algo.ctx.client_data(0), ClientContext(3, 0, gen()))
    for k, v in algo.ctx.model.state_dict().items():
        assert torch.equal(v, template[k]), k
    assert set(reply) == set(payload) and set(state) == {"alpha", "alpha_star"}
    assert state["alpha"].shape == (2, 2) and torch.allclose(state["alpha"].sum(-1), torch.ones(2))
    assert float(entropy(state["alpha"]).mean()) <= float(entropy(state["alpha_star"]).mean())


def sgd_algo(options: dict, **train) -> FedBasis:
    """Full-batch SGD with momentum and weight decay, a BatchNorm model, and α's lr ≠ the weights' lr, so that
    a step taken with the wrong lr, decay, momentum or epoch count cannot agree with the reference."""
    opts = {"K": 2, "tau": 0.25, "alpha_lr": 0.7, **options}
    return make(opts, model=bn_net(), train={**SGD_TRAIN, **train})


@pytest.mark.parametrize("major", [True, False])
def test_psi_step_is_sgd_on_softmax_psi_from_zero_with_the_bases_frozen(major):
    """Eq. 9 steps 1–2 / Alg. 1 lines 4–5: ψ starts at 0 (α uniform), α = softmax(ψ) (unsharpened: τ enters only
    in step 3), `alpha_epochs` epochs (not `train.local_epochs`) of SGD at `alpha_lr` with `train.momentum` and no
    weight decay; the gradient flows through θ = ½v' + ½Σα_k v_k with V constant."""
    algo = sgd_algo({"major": major, "alpha_epochs": 2}, local_epochs=3)
    stacked, mj = algo.split(random_server(algo))
    data = algo.ctx.client_data(0)
    psi = algo.alpha_step(stacked, mj, data, gen())

    def loss(leaves):
        return ref_loss(algo, ref_theta(algo, stacked, mj, torch.softmax(leaves["psi"], -1), algo.param_keys), data)

    *_, ref = manual_sgd({"psi": torch.zeros(2, 2)}, loss, 2, {"psi": 0.7}, 0.5, {"psi": 0.0})
    assert psi.shape == (2, 2) and ref["psi"].abs().max() > 1e-3
    assert torch.allclose(psi, ref["psi"], atol=1e-5), (psi, ref["psi"])


@pytest.mark.parametrize("major", [True, False])
def test_v_step_is_sgd_on_every_basis_with_alpha_frozen(major):
    """Eq. 9 step 4 / Alg. 1 line 7: every basis and v' take `basis_epochs` epochs of SGD at `train.lr` (not
    `alpha_lr`) with `train.momentum` and `train.weight_decay`, through θ(α†, V) with the given α† held fixed."""
    algo = sgd_algo({"major": major, "basis_epochs": 2}, local_epochs=3)
    stacked, mj = algo.split(random_server(algo))
    data = algo.ctx.client_data(0)
    alpha = torch.tensor([[0.9, 0.1], [0.2, 0.8]])  # rows: fc1, classifier
    new, new_major = algo.basis_step(stacked, mj, alpha, data, gen())

    def loss(leaves):
        s, m = unpack(algo, leaves, major)
        return ref_loss(algo, ref_theta(algo, s, m, alpha, algo.param_keys), data)

    leaves = basis_leaves(algo, stacked, mj)
    *_, ref = manual_sgd(leaves, loss, 2, dict.fromkeys(leaves, 0.1), 0.5, dict.fromkeys(leaves, 0.01))
    ref_s, ref_m = unpack(algo, ref, major)
    for k in algo.param_keys:
        assert not torch.allclose(ref_s[k], stacked[k], atol=1e-4), k  # the step is not a no-op
        assert torch.allclose(new[k], ref_s[k], atol=1e-5), k
        if major:
            assert torch.allclose(new_major[k], ref_m[k], atol=1e-5), k
    assert new_major is None if not major else set(new_major) == set(algo.keys)


@pytest.mark.parametrize("major", [True, False])
def test_v_step_trains_one_model_sized_step_and_a_scalar_and_without_weight_decay_a_zero_step_is_no_change(major):
    """The V step's reparameterization (`basis.v_step_theta`): what it trains is one model's parameters and one
    scalar a client, whatever K (the memory a batched round needs: K + 1 bases, their gradients and momenta
    otherwise); the bases are the round's start throughout. A basis with α† = 0 and no weight decay comes back
    bit for bit (a = 1 exactly, its share of the step 0)."""
    algo = sgd_algo({"major": major, "K": 3}, weight_decay=0.0)
    server = random_server(algo)
    plan = algo.sgd_plan(algo.configure(3, server, [0])[0], {}, algo.ctx.client_data(0))
    psi_phase, v_phase = plan.phases
    trained = [k for k in plan.start if any(k.startswith(prefix) for prefix, _ in v_phase.extra)]
    assert sum(plan.start[k].numel() for k in trained) == sum(algo.ctx.initial_params[k].numel()
                                                              for k in algo.param_keys) + 1  # fmt: skip
    assert not any(k.startswith(("v.", "m.")) for k in trained)
    stacked, mj = algo.split(server)
    alpha = torch.tensor([[0.0, 0.4, 0.6], [0.0, 1.0, 0.0]])
    new, new_major = algo.basis_step(stacked, mj, alpha, algo.ctx.client_data(0), gen())
    for k in algo.param_keys:
        assert torch.equal(new[k][0], stacked[k][0]), k
        assert not torch.equal(new[k][1], stacked[k][1]), k
        if major:
            assert not torch.equal(new_major[k], mj[k]), k


def test_a_rounds_clients_are_given_one_set_of_plan_tensors():
    """Every client of a round is sent the same payload object (`configure`), and its plan's tensors are built
    once for it (`payload_tensors`): the bases, the V step's start and ψ = 0 are one object for all the clients, so
    batched clients hold them once (`engine.batched`), not a model's zeros a client (100 ResNet-18 clients: 4.4 GB)
    built client after client. A new payload (the next round's) gets its own."""
    algo = sgd_algo({"K": 2})
    server = random_server(algo)
    payloads = algo.configure(3, server, [0, 1])
    plans = [algo.sgd_plan(payloads[c], {}, algo.ctx.client_data(c)) for c in (0, 1)]
    assert plans[0].start.keys() == plans[1].start.keys()
    assert all(plans[1].start[k] is v for k, v in plans[0].start.items())
    later = algo.sgd_plan(algo.configure(4, dict(server), [0])[0], {}, algo.ctx.client_data(0))
    fresh = [k for k in later.start if k in (PSI, DECAY) or k.startswith(STEP)]  # the V step's start, ψ
    assert len(fresh) == len(algo.param_keys) + 2
    assert all(later.start[k] is not plans[0].start[k] for k in fresh)


def test_client_round_is_psi_step_then_sharpen_then_v_step_with_alpha_dagger_and_uploads_v():
    """Alg. 1 lines 4–8 composed: α* = softmax(ψ*), α† = softmax(ψ*/τ) (SHARPEN), V trained with α† (not α*),
    and the upload is the trained V (all K bases and v'); the client keeps α† as `alpha` and α* as `alpha_star`.
    Reference: the two steps called by hand with the same generator stream, α† computed by hand."""
    algo = sgd_algo({"alpha_epochs": 1, "basis_epochs": 1}, batch_size=64)
    server = random_server(algo)
    stacked, mj = algo.split(server)
    data = algo.ctx.client_data(0)
    g = gen(5)
    psi = algo.alpha_step(stacked, mj, data, g)
    a_dag = torch.softmax(psi / 0.25, -1)
    ref_s, ref_m = algo.basis_step(stacked, mj, a_dag, data, g)
    reply, state = algo.client_update(algo.configure(3, server, [0])[0], {}, data, ClientContext(3, 0, gen(5)))
    assert torch.allclose(state["alpha_star"], torch.softmax(psi, -1), atol=1e-6)
    assert torch.allclose(state["alpha"], a_dag, atol=1e-6)
    assert not torch.allclose(state["alpha"], state["alpha_star"], atol=1e-3)  # sharpening changed something
    assert set(reply) == set(server)
    for k in algo.keys:
        assert torch.allclose(reply[f"major.{k}"], ref_m[k], atol=1e-6), k
        for i in range(2):
            assert torch.allclose(reply[f"basis{i}.{k}"], ref_s[k][i], atol=1e-6), (i, k)
    assert any(not torch.equal(reply[f"basis0.{k}"], server[f"basis0.{k}"]) for k in algo.param_keys)


def test_every_round_restarts_from_uniform_alpha_whatever_the_client_kept():
    """Alg. 1 line 4 ("initialize α by 1/K"): FedBasis is stateless — the α† a client kept from its last round
    never enters the next one; with no α epochs α* is exactly uniform (ψ = 0) and so is α†."""
    algo = sgd_algo({"alpha_epochs": 1, "basis_epochs": 1}, batch_size=64)
    payload = algo.configure(3, random_server(algo), [0])[0]
    data = algo.ctx.client_data(0)
    kept = {"alpha": torch.tensor([[1.0, 0.0]] * 2), "alpha_star": torch.tensor([[0.9, 0.1]] * 2)}
    fresh = algo.client_update(payload, {}, data, ClientContext(3, 0, gen(2)))
    again = algo.client_update(payload, kept, data, ClientContext(3, 0, gen(2)))
    for a, b in zip(fresh, again, strict=True):
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    no_alpha = sgd_algo({"alpha_epochs": 0, "basis_epochs": 1}, batch_size=64)
    _, state = no_alpha.client_update(payload, kept, data, ClientContext(3, 0, gen(2)))
    assert torch.equal(state["alpha_star"], torch.full((2, 2), 0.5))
    assert torch.allclose(state["alpha"], torch.full((2, 2), 0.5))


@pytest.mark.parametrize("major", [True, False])
def test_joint_update_ablation_trains_psi_and_v_together_through_the_sharpened_softmax(major):
    """Table 3 "CD ✗" (Eq. 7): ψ (from 0, α = softmax(ψ/τ), `alpha_lr`, no decay) and V (`train.lr`, decay)
    step together on one loss for `alpha_epochs + basis_epochs` epochs; α* = α† = softmax(ψ/τ)."""
    algo = sgd_algo({"major": major, "coordinate_descent": False, "alpha_epochs": 1, "basis_epochs": 1},
                    local_epochs=3)  # fmt: skip
    stacked, mj = algo.split(random_server(algo))
    data = algo.ctx.client_data(0)
    a_star, a_dag, new, new_major = algo.local_round(stacked, mj, data, gen())

    def loss(leaves):
        s, m = unpack(algo, leaves, major)
        return ref_loss(algo, ref_theta(algo, s, m, torch.softmax(leaves["psi"] / 0.25, -1), algo.param_keys), data)

    leaves = {"psi": torch.zeros(2, 2), **basis_leaves(algo, stacked, mj)}
    lr = {n: 0.7 if n == "psi" else 0.1 for n in leaves}
    wd = {n: 0.0 if n == "psi" else 0.01 for n in leaves}
    *_, ref = manual_sgd(leaves, loss, 2, lr, 0.5, wd)
    ref_s, ref_m = unpack(algo, ref, major)
    assert torch.allclose(a_dag, torch.softmax(ref["psi"] / 0.25, -1), atol=1e-5)
    assert torch.equal(a_star, a_dag) and not torch.allclose(a_dag, torch.full((2, 2), 0.5), atol=1e-2)
    for k in algo.param_keys:
        assert torch.allclose(new[k], ref_s[k], atol=1e-5), k
        if major:
            assert torch.allclose(new_major[k], ref_m[k], atol=1e-5), k
    # the client's reply: the round's trained bases, the major basis's among them; its state: α† and α*
    payload = algo.join(stacked, mj)
    reply, state = algo.client_update(payload, {}, data, ClientContext(3, 0, gen()))
    assert sorted(reply) == sorted(payload)
    assert all(torch.equal(v, algo.join(new, new_major)[k]) for k, v in reply.items())
    assert torch.equal(state["alpha"], a_dag) and torch.equal(state["alpha_star"], a_star)


def test_bn_statistics_frozen_option_and_track_bookkeeping():
    """`bn_stats="frozen"`: the V step changes the weights but no statistic (nor batch counter) of any basis.
    `"track"`: every basis and v' count the batch; a running variance never goes below 0 (the share c_i·Δ/Σc²
    of a large negative Δ can exceed a small basis variance; a variance is floored at 0). Batch counters are
    not combined: the combined model carries the major basis's count."""
    server = None
    for mode in ("frozen", "track"):
        algo = make({"K": 2, "basis_epochs": 1, "bn_stats": mode}, model=bn_net(),
                    train={**TINY["train"], "batch_size": FULL_BATCH})  # fmt: skip
        server = random_server(algo, seed=4) if server is None else server
        stacked, mj = algo.split(server)
        var = "blocks.fc1.2.running_var"
        mj[var] = torch.full_like(mj[var], 1e-3)  # a tiny major variance, huge basis variances: the combined
        stacked[var] = torch.full_like(stacked[var], 1e4)  # variance falls, Δ < 0, v' gets 1·Δ (Σc² = ½)
        n = "blocks.fc1.2.num_batches_tracked"
        mj[n] = mj[n] + 5  # v' has counted more batches than the bases
        alpha = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
        # integer counters are not mixed: the combined model carries the major basis's count (`combine`'s rule)
        assert torch.equal(combine(stacked, alpha, algo.group_of, mj)[n], mj[n])
        new, new_major = algo.basis_step(stacked, mj, alpha, algo.ctx.client_data(0), gen())
        assert any(not torch.equal(new[k], stacked[k]) for k in algo.param_keys)
        if mode == "frozen":
            for k in algo.buffer_keys:
                assert torch.equal(new[k], stacked[k]) and torch.equal(new_major[k], mj[k]), k
        else:
            assert torch.equal(new[n], stacked[n] + 1) and torch.equal(new_major[n], mj[n] + 1)
            assert not torch.equal(new_major[var], mj[var])
            assert float(new_major[var].min()) >= 0 and float(new[var].min()) >= 0
            assert float(new_major[var].min()) == 0.0  # the floor was needed: the test reaches the clamp


# --- warm start ----------------------------------------------------------------------------------------------------
def clustered(algo: FedBasis, members: dict[int, int], n_clusters: int, spread: float = 1e-3):
    """Local models: a few far-apart centres, each client a small perturbation of its centre."""
    torch.manual_seed(7)
    centres = [{k: torch.randn_like(v) * 5 if v.is_floating_point() else v for k, v in algo.ctx.initial_params.items()}
               for _ in range(n_clusters)]  # fmt: skip
    return {c: {k: v + spread * torch.randn_like(v) if v.is_floating_point() else v for k, v in centres[j].items()}
            for c, j in members.items()}  # fmt: skip


def test_switch_round_sets_major_to_fedavg_and_bases_to_kmeans_centroids():
    full = {**TINY["federation"], "sample_fraction": 1.0}
    algo = make({"K": 2}, federation=full)
    assert algo.warmup_rounds == 2 and algo.pool_from == 2  # ⌈0.3·4⌉; all clients sampled every round
    members = {0: 0, 3: 0, 4: 0, 1: 1, 2: 1, 5: 1}
    replies = clustered(algo, members, 2)
    weights = {c: 10.0 + 3 * c for c in replies}
    server = algo.aggregate(1, algo.init_server(), replies, weights)
    assert set(server) == {f"major.{k}" for k in algo.keys}  # round 1: plain FedAvg, nothing pooled
    out = algo.aggregate(2, server, replies, weights)
    assert algo.has_bases(out) and not any(k.startswith("pool") for k in out)
    fedavg = weighted_mean(replies, weights)
    for k in algo.keys:
        assert torch.equal(out[f"major.{k}"], fedavg[k])
    for i, cluster in enumerate(([0, 3, 4], [1, 2, 5])):  # numbered by lowest client id
        centroid = weighted_mean({c: replies[c] for c in cluster}, dict.fromkeys(cluster, 1.0))
        for k in algo.keys:
            assert torch.allclose(out[f"basis{i}.{k}"], centroid[k]), (i, k)
    no_major = make({"K": 2, "major": False}, federation=full).aggregate(2, server, replies, weights)
    assert set(no_major) == {k for k in out if not k.startswith("major.")}


def test_the_warm_start_pools_the_rounds_that_poisson_sampling_draws():
    """With `federation.sampling: poisson` the warm start pools the rounds whose Poisson draws hold K distinct
    clients: its second round draws client 5 alone, so K = 2 pools from round 1 (fixed sampling's second round,
    3 clients, would be enough alone), and K = 4 is refused (3 distinct clients in the 2 warm-up rounds)."""
    from pflbed.federation import sample_clients

    poisson = {**TINY["federation"], "sampling": "poisson"}
    algo = make({"K": 2}, federation=poisson)
    fed, cfg = algo.ctx.federation, algo.ctx.cfg
    assert [sample_clients(cfg.seed, r, fed.participated, 0.5, True) for r in (1, 2)] == [[0, 2, 5], [5]]
    assert algo.warmup_rounds == 2 and algo.pool_from == 1
    assert make({"K": 2}).pool_from == 2  # fixed sampling
    with pytest.raises(ConfigError, match="only 3 distinct clients train in the 2 warm-up rounds"):
        make({"K": 4}, federation=poisson)


def test_warm_start_pools_earlier_rounds_when_a_round_has_fewer_than_k_clients():
    from pflbed.federation import sample_clients

    algo = make({"K": 4})  # 3 of 6 clients per round
    fed, cfg = algo.ctx.federation, algo.ctx.cfg
    r1, r2 = (sample_clients(cfg.seed, r, fed.participated, 0.5) for r in (1, 2))
    assert (r1, r2) == ([1, 2, 4], [1, 3, 4]) and algo.pool_from == 1  # 4 distinct clients over 2 rounds
    models = clustered(algo, {c: c for c in (1, 2, 3, 4)}, 5, spread=0.0)
    first = {c: {k: v - 1.0 if v.is_floating_point() else v for k, v in models[c].items()} for c in r1}
    server = algo.aggregate(1, algo.init_server(), first, dict.fromkeys(r1, 1.0))
    assert {int(k[4 : k.index(".")]) for k in server if k.startswith("pool")} == set(r1)
    second = {c: models[c] for c in r2}
    out = algo.aggregate(2, server, second, dict.fromkeys(r2, 2.0))
    assert not any(k.startswith("pool") for k in out)
    fedavg = weighted_mean(second, dict.fromkeys(r2, 1.0))  # the FedAvg model of the last warm-up round only
    latest = [models[1], first[2], models[3], models[4]]  # client 2 last trained in round 1
    for k in algo.keys:
        assert torch.equal(out[f"major.{k}"], fedavg[k])
        for i in range(4):  # 4 local models, K = 4: singleton clusters, numbered by client id
            assert torch.allclose(out[f"basis{i}.{k}"], latest[i][k]), (i, k)


def test_bases_are_averaged_uniformly_unless_weighted_is_asked():
    """Eq. 9 / Alg. 1 line 10: V̄ = (1/M) Σ_m V_m, ignoring |D_m|; `aggregation="weighted"` uses |D_m|."""
    algo = make()
    replies = {0: random_server(algo, 1), 1: random_server(algo, 2)}
    weights = {0: 1.0, 1: 3.0}
    k = "basis1.blocks.fc1.1.weight"
    out = algo.aggregate(3, random_server(algo), replies, weights)
    assert set(out) == set(replies[0]) and torch.allclose(out[k], (replies[0][k] + replies[1][k]) / 2)
    weighted = make({"aggregation": "weighted"}).aggregate(3, random_server(algo), replies, weights)
    assert torch.allclose(weighted[k], 0.25 * replies[0][k] + 0.75 * replies[1][k])


def test_too_many_bases_for_the_warm_start_is_a_config_error():
    with pytest.raises(ConfigError, match="algorithm.K"):
        make({"K": 7})


def test_warm_start_clusters_parameters_not_statistics_and_centroids_average_full_state():
    """§4.4 k-means over the local models' *parameters* (BatchNorm statistics, unlearned and large, must not
    decide the clusters); a centroid is the plain mean of its members' whole state dicts, statistics included."""
    full = {**TINY["federation"], "sample_fraction": 1.0}
    algo = make({"K": 2}, model=bn_net(), federation=full)
    by_params = {0: 0, 1: 0, 2: 0, 3: 1, 4: 1, 5: 1}
    replies = clustered(algo, by_params, 2)
    var = "blocks.fc1.2.running_var"
    for c in replies:  # statistics that would pair {0, 3, 4} against {1, 2, 5}, 100× farther apart
        replies[c][var] = torch.full_like(replies[c][var], 1e4 if c in (0, 3, 4) else 1.0)
    out = algo.aggregate(2, algo.init_server(), replies, dict.fromkeys(replies, 1.0))
    for i, cluster in enumerate(([0, 1, 2], [3, 4, 5])):
        for k in algo.keys:
            expected = sum(replies[c][k].double() for c in cluster) / 3
            if k.endswith("num_batches_tracked"):
                continue
            assert torch.allclose(out[f"basis{i}.{k}"].double(), expected, atol=1e-5), (i, k)


@pytest.mark.parametrize("major", [True, False])
def test_without_warm_start_the_bases_are_independent_random_models_and_v_prime_the_initial_one(major):
    """`warmup_fraction = 0`: v' = the run's initial model, the K bases K distinct random initializations
    (identical bases would get identical gradients and never separate), reproducible from the run seed."""
    algo = make({"K": 3, "major": major, "warmup_fraction": 0.0})
    server = algo.init_server()
    assert algo.warmup_rounds == 0 and algo.has_bases(server)
    initial = algo.ctx.initial_params
    w = "blocks.fc1.1.weight"
    bases = [server[f"basis{i}.{w}"] for i in range(3)]
    assert all(not torch.equal(bases[i], bases[j]) for i in range(3) for j in range(i)), "bases must differ"
    assert all(not torch.equal(b, initial[w]) for b in bases)
    assert all(float(b.std()) > 0.5 * float(initial[w].std()) for b in bases)  # a real initialization, not zeros
    if major:
        assert all(torch.equal(server[f"major.{k}"], initial[k]) for k in algo.keys)
    else:
        assert not any(k.startswith("major.") for k in server)
    again = make({"K": 3, "major": major, "warmup_fraction": 0.0}).init_server()
    assert all(torch.equal(server[k], again[k]) for k in server)


# --- models --------------------------------------------------------------------------------------------------------
def test_personal_model_is_one_ordinary_model_equal_to_the_functional_combination():
    algo = make({"K": 3})
    server = random_server(algo)
    alpha = torch.softmax(torch.randn(len(algo.groups), 3), -1)
    pred = algo.personal_model(server, {"alpha": alpha})
    n_model = sum(p.numel() for p in algo.ctx.model.parameters())
    assert set(pred.params) == set(algo.ctx.model.state_dict())
    assert sum(pred.params[k].numel() for k in algo.param_keys) == n_model
    x = algo.ctx.source.test.x[:50]
    stacked, mj = algo.split(server)
    with torch.no_grad():
        expected = functional_call(algo.ctx.model, combine(stacked, alpha, algo.group_of, mj), (x,))
    assert torch.allclose(pred.logits(x), expected, atol=1e-5)
    # inference costs one model whatever K: time it against a plain Predictor of one basis, interleaved
    plain = Predictor(algo.ctx.model, algo._sub(server, "basis0."))
    xs = algo.ctx.source.test.x[:256]
    times: dict[str, list[float]] = {"personal": [], "plain": []}
    for _ in range(7):
        for name, p in (("personal", pred), ("plain", plain)):
            t0 = time.perf_counter()
            p.logits(xs)
            times[name].append(time.perf_counter() - t0)
    ratio = min(times["personal"]) / min(times["plain"])  # the fastest of each: a preempted call does not count
    assert ratio < 2.0  # an ensemble of K + 1 = 4 models would be ≈ 4×
    generic = algo.generic_model(server)  # uniform α; a client without α gets the same model object
    assert algo.personal_model(server, {}).params is generic.params
    assert torch.allclose(generic.params["blocks.fc1.1.bias"],
                          combine(stacked, algo.uniform(), algo.group_of, mj)["blocks.fc1.1.bias"])  # fmt: skip


@pytest.mark.parametrize("method", ["ft", "lp"])
def test_personalize_learns_on_frozen_bases_and_yields_snapshots(method):
    algo = make({"K": 2})
    server = random_server(algo)
    before = {k: v.clone() for k, v in server.items()}
    preds = list(algo.personalize(server, algo.ctx.client_data(1), Budget(method, 2, 0.1, 16), gen()))
    assert len(preds) == 2 and preds[0].params is not preds[1].params
    assert all(torch.equal(server[k], before[k]) for k in server)  # the bases are frozen
    first = {k: v.clone() for k, v in preds[0].params.items()}
    assert any(not torch.equal(first[k], preds[1].params[k]) for k in first)
    start = algo.generic_model(server).params
    head = algo.head_param_keys
    # lp learns α only: with α in each block the classifier is still a combination of the bases' classifiers
    if method == "lp":
        w = "blocks.classifier.weight"
        basis = [server[f"basis{i}.{w}"] - server[f"major.{w}"] for i in range(2)]
        d = 2 * preds[1].params[w] - server[f"major.{w}"] - server[f"major.{w}"]
        a = torch.linalg.lstsq(torch.stack([b.reshape(-1) for b in basis], 1), d.reshape(-1, 1)).solution
        assert torch.allclose(a.sum(), torch.tensor(1.0), atol=1e-4)
    else:
        assert any(not torch.equal(preds[1].params[k], start[k]) for k in head)


def test_personalization_steps_psi_at_its_training_ratio_to_the_weights_lr():
    """ψ's step in Alg. 2 is budget.lr · alpha_lr / train.lr: only that product matters for the coefficients."""

    def learned(alpha_lr: float, lr: float) -> torch.Tensor:
        algo = make({"K": 2, "alpha_lr": alpha_lr}, train={**TINY["train"], "lr": 0.01})
        server = random_server(algo)
        *_, last = algo.personalize(server, algo.ctx.client_data(1), Budget("lp", 1, lr, 16), gen())
        return last.params["blocks.fc1.1.weight"]

    same = learned(1.0, 0.01), learned(0.01, 1.0)  # ψ lr 1.0 both times
    assert torch.allclose(*same, atol=1e-6)
    assert not torch.allclose(same[0], learned(0.01, 0.01), atol=1e-4)  # ψ lr 0.01


def test_personal_model_uses_alpha_dagger_and_a_new_client_starts_from_the_uniform_combination():
    """P-FL model = θ(α†) (the α the client's last basis update used), not θ(α*); zero-shot (Alg. 2 line 1) and
    generic = θ(1/K) = ½v' + ½·mean_k v_k, never v' alone."""
    algo = make({"K": 3})
    server = random_server(algo)
    stacked, mj = algo.split(server)
    a_dag = torch.softmax(torch.randn(3, 3, generator=gen(1)) / 0.1, -1)
    a_star = torch.softmax(torch.randn(3, 3, generator=gen(2)), -1)
    pred = algo.personal_model(server, {"alpha": a_dag, "alpha_star": a_star})
    ref = ref_theta(algo, stacked, mj, a_dag, algo.keys)
    assert all(torch.allclose(pred.params[k], ref[k], atol=1e-6) for k in algo.keys)
    uniform = ref_theta(algo, stacked, mj, torch.full((3, 3), 1 / 3), algo.keys)
    zero_shot = algo.zero_shot(server, algo.ctx.client_data(1))
    assert all(torch.allclose(zero_shot.params[k], uniform[k], atol=1e-6) for k in algo.keys)


@pytest.mark.parametrize("method", ["ft", "lp"])
def test_personalization_is_sgd_on_psi_and_for_ft_the_classifier_with_bases_frozen(method):
    """Alg. 2 (+ §6 "the combinations and the whole classifier"): ψ from 0, α = softmax(ψ) (no τ), ψ's lr =
    budget.lr·alpha_lr/train.lr; for "ft" the classifier is a free copy of the uniform combination's at budget.lr;
    one optimizer (budget.momentum) across epochs; after each epoch the snapshot is θ(softmax(ψ)) with the head
    replaced (statistics: the bases' combined with the current α). Reference: the same steps written out."""
    # train.batch_size 16: the budget's batch size (full batch) must be the one used
    algo = make({"K": 2, "tau": 0.25, "alpha_lr": 0.7}, model=bn_net(), train={**SGD_TRAIN, "batch_size": 16})
    server = random_server(algo)
    before = {k: v.clone() for k, v in server.items()}
    stacked, mj = algo.split(server)
    data = algo.ctx.client_data(1)
    snaps = list(algo.personalize(server, data, Budget(method, 2, 0.05, FULL_BATCH, momentum=0.5), gen()))
    assert all(torch.equal(server[k], before[k]) for k in server)  # V frozen
    head = algo.head_param_keys
    assert head == ["blocks.classifier.weight", "blocks.classifier.bias"]
    uniform = ref_theta(algo, stacked, mj, torch.full((2, 2), 0.5), algo.keys)
    leaves = {"psi": torch.zeros(2, 2)}
    if method == "ft":
        leaves.update({k: uniform[k].clone() for k in head})

    def loss(lv):
        theta = ref_theta(algo, stacked, mj, torch.softmax(lv["psi"], -1), algo.param_keys)
        return ref_loss(algo, {**theta, **{k: lv[k] for k in head if k in lv}}, data)

    lr = {n: 0.05 * 0.7 / 0.1 if n == "psi" else 0.05 for n in leaves}
    refs = list(manual_sgd(leaves, loss, 2, lr, 0.5, dict.fromkeys(leaves, 0.0)))
    assert len(snaps) == 2
    for snap, ref in zip(snaps, refs, strict=True):
        theta = ref_theta(algo, stacked, mj, torch.softmax(ref["psi"], -1), algo.keys)
        theta.update({k: ref[k] for k in head if k in ref})
        for k in algo.keys:
            assert torch.allclose(snap.params[k].double(), theta[k].double(), atol=1e-5), (method, k)
    assert not torch.allclose(refs[1]["psi"], refs[0]["psi"], atol=1e-3)


def test_diagnostics_are_basis_cosine_and_entropies_of_alpha_star_and_alpha_dagger():
    """Fig. 2's collapse signals: `basis_cos` = mean pairwise cosine of the K non-major bases' flattened
    parameters (v' and statistics excluded), per block too; `alpha_entropy` = mean over clients and blocks of
    H(α*), `alpha_sharp_entropy` of H(α†), max = log K, over the clients that hold an α. Fig. 4 table: ½ for v',
    ½·α† for the bases."""
    algo = make({"K": 3}, model=bn_net())
    server = random_server(algo, seed=2)
    a_star = {0: torch.tensor([[0.2, 0.3, 0.5], [0.6, 0.2, 0.2]]), 4: torch.tensor([[0.1, 0.1, 0.8], [1 / 3] * 3])}
    a_dag = {0: torch.tensor([[0.0, 0.1, 0.9], [1.0, 0.0, 0.0]]), 4: torch.tensor([[0.0, 0.0, 1.0], [0.5, 0.25, 0.25]])}
    states = {c: {"alpha": a_dag[c], "alpha_star": a_star[c]} for c in a_star}
    d = algo.diagnostics(5, server, lambda c: states.get(c, {}))

    def flat(i, keys):
        return torch.cat([server[f"basis{i}.{k}"].reshape(-1).double() for k in keys])

    def cos(keys):
        pairs = [(0, 1), (0, 2), (1, 2)]
        return sum(float(F.cosine_similarity(flat(i, keys), flat(j, keys), dim=0)) for i, j in pairs) / 3

    def h(p):  # entropy in nats, 0·log 0 = 0, averaged over the blocks
        return float(sum(-(q * math.log(q)) for row in p.tolist() for q in row if q > 0)) / p.shape[0]

    params = algo.param_keys
    assert d["phase"] == "bases" and d["alpha_clients"] == 2
    assert d["basis_cos"] == pytest.approx(cos(params), abs=1e-5)
    assert d["basis_cos_blocks"]["fc1"] == pytest.approx(cos([k for k in params if ".fc1." in k]), abs=1e-5)
    assert d["alpha_entropy"] == pytest.approx((h(a_star[0]) + h(a_star[4])) / 2, abs=1e-5)
    assert d["alpha_sharp_entropy"] == pytest.approx((h(a_dag[0]) + h(a_dag[4])) / 2, abs=1e-5)
    assert d["alpha_entropy_max"] == pytest.approx(math.log(3), abs=1e-6)
    reported = [d[k] for k in ("basis_cos", "alpha_entropy", "alpha_sharp_entropy", "alpha_entropy_max")]
    assert all(v == round(v, 6) for v in [*reported, *d["basis_cos_blocks"].values()])  # reported to 6 decimals
    order, labels, table = mixing_table({c: s["alpha"] for c, s in states.items()}, dict.fromkeys(states, 0), 3,
                                        True, 2)  # fmt: skip
    assert order == [0, 4] and labels == ["major", "b0", "b1", "b2"]
    assert torch.allclose(table[1], torch.cat([torch.full((2, 1), 0.5), 0.5 * a_dag[4]], 1))


def test_a_block_without_state_has_no_coefficient_vector_and_every_vector_learns():
    """A block with no parameters or statistics (a ResNet's pooling; here a ReLU block) has nothing to combine: it
    gets no row of ψ. A row of its own got no gradient and stayed uniform, so every client's α* read log K of
    entropy there (collapse, to the diagnostics) and Fig. 4 drew a block of uniform weights. Every row a client
    learns moves off uniform in one ψ step."""
    net = BlockNet([("fc1", nn.Sequential(nn.Flatten(), nn.Linear(64, 16))), ("act", nn.ReLU()),
                    ("classifier", nn.Linear(16, 10))])  # fmt: skip
    algo = make({"K": 2, "alpha_epochs": 1, "basis_epochs": 1}, model=net)
    assert algo.groups == ["fc1", "classifier"] and set(algo.group_of.values()) == {0, 1}
    server = random_server(algo)
    payload = algo.configure(3, server, [0])[0]
    _, state = algo.client_update(payload, {}, algo.ctx.client_data(0), ClientContext(3, 0, gen(5)))
    assert state["alpha_star"].shape == (2, 2)
    assert all(not torch.allclose(row, torch.full((2,), 0.5), atol=1e-6) for row in state["alpha_star"])


# --- end to end ----------------------------------------------------------------------------------------------------
def test_fedbasis_learns_end_to_end_in_strict_mode_and_is_deterministic():
    """Reference run: FedAvg on the same config and seed. The warm-up round *is* FedAvg (same |D_m| weights,
    `train.local_epochs`), so round 1 matches it exactly; the FedBasis rounds after the switch (rounds 3–4) must
    learn (P-FL +0.12 over the switch round on this seed, asked: +0.06) and end near FedAvg (−0.013 on this seed,
    allowed: −0.06) — a round that trained, uploaded or averaged nothing stays at the switch round's 0.33."""
    cfg = {**TINY, "algorithm": {"name": "fedbasis", "K": 2, "alpha_epochs": 1, "basis_epochs": 1},
           "eval": {**TINY["eval"], "every": 1}}  # fmt: skip
    res = pflbed.run(cfg, write=False)
    ref = pflbed.run({**cfg, "algorithm": {"name": "fedavg"}}, write=False)
    h, hr = res.history, ref.history
    assert h[0]["diag"]["phase"] == "warmup" and h[1]["diag"]["phase"] == "bases"  # switch at ⌈0.3·4⌉ = 2
    assert (h[0]["gfl_acc"], h[0]["pfl_acc"]) == (hr[0]["gfl_acc"], hr[0]["pfl_acc"])
    f, fr = res.summary["final"], ref.summary["final"]
    assert f["pfl_acc"] >= h[1]["pfl_acc"] + 0.06 and f["gfl_acc"] >= h[1]["gfl_acc"] + 0.06
    assert f["pfl_acc"] >= fr["pfl_acc"] - 0.06 and f["gfl_acc"] >= fr["gfl_acc"] - 0.06
    assert h[-1]["diag"]["alpha_clients"] > 0
    n_model = sum(v.numel() * v.element_size() for v in res.executor.algo.ctx.initial_params.values())
    assert h[-1]["down_bytes_per_round"] == 3 * 3 * n_model  # 3 clients × (K + 1) models
    again = pflbed.run({**cfg, "executor": {"strict": False}}, write=False)
    assert all(torch.equal(res.server[k], again.server[k]) for k in res.server)


@pytest.mark.parametrize(
    "options",
    [{"coordinate_descent": False, "major": False}, {"layerwise": False, "warmup_fraction": 0.0, "tau": 1.0}],
)
def test_ablations_run(options):
    cfg = {**TINY, "train": {**TINY["train"], "rounds": 2}, "eval": {"every": 2, "finetune": []},
           "algorithm": {"name": "fedbasis", "K": 2, "alpha_epochs": 1, "basis_epochs": 1, **options}}  # fmt: skip
    res = pflbed.run(cfg, write=False)
    assert res.summary["final"]["pfl_acc"] > 0.1
    states = [s for s in res.executor.states.values() if "alpha" in s]
    assert states and all(s["alpha"].shape == (1 if options.get("layerwise") is False else 3, 2) for s in states)
    # joint update: α* = α† = softmax(ψ/τ); τ = 1: SHARPEN is the identity — either way the two coincide
    assert all(torch.allclose(s["alpha"], s["alpha_star"], atol=1e-6) for s in states)
    assert any(not torch.allclose(s["alpha"], torch.full_like(s["alpha"], 0.5), atol=1e-4) for s in states)
    if options.get("warmup_fraction") == 0.0:  # no warm start: bases from round 1
        assert res.history[0]["diag"]["phase"] == "bases"


def test_new_clients_artifacts_and_diagnostics_are_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PFLBED_PROGRESS_INTERVAL", "0")
    cfg = {
        **TINY,
        "federation": {**TINY["federation"], "new_clients": 2},
        "eval": {"every": 2, "finetune": [], "new_clients": {"epochs": 1, "lrs": [0.05]}},
        "algorithm": {"name": "fedbasis", "K": 2, "alpha_epochs": 1, "basis_epochs": 1},
    }
    res = pflbed.run(cfg, out=tmp_path / "run", progress=True)
    lines = capsys.readouterr().out.splitlines()
    stage = [x.split("artifacts: ", 1)[1].split(",")[0] for x in lines if "artifacts: " in x]
    assert stage[0] == "1/1"  # the plots are one step of the run's progress
    nc = res.summary["new_clients"]
    assert set(nc["methods"]) == {"ft", "lp"} and nc["zero_shot"]["acc"] > 0
    assert nc["methods"]["ft"]["M"]["last"] > 0.1
    arts = res.summary["artifacts"]
    assert set(arts) == {"alpha_png", "alpha_csv"}
    assert (tmp_path / "run" / arts["alpha_png"]).stat().st_size > 0
    rows = (tmp_path / "run" / arts["alpha_csv"]).read_text().splitlines()
    assert rows[0].startswith("client,domain,fc1/major,fc1/b0,fc1/b1") and len(rows) > 1
    for row in rows[1:]:  # mixing weights of each block sum to 1 (½ major + ½ α)
        vals = [float(v) for v in row.split(",")[2:]]
        assert all(sum(vals[i : i + 3]) == pytest.approx(1.0, abs=1e-5) for i in range(0, len(vals), 3))
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["diag"]["basis_cos"] is not None and lines[-1]["diag"]["alpha_entropy"] is not None


# --- pure functions: contracts of basis.py ------------------------------------------------------------------------
def test_stack_bases_keys_and_mixing_weights_without_major():
    """`stack_bases`: one (K, …) tensor per key — of the given keys only, in their order, else of the first basis's
    keys — holding copies; `mixing_weights`: ½ for v' and ½·α with the major basis, (0, α) without it."""
    a = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}
    b = {"w": torch.tensor([5.0, 6.0]), "n": torch.tensor(4)}
    both = stack_bases([a, b])
    assert list(both) == ["w", "n"] and torch.equal(both["w"], torch.tensor([[1.0, 2.0], [5.0, 6.0]]))
    assert torch.equal(both["n"], torch.tensor([3, 4]))
    only = stack_bases([a, b], ["n"])
    assert list(only) == ["n"] and torch.equal(only["n"], torch.tensor([3, 4]))
    single = stack_bases([a])  # K = 1
    assert torch.equal(single["w"], torch.tensor([[1.0, 2.0]]))
    single["w"].add_(1)
    assert torch.equal(a["w"], torch.tensor([1.0, 2.0]))  # a copy, not a view of the input
    alpha = torch.tensor([[0.25, 0.75]])
    w_major, w = mixing_weights(alpha, False)
    assert w_major == 0.0 and torch.equal(w, alpha)
    w_major, w = mixing_weights(alpha, True)
    assert w_major == 0.5 and torch.equal(w, torch.tensor([[0.125, 0.375]]))


def test_combine_without_major_takes_counters_from_basis_0_and_accepts_float64_alpha():
    """Integer batch counters are not mixed: without v' they come from basis 0 (`combine`'s doc). α in float64 on
    float32 bases gives the float32 combination Σ_k α[k]·v_k."""
    stacked = {"w": torch.tensor([[1.0, 2.0], [3.0, 5.0]]), "n": torch.tensor([7, 9])}
    alpha = torch.tensor([[0.25, 0.75]], dtype=torch.float64)
    out = combine(stacked, alpha, {"w": 0, "n": 0})
    assert torch.equal(out["n"], torch.tensor(7))
    assert out["w"].dtype == torch.float32 and torch.equal(out["w"], torch.tensor([2.5, 4.25]))


def test_sharpen_rejects_tau_zero_and_works_along_the_last_dimension_of_a_vector():
    """SHARPEN needs τ > 0 (τ = 0 would be 0/0); it normalizes along the last dimension, also of a 1-D α."""
    a = torch.tensor([0.2, 0.8])
    with pytest.raises(ValueError):
        sharpen(a, 0.0)
    # α^{1/τ} / Σ α^{1/τ} with τ = ½: (0.04, 0.64) / 0.68
    assert torch.allclose(sharpen(a, 0.5), torch.tensor([0.04, 0.64]) / 0.68, atol=1e-6)


def test_entropy_bound_update_shares_and_cosine_edge_cases():
    """log K for K ≥ 1 and 0 for no entries; an all-zero coefficient vector moves no basis (no 0/0); the cosine
    is scale-free, also for vectors shorter than 1."""
    assert max_entropy(4) == pytest.approx(math.log(4)) and max_entropy(1) == 0.0 and max_entropy(0) == 0.0
    assert torch.equal(stat_update_shares(torch.zeros(3)), torch.zeros(3))
    assert torch.allclose(stat_update_shares(torch.tensor([0.5, 0.25, 0.25])), torch.tensor([4 / 3, 2 / 3, 2 / 3]))
    v = torch.tensor([[3.0, 4.0], [4.0, 3.0], [0.0, 5.0]])  # cosines 24/25, 4/5, 3/5
    expected = (24 / 25 + 4 / 5 + 3 / 5) / 3
    assert mean_pairwise_cosine(v) == pytest.approx(expected)
    assert mean_pairwise_cosine(v * 0.01) == pytest.approx(expected)


def ref_kmeans_pp(points: list[float], k: int, g: torch.Generator) -> list[int]:
    """k-means++ on 1-D points written out: the first centre uniform (`randint` on the generator), then each next
    centre drawn (`multinomial` on the same generator) with weight D² = squared distance to the nearest chosen
    centre; once every unchosen point has D² = 0, uniformly among the unchosen."""
    n = len(points)
    chosen = [int(torch.randint(n, (1,), generator=g))]
    while len(chosen) < k:
        d2 = [0.0 if i in chosen else min((p - points[c]) ** 2 for c in chosen) for i, p in enumerate(points)]
        if sum(d2) == 0:
            d2 = [0.0 if i in chosen else 1.0 for i in range(n)]
        chosen.append(int(torch.multinomial(torch.tensor(d2, dtype=torch.float64), 1, generator=g)))
    return chosen


def test_kmeans_pp_init_is_d2_sampling_from_the_generator():
    """Arthur & Vassilvitskii's D² seeding, every draw from the given generator (the global RNG is not read): equal
    to the written-out reference on 1-D points (exact in float; a scale of 1/16 puts Σ D² below 1); duplicates
    are drawn only once nothing else is left, so k = n gives n distinct indices; k = 1 is allowed."""
    torch.manual_seed(123)  # the global RNG, which must not matter
    for scale in (1.0, 1 / 16):
        pts = [0.0, 1.0, 2.0, 3.0, 5.0, 8.0, 13.0]
        x = torch.tensor(pts)[:, None] * scale
        for seed in range(8):
            ref = ref_kmeans_pp([p * scale for p in pts], 4, gen(seed))
            assert kmeans_pp_init(x, 4, gen(seed)).tolist() == ref, (scale, seed)
    same = torch.zeros(5, 2)
    for seed in range(4):
        assert sorted(kmeans_pp_init(same, 5, gen(seed)).tolist()) == list(range(5))
    assert kmeans_pp_init(same, 1, gen(0)).shape == (1,)


def test_kmeans_runs_lloyd_steps_from_kmeans_pp_centres_and_refills_empty_clusters():
    """One Lloyd step from the k-means++ centres of the same generator: nearest centre, then cluster means —
    `iters = 1` stops there. An emptied cluster takes the point farthest from its centroid (ties: lowest index),
    never the last member of another cluster."""
    pts = torch.tensor([0.0, 1.0, 2.0, 4.0, 7.0, 11.0, 16.0, 22.0])[:, None]
    moved = False
    for seed in range(5):
        centres = pts[kmeans_pp_init(pts, 3, gen(seed))]
        first = (pts - centres.T).abs().argmin(1)  # nearest initial centre (1-D, no ties on these points)
        means = torch.stack([pts[first == j].mean(0) for j in range(3)])
        assign, cent = kmeans(pts, 3, 1, gen(seed))
        assert torch.equal(assign, first) and torch.allclose(cent, means), seed
        moved |= not torch.equal((pts - means.T).abs().argmin(1), first)  # a second step would change something
    assert moved
    k = kmeans(pts, 1, 5, gen(0))  # k = 1: one cluster, the mean
    assert torch.equal(k[0], torch.zeros(8, dtype=torch.long)) and torch.allclose(k[1], pts.mean(0, keepdim=True))
    # two locations, three centres: k-means++ must put two centres on one location, one of them ends up empty and
    # takes the point at distance 0 with the lowest index: point 0 (not one of the far points 2, 3)
    dup = torch.tensor([[0.0, 0.0], [0.0, 0.0], [10.0, 0.0], [10.0, 0.0]])
    # a singleton and a pair: the empty cluster must take a member of the pair, not the singleton
    single = torch.tensor([[0.0, 0.0], [5.0, 0.0], [5.0, 0.0]])
    for seed, iters in ((0, 1), (1, 1), (2, 10), (3, 10)):
        a, cent = kmeans(dup, 3, iters, gen(seed))
        assert a[0] != a[1] and a[2] == a[3] and len(set(a.tolist())) == 3, (seed, a)
        a, cent = kmeans(single, 3, iters, gen(seed))
        assert len(set(a.tolist())) == 3 and torch.isfinite(cent).all(), (seed, a)


# --- FedBasis: warm-up, statistics, random streams ----------------------------------------------------------------
def test_a_one_round_warm_up_is_fedavg_and_needs_k_clients_in_that_round():
    """⌈0.25·4⌉ = 1 warm-up round: the server starts as a plain FedAvg model (v' only), and the k-means at the end
    of that round clusters that round's local models — K = 4 > the 3 clients it samples is a config error."""
    algo = make({"K": 3, "warmup_fraction": 0.25})
    assert algo.warmup_rounds == 1 and algo.pool_from == 1
    assert set(algo.init_server()) == {f"major.{k}" for k in algo.keys}
    with pytest.raises(ConfigError, match=r"algorithm.K: .* only 3 distinct .* choose K <= 3, or raise"):
        make({"K": 4, "warmup_fraction": 0.25})


def test_a_warm_up_that_samples_no_client_asks_for_more_rounds_or_clients_not_for_k_0(monkeypatch):
    """Poisson sampling can draw no client in every warm-up round: K >= 1, so `choose K <= 0` would be no advice."""
    monkeypatch.setattr("pflbed.algorithms.fedbasis.sample_clients", lambda *a: [])
    with pytest.raises(ConfigError, match="algorithm.K") as e:
        make({"K": 1, "warmup_fraction": 0.25})
    assert "K <= 0" not in str(e.value)
    assert "raise algorithm.warmup_fraction or federation.sample_fraction" in str(e.value)


def test_warm_up_training_and_personalization_are_fedavg_s_with_the_given_generator():
    """Before the switch a client trains the FedAvg way (`train_from`, its own generator) and personalization is
    the plain fine-tuning of the FedAvg model (`finetune_epochs`); mini-batches of 8, so the order matters."""
    algo = make({"K": 2}, train={**TINY["train"], "batch_size": 8})
    server = algo.init_server()
    payload = algo.configure(1, server, [0])[0]
    data = algo.ctx.client_data(0)
    torch.manual_seed(11)  # the global RNG, which must not be used
    reply, state = algo.client_update(payload, {}, data, ClientContext(1, 0, gen(3)))
    ref = train_from(algo.ctx.model, payload, data, algo.ctx.cfg.train, gen(3))
    assert state == {} and set(reply) == set(ref) and all(torch.equal(reply[k], ref[k]) for k in ref)
    budget = Budget("ft", 2, 0.05, 8)
    torch.manual_seed(12)
    snaps = [dict(p.params) for p in algo.personalize(server, data, budget, gen(4))]
    refs = [dict(p.params) for p in finetune_epochs(algo.ctx.model, payload, data, budget, gen(4))]
    assert len(snaps) == len(refs) == 2
    for snap, r in zip(snaps, refs, strict=True):
        assert all(torch.equal(snap[k], r[k]) for k in algo.keys)


def combined_stats(algo: FedBasis, stacked, major, alpha: torch.Tensor) -> dict[str, torch.Tensor]:
    """The float statistics of θ: the bases' (and v') combined with α detached (`ref_theta` on buffer keys)."""
    keys = [k for k in algo.buffer_keys if stacked[k].is_floating_point()]
    return ref_theta(algo, stacked, major, alpha.detach(), keys)


@pytest.mark.parametrize("major", [True, False])
def test_a_one_sample_batch_normalizes_with_the_statistics_combined_with_the_current_alpha(major):
    """A one-sample training batch is normalized with θ's running statistics (SafeBatchNorm), and those are the
    bases' (½ v' + ½ Σ α_k v_k) combined with the *current* α = softmax(ψ) over the bases, detached — in the ψ step
    (Eq. 9 step 2) and in new-client personalization (Alg. 2). Reference: the SGD steps written out."""
    algo = sgd_algo({"major": major, "alpha_epochs": 2})
    server = random_server(algo)
    stacked, mj = algo.split(server)
    full = algo.ctx.client_data(0)
    data = replace(full, train=full.train[:1])

    def loss(lv):
        a = torch.softmax(lv["psi"], -1)
        theta = ref_theta(algo, stacked, mj, a, algo.param_keys)
        return ref_loss(algo, {**theta, **combined_stats(algo, stacked, mj, a)}, data)

    psi = algo.alpha_step(stacked, mj, data, gen())
    *_, ref = manual_sgd({"psi": torch.zeros(2, 2)}, loss, 2, {"psi": 0.7}, 0.5, {"psi": 0.0})
    assert torch.allclose(psi, ref["psi"], atol=1e-5), (psi, ref["psi"])
    # Alg. 2 ("lp": ψ only) at ψ lr = budget.lr · alpha_lr / train.lr = 0.35; the snapshot: θ and its statistics
    *_, last = algo.personalize(server, data, Budget("lp", 2, 0.05, FULL_BATCH, momentum=0.5), gen())
    *_, ref = manual_sgd({"psi": torch.zeros(2, 2)}, loss, 2, {"psi": 0.35}, 0.5, {"psi": 0.0})
    a = torch.softmax(ref["psi"], -1)
    expected = {**ref_theta(algo, stacked, mj, a, algo.param_keys), **combined_stats(algo, stacked, mj, a)}
    assert not torch.allclose(a, torch.full((2, 2), 0.5), atol=1e-3)
    for k, v in expected.items():
        assert torch.allclose(last.params[k], v, atol=1e-5), k


def test_joint_update_hands_each_batch_s_statistics_back_to_the_bases():
    """Eq. 7 ablation with `bn_stats="track"`: after one full batch, the bases' statistics combined with the α of
    that batch (uniform: ψ = 0) equal those of the combined model run as an ordinary module on the batch, and
    every basis counts the batch; with `"frozen"` no statistic moves."""
    opts = {"coordinate_descent": False, "alpha_epochs": 1, "basis_epochs": 0}
    algo = sgd_algo(opts)
    stacked, mj = algo.split(random_server(algo, seed=3))
    data = algo.ctx.client_data(0)
    *_, new, new_major = algo.local_round(stacked, mj, data, gen())
    uniform = torch.full((2, 2), 0.5)
    ref = bn_net()
    ref.load_state_dict(combine(stacked, uniform, algo.group_of, mj))
    ref.train()
    ref(data.x[data.train])
    after = combine(new, uniform, algo.group_of, new_major, algo.buffer_keys)
    n = "blocks.fc1.2.num_batches_tracked"
    for k, v in ref.state_dict().items():
        if k in algo.buffer_keys and v.is_floating_point():
            assert not torch.allclose(v, mj[k]) and torch.allclose(after[k], v, atol=1e-5), k
    assert torch.equal(new[n], stacked[n] + 1) and torch.equal(new_major[n], mj[n] + 1)
    frozen = sgd_algo({**opts, "bn_stats": "frozen"})
    _, _, new, new_major = frozen.local_round(stacked, mj, data, gen())
    assert all(torch.equal(new[k], stacked[k]) and torch.equal(new_major[k], mj[k]) for k in frozen.buffer_keys)


@pytest.mark.parametrize("augment", [[], ["crop", "flip"]])
def test_local_training_and_personalization_draw_only_from_the_given_generator(augment):
    """Every mini-batch order, and every augmentation of a batch, comes from the client's generator (`pflbed.rng`:
    draws keyed by what they are for): the same generator gives the same result whatever the global RNG, another
    generator another result."""
    algo = make({"K": 2, "coordinate_descent": False, "alpha_epochs": 1, "basis_epochs": 1},
                dataset={**TINY["dataset"], "augment": augment})  # fmt: skip
    server = random_server(algo)
    stacked, mj = algo.split(server)
    data = algo.ctx.client_data(0)  # more than one batch of 16

    def joint(g_seed: int, global_seed: int):
        torch.manual_seed(global_seed)
        return algo.local_round(stacked, mj, data, gen(g_seed))

    def personal(g_seed: int, global_seed: int):
        torch.manual_seed(global_seed)
        return list(algo.personalize(server, data, Budget("lp", 1, 0.1, 16), gen(g_seed)))[-1].params

    a, b, c = joint(5, 1), joint(5, 2), joint(6, 1)
    assert torch.equal(a[0], b[0]) and all(torch.equal(a[2][k], b[2][k]) for k in algo.keys)
    assert not torch.equal(a[0], c[0])
    a, b, c = personal(5, 1), personal(5, 2), personal(6, 1)
    w = "blocks.fc1.1.weight"
    assert all(torch.equal(a[k], b[k]) for k in algo.keys) and not torch.equal(a[w], c[w])


def two_bn_net() -> BlockNet:
    """Two BatchNorm layers, the first with momentum 0: its running statistics never move (Δ = 0)."""
    still = SafeBatchNorm1d(16, momentum=0.0)
    return BlockNet(
        [
            ("fc1", nn.Sequential(nn.Flatten(), nn.Linear(64, 16, bias=False), still, nn.ReLU())),
            ("fc2", nn.Sequential(nn.Linear(16, 16, bias=False), SafeBatchNorm1d(16), nn.ReLU())),
            ("classifier", nn.Linear(16, 10)),
        ]
    )


def test_statistics_of_every_layer_are_tracked_also_after_a_layer_whose_statistics_did_not_move():
    """`bn_stats="track"` goes over every statistic: an unchanged one (Δ = 0) and a batch counter are skipped, not
    the end of the bookkeeping — the second layer's statistics still follow the combined model's."""
    algo = make({"K": 2, "basis_epochs": 1}, model=two_bn_net(), train={**TINY["train"], "batch_size": FULL_BATCH})
    stacked, mj = algo.split(random_server(algo, seed=5))
    data = algo.ctx.client_data(0)
    alpha = torch.tensor([[0.3, 0.7], [0.6, 0.4], [0.5, 0.5]])
    new, new_major = algo.basis_step(stacked, mj, alpha, data, gen())
    ref = two_bn_net()
    ref.load_state_dict(combine(stacked, alpha, algo.group_of, mj))
    ref.train()
    ref(data.x[data.train])
    after = combine(new, alpha, algo.group_of, new_major, algo.buffer_keys)
    for k, v in ref.state_dict().items():
        if k in algo.buffer_keys and v.is_floating_point():
            assert torch.allclose(after[k], v, atol=1e-5), k
    assert not torch.allclose(after["blocks.fc2.1.running_mean"], combine(stacked, alpha, algo.group_of, mj)[
        "blocks.fc2.1.running_mean"])  # fmt: skip
    for n in ("blocks.fc1.2.num_batches_tracked", "blocks.fc2.1.num_batches_tracked"):
        assert torch.equal(new[n], stacked[n] + 1) and torch.equal(new_major[n], mj[n] + 1), n


def test_without_warm_start_basis_i_is_drawn_from_the_run_seed_s_stream_0_i():
    """`warmup_fraction = 0`: basis i is the architecture initialized under the seed derived from (run seed,
    FedBasis's STREAM, 0, i) — stream 0 is the random bases' (module constant), so another run seed gives others."""
    algo = make({"K": 2, "warmup_fraction": 0.0})
    server = algo.init_server()
    for i in range(2):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(rng.derive_seed(algo.ctx.seed, STREAM, 0, i))
            ref = get_params(algo.ctx.new_model())
        assert all(torch.equal(server[f"basis{i}.{k}"], ref[k]) for k in algo.keys), i
    other = make({"K": 2, "warmup_fraction": 0.0}, seed=1).init_server()
    assert not torch.equal(other["basis0.blocks.fc1.1.weight"], server["basis0.blocks.fc1.1.weight"])


def test_switch_k_means_is_seeded_from_the_run_seed_s_stream_1_and_the_round():
    """§4.4 warm start: the k-means++ seeding is drawn from the generator of (run seed, STREAM, 1, round). Six
    local models on a regular hexagon split 3 + 3 in three equally good ways, so the seeding decides the bases."""
    algo = make({"K": 2})
    w = "blocks.fc1.1.weight"
    pool = {}
    for c in range(6):
        state = {k: v.clone() for k, v in algo.ctx.initial_params.items()}
        state[w][0, 0] += 10 * math.cos(math.pi * c / 3)
        state[w][0, 1] += 10 * math.sin(math.pi * c / 3)
        pool[c] = state
    points = torch.stack([torch.cat([pool[c][k].reshape(-1) for k in algo.param_keys]) for c in range(6)])
    splits = set()
    for rnd in range(1, 7):
        out = algo.switch(algo.ctx.initial_params, pool, rnd)
        assign, _ = kmeans(points, 2, algo.opts.kmeans_iters, rng.generator(algo.ctx.seed, STREAM, 1, rnd))
        clusters = sorted([c for c in range(6) if assign[c] == j] for j in range(2))
        splits.add(tuple(clusters[0]))
        for i, members in enumerate(clusters):
            centroid = sum(pool[c][w] for c in members) / len(members)
            assert torch.allclose(out[f"basis{i}.{w}"], centroid, atol=1e-5), (rnd, i)
    assert len(splits) > 1  # the rounds' seedings do not all agree: the test can tell generators apart


# --- diagnostics and the Fig. 4 artifacts -------------------------------------------------------------------------
def test_diagnostics_with_a_single_basis_report_no_cosine():
    """K = 1: no pair of bases, so `basis_cos` (and per block) is None, not an error; log 1 = 0."""
    algo = make({"K": 1})
    d = algo.diagnostics(3, random_server(algo), lambda c: {})
    assert d["basis_cos"] is None and set(d["basis_cos_blocks"].values()) == {None}
    assert d["alpha_entropy"] is None and d["alpha_entropy_max"] == 0.0 and d["alpha_clients"] == 0


def with_domains(algo: FedBasis, domains: list[int]) -> FedBasis:
    """The algorithm over a federation whose participated clients 0..n−1 have the given domains."""
    fed = algo.ctx.federation
    clients = [replace(fed.clients[c % len(fed.clients)], domain=d) for c, d in enumerate(domains)]
    fed = replace(fed, clients=clients, participated=list(range(len(domains))), new=[])
    return FedBasis(replace(algo.ctx, federation=fed))


DOMAINS = [1, 0, 1, 0, 2, 0, 1, 2, 0, 0, 1, 2]  # by (domain, id): 1 3 5 8 9 | 0 2 6 10 | 4 7 11


def client_alphas(n: int, k: int, groups: int) -> dict[int, dict[str, torch.Tensor]]:
    g = gen(9)
    return {c: {"alpha": torch.softmax(torch.randn(groups, k, generator=g), -1)} for c in range(n)}


def test_mixing_table_orders_clients_by_domain_then_id_and_without_major_is_alpha():
    """Fig. 4 table (`basis_plots.mixing_table`): clients by (domain, id); without the major basis the weights are
    α† itself (no v' column); no client with an α: an empty (0, groups, bases) table."""
    states = client_alphas(12, 2, 3)
    alphas, domain = {c: s["alpha"] for c, s in states.items()}, dict(enumerate(DOMAINS))
    order, labels, table = mixing_table(alphas, domain, 2, False, 3)
    assert order == [1, 3, 5, 8, 9, 0, 2, 6, 10, 4, 7, 11] and labels == ["b0", "b1"]
    assert torch.equal(table, torch.stack([states[c]["alpha"] for c in order]))
    _, labels, empty = mixing_table({}, domain, 2, False, 3)
    assert empty.shape == (0, 3, 2)
    _, labels, empty = mixing_table({}, domain, 2, True, 3)
    assert labels == ["major", "b0", "b1"] and empty.shape == (0, 3, 3)


def test_alpha_artifacts_hold_the_mixing_weights_of_every_client_and_block(tmp_path, monkeypatch):
    """Fig. 4 artifacts: `fedbasis_alpha.csv` — one row per client (by domain, id): client, domain, then per block
    ½ (v') and ½·α†[k], 6 decimals — and the heat-map PNG with one panel per block showing exactly that block's
    weights on a fixed 0–1 scale. Written into a directory created with its parents, again into an existing one."""
    from matplotlib.figure import Figure

    algo = with_domains(make({"K": 2}), DOMAINS)
    states = client_alphas(12, 2, 3)
    figures: list = []
    savefig = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **kw: (figures.append(fig), savefig(fig, *a, **kw))[1])
    out = tmp_path / "run" / "artifacts"
    arts = algo.artifacts(random_server(algo), lambda c: states.get(c, {}), out)
    assert arts == {"alpha_png": "fedbasis_alpha.png", "alpha_csv": "fedbasis_alpha.csv"}
    assert (out / "fedbasis_alpha.png").stat().st_size > 0
    with open(out / "fedbasis_alpha.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["client", "domain"] + [f"{g}/{b}" for g in ("fc1", "fc2", "classifier")
                                              for b in ("major", "b0", "b1")]  # fmt: skip
    order = [1, 3, 5, 8, 9, 0, 2, 6, 10, 4, 7, 11]
    assert [int(r[0]) for r in rows[1:]] == order and [int(r[1]) for r in rows[1:]] == [DOMAINS[c] for c in order]
    for r, c in zip(rows[1:], order, strict=True):
        expected = [w for row in states[c]["alpha"].tolist() for w in (0.5, 0.5 * row[0], 0.5 * row[1])]
        assert [float(v) for v in r[2:]] == pytest.approx(expected, abs=6e-7), c
    (fig,) = figures
    panels = [ax for ax in fig.axes if ax.images]
    assert len(fig.axes) == 3 + 1 and len(panels) == 3  # one panel per block, plus the colour bar
    for j, ax in enumerate(panels):
        (im,) = ax.images
        shown = torch.tensor(im.get_array().data)
        assert torch.allclose(shown[:, 0], torch.full((12,), 0.5)), j
        assert torch.allclose(shown[:, 1:], torch.stack([0.5 * states[c]["alpha"][j] for c in order])), j
        assert im.get_clim() == (0, 1), j
    assert algo.artifacts(random_server(algo), lambda c: states.get(c, {}), out) == arts  # the directory exists
