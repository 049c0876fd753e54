"""G-FL and P-FL evaluation of a training state.

Work is shared wherever the models are: clients whose personal predictor is the same model (FedAvg's global
model, say) are evaluated with one batched forward over the union of their test indices, and on the shared test
set one set of per-class counts serves every client's class-weighted accuracy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pflbed.algorithms.base import Algorithm, Budget, Predictor, Tensors
from pflbed.evaluation.metrics import accuracy, class_counts, class_weighted_accuracy, client_stats


def _predict(pred: Predictor, x: torch.Tensor, batch_size: int) -> torch.Tensor:
    return pred.logits(x, batch_size).argmax(1)


class PoolPredictions:
    """Predictions on the training pool (where clients' val and test splits live), computed once per predictor.

    Keyed by predictor group, so FedAvg's one global model is run once over the union of every client's val
    and test indices, and G-FL validation reuses those predictions.
    """

    def __init__(self, x: torch.Tensor, batch_size: int) -> None:
        self.x, self.bs = x, batch_size
        self.store: dict[tuple[int, int], torch.Tensor] = {}

    def __call__(self, pred: Predictor, idx: torch.Tensor) -> torch.Tensor:
        out = self.store.get(pred.group)
        if out is None:
            out = self.store[pred.group] = torch.full((len(self.x),), -1, dtype=torch.int64)
        missing = idx[out[idx] < 0]
        if len(missing):
            out[missing] = _predict(pred, self.x[missing], self.bs)
        return out[idx]


def _per_client(
    preds: dict[int, Predictor], splits: dict[int, torch.Tensor], pool: PoolPredictions, y: torch.Tensor
) -> dict[int, float]:
    """Accuracy of each client's predictor on its own indices of the pool (filled beforehand, group-wise)."""
    out: dict[int, float] = {}
    for cid, p in preds.items():
        idx = splits[cid]
        out[cid] = float((pool(p, idx) == y[idx]).float().mean()) if len(idx) else float("nan")
    return out


def _class_weighted(
    preds: dict[int, Predictor], priors: dict[int, torch.Tensor], x: torch.Tensor, y: torch.Tensor, k: int, bs: int
) -> dict[int, float]:
    counts: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    out = {}
    for cid, p in preds.items():
        if p.group not in counts:
            counts[p.group] = class_counts(_predict(p, x, bs), y, k)
        out[cid] = class_weighted_accuracy(*counts[p.group], priors[cid])
    return out


def evaluate(algo: Algorithm, server: Tensors, states: Callable[[int], Tensors]) -> dict[str, float | None]:
    """One evaluation: G-FL test / val and P-FL test / val statistics over the participated clients."""
    ctx = algo.ctx
    cfg, fed, src = ctx.cfg, ctx.federation, ctx.source
    bs = cfg.eval.batch_size
    cids = fed.participated
    out: dict[str, float | None] = {"gfl_acc": None, "gfl_val": None}
    generic = algo.generic_model(server)
    if generic is not None:
        test_idx = fed.global_test
        out["gfl_acc"] = accuracy(_predict(generic, src.test.x[test_idx], bs), src.test.y[test_idx])
    pool = PoolPredictions(src.train.x, bs)
    preds = {c: algo.personal_model(server, states(c)) for c in cids}
    out.update(_personal_stats(preds, ctx, pool))
    if generic is not None:
        val_idx = torch.cat([fed.clients[c].val for c in cids])
        out["gfl_val"] = accuracy(pool(generic, val_idx), src.train.y[val_idx]) if len(val_idx) else None
    return out


def _personal_stats(preds: dict[int, Predictor], ctx, pool: PoolPredictions) -> dict[str, float | None]:
    cfg, fed, src = ctx.cfg, ctx.federation, ctx.source
    local_test = cfg.eval.pfl_test == "local"
    groups: dict[tuple[int, int], list[int]] = {}
    for cid, p in preds.items():
        groups.setdefault(p.group, []).append(cid)
    for cids in groups.values():  # one forward per distinct predictor over all its clients' val (+ test) data
        pool(
            preds[cids[0]],
            torch.cat([fed.clients[c].val for c in cids] + ([fed.clients[c].test for c in cids] if local_test else [])),
        )
    if not local_test:
        idx = fed.global_test
        priors = {c: fed.clients[c].prior for c in preds}
        test = _class_weighted(preds, priors, src.test.x[idx], src.test.y[idx], src.num_classes, pool.bs)
    else:
        test = _per_client(preds, {c: fed.clients[c].test for c in preds}, pool, src.train.y)
    val = _per_client(preds, {c: fed.clients[c].val for c in preds}, pool, src.train.y)
    prefix = "pfl"
    s = client_stats(list(test.values()))
    vals = [v for v in val.values() if v == v]  # clients with an empty val split are skipped
    return {
        f"{prefix}_acc": s["mean"],
        f"{prefix}_acc_std": s["std"],
        f"{prefix}_acc_min": s["min"],
        f"{prefix}_acc_p10": s["p10"],
        f"{prefix}_val": sum(vals) / len(vals) if vals else None,
        f"_{prefix}_per_client": test,  # type: ignore[dict-item]
    }


def evaluate_personalized(algo: Algorithm, server: Tensors, method: str, generator_for) -> dict[str, float | None]:
    """P-FL after each participated client personalizes the generic model (FedAvg+FT / FedAvg+LP)."""
    ctx = algo.ctx
    e, t = ctx.cfg.eval, ctx.cfg.train
    budget = Budget(method, e.ft_epochs, e.ft_lr, t.batch_size, t.momentum)
    preds = {}
    for c in ctx.federation.participated:
        p = algo.personalize(server, ctx.client_data(c), budget, generator_for(c))
        preds[c] = Predictor(p.model, p.params)
    return _personal_stats(preds, ctx, PoolPredictions(ctx.source.train.x, e.batch_size))
