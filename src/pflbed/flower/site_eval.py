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
    budget = Budget.of(method, e.ft_epochs, e.ft_lr, t)
    test, val = {}, {}
    for c in cids:  # as `evaluate_personalized`: one personalized model alive at a time
        gen = rng.generator(ctx.cfg.seed, rng.FINETUNE, method_index, c)
        with rng.global_from(gen, ctx.device):  # as `evaluate_personalized`
            p = last(algo.personalize(server, ctx.client_data(c), budget, gen))
        t_c, v_c = client_scores({c: p}, ctx, P)
        test[c], val[c] = t_c[c], v_c[c]
        P.forget_models()
    return {"test": test, "val": val}


def _accuracy_fault(v: Any) -> bool:
    """Whether `v` is not an accuracy: a number in [0, 1], or NaN (a client with no such samples, as simulated)."""
    return isinstance(v, bool) or not isinstance(v, int | float) or not (v != v or 0 <= v <= 1)


def _count_fault(v: Any, bound: int) -> bool:
    """Whether `v` is not [correct, samples] with 0 ≤ correct ≤ samples ≤ `bound`."""
    if not isinstance(v, list) or len(v) != 2 or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
        return True
    return not 0 <= v[0] <= v[1] <= bound


def check_scores(answer: Any, cids: list[int], round_figures: bool, methods: list[str], bound: int,
                 counts: list[int] | None) -> str | None:  # fmt: skip
    """Why a site's `evaluate_site` numbers for its clients `cids` are refused; None if they are not. Each part
    asked for (the round's figures, each final personalization) holds the test and val accuracy of exactly `cids`,
    each in [0, 1] (or NaN: no samples); the round's G-FL counts are [correct, samples] with samples at most `bound`
    and, where known, the site's `counts` (test, val): those it declared at start-up, else those of its first
    evaluation (the same data scored again)."""
    if not isinstance(answer, dict):
        return "its numbers are not a mapping"
    own = {str(c) for c in cids}
    for part in ([""] if round_figures else []) + methods:
        figures = answer.get(part)
        name = f"'{part}'" if part else "the round's figures"
        if not isinstance(figures, dict):
            return f"{name} are missing"
        for split in ("test", "val"):
            scores = figures.get(split)
            if not isinstance(scores, dict) or set(scores) != own:
                got = sorted(scores) if isinstance(scores, dict) else scores
                return f"{name} score clients {str(got)[:60]} on {split}, its clients are {cids}"
            bad = next((c for c, v in scores.items() if _accuracy_fault(v)), None)
            if bad is not None:
                return f"{name} give client {bad} a {split} accuracy of {scores[bad]!r}, outside [0, 1]"
        if part == "" and ("gfl_test" in figures or "gfl_val" in figures):
            for i, key in enumerate(("gfl_test", "gfl_val")):
                v = figures.get(key)
                if _count_fault(v, bound):
                    return f"{key} {str(v)[:60]} is not [correct, samples] with 0 ≤ correct ≤ samples ≤ {bound}"
                if counts is not None and v[1] != counts[i]:
                    return f"{key} counts {v[1]} samples, not the {counts[i]} it declared or counted first"
    return None


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
