"""APFL — Deng, Kamani & Mahdavi, "Adaptive Personalized Federated Learning", arXiv:2003.13461, 2020 (Algorithm 1,
Eq. 3, 10).

Each client keeps a local model v_i and a mixing weight α_i; its personalized model is the mixture
v̄_i = α_i v_i + (1 − α_i) w (Eq. 3). In a sampled round it starts from the global w and, per local step on a batch
ξ, updates simultaneously (all gradients at the step's starting values):
- w ← w − η ∇f_i(w; ξ)                          (the global model's local copy; the reply)
- v_i ← v_i − η ∇_v f_i(v̄_i; ξ) = v_i − η α_i ∇f_i(v̄_i; ξ)
- α_i ← α_i − η_α ⟨v_i − w, ∇f_i(v̄_i; ξ)⟩        (Eq. 10, adaptive α), kept in [0, 1].
The server averages the w's (|D_i|-weighted by default; below). P-FL scores v̄_i = α_i v_i + (1 − α_i) w with
the current global w; G-FL scores w.

Choices: `train.local_epochs` · ⌈n_i/B⌉ steps of plain SGD at η = `train.lr` (momentum and weight decay unused);
v_i starts at w^0; `alpha` (initial α_i) 0.5 and `alpha_lr` η_α = η unless set (the paper tunes both); `adaptive`
false keeps α fixed (the paper's non-adaptive variant). New clients fine-tune w (FT/LP).

The server's mean (`server_mean`): the default weighs each client's w by its training-set size, FedAvg's rule, which
every FedAvg-based method here shares. Algorithm 1 and the authors' code (FedTorch, `fedavg_aggregation_centered`:
1/(number of online clients), the size weighting commented out) average uniformly: `server_mean: uniform`. The
two agree when the round's clients hold equally many samples; under client-level DP the weights are uniform
whatever is set.

Read from the authors' code but not followed (the paper's Eq. 3 and 10 are): they mix the two models' outputs,
α v(x) + (1 − α) w(x), where the paper and this file mix parameters; they step w first and then v with the new
w, not both at the step's starting values; and their optional α update runs once per round, on an approximate
gradient with an added 0.02·α.

BatchNorm (the paper's models have none): only parameters mix. v̄'s running statistics and counters are its own,
kept in v_i's entries and updated by v̄'s training forwards; w's by w's. Mixing statistics like parameters would
leave v_i's never updated (the forwards run on the mixture) and describe the features of no model.

The update is a `LocalSGDPlan` whose one phase is `MixedStep`, a `local_sgd.StepRule` (v_i's entries under
`LOCAL`, α_i under `ALPHA`), so `executor.batch_clients` trains a round's clients together. The step takes ∇f(w)
and ∇f(v̄) from one forward each, in that order (dropout masks drawn in that order), and moves v and α by the chain
rule through v̄ (the sums of ⟨v − w, ∇f(v̄)⟩ in another order than autograd's: float rounding only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from pflbed.algorithms.base import ClientData, Context, Predictor, Tensors
from pflbed.algorithms.fedavg import FedAvg
from pflbed.algorithms.local_sgd import Gradients, LocalSGDPlan, Phase
from pflbed.algorithms.training import WeightedMean
from pflbed.search import Search, Space, same_as

ALPHA = "alpha"
LOCAL = "local."  # v_i's entries in a plan, beside w's


class APFLOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # the paper: α ∈ {0.25, 0.5, 0.75}
    search: ClassVar[dict[str, Space]] = {"alpha": Search(0.05, 0.95), "alpha_lr": Search(1e-4, 0.3, log=True)}
    alpha: float = Field(0.5, ge=0, le=1, description="initial mixing weight α_i of the local model")
    alpha_lr: float | None = Field(None, gt=0, description="η_α (None: train.lr)",
                                   json_schema_extra=same_as("train.lr"))
    adaptive: bool = Field(True, description="learn α_i (Eq. 10); False: keep it fixed")
    server_mean: Literal["size", "uniform"] = Field("size", description="the server's mean of the w's: weighted "
                                                    "by |D_i|, or uniform over the round's clients (Algorithm 1 "
                                                    "and the authors' code)")  # fmt: skip


def mixture(v: Tensors, w: Tensors, alpha: torch.Tensor, params: list[str]) -> Tensors:
    """v̄: α v + (1 − α) w for the parameters `params`; every other entry (BatchNorm's statistics) v's own."""
    return {**v, **{k: alpha * v[k] + (1 - alpha) * w[k] for k in params}}


class APFL(FedAvg):
    name = "apfl"
    Config = APFLOptions

    @staticmethod
    def unread_train(options: BaseModel) -> frozenset[str]:
        """Its steps are plain SGD on w, v_i and α_i (the module docstring's choices)."""
        return frozenset({"momentum", "weight_decay"})

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.params = [k for k, _ in ctx.model.named_parameters()]  # the entries that mix

    def init_client(self, cid: int) -> Tensors:
        return {**self.ctx.initial_params, ALPHA: torch.tensor(self.opts.alpha, device=self.ctx.device)}

    def sgd_plan(self, payload: Tensors, state: Tensors, data: ClientData) -> LocalSGDPlan:
        """`local_epochs` epochs of `MixedStep`s from w = the payload, v_i and α_i = the state's (v_i's under
        `LOCAL`); the reply is w, the new state v_i and α_i."""
        t, o, keys = self.ctx.cfg.train, self.opts, list(payload)
        rule = MixedStep(t.lr, o.alpha_lr or t.lr, o.adaptive)
        phase = Phase(tuple(self.ctx.model.block_names()), t.local_epochs, t.lr, rule=rule)
        start = {**payload, **{LOCAL + k: state[k] for k in keys}, ALPHA: state[ALPHA]}

        def finish(p: Tensors) -> tuple[Tensors, Tensors]:
            return {k: p[k] for k in keys}, {**{k: p[LOCAL + k] for k in keys}, ALPHA: p[ALPHA]}

        return LocalSGDPlan(start, (phase,), finish)

    def aggregator(self, rnd: int, server: Tensors, weights: dict[int, float]) -> WeightedMean:
        return WeightedMean({c: 1.0 for c in weights} if self.opts.server_mean == "uniform" else weights)

    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        return Predictor(self.ctx.model, mixture({k: state[k] for k in server}, server, state[ALPHA], self.params))


@dataclass(frozen=True)
class MixedStep:
    """One APFL step on one batch, as a `local_sgd.StepRule`: the gradient of w at w (w's forward, w's BatchNorm
    statistics), that of the mixture v̄ at v̄ (v̄'s forward, v_i's statistics: `models`), then all three moves at
    the step's starting values, by the chain rule through v̄ = αv + (1 − α)w: ∇_v = α∇f(v̄), ∂_α = ⟨v − w, ∇f(v̄)⟩
    (Eq. 10), α kept in [0, 1]."""

    lr: float
    alpha_lr: float
    adaptive: bool
    batches: ClassVar[int] = 1
    forwards: ClassVar[tuple[int, ...]] = (0, 0)  # w's forward, then v̄'s, on the same batch
    models: ClassVar[tuple[str, ...]] = ("", LOCAL)

    def __call__(self, grads: Gradients, params: Tensors) -> Tensors:
        names = [k for k in params if k != ALPHA and not k.startswith(LOCAL)]  # the model's parameters
        w, v, a = {k: params[k] for k in names}, {k: params[LOCAL + k] for k in names}, params[ALPHA]
        gw = grads.grad(w, 0)
        g = grads.grad(mixture(v, w, a, names), 0, LOCAL)  # ∇f(v̄)
        new = {**{k: w[k] - self.lr * gw[k] for k in names}, **{LOCAL + k: v[k] - self.lr * (a * g[k]) for k in names}}
        if self.adaptive:
            slope = sum(((v[k] - w[k]) * g[k]).sum() for k in names)
            new[ALPHA] = (a - self.alpha_lr * slope).clamp(0.0, 1.0)
        return new
