"""kNN-Per (Marfoq et al., ICML 2022): FedAvg training; a client's model is λ·p_kNN + (1 − λ)·p_model, p_kNN the
exp(−d/T)-weighted vote of the k nearest stored features of the client's own training samples, λ tuned on
validation."""

import math
from dataclasses import replace

import pytest
import torch

import pflbed
from pflbed.algorithms import knnper
from pflbed.algorithms.base import Budget, Predictor
from pflbed.algorithms.knnper import knn_probs
from pflbed.algorithms.training import validation_data
from pflbed.config import validate_config
from pflbed.engine.build import prepare
from pflbed.evaluation.evaluate import Predictions, client_score, evaluate
from pflbed.evaluation.newclients import subset

from ..tiny import TINY, same_tensors


def _cfg(name="knnper", federation=None, **options):
    fed = {**TINY["federation"], **(federation or {})}
    return validate_config({**TINY, "federation": fed, "algorithm": {"name": name, **options},
                            "executor": {"threads": 1}})  # fmt: skip


def _algo(**options):
    return prepare(_cfg(**options))


def _features(algo, params, idx):
    model = algo.ctx.model
    Predictor(model, params).logits(algo.ctx.source.train.x[:1])  # load params, eval mode
    with torch.no_grad():
        return model.features(algo.ctx.source.train.x[idx])


# --- the kNN model on hand-made features ---------------------------------------------------------------------
KEYS = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, -2.0], [2.0, 0.0], [3.0, 0.0], [0.0, 5.0]])
LABELS = torch.tensor([0, 1, 1, 2, 0, 2])


def test_knn_probabilities_by_hand():
    """q = (0, 0), k = 3, T = 2, squared L2: distances 1, 1, 4, 4, 9, 25; the 3 nearest are keys 0, 1 and — of
    the two at 4 — key 2 (lower index); weights e^(−1/2), e^(−1/2), e^(−2)."""
    q = torch.tensor([[0.0, 0.0]])
    p = knn_probs(q, KEYS, LABELS, 3, k=3, temperature=2.0)
    a, c = math.exp(-1 / 2), math.exp(-4 / 2)
    want = torch.tensor([[a / (2 * a + c), (a + c) / (2 * a + c), 0.0]])
    assert torch.allclose(p, want, atol=1e-6)


def test_knn_probabilities_by_hand_plain_l2_and_class_ties():
    """Plain L2 (distances 1, 1, 2) and a query equidistant from two keys of different classes (k = 2)."""
    q = torch.tensor([[0.0, 0.0], [0.5, 0.5]])
    p = knn_probs(q, KEYS, LABELS, 3, k=3, temperature=0.5, distance="euclidean")
    a, c = math.exp(-1 / 0.5), math.exp(-2 / 0.5)
    assert torch.allclose(p[0], torch.tensor([a / (2 * a + c), (a + c) / (2 * a + c), 0.0]), atol=1e-6)
    p2 = knn_probs(q[1:], KEYS, LABELS, 3, k=2, temperature=1.0)
    assert torch.allclose(p2, torch.tensor([[0.5, 0.5, 0.0]]))
    assert int(p2.argmax(1)) == 0  # a tie between classes goes to the lower class


def test_k_beyond_the_datastore_and_chunks(monkeypatch):
    """k larger than the datastore uses all of it; queries in small chunks give the same probabilities."""
    g = torch.Generator().manual_seed(0)
    z, keys = torch.randn(50, 4, generator=g), torch.randn(30, 4, generator=g)
    labels = torch.randint(0, 5, (30,), generator=g)
    whole = knn_probs(z, keys, labels, 5, k=7, temperature=3.0)
    monkeypatch.setattr(knnper, "CHUNK_ELEMENTS", 64)
    assert torch.allclose(knn_probs(z, keys, labels, 5, k=7, temperature=3.0), whole)
    everything = knn_probs(z, keys, labels, 5, k=100, temperature=3.0)
    assert torch.allclose(everything, knn_probs(z, keys, labels, 5, k=30, temperature=3.0))


def test_default_kernel_divides_the_distance_by_the_feature_dimension_and_seven_neighbours_vote():
    """The authors' kernel exp(−d/D) (D = 2 here) and k = 7 as defaults. q = (0, 0): squared distances 1, 1, 4, 4,
    9, 25 (all six keys vote, k = 7 > 6); weights e^(−1/2)·2, e^(−2)·2, e^(−9/2), e^(−25/2) by key."""
    opts = knnper.KNNPerOptions()
    assert (opts.k, opts.temperature) == (7, None)
    p = knn_probs(torch.tensor([[0.0, 0.0]]), KEYS, LABELS, 3, k=opts.k, temperature=opts.temperature)
    w = [math.exp(-d / 2) for d in (1, 1, 4, 4, 9, 25)]
    want = torch.tensor([[w[0] + w[4], w[1] + w[2], w[3] + w[5]]]) / sum(w)
    assert torch.allclose(p, want, atol=1e-6)


# --- the personal model ---------------------------------------------------------------------------------------
def test_lambda_zero_is_the_global_model_exactly():
    algo = _algo(lam=0.0)
    server = algo.init_server()
    x = algo.ctx.source.train.x
    pred = algo.personal_model(server, algo.init_client(2))
    assert torch.equal(pred.logits(x), algo.generic_model(server).logits(x))


def test_lambda_one_is_the_knn_classifier_on_the_clients_train_features():
    algo = _algo(lam=1.0, k=5, temperature=3.0)
    server, data = algo.init_server(), algo.ctx.client_data(1)
    pred = algo.personal_model(server, algo.init_client(1))
    idx = data.train.sort().values
    keys, z = _features(algo, server, idx), _features(algo, server, data.val)
    want = torch.zeros(len(z), algo.ctx.source.num_classes)
    for i in range(len(z)):  # one query at a time, by definition
        d = ((keys - z[i]) ** 2).sum(1).double()
        nb = torch.argsort(d, stable=True)[:5]
        w = torch.exp(-d[nb] / 3.0)
        for j, wj in zip(nb.tolist(), w.tolist(), strict=True):
            want[i, int(data.y[idx[j]])] += wj / float(w.sum())
    got = pred.logits(data.x[data.val])
    assert torch.allclose(got, want, atol=1e-5)


def test_the_interpolation_is_of_probabilities():
    algo = _algo(lam=0.3)
    server, data = algo.init_server(), algo.ctx.client_data(4)
    pred = algo.personal_model(server, algo.init_client(4))
    x = data.x[data.val]
    p_knn = knn_probs(_features(algo, server, data.val), _features(algo, server, data.train.sort().values),
                      data.y[data.train.sort().values], algo.ctx.source.num_classes, algo.opts.k,
                      algo.opts.temperature)  # fmt: skip
    model_p = torch.softmax(algo.generic_model(server).logits(x), 1)
    assert torch.allclose(pred.logits(x), 0.3 * p_knn + 0.7 * model_p, atol=1e-6)


def test_datastore_holds_exactly_capacity_training_samples():
    """Capacity counts samples: the datastore holds `capacity` of the client's training samples — never val or
    test samples — drawn by the client's own generator (the same every time, another subset for another client)."""
    algo = _algo(capacity=7)
    server = algo.init_server()
    fed = algo.ctx.federation
    data = algo.ctx.client_data(0)
    idx = algo.datastore_indices(data)
    assert idx.numel() == 7 == idx.unique().numel()
    assert set(idx.tolist()) <= set(data.train.tolist())
    assert not set(idx.tolist()) & (set(data.val.tolist()) | set(fed.clients[0].test.tolist()))
    assert torch.equal(idx, algo.datastore_indices(data))
    pred = algo.personal_model(server, algo.init_client(0))
    assert torch.equal(pred.keys, _features(algo, server, idx))
    assert torch.equal(pred.labels, data.y[idx])
    other = algo.ctx.client_data(1)
    assert set(algo.datastore_indices(other).tolist()) <= set(other.train.tolist())

    half = _algo(capacity_fraction=0.5)
    assert half.datastore_indices(data).numel() == int(0.5 * data.num_train)
    assert _algo().datastore_indices(data).numel() == data.num_train


def test_lambda_is_chosen_on_validation_never_on_test():
    """Planted: validation labels are the kNN model's predictions, test labels the global model's. The best λ on
    test is 0; the chosen λ is the best on validation (smallest on ties)."""
    algo = _algo()
    server, cid = algo.init_server(), 3
    data, test = algo.ctx.client_data(cid), algo.ctx.federation.clients[cid].test
    pred = algo.personal_model(server, algo.init_client(cid))
    y = data.y.clone()
    p_val, logit_val = pred.parts(data.x[data.val])
    y[data.val] = p_val.argmax(1)
    y[test] = algo.generic_model(server).logits(data.x[test]).argmax(1)
    planted = replace(data, y=y)
    accs = [float(((lam * p_val + (1 - lam) * torch.softmax(logit_val, 1)).argmax(1) == y[data.val]).float().mean())
            for lam in algo.opts.lam_grid]  # fmt: skip
    want = algo.opts.lam_grid[accs.index(max(accs))]
    assert want > 0  # the planted case separates validation from test
    assert algo.choose_lam(pred, planted) == want


def test_a_tie_on_validation_goes_to_the_smallest_lambda_whatever_the_grid_order():
    """Planted: each validation label is a class that no λ can predict (the class least likely under both the kNN
    and the global model), so every λ scores 0 and the tie must go to the smallest λ of the grid."""
    algo = _algo(lam_grid=[0.6, 0.2, 1.0])
    server, cid = algo.init_server(), 3
    data = algo.ctx.client_data(cid)
    pred = algo.personal_model(server, algo.init_client(cid))
    p_val, logit_val = pred.parts(data.x[data.val])
    y = data.y.clone()
    y[data.val] = (p_val + torch.softmax(logit_val, 1)).argmin(1)
    planted = replace(data, y=y)
    for lam in (0.2, 0.6, 1.0):  # the planted labels really are unpredictable at every λ of the grid
        assert not bool((knnper.mix(p_val, logit_val, lam).argmax(1) == y[data.val]).any())
    assert algo.choose_lam(pred, planted) == 0.2


def test_without_validation_data_lambda_falls_back():
    algo = _algo(lam_fallback=0.25)
    data = algo.ctx.client_data(0)
    pred = algo.knn_model(algo.init_server(), replace(data, val=data.val[:0]))
    assert pred.lam == 0.25


def test_pflbed_clients_tune_lambda_on_their_domains_shared_validation_set():
    fed = {"protocol": "pflbed", "pflbed": {"clients_per_domain": 2, "new_clients_per_domain": 1}}
    cfg = validate_config({"dataset": {"name": "digits-rot4"}, "model": {"name": "mlp"}, "federation": fed,
                           "algorithm": {"name": "knnper"}})  # fmt: skip
    algo = prepare(cfg)
    fed = algo.ctx.federation
    cid = fed.participated[0]
    data = algo.ctx.client_data(cid)
    assert data.val.numel() == 0
    idx, weights = validation_data(fed, data)
    assert torch.equal(idx, fed.domain_val[fed.clients[cid].domain])
    assert torch.equal(weights, data.prior)
    assert algo.personal_model(algo.init_server(), algo.init_client(cid)).lam in algo.opts.lam_grid


# --- training and new clients ---------------------------------------------------------------------------------
def test_training_is_fedavg_bit_for_bit():
    knn = pflbed.run(_cfg(lam=0.0), write=False)
    avg = pflbed.run(_cfg("fedavg"), write=False)
    assert same_tensors(knn.server, avg.server)
    assert knn.summary["final"] == avg.summary["final"]  # λ = 0: P-FL is the global model's too


def test_new_client_knn_uses_only_its_own_data():
    algo = prepare(_cfg(federation={"new_clients": 2}))
    server = algo.init_server()
    c = algo.ctx.federation.new[0]
    data = subset(algo.ctx.client_data(c), 0.5, torch.Generator().manual_seed(0))
    preds = list(algo.personalize(server, data, Budget("ft", 3, 0.1, 16), torch.Generator().manual_seed(1)))
    assert len(preds) == 1
    idx = data.train.sort().values
    assert torch.equal(preds[0].keys, _features(algo, server, idx))
    assert torch.equal(preds[0].labels, data.y[idx])
    assert preds[0].params is server  # the frozen global model


@pytest.mark.parametrize("method", ["ft", "lp"])
def test_new_client_ft_then_knn_builds_the_datastore_on_the_fine_tuned_model(method):
    algo = prepare(_cfg(federation={"new_clients": 2}, new_client="ft+knn"))
    server = algo.init_server()
    c = algo.ctx.federation.new[1]
    data = algo.ctx.client_data(c)
    preds = list(algo.personalize(server, data, Budget(method, 2, 0.1, 16), torch.Generator().manual_seed(1)))
    assert len(preds) == 2
    idx = data.train.sort().values
    for p in preds:
        assert torch.equal(p.keys, _features(algo, p.params, idx))
    assert not same_tensors(preds[-1].params, server)


def test_every_client_is_evaluated_with_its_own_predictor():
    """Personal predictors share the model and the server's parameters; evaluation (which caches and batches
    predictions per predictor group) must still score each client with its own datastore and λ."""
    algo = _algo()
    server = algo.init_server()
    _, per_client = evaluate(algo, server, algo.init_client)
    for c, acc in per_client.items():
        alone = client_score(algo.personal_model(server, algo.init_client(c)), c, algo.ctx,
                             Predictions(algo.ctx.source, 256), "test")  # fmt: skip
        assert acc == pytest.approx(alone, abs=1e-6)
    knn = pflbed.run(_cfg(lam=1.0), write=False)
    avg = pflbed.run(_cfg("fedavg"), write=False)
    assert knn.summary["final"]["gfl_acc"] == avg.summary["final"]["gfl_acc"]
    assert knn.summary["final"]["pfl_acc"] != avg.summary["final"]["pfl_acc"]


def test_distances_of_close_points_and_an_empty_or_single_key_datastore():
    """Distances below 1 are themselves (only negative rounding is clipped); no key gives zero probabilities, one
    key gives its label; a query far from every key does not underflow (weights are relative to the nearest)."""
    g = torch.Generator().manual_seed(0)
    q, s = 0.1 * torch.randn(5, 3, generator=g), 0.1 * torch.randn(4, 3, generator=g)
    assert torch.allclose(knnper.pairwise_distances(q, s, "sqeuclidean"), torch.cdist(q, s) ** 2, atol=1e-7)
    assert torch.allclose(knnper.pairwise_distances(q, s, "euclidean"), torch.cdist(q, s), atol=1e-6)
    assert torch.equal(knn_probs(q, s[:0], LABELS[:0], 3, k=3, temperature=1.0), torch.zeros(5, 3))
    assert torch.equal(knn_probs(q, s[:1], LABELS[2:3], 3, k=3, temperature=1.0), torch.tensor([[0.0, 1.0, 0.0]] * 5))
    far = knn_probs(torch.tensor([[300.0, 0.0]]), KEYS, LABELS, 3, k=2, temperature=1.0)  # d = 297², 298²
    assert torch.allclose(far, torch.tensor([[1.0, 0.0, 0.0]]))  # weights 1 and e^(−595): the nearest's class


def test_datastore_subsets_depend_on_seed_and_client_and_a_small_fraction_keeps_one_sample():
    """The random subset is drawn from (seed, client): the same training split under another client id or another
    seed gives another subset; a fraction smaller than one sample still stores one."""
    algo = _algo(capacity=5)
    data = algo.ctx.client_data(0)
    mine = algo.datastore_indices(data)
    assert not torch.equal(mine, algo.datastore_indices(replace(data, cid=1)))
    other_seed = prepare(validate_config({**_cfg(capacity=5).model_dump(mode="json"), "seed": 1}))
    assert not torch.equal(mine, other_seed.datastore_indices(data))
    assert _algo(capacity_fraction=1e-3).datastore_indices(data).numel() == 1


def test_lambda_is_chosen_on_class_weighted_validation_accuracy_when_the_set_is_shared(monkeypatch):
    """On a shared validation set (PFLBED: the domain's), each sample weighs the client's prior of its class:
    acc(λ) = Σ w_y·right / Σ w_y. With all of the client's prior on one class, the choice follows that class's
    samples alone — a class is picked where that differs from the unweighted choice. All-zero weights on the
    set's classes fall back to plain accuracy."""
    algo = _algo()
    server, cid = algo.init_server(), 3
    data = algo.ctx.client_data(cid)
    pred = algo.personal_model(server, algo.init_client(cid))
    idx = data.train  # stands in for a shared validation set
    p_knn, logits = pred.parts(data.x[idx])
    y = data.y[idx]
    grid = sorted(algo.opts.lam_grid)

    def best(w):
        accs = [float((w[y] * (knnper.mix(p_knn, logits, lam).argmax(1) == y).double()).sum() / w[y].sum())
                for lam in grid]  # fmt: skip
        return grid[accs.index(max(accs))]

    classes = algo.ctx.source.num_classes
    plain = best(torch.ones(classes, dtype=torch.float64))
    one_hot = [torch.eye(classes, dtype=torch.float64)[c] for c in y.unique().tolist()]
    differing = [w for w in one_hot if best(w) != plain]
    assert differing  # the test separates weighted from unweighted accuracy
    for w in (differing[0] / (10 * len(y)), torch.zeros(classes, dtype=torch.float64)):  # a prior: Σ_y w_y < 1
        monkeypatch.setattr(knnper, "validation_data", lambda fed, d, w=w: (idx, w.float()))
        assert algo.choose_lam(pred, data) == (best(w) if w.sum() > 0 else plain)


def test_a_single_sample_datastore_still_votes():
    """capacity 1, λ = 1: the predictor is the kNN model of one stored sample — its label everywhere."""
    algo = _algo(capacity=1, lam=1.0)
    cid = 2
    pred = algo.personal_model(algo.init_server(), algo.init_client(cid))
    x = algo.ctx.client_data(cid).x[:20]
    assert len(pred.keys) == 1 and torch.equal(pred.logits(x).argmax(1), pred.labels.expand(20))


def test_eval_finetune_rows_exist_only_where_something_is_fine_tuned():
    """`new_client = "knn"` tunes nothing: `eval.finetune` is skipped (its rows would be kNN-Per relabeled);
    `"ft+knn"` reports kNN-Per on the fine-tuned / probed model under `final.ft` / `final.lp`, and those differ
    from the un-tuned kNN-Per figure."""
    ev = {**TINY["eval"], "finetune": ["ft", "lp"], "ft_epochs": 2, "ft_lr": 0.2}
    tree = {**TINY, "train": {**TINY["train"], "rounds": 2}, "eval": ev, "executor": {"threads": 1}}
    knn = pflbed.run({**tree, "algorithm": {"name": "knnper"}}, write=False)
    assert "ft" not in knn.summary["final"] and "lp" not in knn.summary["final"]
    tuned = pflbed.run({**tree, "algorithm": {"name": "knnper", "new_client": "ft+knn"}}, write=False)
    f = tuned.summary["final"]
    assert f["pfl_acc"] == knn.summary["final"]["pfl_acc"]  # training and the un-tuned kNN-Per are the same
    assert f["ft"]["pfl_acc"] is not None and f["lp"]["pfl_acc"] is not None
    assert f["ft"]["pfl_acc"] != f["pfl_acc"]
    assert knn.executor.algo.finetune_methods(knn.server, ["ft", "lp"]) == []
    assert tuned.executor.algo.finetune_methods(tuned.server, ["lp"]) == ["lp"]


def test_pfl_val_is_the_best_validation_accuracy_over_the_lambda_grid():
    """The docstring's caveat, checked: a client's validation score is the maximum over `lam_grid` of its
    validation accuracy (λ was tuned on the same data), at least every single λ's."""
    algo = _algo()
    server = algo.init_server()
    P = Predictions(algo.ctx.source, 256)
    for c in algo.ctx.federation.participated[:3]:
        chosen = client_score(algo.personal_model(server, algo.init_client(c)), c, algo.ctx, P, "val")
        data = algo.ctx.client_data(c)
        each = []
        for lam in algo.opts.lam_grid:
            pred = algo.knn_model(server, data)
            pred.lam = lam
            each.append(client_score(pred, c, algo.ctx, P, "val"))
        assert chosen == pytest.approx(max(each), abs=1e-9)


def test_a_trained_run_s_personal_models_are_the_clients_knn_classifiers(tmp_path):
    """`load_run`: a participant's personal model and a new client's personalized one are kNN-Per classifiers
    (the network with the client's datastore and λ), not the network alone, which is the global model; a
    participant whose state the checkpoint lacks gets its own id's datastore; saved, the model is loaded back with
    its run, datastore and all (another client's datastore holds another number of samples)."""
    from pflbed.results.trained import load_model

    path = tmp_path / "run"
    pflbed.run(_cfg(lam=0.3, federation={"new_clients": 2}), path)
    run = pflbed.load_run(path)
    algo, x = run.algo, run.algo.ctx.source.test.x
    cid = algo.ctx.federation.participated[0]
    pred = algo.personal_model(run.server, run.states[cid])
    got = run.personal_model(cid)(x)
    assert isinstance(pred, knnper.KNNPerPredictor) and torch.allclose(got, pred.logits(x), atol=1e-6)
    assert not torch.equal(got.argmax(1), Predictor(pred.model, pred.params).logits(x).argmax(1))
    run.states.pop(cid, None)
    assert torch.allclose(run.personal_model(cid)(x), got, atol=1e-6)

    data = algo.ctx.client_data(algo.ctx.federation.new[0])
    half = data.train[: len(data.train) // 2]  # the datastore of another size than the run's new client's
    p = run.personalize(data.x[half], data.y[half], epochs=1, lr=0.1)
    assert isinstance(p.model, knnper.KNNPerModule) and len(p.model.keys) == len(half)
    assert float(p.model.lam) == 0.3 and torch.equal(p.model.labels, data.y[half])
    assert not torch.equal(p.model(x).argmax(1), p.model.net(x).argmax(1))
    p.save(tmp_path / "p")
    loaded = load_model(tmp_path / "p", run=run)
    assert len(run.personal_structure().keys) != len(loaded.keys) == len(half)
    assert torch.equal(loaded(x), p.model(x))
