import pytest
import torch
from torch import nn

import pflbed
from pflbed.algorithms.base import ClientContext, Predictor
from pflbed.algorithms.training import train_from, weighted_mean
from pflbed.config import validate_config
from pflbed.engine.build import prepare
from pflbed.evaluation.evaluate import Predictions, client_scores
from pflbed.models import MODELS, BlockNet

from ..tiny import TINY


def _bn_mlp(input_shape, num_classes):
    """A tiny model with a BatchNorm layer (running statistics and an integer batch counter)."""
    d = int(torch.tensor(input_shape).prod())
    return BlockNet([("body", nn.Sequential(nn.Flatten(), nn.Linear(d, 8), nn.BatchNorm1d(8), nn.ReLU())),
                     ("head", nn.Linear(8, num_classes))])  # fmt: skip


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
    from pflbed import rng
    from pflbed.algorithms.base import ClientContext

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


def test_client_update_trains_from_the_payload_and_momentum_restarts():
    """Client: E epochs of the configured SGD from the payload w_t (not from any earlier model), nothing kept on
    the client; with momentum configured, every call starts without momentum history (same call, same result)."""
    algo = prepare(validate_config({**TINY, "train": {**TINY["train"], "momentum": 0.9, "weight_decay": 0.01},
                                    "algorithm": {"name": "fedavg"}}))  # fmt: skip
    c = algo.ctx.federation.participated[0]
    data = algo.ctx.client_data(c)
    payload = {k: v + 0.01 * torch.randn_like(v) for k, v in algo.ctx.initial_params.items()}  # some w_t ≠ w_0
    replies = []
    for _ in range(2):
        reply, state = algo.client_update(payload, {}, data, ClientContext(2, c, torch.Generator().manual_seed(3)))
        assert state == {}
        replies.append(reply)
    expected = train_from(algo.ctx.new_model(), payload, data, algo.ctx.cfg.train, torch.Generator().manual_seed(3))
    assert set(replies[0]) == set(expected)
    for k, v in expected.items():
        assert torch.equal(replies[0][k], v) and torch.equal(replies[1][k], v), k


def test_whole_state_dict_with_batchnorm_statistics_is_uploaded_and_averaged(monkeypatch):
    """FedAvg averages the whole state dict: BN running statistics are uploaded and |D_m|-averaged like every
    parameter (a peer-library trap is to silently never aggregate them); integer batch counters take the max."""
    monkeypatch.setitem(MODELS, "bn_mlp", _bn_mlp)
    algo = prepare(validate_config({**TINY, "model": {"name": "bn_mlp"}, "algorithm": {"name": "fedavg"}}))
    server = algo.init_server()
    assert set(server) == set(algo.ctx.initial_params) and all(
        torch.equal(server[k], v) for k, v in algo.ctx.initial_params.items()
    )
    cids = algo.ctx.federation.participated[:3]
    payloads = algo.configure(1, server, cids)
    replies = {}
    for c in cids:
        cctx = ClientContext(1, c, torch.Generator().manual_seed(c))
        replies[c], _ = algo.client_update(payloads[c], {}, algo.ctx.client_data(c), cctx)
    stats = "blocks.body.2.running_mean"
    for c in cids:
        assert set(payloads[c]) == set(replies[c]) == set(server)
        assert not torch.equal(replies[c][stats], server[stats])  # re-estimated on the client's data
    replies[cids[1]]["blocks.body.2.num_batches_tracked"] += 5  # counters differ: the max is kept
    weights = {c: algo.ctx.federation.num_train(c) for c in cids}
    out = algo.aggregate(1, server, replies, weights)
    assert set(out) == set(server)
    total = sum(weights.values())
    for k, v in out.items():
        if v.is_floating_point():
            assert torch.allclose(v, sum(weights[c] / total * replies[c][k] for c in cids), atol=1e-6), k
        else:
            assert torch.equal(v, replies[cids[1]][k]), k


def test_fedavg_learns_end_to_end_in_strict_mode():
    """Reference: the same clients' scores under the initial model that never trained. The aggregated model must
    beat it by a wide margin (seed 0: 0.47 vs 0.11), which a round that loses the client updates does not."""
    res = pflbed.run(
        {**TINY, "algorithm": {"name": "fedavg"}, "eval": {"every": 2, "finetune": ["ft", "lp"]}}, write=False
    )
    f = res.summary["final"]
    algo = res.executor.algo
    fed = algo.ctx.federation
    untrained, _ = client_scores({c: Predictor(algo.ctx.model, algo.ctx.initial_params) for c in fed.participated},
                                 algo.ctx, Predictions(algo.ctx.source, 1024))  # fmt: skip
    assert f["gfl_acc"] > 0.3 and f["pfl_acc"] > sum(untrained.values()) / len(untrained) + 0.2
    # the personal model of FedAvg is the global model: every client is scored with the server's parameters
    assert algo.personal_model(res.server, {}).params is res.server
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


@pytest.mark.parametrize("method", ["ft", "lp"])
def test_default_personalization_draws_batches_from_the_given_generator_only(method):
    """`Algorithm.personalize` (FedAvg+FT / +LP): fine-tuning depends on the generator the protocol derives for the
    client, never on torch's global RNG — same generator, same model whatever the global state; another differs."""
    from pflbed.algorithms.base import Budget
    from pflbed.evaluation.evaluate import last

    algo = prepare(validate_config({**TINY, "algorithm": {"name": "fedavg"}}))
    server, data = algo.init_server(), algo.ctx.client_data(algo.ctx.federation.participated[0])

    def adapt(seed, global_seed):
        torch.manual_seed(global_seed)
        gen = torch.Generator().manual_seed(seed)
        return last(algo.personalize(server, data, Budget(method, 1, 0.1, 8), gen)).params

    a, b, c = adapt(1, 0), adapt(1, 99), adapt(2, 0)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_zero_shot_model_of_a_new_client_is_the_global_model():
    """`Algorithm.zero_shot` default: a new client without adaptation gets the generic model of the server state."""
    algo = prepare(validate_config({**TINY, "algorithm": {"name": "fedavg"}}))
    torch.manual_seed(0)
    server = {k: v + 0.1 * torch.randn_like(v) for k, v in algo.init_server().items()}
    zs = algo.zero_shot(server, algo.ctx.client_data(0))
    assert zs.model is algo.ctx.model and zs.params is server
