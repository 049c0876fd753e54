"""pFedMe — Dinh, Tran & Nguyen, "Personalized Federated Learning with Moreau Envelopes", NeurIPS 2020
(Algorithm 1, Eq. 2–3, 7–8).

Each client's personalized model θ_i solves the Moreau-envelope inner problem (Eq. 2)

    θ̂_i(w) = argmin_θ f_i(θ) + λ/2 · ‖θ − w‖²,

and the local model w_i descends the envelope. A client copies the global w^t into w_i (and θ_i), then for each
of R local steps draws a batch D and
1. approximately solves the inner problem on D: K steps θ ← θ − η_p (∇f_i(θ; D) + λ(θ − w_i)) (Eq. 7),
2. updates w_i ← w_i − η λ (w_i − θ) (Eq. 8).
It replies w_i and keeps θ_i, its personalized model (P-FL). The server mixes (Alg. 1, line 10):
w ← (1 − β) w + β · mean(w_i); β = 1 is plain averaging, β > 1 the paper's acceleration. G-FL scores w.

Which clients train (`train_clients`):
- `sampled` (default): only the round's sampled clients (`federation.sample_fraction`) train, and all of them reply.
- `all`: Alg. 1 (lines 3–9) and the authors' code — every participated client receives w^t and trains, so every
  θ_i moves each round; only the sampled ones reply, and the server mixes their w_i. A client outside the sample
  keeps its θ_i and replies nothing. A round then costs 1/`sample_fraction` times the local computation. Refused
  with secure aggregation (`sites.secagg`), which sends every site one payload: the clients outside the sample
  would either all be told to keep their update, or enter the sum.
The default stays `sampled` so that a round's computation matches the other algorithms' at the same
`sample_fraction` (an equal-budget comparison, and what a cross-device client that was not selected can do); the
two modes coincide at `sample_fraction` 1.

Choices: R = `train.local_epochs` · ⌈n_i/B⌉; η = `train.lr`; the mean is |D_i|-weighted, as in the authors' code
(Alg. 1 weights the sampled clients equally). Eq. 7–8 are plain gradient steps: `train.momentum` and
`train.weight_decay` are not used. The authors' inner solver (CharlieDinh/pFedMe, `pFedMeOptimizer`, read only) also
adds μ·θ to each of Eq. 7's steps, μ = 0.001, a weight decay the paper does not write; not here. β mixes the
trainable parameters only (the authors' code mixes `model.parameters()`): BatchNorm running statistics take the
plain weighted mean of the replies, the batch counters their maximum — mixing them with β > 1 extrapolated running
variances below zero (one round on `cnn_bn` at β = 2: 604 of 608 negative, G-FL at chance).
Defaults: λ = 15, K = 5, β = 1 (the paper's MNIST setting) and η_p = 0.01
(`personal_lr`; the authors' value for Synthetic and CIFAR-10, their MNIST runs use 0.1 for the convex model and 0.09
for the non-convex one); choose them on validation. A client not yet trained has θ_i = w^0. New clients fine-tune w
(FT/LP; the paper defines no new-client procedure).

The local update is a plan (`sgd_plan`): the model's tensors are θ_i, the plan's `local.` tensors w_i, and its one
phase is `MoreauStep`, a step rule (`local_sgd.StepRule`) of K forwards on the step's batch. `executor.batch_clients`
trains a round's clients together; the loop runs the same rule with autograd.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from pflbed.algorithms.base import ClientData, Predictor, Tensors
from pflbed.algorithms.fedavg import FedAvg
from pflbed.algorithms.local_sgd import Gradients, LocalSGDPlan, Phase
from pflbed.algorithms.reply_shapes import misfit, spec
from pflbed.algorithms.training import WeightedMean
from pflbed.search import IntSearch, Search, Space

LOCAL = "local."  # w_i's parameters in the plan, beside θ_i's (the model's)
KEEP = "pfedme/keep"  # payload flag (`train_clients: all`): a client outside the round's sample, which replies nothing


class PFedMeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    search: ClassVar[dict[str, Space]] = {"lam": Search(1.0, 100.0, log=True), "K": IntSearch(1, 10),
                                            "personal_lr": Search(1e-3, 0.1, log=True)}  # defaults 15, 5, 0.01
    lam: float = Field(15.0, gt=0, description="λ of the Moreau envelope")
    K: int = Field(5, ge=1, description="steps solving the inner problem per local step")
    personal_lr: float = Field(0.01, gt=0, description="η_p: step size of the inner problem")
    beta: float = Field(1.0, gt=0, description="β: server mixing w ← (1 − β)w + β·mean(w_i)")
    train_clients: Literal["sampled", "all"] = Field("sampled", description="who trains: the sampled clients, or all")


class PFedMe(FedAvg):
    name = "pfedme"
    Config = PFedMeOptions

    @staticmethod
    def unread_train(options: BaseModel) -> frozenset[str]:
        """Eq. 7–8 are plain gradient steps (choices)."""
        return frozenset({"momentum", "weight_decay"})

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.params = [k for k, _ in ctx.model.named_parameters()]

    @staticmethod
    def secagg_refusal(options: PFedMeOptions) -> str | None:
        """Why `options` cannot run under SecAgg+ (`sites.secagg`; None: they can), as the one-line config error.

        SecAgg+ sends every site one payload (it takes the lowest client id's) and sums one update per site, while
        `train_clients: all` sends the clients outside the round's sample another payload (`KEEP`): either every
        client would be told to keep its update to itself, or the unsampled clients' updates would enter the sum
        and the release, which the mechanism and the accountant count only for the sampled ones."""
        if options.train_clients == "all":
            return ("algorithm.train_clients: all does not apply with sites.secagg=true: SecAgg+ gives every site "
                    "one payload, and pfedme sends the clients outside the round's sample another; use "
                    "train_clients=sampled")  # fmt: skip
        return None

    def init_client(self, cid: int) -> Tensors:
        return dict(self.ctx.initial_params)  # θ_i before the client's first round

    def configure(self, rnd: int, server: Tensors, cids: list[int]) -> dict[int, Tensors]:
        if self.opts.train_clients == "sampled":
            return {c: server for c in cids}
        sampled, keep = set(cids), {**server, KEEP: torch.ones((), device=self.ctx.device)}
        return {c: server if c in sampled else keep for c in self.ctx.federation.participated}

    def payload_fits(self, rnd: int, cid: int, payload: Tensors, state: Tensors) -> str | None:
        """The model (the default); under `train_clients: all`, for a client outside the round's sample, with the
        flag `KEEP` (a float scalar) besides."""
        if self.opts.train_clients == "all" and KEEP in payload:
            why = misfit({KEEP: payload[KEEP]}, {KEEP: spec(torch.ones((), device=self.ctx.device))})
            if why is not None:
                return why
            payload = {k: v for k, v in payload.items() if k != KEEP}
        return super().payload_fits(rnd, cid, payload, state)

    def sgd_plan(self, payload: Tensors, state: Tensors, data: ClientData) -> LocalSGDPlan:
        """θ_i ← w^t (the model's tensors) and w_i ← w^t (`LOCAL` + key), then R steps (`MoreauStep`) over
        `local_epochs` epochs. Reply: w_i with θ_i's BatchNorm statistics, nothing for a client outside the
        sample (`KEEP`); state: θ_i."""
        model, t, o = self.ctx.model, self.ctx.cfg.train, self.opts
        rule = MoreauStep(o.K, o.lam, o.personal_lr, t.lr)
        keys = list(model.state_dict())
        start = {**{k: payload[k] for k in keys}, **{LOCAL + k: payload[k] for k in self.params}}
        keep = KEEP in payload

        def finish(p: Tensors) -> tuple[Tensors, Tensors]:
            theta = {k: p[k] for k in keys}
            return ({} if keep else {**theta, **{k: p[LOCAL + k] for k in self.params}}), theta

        return LocalSGDPlan(start, (Phase(tuple(model.block_names()), t.local_epochs, t.lr, rule=rule),), finish)

    def aggregator(self, rnd: int, server: Tensors, weights: dict[int, float]) -> _Mix:
        return _Mix(WeightedMean(weights), server, self.opts.beta, self.params)

    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        return Predictor(self.ctx.model, state)


@dataclass(frozen=True)
class MoreauStep:
    """One local step on a batch D, as a `local_sgd.StepRule`: K steps θ ← θ − η_p(∇f(θ; D) + λ(θ − w_i))
    (Eq. 7), then w_i ← w_i − ηλ(w_i − θ) (Eq. 8); θ is the model's parameters, w_i the plan's `LOCAL` ones."""

    K: int
    lam: float
    personal_lr: float  # η_p
    lr: float  # η

    batches = 1

    @property
    def forwards(self) -> tuple[int, ...]:
        return (0,) * self.K

    def __call__(self, grads: Gradients, params: Tensors) -> Tensors:
        local = {k[len(LOCAL) :]: v for k, v in params.items() if k.startswith(LOCAL)}
        theta = {k: params[k] for k in local}
        for _ in range(self.K):
            g = grads.grad(theta, 0)
            theta = {k: p - self.personal_lr * (g[k] + self.lam * (p - local[k])) for k, p in theta.items()}
        return {**theta, **{LOCAL + k: w - self.lr * self.lam * (w - theta[k]) for k, w in local.items()}}


class _Mix:
    """w ← (1 − β)·w + β·mean(w_i) on the parameters (the mean itself for β = 1), the mean on the buffers. Replies of
    clients outside `weights` (trained outside the sample) are not aggregated; with none of the sample's, w stays."""

    def __init__(self, mean: WeightedMean, server: Tensors, beta: float, params: list[str]) -> None:
        self.mean, self.server, self.beta = mean, server, beta
        self.mixed = set(params) if beta != 1 else set()

    def add(self, cid: int, reply: Tensors) -> None:
        if cid in self.mean.w:
            self.mean.add(cid, reply)

    def result(self) -> Tensors:
        if not self.mean.added:
            return dict(self.server)
        m = self.mean.result()
        return {k: (1 - self.beta) * self.server[k] + self.beta * v if k in self.mixed else v for k, v in m.items()}
