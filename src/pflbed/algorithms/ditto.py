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

The update is a plan (`sgd_plan`): UPDATE_GLOBAL's phase on w, then the personal phase on the second model
v_k (`Phase.model`: v_k's tensors travel beside w's under `personal.`, its BatchNorm statistics included) with the
proximal objective (`local_sgd.RegularizedObjective`, anchored at w^t, the client's constants), so
`executor.batch_clients` trains a round's clients together.

Deviations (the authors' code: litian96/ditto, `flearn/trainers_MTL/ditto.py`, read only):
- The personal update runs `personal_epochs` epochs (default: `train.local_epochs`) where the paper counts s local
  iterations. The code interleaves the two updates: at each of its local iterations one personal step, then one
  global step, on the same mini-batch. Here the global phase runs whole, then the personal one, each drawing its
  own mini-batches from the client's generator; the personal steps are anchored at the received w^t either way.
- The personal phase uses `train.*`'s optimizer, as the global phase does (momentum, weight decay); the paper and
  the code take plain gradient steps: `train.momentum: 0` and `train.weight_decay: 0` give them.
- The code samples clients with probability proportional to their data size and averages the replies unweighted;
  here clients are sampled uniformly and the replies averaged n_k-weighted (the same in expectation).
- New clients: the paper defines no new-client procedure; they fine-tune the global model (FT/LP), as the FedBasis
  paper's tables do.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from pflbed.algorithms.base import ClientData, Context, Predictor, Tensors
from pflbed.algorithms.fedavg import FedAvg
from pflbed.algorithms.local_sgd import LocalSGDPlan, Phase, RegularizedObjective
from pflbed.search import Search, Space, same_as


class DittoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    search: ClassVar[dict[str, Space]] = {"lam": Search(1e-3, 10.0, log=True)}  # the paper's grid: 0.01…2
    lam: float = Field(0.1, ge=0, description="λ of the personal objective F_k(v) + λ/2·‖v − w^t‖² (0: Local)")
    personal_epochs: int | None = Field(None, ge=0, description="epochs of the personal update (None: "
                                        "train.local_epochs)",
                                        json_schema_extra=same_as("train.local_epochs"))  # fmt: skip
    personal_lr: float | None = Field(None, gt=0, description="SGD lr of the personal update (None: train.lr)",
                                      json_schema_extra=same_as("train.lr"))


PERSONAL = "personal."  # v_k's tensors in the plan, beside w's


class Ditto(FedAvg):
    name = "ditto"
    Config = DittoOptions

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.keys = list(ctx.model.state_dict())
        self.objective = RegularizedObjective([k for k, _ in ctx.model.named_parameters()], self.opts.lam, anchor="")

    def init_client(self, cid: int) -> Tensors:
        return dict(self.ctx.initial_params)  # v_k^0 = w^0

    def sgd_plan(self, payload: Tensors, state: Tensors, data: ClientData) -> LocalSGDPlan:
        """Algorithm 1's two updates, global first: E epochs of SGD on F_k from w^t (the reply), then the personal
        epochs on h_k(v_k; w^t) = F_k(v_k) + λ/2·‖v_k − w^t‖² from v_k (the new state), at `personal_lr`."""
        t, o = self.ctx.cfg.train, self.opts
        every = tuple(self.ctx.model.block_names())
        epochs = o.personal_epochs if o.personal_epochs is not None else t.local_epochs
        phases = (Phase(every, t.local_epochs, t.lr),
                  Phase(every, epochs, o.personal_lr or t.lr, model=PERSONAL, objective=self.objective))  # fmt: skip
        start = {**payload, **{PERSONAL + k: v for k, v in state.items()}}
        return LocalSGDPlan(start, phases, self.finish, consts={k: payload[k] for k in self.objective.keys})

    def finish(self, trained: Tensors) -> tuple[Tensors, Tensors]:
        """(w, v_k) from the plan's tensors."""
        return {k: trained[k] for k in self.keys}, {k: trained[PERSONAL + k] for k in self.keys}

    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        return Predictor(self.ctx.model, state)
