"""FedRep — Collins, Hassani, Mokhtari & Shakkottai, "Exploiting Shared Representations for Personalized Federated
Learning", ICML 2021 (Algorithm 1).

Model: client i predicts with h_i ∘ φ — a shared representation φ (the model's body blocks) and a personal head h_i
(the head blocks, i.e. the classifier).

Client i in round t, starting from the server's φ^t and its own head h_i^t (Algorithm 1):
  1. head phase, τ_h updates with φ fixed:      h_i ← GRD(f_i(h_i, φ^t), h_i, α_h)
  2. body phase, τ_φ updates with the new head fixed: φ_i ← GRD(f_i(h_i, φ_i), φ_i, α_φ)
  3. send φ_i only; h_i stays on the client.
Server: φ^{t+1} = average of the φ_i of the sampled clients.

Options (`algorithm.<key>`): `head_epochs` τ_h (default 10, the paper's head epochs), `body_epochs` τ_φ (default 1),
`head_lr` / `body_lr` (default None → `train.lr`). Batch size, momentum and weight decay come from `train.*`;
`train.local_epochs` is NOT used — the two phase lengths replace it.

Interpretations and deviations:
- τ_h and τ_φ are counted in epochs over the client's data (as in the paper's experiments), not in single steps.
- The server average is weighted by |D_m| (the engine's weights, as in FedAvg); the paper writes the plain mean over
  the sampled clients. The two coincide when clients hold equally many samples, as in most of the paper's setups.
- Heads start from the run's initial model, the same for every client (the paper only says the heads are
  initialized; a shared initial draw makes the round-0 personal model equal the initial global model).
- Each phase builds a fresh optimizer, so momentum (if configured) never carries from the head phase into the body
  phase or across rounds. The authors' code (lgcollins/FedRep, `main_fedrep.py`, `models/Update.py`, read only)
  trains with momentum 0.5 and weight decay 1e-4 on the weights (not the biases); here `train.*` applies.
- The authors' code ends with one more round in which every client, the body frozen, trains its head for 10 epochs
  on the final body, and reports the accuracy after it. Here P-FL scores each client's last trained head on the
  final body: a client not sampled lately keeps an older head, one never sampled the initial head.
- No global head exists, so there is no generic model (G-FL is null) and no zero-shot model for new clients.
- New clients: start from the server body and a fresh initial head; `lp` trains the head alone on the frozen body
  (what the paper's new-client experiment does: only a head is learned on the fixed representation), `ft` trains
  everything.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field

from pflbed.algorithms.base import Algorithm, Budget, ClientData, Context, Predictor, Same, Tensors
from pflbed.algorithms.local_sgd import LocalSGDPlan, Phase
from pflbed.algorithms.partial import blocks_for, personalize_blocks, subset
from pflbed.algorithms.training import WeightedMean
from pflbed.search import IntSearch, Search, Space, same_as


class FedRepOptions(BaseModel):
    """FedRep options."""
    # the paper: τ_h = 10
    search: ClassVar[dict[str, Space]] = {"head_epochs": IntSearch(1, 20), "head_lr": Search(1e-3, 0.3, log=True)}

    model_config = ConfigDict(extra="forbid")
    head_epochs: int = Field(10, ge=0, description="τ_h: epochs training the head with the body frozen")
    body_epochs: int = Field(1, ge=0, description="τ_φ: epochs training the body with the head frozen")
    head_lr: float | None = Field(None, gt=0, description="head-phase learning rate (None: train.lr)",
                                  json_schema_extra=same_as("train.lr"))
    body_lr: float | None = Field(None, gt=0, description="body-phase learning rate (None: train.lr)",
                                  json_schema_extra=same_as("train.lr"))


class FedRep(Algorithm):
    name = "fedrep"
    dp_refused = None  # replies: the shared entries' new values, averaged (client-level DP applies)
    Config = FedRepOptions

    @staticmethod
    def unread_train(options: BaseModel) -> frozenset[str]:
        """The head's and the body's phase lengths replace `train.local_epochs`."""
        return frozenset({"local_epochs"})

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        m = ctx.model
        self.head, self.body = m.head_blocks(), m.body_blocks()
        self.head_keys, self.body_keys = m.state_keys(self.head), m.state_keys(self.body)

    def init_server(self) -> Tensors:
        return subset(self.ctx.initial_params, self.body_keys)

    def init_client(self, cid: int) -> Tensors:
        return subset(self.ctx.initial_params, self.head_keys)

    def configure(self, rnd: int, server: Tensors, cids: list[int]) -> dict[int, Tensors]:
        return {c: server for c in cids}

    def sgd_plan(self, payload: Tensors, state: Tensors, data: ClientData) -> LocalSGDPlan:
        t, o = self.ctx.cfg.train, self.opts
        phases = (Phase(tuple(self.head), o.head_epochs, o.head_lr or t.lr),
                  Phase(tuple(self.body), o.body_epochs, o.body_lr or t.lr))  # fmt: skip
        return LocalSGDPlan(
            {**payload, **state},
            phases,
            lambda params: (subset(params, self.body_keys), subset(params, self.head_keys)),
        )

    def aggregator(self, rnd: int, server: Tensors, weights: dict[int, float]) -> WeightedMean:
        return WeightedMean(weights, self.body_keys)

    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        # Every client's body is the server's: evaluation computes body features once, then runs each head.
        return Predictor(self.ctx.model, {**server, **state}, ("fedrep-body", Same(server)))

    def personalize(
        self, server: Tensors, data: ClientData, budget: Budget, generator: torch.Generator
    ) -> Iterator[Predictor]:
        start = {**server, **self.init_client(data.cid)}
        blocks = blocks_for(budget, self.ctx.model, lp=self.head)
        yield from personalize_blocks(self.ctx.model, start, data, budget, generator, blocks)

    def zero_shot(self, server: Tensors, data: ClientData) -> Predictor | None:
        return None  # no global head
