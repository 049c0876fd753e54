"""Fed-MTL — Smith, Chiang, Sanjabi & Talwalkar, "Federated Multi-Task Learning", NeurIPS 2017 (MOCHA), the
personalized-FL tables' Fed-MTL baseline: one model per client, coupled by a task-relationship regularizer.

MOCHA's problem (Eq. 1): min_{W, Ω} Σ_i f_i(w_i) + R(W, Ω), with R(W, Ω) = λ · tr(W Ω Wᵀ) for the clients' models
W = [w_1 … w_m]. Formulation implemented: Ω fixed to the mean-regularized relationship Ω = I − 11ᵀ/m (MOCHA §3
lists it among its special cases; Evgeniou & Pontil 2004), so that

    R(W) = λ · Σ_i ‖w_i − w̄‖²,   ∂R/∂w_i = 2λ (w_i − w̄)   (w̄ = (1/m) Σ_j w_j; the w̄-terms cancel).

Why this one: it needs no client's model at the server, only w̄ — which the server keeps exactly from the clients'
changes — whereas learning Ω (MOCHA's alternating Ω step, Ω ∝ (WᵀW)^{1/2}) needs every client's full model at the
server each round. Not implemented: learning Ω; MOCHA's dual (CoCoA-style) local solver — clients take SGD steps on
the primal objective.

A sampled client i receives w̄, runs E epochs of SGD on f_i(w_i) + λ‖w_i − w̄‖² (w̄ fixed) from its own w_i (its
state; w^0 at first), f_i the *mean* loss over its samples, as SGD on mini-batches takes it. Deviation from the
paper: its Eq. 1 sums the loss over the client's n_i samples, which relative to the mean form divides λ by n_i
client by client (small clients pulled towards w̄ harder); here every client's pull is λ, whatever its size. The
authors' code (`compute_primal.m`) takes each task's mean loss, as here, and writes the regularizer
λ/2 · tr(W Ω Wᵀ): its λ is twice ours. The client keeps the
result and replies its change Δ_i. The server: w̄ ← w̄ + (1/m) Σ_{i∈S} Δ_i, m the number of participating clients —
so w̄ is always the mean of every client's current model. P-FL scores w_i; there is no generic model (the tables
report no G-FL or +FT for Fed-MTL). New clients start from w̄, the task mean, and fine-tune (FT/LP). `lam` defaults
to 0.1; choose it on validation.

The update is a plan (`sgd_plan`, `local_sgd.RegularizedObjective` with μ = 2λ, anchored at w̄), so
`executor.batch_clients` trains a round's clients together.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field

from pflbed.algorithms.base import Algorithm, Budget, ClientData, Context, Predictor, Tensors
from pflbed.algorithms.local_sgd import LocalSGDPlan, Phase, RegularizedObjective
from pflbed.algorithms.reply_shapes import misfit, specs
from pflbed.algorithms.training import finetune_epochs
from pflbed.search import Search, Space


class FedMTLOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    search: ClassVar[dict[str, Space]] = {"lam": Search(1e-3, 10.0, log=True)}
    lam: float = Field(0.1, ge=0, description="λ of the relationship regularizer λ·Σ‖w_i − w̄‖²")


class FedMTL(Algorithm):
    name = "fedmtl"
    dp_refused = "the server's task-relationship update reads every client's model one by one, not their mean"
    Config = FedMTLOptions

    def init_server(self) -> Tensors:
        return dict(self.ctx.initial_params)  # w̄ = mean of w_i^0 = w^0

    def init_client(self, cid: int) -> Tensors:
        return dict(self.ctx.initial_params)

    def configure(self, rnd: int, server: Tensors, cids: list[int]) -> dict[int, Tensors]:
        return {c: server for c in cids}

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)  # λ‖w − w̄‖² is the proximal term μ/2‖w − w̄‖² with μ = 2λ, anchored at w̄
        self.objective = RegularizedObjective([k for k, _ in ctx.model.named_parameters()], 2 * self.opts.lam,
                                              anchor="")  # fmt: skip

    def sgd_plan(self, payload: Tensors, state: Tensors, data: ClientData) -> LocalSGDPlan:
        """E epochs of SGD on f_i(w_i) + λ‖w_i − w̄‖² from the client's own w_i; the reply is its change."""
        t = self.ctx.cfg.train
        phase = Phase(tuple(self.ctx.model.block_names()), t.local_epochs, t.lr)
        return self.objective.plan(state, payload, phase, partial(_change, state))

    def aggregate(self, rnd: int, server: Tensors, replies: dict[int, Tensors], weights: dict[int, float]) -> Tensors:
        m = len(self.ctx.federation.participated)
        out = dict(server)
        for k in server:
            if server[k].is_floating_point():
                out[k] = server[k] + sum(r[k] for r in replies.values()) / m
        return out

    def reply_fits(self, payload: Tensors, reply: Tensors) -> str | None:
        """None if `reply` is what a client replies to `payload` — the change of its model, one entry per
        floating-point entry of w̄ sent, of its shape and dtype (integer buffers are not replied) — else why not.
        The server adds the replies into w̄ key by key: one of another shape would broadcast into it, one of
        another dtype promote it."""
        return misfit(reply, specs(payload, [k for k, v in payload.items() if v.is_floating_point()]))

    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        return Predictor(self.ctx.model, state)

    def personalize(
        self, server: Tensors, data: ClientData, budget: Budget, generator: torch.Generator
    ) -> Iterator[Predictor]:
        """A new task starts from the task mean w̄ and fine-tunes (ft: all parameters; lp: the head)."""
        yield from finetune_epochs(self.ctx.model, server, data, budget, generator)

    def zero_shot(self, server: Tensors, data: ClientData) -> Predictor:
        return Predictor(self.ctx.model, server)


def _change(state: Tensors, new: Tensors) -> tuple[Tensors, Tensors]:
    """(Δ_i = w_i⁺ − w_i over the float entries, w_i⁺)."""
    return {k: new[k] - state[k] for k in new if new[k].is_floating_point()}, new
