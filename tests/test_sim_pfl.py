import torch
import torch.nn.functional as F

import pflbed
from pflbed.config import validate_config
from pflbed.engine.loop import prepare

from .test_ktpfl import CFG, HETERO, _probs

SIM = {**HETERO, "name": "sim_pfl"}


def test_sim_pfl_weights_are_normalized_cosine_similarities():
    algo = prepare(validate_config({**CFG, "algorithm": SIM}))
    S = _probs(3, 7, 10)
    T, W = algo.mixing(torch.eye(3, dtype=torch.float64), S, torch.full((3,), 1 / 3, dtype=torch.float64))
    flat = S.reshape(3, -1)
    cos = torch.tensor([[float(F.cosine_similarity(flat[i], flat[j], dim=0)) for j in range(3)] for i in range(3)])
    assert torch.allclose(W, (cos / cos.sum(1, keepdim=True)).double(), atol=1e-6)
    assert torch.allclose(T[1], sum(W[1, m] * S[m] for m in range(3)))


def test_sim_pfl_end_to_end_strict():
    res = pflbed.run({**CFG, "algorithm": SIM}, write=False)
    assert res.summary["final"]["pfl_acc"] > 0.3
    W = res.server["W"]
    assert torch.allclose(W.sum(1), torch.ones(4, dtype=torch.float64)) and (W >= 0).all()
