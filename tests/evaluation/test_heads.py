"""Many heads on one body in one batched operation (evaluation/heads.py) = each head run on its own."""

import pytest
import torch

from pflbed.algorithms.base import Predictor
from pflbed.evaluation import heads
from pflbed.evaluation.evaluate import Predictions
from pflbed.evaluation.heads import classify_all, predict_all, varying_keys
from pflbed.models import build_model

torch.manual_seed(0)
MODEL = build_model("lenet5", (1, 8, 8), 10)
BASE = {k: v.clone() for k, v in MODEL.state_dict().items()}
HEAD = MODEL.state_keys(MODEL.head_blocks())


def _predictors(n, shared_every=3):
    """n predictors on MODEL's body: each has its own random head, except every `shared_every`-th, which keeps the
    base head (the same tensor objects, as clients never sampled share the initial head)."""
    g = torch.Generator().manual_seed(1)
    preds = []
    for i in range(n):
        own = {k: BASE[k] if i % shared_every == 0 else torch.randn(BASE[k].shape, generator=g) for k in HEAD}
        preds.append(Predictor(MODEL, {**BASE, **own}, feature_key=("body",)))
    return preds


def _one_by_one(preds, zs):
    return [p.classify(z) for p, z in zip(preds, zs, strict=True)]


def _features(n):
    return MODEL.eval().features(torch.randn(n, 1, 8, 8))


@pytest.mark.parametrize("chunk", [heads.CHUNK_ELEMENTS, 2_000])  # one chunk; many chunks of a few clients
def test_batched_heads_equal_each_head_alone_on_its_own_features(chunk, monkeypatch):
    """Per-client features of different lengths (an empty one included: a client without validation data)."""
    monkeypatch.setattr(heads, "CHUNK_ELEMENTS", chunk)
    preds = _predictors(7)
    zs = [_features(n) for n in (3, 5, 0, 1, 4, 2, 6)]
    got, want = classify_all(preds, zs, 256), _one_by_one(preds, zs)
    assert [g.shape for g in got] == [w.shape for w in want]
    assert all(torch.allclose(g, w, atol=1e-5) for g, w in zip(got, want, strict=True))
    assert len({tuple(w.argmax(1).tolist()) for w in want if len(w)}) > 1  # the heads really differ


def test_batched_heads_on_one_shared_evaluation_set():
    preds, z = _predictors(5), _features(6)
    got, want = classify_all(preds, [z] * 5, 256), _one_by_one(preds, [z] * 5)
    assert all(torch.allclose(g, w, atol=1e-5) for g, w in zip(got, want, strict=True))


def test_only_the_heads_that_differ_are_stacked_and_identical_heads_run_once():
    preds = _predictors(4)
    assert varying_keys(preds) == HEAD
    assert varying_keys([preds[0], preds[1]]) == HEAD  # only the second differs from the first
    assert varying_keys([preds[0], preds[0]]) == []
    same = [Predictor(MODEL, dict(BASE), feature_key=("body",)) for _ in range(3)]
    zs = [_features(n) for n in (2, 3, 1)]
    got = classify_all(same, zs, 256)
    assert all(torch.allclose(g, w, atol=1e-6) for g, w in zip(got, _one_by_one(same, zs), strict=True))


def test_a_predictor_with_its_own_classify_is_run_its_own_way():
    class Doubled(Predictor):
        def classify(self, z, batch_size=1024):
            return 2 * super().classify(z, batch_size)

    preds = [Doubled(MODEL, p.params, ("body",)) for p in _predictors(3)]
    zs = [_features(2)] * 3
    assert all(torch.equal(g, w) for g, w in zip(classify_all(preds, zs, 256), _one_by_one(preds, zs), strict=True))


@pytest.mark.parametrize("chunk", [heads.CHUNK_ELEMENTS, 2_000])
@pytest.mark.parametrize("case", ["own", "shared", "identical", "own_classify"])
def test_predicted_labels_are_each_predictors_argmax_in_order(case, chunk, monkeypatch):
    """predict_all (argmax on padded chunks, padding rows masked out) = classify_all's logits' argmax, client by
    client, whatever the path: own sets of different lengths, one shared set, identical heads, unbatchable."""
    monkeypatch.setattr(heads, "CHUNK_ELEMENTS", chunk)

    class Doubled(Predictor):
        def classify(self, z, batch_size=1024):
            return 2 * super().classify(z, batch_size)

    preds = _predictors(7)
    zs = [_features(n) for n in (3, 5, 0, 1, 4, 2, 6)]
    if case == "shared":
        zs = [zs[-1]] * 7
    elif case == "identical":
        preds = [Predictor(MODEL, dict(BASE), feature_key=("body",)) for _ in range(7)]
    elif case == "own_classify":
        preds = [Doubled(MODEL, p.params, ("body",)) for p in preds]
    want = torch.cat([w.argmax(1) for w in classify_all(preds, zs, 256)])
    assert torch.equal(predict_all(preds, zs, 256), want)
    assert torch.equal(want, torch.cat([w.argmax(1) for w in _one_by_one(preds, zs)]))


def test_labels_of_more_than_a_thousand_predictors_are_all_there_in_order():
    """Per-predictor logits are concatenated 1,024 predictors at a time before the argmax: with 1,100 every
    predictor's labels come back, each in its place."""
    preds = [Predictor(MODEL, dict(BASE), feature_key=("body",)) for _ in range(1100)]
    z = _features(1100)
    zs = [z[i : i + 1] for i in range(1100)]
    got = predict_all(preds, zs, 256)
    assert torch.equal(got, MODEL.classify(z).argmax(1)) and len(set(got.tolist())) > 1


def test_no_predictor_gives_no_labels_and_one_gives_its_own():
    none = predict_all([], [], 256)
    assert none.dtype == torch.int64 and none.shape == (0,)
    pred, z = _predictors(2)[1], _features(4)
    assert torch.equal(predict_all([pred], [z], 256), pred.classify(z).argmax(1))


def test_each_chunk_of_clients_fits_the_budget_and_holds_as_many_as_fit(monkeypatch):
    """`CHUNK_ELEMENTS` bounds a chunk's memory: its clients' stacked head parameters plus their features padded
    to the longest, n·(head + longest·width) elements — a chunk takes clients in order while the next still fits
    (a lone client larger than the budget is a chunk of its own)."""
    preds = _predictors(9, shared_every=100)
    zs = [_features(n) for n in (1, 0, 2, 1, 1, 30, 0, 1, 2)]
    head, width = sum(BASE[k].numel() for k in HEAD), zs[0].shape[1]
    budget = 3 * (head + 2 * width)
    monkeypatch.setattr(heads, "CHUNK_ELEMENTS", budget)
    chunks, real = [], heads._chunk

    def recorded(head_, keys, preds_, zs_, shared):
        chunks.append([len(z) for z in zs_])
        return real(head_, keys, preds_, zs_, shared)

    monkeypatch.setattr(heads, "_chunk", recorded)
    assert torch.equal(predict_all(preds, zs, 256), torch.cat([w.argmax(1) for w in _one_by_one(preds, zs)]))
    assert [n for c in chunks for n in c] == [len(z) for z in zs] and len(chunks) > 2
    size = lambda rows: len(rows) * (head + max(rows) * width)  # noqa: E731
    assert all(size(c) <= budget or len(c) == 1 for c in chunks)
    assert all(size([*c, nxt[0]]) > budget for c, nxt in zip(chunks, chunks[1:], strict=False))
    assert [30] in chunks and size([30]) > budget  # the 30-row client alone


def test_warm_heads_gives_the_labels_of_the_unwarmed_path():
    """Predictions.warm_heads (body once over the union, heads batched) = Predictions.__call__ per predictor."""
    from pflbed.data.arrays import ArrayDataset, DataSource

    x = torch.randn(30, 1, 8, 8)
    src = DataSource("t", ArrayDataset(x, torch.zeros(30, dtype=torch.long)), ArrayDataset(x[:5], torch.zeros(5)),
                     10, "generated")  # fmt: skip
    preds = _predictors(4)
    idx = [torch.tensor([0, 3, 7]), torch.tensor([3, 4]), torch.tensor([], dtype=torch.long), torch.tensor([9, 1])]
    warm = Predictions(src, 256)
    warm.warm_heads([(p, "train", i) for p, i in zip(preds, idx, strict=True)])
    for p, i in zip(preds, idx, strict=True):
        assert torch.equal(warm(p, "train", i), Predictions(src, 256)(p, "train", i))


def test_warm_heads_with_several_sets_per_predictor_shared_and_empty_sets():
    """Two sets per predictor and split (test, val) as evaluation asks for them: sets shared between predictors
    (a domain's), an empty set (no validation data), the same sets in reverse order (not adjacent rows), and a
    second split — every set's labels equal the unwarmed path's."""
    from pflbed.data.arrays import ArrayDataset, DataSource

    x = torch.randn(30, 1, 8, 8, generator=torch.Generator().manual_seed(0))  # its own stream: any test order
    src = DataSource("t", ArrayDataset(x, torch.zeros(30, dtype=torch.long)), ArrayDataset(x[:6], torch.zeros(6)),
                     10, "generated")  # fmt: skip
    preds = _predictors(5, shared_every=4)  # predictor 3 (reverse order) has a random head of its own
    with torch.no_grad():
        z_mean = MODEL.eval().features(x).mean(0)
    for p in preds[1:4]:  # heads centred on the mean feature: labels vary from sample to sample (else row mix-ups
        w = p.params[HEAD[0]]  # would go unseen behind one constant label)
        p.params[HEAD[1]] = -w @ z_mean
    test_a, val_a, empty = torch.tensor([0, 3, 7]), torch.tensor([4, 11]), torch.tensor([], dtype=torch.long)
    sets = [
        [("train", test_a), ("train", val_a)],
        [("train", torch.tensor([9, 1])), ("train", empty)],
        [("train", test_a), ("train", val_a)],  # shares predictor 0's sets
        [("train", val_a), ("train", test_a)],  # the same sets, other order
        [("test", torch.tensor([5, 0])), ("train", torch.tensor([2]))],
    ]
    items = [(p, split, i) for p, s in zip(preds, sets, strict=True) for split, i in s]
    warm = Predictions(src, 256)
    warm.warm_heads(items)
    for p, split, i in items:
        assert torch.equal(warm(p, split, i), Predictions(src, 256)(p, split, i))
    assert len(Predictions(src, 256)(preds[3], "train", test_a).unique()) > 1
    # gather: all items at once = each item's labels concatenated in order; one block, then a mix with an unwarmed
    # item (the per-item path), then nothing.
    cold = Predictions(src, 256)
    want = torch.cat([cold(p, split, i) for p, split, i in items])
    assert torch.equal(warm.gather(items), want)
    assert torch.equal(warm.gather(items[::-1]), torch.cat([cold(p, split, i) for p, split, i in items[::-1]]))
    other = _predictors(2, shared_every=5)[1]
    mixed = [*items[:3], (other, "train", test_a), *items[3:]]
    assert torch.equal(warm.gather(mixed), torch.cat([cold(p, split, i) for p, split, i in mixed]))
    assert warm.gather([]).numel() == 0
    # A cached entry under another predictor's id (ids are reused once an object dies) is never read as its own.
    stale = dict(warm.labels)
    for (pid, split, ptr, n), (_, block, start, rows) in stale.items():
        if pid == id(preds[1]):
            warm.labels[(id(other), split, ptr, n)] = (preds[1], block, start, rows)
    alias = [(other, split, i) for p, split, i in items if p is preds[1]]
    assert torch.equal(warm.gather(alias), torch.cat([cold(p, split, i) for p, split, i in alias]))
    assert all(torch.equal(warm(p, s, i), cold(p, s, i)) for p, s, i in alias)
