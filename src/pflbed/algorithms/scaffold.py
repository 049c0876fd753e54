"""SCAFFOLD — Karimireddy, Kale, Mohri, Reddi, Stich & Suresh, "SCAFFOLD: Stochastic Controlled Averaging for
Federated Learning", ICML 2020 (Algorithm 1).

Server state: the model x and the server control variate c; client state: its control variate c_i (both start at
zero). A sampled client receives (x, c), starts y ← x and takes K local steps

    y ← y − η_l (g_i(y) − c_i + c)

(here: `train.local_epochs` epochs of mini-batch SGD, K = epochs · ⌈n_i / B⌉ steps, the correction c − c_i added to
every step's gradient). Then it updates its control variate:
- option I:  c_i⁺ = ∇f_i(x), the gradient of its loss at the server model (one more pass over its data; the
  cross-entropy alone, on the samples as stored, in training mode: no augmentation and no weight decay, which the
  local steps have where configured, and dropout drawn, BatchNorm on the batch's statistics);
- option II: c_i⁺ = c_i − c + (x − y) / (K η_l)  (the paper's cheaper choice, the default);
and replies (y, Δc_i = c_i⁺ − c_i). The server: x ← x + η_g · mean(y − x), c ← c + (1/N) Σ_{i∈S} Δc_i, N the
number of (participating) clients.

Choice: the mean over the replies is weighted by |D_i| as in FedAvg (the paper averages uniformly over equal-size
clients); with zero control variates (the first round) and η_g = 1, a round is FedAvg's, bit for bit. η_g steps
the trainable parameters only: BatchNorm running statistics (buffers, which the paper's models do not have) take
the plain weighted mean of the replies, and the batch counters their maximum, as in FedAvg — extrapolating them
(η_g > 1) drove running variances negative (one round on `cnn_bn` at η_g = 2: 544 of 608 below zero, G-FL at
chance). With `train.momentum` > 0 the correction enters the gradient that
momentum accumulates, and option II's (x − y)/(Kη_l) is then only an estimate of the mean corrected gradient (the
paper uses plain SGD). Personalization (+FT/+LP, new clients) fine-tunes x, as for FedAvg.
The local steps are a plan (`sgd_plan`, `local_sgd.RegularizedObjective`: CE + ⟨w, c − c_i⟩, the correction as
the client's constants): `executor.batch_clients` trains a round's clients together.
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from pflbed.algorithms.base import ClientData, Context, Tensors
from pflbed.algorithms.local_sgd import LocalSGDPlan, Phase, RegularizedObjective
from pflbed.algorithms.reply_shapes import misfit, spec, specs
from pflbed.algorithms.server_extras import ModelWithExtras
from pflbed.algorithms.training import WeightedMean, load_params
from pflbed.search import Search, Space

C = "c/"  # server control variate keys: c/<parameter name>
DC = "dc/"  # reply: Δc_i per parameter


class ScaffoldOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    search: ClassVar[dict[str, Space]] = {"server_lr": Search(0.1, 2.0, log=True)}  # the paper: η_g = 1
    option: Literal["I", "II"] = Field("II", description="control-variate update: I = gradient at x, II = from y")
    server_lr: float = Field(1.0, gt=0, description="global step size η_g")


class Scaffold(ModelWithExtras):
    name = "scaffold"
    dp_refused = (
        "each reply also carries the client's control-variate change, a second update that the clip and "
        "the noise would have to bound too"
    )
    Config = ScaffoldOptions
    prefix = C  # c; clients' c_i start at zero too

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        # CE + ⟨w, c − c_i⟩ (gradient g_i(y) + (c − c_i)); one function: the round's plans batch together
        self.objective = RegularizedObjective(self.params, linear="")

    def configure(self, rnd: int, server: Tensors, cids: list[int]) -> dict[int, Tensors]:
        return {c: server for c in cids}

    def sgd_plan(self, payload: Tensors, state: Tensors, data: ClientData) -> LocalSGDPlan:
        """The local steps as a plan: every block at `train.lr` on CE + ⟨w, c − c_i⟩, the correction c − c_i
        as the client's constants; `finish` updates c_i (option I or II) and builds the reply (y, Δc_i)."""
        t = self.ctx.cfg.train
        x = {k: payload[k] for k in self.model_keys}

        def finish(y: Tensors) -> tuple[Tensors, Tensors]:
            if self.opts.option == "II":
                steps = t.local_epochs * math.ceil(data.num_train / t.batch_size)
                new = {k: state[k] - payload[f"{C}{k}"] + (x[k] - y[k]) / (steps * t.lr) for k in self.params}
            else:
                new = self.full_gradient(x, data)
            return {**y, **{f"{DC}{k}": new[k] - state[k] for k in self.params}}, new

        correction = {k: (payload[f"{C}{k}"] - state[k]).detach() for k in self.params}
        phase = Phase(tuple(self.ctx.model.block_names()), t.local_epochs, t.lr)
        return LocalSGDPlan(x, (phase,), finish, self.objective, correction)

    def full_gradient(self, x: Tensors, data: ClientData) -> Tensors:
        """∇f_i(x): the mean loss gradient over the client's training samples, at x (option I)."""
        model, bs = self.ctx.model, self.ctx.cfg.train.batch_size
        load_params(model, x)
        model.train()
        named = dict(model.named_parameters())
        total = {k: torch.zeros_like(p) for k, p in named.items()}
        for b in data.train.split(bs):  # order does not matter for a sum
            grads = torch.autograd.grad(F.cross_entropy(model(data.x[b]), data.y[b], reduction="sum"),
                                        list(named.values()), allow_unused=True)  # fmt: skip
            for k, g in zip(named, grads, strict=True):
                if g is not None:
                    total[k] += g
        return {k: v / max(data.num_train, 1) for k, v in total.items()}

    def reply_fits(self, payload: Tensors, reply: Tensors) -> str | None:
        """None if `reply` is what a client replies to `payload`: y (every model entry, buffers included, as x was
        sent) and Δc_i under `dc/<parameter>` (as c was sent); else why not. The server adds each Δc_i into c, so
        one of another shape would broadcast into c, and one of another dtype would promote it."""
        return misfit(reply, {**specs(payload, self.model_keys),
                              **{f"{DC}{k}": spec(payload[f"{C}{k}"]) for k in self.params}})  # fmt: skip

    def aggregator(self, rnd: int, server: Tensors, weights: dict[int, float]) -> _ScaffoldServer:
        return _ScaffoldServer(self, server, weights)


class _ScaffoldServer:
    """x ← x + η_g(mean_w(y) − x) (|D_i|-weighted mean) on the parameters, the mean itself on the buffers (BatchNorm
    statistics), c ← c + Σ Δc_i / N, one reply at a time."""

    def __init__(self, algo: Scaffold, server: Tensors, weights: dict[int, float]) -> None:
        self.algo, self.server = algo, server
        self.mean = WeightedMean(weights, keys=algo.model_keys)
        self.stepped = set(algo.params) if algo.opts.server_lr != 1 else set()
        self.dc = {k: torch.zeros_like(server[f"{C}{k}"]) for k in algo.params}

    def add(self, cid: int, reply: Tensors) -> None:
        self.mean.add(cid, reply)
        for k in self.dc:
            self.dc[k] += reply[f"{DC}{k}"]

    def result(self) -> Tensors:
        m, eta = self.mean.result(), self.algo.opts.server_lr
        x = {k: v + (eta - 1) * (v - self.server[k]) if k in self.stepped else v for k, v in m.items()}
        n = len(self.algo.ctx.federation.participated)
        c = {f"{C}{k}": self.server[f"{C}{k}"] + self.dc[k] / n for k in self.algo.params}
        return {**x, **c}
