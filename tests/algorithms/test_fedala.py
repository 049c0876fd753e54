"""FedALA (Zhang et al., AAAI 2023, Eqs. 4-6): a sampled client aggregates the global model into its own with
element-wise weights W on the top p blocks (the lower ones overwritten), learns W by clipped gradient steps on s% of
its data (to convergence in its first aggregation, one pass after that), then trains locally; FedAvg's aggregation.
The rules are recomputed here in the code's form (Eq. 6: the gradient of the aggregated model times the update)."""

from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import pflbed
from pflbed.algorithms.base import ClientContext
from pflbed.algorithms.training import index_batches, load_params
from pflbed.config import validate_config
from pflbed.engine.build import prepare
from pflbed.errors import ConfigError

from ..tiny import TINY, same_tensors

WEIGHT = "ala/"
BN = {"model": {"name": "cnn_bn"}, "dataset": {"name": "digits"}}  # BatchNorm statistics in the body and the head


def _cfg(name="fedala", sections=None, **options):
    return validate_config({**TINY, "train": {**TINY["train"], "local_epochs": 2, "momentum": 0.0},
                            "algorithm": {"name": name, **options}, "executor": {"threads": 1},
                            **(sections or {})})  # fmt: skip


def _update(algo, payload, state, seed=7):
    data = algo.ctx.client_data(0)
    return algo.client_update(payload, state, data, ClientContext(2, 0, torch.Generator().manual_seed(seed)))


def _moved(params, scale, seed):
    """`params` with its float entries moved by Gaussian noise: another model of the same shape."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) if v.is_floating_point() else v.clone()
            for k, v in params.items()}  # fmt: skip


def _top(model, p):
    """The parameters of the top p blocks, found through the blocks themselves."""
    return [f"blocks.{b}.{n}" for b in model.top_blocks(p) for n, _ in model.blocks[b].named_parameters()]


def _ala_by_hand(algo, glob, local, weights, generator):
    """Eq. 5 in the code's form on a copy of the local model whose lower parameters are the global ones: per batch,
    the top parameters set to Θ_i + (Θ − Θ_i) ⊙ W, then W ← clip(W − η·∇_Θ̂ L ⊙ (Θ − Θ_i), 0, 1); the last batch's
    loss recorded per pass, passes until the std test (start phase) or one. Returns (W, passes)."""
    model, o, t = algo.ctx.model, algo.opts, algo.ctx.cfg.train
    data = algo.ctx.client_data(0)
    top = _top(model, o.layers)
    params = [k for k, _ in model.named_parameters()]
    start = weights is None
    w = {k: torch.ones_like(glob[k]) if start else weights[k].clone() for k in top}
    n = data.num_train
    sample = data.train[torch.randperm(n, generator=generator)[: max(1, n * o.rand_percent // 100)]]
    load_params(model, {**local, **{k: glob[k] for k in params if k not in top}})  # statistics: the local ones
    named = dict(model.named_parameters())
    model.train()
    losses = []
    for _ in range(o.max_start_epochs if start else 1):
        for b in sample.split(t.batch_size):
            with torch.no_grad():
                for k in top:
                    named[k].copy_(local[k] + (glob[k] - local[k]) * w[k])
            model.zero_grad()
            loss = F.cross_entropy(model(data.x[b]), data.y[b])
            loss.backward()
            w = {k: torch.clamp(w[k] - o.eta * named[k].grad * (glob[k] - local[k]), 0, 1) for k in top}
        losses.append(loss.item())
        if start and len(losses) > o.num_pre_loss and np.std(losses[-o.num_pre_loss :]) < o.threshold:
            break
    return w, len(losses)


def _sgd_by_hand(algo, start, generator):
    """E epochs of plain SGD on the cross-entropy from `start` (statistics moved by the training forwards)."""
    model, t, data = algo.ctx.model, algo.ctx.cfg.train, algo.ctx.client_data(0)
    load_params(model, start)
    model.train()
    params = dict(model.named_parameters())
    for b in index_batches(data.train, t.batch_size, t.local_epochs, generator):
        model.zero_grad()
        F.cross_entropy(model(data.x[b]), data.y[b]).backward()
        with torch.no_grad():
            for p in params.values():
                p.add_(p.grad, alpha=-t.lr)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _close(a, b, keys=None):
    return all(torch.allclose(a[k].double(), b[k].double(), atol=1e-5) for k in (keys or a))


def test_layers_zero_is_fedavg_bit_for_bit():
    ala = pflbed.run(_cfg(layers=0), write=False)
    avg = pflbed.run(_cfg("fedavg"), write=False)
    assert same_tensors(ala.server, avg.server) and ala.summary["final"] == avg.summary["final"]


def test_the_first_round_is_an_overwrite_and_the_start_phase_waits():
    """Θ^0 = Θ_i^0: nothing to weigh. The update is FedAvg's, and no weights are learned yet."""
    algo, avg = prepare(_cfg()), prepare(_cfg("fedavg"))
    server = algo.init_server()
    reply, state = _update(algo, server, algo.init_client(0))
    plain, _ = _update(avg, server, {})
    assert same_tensors(reply, plain)
    assert same_tensors(state, reply)  # the local model, no W


@pytest.mark.parametrize("sections", [None, BN], ids=["mlp", "cnn_bn"])
def test_a_later_round_is_eq_4_after_one_pass_of_eq_5_then_local_sgd(sections):
    """A client with weights: one pass of Eq. 5 from its W on s% of its data, Eq. 4 with the new W (the lower
    blocks global, BatchNorm statistics its own), E epochs of SGD from there; the reply is the trained model, the
    state that model and the new W."""
    algo = prepare(_cfg(sections=sections, rand_percent=60, eta=2.0))
    model = algo.ctx.model
    glob, local = _moved(algo.init_server(), 0.1, 1), _moved(algo.init_server(), 0.1, 2)
    top = _top(model, 1)
    g = torch.Generator().manual_seed(3)
    weights = {k: torch.rand(local[k].shape, generator=g) for k in top}
    reply, state = _update(algo, glob, {**local, **{WEIGHT + k: v for k, v in weights.items()}})

    gen = torch.Generator().manual_seed(7)
    w, passes = _ala_by_hand(algo, glob, local, weights, gen)
    assert passes == 1
    params = [k for k, _ in model.named_parameters()]
    start = {**local, **{k: glob[k] for k in params}}  # lower blocks and (below) top blocks: Eq. 4
    start.update({k: local[k] + (glob[k] - local[k]) * w[k] for k in top})
    expected = _sgd_by_hand(algo, start, gen)

    assert _close(reply, expected) and reply.keys() == expected.keys()
    assert _close({k: state[WEIGHT + k] for k in top}, w)
    assert set(state) == set(reply) | {WEIGHT + k for k in top}
    assert same_tensors({k: state[k] for k in reply}, reply)
    assert not _close(w, weights)  # the pass moved W


@pytest.mark.parametrize(("threshold", "cap"), [(0.01, 100), (1e-12, 4)], ids=["converged", "capped"])
def test_the_start_phase_learns_from_all_ones_until_the_loss_settles(threshold, cap):
    """A client's first aggregation that runs: W from ones, passes over the same sample until more than
    num_pre_loss last-batch losses are recorded and their std is below the threshold, or `max_start_epochs`."""
    algo = prepare(_cfg(threshold=threshold, max_start_epochs=cap, num_pre_loss=5, eta=0.5))
    glob, local = _moved(algo.init_server(), 0.2, 1), algo.init_server()  # e.g. a first-timer in a later round
    reply, state = _update(algo, glob, {})
    w, passes = _ala_by_hand(algo, glob, local, None, torch.Generator().manual_seed(7))
    assert 5 < passes < cap if cap == 100 else passes == cap
    top = _top(algo.ctx.model, 1)
    learned = {k: state[WEIGHT + k] for k in top}
    assert _close(learned, w)
    assert any(bool((v == 1).any()) and bool((v < 1).any()) for v in learned.values())  # clipped at 1, moved below


def test_the_personal_model_is_eq_4_on_the_current_global_model_or_the_trained_one():
    """`initialized`: Eq. 4 with the client's last W on the server's model, statistics the client's; without
    weights the global parameters. `trained`: the client's own model (Θ^0 before it trains)."""
    for sections in (None, BN):
        algo = prepare(_cfg(sections=sections))
        model = algo.ctx.model
        server, local = _moved(algo.init_server(), 0.1, 1), _moved(algo.init_server(), 0.1, 2)
        top = _top(model, 1)
        weights = {k: torch.rand(local[k].shape, generator=torch.Generator().manual_seed(4)) for k in top}
        params = [k for k, _ in model.named_parameters()]
        got = algo.personal_model(server, {**local, **{WEIGHT + k: v for k, v in weights.items()}}).params
        expected = {**local, **{k: server[k] for k in params},
                    **{k: local[k] + (server[k] - local[k]) * weights[k] for k in top}}  # fmt: skip
        assert _close(got, expected) and got.keys() == expected.keys()
        fresh = algo.personal_model(server, algo.init_client(0)).params
        assert same_tensors({k: fresh[k] for k in params}, {k: server[k] for k in params})
        trained = prepare(_cfg(sections=sections, personal="trained"))
        assert same_tensors(trained.personal_model(server, {**local, WEIGHT + top[0]: weights[top[0]]}).params, local)
        assert same_tensors(trained.personal_model(server, {}).params, trained.ctx.initial_params)
        x = algo.ctx.client_data(0).x[:5]
        model.eval()
        assert torch.allclose(trained.personal_model(server, local).logits(x),
                              torch.func.functional_call(model, local, (x,)), atol=1e-6)  # fmt: skip


def test_a_shared_body_is_declared_only_where_every_client_has_the_global_one():
    """With p = the head and no statistics in the body, evaluation may compute the body's features once."""
    mlp = prepare(_cfg())
    assert mlp.personal_model(mlp.init_server(), {}).feature_key is not None
    for algo in (prepare(_cfg(sections=BN)), prepare(_cfg(layers=2))):
        assert algo.personal_model(algo.init_server(), {}).feature_key is None


def test_the_start_phase_stops_after_more_than_num_pre_loss_settled_losses():
    """A loss that is settled from the first pass (std far below the threshold) stops the start phase after
    num_pre_loss + 1 passes, not num_pre_loss: the std needs more recorded losses than it covers (the code's `>`)."""
    algo = prepare(_cfg(threshold=10.0, num_pre_loss=3, eta=0.5))
    glob, local = _moved(algo.init_server(), 0.2, 1), algo.init_server()
    _, state = _update(algo, glob, {})
    w, passes = _ala_by_hand(algo, glob, local, None, torch.Generator().manual_seed(7))
    assert passes == 4
    assert _close({k: state[WEIGHT + k] for k in _top(algo.ctx.model, 1)}, w)


@pytest.mark.parametrize("rand_percent", [1, 100])
def test_the_sample_is_s_percent_of_the_client_but_at_least_one_sample(rand_percent):
    """⌊s·n_i/100⌋ samples, at least one (one sample at s = 1 % of a client of under 200), all at s = 100."""
    algo = prepare(_cfg(rand_percent=rand_percent, eta=0.5))
    assert (algo.ctx.client_data(0).num_train * rand_percent // 100 <= 1) is (rand_percent == 1)  # one sample
    glob, local = _moved(algo.init_server(), 0.2, 1), _moved(algo.init_server(), 0.1, 2)
    weights = {k: torch.full_like(local[k], 0.5) for k in _top(algo.ctx.model, 1)}
    _, state = _update(algo, glob, {**local, **{WEIGHT + k: v for k, v in weights.items()}})
    w, _ = _ala_by_hand(algo, glob, local, weights, torch.Generator().manual_seed(7))
    assert _close({k: state[WEIGHT + k] for k in w}, w) and not _close(w, weights)


def test_a_client_without_training_samples_keeps_its_weights_and_one_sample_moves_them():
    algo = prepare(_cfg(eta=0.5))
    glob, local = _moved(algo.init_server(), 0.2, 1), _moved(algo.init_server(), 0.1, 2)
    data = algo.ctx.client_data(0)
    weights = {k: torch.full_like(local[k], 0.5) for k in _top(algo.ctx.model, 1)}
    for n, moved in [(0, False), (1, True)]:
        few = replace(data, train=data.train[:n])
        w = algo.learn_weights(glob, local, weights, few, torch.Generator().manual_seed(7))
        assert w.keys() == weights.keys() and _close(w, weights) is not moved, n


def test_every_block_may_be_weighed_and_no_more():
    blocks = len(prepare(_cfg()).ctx.model.block_names())
    assert prepare(_cfg(layers=blocks)).lower == []
    with pytest.raises(ConfigError, match=rf"^algorithm.layers: the model has {blocks} blocks; choose 0 to {blocks} "
                       rf"\(got {blocks + 1}\)$"):  # fmt: skip
        prepare(_cfg(layers=blocks + 1))


@pytest.mark.parametrize("case", ["plain", "dropout", "augment"])
def test_the_start_phases_cache_of_the_lower_blocks_changes_nothing(case):
    """The start phase computes a batch's lower-block output once only where it is the same on every pass; with
    dropout below the top or augmentation every pass draws again, exactly as without the cache."""
    sections = {"plain": None, "dropout": {"model": {"name": "alexnet_small_x025"}, "dataset": {"name": "digits"}},
                "augment": {"dataset": {"name": "digits", "augment": ["crop", "flip"]}}}[case]  # fmt: skip
    algo = prepare(_cfg(sections=sections, num_pre_loss=2, max_start_epochs=3, threshold=1e-12, eta=0.5))
    assert algo.fixed_lower is (case == "plain")
    glob, local = _moved(algo.init_server(), 0.2, 1), algo.init_server()
    data = algo.ctx.client_data(0)
    torch.manual_seed(0)
    cached = algo.learn_weights(glob, local, None, data, torch.Generator().manual_seed(7))
    algo.fixed_lower = False
    torch.manual_seed(0)
    fresh = algo.learn_weights(glob, local, None, data, torch.Generator().manual_seed(7))
    assert same_tensors(cached, fresh)
