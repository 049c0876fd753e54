"""G-FL and P-FL evaluation of a training state.

Work is shared wherever the models are: predictions are cached per (predictor, split) and computed once per
sample, so FedAvg's single global model is run once over every client's val and test data, and a shared test
set (global or per domain) is predicted once per distinct model however many clients use it.

Which P-FL protocol applies:
- `domain` (federation.protocol = pflbed): class-weighted accuracy on the client's domain test set, weights =
  the client's training class prior; validation likewise on the domain's val set.
- `global` (eval.pfl_test = global): class-weighted accuracy on the global balanced test set.
- `local` (default otherwise): plain accuracy on the client's own test split.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch

from pflbed import rng
from pflbed.algorithms.base import Algorithm, Budget, Context, Predictor, Tensors
from pflbed.data.arrays import DataSource
from pflbed.evaluation.heads import predict_all
from pflbed.evaluation.metrics import accuracy, class_counts, class_weighted_accuracy, client_stats
from pflbed.models.inference import inference_rows

Forward = Callable[[Predictor, str, str, list[torch.Tensor], int], list[torch.Tensor] | None]
"""Where an evaluation's forwards may run (`engine.procs.ProcsExecutor.forward`): given (predictor, method, split,
index parts, batch size), `getattr(predictor, method)(x[part], batch size)` for each part, x the split's samples
— or None, to run them in this process."""


class Predictions:
    """Predicted labels per (predictor group, split), computed lazily, once per sample.

    Index tensors passed in must be ones the federation owns (a client's splits, a domain's shared sets): body
    features of feature-keyed predictors, and the labels `warm_heads` precomputes, are cached by the index
    tensor's identity.
    """

    def __init__(self, source: DataSource, batch_size: int, forward: Forward | None = None) -> None:
        self.source, self.bs, self.forward = source, batch_size, forward
        self.store: dict[tuple[tuple[int, int], str], torch.Tensor] = {}
        self.feats: dict[tuple, torch.Tensor] = {}  # body features per (feature_key, split, index tensor)
        # `warm_heads` results per (predictor, set): (predictor, labels block, first row, rows) — sliced when read
        self.labels: dict[tuple, tuple[Predictor, torch.Tensor, int, int]] = {}

    def __call__(self, pred: Predictor, split: str, idx: torch.Tensor) -> torch.Tensor:
        x = getattr(self.source, split).x
        if pred.feature_key is not None:  # shared frozen body: features once, then only the head
            hit = self.labels.get((id(pred), split, idx.data_ptr(), idx.numel()))
            if hit is not None and hit[0] is pred:
                return hit[1][hit[2] : hit[2] + hit[3]]
            key = (pred.feature_key, split, idx.data_ptr(), idx.numel())
            if key not in self.feats:
                self.feats[key] = pred.features(x[idx], self.bs)
            return pred.classify(self.feats[key], self.bs).argmax(1)
        out = self.store.get((pred.group, split))
        if out is None:
            out = self.store[(pred.group, split)] = torch.full((len(x),), -1, dtype=torch.int64, device=x.device)
        missing = idx[out[idx] < 0].unique()
        if len(missing):
            parts = [missing]
            if self._remote(pred, "logits"):  # parts of whole forward chunks: the same chunks as one call
                step = max(1, 16 * self.bs // (rows := inference_rows(pred.model, "forward", x, self.bs))) * rows
                parts = list(missing.split(step))
            out[missing] = torch.cat(self._run(pred, "logits", split, parts)).argmax(1)
        return out[idx]

    def _remote(self, pred: Predictor, method: str) -> bool:
        """Whether `method` of `pred` may run through `forward`: there is one, and the method is `Predictor`'s own
        (a subclass's could depend on this process or on how its inputs are split)."""
        return self.forward is not None and getattr(type(pred), method) is getattr(Predictor, method)

    def _run(self, pred: Predictor, method: str, split: str, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """`getattr(pred, method)(x[part])` for each part: through `forward` where it may and will, else here."""
        out = self.forward(pred, method, split, parts, self.bs) if self._remote(pred, method) else None
        if out is None:
            x = getattr(self.source, split).x
            out = [getattr(pred, method)(x[p], self.bs) for p in parts]
        return out

    def warm_heads(self, items: list[tuple[Predictor, str, torch.Tensor]]) -> None:
        """Labels of many heads on one shared body: (predictor, split, pool indices) per item, all predictors of
        one `feature_key` and model. The body runs once per split over the union of the items' samples; the heads
        run as one batched operation (`heads.predict_all`).

        Features are gathered once per distinct index tensor (clients of one domain share theirs), in order of first
        appearance, so the sets a predictor lists together (test, val) are usually adjacent rows: one view, shared
        by every predictor with the same sets (`predict_all` runs a shared set once); other orders are gathered.
        """
        first = items[0][0]
        span: dict[tuple[str, int, int], tuple[int, int]] = {}  # (split, index tensor) → its rows in `feats[split]`
        feats: dict[str, torch.Tensor] = {}
        for split in dict.fromkeys(s for _, s, _ in items):
            distinct = {(s, i.data_ptr(), i.numel()): i for _, s, i in items if s == split}
            wanted = torch.cat(list(distinct.values()))
            union = wanted.unique()  # sorted
            body = torch.cat(self._run(first, "features", split, list(union.split(16 * self.bs))))  # a slice at a time
            feats[split] = body[torch.searchsorted(union, wanted)]
            start = 0
            for key, i in distinct.items():
                span[key], start = (start, start + i.numel()), start + i.numel()
        # One head application per predictor and split, on the rows of all its sets.
        groups: dict[tuple[int, str], list[tuple[int, int, int]]] = {}  # (predictor, split) → its sets' keys
        owner: dict[int, Predictor] = {}
        for p, split, idx in items:
            groups.setdefault((id(p), split), []).append((idx.data_ptr(), idx.numel()))
            owner[id(p)] = p
        views: dict[tuple, torch.Tensor] = {}
        zs: list[torch.Tensor] = []
        for (_, split), sets in groups.items():
            rows = [r for r in (span[(split, *k)] for k in sets) if r[1] > r[0]] or [(0, 0)]  # empty sets: no rows
            contiguous = len(rows) == 1 or all(a[1] == b[0] for a, b in zip(rows, rows[1:], strict=False))
            key = (split, rows[0][0], rows[-1][1]) if contiguous else (split, *rows)
            if key not in views:
                f = feats[split]
                views[key] = f[rows[0][0] : rows[-1][1]] if contiguous else torch.cat([f[a:b] for a, b in rows])
            zs.append(views[key])
        labels = predict_all([owner[pid] for pid, _ in groups], zs, self.bs)
        start = 0
        for (pid, split), sets in groups.items():
            for ptr, n in sets:
                self.labels[(pid, split, ptr, n)] = owner[pid], labels, start, n
                start += n

    def gather(self, items: list[tuple[Predictor, str, torch.Tensor]]) -> torch.Tensor:
        """The labels of every (predictor, split, indices) item, concatenated in order: `__call__` of each item,
        but items `warm_heads` labelled in one block come out of one indexing operation rather than one slice per
        item (20,000 slices an evaluation at 10,000 clients)."""
        hits = [self.labels.get((id(p), s, i.data_ptr(), i.numel())) for p, s, i in items]
        block = hits[0][1] if hits and hits[0] is not None else None
        one_block = block is not None and all(
            h is not None and h[1] is block and h[0] is p for h, (p, _, _) in zip(hits, items, strict=True)
        )
        if not one_block:  # the per-item path (a hit of another predictor, whose id was reused, is not a hit)
            return torch.cat([self(p, s, i) for p, s, i in items]) if items else torch.zeros(0, dtype=torch.int64)
        starts = torch.tensor([h[2] for h in hits], device=block.device)
        sizes = torch.tensor([h[3] for h in hits], device=block.device)
        offsets = torch.cumsum(sizes, 0) - sizes  # where each item's rows begin in the output
        rows = torch.arange(int(sizes.sum()), device=block.device)
        return block[rows + torch.repeat_interleave(starts - offsets, sizes)]

    def forget_models(self) -> None:
        """Drop everything cached per model (keep shared-body features): before scoring the next models."""
        self.store.clear()
        self.labels.clear()


def pfl_mode(ctx: Context) -> str:
    return "domain" if ctx.federation.domain_test else ctx.cfg.eval.pfl_test


def needs(cid: int, ctx: Context, which: str) -> tuple[str, torch.Tensor]:
    """(split, indices) client `cid`'s `which` ("test" or "val") score is computed on under the protocol."""
    fed, mode = ctx.federation, pfl_mode(ctx)
    cl = fed.clients[cid]
    if mode == "domain":
        return "train", (fed.domain_test if which == "test" else fed.domain_val)[cl.domain]
    if mode == "global" and which == "test":
        return fed.global_split, fed.global_test
    return "train", cl.test if which == "test" else cl.val


def client_score(pred: Predictor, cid: int, ctx: Context, P: Predictions, which: str) -> float:
    """P-FL accuracy of `pred` for client `cid` on its `which` ("test" or "val") data under the protocol:
    class-weighted by the client's prior on shared sets (domain; global test), plain on its own split."""
    split, idx = needs(cid, ctx, which)
    labels, y = P(pred, split, idx), getattr(ctx.source, split).y[idx]
    if class_weighted(ctx, which):
        return _weighted(labels, y, ctx.federation.clients[cid].prior)
    return accuracy(labels, y)


def class_weighted(ctx: Context, which: str) -> bool:
    """Whether `which` scores are class-weighted by the client's prior: on shared sets (domain; global test)."""
    mode = pfl_mode(ctx)
    return mode == "domain" or (mode == "global" and which == "test")


def client_scores(
    preds: dict[int, Predictor], ctx: Context, P: Predictions
) -> tuple[dict[int, float], dict[int, float]]:
    """(test, val) P-FL accuracy per client under the federation's protocol."""
    sets = {which: [needs(c, ctx, which) for c in preds] for which in ("test", "val")}
    _warm(preds, P, sets)
    return _scores(preds, ctx, P, "test", sets["test"]), _scores(preds, ctx, P, "val", sets["val"])


def _scores(
    preds: dict[int, Predictor], ctx: Context, P: Predictions, which: str, sets: list[tuple[str, torch.Tensor]]
) -> dict[int, float]:
    """`client_score` of every client, given each one's (split, indices) for `which`. Plain accuracies on the
    clients' own splits are counted in one pass (the same float32 numbers `accuracy` gives); class-weighted ones
    per client."""
    if class_weighted(ctx, which):
        return {c: client_score(p, c, ctx, P, which) for c, p in preds.items()}
    if not sets:
        return {}
    idxs = [idx for _, idx in sets]
    labels = P.gather([(p, "train", idx) for p, idx in zip(preds.values(), idxs, strict=True)])
    right = (labels == ctx.source.train.y[torch.cat(idxs)]).float()
    sizes = torch.tensor([idx.numel() for idx in idxs], device=right.device)
    client = torch.repeat_interleave(torch.arange(len(idxs), device=right.device), sizes)
    correct = torch.zeros(len(idxs), device=right.device).index_add_(0, client, right)
    return dict(zip(preds, (correct / sizes).tolist(), strict=True))  # 0 / 0: NaN, as `accuracy` of nothing


def _weighted(pred: torch.Tensor, y: torch.Tensor, prior: torch.Tensor) -> float:
    return class_weighted_accuracy(*class_counts(pred, y, len(prior)), prior)


def _warm(preds: dict[int, Predictor], P: Predictions, sets: dict[str, list[tuple[str, torch.Tensor]]]) -> None:
    """Predict everything the scores will read, with as few forwards as possible.

    A model shared by several clients (same `group`) runs one batched forward per split over all samples its
    clients need; predictors on one shared body (same `feature_key` and model) run the body once per split and
    all their heads as one batched operation (`Predictions.warm_heads`).
    """
    pred_list = list(preds.values())
    groups: dict[tuple, list[int]] = {}  # positions in `pred_list`
    for i, p in enumerate(pred_list):
        key = ("heads", p.feature_key, id(p.model)) if p.feature_key is not None else ("model", p.group)
        groups.setdefault(key, []).append(i)
    for key, pos in groups.items():
        items = [(pred_list[i], *sets[which][i]) for i in pos for which in ("test", "val")]
        if key[0] == "heads":
            P.warm_heads(items)
            continue
        for split in dict.fromkeys(s for _, s, _ in items):
            P(pred_list[pos[0]], split, torch.cat([idx for _, s, idx in items if s == split]))


def summarize(test: dict[int, float], val: dict[int, float], prefix: str = "pfl") -> dict:
    s = client_stats(list(test.values()))
    vals = [v for v in val.values() if v == v]  # clients with an empty val split are skipped
    return {
        f"{prefix}_acc": s["mean"],
        f"{prefix}_acc_std": s["std"],
        f"{prefix}_acc_min": s["min"],
        f"{prefix}_acc_p10": s["p10"],
        f"{prefix}_val": sum(vals) / len(vals) if vals else None,
    }


def subsampled(ctx: Context, per_class: int | None) -> Context:
    """A view of `ctx` whose shared test sets (global, per domain) keep at most `per_class` samples of each class.

    For intermediate evaluations (DESIGN §6): a fixed, class-balanced subset, the same in every evaluation and
    every run of the federation; the final evaluation always uses the full sets. Validation data is not touched,
    so the round selected on validation does not depend on it.
    """
    fed = ctx.federation
    if not per_class:
        return ctx
    gen = torch.Generator(device="cpu").manual_seed(0)  # the same subset whatever the device

    def sub(idx: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        idx = idx[torch.randperm(len(idx), generator=gen, device="cpu")]
        keep = [idx[y[idx] == c][:per_class] for c in range(fed.num_classes)]
        return torch.cat(keep).sort().values

    split_y = getattr(ctx.source, fed.global_split).y
    view = replace(fed, global_test=sub(fed.global_test, split_y),
                   domain_test=[sub(t, ctx.source.train.y) for t in fed.domain_test])  # fmt: skip
    return replace(ctx, federation=view)


def evaluate(
    algo: Algorithm, server: Tensors, states: Callable[[int], Tensors], ctx: Context | None = None,
    forward: Forward | None = None,
) -> tuple[dict, dict[int, float]]:  # fmt: skip
    """One evaluation of the participated clients: (G-FL and P-FL figures, P-FL test accuracy per client).

    `ctx` may be a `subsampled` view of the algorithm's context (cheaper intermediate evaluations); `forward`, where
    the heavy forwards may run (the executor's). Runs with the cyclic garbage collector paused (`_gc_paused`).
    """
    with _gc_paused():
        return _evaluate(algo, server, states, ctx, forward)


def _evaluate(
    algo: Algorithm, server: Tensors, states: Callable[[int], Tensors], ctx: Context | None, forward: Forward | None
) -> tuple[dict, dict[int, float]]:
    ctx = ctx or algo.ctx
    fed = ctx.federation
    P = Predictions(ctx.source, ctx.cfg.eval.batch_size, forward)
    out: dict = {"gfl_acc": None, "gfl_val": None}
    generic = algo.generic_model(server)
    if generic is not None:
        gy = getattr(ctx.source, fed.global_split).y[fed.global_test]
        out["gfl_acc"] = accuracy(P(generic, fed.global_split, fed.global_test), gy)
    preds = {c: algo.personal_model(server, states(c)) for c in fed.participated}
    test, val = client_scores(preds, ctx, P)
    out.update(summarize(test, val))
    if generic is not None:
        val_idx = torch.cat(fed.domain_val if fed.domain_val else [fed.clients[c].val for c in fed.participated])
        out["gfl_val"] = accuracy(P(generic, "train", val_idx), ctx.source.train.y[val_idx]) if len(val_idx) else None
    return out, test


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector, as it was before afterwards.

    An evaluation of 10,000 clients allocates a few container objects per client (predictors, index keys, client
    states on first use). That is enough to trigger full collections, and each one traverses every object of the
    process: at 10,000 clients the federation alone holds ~450,000, and a full collection costs ~0.2 s, a third of
    an evaluation. Evaluation builds no reference cycles of its own that would outlive it, so nothing is lost.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def last(predictors: Iterable[Predictor]) -> Predictor:
    """The final model of a per-epoch personalization."""
    final = None
    for final in predictors:  # noqa: B007 - only the last one is wanted
        pass
    if final is None:
        raise ValueError("personalization yielded no model")
    return final


def evaluate_personalized(algo: Algorithm, server: Tensors, method: str, generator_for,
                          tick: Callable[[], None] | None = None) -> dict:  # fmt: skip
    """P-FL after each participated client personalizes from the trained state (e.g. FedAvg+FT / FedAvg+LP);
    `tick` is called after each client (progress)."""
    ctx = algo.ctx
    e, t = ctx.cfg.eval, ctx.cfg.train
    budget = Budget.of(method, e.ft_epochs, e.ft_lr, t)
    P = Predictions(ctx.source, e.batch_size)
    test: dict[int, float] = {}
    val: dict[int, float] = {}
    for c in ctx.federation.participated:  # one client at a time: only one personalized model alive
        gen = generator_for(c)
        with rng.global_from(gen, ctx.device):  # its dropout masks: its own, whatever ran before (`rng.global_from`)
            p = last(algo.personalize(server, ctx.client_data(c), budget, gen))
        t_c, v_c = client_scores({c: p}, ctx, P)
        test[c], val[c] = t_c[c], v_c[c]
        P.forget_models()
        if tick is not None:
            tick()
    return summarize(test, val)
