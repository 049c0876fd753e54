"""FedLC — Zhang, Li, Li, Xu, Wu, Ding & Wu, "Federated Learning with Label Distribution Skew via Logits
Calibration", ICML 2022 (PMLR 162; arXiv 2209.00189).

Label skew makes a client's softmax cross-entropy push its minority and missing classes down: its update drifts
away from the global objective. FedLC calibrates the logits before the softmax by the client's own class counts
n_{c,y}: client c trains on the pairwise-label-margin loss

    ℓ(x, y) = log(1 + Σ_{y'≠y} exp(Δ_{y,y'} + f_{y'}(x) − f_y(x))),   Δ_{y,y'} = τ·(n_{c,y}^{−1/4} − n_{c,y'}^{−1/4}),

which, with g_k = f_k(x) − τ·n_{c,k}^{−1/4} (the calibrated logits), is exactly the cross-entropy of g:
ℓ = −log softmax_y(g). Local training is E epochs of SGD on it; the server averages the replies as FedAvg does
(Σ n_c/n · w_c), and the global model predicts with its *uncalibrated* logits (the calibration is training only).
A client sends and keeps nothing beyond FedAvg's: its class counts are its own.

Choices and deviations (reference code: the authors published none; compared with the public reimplementations,
read only: KarhouTam/FL-bench `src/client/fedlc.py`, bytedance/FedDecorr `approach/fedlogitcal.py`, TsingZ0/PFLlib
`clientlc.py`, Flower's `baselines/fedlc`):
  1. `denominator`. The paper prints its loss with the denominator over y' ≠ y,
     −log(e^{g_y} / Σ_{y'≠y} e^{g_{y'}}), the margin form above with its "1 +" dropped. That form is unbounded below
     (it falls without limit as g_y grows: training on it collapses, as a public reimplementation reports), so the
     default is the cross-entropy of the calibrated logits ("all", the form every public reimplementation trains
     on); "others" is the printed formula, for comparison.
  2. `missing`: a class the client has no sample of has n = 0 and an infinite margin. "remove" (default) takes
     that literally — the class's calibrated logit is −∞, out of the client's softmax; "floor" counts it as
     10⁻⁸ samples (a margin of 100·τ), as one reimplementation does.
  3. τ: the paper's value for each setting could not be verified here; the default 1.0 is the common
     reimplementations' default, and the search (log-uniform 0.05–2) holds every value they use (0.1, 0.5, 1).
  4. Counts are the client's exact training label counts (its class prior × its training-set size), as in the
     paper, FL-bench and FedDecorr; PFLlib sums the counts over all clients instead.
Personalization (+FT/+LP, new clients) fine-tunes the global model, as for FedAvg. The update is a plan
(`sgd_plan`): `executor.batch_clients` trains a round's clients together.
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from pflbed.algorithms.base import ClientData, Context, Tensors
from pflbed.algorithms.fedavg import FedAvg
from pflbed.algorithms.fedrod import class_counts
from pflbed.algorithms.local_sgd import LocalSGDPlan, Phase, model_forward, weighted_mean
from pflbed.models import BlockNet
from pflbed.search import Search, Space

FLOOR = 1e-8  # `missing: floor`: a missing class counted as this many samples


class FedLCOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    search: ClassVar[dict[str, Space]] = {"tau": Search(0.05, 2.0, log=True)}
    tau: float = Field(1.0, gt=0, description="τ, the calibration strength: class y's logit is lowered by τ·n_y^(−1/4)")
    denominator: Literal["all", "others"] = Field(
        "all", description="all: cross-entropy of the calibrated logits; others: the paper's printed formula (the "
        "true class left out of the denominator; unbounded below)")
    missing: Literal["remove", "floor"] = Field(
        "remove", description="a class the client has no sample of: out of its softmax (remove), or counted as 1e-8 "
        "samples (floor)")


def calibration(counts: torch.Tensor, tau: float, missing: str) -> torch.Tensor:
    """τ·n_k^{−1/4} per class k, from the client's class counts; a zero count per `missing`."""
    counts = counts.to(torch.float64)
    zero = counts == 0
    shift = tau * counts.clamp_min(FLOOR if missing == "floor" else 1.0).pow(-0.25)
    if missing == "remove":
        shift = torch.where(zero, torch.full_like(shift, math.inf), shift)
    return shift.to(torch.float32)


class CalibratedObjective:
    """The loss of a batch on the calibrated logits g = f(x) − shift (`consts["shift"]`, the client's)."""

    def __init__(self, denominator: str) -> None:
        self.denominator = denominator

    def __call__(
        self, model: BlockNet, params: Tensors, consts: Tensors, x: torch.Tensor, y: torch.Tensor,
        w: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        logits = model_forward(model, params, x)
        g = logits - consts["shift"].to(logits)
        if self.denominator == "all":
            per = F.cross_entropy(g, y, reduction="mean" if w is None else "none")
        else:  # −g_y + log Σ_{y'≠y} e^{g_{y'}}
            true = g.gather(1, y[:, None]).squeeze(1)
            others = g.scatter(1, y[:, None], -math.inf).logsumexp(1)
            per = others - true
            per = per.mean() if w is None else per
        return per if w is None else weighted_mean(per, w)


class FedLC(FedAvg):
    name = "fedlc"
    Config = FedLCOptions

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.objective = CalibratedObjective(self.opts.denominator)  # one object: a round's plans batch together

    def sgd_plan(self, payload: Tensors, state: Tensors, data: ClientData) -> LocalSGDPlan:
        """E epochs of SGD on every block, on the calibrated loss with this client's shift; the reply is w."""
        t, o = self.ctx.cfg.train, self.opts
        phase = Phase(tuple(self.ctx.model.block_names()), t.local_epochs, t.lr)
        shift = calibration(class_counts(data), o.tau, o.missing)
        return LocalSGDPlan(payload, (phase,), lambda params: (params, state), self.objective, {"shift": shift})
