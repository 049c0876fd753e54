import torch

import pflbed
from pflbed.config import validate_config
from pflbed.engine.loop import prepare

from .test_ktpfl import CFG, HETERO

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


def test_topk_pfl_end_to_end_strict():
    res = pflbed.run({**CFG, "algorithm": TOPK}, write=False)
    assert res.summary["final"]["pfl_acc"] > 0.3
    W = res.server["W"]
    assert torch.allclose(W.sum(1), torch.ones(4, dtype=torch.float64)) and ((W == 0) | (W == 0.5)).all()
