import torch

import pflbed
from pflbed.config import validate_config
from pflbed.engine.loop import prepare

from .test_ktpfl import CFG, HETERO, _probs

FEDMD = {**HETERO, "name": "fedmd"}


def test_fedmd_target_is_the_uniform_consensus():
    algo = prepare(validate_config({**CFG, "algorithm": FEDMD}))
    S = _probs(3, 7, 10)
    T, W = algo.mixing(torch.eye(3, dtype=torch.float64), S, torch.full((3,), 1 / 3, dtype=torch.float64))
    assert torch.allclose(T, S.mean(0).expand_as(T)) and torch.allclose(W, torch.full_like(W, 1 / 3))


def test_fedmd_end_to_end_strict():
    res = pflbed.run({**CFG, "algorithm": FEDMD}, write=False)
    assert res.summary["final"]["pfl_acc"] > 0.3
    assert res.summary["communication"]["up_bytes_per_round"] == 4 * 100 * 10 * 4  # soft predictions only
    assert torch.allclose(res.server["W"], torch.full((4, 4), 0.25, dtype=torch.float64))
