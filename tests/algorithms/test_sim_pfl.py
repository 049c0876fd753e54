import math

import torch
import torch.nn.functional as F

import pflbed
from pflbed.algorithms import distill as kd
from pflbed.config import validate_config
from pflbed.engine.build import prepare

from .test_ktpfl import CFG, HETERO, _probs, _rows, final_predictions, local_reference_pfl

SIM = {**HETERO, "name": "sim_pfl"}


def _cosine_weights(S: torch.Tensor) -> torch.Tensor:
    """W[n, m] = cos(s_n, s_m) / Σ_m' cos(s_n, s_m') over the flattened predictions (samples × classes)."""
    flat = S.reshape(len(S), -1)
    n = len(S)
    cos = torch.tensor([[float(F.cosine_similarity(flat[i], flat[j], dim=0)) for j in range(n)] for i in range(n)])
    return (cos / cos.sum(1, keepdim=True)).double()


def test_sim_pfl_weights_are_normalized_cosine_similarities():
    algo = prepare(validate_config({**CFG, "algorithm": SIM}))
    S = _probs(3, 7, 10)
    T, W = algo.mixing(torch.eye(3, dtype=torch.float64), S, torch.full((3,), 1 / 3, dtype=torch.float64))
    assert torch.allclose(W, _cosine_weights(S), atol=1e-6)
    assert torch.allclose(T[1], sum(W[1, m] * S[m] for m in range(3)))


def test_sim_pfl_hand_computed_weights_include_self_and_ignore_c_and_sizes():
    """One sample, two classes: s0 = (1, 0), s1 = (0, 1), s2 = (½, ½). cos(s0, s1) = 0, cos(s0, s2) = 1/√2 and the
    self-similarity 1 counts, so row 0 = (1, 0, 1/√2) / (1 + 1/√2). The incoming c and D_n/D play no part."""
    algo = prepare(validate_config({**CFG, "algorithm": SIM}))
    S = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]], [[0.5, 0.5]]], dtype=torch.float64)
    r = 1 / math.sqrt(2)
    expected = torch.tensor([[1, 0, r], [0, 1, r], [r, r, 1]], dtype=torch.float64)
    expected = expected / expected.sum(1, keepdim=True)
    T, W = algo.mixing(_rows(3, 2), S, torch.tensor([0.1, 0.2, 0.7], dtype=torch.float64))
    assert torch.allclose(W, expected, atol=1e-6)
    assert torch.allclose(T[2], (r * S[0] + r * S[1] + S[2]) / (1 + 2 * r), atol=1e-6)


def test_minmax_weights_are_the_authors_rule_the_least_similar_teacher_gets_nothing():
    """`weights: minmax`, the authors' code: (cos − row min) / Σ (cos − row min). Same three clients as above: rows 0
    and 1 hold a similarity 0, so they are the cosine rows; row 2's smallest similarity is 1/√2 (to s0 and s1), so all
    its weight is its own. Every similarity of a row equal (identical predictions): a uniform row, not 0/0."""
    algo = prepare(validate_config({**CFG, "algorithm": {**SIM, "weights": "minmax"}}))
    S = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]], [[0.5, 0.5]]], dtype=torch.float64)
    r = 1 / math.sqrt(2)
    expected = torch.tensor([[1 / (1 + r), 0, r / (1 + r)], [0, 1 / (1 + r), r / (1 + r)], [0, 0, 1]],
                            dtype=torch.float64)  # fmt: skip
    T, W = algo.mixing(_rows(3, 2), S, torch.full((3,), 1 / 3, dtype=torch.float64))
    assert torch.allclose(W, expected, atol=1e-6)
    assert torch.allclose(T[2], S[2], atol=1e-6)
    same = S[2].expand(3, 1, 2).clone()
    _, W = algo.mixing(_rows(3, 2), same, torch.full((3,), 1 / 3, dtype=torch.float64))
    assert torch.allclose(W, torch.full((3, 3), 1 / 3, dtype=torch.float64))
    assert torch.allclose(prepare(validate_config({**CFG, "algorithm": SIM})).mixing(_rows(3, 2), S, W[0])[1],
                          _cosine_weights(S), atol=1e-6)  # fmt: skip


def test_sim_pfl_end_to_end_strict():
    """Strict run against references: the last round's W and targets are the rule applied to the clients' final
    predictions on ξ_R (recomputed from their stored models); P-FL learned and not below the Local control by
    more than 0.02 (no transfer margin is claimed on this tiny config: see test_fedmd)."""
    res = pflbed.run({**CFG, "algorithm": SIM}, write=False)
    pfl = res.summary["final"]["pfl_acc"]
    assert pfl > 0.25 and pfl > local_reference_pfl() - 0.02
    W = res.server["W"]
    assert torch.allclose(W.sum(1), torch.ones(4, dtype=torch.float64)) and (W >= 0).all()
    S = final_predictions(res)
    assert torch.allclose(W, _cosine_weights(S), atol=1e-6)
    T = kd.mix(W, S)
    assert all(torch.allclose(res.server[f"t/{c}"], T[i].float(), atol=1e-6)
               for i, c in enumerate(res.executor.algo.clients))  # fmt: skip
