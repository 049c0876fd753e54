"""Evaluation rules on tiny hand-built federations (evaluate.py, newclients.py).

Every model here is a lookup table: a sample's feature is its id (pool index i, or OFF + j for sample j of the
shared test split) and a `Table` predictor is right exactly on the ids it is given, wrong (y + 1 mod K) elsewhere.
So every accuracy below is hand-computed from the sets of samples a model gets right, and a rule that reads the
wrong data, weights or epoch changes the number.
"""

import gc
import weakref
from dataclasses import replace

import pytest
import torch

from pflbed import rng
from pflbed.algorithms.base import Budget, Context, Predictor
from pflbed.config import Config
from pflbed.data.arrays import ArrayDataset, DataSource
from pflbed.evaluation.evaluate import (
    Predictions,
    client_scores,
    evaluate,
    evaluate_personalized,
    last,
    pfl_mode,
    subsampled,
    summarize,
)
from pflbed.evaluation.newclients import _mean, evaluate_new_clients, run_one, subset
from pflbed.federation.federation import ClientSplit, Federation

OFF = 1000  # ids of the shared test split's samples start here
K = 3


def _source(train_y: list[int], test_y: list[int]) -> DataSource:
    train = ArrayDataset(torch.arange(len(train_y)).float()[:, None], torch.tensor(train_y))
    test = ArrayDataset((OFF + torch.arange(len(test_y))).float()[:, None], torch.tensor(test_y))
    return DataSource("hand", train, test, K, "generated")


class Table(Predictor):
    """Right on `right_train` (pool ids) and `right_test` (test-split positions), wrong elsewhere.

    `group` may be forced: CPython reuses the id of a freed parameter dict, so a new model can get the group of
    one that no longer exists — the caches must not hand the old model's predictions to it.
    """

    def __init__(self, source: DataSource, right_train=(), right_test=(), group=None) -> None:
        super().__init__(torch.nn.Identity(), {})
        lut = torch.full((OFF + len(source.test),), -1, dtype=torch.int64)
        lut[: len(source.train)] = (source.train.y + 1) % K
        lut[OFF:] = (source.test.y + 1) % K
        for i in right_train:
            lut[i] = source.train.y[i]
        for j in right_test:
            lut[OFF + j] = source.test.y[j]
        self.lut, self._group, self.calls = lut, group, []

    @property
    def group(self):
        return self._group if self._group is not None else super().group

    batch_sizes: list[int] = []  # every batch size any table was asked to use (shared by all instances)

    def logits(self, x, batch_size=1024):
        self.calls.append(len(x))
        Table.batch_sizes.append(batch_size)
        return torch.nn.functional.one_hot(self.lut[x[:, 0].long()], K).float()


def _ctx(source, fed, **cfg) -> Context:
    return Context(Config(**cfg), source, fed, options=None, model=None)


def _prior(y: torch.Tensor, idx: list[int]) -> torch.Tensor:
    return torch.bincount(y[torch.tensor(idx)], minlength=K).float() / len(idx)


# ---------------------------------------------------------------------------------------------------------------
# The shared hand-built federation. Train pool (ids 0..41), K = 3:
#   0-5 domain-0 test  y 0 0 1 1 2 2 | 6-8 domain-0 val y 0 1 2 | 9-14 domain-1 test y 0 0 1 1 2 2 | 15-17 d1 val
#   client 0 (domain 1): train 18-21 y 0 0 0 1 → prior [.75 .25 0]; val 26-27 y 0 1; test 31-34 y 0 0 1 2
#   client 1 (domain 0): train 22-25 y 2 2 1 1 → prior [0 .5 .5];  val 28-30 y 0 2 2; test 35-36 y 1 2
#   client 2 (new):      train 37-38, val 39, test 40-41
# Shared test split: y 0 0 1 1 2 2.
# ---------------------------------------------------------------------------------------------------------------
TRAIN_Y = ([0, 0, 1, 1, 2, 2] + [0, 1, 2] + [0, 0, 1, 1, 2, 2] + [0, 1, 2] + [0, 0, 0, 1] + [2, 2, 1, 1]
           + [0, 1] + [0, 2, 2] + [0, 0, 1, 2] + [1, 2] + [0, 1, 2, 0, 1])  # fmt: skip
TEST_Y = [0, 0, 1, 1, 2, 2]
R = lambda a, b: list(range(a, b + 1))  # noqa: E731 - inclusive id ranges, as in the table above
# Which samples each model gets right (pool ids, test-split positions):
RIGHT = {
    0: ([9, 10, 11, 16, 26, 31, 32, 33], [0, 2, 3]),
    1: ([0, 1, 4, 6, 8, 28, 35], [4]),
    2: ([], []),  # the new client: must never be scored with the participated ones
    "generic": ([26, 28, 29, 39, 6, 15, 16, 0, 1, 2, 9], [0, 1, 2, 3]),
}
# Hand-computed P-FL scores per protocol: (test, val) per participated client.
#   local:  own test / own val, plain: c0 3/4, 1/2; c1 1/2, 1/3.
#   global: test = global test set class-weighted by the train prior: c0 right on classes 0,1,1 → correct [1 2 0]
#           → (.75·1 + .25·2)/(.75·2 + .25·2) = .625; c1 right on one class-2 sample → .5·1/(.5·2 + .5·2) = .25;
#           val = own val, plain (as local).
#   domain: c0 on domain 1 (not 0): right on classes 0,0,1 → (.75·2 + .25·1)/2 = .875; d1 val right on class 1
#           → .25/(.75 + .25) = .25; c1 on domain 0: right on classes 0,0,2 → .5·1/2 = .25; d0 val right on
#           classes 0,2 → .5/1 = .5. Plain accuracy would give .5 / 1/3 / .5 / 2/3 instead.
EXPECTED = {
    "local": ({0: 0.75, 1: 0.5}, {0: 0.5, 1: 1 / 3}),
    "global": ({0: 0.625, 1: 0.25}, {0: 0.5, 1: 1 / 3}),
    "domain": ({0: 0.875, 1: 0.25}, {0: 0.25, 1: 0.5}),
}


def _fed(mode: str) -> tuple[DataSource, Federation]:
    src = _source(TRAIN_Y, TEST_Y)
    y = src.train.y
    t = lambda ids: torch.tensor(ids, dtype=torch.int64)  # noqa: E731
    clients = [
        ClientSplit(t(R(18, 21)), t(R(26, 27)), t(R(31, 34)), _prior(y, R(18, 21)), domain=1),
        ClientSplit(t(R(22, 25)), t(R(28, 30)), t(R(35, 36)), _prior(y, R(22, 25)), domain=0),
        ClientSplit(t(R(37, 38)), t([39]), t(R(40, 41)), _prior(y, R(37, 38)), domain=0),
    ]
    if mode == "domain":  # as PFLBED builds it: global test = the domain test sets, in the train pool
        dt, dv = [t(R(0, 5)), t(R(9, 14))], [t(R(6, 8)), t(R(15, 17))]
        return src, Federation(clients, [0, 1], [2], torch.cat(dt), K, "k", "train", domain_val=dv, domain_test=dt)
    return src, Federation(clients, [0, 1], [2], t(R(0, 5)), K, "k", "test")


def _mode_ctx(mode: str) -> Context:
    src, fed = _fed(mode)
    return _ctx(src, fed, eval={"pfl_test": "local" if mode == "domain" else mode})


# The trained server state evaluation is given: every model must be built from it (the fakes check identity).
SERVER = {"trained": torch.zeros(1)}


class FakeAlgo:
    """What evaluation calls on an algorithm: a generic model, a personal model per client state, personalize."""

    name = "fake"

    def __init__(self, ctx, generic=True, epochs=None) -> None:
        self.ctx = ctx
        self.models = {c: Table(ctx.source, *RIGHT[c]) for c in (0, 1, 2)}
        self.generic = Table(ctx.source, *RIGHT["generic"]) if generic else None
        self.epochs, self.budgets = epochs, []

    def generic_model(self, server):
        assert server is SERVER
        return self.generic

    def personal_model(self, server, state):
        assert server is SERVER
        return self.models[int(state["cid"])]

    def personalize(self, server, data, budget, generator):
        """Epochs 1..E-1 are right nowhere; the last epoch is the client's table model, its group shared by all
        clients (a freed model's id being reused)."""
        assert server is SERVER
        self.budgets.append((data.cid, budget, generator))
        for _ in range(budget.epochs - 1):
            yield Table(self.ctx.source)
        yield Table(self.ctx.source, *RIGHT[data.cid], group=("reused", 0))


def _states(c):
    return {"cid": torch.tensor(c)}


# --- metrics.py / evaluate.py: which protocol, which data -------------------------------------------------------
@pytest.mark.parametrize("mode", ["local", "global", "domain"])
def test_client_scores_use_the_protocols_data_and_weights(mode):
    """Rule (evaluate.py:pfl_mode/client_score): `domain` when the federation has domain test sets (class-weighted
    by the client's *train* prior on its own domain's test / val set), else eval.pfl_test: `global` = weighted on
    the global test set with the client's own val split plain, `local` = own test / val, plain."""
    ctx = _mode_ctx(mode)
    assert pfl_mode(ctx) == mode
    algo = FakeAlgo(ctx)
    test, val = client_scores({c: algo.models[c] for c in (0, 1)}, ctx, Predictions(ctx.source, 4))
    exp_test, exp_val = EXPECTED[mode]
    assert test == pytest.approx(exp_test) and val == pytest.approx(exp_val)


def test_domain_protocol_wins_over_eval_pfl_test():
    """A PFLBED federation is always scored on its domain sets, whatever eval.pfl_test says."""
    src, fed = _fed("domain")
    ctx = _ctx(src, fed, eval={"pfl_test": "global"})
    assert pfl_mode(ctx) == "domain"
    models = FakeAlgo(ctx).models
    test, val = client_scores({0: models[0], 1: models[1]}, ctx, Predictions(src, 4))
    assert test == pytest.approx(EXPECTED["domain"][0]) and val == pytest.approx(EXPECTED["domain"][1])


def test_summarize_stats_over_test_and_val_mean_skipping_empty_val():
    """Rule (evaluate.py:summarize): mean / population std / min / p10 over clients' *test* scores; pfl_val = mean
    of the val scores of clients that have one (NaN = empty val split is skipped), None when none has."""
    nan = float("nan")
    s = summarize({0: 0.2, 1: 0.6, 2: 1.0}, {0: 0.9, 1: nan, 2: 0.5})
    assert s["pfl_acc"] == pytest.approx(0.6)
    assert s["pfl_acc_std"] == pytest.approx((0.32 / 3) ** 0.5)  # deviations −.4, 0, .4
    assert s["pfl_acc_min"] == pytest.approx(0.2)
    assert s["pfl_acc_p10"] == pytest.approx(0.28)  # rank 0.2 between 0.2 and 0.6
    assert s["pfl_val"] == pytest.approx(0.7)
    assert summarize({0: 0.5}, {0: nan})["pfl_val"] is None
    assert set(summarize({0: 0.5}, {0: 0.5}, prefix="x")) == {"x_acc", "x_acc_std", "x_acc_min", "x_acc_p10", "x_val"}


@pytest.mark.parametrize(
    ("mode", "gfl_acc", "gfl_val"),
    [
        # G-FL test: generic right on test-split 0-3 of 6. Val = union of participated clients' val splits
        # (26-30, sample-weighted: right on 26, 28, 29 → 3/5; the mean of per-client figures would be 7/12 and
        # adding the new client's val 39 would give 4/6).
        ("local", 4 / 6, 3 / 5),
        ("global", 4 / 6, 3 / 5),
        # PFLBED: global test = both domains' test sets in the train pool (right on 0, 1, 2, 9 → 4/12); val = union
        # of the domain val sets (right on 6, 15, 16 → 3/6), not the (non-empty here) client val splits.
        ("domain", 4 / 12, 3 / 6),
    ],
)
def test_evaluate_reports_gfl_and_pfl_of_participated_clients(mode, gfl_acc, gfl_val):
    """Rule (evaluate.py:evaluate): gfl_acc = generic model on the global test set of `global_split`; gfl_val on the
    union of val splits (domain val sets under PFLBED, else the participated clients'); P-FL over participated
    clients only, summarized; the per-client dict is the P-FL *test* accuracy."""
    ctx = _mode_ctx(mode)
    out, test = evaluate(FakeAlgo(ctx), SERVER, _states, ctx)
    exp_test, exp_val = EXPECTED[mode]
    assert test == pytest.approx(exp_test)
    assert out["gfl_acc"] == pytest.approx(gfl_acc) and out["gfl_val"] == pytest.approx(gfl_val)
    assert out["pfl_acc"] == pytest.approx(sum(exp_test.values()) / 2)
    assert out["pfl_acc_min"] == pytest.approx(min(exp_test.values()))
    assert out["pfl_val"] == pytest.approx(sum(exp_val.values()) / 2)


def test_evaluate_without_generic_model_and_with_empty_val_splits():
    """No generic model → gfl_acc and gfl_val are None. A participated client with an empty val split drops out of
    pfl_val (mean over the others) and adds nothing to gfl_val's union."""
    src, fed = _fed("local")
    ctx = _ctx(src, fed)
    out, _ = evaluate(FakeAlgo(ctx, generic=False), SERVER, _states, ctx)
    assert out["gfl_acc"] is None and out["gfl_val"] is None
    no_val = replace(fed.clients[1], val=torch.zeros(0, dtype=torch.int64))
    ctx = _ctx(src, replace(fed, clients=[fed.clients[0], no_val, fed.clients[2]]))
    out, _ = evaluate(FakeAlgo(ctx), SERVER, _states, ctx)
    assert out["pfl_val"] == pytest.approx(0.5)  # client 0 alone
    assert out["gfl_val"] == pytest.approx(0.5)  # generic right on 26 of 26-27
    assert out["pfl_acc"] == pytest.approx(0.625)  # test figures untouched


@pytest.mark.parametrize("enabled", [True, False])
def test_evaluate_pauses_the_garbage_collector_and_restores_its_state(enabled):
    """The cyclic collector is off while an evaluation runs (full collections at 10,000 clients cost a third of
    it) and as it was afterwards: on stays on, off stays off (a caller's own choice is not overridden)."""
    seen = []

    class Spy(FakeAlgo):
        def personal_model(self, server, state):
            seen.append(gc.isenabled())
            return super().personal_model(server, state)

    ctx = _mode_ctx("local")
    (gc.enable if enabled else gc.disable)()
    try:
        evaluate(Spy(ctx), SERVER, _states, ctx)
        assert gc.isenabled() is enabled
    finally:
        gc.enable()
    assert seen and not any(seen)


def test_evaluate_personalized_scores_each_clients_last_epoch_with_the_eval_budget():
    """Rule (evaluate.py:evaluate_personalized): every participated client (not new ones) personalizes with
    Budget(method, eval.ft_epochs, eval.ft_lr, train.batch_size, train.momentum) and its own generator; the *last*
    epoch's model is scored under the protocol (global here: the shared test set makes a stale cache visible — each
    client's final model reuses a freed model's group, so predictions must not carry over between clients)."""
    src, fed = _fed("global")
    ctx = _ctx(src, fed, eval={"pfl_test": "global", "ft_epochs": 3, "ft_lr": 0.2},
               train={"batch_size": 7, "momentum": 0.5})  # fmt: skip
    algo = FakeAlgo(ctx)
    gens = {c: torch.Generator() for c in (0, 1, 2)}
    out = evaluate_personalized(algo, SERVER, "lp", gens.__getitem__)
    assert [(c, b) for c, b, _ in algo.budgets] == [(c, Budget("lp", 3, 0.2, 7, 0.5)) for c in (0, 1)]
    assert all(g is gens[c] for c, _, g in algo.budgets)
    assert out == pytest.approx(summarize(*EXPECTED["global"]))
    assert out["pfl_acc"] == pytest.approx(0.4375)


# --- the Predictions cache ---------------------------------------------------------------------------------------
def test_predictions_are_cached_per_model_and_split_never_shared():
    """Rule (evaluate.py:Predictions): the cache key is (model group, split): another model, or the same positions
    of another split, must get its own predictions; a sample already predicted is not run again."""
    src, _ = _fed("local")
    a = Table(src, right_train=[0, 1, 2])
    b = Table(src, right_train=[3, 4, 5])
    idx = torch.tensor([0, 1, 2, 3, 4, 5])
    P = Predictions(src, 4)
    assert torch.equal(P(a, "train", idx), torch.tensor([0, 0, 1, 2, 0, 0]))
    assert torch.equal(P(b, "train", idx), torch.tensor([1, 1, 2, 1, 2, 2]))  # not a's cached labels
    assert torch.equal(P(a, "test", idx), torch.tensor([1, 1, 2, 2, 0, 0]))  # test split: a is right nowhere
    # once per sample: duplicates and already-known samples are not predicted again
    c = Table(src)
    P(c, "train", torch.tensor([7, 7, 8]))
    P(c, "train", torch.tensor([8, 9]))
    assert c.calls == [2, 1]


def test_a_cache_entry_holds_its_model_and_parameters_so_no_later_model_takes_their_address():
    """CPython gives a new object the address of one just freed: a cache keyed by `id(params)` would hand a
    freed model's labels to the next model whose parameter dict lands there. `Predictor.group` holds the model
    and its parameter dict instead, so neither is freed while its entry is cached."""

    class Params(dict):  # a dict that can be referenced weakly
        pass

    src, _ = _fed("local")
    idx = torch.tensor([0, 1, 2, 3, 4, 5])
    P = Predictions(src, 4)
    t = Table(src, right_train=[0])
    t.params = Params()
    alive = weakref.ref(t.params), weakref.ref(t.model)
    expected = P(t, "train", idx)
    del t
    gc.collect()
    assert all(r() is not None for r in alive)  # their addresses stay taken while cached
    u = Table(src, right_train=[1, 2])
    assert torch.equal(P(u, "train", idx), Predictions(src, 4)(u, "train", idx))
    assert not torch.equal(P(u, "train", idx), expected)
    P.forget_models()
    gc.collect()
    assert all(r() is None for r in alive)  # and only while cached


class Head(Predictor):
    """A linear probe on a shared frozen body: features = the sample id; the head is a lookup table."""

    def __init__(self, table: Table, body_calls: list) -> None:
        super().__init__(torch.nn.Identity(), {}, feature_key=("body",))
        self.table, self.body_calls = table, body_calls

    def features(self, x, batch_size=1024):
        self.body_calls.append(len(x))
        Table.batch_sizes.append(batch_size)
        return x.clone()

    def classify(self, z, batch_size=1024):
        return self.table.logits(z, batch_size)


def test_feature_cache_shares_the_body_not_the_head_nor_the_split():
    """Rule (evaluate.py:Predictions, feature_key): heads on one body reuse its features for the same evaluation
    set, but each head classifies them itself, and features of another split / index set are computed anew."""
    src, _ = _fed("local")
    body: list[int] = []
    h1, h2 = Head(Table(src, right_train=[0, 1]), body), Head(Table(src, right_train=[2]), body)
    idx = torch.tensor([0, 1, 2])
    P = Predictions(src, 4)
    assert torch.equal(P(h1, "train", idx), torch.tensor([0, 0, 2]))
    assert torch.equal(P(h2, "train", idx), torch.tensor([1, 1, 1]))
    assert body == [3]  # one body forward for both heads
    assert torch.equal(P(h1, "test", idx), torch.tensor([1, 1, 2]))  # test split's samples, not the pool's
    assert torch.equal(P(h1, "train", torch.tensor([3, 4, 5])), torch.tensor([2, 0, 0]))  # another index set
    assert body == [3, 3, 3]


@pytest.mark.parametrize(("mode", "calls"), [("local", [11]), ("global", [6, 5]), ("domain", [18])])
def test_a_shared_model_is_run_once_per_evaluation_set(mode, calls):
    """Rule (evaluate.py:_warm, DESIGN §6): a model shared by every client (FedAvg) runs one batched forward over
    all pool samples its clients need (local: 5 val + 6 test; global: the 6 shared test samples, then 5 val;
    domain: 2 × (6 test + 3 val)), not one per client and split."""
    ctx = _mode_ctx(mode)
    shared = Table(ctx.source)
    client_scores({0: shared, 1: shared}, ctx, Predictions(ctx.source, 4))
    assert shared.calls == calls


# --- subsampled intermediate evaluations --------------------------------------------------------------------------
def test_subsampled_keeps_at_most_per_class_of_the_shared_test_sets_and_leaves_val_alone():
    """Rule (evaluate.py:subsampled): global and domain test sets keep ≤ per_class samples of each class (labels of
    their own split: test split for the global set, the pool for domain sets), a fixed sorted subset; val sets and
    client splits untouched; no per_class → the context itself."""
    train_y = [1, 1, 1, 1, 0, 0, 0, 2, 2, 2] + [2, 2, 0, 0, 0, 0] + [0, 1, 2, 0] + [0, 0, 0]
    test_y = [0, 0, 0, 1, 2, 2, 2, 2, 1, 1]  # same positions, other labels than the pool
    src = _source(train_y, test_y)
    t = lambda ids: torch.tensor(ids, dtype=torch.int64)  # noqa: E731
    client = ClientSplit(t([16, 17]), t([18]), t([19]), torch.tensor([0.5, 0.5, 0.0]))
    dv = [t([16, 17]), t([19, 20, 21, 22])]  # four of class 0: a val set subsampled to 2 per class would shrink
    dt = [t(R(0, 9)), t(R(10, 15))]
    fed = Federation([client], [0], [], t(R(0, 7)), K, "k", "test", domain_val=dv, domain_test=dt)
    ctx = _ctx(src, fed)
    view = subsampled(ctx, 2).federation
    ty, py = src.test.y, src.train.y
    # global: test-split classes [3, 1, 4] → [2, 1, 2]; domain 0: pool classes [3, 4, 3] → [2, 2, 2]; domain 1:
    # pool classes [4, 0, 2] → [2, 0, 2]
    assert torch.bincount(ty[view.global_test], minlength=K).tolist() == [2, 1, 2]
    assert torch.bincount(py[view.domain_test[0]], minlength=K).tolist() == [2, 2, 2]
    assert torch.bincount(py[view.domain_test[1]], minlength=K).tolist() == [2, 0, 2]
    for new, old in zip([view.global_test, *view.domain_test], [fed.global_test, *fed.domain_test], strict=True):
        assert set(new.tolist()) <= set(old.tolist()) and torch.equal(new, new.sort().values)
    assert all(torch.equal(a, b) for a, b in zip(view.domain_val, dv, strict=True)) and len(view.domain_val) == 2
    assert view.clients == fed.clients and view.participated == [0]
    again = subsampled(ctx, 2).federation
    assert torch.equal(again.global_test, view.global_test) and torch.equal(again.domain_test[0], view.domain_test[0])
    assert subsampled(ctx, None) is ctx
    # the draw itself: one permutation per set from a generator seeded 0 (independent of the run's seed), global
    # set first, then the domains; each class keeps its first per_class samples in that order
    gen = torch.Generator().manual_seed(0)
    for new, old, y in zip([view.global_test, *view.domain_test], [fed.global_test, *fed.domain_test], [ty, py, py],
                           strict=True):  # fmt: skip
        order = old[torch.randperm(len(old), generator=gen)]
        assert torch.equal(new, torch.cat([order[y[order] == c][:2] for c in range(K)]).sort().values)


# --- the new-client protocol --------------------------------------------------------------------------------------
def test_subset_is_a_prefix_of_one_fixed_order():
    """Rule (newclients.py:subset): the first ⌈f·n⌉ of a fixed random order, so S ⊂ M ⊂ L (and ⌈⌉ not ⌊⌋)."""
    src, fed = _fed("local")
    data = _ctx(src, fed).client_data(0)
    data = replace(data, train=torch.tensor([10, 11, 12, 13, 14]))
    pick = {f: subset(data, f, torch.Generator().manual_seed(5)).train for f in (0.2, 0.5, 1.0)}
    assert [len(v) for v in pick.values()] == [1, 3, 5]  # ⌈1⌉, ⌈2.5⌉, 5
    assert sorted(pick[1.0].tolist()) == [10, 11, 12, 13, 14]
    assert torch.equal(pick[0.5], pick[1.0][:3]) and torch.equal(pick[0.2], pick[1.0][:1])
    assert torch.equal(pick[1.0], data.train[torch.randperm(5, generator=torch.Generator().manual_seed(5))])
    assert torch.equal(subset(data, 0.5, torch.Generator().manual_seed(5)).val, data.val)  # only train shrinks


# New-client federation: client 0 participates; 1 and 2 are new. Each has 4 train / 4 val / 4 test samples, so a
# model right on the first k val and first m test samples scores (k/4, m/4).
def _nc_fed() -> tuple[DataSource, Federation]:
    src = _source([i % K for i in range(36)], [0])
    split = lambda b: ClientSplit(*(torch.arange(b + 4 * s, b + 4 * s + 4) for s in range(3)),  # noqa: E731
                                  prior=_prior(src.train.y, list(range(b, b + 4))))  # fmt: skip
    return src, Federation([split(0), split(12), split(24)], [0], [1, 2], torch.tensor([0]), K, "k", "test")


def _scored(src, fed, cid, val, test, group=None) -> Table:
    cl = fed.clients[cid]
    right = cl.val[: round(4 * val)].tolist() + cl.test[: round(4 * test)].tolist()
    return Table(src, right_train=right, group=group)


class SeqAlgo:
    """personalize yields one model per epoch with the given (val, test) accuracies."""

    name = "seq"

    def __init__(self, ctx, script, zero_shot=None) -> None:
        self.ctx, self.script, self.zs, self.calls = ctx, script, zero_shot, []

    def personalize(self, server, data, budget, generator):
        assert server is SERVER
        self.calls.append((data.cid, tuple(data.train.tolist()), budget, generator.initial_seed()))
        for val, test, *group in self.script(data.cid, len(data.train), budget.lr):
            yield _scored(self.ctx.source, self.ctx.federation, data.cid, val, test, *group)

    def zero_shot(self, server, data):
        assert server is SERVER
        return None if self.zs is None else _scored(self.ctx.source, self.ctx.federation, data.cid, *self.zs[data.cid])


def _run_one(script):
    src, fed = _nc_fed()
    ctx = _ctx(src, fed)
    algo = SeqAlgo(ctx, lambda c, n, lr: script)
    return run_one(algo, SERVER, 1, ctx.client_data(1), Budget("ft", len(script), 0.1, 4), torch.Generator(),
                   Predictions(src, 4))  # fmt: skip


def test_run_one_last_and_best_by_validation():
    """Rule (newclients.py:run_one): Last = test after the final epoch; Best = test at the epoch of best *val*
    (strict >: the earliest of tied epochs), never the best test; last_val / best_val = that epoch's val.

    Epochs (val, test): (.25,.5) (.75,.25) (.5,1) (.75,.75) (.5,.5) → best val .75 first at epoch 1 → Best .25
    (latest tie would give .75, best test 1.0); Last .5 with val .5. Groups a b a c a: epochs 2 and 4 reuse the
    group of a model already discarded (as a recycled id would), so each epoch must be scored afresh.
    """
    script = [(0.25, 0.5, "a"), (0.75, 0.25, "b"), (0.5, 1.0, "a"), (0.75, 0.75, "c"), (0.5, 0.5, "a")]
    assert _run_one(script) == pytest.approx({"last": 0.5, "best": 0.25, "last_val": 0.5, "best_val": 0.75})


def test_run_one_best_when_validation_is_zero_throughout():
    """An epoch with val accuracy 0 is still a candidate: Best = the first epoch when every val score is 0."""
    assert _run_one([(0.0, 0.5), (0.0, 0.75)]) == pytest.approx(
        {"last": 0.75, "best": 0.5, "last_val": 0.0, "best_val": 0.0}
    )


# Per-lr scripts for the full new-client protocol, M size (n = 4): (val, test) per epoch, for clients 1 and 2.
M_SCRIPT = {
    0.1: {1: [(1.0, 0.5), (0.25, 0.25)], 2: [(0.75, 0.25), (0.5, 0.5)]},
    0.2: {1: [(0.5, 0.75), (0.75, 0.5)], 2: [(0.25, 0.5), (0.75, 0.5)]},
    0.3: {1: [(0.5, 1.0), (0.5, 0.75)], 2: [(0.25, 0.75), (0.25, 0.5)]},
}
# Client means: lr .1: last (.25+.5)/2, best (.5+.25)/2, last_val (.25+.5)/2, best_val (1+.75)/2
#               lr .2: last .5, best .5 (epoch 1 both), last_val .75, best_val .75
#               lr .3: last (.75+.5)/2, best (1+.75)/2 (epoch 0: tie → earliest), last_val (.5+.25)/2, best_val same
M_PER_LR = {
    "0.1": {"last": 0.375, "best": 0.375, "last_val": 0.375, "best_val": 0.875},
    "0.2": {"last": 0.5, "best": 0.5, "last_val": 0.75, "best_val": 0.75},
    "0.3": {"last": 0.625, "best": 0.875, "last_val": 0.375, "best_val": 0.375},
}
# S (n = 2) swaps the scripts of lrs .1 and .3, so its Best rate differs from M's.
S_SCRIPT = {0.1: M_SCRIPT[0.3], 0.2: M_SCRIPT[0.2], 0.3: M_SCRIPT[0.1]}
S_PER_LR = {"0.1": M_PER_LR["0.3"], "0.2": M_PER_LR["0.2"], "0.3": M_PER_LR["0.1"]}
NC = {"methods": ["ft", "lp"], "fractions": [0.5, 1.0], "epochs": 2, "lrs": [0.1, 0.2, 0.3], "zero_shot": True}


def _nc_ctx(**nc):
    src, fed = _nc_fed()
    return _ctx(src, fed, seed=7, eval={"new_clients": {**NC, **nc}}, train={"batch_size": 5, "momentum": 0.5})


def _nc_algo(ctx, zero_shot=None):
    perfect = [(1.0, 1.0), (1.0, 1.0)]  # a participated client, were it (wrongly) personalized, would lift every mean
    return SeqAlgo(ctx, lambda c, n, lr: {2: S_SCRIPT, 4: M_SCRIPT}[n][lr].get(c, perfect), zero_shot)


def test_new_clients_lr_chosen_on_validation_separately_for_last_and_best():
    """Rules (newclients.py:evaluate_new_clients): figures are means over the *new* clients per lr (kept under
    per_lr); the rate for Last maximizes mean last_val (M: .2 → Last .5; the best Last on test would be .3), the
    rate for Best maximizes mean best_val (M: .1 → Best .375; on test it would be .3, on last_val .2); Δ = Best − Last.
    """
    ctx = _nc_ctx()
    out = evaluate_new_clients(_nc_algo(ctx), SERVER)
    assert out["clients"] == 2 and out["epochs"] == 2 and out["lrs"] == [0.1, 0.2, 0.3]
    assert out["sizes"] == {"S": 0.5, "M": 1.0}
    for method in ("ft", "lp"):
        m, s = out["methods"][method]["M"], out["methods"][method]["S"]
        assert m["per_lr"] == M_PER_LR and s["per_lr"] == S_PER_LR  # multiples of 1/8: exact in binary
        assert (m["lr_last"], m["lr_best"]) == (0.2, 0.1) and (s["lr_last"], s["lr_best"]) == (0.2, 0.3)
        for r in (m, s):
            assert r["last"] == pytest.approx(0.5) and r["best"] == pytest.approx(0.375)
            assert r["delta"] == pytest.approx(-0.125)


def test_new_clients_personalize_nested_subsets_with_the_protocol_budget():
    """Each new client trains on one fixed order's prefix: S (⌈.5·4⌉ = 2 samples) = the first half of M, the same
    data for every method and lr; Budget(method, epochs, lr, train.batch_size, train.momentum); one generator
    stream per (method, size, lr, client); participated clients never personalize here."""
    ctx = _nc_ctx()
    algo = _nc_algo(ctx)
    evaluate_new_clients(algo, SERVER)
    assert len(algo.calls) == 2 * 2 * 3 * 2
    for c in (1, 2):
        data = {n: {tr for cid, tr, _, _ in algo.calls if cid == c and len(tr) == n} for n in (2, 4)}
        assert len(data[2]) == len(data[4]) == 1  # same subset for every method and lr
        (s,), (m,) = data[2], data[4]
        assert m[:2] == s and sorted(m) == ctx.federation.clients[c].train.tolist()
        gen = rng.generator(7, rng.NEWCLIENT, 0, c)
        assert list(m) == ctx.federation.clients[c].train[torch.randperm(4, generator=gen)].tolist()
    assert {cid for cid, *_ in algo.calls} == {1, 2}
    assert {(b.method, b.lr) for *_, b, _ in algo.calls} == {(m, lr) for m in ("ft", "lp") for lr in (0.1, 0.2, 0.3)}
    assert all((b.epochs, b.batch_size, b.momentum) == (2, 5, 0.5) for *_, b, _ in algo.calls)
    assert len({seed for *_, seed in algo.calls}) == len(algo.calls)
    # the stream keys: run seed, the NEWCLIENT tag, then (1 + method, size, lr, client) — apart from the subset's
    # (…, 0, client) stream and every other stream tag, and different for another run seed
    sizes = {2: 0, 4: 1}
    lrs = {0.1: 0, 0.2: 1, 0.3: 2}
    for cid, tr, b, seed in algo.calls:
        keys = (1 + ["ft", "lp"].index(b.method), sizes[len(tr)], lrs[b.lr], cid)
        assert seed == rng.derive_seed(7, rng.NEWCLIENT, *keys)


def test_new_clients_zero_shot_is_the_mean_test_score_of_new_clients():
    """Zero-shot = the unadapted model's *test* score, mean over new clients (1: .5, 2: 1 → .75; their val scores
    are 0); None when the method has no zero-shot model or the config turns it off; None without new clients."""
    ctx = _nc_ctx(methods=[])
    zs = {0: (1.0, 0.0), 1: (0.0, 0.5), 2: (0.0, 1.0)}
    out = evaluate_new_clients(_nc_algo(ctx, zs), SERVER)
    assert out["zero_shot"] == pytest.approx({"acc": 0.75}) and out["methods"] == {}
    assert evaluate_new_clients(_nc_algo(ctx), SERVER)["zero_shot"] is None
    assert evaluate_new_clients(_nc_algo(_nc_ctx(methods=[], zero_shot=False), zs), SERVER)["zero_shot"] is None
    no_new = replace(ctx, federation=replace(ctx.federation, new=[]))
    assert evaluate_new_clients(_nc_algo(no_new, zs), SERVER) is None


def test_hand_built_fixtures_are_consistent():
    """Guards the fixtures the rules above lean on: priors, disjoint splits, and the table model's behaviour."""
    src, fed = _fed("local")
    assert fed.clients[0].prior.tolist() == [0.75, 0.25, 0.0] and fed.clients[1].prior.tolist() == [0.0, 0.5, 0.5]
    ids = torch.cat([t for cl in fed.clients for t in (cl.train, cl.val, cl.test)])
    assert len(ids.unique()) == len(ids) == len(TRAIN_Y) - 18
    model = Table(src, right_train=[0], right_test=[5])
    assert model.logits(torch.tensor([[0.0], [1.0], [OFF + 5.0]])).argmax(1).tolist() == [0, 1, 2]


def test_new_client_without_validation_data_keeps_last_epoch_as_best():
    """A new client with an empty val split (local protocol, a tiny client) cannot stop early: its Best is its Last
    (not the first epoch, and no crash), its val figures are NaN, and the per-lr val means — which choose the rates —
    are taken over the clients that have validation data, while test means cover every new client.

    Client 2 loses its val split. Full data, lr .1: client 1 last .25 / best .5 (val 1.0 at epoch 0) / last_val
    .25; client 2 last = best = .5 → means last .375, best .5, last_val .25, best_val 1.0. lr .2: .5, .5, .75, .75.
    lr .3: client 1 last .75, best 1.0, val .5; client 2 .5 → .625, .75, .5, .5. So Last at lr .2 (.5), Best at
    lr .1 (.5)."""
    src, fed = _nc_fed()
    run = _run_one([(0.5, 0.25), (0.75, 0.75)])  # sanity: with val, Best follows val
    assert run["best"] == 0.75
    no_val = replace(fed.clients[2], val=torch.zeros(0, dtype=torch.int64))
    fed = replace(fed, clients=[fed.clients[0], fed.clients[1], no_val])
    ctx = _ctx(src, fed, seed=7, eval={"new_clients": {**NC, "methods": ["ft"], "fractions": [1.0]}})
    algo = SeqAlgo(ctx, lambda c, n, lr: M_SCRIPT[lr][c])
    row = run_one(algo, SERVER, 2, ctx.client_data(2), Budget("ft", 2, 0.1, 4), torch.Generator(), Predictions(src, 4))
    assert (row["last"], row["best"]) == (0.5, 0.5)  # M_SCRIPT[.1][2]: tests .25 then .5
    assert row["last_val"] != row["last_val"] and row["best_val"] != row["best_val"]  # NaN: no val data
    m = evaluate_new_clients(algo, SERVER)["methods"]["ft"]["S"]  # the one size (all the data) is named S
    assert m["per_lr"] == {
        "0.1": {"last": 0.375, "best": 0.5, "last_val": 0.25, "best_val": 1.0},
        "0.2": {"last": 0.5, "best": 0.5, "last_val": 0.75, "best_val": 0.75},
        "0.3": {"last": 0.625, "best": 0.75, "last_val": 0.5, "best_val": 0.5},
    }
    assert (m["lr_last"], m["last"], m["lr_best"], m["best"], m["delta"]) == (0.2, 0.5, 0.1, 0.5, 0.0)


def test_new_client_means_skip_missing_validation_and_survive_when_all_lack_it():
    """Means over new clients skip NaN validation figures (clients without val data); when no client has val data
    the mean is NaN, not a crash — test figures still average over everyone."""
    import math

    got = _mean([{"last": 0.5, "last_val": 1.0}, {"last": 0.7, "last_val": float("nan")},
                 {"last": 0.9, "last_val": 0.0}])  # fmt: skip
    assert got == {"last": (0.5 + 0.7 + 0.9) / 3, "last_val": 0.5}
    none = _mean([{"last": 0.2, "last_val": float("nan")}, {"last": 0.4, "last_val": float("nan")}])
    assert none["last"] == (0.2 + 0.4) / 2 and math.isnan(none["last_val"])
    assert _mean([{"last": 0.25, "last_val": 0.5}]) == {"last": 0.25, "last_val": 0.5}  # a single new client


# --- which context, which models, which batch size -----------------------------------------------------------------
def test_evaluate_scores_on_the_context_it_is_given():
    """Rule (evaluate.py:evaluate): an explicit ctx (the `subsampled` view of intermediate evaluations) is the one
    scored, not the algorithm's full context; without one, the algorithm's. The view's global test set keeps
    positions 0, 4, 5 of which the generic model is right on 0 only (1/3; the full set gives 4/6)."""
    ctx = _mode_ctx("global")
    algo = FakeAlgo(ctx)
    view = replace(ctx, federation=replace(ctx.federation, global_test=torch.tensor([0, 4, 5])))
    assert evaluate(algo, SERVER, _states, view)[0]["gfl_acc"] == pytest.approx(1 / 3)
    assert evaluate(algo, SERVER, _states)[0]["gfl_acc"] == pytest.approx(4 / 6)


def test_gfl_val_is_missing_not_nan_without_any_validation_data():
    """No participated client has a val split (and no domain val sets): gfl_val and pfl_val are None — no figure —
    rather than an accuracy over zero samples (NaN would reach summary.json and the selected-round fallback)."""
    src, fed = _fed("local")
    empty = torch.zeros(0, dtype=torch.int64)
    clients = [replace(fed.clients[0], val=empty), replace(fed.clients[1], val=empty), fed.clients[2]]
    out, _ = evaluate(FakeAlgo(_ctx(src, fed)), SERVER, _states, _ctx(src, replace(fed, clients=clients)))
    assert out["gfl_val"] is None and out["pfl_val"] is None
    assert out["gfl_acc"] == pytest.approx(4 / 6)


def test_last_is_the_final_model_and_an_empty_personalization_is_an_error():
    """Rule (evaluate.py:last, newclients.py:run_one): the personalized model is the last one yielded; a
    personalization that yields no model is an error, never a silently missing score."""
    src, _ = _fed("local")
    a, b = Table(src), Table(src)
    assert last(iter([a, b])) is b
    with pytest.raises(ValueError, match="no model"):
        last(iter([]))
    with pytest.raises(ValueError, match="no model"):
        _run_one([])


def test_each_distinct_model_is_warmed_over_its_own_clients_samples():
    """Rule (evaluate.py:_warm): models are grouped by their own identity — each distinct model runs one forward
    over exactly its own clients' samples (local: client 0 val 2 + test 4, client 1 val 3 + test 2), never over
    another client's; a feature-keyed predictor runs its body once over all of its evaluation sets, without
    stopping the warm-up of the models after it."""
    ctx = _mode_ctx("local")
    a, b = Table(ctx.source), Table(ctx.source)
    client_scores({0: a, 1: b}, ctx, Predictions(ctx.source, 4))
    assert a.calls == [6] and b.calls == [5]
    body: list[int] = []
    head, c = Head(Table(ctx.source), body), Table(ctx.source)
    client_scores({0: head, 1: c}, ctx, Predictions(ctx.source, 4))
    assert c.calls == [5] and body == [6]  # the head's body: once, over its test and val sets together


def test_every_forward_runs_at_eval_batch_size():
    """Rule (eval.batch_size, "inference batch size"): G-FL / P-FL evaluation, evaluation-time personalization,
    the new-client protocol and the shared-body feature path all run their forwards at the configured batch size
    (3 here), not the predictors' default (1024)."""

    def used() -> set[int]:
        seen = set(Table.batch_sizes)
        Table.batch_sizes.clear()
        return seen

    used()
    src, fed = _fed("local")
    ctx = _ctx(src, fed, eval={"batch_size": 3, "ft_epochs": 1})
    evaluate(FakeAlgo(ctx), SERVER, _states, ctx)
    assert used() == {3}
    evaluate_personalized(FakeAlgo(ctx), SERVER, "ft", lambda c: torch.Generator())
    assert used() == {3}
    head = Head(Table(src), [])
    Predictions(src, 3)(head, "train", torch.tensor([0, 1]))
    assert used() == {3}  # features and head alike
    src, fed = _nc_fed()
    nctx = _ctx(src, fed, eval={"batch_size": 3, "new_clients": {**NC, "methods": ["ft"], "lrs": [0.1]}})
    evaluate_new_clients(_nc_algo(nctx, {1: (0.0, 0.5), 2: (0.0, 1.0)}), SERVER)
    assert used() == {3}


# --- a personalization's random draws ----------------------------------------------------------------------------
def _dropout_run(monkeypatch):
    """FedAvg on AlexNet (dropout) with a new client, prepared, and the parameters of every personalization's final
    model as it is made (`finals`)."""
    from pflbed.config import validate_config
    from pflbed.engine.build import prepare

    from ..tiny import DATA, TINY

    cfg = validate_config({**TINY, "dataset": DATA, "model": {"name": "alexnet_small_x025"},
                           "federation": {**TINY["federation"], "new_clients": 1},
                           "eval": {"finetune": ["ft"], "new_clients": {"epochs": 1, "lrs": [0.05], "fractions": [1.0],
                                                                        "methods": ["ft"], "zero_shot": False}},
                           "executor": {"threads": 1}})  # fmt: skip
    algo = prepare(cfg)
    finals, real = [], algo.personalize

    def personalize(*args):
        for pred in real(*args):
            yield pred
        finals.append({k: v.clone() for k, v in pred.params.items()})

    monkeypatch.setattr(algo, "personalize", personalize)
    return algo, algo.init_server(), finals


@pytest.mark.parametrize("where", ["finetune", "new clients", "site"])
def test_a_personalizations_dropout_masks_come_from_its_own_seed_not_from_what_ran_before(where, monkeypatch):
    """Rule (`rng.global_from` around every personalization): its dropout masks, drawn from torch's global RNG, are
    seeded by what the personalization is for. Left unseeded they were whatever the process last left there — the
    loop's last client update, nothing in a procs or Flower server — so the figures of +FT and new clients on a
    dropout model depended on the executor. Two different global states before: the same models; and the global
    RNG is left as it was found."""
    from pflbed.flower.site_eval import evaluate_site

    algo, server, finals = _dropout_run(monkeypatch)
    fed = algo.ctx.federation

    def personalize():
        if where == "finetune":
            evaluate_personalized(algo, server, "ft", lambda c: rng.generator(0, rng.FINETUNE, 0, c))
        elif where == "new clients":
            evaluate_new_clients(algo, server)
        else:
            evaluate_site(algo, server, algo.init_client, sorted(fed.participated), "ft")

    runs = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        state = torch.get_rng_state()
        personalize()
        assert torch.equal(torch.get_rng_state(), state)
        runs.append(finals[:])
        finals.clear()
    assert len(runs[0]) == (len(fed.new) if where == "new clients" else len(fed.participated)) > 0
    assert all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(*runs, strict=True))


def test_the_global_rng_is_seeded_from_the_generators_own_seed_apart_from_its_numbers():
    """Rule (`rng.global_from`): inside, torch's global RNG draws a stream fixed by the generator's seed — the same
    for the same seed, another for another (each client's personalization its own masks) and not the generator's
    own numbers, which it leaves undrawn; outside, the global RNG is where it was."""
    cpu = torch.device("cpu")

    def inside(seed):
        gen = rng.generator(0, rng.FINETUNE, 0, seed)
        with rng.global_from(gen, cpu):
            drawn = torch.rand(6)
        return drawn, torch.rand(6, generator=gen)

    torch.manual_seed(5)
    state = torch.get_rng_state()
    (a, own), (again, _), (other, _) = inside(1), inside(1), inside(2)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a, again) and not torch.equal(a, other) and not torch.equal(a, own)
    assert torch.equal(own, torch.rand(6, generator=rng.generator(0, rng.FINETUNE, 0, 1)))  # nothing drawn from it
