import csv

import pytest
import torch

import pflbed
from pflbed.algorithms import distill as kd
from pflbed.config import validate_config
from pflbed.engine.loop import prepare

from .tiny import TINY

FED = {**TINY["federation"], "clients": 4, "sample_fraction": 1.0, "public": 200}
HETERO = {"name": "ktpfl", "architectures": ["lenet5", "mlp"], "public_batch": 100, "distill_batch_size": 32}
CFG = {**TINY, "federation": FED, "algorithm": HETERO, "eval": {"every": 4, "finetune": []}}


def _probs(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(*shape, generator=g, dtype=torch.float64) * 2, dim=-1)


def test_projection_keeps_rows_valid_weights():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(7, 7, generator=g, dtype=torch.float64)
    P = kd.project_rows_to_simplex(W)
    assert (P >= 0).all() and torch.allclose(P.sum(1), torch.ones(7, dtype=torch.float64))
    valid = kd.normalize_rows(torch.rand(7, 7, generator=g, dtype=torch.float64))
    assert torch.allclose(kd.project_rows_to_simplex(valid), valid)  # already valid: unchanged


@pytest.mark.parametrize("preset", ["paper", "official"])
def test_coefficient_updates_keep_rows_valid(preset):
    algo = prepare(validate_config({**CFG, "algorithm": {**HETERO, "preset": preset, "c_lr": 5.0}}))
    V = torch.full((4, 4), 0.25, dtype=torch.float64)
    S = _probs(4, 30, 10)
    w = torch.full((4,), 0.25, dtype=torch.float64)
    for _ in range(5):
        V = algo.update_coefficients(V, S, w)
        assert (V >= 0).all() and torch.allclose(V.sum(1), torch.ones(4, dtype=torch.float64))
    assert not torch.allclose(V, torch.full_like(V, 0.25))


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_paper_coefficients_move_towards_clients_with_similar_predictions(pooling):
    """Two groups of clients predict alike within a group; one paper step (c_lr 0.01, ρ 0.7) from uniform c."""
    algo = prepare(validate_config({**CFG, "algorithm": {**HETERO, "c_kl": pooling}}))
    a, b = _probs(1, 300, 10, seed=1), _probs(1, 300, 10, seed=2)
    S = torch.cat([a, a * 0.9 + 0.01, b, b * 0.9 + 0.01])  # clients 0, 1 alike; 2, 3 alike
    V = algo.update_coefficients(torch.full((4, 4), 0.25, dtype=torch.float64), S, torch.full((4,), 0.25))
    if pooling == "sum":  # Eq. 2 / 4: the KL term leads, c favours the alike client
        assert V[0, 1] > V[0, 2] + 0.05 and V[2, 3] > V[2, 0] + 0.05
    else:  # averaged KL: the pull to 1/N dominates and c barely moves
        assert (V - 0.25).abs().max() < 0.01


def test_identity_coefficients_give_each_client_its_own_predictions():
    S = _probs(5, 12, 10)
    assert torch.allclose(kd.mix(torch.eye(5, dtype=torch.float64), S), S)
    assert torch.allclose(kd.kl_per_client(S, S), torch.zeros(5, dtype=torch.float64), atol=1e-12)


def test_coefficient_gradient_matches_autograd_of_eq4():
    S = _probs(4, 9, 6)
    W = kd.normalize_rows(torch.rand(4, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    w = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    Wg = W.clone().requires_grad_(True)
    kd.coefficient_objective(Wg, S, w, lam=1.7, rho=0.3, prior=0.25).backward()
    assert torch.allclose(kd.coefficient_grad(W, S, w, 1.7, 0.3, 0.25), Wg.grad, atol=1e-10)


def test_mse_gradient_matches_autograd_of_the_official_loss():
    S = _probs(3, 5, 4)
    W = kd.normalize_rows(torch.rand(3, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64))
    Wg = W.clone().requires_grad_(True)
    T = kd.mix(Wg, S)
    loss = sum(((S[n] - T[n]) ** 2).mean() + 0.7 * ((Wg[n] - 1 / 3) ** 2).mean() for n in range(3))
    loss.backward()
    assert torch.allclose(kd.mse_coefficient_grad(W, S, 0.7), Wg.grad, atol=1e-12)


def test_power5_step_is_a_power_of_five_bringing_the_mean_gradient_near_001():
    for scale in (1e-5, 3e-3, 0.02, 1.0, 40.0):
        g = torch.full((10,), scale)
        lr = kd.power5_step(g)
        assert abs(round(torch.log(torch.tensor(lr)).item() / torch.log(torch.tensor(5.0)).item())
                   - torch.log(torch.tensor(lr)).item() / torch.log(torch.tensor(5.0)).item()) < 1e-6  # fmt: skip
        assert 0.002 <= lr * scale <= 0.05


def test_public_batch_depends_only_on_seed_and_round():
    pub = torch.arange(100, 300)
    a, b = kd.public_batch(pub, 50, 0, 3), kd.public_batch(pub, 50, 0, 3)
    assert torch.equal(a, b) and len(set(a.tolist())) == 50 and set(a.tolist()) <= set(pub.tolist())
    assert not torch.equal(a, kd.public_batch(pub, 50, 0, 4))
    assert torch.equal(kd.public_batch(pub, 500, 0, 3), pub)


def test_partial_participation_updates_only_the_sampled_block():
    algo = prepare(validate_config({**CFG, "algorithm": {**HETERO, "c_lr": 5.0}}))
    server = algo.init_server()
    a, b = algo.clients[1], algo.clients[3]
    replies = {a: {"s": _probs(100, 10, seed=3).float()}, b: {"s": _probs(100, 10, seed=4).float()}}
    out = algo.aggregate(1, server, replies, {a: 10.0, b: 30.0})
    W, idx = out["W"], [1, 3]
    assert torch.allclose(W.sum(1), torch.ones(4, dtype=torch.float64))
    changed = torch.nonzero(torch.ne(W, server["W"])).tolist()
    assert changed and all(i in idx and j in idx for i, j in changed)
    assert int(out[f"r/{a}"]) == 1 and f"t/{algo.clients[0]}" not in out
    assert torch.allclose(out[f"t/{a}"].sum(-1), torch.ones(100))  # targets are distributions


def test_heterogeneous_end_to_end_strict_learns_and_sends_predictions_not_parameters(tmp_path):
    res = pflbed.run(CFG, write=False)
    algo = res.executor.algo
    assert {algo.arch_of(c) for c in range(4)} == {"lenet5", "mlp"}
    assert [algo.arch_of(c) for c in range(4)] == ["lenet5", "lenet5", "mlp", "mlp"]  # contiguous blocks
    f = res.summary["final"]
    assert f["pfl_acc"] > 0.3 and f["gfl_acc"] is None  # 10 classes: chance is 0.1
    comm = res.summary["communication"]
    pred_bytes = 4 * 100 * 10 * 4  # 4 clients × 100 public samples × 10 classes × float32
    assert comm["up_bytes_per_round"] == pred_bytes
    assert comm["down_bytes_per_round"] == pred_bytes + 4 * 8  # targets + the int64 round number
    n_params = sum(v.numel() * v.element_size() for v in algo.models["lenet5"].state_dict().values())
    assert comm["up_bytes_per_round"] < n_params  # all four uploads together weigh less than one LeNet
    W = res.server["W"]
    assert torch.allclose(W.sum(1), torch.ones(4, dtype=torch.float64)) and (W >= 0).all()
    assert not torch.allclose(W, torch.full_like(W, 0.25))
    diag = res.history[-1]["diag"]
    assert 0 < diag["c_row_entropy"] <= diag["c_row_entropy_uniform"] + 1e-9
    files = algo.artifacts(res.server, res.executor.state, tmp_path)
    assert (tmp_path / files["coefficients_png"]).exists()
    with open(tmp_path / files["coefficients_csv"]) as fh:
        rows = list(csv.reader(fh))
    assert len(rows) == 5 and all(abs(sum(map(float, r[3:])) - 1) < 1e-5 for r in rows[1:])


def test_targets_are_delivered_next_round_and_distilled_on_the_same_batch():
    """Pipelining: round 2's payload holds round 1's targets and names round 1's public batch."""
    cfg = {**CFG, "train": {**CFG["train"], "rounds": 1}}
    res = pflbed.run(cfg, write=False)
    algo = res.executor.algo
    payloads = algo.configure(2, res.server, algo.clients)
    for c in algo.clients:
        assert int(payloads[c]["batch_round"]) == 1
        assert torch.equal(payloads[c]["targets"], res.server[f"t/{c}"])
    assert algo.configure(1, algo.init_server(), algo.clients) == {c: {} for c in algo.clients}


def test_official_preset_runs_with_prediction_only_first_round():
    cfg = {**CFG, "train": {**CFG["train"], "rounds": 3, "local_epochs": 2},
           "algorithm": {**HETERO, "preset": "official"}}  # fmt: skip
    res = pflbed.run(cfg, write=False)
    algo = res.executor.algo
    assert [algo._epochs(r) for r in (2, 3, 4)] == [1, 2, 2]  # ramp counts local trainings
    W = res.server["W"]
    assert torch.allclose(W.sum(1), torch.ones(4, dtype=torch.float64)) and (W > 0).all()
    assert res.summary["final"]["pfl_acc"] > 0.2


def test_homogeneous_end_to_end():
    cfg = {**CFG, "algorithm": {"name": "ktpfl", "homogeneous": True, "public_batch": 100, "c_lr": 1.0}}
    res = pflbed.run(cfg, write=False)
    algo = res.executor.algo
    f = res.summary["final"]
    assert f["pfl_acc"] > 0.3
    n_params = sum(v.numel() * v.element_size() for v in algo.ctx.initial_params.values())
    assert res.summary["communication"]["up_bytes_per_round"] == 4 * n_params  # parameters travel
    W = res.server["W"]
    assert torch.allclose(W.sum(1), torch.ones(4, dtype=torch.float64))
    c = algo.clients[0]
    mixed = algo.personal_model(res.server, res.executor.state(c)).params
    expected = sum(float(W[0, j]) * res.server[f"local/{m}/blocks.fc1.1.weight"] for j, m in enumerate(algo.clients))
    assert torch.allclose(mixed["blocks.fc1.1.weight"], expected, atol=1e-6)
