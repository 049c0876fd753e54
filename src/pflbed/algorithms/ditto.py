"""Ditto — Li, Hu, Beirami & Smith, "Ditto: Fair and Robust Federated Learning Through Personalization", ICML 2021
(Algorithm 1, Eq. 2).

Each client k keeps a personal model v_k and, in the rounds it is sampled, does two things from the received
global model w^t (Algorithm 1):
1. the global objective's local update, UPDATE_GLOBAL — here FedAvg's: E epochs of SGD on F_k from w^t; the reply;
2. the personal update: SGD on h_k(v_k; w^t) = F_k(v_k) + λ/2 · ‖v_k − w^t‖² (Eq. 2), i.e. steps
   v_k ← v_k − η(∇F_k(v_k) + λ(v_k − w^t)), with w^t the *received* global model (not the one just updated).
The server averages the replies as FedAvg (n_k-weighted). v_k starts from w^0, the common initial model
(Algorithm 1's input). P-FL scores v_k; G-FL scores w.

λ interpolates between Local (λ = 0: v_k is trained on F_k alone) and the global model (large λ pulls v_k onto
w^t). `lam` defaults to 0.1, inside the paper's grid {0.01, 0.1, 1, 2}; choose it on validation. With a fixed
step η the personal steps are stable for ηλ < 2.

Deviations: the personal update runs `personal_epochs` epochs (default: `train.local_epochs`) where the paper
counts s local iterations; both updates share the client's generator (global first). New clients: the paper
defines no new-client procedure; they fine-tune the global model (FT/LP), as the FedBasis paper's tables do.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from pflbed.algorithms.base import Algorithm, ClientContext, ClientData, Predictor, Tensors
from pflbed.algorithms.fedavg import FedAvg
from pflbed.algorithms.training import proximal_sgd, train_from
from pflbed.search import Search, Space


class DittoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    search: ClassVar[dict[str, Space]] = {"lam": Search(1e-3, 10.0, log=True)}  # the paper's grid: 0.01…2
    lam: float = Field(0.1, ge=0, description="λ of the personal objective F_k(v) + λ/2·‖v − w^t‖² (0: Local)")
    personal_epochs: int | None = Field(None, ge=0, description="epochs of the personal update (None: "
                                        "train.local_epochs)")  # fmt: skip
    personal_lr: float | None = Field(None, gt=0, description="SGD lr of the personal update (None: train.lr)")


class Ditto(FedAvg):
    name = "ditto"
    Config = DittoOptions
    sgd_plan = Algorithm.sgd_plan  # two updates, the second proximal: not one plain local SGD

    def init_client(self, cid: int) -> Tensors:
        return dict(self.ctx.initial_params)  # v_k^0 = w^0

    def client_update(
        self, payload: Tensors, state: Tensors, data: ClientData, cctx: ClientContext
    ) -> tuple[Tensors, Tensors]:
        t, o = self.ctx.cfg.train, self.opts
        reply = train_from(self.ctx.model, payload, data, t, cctx.generator)  # UPDATE_GLOBAL
        epochs = o.personal_epochs if o.personal_epochs is not None else t.local_epochs
        personal = proximal_sgd(self.ctx.model, state, payload, o.lam, data, epochs=epochs,
                                lr=o.personal_lr or t.lr, train=t, generator=cctx.generator)  # fmt: skip
        return reply, personal

    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        return Predictor(self.ctx.model, state)
