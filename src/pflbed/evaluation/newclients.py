"""The new-client protocol (FedBasis/PFLBED paper §5, App. B, Table 2).

After training, every held-out client adapts from the trained server state with its algorithm's `personalize`
on a fraction of its training data (S / M / L, default 50 % / 100 %), for E epochs at each learning rate of a
grid. Its model is scored after every epoch on validation data and, when validation improves, on test data:

- **Last**: test accuracy after the final epoch;
- **Best**: test accuracy at the epoch with the best validation accuracy (earliest on ties) — early stopping
  that a client could actually do, never chosen on test;
- **Δ = Best − Last**: how much a method depends on stopping at the right time.

Scores follow the federation's P-FL protocol (class-weighted on the domain's shared sets under PFLBED). Figures
are means over new clients. The learning rate is chosen per (method, size) on validation, like every other
choice: for Last the rate with the best mean last-epoch validation accuracy, for Best the rate with the best mean
best-epoch validation accuracy. Every rate's figures are kept under `per_lr` (robustness tables need them).
Zero-shot is the method's `zero_shot` model with no adaptation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from pflbed import rng
from pflbed.algorithms.base import Algorithm, Budget, ClientData, Tensors
from pflbed.evaluation.evaluate import Predictions, client_score
from pflbed.federation.federation import draw_subset, new_client_train

SIZE_NAMES = ("S", "M", "L")


def subset(data: ClientData, fraction: float, generator: torch.Generator) -> ClientData:
    """The first ⌈fraction·n⌉ of a fixed random order of the client's training indices (S ⊂ M ⊂ L)."""
    return replace(data, train=draw_subset(data.train, fraction, generator))


def run_one(algo: Algorithm, server: Tensors, cid: int, data: ClientData, budget: Budget, gen: torch.Generator,
            P: Predictions) -> dict[str, float]:  # fmt: skip
    """Personalize one client with one budget; last and best-by-validation scores.

    Validation is scored every epoch; test only twice, for the best-validation model (kept by reference: every
    epoch yields a fresh parameter snapshot) and for the last one.
    """
    ctx = algo.ctx
    best_val, best, last, val = -1.0, None, None, float("nan")
    with rng.global_from(gen, ctx.device):  # its dropout masks: its own, whatever ran before (`rng.global_from`)
        for pred in algo.personalize(server, data, budget, gen):
            val = client_score(pred, cid, ctx, P, "val")
            P.store.clear()  # each epoch is a new model
            if val > best_val:
                best_val, best = val, pred
            last = pred
    if last is None:
        raise ValueError(f"{algo.name}.personalize yielded no model")
    if best is None:  # no validation data (val NaN every epoch): the client cannot stop early, so Best = Last
        best, best_val = last, val
    last_test = client_score(last, cid, ctx, P, "test")
    best_test = last_test if best is last else client_score(best, cid, ctx, P, "test")
    P.store.clear()
    return {"last": last_test, "best": best_test, "last_val": val, "best_val": best_val}


def _mean(rows: list[dict[str, float]]) -> dict[str, float]:
    """Means over clients, skipping NaN (val figures of clients without validation data), as `summarize` does."""
    kept = {k: [r[k] for r in rows if r[k] == r[k]] for k in rows[0]}
    return {k: sum(v) / len(v) if v else float("nan") for k, v in kept.items()}


def work(algo: Algorithm) -> int:
    """How many client personalizations `evaluate_new_clients` runs (its progress total)."""
    nc, new = algo.ctx.cfg.eval.new_clients, algo.ctx.federation.new
    return len(nc.methods) * len(nc.fractions[: len(SIZE_NAMES)]) * len(nc.lrs) * len(new)


def evaluate_new_clients(algo: Algorithm, server: Tensors, tick: Callable[[], None] | None = None
                         ) -> dict[str, Any] | None:  # fmt: skip
    """The protocol above; `tick` is called after each client personalization (`work` of them)."""
    ctx = algo.ctx
    cfg, fed = ctx.cfg, ctx.federation
    nc = cfg.eval.new_clients
    if not fed.new:
        return None
    P = Predictions(ctx.source, cfg.eval.batch_size)
    out: dict[str, Any] = {
        "clients": len(fed.new), "epochs": nc.epochs, "lrs": nc.lrs,
        "sizes": dict(zip(SIZE_NAMES, nc.fractions, strict=False)), "zero_shot": None, "methods": {},
    }  # fmt: skip
    if nc.zero_shot:
        scores = []
        for c in fed.new:
            pred = algo.zero_shot(server, ctx.client_data(c))
            if pred is None:
                break
            scores.append(client_score(pred, c, ctx, P, "test"))
        P.store.clear()
        if scores:
            out["zero_shot"] = {"acc": sum(scores) / len(scores)}
    t = cfg.train
    for mi, method in enumerate(nc.methods):
        per_size: dict[str, Any] = {}
        for fi, (size, fraction) in enumerate(zip(SIZE_NAMES, nc.fractions, strict=False)):
            per_lr: dict[str, dict[str, float]] = {}
            for li, lr in enumerate(nc.lrs):
                budget = Budget.of(method, nc.epochs, lr, t)
                rows = []
                for c in fed.new:
                    data = replace(ctx.client_data(c), train=new_client_train(fed, c, fi, fraction, cfg.seed))
                    gen = rng.generator(cfg.seed, rng.NEWCLIENT, 1 + mi, fi, li, c)
                    rows.append(run_one(algo, server, c, data, budget, gen, P))
                    if tick is not None:
                        tick()
                per_lr[f"{lr:g}"] = _mean(rows)
            lr_last = max(per_lr, key=lambda k: per_lr[k]["last_val"])
            lr_best = max(per_lr, key=lambda k: per_lr[k]["best_val"])
            last, best = per_lr[lr_last]["last"], per_lr[lr_best]["best"]
            per_size[size] = {"last": last, "best": best, "delta": best - last, "lr_last": float(lr_last),
                              "lr_best": float(lr_best), "per_lr": per_lr}  # fmt: skip
        out["methods"][method] = per_size
    return out
