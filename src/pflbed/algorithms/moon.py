"""MOON — Li, He & Song, "Model-Contrastive Federated Learning", CVPR 2021 (Algorithm 1, Eqs. 2-3).

Client i, sampled in round t, starts from the global model w^t and trains E epochs of SGD on

    ℓ = ℓ_sup(w; x, y) + μ·ℓ_con,                                                     (Eq. 3)
    ℓ_con = −log( exp(sim(z, z_glob)/τ) / (exp(sim(z, z_glob)/τ) + exp(sim(z, z_prev)/τ)) ),   (Eq. 2)

z = R_w(x) the representation of the model being trained, z_glob = R_{w^t}(x) that of the global model it received,
z_prev = R_{w_i^{t−1}}(x) that of its own model from the last round it trained, sim the cosine similarity; both other
models frozen (Algorithm 1, lines 13-18). The server averages the replies as FedAvg does (Σ |D_i|/|D| · w_i), and the
global model is the one that predicts (MOON is a generic-FL method: every client's prediction is the global model's).
A client keeps its last trained model as its state; nothing else is exchanged.

Choices and deviations:
  1. The representation. The paper's network adds a projection head (a 2-layer MLP to 256 dimensions) between
     the encoder and the output layer and contrasts its output; its code also offers the network without it
     (`use_project_head 0`: the encoder's output contrasted, the output layer on it). Here the models are shared
     by every method of a comparison, so R_w is the model's body (every block below its head, `model.body_blocks()`)
     and the output layer its head: the code's no-projection-head network, as the common reimplementations use.
  2. A client with no model of its own yet (its first participation) trains on ℓ_sup alone: the paper's code does
     exactly this in its first round (its pool of previous models is still empty, so ℓ_con is 0); a later
     first-timer would there contrast with its own untrained initialization, an artefact of its simulation.
  3. One previous model (the code's default pool size 1, with which the code's InfoNCE is Eq. 2 exactly).
  4. The frozen models' forwards run in eval mode (the code sets them so): BatchNorm uses their running statistics
     and does not update them.
  5. Defaults: μ = 1 and τ = 0.5 (the code's; the paper's best μ is 5 on CIFAR-10, 1 on CIFAR-100 and
     Tiny-ImageNet); the search covers its README grid (μ 0.001-10 log-uniform, τ 0.1-1). The code trains with
     SGD momentum 0.9 and weight decay 1e-5 (`main.py`); here `train.*` applies.
Personalization (+FT/+LP, new clients) fine-tunes the global model, as for FedAvg. The update is a plan
(`sgd_plan`): `executor.batch_clients` trains a round's clients together.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import ClassVar

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from pflbed.algorithms.base import ClientData, Context, Tensors
from pflbed.algorithms.fedavg import FedAvg
from pflbed.algorithms.local_sgd import LocalSGDPlan, Phase, run_blocks, weighted_mean
from pflbed.models import BlockNet
from pflbed.search import Search, Space

GLOBAL, PREVIOUS = "global/", "previous/"  # the frozen models' tensors among the plan's constants


class MOONOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    search: ClassVar[dict[str, Space]] = {"mu": Search(1e-3, 10.0, log=True), "tau": Search(0.1, 1.0, log=True)}
    mu: float = Field(1.0, ge=0, description="μ, the weight of the model-contrastive loss (0: FedAvg)")
    tau: float = Field(0.5, gt=0, description="τ, the temperature of the model-contrastive loss")


@contextlib.contextmanager
def _frozen(model: BlockNet) -> Iterator[None]:
    """Eval mode for a frozen model's forward, the training mode put back after."""
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


class ContrastiveObjective:
    """ℓ_sup + μ·ℓ_con (Eq. 3) on a batch; without a previous model among the constants, ℓ_sup alone."""

    def __init__(self, mu: float, tau: float) -> None:
        self.mu, self.tau = mu, tau

    def __call__(
        self, model: BlockNet, params: Tensors, consts: Tensors, x: torch.Tensor, y: torch.Tensor,
        w: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        body = model.body_blocks()
        z = run_blocks(model, params, body, x)
        per = F.cross_entropy(run_blocks(model, params, model.head_blocks(), z), y,
                              reduction="mean" if w is None else "none")  # fmt: skip
        prev = {k[len(PREVIOUS) :]: v for k, v in consts.items() if k.startswith(PREVIOUS)}
        if prev and self.mu:
            glob = {k[len(GLOBAL) :]: v for k, v in consts.items() if k.startswith(GLOBAL)}
            with _frozen(model):
                z_glob = run_blocks(model, glob, body, x).detach()
                z_prev = run_blocks(model, prev, body, x).detach()
            flat = z.flatten(1)
            pos = F.cosine_similarity(flat, z_glob.flatten(1), dim=1) / self.tau
            neg = F.cosine_similarity(flat, z_prev.flatten(1), dim=1) / self.tau
            con = F.softplus(neg - pos)  # −log(e^pos / (e^pos + e^neg)), Eq. 2
            per = per + self.mu * (con.mean() if w is None else con)
        return per if w is None else weighted_mean(per, w)


class MOON(FedAvg):
    name = "moon"
    Config = MOONOptions

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.objective = ContrastiveObjective(self.opts.mu, self.opts.tau)  # one object: a round's plans batch

    def sgd_plan(self, payload: Tensors, state: Tensors, data: ClientData) -> LocalSGDPlan:
        """E epochs of SGD on every block from w^t on Eq. 3, the global model w^t and the client's previous model
        (its state; none on its first participation) the frozen constants; the reply is w, the new state w too."""
        t = self.ctx.cfg.train
        phase = Phase(tuple(self.ctx.model.block_names()), t.local_epochs, t.lr)
        consts = {GLOBAL + k: v for k, v in payload.items()} | {PREVIOUS + k: v for k, v in state.items()}
        return LocalSGDPlan(payload, (phase,), lambda params: (params, dict(params)), self.objective, consts)
