"""L2GD — Hanzely & Richtárik, "Federated Learning of a Mixture of Global and Local Models", arXiv:2002.05516, 2020
(Algorithm 1, Eq. 2–3).

Objective (Eq. 2): min_x (1/n) Σ f_i(x_i) + λ · (1/2n) Σ ‖x_i − x̄‖², x̄ the mean of the clients' models x_i: λ = 0
is Local, λ → ∞ a single global model. Loopless local GD (Algorithm 1) flips one coin per iteration: with
probability 1 − p every client takes a local step x_i ← x_i − α/(n(1−p)) · ∇f_i(x_i); with probability p every
client moves toward the mean, x_i ← x_i − αλ/(np) · (x_i − x̄). Communication happens only when an averaging step
follows a local one.

Rounds here are the coin's runs: a round is a run of averaging steps (length a ~ Geometric(1 − p), ≥ 1) followed by
a run of local steps (length l ~ Geometric(p), ≥ 1), one communication each. The mean does not move during an
averaging run, so its a steps contract x_i − x̄ by (1 − θ)^a, θ = αλ/(np). The server draws (a, l) from (seed,
round) and sends them with x̄; each client applies the contraction, then l mini-batch SGD steps with step
η = α/(n(1−p)) = `train.lr`, and replies x_i (its state). θ = η·λ·(1 − p)/p must be ≤ 1.
The update is a plan (`sgd_plan`: the contraction gives the start, then a phase of l plain steps), so
`executor.batch_clients` trains a round's clients together.

Deviations: the paper assumes every client in every iteration; with `federation.sample_fraction` < 1 a client not
sampled skips the round (its x_i waits). The server's x̄ is the |D_i|-weighted mean of the round's repliers' x_i
only (the paper's x̄ is the equally weighted mean of all n clients' x_i): a client that skips the round does not
enter it, so with sampling x̄ is the mean over the sample, and it equals the paper's (up to the weighting) only at
`sample_fraction` 1 with no lost replies. Stochastic gradients (mini-batches) as in the paper's experiments; the
local steps are Algorithm 1's plain gradient steps: `train.momentum` and `train.weight_decay` are not used. P-FL
scores x_i; G-FL scores x̄; new clients fine-tune x̄ (FT/LP). Defaults p = 0.2, λ = 2 (θ = 0.4 at lr 0.05).
The paper allows any p in (0, 1); here p ≥ 0.001, as a round's local run has 1/p steps on average (p → 0 never ends).

Under client-level DP (`privacy`, DP-FedAvg over the reply): what a client sends is x_i's update relative to the x̄ it
received, clipped to C, and the server's x̄ is the noised mean of those. The client keeps its own x_i unclipped, so
with a small λ (personal models far from x̄) the clip, not λ, bounds how far one client moves the mean. The run
lengths (a, l) travel as integers beside x̄: an instruction drawn from the seed, never replied, neither clipped nor
noised (`dp_instructions`).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field

from pflbed import rng
from pflbed.algorithms.base import ClientData, Predictor, Tensors
from pflbed.algorithms.fedavg import FedAvg
from pflbed.algorithms.local_sgd import LocalSGDPlan, Phase
from pflbed.errors import ConfigError
from pflbed.search import Search, Space

RUNS = "l2gd/runs"  # payload: (averaging steps a, local steps l) of the round
_COIN = 0x1260  # the server's coin stream, apart from every client's (rng keys 1–4)


P_MIN = 1e-3  # a round's local run is Geometric(p) long: p → 0 makes it endless (at 5e-324, log(1 − p) = 0 crashed)


class L2GDOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # θ > 1: refused, pruned
    search: ClassVar[dict[str, Space]] = {"p": Search(0.05, 0.95), "lam": Search(0.1, 10.0, log=True)}
    p: float = Field(0.2, ge=P_MIN, lt=1, description="probability of an averaging step (a round's local run "
                     "has 1/p steps on average: from 0.001, at most 1,000)")  # fmt: skip
    lam: float = Field(2.0, ge=0, description="λ: the penalty on the distance to the mean model")


class L2GD(FedAvg):
    name = "l2gd"
    Config = L2GDOptions
    # under client-level DP: the run lengths are an instruction to the clients, never replied, and public (drawn from
    # the seed and the round): neither clipped nor noised (`engine.build.check_dp_payload`)
    dp_instructions = (RUNS,)

    @staticmethod
    def unread_train(options: BaseModel) -> frozenset[str]:
        """Algorithm 1's plain gradient steps, run lengths drawn from p (not epochs)."""
        return frozenset({"local_epochs", "momentum", "weight_decay"})

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        o, lr = self.opts, ctx.cfg.train.lr
        self.theta = lr * o.lam * (1 - o.p) / o.p
        if self.theta > 1:
            raise ConfigError(f"algorithm.lam: the averaging step θ = train.lr·λ·(1 − p)/p = {self.theta:g} must be "
                              "≤ 1; lower lam or train.lr, or raise p")  # fmt: skip

    def init_client(self, cid: int) -> Tensors:
        return dict(self.ctx.initial_params)  # x_i^0 = x^0

    def runs(self, rnd: int) -> tuple[int, int]:
        """(a, l): the round's averaging-run and local-run lengths, drawn from (seed, round)."""
        coin = rng.generator(self.ctx.seed, _COIN, rnd)
        u = torch.rand(2, generator=coin, dtype=torch.float64, device="cpu").tolist()  # host numbers
        p = self.opts.p
        a = 1 + math.floor(math.log(u[0]) / math.log(p))  # P(a = k) = p^(k−1)(1 − p): the run goes on w.p. p
        l_ = 1 + math.floor(math.log(u[1]) / math.log(1 - p))  # P(l = k) = (1 − p)^(k−1) p
        return a, l_

    def configure(self, rnd: int, server: Tensors, cids: list[int]) -> dict[int, Tensors]:
        payload = {**server, RUNS: torch.tensor(self.runs(rnd), device=self.ctx.device)}
        return {c: payload for c in cids}

    def sgd_plan(self, payload: Tensors, state: Tensors, data: ClientData) -> LocalSGDPlan:
        """The contraction x_i ← x̄ + (1 − θ)^a·(x_i − x̄) gives the start; then l plain mini-batch gradient steps
        (η = α/(n(1 − p)) = `train.lr`; no momentum, no weight decay), batches epoch after epoch, cut after l.
        Every client of a round has the same (a, l), so their plans batch together."""
        t = self.ctx.cfg.train
        a, l_ = (int(v) for v in payload[RUNS])
        shrink = (1 - self.theta) ** a
        x = {k: payload[k] + shrink * (v - payload[k]) if v.is_floating_point() else v for k, v in state.items()}
        phase = Phase(tuple(self.ctx.model.block_names()), l_, t.lr, steps=l_, momentum=0.0, weight_decay=0.0)
        return LocalSGDPlan(x, (phase,), _twice)

    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        return Predictor(self.ctx.model, state)


def _twice(new: Tensors) -> tuple[Tensors, Tensors]:
    """x_i is both the reply and the state."""
    return new, new
