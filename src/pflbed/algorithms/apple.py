"""APPLE — Luo & Wu, "Adapt to Adaptation: Learning Personalization for Cross-Silo Federated Learning",
IJCAI 2022 (arXiv 2110.08394).

Source note: the stored copies of the paper that could be read here hold its abstract and introduction only. The
rule below is the paper's method as its authors' public code computes it (ljaiverson/pFL-APPLE, read, not copied);
the paper's equation numbers could not be checked, so the equations are named, not numbered.

Every participated client i (N of them) owns a *core model* w_{c,i} and a *directed relationship (DR) vector*
p_i ∈ R^N: p_ij is how much client i uses client j's core model. Its personalized model is

    w_{p,i} = Σ_j p_ij · w_{c,j}                                                          (personalized model)

(the authors' code sums the N layers' outputs, Σ_j p_ij·layer_j(x), before each nonlinearity; for the affine
layers of a network that is this weight-space combination, which is also the model their code evaluates). In a
round client i downloads every core model, then trains its own core and p_i together, every other core frozen,
by SGD on

    L_i(w_{c,i}, p_i) = CE(w_{p,i}; D_i) + λ(r)·‖p_i − p_0‖²,                            (local objective)
    p_0 = (n_1, …, n_N) / Σ_j n_j                   (the clients' training-set shares: FedAvg's weights),

so that ∂L/∂w_{c,i} = p_ii·∂CE/∂w_{p,i} and ∂L/∂p_ij = ⟨∂CE/∂w_{p,i}, w_{c,j}⟩ + 2λ(r)·(p_ij − p_0j), each core
at its own value (the client's own core included). λ(r) pulls p_i towards p_0 early in training and then lets go:

    λ(r) = μ·0.001^{r/R_d} for r < R_d, else 0, R_d = ⌊R·`reg_fraction`⌋     (exponential schedule, the default)
    λ(r) = μ·(cos(π·r/R_d) + 1)/2 for r < R_d, else 0                          (cosine schedule)

with r = 0, 1, … the round (the engine's round minus 1) and R the run's rounds. The client uploads its new core;
the server stores the N core models and relays them — nothing is averaged. p_i starts at p_0 and stays with the
client, with its personalized model, which is the model it predicts with (P-FL).

Choices and deviations:
  1. Constraints and scale: p_i is unconstrained (no projection onto the simplex, no normalization), and the
     regularizer has no ½ — both as the authors' code computes them (whether the paper writes μ/2 is unchecked).
  2. Downloads: every core model, every round — the authors' default (`limit_downloaded_models` 10000). Their
     limited-bandwidth variant (M cores drawn with probabilities rising with |p_ij|) is not reproduced: in their
     code its bookkeeping of cores downloaded once is never updated, so it only ever draws uniformly.
  3. Rounds are synchronous: a client trains against the cores stored at the end of the previous round (the
     authors' simulation does the same). Under partial participation (the authors train every client every
     round) a sampled client downloads the current cores; a client not sampled keeps its p_i and its model, and
     its core stays on the server as it last uploaded it.
  4. The optimizer: one SGD per round (restarted, as in the authors' code) over the own core at `core_lr` and
     p_i at `dr_lr`, with `train.momentum` and `train.weight_decay` for both (the authors use momentum 0.9 and
     no weight decay: set `train.momentum: 0.9`). Epochs and batch size are `train.*`.
  5. Initialization: every core model its own random initialization (`core_init: independent`, the authors'
     code: independently initialized networks), seeded by (seed, client id) as `training.fresh_client_params`
     does; `shared` starts every core from the run's initial model — required with `model.init_from`, whose
     weights independent initializations would discard. p_i starts at p_0, which the server sends (it knows every
     client's training-set size; a site of a site-local run knows only its own). A client that has not trained
     yet (the authors' clients all train every round) predicts with its own initial core.
  6. BatchNorm (the authors' network has none): only parameters are combined by p_i. The personalized model runs
     on the client's own core's running statistics, which its training forwards update and which travel with the
     core.
  7. P-FL scores the personalized model a client holds after its last training: its new core and the other cores
     as it downloaded them, combined by its new p_i — the model the authors' code evaluates. APPLE has no global
     model (G-FL is null), so `eval.finetune` does not run on participated clients.
  8. New clients (the paper defines none): the start is the p_0-weighted mean of the stored cores, the model of
     a newcomer whose DR vector is still p_0 (BatchNorm statistics averaged as FedAvg would; the zero-shot model),
     and `personalize` fine-tunes it (`ft`: every parameter; `lp`: the head).
  9. The update is a plan (`sgd_plan`: one phase over the model and p_i on `DRObjective`, the N cores stacked
     among the client's constants), so `executor.batch_clients` trains a round's clients together.

Defaults, from the authors' code: `mu` 0.1, `reg_fraction` 0.1, `schedule` exponential, `dr_lr` 0.001 (their
README's `--lr_coef 0.001`); `core_lr` defaults to `train.lr` (their `--lr_net` 0.01). `dr_lr: 0` freezes p_i at
p_0 (the default of the PFLlib reimplementation, which also differs elsewhere: uniform p_i, personalized models
uploaded in place of cores, clients of a round training one after another).

Step size, for choosing the options: a step of the own core moves the personalized model by p_ii·Δw_{c,i} =
p_ii²·core_lr·∇, about core_lr/N² while p_i is near p_0 over N clients of similar size; and a mixture of N
independent initializations has its weights shrunk by about √N per layer, so a deep net starts nearly constant.
The authors run 12 clients for 160 rounds of 5 epochs with momentum 0.9. With more clients or fewer rounds, raise
`core_lr` (PFLlib multiplies the lr by N) and consider `core_init: shared`.

Communication per round and client: down N core models (parameters stacked, plus the own core whole), p_0 and
λ(r); up one core model. Memory: a client's update holds the N cores (a batched round, N per client): APPLE is a
cross-silo method (the paper: 12 clients).

Site-local runs (`sites.local`): a site evaluating its clients receives only their own cores `core/<cid>/`
(`client_entries`); a client's P-FL model is in its own state. A training payload still carries every core, which
APPLE hands out by design.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from pflbed.algorithms.base import Algorithm, Budget, ClientData, Context, Predictor, Tensors
from pflbed.algorithms.local_sgd import LocalSGDPlan, Phase, model_forward, weighted_mean
from pflbed.algorithms.reply_shapes import UNSENT, misfit, spec, specs
from pflbed.algorithms.training import WeightedMean, finetune_epochs, fresh_client_params
from pflbed.errors import ConfigError
from pflbed.models import BlockNet
from pflbed.search import Choice, Search, Space, same_as

CORE = "core/"  # server: client c's core model, core/<cid>/<key>
CORES = "cores/"  # payload and plan constants: every core's parameter <key>, stacked in participated order (N, …)
DR = "apple/p"  # the client's DR vector p_i (N): its state, and the plan's second trained tensor
P0 = "apple/p0"  # p_0 (N), sent with every payload
COEF = "apple/coef"  # λ(r), a scalar, sent with every payload
OWN = "apple/own"  # plan constant: the one-hot of the client's own row among the stacked cores
EPSILON = 0.001  # the exponential schedule's value at r = R_d (the authors' constant)


class APPLEOptions(BaseModel):
    """APPLE options."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    # the authors' code: μ 0.1, lr_coef 0.001; the start of the cores decides whether short runs learn at all
    search: ClassVar[dict[str, Space]] = {"mu": Search(1e-3, 10.0, log=True), "dr_lr": Search(1e-4, 0.1, log=True),
                                          "schedule": Choice(["exponential", "cosine"]),
                                          "core_init": Choice(["independent", "shared"])}  # fmt: skip
    dr_lr: float = Field(0.001, ge=0, le=100, description="SGD lr of the DR vector p_i (authors' lr_coef 0.001; 0: "
                         "p_i frozen at p_0)")  # fmt: skip
    core_lr: float | None = Field(None, gt=0, le=100, description="SGD lr of the own core model (None: train.lr; "
                                  "authors' lr_net 0.01)", json_schema_extra=same_as("train.lr"))  # fmt: skip
    mu: float = Field(0.1, ge=0, le=1e4, description="μ: the strength of the pull ‖p_i − p_0‖² at round 0 (0: "
                      "none)")  # fmt: skip
    reg_fraction: float = Field(0.1, ge=0, le=1, description="R_d/R: the share of the rounds during which λ(r) "
                                "decays from μ; 0 from then on")  # fmt: skip
    schedule: Literal["exponential", "cosine"] = Field("exponential", description="λ(r)'s decay: μ·0.001^{r/R_d} "
                                                       "or μ·(cos(π·r/R_d) + 1)/2")  # fmt: skip
    core_init: Literal["independent", "shared"] = Field("independent", description="independent: each core its "
                                                        "own random init (authors' code); shared: every core the "
                                                        "run's initial model (for model.init_from)")  # fmt: skip


def mix(p: torch.Tensor, own: torch.Tensor, params: Tensors, cores: Tensors, keys: list[str]) -> Tensors:
    """w_p = Σ_j p_j·w_{c,j} for the parameters `keys`: the client's own core from `params` (weight p·own), every
    other core from the stacked `cores` (`CORES` + key), whose own row (a stale copy of the same core) is masked
    out — so gradients reach the own core and every p_j, never the other cores."""
    others = p * (1 - own)
    self_weight = (p * own).sum()
    return {k: self_weight * params[k] + torch.tensordot(others, cores[CORES + k], dims=1) for k in keys}


class DRObjective:
    """The local objective: CE of the personalized model + λ(r)·‖p − p_0‖² (λ(r), p_0, the stacked cores and the
    own-row one-hot: the plan's constants). In the loop (`w` None) the batch mean; in a batched step the same per
    sample, weighted, the regularizer once per client. A class: the algorithm travels to `procs` workers by
    pickle."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys

    def __call__(
        self, model: BlockNet, params: Tensors, consts: Tensors, x: torch.Tensor, y: torch.Tensor,
        w: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        p = params[DR]
        logits = model_forward(model, mix(p, consts[OWN], params, consts, self.keys), x)
        ce = F.cross_entropy(logits, y, reduction="mean" if w is None else "none")
        loss = ce if w is None else weighted_mean(ce, w)
        return loss + consts[COEF] * ((p - consts[P0]) ** 2).sum()


class APPLE(Algorithm):
    name = "apple"
    dp_refused = (
        "replies are each client's own core model, which the server stores and relays one by one, never averaged"
    )
    Config = APPLEOptions
    client_entries = rf"{CORE}(\d+)/"

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        if self.opts.core_init == "independent" and ctx.cfg.model.init_from is not None:
            raise ConfigError("algorithm.core_init: independent draws every core model at random, which would "
                              "discard model.init_from; set core_init: shared")  # fmt: skip
        fed = ctx.federation
        self.clients = list(fed.participated)
        self.index = {c: i for i, c in enumerate(self.clients)}
        self.sizes = {c: float(fed.num_train(c)) for c in self.clients}
        n = torch.tensor(list(self.sizes.values()), dtype=torch.float64, device="cpu")  # host numbers
        self.p0 = (n / n.sum()).to(torch.float32).to(ctx.device)
        self.keys = list(ctx.initial_params)  # a core model: the whole state
        self.param_keys = [k for k, _ in ctx.model.named_parameters()]  # what p combines
        self.objective = DRObjective(self.param_keys)  # one object: a round's plans batch together

    # --- the schedule and the cores ----------------------------------------------------------------------------
    def coef(self, rnd: int) -> float:
        """λ(r) for the engine's round `rnd` (r = rnd − 1): μ decaying over the first R_d rounds, then 0 (R_d = 0:
        never, as in the authors' code)."""
        o = self.opts
        r, r_d = rnd - 1, int(self.ctx.cfg.train.rounds * o.reg_fraction)
        if o.mu == 0 or r >= r_d:
            return 0.0
        if o.schedule == "exponential":
            return o.mu * EPSILON ** (r / r_d)
        return o.mu * (math.cos(math.pi * r / r_d) + 1) / 2

    def initial_core(self, cid: int) -> Tensors:
        if self.opts.core_init == "shared":
            return dict(self.ctx.initial_params)
        return fresh_client_params(self.ctx.model, self.ctx.seed, cid)

    def core(self, server: Tensors, cid: int) -> Tensors:
        return {k: server[f"{CORE}{cid}/{k}"] for k in self.keys}

    # --- federation ------------------------------------------------------------------------------------------
    def init_server(self) -> Tensors:
        return {f"{CORE}{c}/{k}": v for c in self.clients for k, v in self.initial_core(c).items()}

    def init_client(self, cid: int) -> Tensors:
        """The client's own initial core, the model it holds until it first trains (choice 5); no DR vector yet:
        p_i starts at the p_0 of its first payload."""
        return self.initial_core(cid)

    def configure(self, rnd: int, server: Tensors, cids: list[int]) -> dict[int, Tensors]:
        """Every client the same stacked cores, p_0 and λ(r), and its own core whole (its start and the reference of
        its reply)."""
        shared = {CORES + k: torch.stack([server[f"{CORE}{c}/{k}"] for c in self.clients]) for k in self.param_keys}
        shared[P0] = self.p0
        shared[COEF] = torch.tensor(self.coef(rnd), dtype=self.p0.dtype, device=self.ctx.device)
        return {c: {**self.core(server, c), **shared} for c in cids}

    def payload_fits(self, rnd: int, cid: int, payload: Tensors, state: Tensors) -> str | None:
        """The client's own core (the model's whole state), every core's parameters stacked in participated order,
        p_0 and λ(r) (`configure`), from the model's shapes (the default would build every client's initial core,
        per payload)."""
        model, n = self.ctx.initial_params, len(self.clients)
        want = {**specs(model), P0: spec(self.p0), COEF: ((), self.p0.dtype),
                **{CORES + k: ((n, *model[k].shape), model[k].dtype) for k in self.param_keys}}  # fmt: skip
        return misfit(payload, want, UNSENT)

    def view_fits(self, view: Tensors, cids: list[int]) -> str | None:
        """The cores of `cids` (`core/<cid>/`, the model's whole state), from the model's shapes: the default would
        build every client's initial core."""
        model = specs(self.ctx.initial_params)
        return misfit(view, {f"{CORE}{c}/{k}": s for c in cids if c in self.index for k, s in model.items()}, UNSENT)

    def sgd_plan(self, payload: Tensors, state: Tensors, data: ClientData) -> LocalSGDPlan:
        """E epochs of SGD on the local objective over the own core (`core_lr`) and p_i (`dr_lr`); the reply is the
        new core, the new state p_i and the personalized model it gives (`finish`)."""
        t, o = self.ctx.cfg.train, self.opts
        own = torch.zeros_like(self.p0)
        own[self.index[data.cid]] = 1.0
        consts = {**{CORES + k: payload[CORES + k] for k in self.param_keys}, OWN: own, P0: payload[P0],
                  COEF: payload[COEF]}  # fmt: skip
        start = {**{k: payload[k] for k in self.keys}, DR: state.get(DR, payload[P0])}  # p_i^0 = p_0
        phase = Phase(tuple(self.ctx.model.block_names()), t.local_epochs, o.core_lr or t.lr, extra=((DR, o.dr_lr),))
        return LocalSGDPlan(start, (phase,), partial(self.finish, consts), self.objective, consts)

    def finish(self, consts: Tensors, trained: Tensors) -> tuple[Tensors, Tensors]:
        """(the new core, {its statistics and the personalized model w_p = Σ_j p_j·w_{c,j}, p})."""
        core = {k: trained[k] for k in self.keys}
        with torch.no_grad():
            personal = mix(trained[DR], consts[OWN], trained, consts, self.param_keys)
        return core, {**core, **personal, DR: trained[DR]}

    def aggregate(self, rnd: int, server: Tensors, replies: dict[int, Tensors], weights: dict[int, float]) -> Tensors:
        """Store each reply as its client's core: no averaging."""
        out = dict(server)
        for c in sorted(replies):
            out.update({f"{CORE}{c}/{k}": replies[c][k] for k in self.keys})
        return out

    def reply_fits(self, payload: Tensors, reply: Tensors) -> str | None:
        """None if `reply` is a core model — every entry of the run's model, of the shape and dtype of the own core
        sent — else why not. The server stores it as the client's core and stacks it with the others next round:
        another shape would crash that stack."""
        return misfit(reply, specs(payload, self.keys))

    # --- evaluation ------------------------------------------------------------------------------------------
    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        return Predictor(self.ctx.model, {k: state[k] for k in self.keys})

    def start(self, server: Tensors) -> Tensors:
        """A new client's model: the p_0-weighted mean of the stored cores, Σ_j p_0j·w_{c,j} (choice 8), integer
        entries the maximum."""
        agg = WeightedMean(self.sizes)  # weights n_j, normalized in float64: p_0
        for c in self.clients:
            agg.add(c, self.core(server, c))
        return agg.result()

    def zero_shot(self, server: Tensors, data: ClientData) -> Predictor | None:
        return Predictor(self.ctx.model, self.start(server))

    def personalize(
        self, server: Tensors, data: ClientData, budget: Budget, generator: torch.Generator
    ) -> Iterator[Predictor]:
        yield from finetune_epochs(self.ctx.model, self.start(server), data, budget, generator)

    def diagnostics(self, rnd: int, server: Tensors, state_of: Callable[[int], Tensors]) -> dict[str, Any]:
        """How personal the DR vectors have become: the mean own weight p_ii (p_0i at the start), the mean Σ_j p_ij
        (1 at the start; p is unconstrained) and the mean ‖p_i − p_0‖."""
        ps = torch.stack([state_of(c).get(DR, self.p0).to(self.p0) for c in self.clients])
        own = ps.diagonal()
        return {"dr_self": round(float(own.mean()), 6), "dr_sum": round(float(ps.sum(1).mean()), 6),
                "dr_distance": round(float((ps - self.p0).norm(dim=1).mean()), 6)}  # fmt: skip
