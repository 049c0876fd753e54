"""GPFL — Zhang, Hua, Wang, Song, Xue, Ma, Cao & Guan, "GPFL: Simultaneously Learning Global and Personalized
Feature Information for Personalized Federated Learning", ICCV 2023 (arXiv 2308.10279, §3.2, Eqs. 3-11,
Algorithm 1).

Equation numbers are the paper's; the rules it leaves open are the authors' public code's (read, not copied).

Model: a feature extractor φ(·; W^fe) (the BlockNet body, shared; f_i = φ(x) flattened to K values), a personal
head ψ(·; W_i^h) (the head blocks, never leaving client i), the Conditional Valve CoV(·; V) and the Global Category
Embedding GCE(·; C), a table C ∈ R^{U×K} with one row per class u (both shared). Client i trains on

    f^G = σ[(γ + 1) ⊙ f + β],  f^P = σ[(γ_i + 1) ⊙ f + β_i],  σ = ReLU                                   (Eq. 3)
    {γ, β} = CoV(f, g; V),  {γ_i, β_i} = CoV(f, p_i; V),  γ(c) = LN(ReLU(W_γ c + b_γ)), β(c) likewise   (Eq. 4)
    g = (1/U)·Σ_u Ĉ_u,  p_i = Σ_u α_i^u·Ĉ_u  (α_i: client i's training label frequencies; both constants)  (5-7)
    L^alg = −log( exp(cos(f^G, C_y)) / Σ_u exp(cos(f^G, C_u)) )        (angle-level guidance, no temperature) (Eq. 8)
    L^mlg = ‖f^G − Ĉ_y‖₂   (Ĉ: a frozen copy of the C the client received)   (magnitude-level guidance)   (Eq. 9)
    L^P = CE(ψ(f^P; W_i^h), y)                                                      (the personalized task) (Eq. 10)
    L = L^P + L^alg + λ·L^mlg + (μ/2)·(‖C‖² + ‖V‖²)                            (Eq. 11 as the code applies μ)

E epochs of mini-batch SGD at `train.lr` on W^fe, W_i^h, V and C together (the code's three SGD optimizers, one
lr; μ is their weight decay on C and V, written here as the equivalent penalty). The server averages W^fe, V and C
with weights n_i / Σ_{j∈S_t} n_j (the head is never sent). Client i predicts with ψ_i(CoV(φ(x), p_i)) (P-FL); the
global route argmax_u cos(CoV(φ(x), g), C_u) is the generic model (G-FL; the paper's code does not score it).

Choices and deviations:
  1. The conditional inputs (`conditional`). Default `received`: g and p_i from the C the client receives in the
     round (the server's C^t), fixed during local training (no gradient flows into C through them), the reading
     of Eq. 4 with the one shared C. The authors' code instead recomputes them, at the end of each round, from
     the client's own GCE just before the new global one overwrites it — its locally trained C_i, one round
     behind the C it then trains with — and starts every client at g = p_i = 0. `local` is that rule: g, p_i
     from the client's GCE after its last training, kept in its state (0 before it first trains; there every
     client receives every round's C, so its unsampled clients recompute theirs from the previous global C, while
     here a client's kept values change only when it trains). The two change results. The paper prescribes
     `received`: Eq. 5 and 7 build g and p_i from Ĉ, the copy of the received C^t (Algorithm 1, lines 6-8).
  2. The magnitude term (`mlg`). Default `sample`: Eq. 9 per sample, averaged over the mini-batch (the loss is
     an expectation over the client's data). The authors' code takes one Frobenius norm of the whole mini-batch's
     F^G − Ĉ_Y matrix (`batch`); that is about √B times larger, so the code's λ = 0.01 (the authors' setting for
     the 4-layer CNN at batch 10) is weaker under `sample`: `batch` with λ matches `sample` with about λ·√B.
  3. α_i is the client's exact training label frequency (its class prior); the code counts it over a loader that
     drops the last incomplete batch.
  4. The personal head of every client starts from the run's initial head (the same for all, as in the code,
     where every client draws its model from the same seed); C (N(0, 1), `nn.Embedding`'s) and V (PyTorch's
     default Linear and LayerNorm initialization) are drawn once, from a stream of their own, and sent to all.
  5. The flattened body output is f (K its size), γ and β depend on the conditional input only (the code's CoV,
     broadcast over the batch); f^P is reshaped to the body's output shape before the head. For the zoo's
     `cnn` this is the code's split: body = all but the last Linear, f the ReLU'd 512-d `fc1` output.
  6. `train.momentum` and `train.weight_decay` apply to every trained tensor, V and C included (the code: plain
     SGD, its only weight decay μ, on C and V); leave them 0 for the code's optimizers.
  7. BatchNorm statistics of the body, if a model has any, are shared and averaged with its parameters.
  8. New clients (the paper defines none): `zero_shot` is the generic model (the global route). `personalize`
     starts from the server's φ, V, C, the run's initial head and p = α_new·C: `lp` trains the head alone on the
     frozen f^P (computed once, eval mode), `ft` trains φ, V and the head on L^P (the personalized route's
     cross-entropy), C not involved. `eval.finetune` of participated clients goes through the same `personalize`,
     which sees no client state: it starts from the initial head, not the client's.
  9. μ: Eq. 11 adds μ‖V‖₂ + μ‖C‖₂, norms not squared (gradient μ·V/‖V‖); the authors' code passes μ as the weight
     decay of V's and C's SGD optimizers (gradient μ·V), which is (μ/2)‖·‖² here. The code is followed: its
     defaults (λ, μ below) were tuned under it.
 10. p_i: Eq. 7 divides Σ_u α_i^u Ĉ_u by U; the authors' code does not, nor does this file (p_i is U times the
     paper's, a convex combination of the rows of Ĉ like g).
 11. What is reported: the paper, following pFedMe, reports the best per-round mean test accuracy of the
     personalized models; the PFLBED protocol never selects on test (the final round, or validation's choice).
The update is a plan (`sgd_plan`: one phase over every block with V and C as extra tensors, `GPFLObjective`, Ĉ, g
and p_i the client's constants), so `executor.batch_clients` trains a round's clients together. Every reply entry
is the client's new value of a payload entry (W^fe, V, C) and the server reads them only through their weighted
mean, so client-level DP applies; the server state holds no per-client entry.

Defaults (`algorithm.<key>`): λ = 0.01 and μ = 0.1, the authors' run script for the 4-layer CNN and 3-layer MLP
(their code's own defaults are λ = 0, μ = 0; PFLlib's shared flags give λ = 1, μ = 0).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from torch.func import functional_call

from pflbed import rng
from pflbed.algorithms.base import Algorithm, Budget, ClientData, Context, Predictor, Same, Tensors
from pflbed.algorithms.fedrod import feature_dim, prefixed, unprefixed
from pflbed.algorithms.local_sgd import LocalSGDPlan, Phase, run_blocks, weighted_mean
from pflbed.algorithms.training import WeightedMean, get_params, load_params, sgd_epochs
from pflbed.models import BlockNet
from pflbed.search import Search, Space

COV, GCE = "cov.", "gce."  # key prefixes of V and C in the server state, the plans and the route modules
TABLE = GCE + "weight"  # C, U × K
NET = "net."  # the BlockNet's keys inside the route modules
STREAM = 0x6BF1  # the init stream of V and C (not one of pflbed.rng's tags)


class GPFLOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    search: ClassVar[dict[str, Space]] = {"lam": Search(1e-4, 1.0, log=True), "mu": Search(1e-3, 1.0, log=True)}
    lam: float = Field(0.01, ge=0, le=100, description="λ, the weight of the magnitude-level guidance L^mlg (Eq. 9; "
                       "the authors' 0.01 for the 4-layer CNN and MLP)")  # fmt: skip
    mu: float = Field(0.1, ge=0, le=100, description="μ, the weight decay of the GCE table C and the CoV's "
                      "parameters V, as the penalty (μ/2)·(‖C‖² + ‖V‖²) (the authors' 0.1 for the 4-layer CNN and "
                      "MLP)")  # fmt: skip
    mlg: Literal["sample", "batch"] = Field(
        "sample", description="L^mlg: sample — each sample's ‖f^G − Ĉ_y‖₂ averaged over the batch (Eq. 9); batch — "
        "one Frobenius norm of the mini-batch's F^G − Ĉ_Y (the authors' code, ≈ √B times larger)")
    conditional: Literal["received", "local"] = Field(
        "received", description="g and p_i from: received — the C the client receives each round; local — the "
        "client's own C after its last training, kept in its state, 0 before it first trains (the authors' code)")


def cosine_logits(f: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """cos(f_b, C_u) for every sample b and class u: the logits of Eq. 8 (no temperature, no margin)."""
    return F.normalize(f.flatten(1), dim=1) @ F.normalize(table, dim=1).T


def conditional_inputs(table: torch.Tensor, prior: torch.Tensor) -> Tensors:
    """g = (1/U)·Σ_u C_u and p_i = Σ_u α_{i,u}·C_u (Eq. 5 and 7, without Eq. 7's 1/U: choice 10), detached
    constants."""
    table = table.detach()
    return {"g": table.mean(0), "p": prior.to(table) @ table}


class ConditionalValve(nn.Module):
    """CoV(f, c; V) = σ[(γ(c) + 1) ⊙ f + β(c)], γ(c) = LN(ReLU(W_γ c + b_γ)), β(c) = LN(ReLU(W_β c + b_β)) (Eqs. 3-4);
    c is one K-vector for the whole batch, f is flattened to K values and the output has f's shape."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gamma = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.LayerNorm(dim))
        self.beta = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.LayerNorm(dim))

    def forward(self, f: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        out = F.relu(f.flatten(1) * (self.gamma(c) + 1) + self.beta(c))
        return out.reshape(f.shape)


class PersonalRoute(nn.Module):
    """The P-FL predictor ψ_i(CoV(φ(x), p_i)): the BlockNet (`net.`), the CoV (`cov.`) and p_i (`cond`). `features`
    is the body, so clients on one body share its features; `classify` the valve and the client's head."""

    def __init__(self, net: BlockNet, cov: ConditionalValve, dim: int, device: torch.device) -> None:
        super().__init__()
        self.net, self.cov = net, cov
        self.register_buffer("cond", torch.zeros(dim, device=device))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.net.features(x)

    def classify(self, z: torch.Tensor) -> torch.Tensor:
        return self.net.classify(self.cov(z, self.cond))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classify(self.features(x))


class GlobalRoute(PersonalRoute):
    """The G-FL predictor: cosine logits of CoV(φ(x), g) against the GCE table (`gce.weight`), g in `cond`."""

    def __init__(self, net: BlockNet, cov: ConditionalValve, gce: nn.Embedding, dim: int, device: torch.device):
        super().__init__(net, cov, dim, device)
        self.gce = gce

    def classify(self, z: torch.Tensor) -> torch.Tensor:
        return cosine_logits(self.cov(z, self.cond), self.gce.weight)


class GPFLObjective:
    """L^P + L^alg + λ·L^mlg + (μ/2)·(‖C‖² + ‖V‖²) on a batch (`local_sgd.Objective`): V the plan's `cov.` tensors,
    C its `gce.weight`, Ĉ (`frozen`), g and p_i the client's constants. In the loop (`w` None) batch means; in a
    batched step the per-sample terms weighted, the batch norm of `mlg: batch` over the real samples only, the
    penalty once per client."""

    def __init__(self, cov: ConditionalValve, lam: float, mu: float, mlg: str) -> None:
        self.cov, self.lam, self.mu, self.mlg = cov, lam, mu, mlg

    def __call__(
        self, model: BlockNet, params: Tensors, consts: Tensors, x: torch.Tensor, y: torch.Tensor,
        w: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        valve = unprefixed(COV, params)
        f = run_blocks(model, params, model.body_blocks(), x)
        f_p = functional_call(self.cov, valve, (f, consts["p"]))
        f_g = functional_call(self.cov, valve, (f, consts["g"])).flatten(1)
        reduction = "mean" if w is None else "none"
        personal = F.cross_entropy(run_blocks(model, params, model.head_blocks(), f_p), y, reduction=reduction)
        angle = F.cross_entropy(cosine_logits(f_g, params[TABLE]), y, reduction=reduction)  # Eq. 8
        gap = f_g - F.embedding(y, consts["frozen"]).to(f_g)  # f^G − Ĉ_y, Ĉ frozen (Eq. 9)
        if self.mlg == "sample":
            norms = torch.linalg.vector_norm(gap, dim=1)
            per = personal + angle + self.lam * (norms.mean() if w is None else norms)
            loss = per if w is None else weighted_mean(per, w)
        else:
            real = gap if w is None else gap * (w > 0).to(gap.dtype)[:, None]  # padding rows out of the norm
            loss = personal + angle if w is None else weighted_mean(personal + angle, w)
            loss = loss + self.lam * torch.linalg.vector_norm(real)
        if self.mu:
            loss = loss + 0.5 * self.mu * (params[TABLE].pow(2).sum() + sum(v.pow(2).sum() for v in valve.values()))
        return loss


class GPFL(Algorithm):
    name = "gpfl"
    Config = GPFLOptions
    dp_refused = None  # replies: the shared entries' (φ, V, C) new values, averaged (client-level DP applies)

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        m = ctx.model
        self.body_keys, self.head_keys = m.state_keys(m.body_blocks()), m.state_keys(m.head_blocks())
        self.dim = feature_dim(m, ctx.source.input_shape)
        with rng.fork(ctx.device), torch.device("cpu"):  # drawn on the CPU like the zoo's models, then moved
            torch.manual_seed(rng.derive_seed(ctx.seed, rng.INIT, STREAM))
            cov, gce = ConditionalValve(self.dim), nn.Embedding(ctx.source.num_classes, self.dim)
        self.cov, self.gce = cov.to(ctx.device), gce.to(ctx.device)
        self.shared_init = {**prefixed(COV, get_params(self.cov)), **prefixed(GCE, get_params(self.gce))}
        self.personal = PersonalRoute(m, self.cov, self.dim, ctx.device)
        self.generic = GlobalRoute(m, self.cov, self.gce, self.dim, ctx.device)
        o = self.opts
        self.objective = GPFLObjective(self.cov, o.lam, o.mu, o.mlg)  # one object: a round's plans batch together

    # --- federation ------------------------------------------------------------------------------------------
    def init_server(self) -> Tensors:
        return {**{k: self.ctx.initial_params[k] for k in self.body_keys}, **self.shared_init}

    def init_client(self, cid: int) -> Tensors:
        """The initial head and α_i (kept: `personal_model` sees the state, not the client's data)."""
        head = {k: self.ctx.initial_params[k] for k in self.head_keys}
        return {**head, "prior": self.ctx.federation.clients[cid].prior.clone()}

    def configure(self, rnd: int, server: Tensors, cids: list[int]) -> dict[int, Tensors]:
        return {c: server for c in cids}

    def conditionals(self, table: torch.Tensor, state: Tensors) -> Tensors:
        """g and p_i for training and P-FL: from `table` (the received C), or the kept ones (`conditional: local`)."""
        if self.opts.conditional == "received":
            return conditional_inputs(table, state["prior"])
        zero = torch.zeros(self.dim, device=table.device, dtype=table.dtype)
        return {"g": state.get("g", zero), "p": state.get("p", zero)}

    def sgd_plan(self, payload: Tensors, state: Tensors, data: ClientData) -> LocalSGDPlan:
        """E epochs of SGD on φ, ψ_i (every block), V and C (extra tensors) at `train.lr` on `GPFLObjective`; the
        reply is φ, V, C, the new state ψ_i, α_i (and g, p_i from the trained C with `conditional: local`)."""
        t = self.ctx.cfg.train
        start = {**payload, **{k: state[k] for k in self.head_keys}}
        phase = Phase(tuple(self.ctx.model.block_names()), t.local_epochs, t.lr, ((COV, t.lr), (GCE, t.lr)))
        consts = {"frozen": payload[TABLE], **self.conditionals(payload[TABLE], state)}
        shared = list(payload)

        def finish(params: Tensors) -> tuple[Tensors, Tensors]:
            new = {**{k: params[k] for k in self.head_keys}, "prior": state["prior"]}
            if self.opts.conditional == "local":
                new.update(conditional_inputs(params[TABLE], state["prior"]))
            return {k: params[k] for k in shared}, new

        return LocalSGDPlan(start, (phase,), finish, self.objective, consts)

    def aggregator(self, rnd: int, server: Tensors, weights: dict[int, float]) -> WeightedMean:
        return WeightedMean(weights)  # φ, V, C: Σ n_i/n·(·)_i over the round's clients

    # --- evaluation ------------------------------------------------------------------------------------------
    def shared(self, server: Tensors) -> Tensors:
        """The personalized route's shared parameters: the server's body (`net.`) and V."""
        return {**{NET + k: server[k] for k in self.body_keys},
                **{k: v for k, v in server.items() if k.startswith(COV)}}  # fmt: skip

    def generic_model(self, server: Tensors) -> Predictor:
        params = {**self.shared(server), TABLE: server[TABLE], "cond": server[TABLE].mean(0)}  # g
        return Predictor(self.generic, params, feature_key=("gpfl-body", Same(server)))

    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        params = {**self.shared(server), **prefixed(NET, {k: state[k] for k in self.head_keys}),
                  "cond": self.conditionals(server[TABLE], state)["p"]}  # fmt: skip
        return Predictor(self.personal, params, feature_key=("gpfl-body", Same(server)))

    def personalize(
        self, server: Tensors, data: ClientData, budget: Budget, generator: torch.Generator
    ) -> Iterator[Predictor]:
        """From the server's φ, V, the initial head and p = α·C (choice 8): `lp` the head on frozen f^P, `ft` φ, V
        and the head on L^P."""
        start = {**self.shared(server), **prefixed(NET, {k: self.ctx.initial_params[k] for k in self.head_keys}),
                 "cond": conditional_inputs(server[TABLE], data.prior)["p"]}  # fmt: skip
        route, net = self.personal, self.ctx.model
        load_params(route, start)
        kw = budget.sgd(generator)
        if budget.method == "ft":
            for _ in sgd_epochs(route, data, **kw):  # φ, ψ and V: the personalized route has no C
                yield Predictor(route, get_params(route))
        elif budget.method == "lp":
            route.eval()
            with torch.no_grad():
                feats = route.cov(net.features(data.x[data.train]), route.cond)
            on_feats = ClientData(data.cid, feats, data.y[data.train], torch.arange(len(feats), device=feats.device),
                                  data.val[:0], data.prior)  # fmt: skip
            head = set(net.state_keys(net.head_blocks()))
            trainable = [p for k, p in net.named_parameters() if k in head]
            fixed = {k: v for k, v in start.items() if k.removeprefix(NET) not in head}
            for _ in sgd_epochs(net, on_feats, params=trainable, forward=net.classify, **kw):
                yield Predictor(route, {**fixed, **prefixed(NET, get_params(net, sorted(head)))},
                                feature_key=("gpfl-body", Same(server)))  # fmt: skip
        else:
            raise ValueError(f"unknown personalization method {budget.method!r}")
