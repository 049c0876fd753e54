"""Shared training helpers (`pflbed.algorithms.training`), checked against hand-written references on tiny tensors.

The references below never call the helper they check: SGD is written out by hand (torch.optim.SGD's update,
d = g + wd·p; b = d on the first step, b = μ·b + d after; p ← p − lr·b), and batches are drawn with the
documented rule (one `torch.randperm` of the client's training indices per epoch, split into batches).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pflbed.algorithms.base import Budget, ClientData
from pflbed.algorithms.training import (
    finetune_epochs,
    get_params,
    index_batches,
    load_params,
    sgd_epochs,
    train_from,
    weighted_mean,
)
from pflbed.config import TrainConfig
from pflbed.models import BlockNet


def _data(n=14, d=4, classes=3, seed=0):
    """A tiny client: n pool samples, of which the first n−4 are its training indices (the rest are not)."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, d, generator=g), torch.randint(0, classes, (n,), generator=g)
    return ClientData(0, x, y, torch.arange(n - 4), torch.arange(n - 4, n), torch.full((classes,), 1 / classes))


def _bn_net(seed=0, d=4, hidden=6, classes=3):
    torch.manual_seed(seed)
    body = nn.Sequential(nn.Linear(d, hidden), nn.BatchNorm1d(hidden), nn.ReLU())
    return BlockNet([("body", body), ("head", nn.Linear(hidden, classes))])


def _hand_batches(idx, batch_size, epochs, seed):
    """The documented batching rule: a fresh permutation of `idx` per epoch, cut into `batch_size` pieces."""
    g = torch.Generator().manual_seed(seed)
    return [[idx[p] for p in torch.randperm(len(idx), generator=g).split(batch_size)] for _ in range(epochs)]


def _hand_sgd(model, params, data, *, epochs, batch_size, lr, momentum, weight_decay, seed, loss_fn=F.cross_entropy,
              forward=None):  # fmt: skip
    """Mini-batch SGD written out by hand over `params` (one momentum buffer per parameter for all epochs).

    Returns the per-epoch mean of the batch losses (computed before each step)."""
    bufs, means = [None] * len(params), []
    fwd = forward or model
    for epoch in _hand_batches(data.train, batch_size, epochs, seed):
        model.train()
        losses = []
        for b in epoch:
            loss = loss_fn(fwd(data.x[b]), data.y[b])
            grads = torch.autograd.grad(loss, params)
            with torch.no_grad():
                for i, (p, g) in enumerate(zip(params, grads, strict=True)):
                    d = g + weight_decay * p
                    bufs[i] = d.clone() if bufs[i] is None else momentum * bufs[i] + d
                    p -= lr * bufs[i]
            losses.append(float(loss.detach()))
        means.append(sum(losses) / len(losses))
    return means


def test_index_batches_are_a_fresh_permutation_every_epoch():
    """index_batches: every epoch visits each index once, in a new random order, batches of B, last one smaller."""
    idx = torch.arange(10) + 100
    got = list(index_batches(idx, 4, 3, torch.Generator().manual_seed(5)))
    assert [len(b) for b in got] == [4, 4, 2] * 3
    expected = [b for epoch in _hand_batches(idx, 4, 3, 5) for b in epoch]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    epochs = [torch.cat(got[i : i + 3]) for i in (0, 3, 6)]
    assert all(torch.equal(e.sort().values, idx) for e in epochs)  # each epoch: a permutation of idx
    assert not torch.equal(epochs[0], epochs[1]) and not torch.equal(epochs[0], idx)  # reshuffled, not in order


def test_train_from_is_hand_sgd_with_the_configured_momentum_and_weight_decay():
    """train_from: load `start`, then `local_epochs` of SGD (lr, momentum, weight decay, batch size of the config)
    on the client's training indices only, one optimizer (one momentum history) for all epochs of the call."""
    data = _data()
    train = TrainConfig(local_epochs=2, batch_size=4, lr=0.2, momentum=0.5, weight_decay=0.1)
    torch.manual_seed(1)
    model, ref = nn.Linear(4, 3), nn.Linear(4, 3)
    start = get_params(model)
    load_params(ref, start)
    with torch.no_grad():
        model.weight.fill_(7.0)  # whatever the model holds before: train_from starts from `start`
    out = train_from(model, start, data, train, torch.Generator().manual_seed(3))
    _hand_sgd(ref, list(ref.parameters()), data, epochs=2, batch_size=4, lr=0.2, momentum=0.5, weight_decay=0.1,
              seed=3)  # fmt: skip
    assert set(out) == {"weight", "bias"}
    for k, v in get_params(ref).items():
        assert torch.allclose(out[k], v, atol=1e-6), k
    # stateless across calls: the same call again (momentum restarts) gives the same result
    again = train_from(model, start, data, train, torch.Generator().manual_seed(3))
    assert all(torch.equal(again[k], out[k]) for k in out)
    assert not torch.equal(start["weight"], out["weight"])  # get_params copies: the start was not trained in place


def test_sgd_epochs_yields_the_mean_batch_loss_and_trains_only_params():
    """sgd_epochs: `params` restricts what moves, `forward`/`loss_fn` replace model(x)/CE, and every epoch yields
    the mean of that epoch's batch losses."""
    data = _data()
    torch.manual_seed(2)
    model, ref = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 3)), nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 3))
    ref.load_state_dict(model.state_dict())
    frozen = {k: v.clone() for k, v in model[0].state_dict().items()}
    loss_fn = lambda out, y: F.cross_entropy(2 * out, y)  # noqa: E731
    got = list(sgd_epochs(model, data, epochs=2, batch_size=3, lr=0.1, momentum=0.3,
                          generator=torch.Generator().manual_seed(9), params=model[1].parameters(),
                          loss_fn=loss_fn, forward=lambda x: model(x) + 1.0))  # fmt: skip
    expected = _hand_sgd(ref, list(ref[1].parameters()), data, epochs=2, batch_size=3, lr=0.1, momentum=0.3,
                         weight_decay=0.0, seed=9, loss_fn=loss_fn, forward=lambda x: ref(x) + 1.0)  # fmt: skip
    assert got == pytest.approx(expected, rel=1e-5)
    assert all(torch.equal(model[0].state_dict()[k], v) for k, v in frozen.items())
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(model[1].parameters(), ref[1].parameters(), strict=True))


def test_sgd_epochs_trains_in_training_mode_every_epoch():
    """A consumer may evaluate (eval mode) between two epochs; the next epoch must train in training mode again
    (BatchNorm uses and updates batch statistics)."""
    net, data = _bn_net(), _data()
    epochs = sgd_epochs(net, data, epochs=2, batch_size=4, lr=0.1, generator=torch.Generator().manual_seed(0))
    next(epochs)
    net.eval()
    after_first = net.blocks.body[1].running_mean.clone()
    next(epochs)
    assert not torch.equal(net.blocks.body[1].running_mean, after_first)


def test_weighted_mean_normalizes_the_weights_and_takes_only_the_given_keys():
    """Σ_m w_m·x_m / Σ_m w_m with unnormalized weights over three replies; integer tensors take the max; `keys`
    restricts the output."""
    replies = {
        c: {"w": torch.tensor([float(c), 2.0 * c]), "n": torch.tensor([3, 7, 5][c]), "other": torch.tensor([9.0])}
        for c in (0, 1, 2)
    }
    out = weighted_mean(replies, {0: 2.0, 1: 5.0, 2: 13.0}, keys=["w", "n"])
    assert set(out) == {"w", "n"}
    assert torch.allclose(out["w"], torch.tensor([(5 * 1 + 13 * 2) / 20, (5 * 2 + 13 * 4) / 20]))
    assert out["n"].dtype == torch.int64 and int(out["n"]) == 7  # the max, neither the first nor the last


@pytest.mark.parametrize("method", ["ft", "lp"])
def test_finetune_epochs_matches_hand_sgd(method):
    """finetune_epochs from `start`: ft trains every parameter (training mode); lp freezes the body — its features
    computed once in eval mode, so BatchNorm statistics are untouched — and trains the head alone on them.

    Both use the budget's lr and momentum, no weight decay, and yield a snapshot after every epoch."""
    data = _data(n=20)
    budget = Budget(method, 2, 0.1, 4, momentum=0.5)
    net, ref = _bn_net(seed=0), _bn_net(seed=0)
    with torch.no_grad():  # a start whose BN statistics are not the defaults (so eval vs train mode differ)
        ref.blocks.body[1].running_mean.fill_(0.5)
        ref.blocks.body[1].running_var.fill_(2.0)
    start = get_params(ref)
    yielded = list(finetune_epochs(net, start, data, budget, torch.Generator().manual_seed(4)))
    assert len(yielded) == 2 and yielded[0].params is not yielded[1].params
    assert not all(torch.equal(yielded[0].params[k], yielded[1].params[k]) for k in start)  # snapshots
    head = {"blocks.head.weight", "blocks.head.bias"}
    if method == "ft":
        _hand_sgd(ref, list(ref.parameters()), data, epochs=2, batch_size=4, lr=0.1, momentum=0.5, weight_decay=0.0,
                  seed=4)  # fmt: skip
        expected = get_params(ref)
    else:
        ref.eval()
        with torch.no_grad():
            feats = ref.features(data.x[data.train])
        on_feats = ClientData(0, feats, data.y[data.train], torch.arange(len(feats)), data.val[:0], data.prior)
        _hand_sgd(ref.blocks.head, list(ref.blocks.head.parameters()), on_feats, epochs=2, batch_size=4, lr=0.1,
                  momentum=0.5, weight_decay=0.0, seed=4)  # fmt: skip
        expected = get_params(ref)
        assert all(torch.equal(expected[k], start[k]) for k in start if k not in head)  # body and its BN stats
        stats = net.blocks.body[1]
        assert torch.equal(stats.running_mean, start["blocks.body.1.running_mean"])  # no train-mode forward
    got = yielded[-1].params
    assert set(got) == set(start)
    for k, v in expected.items():
        assert torch.allclose(got[k], v, atol=1e-6), k


def test_fresh_client_params_are_seeded_by_run_seed_and_client_only():
    """fresh_client_params: the model's default init drawn from the (seed, INIT, 1 + cid) stream — a function of
    (run seed, client id) alone (not of the global RNG or what the model held), never the stream of the run's
    initial model (seed, INIT) (= key 0, hence the 1 +), different per client and per seed."""
    from pflbed import rng
    from pflbed.algorithms.training import fresh_client_params

    def net():
        return BlockNet([("body", nn.Sequential(nn.Linear(4, 6), nn.ReLU())), ("head", nn.Linear(6, 3))])

    def drawn_from(*keys):  # the stream's default init, written out: the same modules reset in order
        torch.manual_seed(rng.derive_seed(*keys))
        return get_params(net())

    model = net()
    torch.manual_seed(123)
    global_state = torch.get_rng_state()
    got = {c: fresh_client_params(model, 7, c) for c in (0, 1, 2)}
    assert torch.equal(torch.get_rng_state(), global_state)  # the global stream is left where it was
    for c in (0, 1, 2):
        expected = drawn_from(7, rng.INIT, 1 + c)
        assert set(got[c]) == set(expected) and all(torch.equal(got[c][k], expected[k]) for k in expected), c
    initial = drawn_from(7, rng.INIT)  # the run's initial model on this architecture
    w = "blocks.body.0.weight"
    assert all(not torch.equal(got[c][w], initial[w]) for c in (0, 1, 2))
    assert not torch.equal(fresh_client_params(model, 8, 0)[w], got[0][w])


def test_epoch_mean_loss_of_a_single_batch_epoch_is_that_batch_loss():
    """sgd_epochs yields Σ batch losses / number of batches — also when an epoch is one batch (divide by 1)."""
    data = _data()  # 10 training samples, batch 16: one batch per epoch
    torch.manual_seed(3)
    model, ref = nn.Linear(4, 3), nn.Linear(4, 3)
    ref.load_state_dict(model.state_dict())
    got = list(sgd_epochs(model, data, epochs=2, batch_size=16, lr=0.1, generator=torch.Generator().manual_seed(1)))
    expected = _hand_sgd(ref, list(ref.parameters()), data, epochs=2, batch_size=16, lr=0.1, momentum=0.0,
                         weight_decay=0.0, seed=1)  # fmt: skip
    assert got == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("epochs", [1, 3])
def test_local_sgd_returns_the_mean_of_the_epoch_mean_losses(epochs):
    """local_sgd: `sgd_epochs` to the end, returning the mean over epochs of the per-epoch mean losses."""
    from pflbed.algorithms.training import local_sgd

    data = _data()
    torch.manual_seed(4)
    model, ref = nn.Linear(4, 3), nn.Linear(4, 3)
    ref.load_state_dict(model.state_dict())
    got = local_sgd(model, data, epochs=epochs, batch_size=4, lr=0.1, generator=torch.Generator().manual_seed(2))
    means = _hand_sgd(ref, list(ref.parameters()), data, epochs=epochs, batch_size=4, lr=0.1, momentum=0.0,
                      weight_decay=0.0, seed=2)  # fmt: skip
    assert got == pytest.approx(sum(means) / epochs, rel=1e-6)


def test_weighted_mean_of_one_reply_and_of_integer_tensors():
    """A round with a single sampled client aggregates to that client's reply; integer tensors of any shape take
    the element-wise maximum over the replies."""
    one = {5: {"w": torch.tensor([1.5, -2.0]), "n": torch.tensor([3, 1])}}
    out = weighted_mean(one, {5: 7.0})
    assert torch.equal(out["w"], one[5]["w"]) and torch.equal(out["n"], one[5]["n"])
    two = {0: {"n": torch.tensor([3, 9, 1])}, 1: {"n": torch.tensor([4, 2, 1])}}
    assert torch.equal(weighted_mean(two, {0: 1.0, 1: 1.0})["n"], torch.tensor([4, 9, 1]))
    below = {0: {"n": torch.tensor([-3, -9])}, 1: {"n": torch.tensor([-4, -2])}}  # the replies' maximum, not 0's
    assert torch.equal(weighted_mean(below, {0: 1.0, 1: 1.0})["n"], torch.tensor([-3, -2]))


def test_get_params_copies_exactly_the_requested_keys():
    """get_params(model, keys): detached copies of those state entries only (all of them without `keys`)."""
    net = _bn_net()
    keys = ["blocks.head.weight", "blocks.body.1.running_mean"]
    got = get_params(net, keys)
    assert list(got) == keys
    assert all(torch.equal(got[k], net.state_dict()[k]) for k in keys)
    assert got["blocks.head.weight"].data_ptr() != net.blocks.head.weight.data_ptr()
    assert set(get_params(net)) == set(net.state_dict())


def test_lp_cached_features_are_keyed_by_the_start():
    """lp predictors declare a shared body keyed by their start state: predictors from two different starts,
    evaluated with one prediction cache, each keep their own body features."""
    from types import SimpleNamespace

    from pflbed.evaluation.evaluate import Predictions

    data = _data(n=20)
    net = _bn_net()
    gen = torch.Generator().manual_seed(5)  # two starts with clearly different bodies and non-degenerate heads
    starts = [{k: 2 * torch.randn(v.shape, generator=gen) if k.endswith("weight") else v for k, v in
               get_params(net).items()} for _ in range(2)]  # fmt: skip
    preds = [list(finetune_epochs(net, s, data, Budget("lp", 1, 0.1, 4), torch.Generator().manual_seed(0)))[-1]
             for s in starts]  # fmt: skip
    x = torch.randn(30, 4, generator=torch.Generator().manual_seed(9))
    P = Predictions(SimpleNamespace(test=SimpleNamespace(x=x)), 1024)
    idx = torch.arange(30)
    assert not torch.equal(preds[0].logits(x).argmax(1), preds[1].logits(x).argmax(1))
    for p in preds:
        assert torch.equal(P(p, "test", idx), p.logits(x).argmax(1))


def test_lp_features_of_a_freed_start_are_never_read_for_a_later_start():
    """CPython gives a new dict the address of one just freed. A feature key of the start's id would then score a
    later client's lp predictor on an earlier client's body features (one prediction cache serves every client
    of `evaluate_personalized` and of the new-client protocol): the key must hold the start itself."""
    from types import SimpleNamespace

    from pflbed.evaluation.evaluate import Predictions

    data, net = _data(n=20), _bn_net()
    x = torch.randn(30, 4, generator=torch.Generator().manual_seed(9))
    P = Predictions(SimpleNamespace(test=SimpleNamespace(x=x)), 1024)
    idx = torch.arange(30)
    seen = set()
    for seed in range(6):
        gen = torch.Generator().manual_seed(seed)
        start = {k: 2 * torch.randn(v.shape, generator=gen) if k.endswith("weight") else v
                 for k, v in get_params(net).items()}  # fmt: skip
        pred = list(finetune_epochs(net, start, data, Budget("lp", 1, 0.1, 4), torch.Generator().manual_seed(0)))[-1]
        seen.add(pred.logits(x).argmax(1).tolist().__repr__())
        del start  # only the cache may keep it now
        assert torch.equal(P(pred, "test", idx), pred.logits(x).argmax(1))
        P.forget_models()  # as between clients
    assert len(seen) > 1  # the bodies differ, so a wrong body's features would show
