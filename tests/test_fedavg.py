import pytest
import torch

import pflbed
from pflbed.algorithms.training import weighted_mean

from .tiny import TINY


def test_weighted_mean_hand_computed():
    replies = {
        0: {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)},
        1: {"w": torch.tensor([4.0, 8.0]), "n": torch.tensor(5)},
    }
    out = weighted_mean(replies, {0: 1, 1: 3})
    assert torch.allclose(out["w"], torch.tensor([0.25 * 1 + 0.75 * 4, 0.25 * 2 + 0.75 * 8]))
    assert int(out["n"]) == 5  # integer buffers (BN batch counters) take the max


def test_one_round_is_weighted_mean_of_local_sgd():
    """Server after round 1 == Σ |D_m|/|D| · (the client's own SGD result from the initial model)."""
    cfg = {
        **TINY,
        "train": {**TINY["train"], "rounds": 1},
        "federation": {**TINY["federation"], "sample_fraction": 1.0},
    }
    res = pflbed.run({**cfg, "algorithm": {"name": "fedavg"}}, write=False)
    algo = res.executor.algo
    fed = algo.ctx.federation
    from pflbed.algorithms.base import ClientContext
    from pflbed.engine import rng

    replies, weights = {}, {}
    for c in fed.participated:
        seed = rng.derive_seed(0, rng.CLIENT, 1, c)
        reply, _ = algo.client_update(
            algo.ctx.initial_params,
            {},
            algo.ctx.client_data(c),
            ClientContext(1, c, torch.Generator().manual_seed(seed)),
        )
        replies[c], weights[c] = reply, fed.num_train(c)
    total = sum(weights.values())
    for k, v in res.server.items():
        expected = sum(weights[c] / total * replies[c][k] for c in replies)
        assert torch.allclose(v, expected, atol=1e-6), k


def test_fedavg_learns_end_to_end_in_strict_mode():
    res = pflbed.run(
        {**TINY, "algorithm": {"name": "fedavg"}, "eval": {"every": 2, "finetune": ["ft", "lp"]}}, write=False
    )
    f = res.summary["final"]
    assert f["gfl_acc"] > 0.3 and f["pfl_acc"] > 0.3  # 10 balanced classes: chance is 0.1
    assert f["ft"]["pfl_acc"] is not None and f["lp"]["pfl_acc"] is not None
    comm = res.summary["communication"]
    n_params = sum(v.numel() * v.element_size() for v in res.server.values())
    assert comm["down_bytes_per_round"] == comm["up_bytes_per_round"] == n_params * 3  # 3 clients sampled


@pytest.mark.parametrize("method", ["ft", "lp"])
def test_personalize_lp_changes_only_the_head(method):
    res = pflbed.run({**TINY, "algorithm": {"name": "fedavg"}}, write=False)
    algo = res.executor.algo
    from pflbed.algorithms.base import Budget
    from pflbed.evaluation.evaluate import last

    p = last(algo.personalize(res.server, algo.ctx.client_data(0), Budget(method, 1, 0.1, 8), torch.Generator()))
    head = set(algo.ctx.model.state_keys(algo.ctx.model.head_blocks()))
    changed = {k for k in res.server if not torch.equal(res.server[k], p.params[k])}
    assert changed == set(res.server) if method == "ft" else changed == head


def test_intermediate_evaluations_may_use_a_balanced_test_subsample():
    from pflbed.evaluation.evaluate import subsampled

    evaluation = {"every": 1, "finetune": [], "test_subsample": 5}
    res = pflbed.run({**TINY, "algorithm": {"name": "fedavg"}, "eval": evaluation}, write=False)
    assert [h["full_test"] for h in res.history] == [False, False, False, True]
    ctx = res.executor.algo.ctx
    view = subsampled(ctx, 5).federation
    y = ctx.source.test.y[view.global_test]
    assert (torch.bincount(y, minlength=10) == 5).all() and set(view.global_test.tolist()) <= set(
        ctx.federation.global_test.tolist()
    )
    assert torch.equal(subsampled(ctx, 5).federation.global_test, view.global_test)  # fixed subset
