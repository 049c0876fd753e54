"""Evaluation where the data is (`sites.local`): each site scores its own clients, and only numbers travel.

A site computes, for each of its clients, the P-FL test and validation accuracies (`client_scores`: the same
function, on the same samples, as a simulated run) of the personal model — or, for a final `+FT` / `+LP` stage, of
the model the client personalizes from the trained state (`personalize`, seeded as in `evaluate_personalized`) —
and, for the generic model, its correct predictions and sample counts on the site's test and validation data.

The server (`combine`) forms the run's figures from them: P-FL statistics over every client (`summarize`, as any
run), `gfl_val` as the generic model's accuracy on the union of the clients' validation data (what a simulated
run computes: correct ÷ samples, in float32), and G-FL on `sites.test` where the server has one, else as the
sample-weighted mean over the sites' test data (`gfl_source` in the summary says which).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pflbed import rng
from pflbed.algorithms.base import Algorithm, Budget, Tensors
from pflbed.evaluation.evaluate import Predictions, client_scores, last, summarize


def _counts(algo: Algorithm, server: Tensors, cids: list[int], P: Predictions, which: str) -> list[int]:
    """[correct, samples] of the generic model on the `which` splits of clients `cids`."""
    fed, y = algo.ctx.federation, algo.ctx.source.train.y
    generic = algo.generic_model(server)
    idx = torch.cat([getattr(fed.clients[c], which) for c in cids]) if cids else torch.zeros(0, dtype=torch.int64)
    if generic is None or not len(idx):
        return [0, int(idx.numel())]
    return [int((P(generic, "train", idx) == y[idx]).sum()), int(idx.numel())]


def evaluate_site(algo: Algorithm, server: Tensors, state: Callable[[int], Tensors], cids: list[int],
                  method: str | None = None, method_index: int = 0) -> dict[str, Any]:  # fmt: skip
    """The site's numbers for clients `cids`: {"test": {cid: acc}, "val": {cid: acc}, "gfl_test": [correct, n],
    "gfl_val": [correct, n]}; with `method` (a final personalization, the `method_index`-th of the run's), the
    personalized models' test and val accuracies only."""
    ctx = algo.ctx
    P = Predictions(ctx.source, ctx.cfg.eval.batch_size)
    if method is None:
        test, val = client_scores({c: algo.personal_model(server, state(c)) for c in cids}, ctx, P)
        return {"test": test, "val": val, "gfl_test": _counts(algo, server, cids, P, "test"),
                "gfl_val": _counts(algo, server, cids, P, "val")}  # fmt: skip
    e, t = ctx.cfg.eval, ctx.cfg.train
    budget = Budget(method, e.ft_epochs, e.ft_lr, t.batch_size, t.momentum)
    test, val = {}, {}
    for c in cids:  # as `evaluate_personalized`: one personalized model alive at a time
        gen = rng.generator(ctx.cfg.seed, rng.FINETUNE, method_index, c)
        t_c, v_c = client_scores({c: last(algo.personalize(server, ctx.client_data(c), budget, gen))}, ctx, P)
        test[c], val[c] = t_c[c], v_c[c]
        P.forget_models()
    return {"test": test, "val": val}


def _ratio(correct: int, n: int) -> float | None:
    """correct ÷ n as `metrics.accuracy` computes it (the mean of a float32 0/1 tensor), None for no samples."""
    return float(torch.tensor(float(correct), dtype=torch.float32) / n) if n else None


def combine(sites: list[dict[str, Any]], gfl_server: float | None, has_generic: bool) -> tuple[dict, dict[int, float]]:
    """The run's record figures and per-client P-FL from every site's `evaluate_site` numbers (clients in id
    order); `gfl_server`: G-FL on the server's own test set, where it has one."""
    test = dict(sorted((int(c), v) for s in sites for c, v in s["test"].items()))
    val = dict(sorted((int(c), v) for s in sites for c, v in s["val"].items()))
    out: dict[str, Any] = {"gfl_acc": None, "gfl_val": None}
    if has_generic and "gfl_test" in sites[0]:
        pooled = [sum(s[k][i] for s in sites) for k in ("gfl_test", "gfl_val") for i in (0, 1)]
        out["gfl_acc"] = gfl_server if gfl_server is not None else _ratio(pooled[0], pooled[1])
        out["gfl_val"] = _ratio(pooled[2], pooled[3])
    out.update(summarize(test, val))
    return out, test
