import torch

import pflbed
from pflbed.algorithms import distill as kd
from pflbed.config import validate_config
from pflbed.engine.build import prepare

from .test_ktpfl import CFG, HETERO, _rows, final_predictions, local_reference_pfl

TOPK = {**HETERO, "name": "topk_pfl", "k": 2}


def _clustered() -> torch.Tensor:
    """Clients 0, 1 predict class 0, clients 2, 3 class 1 (nearly one-hot), client 3 a little less sharply."""
    base = torch.full((4, 5, 3), 0.01, dtype=torch.float64)
    base[0, :, 0] = base[1, :, 0] = 0.98
    base[2, :, 1] = 0.98
    base[3, :, 1], base[3, :, 2] = 0.7, 0.29
    return base


def test_topk_averages_the_k_most_similar_clients():
    algo = prepare(validate_config({**CFG, "algorithm": TOPK}))
    S, w = _clustered(), torch.full((4,), 0.25, dtype=torch.float64)
    T, W = algo.mixing(torch.eye(4, dtype=torch.float64), S, w)
    assert torch.allclose(W[0], torch.tensor([0.5, 0.5, 0, 0], dtype=torch.float64))
    assert torch.allclose(W[3], torch.tensor([0, 0, 0.5, 0.5], dtype=torch.float64))
    assert torch.allclose(T[0], S[:2].mean(0))
    algo.opts.include_self, algo.opts.k = False, 1
    _, W = algo.mixing(torch.eye(4, dtype=torch.float64), S, w)
    assert W.diagonal().eq(0).all() and W[0, 1] == 1 and W[3, 2] == 1


def test_topk_k_beyond_the_candidates_means_all_of_them_and_ignores_c_and_sizes():
    """K ≥ candidates: the uniform mean of all (include_self) or of all others (not include_self); the incoming c
    and D_n/D play no part (the rule is recomputed from the predictions alone)."""
    algo = prepare(validate_config({**CFG, "algorithm": {**TOPK, "k": 9}}))
    S, V, w = _clustered(), _rows(4, 3), torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    T, W = algo.mixing(V, S, w)
    assert torch.allclose(W, torch.full((4, 4), 0.25, dtype=torch.float64)) and torch.allclose(T[1], S.mean(0))
    algo.opts.include_self = False
    T, W = algo.mixing(V, S, w)
    others = (torch.ones(4, 4, dtype=torch.float64) - torch.eye(4, dtype=torch.float64)) / 3
    assert torch.allclose(W, others) and torch.allclose(T[0], S[1:].mean(0))


def test_topk_pfl_end_to_end_strict():
    """Strict run against references: in the last round each client's W row is 1/K on the K = 2 clients whose
    final predictions on ξ_R (recomputed from their stored models) have the largest cosine with its own, its
    target their mean; P-FL learned and not below the Local control by more than 0.02 (no transfer margin is
    claimed on this tiny config: see test_fedmd)."""
    res = pflbed.run({**CFG, "algorithm": TOPK}, write=False)
    pfl = res.summary["final"]["pfl_acc"]
    assert pfl > 0.25 and pfl > local_reference_pfl() - 0.02
    W = res.server["W"]
    assert torch.allclose(W.sum(1), torch.ones(4, dtype=torch.float64)) and ((W == 0) | (W == 0.5)).all()
    S = final_predictions(res)
    flat = torch.nn.functional.normalize(S.reshape(4, -1), dim=1)
    cos = flat @ flat.T
    for n, c in enumerate(res.executor.algo.clients):
        ranked = cos[n].argsort(descending=True).tolist()
        assert cos[n, ranked[1]] - cos[n, ranked[2]] > 1e-6  # no near-tie at the cut on this seed
        assert set(torch.nonzero(W[n]).flatten().tolist()) == set(ranked[:2])
        assert torch.allclose(res.server[f"t/{c}"], S[ranked[:2]].mean(0).float(), atol=1e-6)
    assert torch.allclose(kd.mix(W, S)[0].float(), res.server[f"t/{res.executor.algo.clients[0]}"], atol=1e-6)


def test_topk_defaults_are_the_papers():
    """§5.1 footnote 3: K = 5; the client itself counts among its K most similar by default (documented)."""
    d = prepare(validate_config({**CFG, "algorithm": {**HETERO, "name": "topk_pfl"}})).opts
    assert (d.k, d.include_self) == (5, True)


def test_topk_without_self_excludes_self_even_with_two_clients():
    """With two replying clients and include_self false, each target is the *other* client's prediction: the
    self-exclusion must hold for every n ≥ 2, not only for larger federations."""
    algo = prepare(validate_config({**CFG, "algorithm": {**TOPK, "k": 1, "include_self": False}}))
    S, w = _clustered()[[0, 2]], torch.full((2,), 0.5, dtype=torch.float64)
    T, W = algo.mixing(torch.eye(2, dtype=torch.float64), S, w)
    assert torch.equal(W, torch.tensor([[0.0, 1.0], [1.0, 0.0]], dtype=torch.float64))
    assert torch.allclose(T[0], S[1]) and torch.allclose(T[1], S[0])


def test_topk_without_self_and_a_single_replying_client_keeps_its_own_prediction():
    """With one replying client there is no other client to choose: the rule falls back to the client itself
    (W = [[1]], target = its own prediction) instead of an empty selection."""
    algo = prepare(validate_config({**CFG, "algorithm": {**TOPK, "k": 1, "include_self": False}}))
    S = _clustered()[[1]]
    T, W = algo.mixing(torch.eye(1, dtype=torch.float64), S, torch.ones(1, dtype=torch.float64))
    assert torch.equal(W, torch.ones(1, 1, dtype=torch.float64)) and torch.allclose(T, S)
