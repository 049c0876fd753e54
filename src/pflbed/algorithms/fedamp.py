"""FedAMP — Huang, Chu, Zhou, Wang, Liu, Pei & Zhang, "Personalized Cross-Silo Federated Learning on Non-IID Data",
AAAI 2021 (arXiv 2007.03797): federated attentive message passing, and its heuristic variant HeurFedAMP.

Every client i has its own model w_i; there is no global model. The objective couples the clients pairwise through
an attention-inducing function A:

    min_W  G(W) = Σ_i F_i(w_i) + λ Σ_{i<j} A(‖w_i − w_j‖²),      A(x) = 1 − exp(−x/σ)

(A increasing, concave, A(0) = 0, A'(x) = exp(−x/σ)/σ ≤ A'(0) = 1/σ). FedAMP alternates a gradient step on the
attention term with a proximal step on the losses (Algorithm 1):

    U^k = W^{k−1} − α_k ∇A(W^{k−1})                                         (server: message passing)
    w_i^k = argmin_w  F_i(w) + λ/(2α_k) · ‖w − u_i^k‖²                       (client i)

Written out per client, the server's step is the personalized cloud model

    u_i^k = ξ_ii w_i^{k−1} + Σ_{j≠i} ξ_ij w_j^{k−1},   ξ_ij = α_k · A'(‖w_i^{k−1} − w_j^{k−1}‖²)  (j ≠ i),
    ξ_ii = 1 − Σ_{j≠i} ξ_ij,

a convex combination as long as ξ_ii ≥ 0: a client close to i passes it more of its model (A' decreases). Here
the weights are exactly these, as the paper writes the expansion (the factor 2 of ∂/∂w_i ‖w_i − w_j‖² is absorbed
into α_k). They ignore the data sizes: with σ → ∞, α_k = σ/N and λ = 0 every ξ_ij is 1/N and a round is FedAvg
with equal weights (tested). The squared distance runs over all trainable parameters, flattened together, in
float64; u_i mixes every floating-point tensor of the state with the same weights (BatchNorm running statistics
too), integer buffers (BatchNorm's batch counter) take the maximum.

HeurFedAMP (`variant: heur`, the paper's heuristic for deep networks, where Euclidean distances in high dimension
discriminate poorly): the self weight ξ_ii is a fixed hyper-parameter (`self_weight`) and the others share the rest
by a softmax of scaled cosine similarities (σ: `heur_sigma`),

    ξ_ij = (1 − ξ_ii) · exp(σ·cos(w_i, w_j)) / Σ_{h≠i} exp(σ·cos(w_i, w_h)),

the cosine over the flattened trainable parameters (0 against an all-zero model). A client alone in its pool keeps
its own model (u_i = w_i). The client step is the same (λ/α_k still sets its pull).

Client: `train.local_epochs` epochs of mini-batch SGD (`train.*`) on CE + μ/2·‖w − u_i‖² with μ = λ/α_k
(`local_sgd.RegularizedObjective`, over the trainable parameters), the approximate solution of the proximal step. Local
training starts from u_i, the anchor itself: the argmin does not depend on the start, and the client then needs
nothing but its payload (its state is only its id). The reply is w_i. Plain SGD is stable on the proximal term for
train.lr · λ/α_k < 2; beyond, the run diverges (reported as such).

Reference code: the authors published none. PFLlib's reimplementation (TsingZ0/PFLlib, `serveramp.py`,
`clientamp.py`) differs from this file in three ways, so its numbers are not ours: its local SGD starts from the
client's own w_i^{k−1}, not from u_i (with a few epochs of SGD the start matters, though the exact argmin does not);
its u_i mixes the parameters only, so a client keeps its own BatchNorm statistics; and its proximal term is built
from detached tensors, so it carries no gradient and the client trains on cross-entropy alone. Its defaults are
α_k = λ = σ = 1 (ours α_k = λ = 0.01, σ = 1: the same pull μ = 1, neighbour weights 100× smaller).

Server: it keeps every client's latest uploaded model under `local/{cid}/{param}` and, in configure, builds u_i for
each client of the round from the stored models; the aggregate only stores the replies.

Choices (Algorithm 1 updates every client in every iteration and leaves these open):
  (a) Partial participation (`federation.sample_fraction` < 1): the models that enter u_i are those of the clients
      that have uploaded at least once (their latest model, however old), plus client i's own — the initial model
      w^0 while it has never trained. A client that never trained passes no message: its "model" would be w^0, a
      phantom pulling everyone back to the start. Round 1 therefore sends w^0 to every client (any mix of one
      common initial model is that model); with full participation every later u_i is the paper's. P-FL scores
      each client's stored w_i (w^0 for a client never sampled).
  (b) A negative self weight (Σ_{j≠i} ξ_ij > 1: α_k too large for σ and the number of clients) would make u_i an
      extrapolation, not a combination. Nothing is clipped or renormalized. `weight_check: bound` (default)
      refuses, before the run starts, any setting where it can happen: since A' ≤ 1/σ, α_k·(N − 1)/σ ≤ 1 (N
      participated clients) guarantees ξ_ii ≥ 0 whatever the distances. `weight_check: each_round` allows any α_k,
      σ and checks every row instead: the round in which some ξ_ii turns negative stops with a config error naming
      the fixes (lower `alpha_k`, raise `sigma`, `variant: heur`). Rounding below 1e-12 is taken as 0.
  (c) New clients (the paper defines none): zero-shot, the uniform mean of the stored client models (w^0 if none
      has uploaded); FT/LP fine-tune from it (`training.finetune_epochs`). No generic model: G-FL is null and
      `eval.finetune` does not apply.
  - α_k is constant over the rounds (`alpha_k`; the paper allows a schedule).

Defaults: λ enters only through the client's pull μ = λ/α_k, α_k also through the scale α_k/σ of the weights, and
σ sets which distances count as near. ‖w_i − w_j‖² grows with the model, so values tuned on the paper's networks do
not carry over; the defaults fit this library's models: `sigma` σ = 1 (measured between clients of the zoo's small
models after 1–3 local epochs from a common start: 0.02–0.6 for `cnn` on digits, 0.5–12 for `mlp` on synthetic),
`alpha_k` α_k = 0.01 (at most 0.01 per other client: valid under the bound for up to 101 clients), `lam` λ = 0.01
(μ = 1, a FedProx-strength pull). HeurFedAMP: `self_weight` 0.5 and `heur_sigma` 10. Choose them on validation.

Communication: down one model per client (u_i), up one model.

Site-local runs (`sites.local`): a site evaluating its clients receives, of the server state, only their own stored
models `local/<cid>/` (`client_entries`): a client's P-FL model is its own upload, and with no generic model there
is no final +FT/+LP on the sites. Another client's stored model never reaches a site as such: only mixed into u_i,
the training payload, by design.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from pflbed.algorithms.base import Algorithm, Budget, ClientData, Context, Predictor, Tensors
from pflbed.algorithms.local_sgd import LocalSGDPlan, Phase, RegularizedObjective
from pflbed.algorithms.reply_shapes import Spec, misfit, specs
from pflbed.algorithms.training import WeightedMean, finetune_epochs
from pflbed.errors import ConfigError
from pflbed.search import Search, Space

LOCAL = "local/"  # the server's copy of client c's latest upload: local/<cid>/<state key>
ROUNDING = 1e-12  # a self weight this far below 0 is rounding of ξ_ii = 0, not a negative weight


class FedAMPOptions(BaseModel):
    search: ClassVar[dict[str, Space]] = {"alpha_k": Search(1e-3, 1.0, log=True), "lam": Search(1e-3, 1.0, log=True),
                                            "sigma": Search(0.1, 1e5, log=True)}  # fmt: skip
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    variant: Literal["amp", "heur"] = Field("amp", description="amp: FedAMP's A'-weights; heur: HeurFedAMP's "
                                            "cosine-softmax weights with a fixed self weight")  # fmt: skip
    alpha_k: float = Field(0.01, gt=0, description="α_k: step of the message passing (ξ_ij = α_k·A'(d_ij)); the "
                           "client's proximal pull is lam/alpha_k")  # fmt: skip
    lam: float = Field(0.01, ge=0, description="λ: weight of the attention term; client objective "
                       "F_i(w) + λ/(2α_k)·‖w − u_i‖²")  # fmt: skip
    sigma: float = Field(1.0, gt=0, description="σ of A(x) = 1 − exp(−x/σ), x = ‖w_i − w_j‖² (variant amp)")
    weight_check: Literal["bound", "each_round"] = Field("bound", description="bound: refuse settings where a self "
                                                         "weight can turn negative (α_k·(N − 1)/σ > 1); each_round: "
                                                         "check every row, error in the round it happens")  # fmt: skip
    self_weight: float = Field(0.5, ge=0, le=1, description="ξ_ii of HeurFedAMP (variant heur)")
    heur_sigma: float = Field(10.0, gt=0, description="σ scaling the cosine similarities in HeurFedAMP's softmax")


def sq_distance(a: Tensors, b: Tensors, keys: list[str]) -> float:
    """‖a − b‖² over `keys` (the trainable parameters, flattened together), in float64."""
    return float(sum(((a[k].double() - b[k].double()) ** 2).sum() for k in keys))


def cosine(a: Tensors, b: Tensors, keys: list[str]) -> float:
    """cos(a, b) over `keys`, flattened together, in float64 (0 when either vector is zero)."""
    dot = float(sum((a[k].double() * b[k].double()).sum() for k in keys))
    na = math.sqrt(float(sum((a[k].double() ** 2).sum() for k in keys)))
    nb = math.sqrt(float(sum((b[k].double() ** 2).sum() for k in keys)))
    return dot / (na * nb) if na > 0 and nb > 0 else 0.0


def amp_row(i: int, dist: dict[int, float], alpha_k: float, sigma: float) -> tuple[dict[int, float], float]:
    """FedAMP's weights of client i over the pool (`dist`: j → ‖w_i − w_j‖², i included), and Σ_{j≠i} ξ_ij.

    ξ_ij = α_k·A'(d_ij) = α_k·exp(−d_ij/σ)/σ for j ≠ i, ξ_ii = 1 − Σ_{j≠i} ξ_ij (possibly negative: the caller checks).
    """
    row = {j: alpha_k * math.exp(-d / sigma) / sigma for j, d in dist.items() if j != i}
    others = math.fsum(row.values())
    row[i] = 1.0 - others
    return dict(sorted(row.items())), others


def heur_row(i: int, cos: dict[int, float], sigma: float, self_weight: float) -> dict[int, float]:
    """HeurFedAMP's weights of client i over the pool (`cos`: j → cos(w_i, w_j), i included): ξ_ii fixed, the rest
    shared by softmax(σ·cos) over j ≠ i. Alone in the pool, i keeps its own model."""
    others = {j: sigma * c for j, c in cos.items() if j != i}
    if not others:
        return {i: 1.0}
    top = max(others.values())
    e = {j: math.exp(s - top) for j, s in others.items()}  # shifted: the same softmax, no overflow
    total = math.fsum(e.values())
    row = {j: (1.0 - self_weight) * v / total for j, v in e.items()}
    row[i] = self_weight
    return dict(sorted(row.items()))


class FedAMP(Algorithm):
    name = "fedamp"
    dp_refused = (
        "the server builds each client's model from every other client's model one by one (attention "
        "over pairs of models), not from their mean"
    )
    Config = FedAMPOptions
    client_entries = rf"{LOCAL}(\d+)/"

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.params = [k for k, _ in ctx.model.named_parameters()]
        self.mu = self.opts.lam / self.opts.alpha_k
        self.objective = RegularizedObjective(self.params, self.mu, anchor="")  # one function: plans batch together
        self._mean_cache: tuple[Tensors, Tensors] | None = None  # (server state, its mean model)
        o, n = self.opts, len(ctx.federation.participated)
        bound = o.alpha_k * (n - 1) / o.sigma
        if o.variant == "amp" and o.weight_check == "bound" and bound > 1:
            raise ConfigError(
                f"algorithm.alpha_k: fedamp's self weights ξ_ii = 1 − α_k·Σ_j A'(‖w_i − w_j‖²) can turn negative: "
                f"alpha_k·(N − 1)/sigma = {o.alpha_k:g}·{n - 1}/{o.sigma:g} = {bound:.4g} > 1 with N = {n} "
                f"participated clients; lower algorithm.alpha_k, raise algorithm.sigma, use algorithm.variant=heur, "
                f"or set algorithm.weight_check=each_round to stop only in a round where one does"
            )

    # --- the stored models -----------------------------------------------------------------------------------
    @staticmethod
    def uploaded(server: Tensors) -> list[int]:
        """The clients whose latest upload the server holds, in id order."""
        return sorted({int(k[len(LOCAL) :].split("/", 1)[0]) for k in server if k.startswith(LOCAL)})

    def stored(self, server: Tensors, cid: int) -> Tensors:
        """Client `cid`'s latest upload; the initial model w^0 (the very dict) while it has never trained."""
        prefix = f"{LOCAL}{cid}/"
        if prefix + self.params[0] not in server:
            return self.ctx.initial_params
        return {k: server[prefix + k] for k in self.ctx.initial_params}

    def weights(self, rnd: int, i: int, models: dict[int, Tensors], cache: dict | None = None) -> dict[int, float]:
        """Client i's row ξ_i· over the pool `models` (i included), checked for a negative self weight. `cache`
        keeps the symmetric pair figures (distance, cosine) of one configure call: each pair is computed once."""
        o, cache = self.opts, {} if cache is None else cache

        def pair(fn, j: int) -> float:
            key = (fn.__name__, min(i, j), max(i, j))
            if key not in cache:
                cache[key] = fn(models[i], models[j], self.params)
            return cache[key]

        if o.variant == "heur":
            return heur_row(i, {j: 1.0 if j == i else pair(cosine, j) for j in models}, o.heur_sigma, o.self_weight)
        row, others = amp_row(i, {j: 0.0 if j == i else pair(sq_distance, j) for j in models}, o.alpha_k, o.sigma)
        if row[i] < -ROUNDING:
            raise ConfigError(
                f"algorithm.alpha_k: fedamp round {rnd}, client {i}: Σ_j≠i ξ_ij = {others:.6g} > 1, so the self "
                f"weight ξ_ii = {row[i]:.6g} is negative (u_i would extrapolate); lower algorithm.alpha_k, raise "
                f"algorithm.sigma (alpha_k·(N − 1)/sigma ≤ 1 rules it out), or use algorithm.variant=heur"
            )
        row[i] = max(row[i], 0.0)
        return row

    @staticmethod
    def mix(models: dict[int, Tensors], row: dict[int, float]) -> Tensors:
        """Σ_j ξ_ij·w_j per floating-point tensor (integer buffers: the maximum), j in id order."""
        agg = WeightedMean(row)
        for j in row:
            agg.add(j, models[j])
        return agg.result()

    def cloud_model(self, rnd: int, server: Tensors, i: int, cache: dict | None = None) -> Tensors:
        """u_i from the stored models of the clients that have uploaded, plus i's own (choice (a))."""
        models = {j: self.stored(server, j) for j in sorted({*self.uploaded(server), i})}
        return self.mix(models, self.weights(rnd, i, models, cache))

    # --- federation ------------------------------------------------------------------------------------------
    def init_server(self) -> Tensors:
        return {}

    def init_client(self, cid: int) -> Tensors:
        return {"cid": torch.tensor(cid, device=self.ctx.device)}

    def configure(self, rnd: int, server: Tensors, cids: list[int]) -> dict[int, Tensors]:
        cache: dict = {}  # pair figures shared by the round's rows
        return {c: self.cloud_model(rnd, server, c, cache) for c in cids}

    def sgd_plan(self, payload: Tensors, state: Tensors, data: ClientData) -> LocalSGDPlan:
        """w_i ≈ argmin F_i(w) + λ/(2α_k)·‖w − u_i‖²: SGD on CE + μ/2·‖w − u_i‖², μ = λ/α_k, from u_i (a plan: the
        batched executor trains a round's clients together, each anchored at its own u_i)."""
        t = self.ctx.cfg.train
        phase = Phase(tuple(self.ctx.model.block_names()), t.local_epochs, t.lr)
        return self.objective.plan(payload, payload, phase, lambda params: (params, dict(state)))

    def aggregate(self, rnd: int, server: Tensors, replies: dict[int, Tensors], weights: dict[int, float]) -> Tensors:
        """Store each reply as its client's latest model; clients that did not reply keep theirs."""
        out = dict(server)
        for c in sorted(replies):
            out.update({f"{LOCAL}{c}/{k}": v for k, v in replies[c].items()})
        return out

    def view_groups(self, cids: list[int]) -> list[dict[str, Spec]]:
        """Each client's stored model `local/<cid>/` (every entry of the run's model), once it has uploaded."""
        model = specs(self.ctx.initial_params)
        return [{f"{LOCAL}{c}/{k}": s for k, s in model.items()} for c in cids]

    def reply_fits(self, payload: Tensors, reply: Tensors) -> str | None:
        """None if `reply` is what a client replies to `payload` — its new model, every entry of u_i as sent — else
        why not. The server stores it as the client's model, which every later u_j mixes in: an entry of another
        shape or dtype would break, or change the dtype of, the other clients' payloads."""
        return misfit(reply, specs(payload))

    # --- evaluation and new clients --------------------------------------------------------------------------
    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        return Predictor(self.ctx.model, self.stored(server, int(state["cid"])))

    def mean_model(self, server: Tensors) -> Tensors:
        """The uniform mean of the stored client models (w^0 if none has uploaded): a new client's start."""
        if self._mean_cache is not None and self._mean_cache[0] is server:
            return self._mean_cache[1]
        cids = self.uploaded(server)
        mean = self.mix({c: self.stored(server, c) for c in cids}, dict.fromkeys(cids, 1.0)) if cids else \
            dict(self.ctx.initial_params)  # fmt: skip
        self._mean_cache = (server, mean)
        return mean

    def zero_shot(self, server: Tensors, data: ClientData) -> Predictor | None:
        return Predictor(self.ctx.model, self.mean_model(server))

    def personalize(
        self, server: Tensors, data: ClientData, budget: Budget, generator: torch.Generator
    ) -> Iterator[Predictor]:
        """FT / LP from the mean of the stored client models (the paper defines no new-client procedure)."""
        yield from finetune_epochs(self.ctx.model, self.mean_model(server), data, budget, generator)
