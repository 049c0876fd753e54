"""How well a run's starting weights (`model.init_from`) score on its targets before any federated training.

Why: a result that starts from pretrained weights is read against what those weights alone reach on the same test
sets, target domain by target domain: what the federated training added, and where. The weights are scored
whole — every block of the file, its classifier included — whatever `model.init_blocks` the run loaded, since the
question is what the pretraining learned, not what the run kept of it. Scored on the run's test sets: G-FL's global
one and, under PFLBED, each domain's shared one; plain accuracy, as G-FL is (both sets are class-balanced).
"""

from __future__ import annotations

from typing import Any

import torch

from pflbed.algorithms.base import Context
from pflbed.algorithms.common import Predictor
from pflbed.algorithms.training import get_params
from pflbed.errors import ConfigError
from pflbed.evaluation.evaluate import Predictions
from pflbed.evaluation.metrics import accuracy
from pflbed.models.pretrained import apply_weights, load_weights


def pretrained_accuracy(ctx: Context) -> dict[str, Any]:
    """`{"global": accuracy, "domains": {name: accuracy}}` of the whole weights file `model.init_from` on the run's
    test sets (`domains` only under PFLBED), or `{"why": …}` where the file holds no classifier for the run's
    classes (a body alone, another class count, an ImageNet classifier). Draws nothing from any random stream."""
    cfg, fed, source = ctx.cfg, ctx.federation, ctx.source
    with torch.random.fork_rng(devices=[]):  # the model's random initialization is overwritten below
        model = ctx.new_model()
    try:
        written = set(apply_weights(model, load_weights(cfg.model.init_from), ["all"], cfg.model.name))
    except ConfigError as e:
        return {"why": str(e).removeprefix("model.init_from: ")}
    if not set(model.state_keys(model.head_blocks())) <= written:
        return {"why": "the weights hold no classifier for the run's classes (an ImageNet one is dropped)"}
    pred, P = Predictor(model, get_params(model)), Predictions(source, cfg.eval.batch_size)
    out: dict[str, Any] = {"global": accuracy(P(pred, fed.global_split, fed.global_test),
                                              getattr(source, fed.global_split).y[fed.global_test])}  # fmt: skip
    if fed.domain_test:
        names = source.domain_names or tuple(str(d) for d in range(len(fed.domain_test)))
        out["domains"] = {n: accuracy(P(pred, "train", idx), source.train.y[idx])
                          for n, idx in zip(names, fed.domain_test, strict=True)}  # fmt: skip
    return out
