"""FedRoD (hyper) — Chen & Chao, "On Bridging Generic and Personalized Federated Learning for Image
Classification", ICLR 2022: adaptive personalized predictors via a hypernetwork (the authors' slides,
"Adaptive Personalized Predictors Via Hypernetworks" and "Algorithm Modification").

Everything generic is FedRoD (linear) — see `fedrod.py` for the balanced-softmax loss, Eq. 7, Eq. 8 and Eq. 10
and its interpretations 1–3 and 5–7, which hold here unchanged; its option `pfl_body` (interpretation 8) chooses
the P-FL model's body here too (note 7). The personal head is no longer a free parameter per client but generated
from the client's class distribution a_m:

- φ_m = H^P(a_m; ν), H^P a hypernetwork of two FC layers with parameters ν;
  ŷ_P = h_G(z; ψ) + h_P(z; H^P(a_m; ν)).
- Local (modified Eq. 9): ν*_m = argmin_ν L_m({θ, ψ, ν}), initialised with ν̄ (plain CE of ŷ_P, the P-loss).
- Global (modified Eq. 10): ν̄ = Σ_m |D_m|/|D|·ν*_m, next to θ̄ and ψ̄ (normalised over the sampled clients).

Interpretations and deviations:
1. H^P = Linear(C, hidden) → ReLU → Linear(hidden, C·d + C), the output reshaped into the weight (C × d) and
   bias (C) of the linear personal head on the flattened body output (d its size). The slides say "two FC" and
   give no width: `hidden` defaults to 32. A width at which four copies of H^P exceed the device's memory
   (`pflbed.memory`) is refused in one line before the run starts.
2. a_m = the client's training class prior P_m(y) (normalised label counts) — the "class distribution". A new
   client's a_m is its `ClientData.prior`, the prior of its whole training split even when it adapts on a subset.
3. Initialisation: the output layer of H^P is all zeros, so every client's generated head starts at zero and
   ŷ_P = ŷ_G — the same start as the linear variant's zero φ'_m. The first layer has PyTorch's default init,
   drawn from a stream derived from (seed, INIT) so runs reproduce. (At the first step only the output layer gets
   gradient; from the second on, both do.)
4. The P-loss trains ν through the generated weights: the head is regenerated from ν at every step, and the
   stop-gradients of `fedrod.personal_logits` keep the P-loss off f and h_G (and L^BSM off ν). ν uses SGD with
   `hyper_lr` and `train.momentum` / `train.weight_decay`; restarted every round. `hyper_lr` defaults to half
   the personal head's lr (`personal_lr`, itself `train.lr` by default), chosen on *validation* P-FL (seed 0,
   LeNet-5, Fashion-MNIST, 25 rounds, train.lr 0.01; grid 0.0005–0.01, the best mean over three settings):
   100 clients Dir(0.3) / Dir(0.1) (benchmarks/suites/fmnist_pfl.yaml, table `fedrod_hyper_lr`) and 50 of 100
   clients Dir(0.3) (fmnist_fedrod_bodies.yaml, table `hyper_lr`) pick 0.002 / 0.005 / 0.005 alone and 0.005 on
   the mean. A step on ν moves the generated head by about (1 + ‖hidden‖²) times as much as the same step on a
   free head, and FedAvg of ν over clients with different priors drifts: at the full head lr the Dir(0.3)
   validation P-FL falls 5.2 points below the choice (78.8 vs 84.0), at Dir(0.1) it ties. The slides give no lr.
   The update is FedRoD's plan with ν in φ_m's place (`HyperObjective`; a_m a per-client constant), so
   `executor.batch_clients` trains a round's clients together.
5. ν is uploaded with θ and ψ and averaged with weights |D_m|; the reply is the model state dict plus `hyper.*`.
6. Nothing learned is kept per client (with the default `pfl_body: server`). The client state holds a_m (a
   constant the client knows, never uploaded), because `personal_model(server, state)` has no other way to know
   whose head to generate; with `pfl_body: local` also the client's θ*_m, ψ*_m of its last participated round.
7. P-FL model of client m: h_P = H^P(a_m; ν̄) with the aggregated ν̄ (not the client's last local ν*_m), i.e.
   what the client would generate after the latest aggregation, on the body f, h_G that `pfl_body` names: θ̄, ψ̄
   (`server`), or the client's own θ*_m, ψ*_m (`local`; θ̄, ψ̄ while it has never been sampled). The option
   chooses the body only: the generated head is H^P(a_m; ν̄) under both.
8. New clients: `zero_shot` = θ̄, ψ̄, H^P(a_new; ν̄) with no training. `personalize` starts from that generated
   head and trains the head's weight and bias directly ("lp": P-loss on frozen, cached features; "ft": θ, ψ and
   the head with plain CE on ŷ_P, as in the linear variant). ν itself is never adapted by a new client.
   `eval.finetune` (participated clients) likewise starts from H^P(a_m; ν̄).
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import ClassVar

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn
from torch.func import functional_call

from pflbed import rng
from pflbed.algorithms.base import Budget, ClientData, Context, Predictor, Same, Tensors
from pflbed.algorithms.fedrod import (
    DecoupledObjective,
    FedRoD,
    FedRoDOptions,
    class_counts,
    personalize_additive,
    prefixed,
    unprefixed,
)
from pflbed.algorithms.local_sgd import LocalSGDPlan, Phase
from pflbed.algorithms.training import get_params, load_params
from pflbed.memory import check_fits
from pflbed.search import Search, Space

HYPER = "hyper."  # server-state prefix of ν
_INIT_TAG = 1  # keys the hypernetwork's init stream apart from the model's


class HyperNetwork(nn.Module):
    """H^P(a; ν): class distribution a (C) → weight (C × d) and bias (C) of the personal linear head."""

    def __init__(self, num_classes: int, feature_dim: int, hidden: int = 32) -> None:
        super().__init__()
        self.num_classes, self.feature_dim = num_classes, feature_dim
        self.fc1 = nn.Linear(num_classes, hidden)
        self.fc2 = nn.Linear(hidden, num_classes * feature_dim + num_classes)
        with torch.no_grad():  # deviation 3: every generated head starts at zero
            self.fc2.weight.zero_()
            self.fc2.bias.zero_()

    @staticmethod
    def size(num_classes: int, feature_dim: int, hidden: int) -> int:
        """The parameters `HyperNetwork(num_classes, feature_dim, hidden)` holds, without building it."""
        return (num_classes + 1) * hidden + (hidden + 1) * num_classes * (feature_dim + 1)

    def forward(self, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.fc2(F.relu(self.fc1(a.to(self.fc1.weight))))
        c, d = self.num_classes, self.feature_dim
        return out[: c * d].view(c, d), out[c * d :]

    def head(self, a: torch.Tensor) -> Tensors:
        """The generated personal head, detached, as a Linear state dict (`weight`, `bias`)."""
        with torch.no_grad():
            w, b = self(a)
        return {"weight": w.clone(), "bias": b.clone()}


class HyperObjective(DecoupledObjective):
    """FedRoD's loss with the personal head generated: h_P = H^P(a_m; ν), ν the plan's tensors `hyper.*` and a_m
    its constant `prior`, regenerated at every step (note 4)."""

    def __init__(self, gamma: float, hyper: HyperNetwork) -> None:
        super().__init__(gamma)
        self.hyper = hyper

    def personal_head(self, params: Tensors, consts: Tensors) -> tuple[torch.Tensor, torch.Tensor]:
        return functional_call(self.hyper, unprefixed(HYPER, params), (consts["prior"],))


class FedRoDHyperOptions(FedRoDOptions):
    search: ClassVar[dict[str, Space]] = {**FedRoDOptions.search, "hyper_lr": Search(1e-4, 0.1, log=True)}
    hidden: int = Field(32, ge=1, description="hidden width of the hypernetwork's two FC layers")
    hyper_lr: float | None = Field(None, gt=0, description="SGD lr of ν (default: personal lr / 2, note 4)")


class FedRoDHyper(FedRoD):
    name = "fedrod_hyper"
    Config = FedRoDHyperOptions

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        c, d = ctx.source.num_classes, self.head.in_features
        check_fits(HyperNetwork.size(c, d, self.opts.hidden), ctx.device, "fedrod_hyper's hypernetwork",
                   "algorithm.hidden")  # every client trains it: refused wherever it is built
        with rng.fork(ctx.device), torch.device("cpu"):  # initialized on the CPU like the zoo's models, then moved
            torch.manual_seed(rng.derive_seed(ctx.seed, rng.INIT, _INIT_TAG))
            self.hyper = HyperNetwork(c, d, self.opts.hidden)
        self.hyper.to(ctx.device)
        self.hyper_init = get_params(self.hyper)
        self.objective = HyperObjective(self.opts.gamma, self.hyper)  # one function: clients' plans batch together

    def generate(self, server: Tensors, prior: torch.Tensor) -> Tensors:
        """h_P = H^P(a; ν̄) from the server's ν."""
        load_params(self.hyper, unprefixed(HYPER, server))
        return self.hyper.head(prior)

    # --- federation ------------------------------------------------------------------------------------------
    def init_server(self) -> Tensors:
        return {**self.ctx.initial_params, **prefixed(HYPER, self.hyper_init)}

    def init_client(self, cid: int) -> Tensors:
        return {"prior": self.ctx.federation.clients[cid].prior.clone()}  # deviation 6: a_m only

    def sgd_plan(self, payload: Tensors, state: Tensors, data: ClientData) -> LocalSGDPlan:
        """FedRoD's plan with ν (`hyper.`) in the personal head's place, at `hyper_lr`; the reply is θ*, ψ*, ν*."""
        t = self.ctx.cfg.train
        start = {**self.model_params(payload), **{k: v for k, v in payload.items() if k.startswith(HYPER)}}
        phase = Phase(tuple(self.ctx.model.block_names()), t.local_epochs, t.lr, ((HYPER, self.hyper_lr),))
        consts = {"counts": class_counts(data), "prior": data.prior}
        return LocalSGDPlan(start, (phase,), partial(self._finish, state), self.objective, consts)

    def _finish(self, state: Tensors, reply: Tensors) -> tuple[Tensors, Tensors]:
        return reply, {**state, **self.local_body(reply)} if self.opts.pfl_body == "local" else state

    @property
    def hyper_lr(self) -> float:
        return self.opts.hyper_lr if self.opts.hyper_lr is not None else self.personal_lr / 2

    # aggregate: FedRoD's weighted mean over every uploaded key, ν included (modified Eq. 10)

    # --- evaluation ------------------------------------------------------------------------------------------
    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        return self.additive(server, self.generate(server, state["prior"]), self.personal_body(state))  # note 7

    def zero_shot(self, server: Tensors, data: ClientData) -> Predictor:
        return self.additive(server, self.generate(server, data.prior))

    def personalize(
        self, server: Tensors, data: ClientData, budget: Budget, generator: torch.Generator
    ) -> Iterator[Predictor]:
        start = self.generate(server, data.prior)
        yield from personalize_additive(self.predictor, self.model_params(server), start, data, budget, generator,
                                        feature_key=("fedrod-body", Same(server)))  # fmt: skip
