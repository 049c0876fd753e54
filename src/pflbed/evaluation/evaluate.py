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


def _per_client(
    preds: dict[int, Predictor], splits: dict[int, torch.Tensor], x: torch.Tensor, y: torch.Tensor, bs: int
) -> dict[int, float]:
    """Accuracy of each client's predictor on its own indices, one forward per distinct predictor."""
    groups: dict[tuple[int, int], list[int]] = {}
    for cid, p in preds.items():
        groups.setdefault(p.group, []).append(cid)
    out: dict[int, float] = {}
    for cids in groups.values():
        idx = torch.cat([splits[c] for c in cids])
        hits = _predict(preds[cids[0]], x[idx], bs) == y[idx]
        for c, h in zip(cids, hits.split([len(splits[c]) for c in cids]), strict=True):
            out[c] = float(h.float().mean()) if len(h) else float("nan")
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
        val_idx = torch.cat([fed.clients[c].val for c in cids])
        if len(val_idx):
            out["gfl_val"] = accuracy(_predict(generic, src.train.x[val_idx], bs), src.train.y[val_idx])
    preds = {c: algo.personal_model(server, states(c)) for c in cids}
    out.update(_personal_stats(preds, ctx, "pfl"))
    return out


def _personal_stats(preds: dict[int, Predictor], ctx, prefix: str) -> dict[str, float | None]:
    cfg, fed, src = ctx.cfg, ctx.federation, ctx.source
    bs = cfg.eval.batch_size
    if cfg.eval.pfl_test == "global":
        idx = fed.global_test
        priors = {c: fed.clients[c].prior for c in preds}
        test = _class_weighted(preds, priors, src.test.x[idx], src.test.y[idx], src.num_classes, bs)
    else:
        test = _per_client(preds, {c: fed.clients[c].test for c in preds}, src.train.x, src.train.y, bs)
    val = _per_client(preds, {c: fed.clients[c].val for c in preds}, src.train.x, src.train.y, bs)
    s = client_stats(list(test.values()))
    vals = [v for v in val.values() if v == v]  # clients with an empty val split are skipped
    return {
        f"{prefix}_acc": s["mean"], f"{prefix}_acc_std": s["std"], f"{prefix}_acc_min": s["min"],
        f"{prefix}_acc_p10": s["p10"], f"{prefix}_val": sum(vals) / len(vals) if vals else None,
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
    return _personal_stats(preds, ctx, "pfl")
