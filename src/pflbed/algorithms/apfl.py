"""APFL — Deng, Kamani & Mahdavi, "Adaptive Personalized Federated Learning", arXiv:2003.13461, 2020 (Algorithm 1,
Eq. 3, 10).

Each client keeps a local model v_i and a mixing weight α_i; its personalized model is the mixture
v̄_i = α_i v_i + (1 − α_i) w (Eq. 3). In a sampled round it starts from the global w and, per local step on a batch
ξ, updates simultaneously (all gradients at the step's starting values):
- w ← w − η ∇f_i(w; ξ)                          (the global model's local copy; the reply)
- v_i ← v_i − η ∇_v f_i(v̄_i; ξ) = v_i − η α_i ∇f_i(v̄_i; ξ)
- α_i ← α_i − η_α ⟨v_i − w, ∇f_i(v̄_i; ξ)⟩        (Eq. 10, adaptive α), kept in [0, 1].
The server averages the w's (|D_i|-weighted). P-FL scores v̄_i = α_i v_i + (1 − α_i) w with the current global w;
G-FL scores w.

Choices: `train.local_epochs` · ⌈n_i/B⌉ steps of plain SGD at η = `train.lr` (momentum and weight decay unused);
v_i starts at w^0; `alpha` (initial α_i) 0.5 and `alpha_lr` η_α = η unless set (the paper tunes both); `adaptive`
false keeps α fixed (the paper's non-adaptive variant). New clients fine-tune w (FT/LP).

BatchNorm (the paper's models have none): only parameters mix. v̄'s running statistics and counters are its own,
kept in v_i's entries and updated by v̄'s training forwards; w's by w's. Mixing statistics like parameters would
leave v_i's never updated (the forwards run on the mixture) and describe the features of no model.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch.func import functional_call

from pflbed.algorithms.base import Algorithm, ClientContext, ClientData, Context, Predictor, Tensors
from pflbed.algorithms.fedavg import FedAvg
from pflbed.algorithms.training import index_batches
from pflbed.search import Search, Space, same_as

ALPHA = "alpha"


class APFLOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # the paper: α ∈ {0.25, 0.5, 0.75}
    search: ClassVar[dict[str, Space]] = {"alpha": Search(0.05, 0.95), "alpha_lr": Search(1e-4, 0.3, log=True)}
    alpha: float = Field(0.5, ge=0, le=1, description="initial mixing weight α_i of the local model")
    alpha_lr: float | None = Field(None, gt=0, description="η_α (None: train.lr)",
                                   json_schema_extra=same_as("train.lr"))
    adaptive: bool = Field(True, description="learn α_i (Eq. 10); False: keep it fixed")


def mixture(v: Tensors, w: Tensors, alpha: torch.Tensor, params: list[str]) -> Tensors:
    """v̄: α v + (1 − α) w for the parameters `params`; every other entry (BatchNorm's statistics) v's own."""
    return {**v, **{k: alpha * v[k] + (1 - alpha) * w[k] for k in params}}


class APFL(FedAvg):
    name = "apfl"
    Config = APFLOptions
    sgd_plan = Algorithm.sgd_plan
    loop_only = ("a step forwards two models, w and the mixture α·v + (1 − α)·w (with v's BatchNorm statistics), "
                 "and moves w, v and α at once; a plan's step forwards one model")

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.params = [k for k, _ in ctx.model.named_parameters()]  # the entries that mix

    def init_client(self, cid: int) -> Tensors:
        return {**self.ctx.initial_params, ALPHA: torch.tensor(self.opts.alpha, device=self.ctx.device)}

    def client_update(
        self, payload: Tensors, state: Tensors, data: ClientData, cctx: ClientContext
    ) -> tuple[Tensors, Tensors]:
        model, t, o = self.ctx.model, self.ctx.cfg.train, self.opts
        model.train()
        names = self.params
        w = {k: v.detach().clone() for k, v in payload.items()}
        v = {k: state[k].detach().clone() for k in payload}
        alpha = state[ALPHA].detach().clone()
        eta_a = o.alpha_lr or t.lr

        def loss(params: Tensors, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(functional_call(model, params, (x,)), y)

        steps = t.local_epochs * math.ceil(data.num_train / t.batch_size)
        for b in index_batches(data.train, t.batch_size, t.local_epochs, cctx.generator, passes=2):
            x, y = data.batch(b, cctx.generator)  # one (augmented) batch for w's and v̄'s gradients
            wp = {k: w[k].requires_grad_(True) if k in names else w[k] for k in w}
            gw = torch.autograd.grad(loss(wp, x, y), [wp[k] for k in names])
            vp = {k: v[k].requires_grad_(True) if k in names else v[k] for k in v}
            a = alpha.clone().requires_grad_(o.adaptive)
            mixed = mixture(vp, {k: w[k].detach() for k in names}, a, names)  # v's statistics: updated in place
            inputs = [vp[k] for k in names] + ([a] if o.adaptive else [])
            grads = torch.autograd.grad(loss(mixed, x, y), inputs)
            with torch.no_grad():
                for k, g in zip(names, gw, strict=True):
                    w[k] = w[k].detach() - t.lr * g
                for k, g in zip(names, grads[: len(names)], strict=True):
                    v[k] = v[k].detach() - t.lr * g
                if o.adaptive:
                    alpha = (alpha - eta_a * grads[-1]).clamp(0.0, 1.0)
            steps -= 1
        assert steps == 0
        w = {k: x.detach() for k, x in w.items()}
        return w, {**{k: x.detach() for k, x in v.items()}, ALPHA: alpha}

    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        return Predictor(self.ctx.model, mixture({k: state[k] for k in server}, server, state[ALPHA], self.params))
