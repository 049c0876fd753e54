"""FedBasis — "Learning Shareable Bases for Personalized Federated Image Classification" (cited by its title: the
version implemented is the double-blind review copy, which names no authors and no venue).

Implemented: §4.1 (Eq. 4–6), §4.2 (Eq. 8–9: coordinate descent and sharpening), §4.4 (layer-wise
combinations, the major basis, the FedAvg/k-means warm start), §6 (setup: K, τ, 5 + 5 local epochs, 30 % warm
start, "the combinations and the whole classifier" for new clients), App. A (Alg. 1 training, Alg. 2 new client),
Table 3 ablations (coordinate descent, major basis, τ), Fig. 2 (collapse diagnostics) and Fig. 4 (α heat-map).

Idea: K shareable *basis* models v_1..v_K of the same architecture plus a major basis v'. A client is a short
vector on the simplex; its model is the layer-wise convex combination
    θ_m = ½·v' + ½·Σ_k α_m[k]·v_k          (without the major basis: θ_m = Σ_k α_m[k]·v_k),
one α per coefficient group (a block of the model). Inference costs one model, whatever K.

Training (Alg. 1 / Eq. 9), after the warm start; each sampled client, each round:
  1. receive V̄ = {v', v_1..v_K}; set ψ = 0 (α uniform: the paper keeps no α between rounds — stateless);
  2. α* = argmin_α L_m(α, V) for `alpha_epochs` epochs of SGD on ψ, V frozen, α = softmax(ψ);
  3. α† = SHARPEN(α*; τ) = softmax(ψ/τ);
  4. V* = argmin_V L_m(α†, V) for `basis_epochs` epochs of SGD on every basis (and v'), α† frozen;
  5. upload V*; the server sets V̄ = (1/M) Σ_m V*_m, basis by basis.
Warm start (§4.4): the first ⌈warmup_fraction·T⌉ rounds are FedAvg; at the end of the last of them v' ← the FedAvg
global model and v_1..v_K ← the centroids of a k-means (K clusters) over the clients' local models of that round.

Options (`algorithm.<key>`; the paper's values are the defaults):
  - `K` (4): non-major bases (paper: 4 for PACS/Office-Home, 8 for GLD). `tau` (0.1): sharpening temperature
    (Table 3 ablation: 1.0 = no sharpening). `major` (True): keep the major basis (ablation: False).
  - `coordinate_descent` (True): Eq. 9. False = the joint update of Eq. 7 (Table 3 "CD ✗"): ψ and V trained together
    for `alpha_epochs + basis_epochs` epochs (the same number of passes), forward with α = softmax(ψ/τ) — the
    ablation keeps τ = 0.1, so the temperature must enter somewhere; it enters the one parameterization there is.
  - `layerwise` (True): one coefficient vector per block of the model that holds parameters or statistics
    (`BlockNet.block_names()`; the paper's "4 ResNet blocks + classifier", §4.4). Deviation: on the zoo's ResNets
    the stem (first convolution and its BatchNorm) is a block with a vector of its own, 6 vectors where the paper
    counts 5 (it does not say which vector the stem takes). False: a single vector for the whole network (Eq. 4
    as first written).
  - `alpha_epochs`, `basis_epochs` (5, 5): they *replace* `train.local_epochs` in the FedBasis rounds;
    `train.local_epochs` is used by the FedAvg warm-up rounds only (the paper's setup trains 5 local epochs there:
    set `train.local_epochs=5` to reproduce it).
  - `alpha_lr` (None → `train.lr`): SGD learning rate of ψ. V uses `train.lr`, `train.momentum`,
    `train.weight_decay`; ψ uses `train.momentum` and no weight decay (a decay on ψ would be a pull towards
    uniform α, a regularizer the paper explicitly drops, §4.1).
  - `warmup_fraction` (0.3): share of `train.rounds` run as FedAvg (0: no warm start, see below).
  - `kmeans_iters` (50): Lloyd iterations of the warm-start k-means (it stops earlier once stable).
  - `aggregation` ("uniform"): V̄ = (1/M) Σ_m V_m over the clients of the round, as Eq. 7/9 and Alg. 1 line 10
    write it; "weighted" uses the engine's |D_m| weights instead. (The FedAvg warm-up is always |D_m|-weighted,
    Eq. 2.)
  - `bn_stats` ("track"): how BatchNorm running statistics are learned; see below. "frozen": never updated locally.

Interpretations (the paper leaves these open):
  - SHARPEN. §4.2 defines α[k] = exp(ψ[k]/τ)/Σ exp(ψ[k']/τ) as "a softmax function sharpened with a temperature";
    Eq. 9 applies SHARPEN as a separate step 3 "artificially and temporally" while computing ∇V. Read together:
    step 2 learns ψ through the plain softmax α = softmax(ψ), and step 3 is α† = softmax(ψ/τ) =
    α^{1/τ}/Σ α^{1/τ} (`basis.sharpen`). τ = 1 then means "no sharpening", as in Table 3. (The other reading,
    softmax(ψ/τ) already in step 2, would sharpen twice — softmax(ψ/τ²) — in step 3.)
  - What a client keeps: its last α† (client state `alpha`, shape (groups, K)) and α* (`alpha_star`, for the
    entropy diagnostic; equal to α† in the joint update, which learns softmax(ψ/τ) directly). Both are outputs,
    never inputs: the next round re-initializes ψ = 0 (Alg. 1 line 4).
    A participated client's personal model (P-FL) is the combination with its α† — the coefficients its last
    basis update was made with. A client that never trained after the warm start gets the uniform combination.
  - The combined model is formed per mini-batch (App. A: "only needs to be generated per mini-batch") and run with
    `torch.func.functional_call` on the shared `ctx.model`: no model copy per client, and the template's own
    parameters are never read or written (the call swaps in the combined tensors); its BatchNorm buffers hold the
    combined statistics during a client's update and are put back after it.
  - Eq. 9 is a plan (`sgd_plan`): the ψ step and the V step are two phases over the bases (`v.`, `m.`, their
    statistics `vs.`, `ms.`) and ψ, on `basis.CombinedObjective`, whose hooks combine the statistics before each
    step and hand their update back after it; so `executor.batch_clients` trains a round's clients together.
    The V step trains the bases through an exact reparameterization (`basis.v_step_theta`): with α† fixed every
    basis stays v_i = a·v_i⁰ + c_i·U under SGD with momentum and weight decay, so SGD runs on one model-sized
    step P = S·U (S = Σ_i c_i²) and the scalar decay a, and the bases are formed from them once, at the end
    (`basis.trained_bases`): the same SGD on every basis up to float rounding (tested against it written out),
    on one model's tensors, gradients and momenta per client instead of K + 1. The bases V⁰ themselves are
    built once per round's payload (`payload_tensors`), so batched clients hold them once for all, not K + 1
    models a client (`engine.batched`). The joint update
    (`coordinate_descent: false`) runs client by client: ψ without and V with weight decay in one step is not a
    plan's phase.
  - BatchNorm: affine γ, β are parameters and are combined like weights. Running mean/var are combined the same
    way (with α detached: they are statistics, not trained) into fresh tensors per batch, so a training forward
    updates only those copies. `bn_stats="track"` then hands each batch's update Δ of the combined statistic back
    to the bases in proportion to their coefficients c_i (½ for v', ½·α†[k] for v_k): Δv_i = c_i·Δ / Σ_j c_j²
    (`basis.stat_update_shares`), the smallest change of the bases under which the combination follows exactly the
    EMA a single model would have; a basis with α†[k] = 0 keeps its statistics, like its weights (∇v_k = 0). A
    running variance is floored at 0 afterwards. This happens in the V step (and the joint update) only: in the ψ
    step V — statistics included — is frozen, and new-client personalization never changes the bases. Batch
    counters (integers) are not combined; every basis counts the batches of its clients. With "frozen" the
    bases keep the statistics of the warm start.
  - Weight decay (`train.weight_decay`) applies to every basis in the V step, also to a basis the client does not
    use (standard SGD weight decay over the trained tensors).
  - Warm start: k-means runs on the local models of the last warm-up round, over the flattened *parameters*
    (BatchNorm statistics would dominate the distances without being learned), unweighted (§4.4: "cluster
    {θ_m} into K clusters"); a centroid is the plain mean of its members' full state dicts (statistics
    included; integer counters take the maximum, as `weighted_mean`). k-means++ seeding from a generator derived
    from (seed, round) — `aggregate` has no client generator — and clusters are numbered by their lowest client
    id, so the result does not depend on the seeding order. If the last warm-up round sampled fewer than K clients,
    the local models of the preceding warm-up rounds are pooled too (the latest model of each client), back to as
    many rounds as K distinct clients need; the server state carries them (`pool<cid>.*`) until the switch. A
    configuration whose warm-up never trains K distinct clients is a config error. Without the major basis the
    FedAvg global model is discarded at the switch.
  - `warmup_fraction = 0`: no local models to cluster, so v' = the initial model and the K bases are independent
    random initializations of the architecture (seeds derived from the run seed): K identical bases would receive
    identical gradients and never separate.
  - Generic model (G-FL), zero-shot model of a new client and the start of every personalization: the uniform
    combination α = 1/K (Alg. 2 line 1). It is the model of a client about which nothing is known yet — the one
    Alg. 2 starts every new client from; the major basis alone is never trained as a standalone model (only as
    half of a combination), so it is not offered. During the warm-up: the FedAvg global model.
  - New clients (Alg. 2; `personalize`), bases frozen: `budget.method="ft"` learns ψ (α = softmax(ψ), unsharpened,
    as Alg. 2 line 2–3 write it) *and the whole classifier* — the head blocks become free parameters initialized
    from the uniform combination ("we learn the combinations and the whole classifier", §6, the paper's
    FedBasis row of Table 2); the head's own α group then has no effect. `"lp"` learns ψ only — Alg. 2 literally,
    G·K numbers per client (FedBasis has no linear probe; the coefficient-only adaptation is its parameter-light
    counterpart). One SGD optimizer (`budget.momentum`) for ψ and head, kept across epochs: the head at `budget.lr`,
    ψ at `budget.lr · alpha_lr / train.lr` — the ratio ψ was trained with, so an LR sweep scales both alike. (ψ at
    the weights' lr barely moves: ∂L/∂ψ_k = α_k·(v_k − θ)·∇_θL is small when the bases are close, which is why
    `alpha_lr` exists; measured on fmnist-rot4, see the results pages, docs/results/fedbasis.md.) After
    every epoch the combination is materialized into one ordinary state dict of `ctx.model` (a fresh snapshot).
    BatchNorm statistics of that model are the bases' combined with the current α (the bases are frozen).
    `eval.finetune` (FedBasis+FT/LP on participated clients) runs the same procedure, from uniform α.
  - Before the switch (or if the whole run is warm-up) the client update, personalization and models are FedAvg's.

Wire format: server / payload / reply keys `major.<key>` and `basis<k>.<key>` (k = 0..K−1), full state dicts, so a
FedBasis round sends K+1 models each way (App. A: "communications K times more"); warm-up payloads and replies are
plain FedAvg state dicts. Client state: `alpha` (α†) and `alpha_star` (α*), each (groups, K).

Diagnostics (`diag`, every evaluation): `basis_cos` — mean pairwise cosine similarity of the K non-major bases'
flattened parameters (and per block, `basis_cos_blocks`); `alpha_entropy` / `alpha_sharp_entropy` — mean entropy
(nats) of α* / α† over the participated clients that have one and over groups, with `alpha_entropy_max` = log K
(the collapse signals of Fig. 2). Artifacts: the final mixing weights per client × block (Fig. 4: major basis
first), clients ordered by domain then id, as PNG heat-map and CSV.

Site-local runs (`sites.local`): a site evaluating its clients receives the bases (or, in the warm-up, the FedAvg
model) and, of the local models the warm-up pools for k-means (`pool<cid>.<key>`), only its own clients'
(`client_entries`): evaluation and the final +FT/+LP read the bases and each client's own α, never the pool.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from pflbed import rng
from pflbed.algorithms.base import Algorithm, Budget, ClientContext, ClientData, Context, Predictor, Tensors
from pflbed.algorithms.basis import (
    BASES_M,
    BASES_V,
    DECAY,
    PSI,
    STATS_M,
    STATS_V,
    STEP,
    CombinedObjective,
    collapse_diagnostics,
    combine,
    detached,
    kmeans_bases,
    sgd_through_combination,
    sharpen,
    stack_bases,
    trainable_copies,
    trained_bases,
)
from pflbed.algorithms.basis_plots import mixing_table, write_mixing_weights
from pflbed.algorithms.local_sgd import LocalSGDPlan, Phase, run_plan
from pflbed.algorithms.reply_shapes import UNSENT, Spec, misfit, specs
from pflbed.algorithms.sgd import SGD
from pflbed.algorithms.training import finetune_epochs, get_params, weighted_mean
from pflbed.errors import ConfigError
from pflbed.federation import sample_clients
from pflbed.search import IntSearch, Search, Space, same_as

STREAM = 0xFBA5  # FedBasis's own random streams (not one of pflbed.rng's tags): 0 random bases, 1 k-means
MAJOR, BASIS, POOL = "major.", "basis", "pool"


class FedBasisOptions(BaseModel):
    """FedBasis options; defaults are the paper's setup (§6)."""

    model_config = ConfigDict(extra="forbid")
    search: ClassVar[dict[str, Space]] = {"K": IntSearch(2, 8), "tau": Search(0.02, 1.0, log=True)}
    K: int = Field(4, ge=1, description="number of non-major bases")
    tau: float = Field(0.1, gt=0, le=1, description="sharpening temperature (1: no sharpening)")
    major: bool = Field(True, description="keep the major basis: θ = ½·v' + ½·Σ α_k v_k")
    coordinate_descent: bool = Field(True, description="Eq. 9 (ψ, then V); False: joint update (Eq. 7)")
    layerwise: bool = Field(True, description="one coefficient vector per model block (False: one in all)")
    alpha_epochs: int = Field(5, ge=0, description="local epochs of the ψ step (replaces train.local_epochs)")
    basis_epochs: int = Field(5, ge=0, description="local epochs of the V step (replaces train.local_epochs)")
    alpha_lr: float | None = Field(None, gt=0, description="SGD lr of ψ (None: train.lr)",
                                   json_schema_extra=same_as("train.lr"))
    warmup_fraction: float = Field(0.3, ge=0, le=1, description="share of rounds run as FedAvg warm start")
    kmeans_iters: int = Field(50, ge=1, description="Lloyd iterations of the warm-start k-means")
    aggregation: Literal["uniform", "weighted"] = Field("uniform", description="basis mean: 1/M or |D_m|-weighted")
    bn_stats: Literal["track", "frozen"] = Field(
        "track", description="BatchNorm running statistics: tracked back into the bases, or never updated"
    )


class FedBasis(Algorithm):
    name = "fedbasis"
    dp_refused = (
        "each client's update of the bases is weighted by its personal coefficients, which the server "
        "reads client by client"
    )
    Config = FedBasisOptions
    opts: FedBasisOptions
    client_entries = rf"{POOL}(\d+)\."

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        o, model = self.opts, ctx.model
        self.keys = list(model.state_dict())
        named = {k for k, _ in model.named_parameters()}
        self.param_keys = [k for k in self.keys if k in named]
        self.buffer_keys = [k for k in self.keys if k not in named]
        # a block with no state (a ResNet's pooling) has nothing to combine: a row of its own got no gradient and
        # stayed uniform, read by the entropies as collapse and drawn in Fig. 4 as a block of uniform weights
        blocks = [b for b in model.block_names() if model.state_keys([b])]
        self.groups = blocks if o.layerwise else ["all"]
        self.group_of = {k: (gi if o.layerwise else 0) for gi, b in enumerate(blocks) for k in model.state_keys([b])}
        block_of = {k: b for b in model.block_names() for k in model.state_keys([b])}
        self.block_params = {b: [k for k in self.param_keys if block_of[k] == b] for b in model.block_names()}
        self.var_keys = {f"{n}.running_var" for n, m in model.named_modules()
                         if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_var is not None}  # fmt: skip
        head = set(model.state_keys(model.head_blocks()))
        self.head_param_keys = [k for k in self.param_keys if k in head]
        rounds = ctx.cfg.train.rounds
        self.warmup_rounds = math.ceil(round(o.warmup_fraction * rounds, 9))
        self.pool_from = self._pool_start() if self.warmup_rounds > 0 else 0
        self._cache: tuple[Tensors, tuple[Tensors, Tensors | None] | None, dict[str, Tensors]] | None = None
        self.named = named
        track = o.bn_stats == "track"  # one objective per step kind: clients' plans batch together
        self.softmax, self.sharpened, self.given = (
            CombinedObjective(self.param_keys, self.buffer_keys, self.group_of, self.var_keys, alpha=a, tau=o.tau,
                              track=track and a != "softmax")  # fmt: skip
            for a in ("softmax", "sharpened", "given"))

    @property
    def alpha_lr(self) -> float:
        return self.opts.alpha_lr if self.opts.alpha_lr is not None else self.ctx.cfg.train.lr

    def _pool_start(self) -> int:
        """First warm-up round whose local models feed the k-means: enough trailing rounds for K distinct clients."""
        cfg, fed, k = self.ctx.cfg, self.ctx.federation, self.opts.K
        seen: set[int] = set()
        for r in range(self.warmup_rounds, 0, -1):
            seen |= set(sample_clients(cfg.seed, r, fed.participated, cfg.federation.sample_fraction,
                                       cfg.poisson_sampling()))
            if len(seen) >= k:
                return r
        fewer = f"choose K <= {len(seen)}, or " if seen else ""  # K >= 1: with no client, only more rounds help
        raise ConfigError(
            f"algorithm.K: the warm start clusters local models into K = {k} bases, but only {len(seen)} distinct "
            f"clients train in the {self.warmup_rounds} warm-up rounds; {fewer}raise algorithm.warmup_fraction or "
            "federation.sample_fraction"
        )

    # --- state layout ------------------------------------------------------------------------------------------
    def _sub(self, tensors: Tensors, prefix: str) -> Tensors:
        return {k: tensors[prefix + k] for k in self.keys}

    @staticmethod
    def has_bases(tensors: Tensors) -> bool:
        """Whether a server state / payload is past the warm start (holds the non-major bases)."""
        return any(k.startswith(f"{BASIS}0.") for k in tensors)

    def split(self, tensors: Tensors) -> tuple[Tensors, Tensors | None]:
        """(stacked non-major bases {key: (K, …)}, major basis or None) of a server state or payload."""
        stacked = stack_bases([self._sub(tensors, f"{BASIS}{i}.") for i in range(self.opts.K)], self.keys)
        return stacked, (self._sub(tensors, MAJOR) if self.opts.major else None)

    def join(self, stacked: Tensors, major: Tensors | None) -> Tensors:
        """The wire form of (stacked bases, major): prefixed flat keys, independent contiguous tensors."""
        out: Tensors = {}
        if major is not None:
            out.update({MAJOR + k: major[k].detach().clone() for k in self.keys})
        for i in range(self.opts.K):
            out.update({f"{BASIS}{i}.{k}": stacked[k][i].detach().clone() for k in self.keys})
        return out

    def _memo(self, server: Tensors) -> tuple[Tensors, tuple[Tensors, Tensors | None] | None, dict[str, Tensors]]:
        """(server, its split or None during the warm-up, memo), cached for the server object evaluated last
        (evaluation asks once per client)."""
        if self._cache is None or self._cache[0] is not server:
            self._cache = (server, self.split(server) if self.has_bases(server) else None, {})
        return self._cache

    def _parts(self, server: Tensors) -> tuple[Tensors, Tensors | None]:
        """`split(server)` of a server state past the warm start, cached."""
        parts = self._memo(server)[1]
        assert parts is not None, "the server state has no bases yet (warm-up)"
        return parts

    def uniform(self) -> torch.Tensor:
        k = self.opts.K
        return torch.full((len(self.groups), k), 1.0 / k, device=self.ctx.device)

    def materialize(
        self, stacked: Tensors, major: Tensors | None, alpha: torch.Tensor, override: Tensors | None = None
    ) -> Tensors:
        """θ(α, V) as one ordinary state dict of `ctx.model` (inference = one model), `override` keys replaced."""
        with torch.no_grad():
            theta = combine(stacked, alpha.detach(), self.group_of, major, self.keys)
        for k, v in (override or {}).items():
            theta[k] = v.detach().clone()
        return theta

    # --- federation --------------------------------------------------------------------------------------------
    def init_server(self) -> Tensors:
        initial = self.ctx.initial_params
        if self.warmup_rounds > 0:
            return {MAJOR + k: v.clone() for k, v in initial.items()}
        bases = []
        for i in range(self.opts.K):  # independent random initializations, off the global RNG
            with rng.fork(self.ctx.device):
                torch.manual_seed(rng.derive_seed(self.ctx.seed, STREAM, 0, i))
                bases.append(get_params(self.ctx.new_model()))
        return self.join(stack_bases(bases, self.keys), dict(initial) if self.opts.major else None)

    def configure(self, rnd: int, server: Tensors, cids: list[int]) -> dict[int, Tensors]:
        if self.has_bases(server):
            payload = {k: v for k, v in server.items() if k.startswith((MAJOR, BASIS))}
        else:
            payload = self._sub(server, MAJOR)  # warm-up: a plain FedAvg model
        return dict.fromkeys(cids, payload)

    def client_update(
        self, payload: Tensors, state: Tensors, data: ClientData, cctx: ClientContext
    ) -> tuple[Tensors, Tensors]:
        plan = self.sgd_plan(payload, state, data)
        if plan is not None:
            return run_plan(self.ctx.model, plan, data, self.ctx.cfg.train, cctx.generator)
        alpha_star, alpha_dag, stacked, major = self.local_round(*self.split(payload), data, cctx.generator)
        return self.join(stacked, major), {"alpha": alpha_dag, "alpha_star": alpha_star}

    def local_round(
        self, stacked: Tensors, major: Tensors | None, data: ClientData, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor, Tensors, Tensors | None]:
        """One client's round of the joint update (Eq. 7, client by client; Eq. 9 is a plan, `sgd_plan`): (α*, α†,
        trained stacked bases, trained major basis)."""
        psi, stacked, major = self.joint_step(stacked, major, data, generator)
        alpha = torch.softmax(psi / self.opts.tau, -1)
        return alpha, alpha, stacked, major

    def sgd_plan(self, payload: Tensors, state: Tensors, data: ClientData) -> LocalSGDPlan | None:
        """A warm-up round: FedAvg's epochs. After it, Eq. 9 as a plan over the bases (`basis.CombinedObjective`):
        the ψ step from ψ = 0 (`alpha_epochs` at `alpha_lr`, no weight decay), then the V step on every basis with
        α† = SHARPEN(softmax(ψ); τ) fixed (`basis_epochs` at `train.lr`); the reply is V, the state α†, α*. None
        for the joint update (`coordinate_descent: false`): ψ without and V with weight decay in one step, which
        a plan's phase (one weight decay) does not express — it runs client by client."""
        t, o = self.ctx.cfg.train, self.opts
        if not self.has_bases(payload):
            every = tuple(self.ctx.model.block_names())
            return LocalSGDPlan(payload, (Phase(every, t.local_epochs, t.lr),), partial(_unchanged, state))
        if not o.coordinate_descent:
            return None
        return LocalSGDPlan(self.payload_tensors(payload), self.phases, self.finish)

    @property
    def phases(self) -> tuple[Phase, Phase]:
        return self.psi_phase, self.basis_phase(self.sharpened)

    @property
    def psi_phase(self) -> Phase:
        """Eq. 9 steps 1–2: `alpha_epochs` epochs of SGD on ψ (`train.momentum`, no weight decay), V frozen."""
        return Phase((), self.opts.alpha_epochs, self.alpha_lr, extra=((PSI, self.alpha_lr),), weight_decay=0.0,
                     objective=self.softmax)  # fmt: skip

    def basis_phase(self, objective: CombinedObjective) -> Phase:
        """Eq. 9 step 4: `basis_epochs` epochs of SGD on every basis and v' (`train.*`), α† fixed — as SGD on the
        step of their combination and the decay of where they started (`basis.v_step_theta`), which follows the
        SGD of every basis exactly, on one model's tensors."""
        lr = self.ctx.cfg.train.lr
        return Phase((), self.opts.basis_epochs, lr, extra=((STEP, lr), (DECAY, lr)), objective=objective)

    def payload_tensors(self, payload: Tensors) -> Tensors:
        """`plan_tensors` of a payload, built once for the payload object the round sends every client
        (`configure`): the same tensors in every client's plan, which batched clients take once for all of them
        (`engine.batched`: K + 1 models a client fewer); the loop trains copies of them (`run_plan`)."""
        memo = self._memo(payload)[2]
        if "plan" not in memo:
            memo["plan"] = self.plan_tensors(*self._parts(payload))
        return memo["plan"]

    def plan_tensors(self, stacked: Tensors, major: Tensors | None) -> Tensors:
        """The bases as a plan's tensors (`basis.CombinedObjective`'s names), ψ = 0 (α uniform: Alg. 1 line 4), and
        the V step's start: step 0, decay 1."""
        out = {BASES_V + k: stacked[k] for k in self.param_keys} | {STATS_V + k: stacked[k] for k in self.buffer_keys}
        if major is not None:
            out |= {BASES_M + k: major[k] for k in self.param_keys} | {STATS_M + k: major[k] for k in self.buffer_keys}
        out |= {STEP + k: torch.zeros_like(stacked[k][0]) for k in self.param_keys}
        dtype = stacked[self.param_keys[0]].dtype
        return {**out, DECAY: torch.ones((), dtype=dtype, device=self.ctx.device),
                PSI: torch.zeros(len(self.groups), self.opts.K, device=self.ctx.device)}  # fmt: skip

    def plan_bases(self, tensors: Tensors, alpha: torch.Tensor) -> tuple[list[Tensors], Tensors | None]:
        """(each non-major basis, the major basis or None) as full state dicts of fresh tensors, after a plan's V
        step with `alpha` (`basis.trained_bases`); their statistics as the plan's hand-back left them."""
        has_major = BASES_M + self.param_keys[0] in tensors
        step = {k: tensors[STEP + k] for k in self.param_keys}
        bases, major = trained_bases({k: tensors[BASES_V + k] for k in self.param_keys},
                                     {k: tensors[BASES_M + k] for k in self.param_keys} if has_major else None,
                                     alpha, step, tensors[DECAY], self.group_of, self.param_keys)  # fmt: skip
        bases = [{k: b[k] if k in self.named else tensors[STATS_V + k][i].clone() for k in self.keys}
                 for i, b in enumerate(bases)]  # fmt: skip
        if major is not None:
            major = {k: major[k] if k in self.named else tensors[STATS_M + k].clone() for k in self.keys}
        return bases, major

    def round_result(self, tensors: Tensors) -> tuple[torch.Tensor, torch.Tensor, list[Tensors], Tensors | None]:
        """(α* = softmax(ψ*), α† = SHARPEN(α*; τ), V* (each basis, the major one)) from a plan's trained tensors."""
        alpha_star = torch.softmax(tensors[PSI], -1)
        alpha_dag = sharpen(alpha_star, self.opts.tau)
        return alpha_star, alpha_dag, *self.plan_bases(tensors, alpha_dag)

    def finish(self, tensors: Tensors) -> tuple[Tensors, Tensors]:
        """Upload V* (its tensors fresh: the reply as they are); keep α† and α*."""
        alpha_star, alpha_dag, bases, major = self.round_result(tensors)
        reply = {MAJOR + k: v for k, v in major.items()} if major is not None else {}
        reply |= {f"{BASIS}{i}.{k}": v for i, b in enumerate(bases) for k, v in b.items()}
        return reply, {"alpha": alpha_dag, "alpha_star": alpha_star}

    def aggregate(self, rnd: int, server: Tensors, replies: dict[int, Tensors], weights: dict[int, float]) -> Tensors:
        """FedBasis rounds: V̄ = mean of the uploaded bases. Warm-up: FedAvg, and the k-means switch at its end."""
        first = replies[next(iter(replies))]
        if self.has_bases(first):
            w = weights if self.opts.aggregation == "weighted" else dict.fromkeys(replies, 1.0)
            return weighted_mean(replies, w)
        glob = weighted_mean(replies, weights)
        out = {MAJOR + k: v for k, v in glob.items()}
        if rnd < self.pool_from:
            return out
        pool = self.pool_of(server)
        pool.update(replies)  # a client's latest local model wins
        if rnd < self.warmup_rounds:
            for c, params in pool.items():
                out.update({f"{POOL}{c}.{k}": params[k] for k in self.keys})
            return out
        return self.switch(glob, pool, rnd)

    def pool_of(self, server: Tensors) -> dict[int, Tensors]:
        """Local models carried in the server state since `pool_from` ({cid: state dict})."""
        cids = sorted({int(k[len(POOL) : k.index(".")]) for k in server if k.startswith(POOL)})
        return {c: self._sub(server, f"{POOL}{c}.") for c in cids}

    def switch(self, glob: Tensors, pool: dict[int, Tensors], rnd: int) -> Tensors:
        """End of the warm start (§4.4): v' ← FedAvg global model, v_k ← k-means centroids of the local models."""
        gen = rng.generator(self.ctx.seed, STREAM, 1, rnd)
        bases = kmeans_bases(pool, self.param_keys, self.keys, self.opts.K, self.opts.kmeans_iters, gen)
        return self.join(bases, glob if self.opts.major else None)

    def payload_fits(self, rnd: int, cid: int, payload: Tensors, state: Tensors) -> str | None:
        """The warm start's FedAvg model in its rounds; after them, the K bases and (with `major`) the major basis,
        each of the model's entries: the structure `switch` gives the server state at the warm start's end."""
        if rnd <= self.warmup_rounds:
            return super().payload_fits(rnd, cid, payload, state)
        return misfit(payload, self.bases_structure(), UNSENT)

    def bases_structure(self) -> dict[str, Spec]:
        """The K bases and (with `major`) the major basis, each of the model's entries: the server state from the
        warm start's end on, and every payload it sends."""
        model = specs(self.ctx.initial_params)
        want = {f"{BASIS}{i}.{k}": s for i in range(self.opts.K) for k, s in model.items()}
        if self.opts.major:
            want.update({MAJOR + k: s for k, s in model.items()})
        return want

    def view_fits(self, view: Tensors, cids: list[int]) -> str | None:
        """With bases, their structure (`bases_structure`); without, the warm start's: its FedAvg model and, held
        whole, the pooled local models of `cids` (`view_groups`)."""
        if self.has_bases(view):
            return misfit(view, self.bases_structure(), UNSENT)
        return super().view_fits(view, cids)

    def view_groups(self, cids: list[int]) -> list[dict[str, Spec]]:
        """The warm start's pooled local model of each client of `cids` (`pool<cid>.`), from `pool_from` on."""
        model = specs(self.ctx.initial_params)
        return [{f"{POOL}{c}.{k}": s for k, s in model.items()} for c in cids]

    def reply_fits(self, payload: Tensors, reply: Tensors) -> str | None:
        """None if `reply` is what a client replies to `payload`, else why not: every entry sent, of its shape and
        dtype — the trained model during the warm start, the trained bases (and major basis) after it. The server
        averages the replies key by key into its state, so a missing key would crash the mean and an extra one
        enter the state."""
        return misfit(reply, specs(payload))

    # --- local training ----------------------------------------------------------------------------------------
    def _run(
        self, params: Callable[[], Tensors], stacked: Tensors, major: Tensors | None, alpha: Callable[[], torch.Tensor],
        opt: SGD, data: ClientData, epochs: int, generator: torch.Generator, track: bool,
        batch_size: int | None = None,
    ) -> None:  # fmt: skip
        """`sgd_through_combination` over this model's keys (see module doc); batch size `train`'s, or `batch_size`
        (personalization budgets)."""
        sgd_through_combination(self.ctx.model, data, params, alpha, stacked, major, opt, epochs=epochs,
                                batch_size=batch_size or self.ctx.cfg.train.batch_size, generator=generator,
                                group_of=self.group_of, buffer_keys=self.buffer_keys, var_keys=self.var_keys,
                                track=track)  # fmt: skip

    def alpha_step(
        self, stacked: Tensors, major: Tensors | None, data: ClientData, gen: torch.Generator
    ) -> torch.Tensor:
        """Eq. 9 steps 1–2 alone (the plan's first phase): ψ after `alpha_epochs` epochs from 0, V frozen."""
        plan = LocalSGDPlan(self.plan_tensors(stacked, major), (self.psi_phase,), lambda t: (t, {}))
        return run_plan(self.ctx.model, plan, data, self.ctx.cfg.train, gen)[0][PSI]

    def basis_step(
        self, stacked: Tensors, major: Tensors | None, alpha: torch.Tensor, data: ClientData, gen: torch.Generator
    ) -> tuple[Tensors, Tensors | None]:
        """Eq. 9 step 4 alone (the plan's second phase, with this α† as a constant): the trained bases."""
        plan = LocalSGDPlan(self.plan_tensors(stacked, major), (self.basis_phase(self.given),),
                            lambda t: (t, {}), consts={"alpha": alpha.detach()})  # fmt: skip
        bases, major = self.plan_bases(run_plan(self.ctx.model, plan, data, self.ctx.cfg.train, gen)[0], alpha)
        return stack_bases(bases, self.keys), major

    def joint_step(
        self, stacked: Tensors, major: Tensors | None, data: ClientData, gen: torch.Generator
    ) -> tuple[torch.Tensor, Tensors, Tensors | None]:
        """Eq. 7 (ablation "no coordinate descent"): ψ and V together, α = softmax(ψ/τ), for both epoch budgets."""
        t, o = self.ctx.cfg.train, self.opts
        psi = torch.zeros(len(self.groups), o.K, device=self.ctx.device, requires_grad=True)
        stacked, major, leaves = trainable_copies(stacked, major, self.param_keys)
        opt = SGD([{"params": [psi], "lr": self.alpha_lr, "weight_decay": 0.0},
                               {"params": leaves, "lr": t.lr, "weight_decay": t.weight_decay}],
                              lr=t.lr, momentum=t.momentum)  # fmt: skip

        def alpha() -> torch.Tensor:
            return torch.softmax(psi / o.tau, -1)

        def params() -> Tensors:
            return combine(stacked, alpha(), self.group_of, major, self.param_keys)

        self._run(params, stacked, major, alpha, opt, data, o.alpha_epochs + o.basis_epochs, gen,
                  track=o.bn_stats == "track")  # fmt: skip
        return (psi.detach(), *detached(stacked, major))

    # --- evaluation --------------------------------------------------------------------------------------------
    def _uniform_params(self, server: Tensors) -> Tensors:
        """The generic model's state dict, built once per server state (clients without α share it)."""
        memo = self._memo(server)[2]
        if "uniform" not in memo:
            if self.has_bases(server):
                memo["uniform"] = self.materialize(*self._parts(server), self.uniform())
            else:
                memo["uniform"] = self._sub(server, MAJOR)
        return memo["uniform"]

    def generic_model(self, server: Tensors) -> Predictor:
        """Uniform α (during the warm-up: the FedAvg model); see the module doc for why not the major basis."""
        return Predictor(self.ctx.model, self._uniform_params(server))

    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        """One ordinary model: the bases combined with the client's α† (uniform for a client without one)."""
        if not self.has_bases(server) or "alpha" not in state:
            return self.generic_model(server)
        return Predictor(self.ctx.model, self.materialize(*self._parts(server), state["alpha"]))

    def zero_shot(self, server: Tensors, data: ClientData) -> Predictor:
        """A new client before adaptation: uniform α, the point Alg. 2 starts from (= the generic model)."""
        return self.generic_model(server)

    def personalize(
        self, server: Tensors, data: ClientData, budget: Budget, generator: torch.Generator
    ) -> Iterator[Predictor]:
        """Alg. 2 with bases frozen: learn ψ (and, for "ft", the classifier); yield θ after each epoch."""
        if not self.has_bases(server):
            yield from finetune_epochs(self.ctx.model, self._sub(server, MAJOR), data, budget, generator)
            return
        if budget.method not in ("ft", "lp"):
            raise ValueError(f"unknown personalization method {budget.method!r}")
        stacked, major = self._parts(server)
        frozen, frozen_major = detached(stacked, major)
        psi = torch.zeros(len(self.groups), self.opts.K, device=self.ctx.device, requires_grad=True)
        head: Tensors = {}
        if budget.method == "ft":
            start = self._uniform_params(server)
            head = {k: start[k].detach().clone().requires_grad_(True) for k in self.head_param_keys}
        psi_lr = budget.lr * self.alpha_lr / self.ctx.cfg.train.lr  # ψ keeps its training ratio to the weights' lr
        groups = [{"params": [psi], "lr": psi_lr}] + ([{"params": list(head.values())}] if head else [])
        opt = SGD(groups, lr=budget.lr, momentum=budget.momentum)
        body_keys = [k for k in self.param_keys if k not in head]

        def params() -> Tensors:
            return {**combine(frozen, torch.softmax(psi, -1), self.group_of, frozen_major, body_keys), **head}

        for _ in range(budget.epochs):
            self._run(params, frozen, frozen_major, lambda: torch.softmax(psi, -1), opt, data, 1, generator,
                      track=False, batch_size=budget.batch_size)  # fmt: skip
            yield Predictor(self.ctx.model, self.materialize(frozen, frozen_major, torch.softmax(psi, -1), head))

    # --- diagnostics -------------------------------------------------------------------------------------------
    def client_alphas(self, state_of: Callable[[int], Tensors]) -> dict[int, Tensors]:
        """{participated client: its state} for the clients that hold an α† (trained after the warm start)."""
        out = {}
        for c in self.ctx.federation.participated:
            s = state_of(c)
            if "alpha" in s:
                out[c] = s
        return out

    def diagnostics(self, rnd: int, server: Tensors, state_of: Callable[[int], Tensors]) -> dict[str, Any]:
        """Fig. 2's collapse signals: basis cosine similarity and combination entropy."""
        if not self.has_bases(server):
            return {"phase": "warmup"}
        states = self.client_alphas(state_of)
        alpha_star, alpha_dagger = [s["alpha_star"] for s in states.values()], [s["alpha"] for s in states.values()]
        diag = collapse_diagnostics(self._parts(server)[0], self.param_keys, self.block_params, alpha_star,
                                    alpha_dagger)  # fmt: skip
        return {"phase": "bases", **diag}

    def artifacts(self, server: Tensors, state_of: Callable[[int], Tensors], out_dir: Path) -> dict[str, str]:
        """Fig. 4: the final mixing weights per client × block (major basis first), as PNG heat-map and CSV."""
        if not self.has_bases(server):
            return {}
        alphas = {c: s["alpha"] for c, s in self.client_alphas(state_of).items()}
        domain = {c: self.ctx.federation.clients[c].domain for c in alphas}
        order, labels, table = mixing_table(alphas, domain, self.opts.K, self.opts.major, len(self.groups),
                                            self.ctx.device)  # fmt: skip
        return write_mixing_weights(order, [domain[c] for c in order], self.groups, labels, table, out_dir)


def _unchanged(state: Tensors, params: Tensors) -> tuple[Tensors, Tensors]:
    """A warm-up round's (reply, state): the trained model, the state as it was."""
    return params, state
