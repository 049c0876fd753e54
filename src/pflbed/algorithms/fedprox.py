"""FedProx — Li, Sahu, Zaheer, Sanjabi, Talwalkar & Smith, "Federated Optimization in Heterogeneous Networks",
MLSys 2020 (Algorithm 2, Eq. 2).

Client k minimizes, from the global model w^t, the proximal objective (Eq. 2)

    h_k(w; w^t) = F_k(w) + μ/2 · ‖w − w^t‖²

with E epochs of mini-batch SGD (batch B, lr η): each step follows ∇F_k on the batch plus μ·(w − w^t). The server
averages as FedAvg does (Σ n_k/n · w_k over the round's clients). μ = 0 is FedAvg, bit for bit (the proximal
gradient is then exactly zero and the SGD path is the same).

The proximal term covers the model's trainable parameters; BatchNorm running statistics are buffers, not part of
w in the paper's models, and are averaged as in FedAvg.

Deviations: the paper's system-heterogeneity experiments let stragglers run fewer local epochs (γ-inexact
solutions); here every client runs the configured epochs, as in the personalized-FL baseline tables that use
FedProx. `mu` defaults to 0.01, one of the paper's grid {0.001, 0.01, 0.1, 0.5, 1}; choose it on validation.
Personalization (+FT/+LP, new clients) fine-tunes the global model, as for FedAvg.
The update is a plan (`sgd_plan`, `local_sgd.RegularizedObjective`): `executor.batch_clients` trains a round's
clients together.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from pflbed.algorithms.base import ClientData, Context, Tensors
from pflbed.algorithms.fedavg import FedAvg
from pflbed.algorithms.local_sgd import LocalSGDPlan, Phase, RegularizedObjective
from pflbed.search import Search, Space


class FedProxOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    search: ClassVar[dict[str, Space]] = {"mu": Search(1e-4, 1.0, log=True)}  # the paper's grid spans 0.001…1
    mu: float = Field(0.01, ge=0, description="μ of the proximal term μ/2·‖w − w^t‖² (0: FedAvg)")


class FedProx(FedAvg):
    name = "fedprox"
    Config = FedProxOptions

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.objective = RegularizedObjective([k for k, _ in ctx.model.named_parameters()], self.opts.mu, anchor="")

    def sgd_plan(self, payload: Tensors, state: Tensors, data: ClientData) -> LocalSGDPlan:
        """Eq. 2 as a plan: every block at `train.lr` for `train.local_epochs` epochs on the proximal objective,
        anchored at w^t (the payload, the client's constants); the reply is w, the state unchanged."""
        t = self.ctx.cfg.train
        phase = Phase(tuple(self.ctx.model.block_names()), t.local_epochs, t.lr)
        return self.objective.plan(payload, payload, phase, lambda params: (params, dict(state)))
