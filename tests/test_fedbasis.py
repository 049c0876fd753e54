import json
import math
import statistics
import time
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import pflbed
from pflbed.algorithms.base import Budget, ClientContext, Predictor
from pflbed.algorithms.basis import (
    combine,
    entropy,
    kmeans,
    mean_pairwise_cosine,
    sharpen,
    stack_bases,
    stat_update_shares,
)
from pflbed.algorithms.fedbasis import FedBasis
from pflbed.algorithms.training import get_params, weighted_mean
from pflbed.config import validate_config
from pflbed.engine.loop import prepare
from pflbed.errors import ConfigError
from pflbed.models import BlockNet
from pflbed.models.zoo import SafeBatchNorm1d

from .tiny import TINY


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

    models = [{k: rand(v) - (0.5 if k in algo.param_keys else 0.0) for k, v in algo.ctx.initial_params.items()}
              for _ in range(algo.opts.K + 1)]  # fmt: skip
    return algo.join(stack_bases(models[1:], algo.keys), models[0] if algo.opts.major else None)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


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
    algo = make({"K": 3, "alpha_epochs": 2, "basis_epochs": 1}, model=bn_net())
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
    ratio = statistics.median(times["personal"]) / statistics.median(times["plain"])
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


# --- end to end ----------------------------------------------------------------------------------------------------
def test_fedbasis_learns_end_to_end_in_strict_mode_and_is_deterministic():
    cfg = {**TINY, "algorithm": {"name": "fedbasis", "K": 2, "alpha_epochs": 1, "basis_epochs": 1},
           "eval": {**TINY["eval"], "every": 1}}  # fmt: skip
    res = pflbed.run(cfg, write=False)
    assert res.history[0]["diag"]["phase"] == "warmup" and res.history[0]["gfl_acc"] is not None  # FedAvg model
    f = res.summary["final"]
    assert f["gfl_acc"] > 0.3 and f["pfl_acc"] > 0.3  # 10 balanced classes: chance is 0.1
    assert res.history[-1]["diag"]["phase"] == "bases" and res.history[-1]["diag"]["alpha_clients"] > 0
    n_model = sum(v.numel() * v.element_size() for v in res.executor.algo.ctx.initial_params.values())
    assert res.history[-1]["down_bytes_per_round"] == 3 * 3 * n_model  # 3 clients × (K + 1) models
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
    state = next(s for s in res.executor.states.values() if "alpha" in s)
    assert state["alpha"].shape == (1 if options.get("layerwise") is False else 3, 2)


def test_new_clients_artifacts_and_diagnostics_are_written(tmp_path):
    cfg = {
        **TINY,
        "federation": {**TINY["federation"], "new_clients": 2},
        "eval": {"every": 2, "finetune": [], "new_clients": {"epochs": 1, "lrs": [0.05]}},
        "algorithm": {"name": "fedbasis", "K": 2, "alpha_epochs": 1, "basis_epochs": 1},
    }
    res = pflbed.run(cfg, out=tmp_path / "run")
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
