"""KT-pFL — Zhang, Guo, Ma, Wang, Xu & Wu, "Parameterized Knowledge Transfer for Personalized Federated Learning",
NeurIPS 2021 (Definitions 3.1–3.2, Eq. 2–7, Algorithm 1; heterogeneous Table 1, homogeneous Table 2, public data
Table 5).

Idea: clients with different architectures collaborate through soft predictions on shared public data. The server
keeps a knowledge-coefficient matrix c (N×N, learned) and gives every client a personalized target
t_n = Σ_m c_mn·s_m, s_m = softmax(z_m / T) (Eq. 2); each client distils towards its own target (Eq. 6) besides
training on its private data (Eq. 5); c is updated by gradient descent on
L(c) = λ·Σ_n (D_n/D)·KL(t_n ‖ s_n) + ρ‖c − 1/N‖² with the models fixed (Eq. 4, 7).

Matrix convention: stored as `W` with W[n, m] = c_mn — row n holds client n's weights over the teachers m (the
authors' code uses rows the same way; see `distill`). Rows are kept valid weight vectors (≥ 0, sum 1).

Round structure (one engine round = one configure → client_update → aggregate; nothing but tensors crosses):
  The paper's round t is: local training → upload s_n on public batch ξ_t → server forms t_n → clients distil →
  server updates c. It needs a second down-link inside the round, so it is pipelined across engine rounds:
  - round r, payload to client n: its target t_n formed by the server in the aggregate of the round n last
    replied in (r', normally r − 1), and r' itself (`batch_round`). Nothing in round 1.
  - round r, client n: (1) distil on the public batch ξ_{r'} towards t_n (R = `distill_epochs` passes, or
    `distill_steps` mini-batches; batch `distill_batch_size`, SGD lr `distill_lr`, momentum `distill_momentum`);
    (2) local CE training on its data (`train.*`, E = `train.local_epochs`); (3) reply s_n = softmax(z/T) on ξ_r
    (eval mode). The client's state is its model after (2) (what (3) predicted with).
  - round r, aggregate: with the replies S_r, (a) t_n = Σ_m W[n, m]·s_m for every replying n, stored for n's
    next payload; (b) the coefficient update (Eq. 7) on S_r. (`update_then_target` swaps (a) and (b).)
  The public batch ξ_r = `public_batch` indices drawn from `federation.public` by a generator seeded from
  (seed, 101, r), recomputed independently by server and clients; only the round number travels.
  Per client the sequence of operations is exactly the paper's — local_1, predict_1, distil_1, local_2, … — only
  the cut between engine rounds differs: after round r a client holds its model after local training, and its
  distillation towards the targets of round r is pending until its next round (the last round's never runs in a
  client; `score` decides whether evaluation applies it).
  What is scored (the personal model, `score`):
  - `after_distill` (paper): Alg. 1's ClientLocalUpdate returns the model after the distillation, so
    `personal_model(server, state)` applies the pending step — the state's model distilled towards t_n on ξ_{r'}
    (`t/{n}`, `r/{n}` in the server state) — and scores that. To make it the very model the client will hold, the
    distillation draws its batch order and torch's global RNG (dropout) from (seed, 102, r', n) alone, never
    from the client's round stream (which local training then starts afresh), and leaves the caller's global RNG
    as it was; so evaluating changes nothing, the evaluated model equals the one the client starts its next
    local training from, bit for bit, and the final round's model is the distilled one too (also for
    `TrainedRun.personal_model`). Nothing new is kept: a checkpoint holds the state and the pending targets
    already. Cost: one distillation per client per evaluation (R passes over ξ_{r'}).
  - `after_local` (official; the authors' code tests its models after local training, before distilling): the
    state as it left local training; the distillation draws from the client's round stream, which local training
    continues (this library's behaviour before the option existed, bit for bit).
  A client that has no targets yet (round 1, or never sampled) is scored as it is.

Options (`algorithm.<key>`; the ones left unset come from `preset`):
  - `preset`: "paper" (default) or "official" (the authors' official code, engine_kt_pfl.py):
        key                  paper          official
        temperature T        10             10
        rho ρ                0.7            0.7
        c_grad               kl (Eq. 7)     mse (MSE of probabilities per row, no D_n/D, no λ)
        c_kl                 sum            mean (how the KL of Eq. 2 / 4 pools the public samples)
        c_step               fixed c_lr     power5 (per-row adaptive step: powers of 5 towards mean |g| ≈ 0.01)
        c_normalize          simplex        softmax5 (rows ← softmax(5·row) after every update)
        order                train_first    distill_first
        epoch_ramp           false          true (E = 1, 2, … up to train.local_epochs; the code caps at 15)
        kl_reduction         batchmean      mean (torch's element mean = batchmean / C)
        update_then_target   false          true (targets formed with the freshly updated c)
        distill_momentum     train          0 (SGD momentum of the distillation; train = train.momentum)
        score                after_distill  after_local (the model scored: see the round structure)
    The paper gives no T; 10 is the code's. ρ = 0.7: Table 4's ρ = 0.7 Fashion-MNIST entry (89.14) is the
    default-setting result of Tables 3, 5 and 6. The code's other settings are not algorithm options: SGD lr 0.02
    without momentum (`train.lr`), local batch 16 (`train.batch_size`), 60 rounds, distillation batch 256.
    `distill_momentum`: the paper names no optimizer for Eq. 6 beyond η2; the authors' code builds the same plain
    SGD for both phases, so the paper preset distils with the local optimizer's momentum (`train`); the official
    preset keeps 0, this library's behaviour before the option existed (the code's own, at its momentum 0).
  - `architectures` (default [lenet5, alexnet_small, resnet18, shufflenetv2], the paper's zoo): client c gets
    architectures[⌊c·A / federation.clients⌋] — contiguous equal blocks over the client ids (20 clients, 4
    architectures: 0–4 lenet5, 5–9 alexnet_small, …), new clients included in the id range.
  - `homogeneous` (default false): every client uses the run's `model.name` and the parameter form below.
  - `public_batch` (default 5000, or the whole public set if smaller; the paper's text says 3000, its Table 6 and
    the code use 5000), `lam` λ (default 1), `c_lr` η3 (default 0.01, the paper's §5.2.2 value), `distill_epochs`
    R (default 1), `distill_steps` (mini-batches instead of epochs), `distill_lr` η2 (default `train.lr`),
    `distill_batch_size` (default 256, paper and code), `distill_momentum` (a number ≥ 0, or `train`),
    `score` (`after_distill` or `after_local`). The baselines (FedMD, Sim-pFL, TopK-pFL) take the last two as
    well, defaulting to 0 and `after_local`.

Homogeneous KT-pFL (Table 2; the paper's Appendix C is not in the stored text, so this is an interpretation):
  the collaborative knowledge is the parameters. The server keeps every client's last uploaded model w_m (the
  initial model before its first upload); the payload of client n is its personalized model
  w̄_n = Σ_m W[n, m]·w_m (integer buffers take the maximum); the client trains it locally and uploads it; the
  server then computes s_m = softmax(z/T) of the uploaded models on ξ_r itself (the public data sits on the server,
  as in the paper's Fig. 5 experiment) and updates W by the same rule as above. There is no distillation step.
  The personal model is w̄_n with the latest W: already the model after the transfer (what the client starts its
  next round from), in either preset, so `score` and `distill_momentum` change nothing here.

Interpretations and deviations:
  - Coefficient gradient: KL(t_n ‖ s_n) is summed over the public samples, as Eq. 2 and Eq. 4 write it
    (`c_kl = "sum"`; "mean" averages them, i.e. divides the KL term by |ξ_r|). The pooling decides which term of
    Eq. 4 leads: with the mean and ρ = 0.7 the pull ρ‖c − 1/N‖² outweighs the D_n/D-weighted KL term by orders of
    magnitude and c stays uniform to 1e-5 (measured: 20 clients × 2 labels, 3 rounds), so KT-pFL degenerates to
    FedMD; with the sum, c moves towards the clients whose predictions explain a client's own. It is evaluated at
    the uploaded predictions S_r, i.e. after local training and before distillation
    (Eq. 7 writes s(w*) of the distilled models, which would need a third exchange per round; the authors' code
    also uses the uploaded predictions). D_n/D are the |D_n| of the replying clients, normalized over them.
  - Valid weights: the paper does not say how rows stay weights. `simplex`: Euclidean projection of each row onto
    the probability simplex after the step (projected gradient descent); `softmax5`: the code's re-normalization.
  - Partial participation (the paper's 100-client runs update "only partial elements" of c): only the block
    W[A, A] of the replying set A changes. Its rows are rescaled to sum 1 (V = W[A, A] / mass_n), updated with the
    uniform prior 1/|A| in the ρ term, normalized, and written back times mass_n — entries towards absent clients
    stay, rows still sum 1, and with full participation this is exactly the rule above. Targets mix the replying
    clients only (t_n = Σ_{m∈A} V[n, m]·s_m): absent clients have no prediction on ξ_r.
  - `order = distill_first`: the code's round is predict → distil → local training. Pipelined, that order is the
    same per-client sequence shifted by one exchange, so round 1 is a prediction-only exchange on the untrained
    models (no local training); every later round is distil → local → predict. T engine rounds therefore hold
    T − 1 local trainings: run train.rounds = the code's rounds + 1 for the same count. `epoch_ramp` counts
    the rounds that hold a local training, as the code counts its rounds (E = min(k, train.local_epochs) in the
    k-th): every client trains every round there; under partial participation a client's first local training in
    the k-th such round gets min(k, E) epochs too, not 1.
  - Not reproduced from the code: the initial pre-training of every client on its private data; grey images
    replicated to 3 channels (the zoo takes 1 channel); separately re-created optimizers are the same here
    (SGD, one optimizer per phase per round, so momentum restarts; `train.weight_decay` applies to local training
    only). Official LeNet has no conv padding (16·4·4 features); the zoo's `lenet5` pads the first conv (16·5·5).
  - Client models: heterogeneous clients start from their own random initialization (seeded by (seed, 2, 1 + id),
    like independently built models in the code); homogeneous ones from the run's initial model.
  - New clients (not in the paper): the personal model of a new client is trained from scratch on its own data
    (heterogeneous; zero-shot is None) or fine-tuned from the uniform mix (1/N, c's prior) of all local models
    (homogeneous, which is also its zero-shot model). There is no generic model (G-FL is null).

Batched clients (`executor.batch_clients`): the client update is a plan (`round_plan`): the distillation a phase
on the public batch (`Phase.data`: the pool's rows of ξ_{r'}, each labelled with its position, the row of the
client's targets — a per-client constant — it is distilled towards; batch size `distill_batch_size`, no weight
decay; under `after_distill` its draws from `Phase.stream`), then the local epochs, and `finish` predicts s_n on
ξ_r. The clients of each architecture are trained together (`LocalSGDPlan.model`), those distilling on the same
batch in one phase. `distill_steps` takes exactly that many mini-batches, drawing no batch beyond the last (the
library's earlier loop drew one more, counted it as work and, where the last step ended a pass, drew the next
pass's order from the client's stream).

Communication: heterogeneous replies are B×C probabilities (float32) and payloads the same size — independent of
the architectures, usually far below their parameter counts; homogeneous ones are parameters.

Diagnostics: `diag.c_row_entropy` (mean row entropy of W over participated clients, nats; log N when uniform),
`diag.c_diag` (mean self-weight W[n, n]). Artifacts: the final W as heat-map PNG and CSV, clients sorted by their
label set (the labels holding at least 1/C of the client's training distribution).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator

from pflbed.algorithms import distill as kd
from pflbed.algorithms.base import Algorithm, Budget, ClientContext, ClientData, Context, Predictor, Tensors
from pflbed.algorithms.local_sgd import LocalSGDPlan, Phase, run_plan
from pflbed.algorithms.reply_shapes import UNSENT, Spec, misfit, specs
from pflbed.algorithms.training import (
    architecture_of,
    finetune_epochs,
    fresh_client_params,
    load_params,
    weighted_mean,
)
from pflbed.errors import ConfigError
from pflbed.models import BlockNet, ModelNames
from pflbed.search import IntSearch, Search, Space, same_as

PRESETS: dict[str, dict[str, Any]] = {
    "paper": {"temperature": 10.0, "rho": 0.7, "c_grad": "kl", "c_kl": "sum", "c_step": "fixed",
              "c_normalize": "simplex",
              "order": "train_first", "epoch_ramp": False, "kl_reduction": "batchmean",
              "update_then_target": False, "distill_momentum": "train", "score": "after_distill"},
    "official": {"temperature": 10.0, "rho": 0.7, "c_grad": "mse", "c_kl": "mean", "c_step": "power5",
                 "c_normalize": "softmax5",
                 "order": "distill_first", "epoch_ramp": True, "kl_reduction": "mean",
                 "update_then_target": True, "distill_momentum": 0.0, "score": "after_local"},
}  # fmt: skip
DEFAULT_ARCHITECTURES = ["lenet5", "alexnet_small", "resnet18", "shufflenetv2"]
DISTILL_STREAM = 102  # rng tag of the distillation when score = after_distill: (seed, 102, batch round, client)
PUBLIC_ROUNDS = 8  # the rounds whose public batches a run keeps as phase data (`KTpFL._public`)
Momentum = Annotated[float, Field(ge=0)]
MOMENTUM_DOC = "SGD momentum of the distillation: a number, or train (= train.momentum, the local optimizer's)"
SCORE_DOC = (
    "the model scored as a client's personal model: after_distill (its pending distillation applied, Alg. 1) or "
    "after_local (as it left local training)"
)


class TransferOptions(BaseModel):
    """Options shared by the soft-prediction family (KT-pFL and its baselines FedMD, Sim-pFL, TopK-pFL)."""
    search: ClassVar[dict[str, Space]] = {"temperature": Search(1.0, 20.0, log=True), "distill_epochs": IntSearch(1, 5),
                                            "distill_lr": Search(1e-4, 0.1, log=True)}  # fmt: skip

    model_config = ConfigDict(extra="forbid")
    architectures: ModelNames = Field(default_factory=lambda: list(DEFAULT_ARCHITECTURES), min_length=1)
    public_batch: int = Field(5000, ge=1, description="public samples per round (capped at the public set)")
    temperature: float = Field(10.0, gt=0, description="softmax temperature T of the soft predictions")
    order: Literal["train_first", "distill_first"] = Field("train_first", description="round order")
    epoch_ramp: bool = Field(False, description="local epochs 1, 2, … up to train.local_epochs")
    kl_reduction: Literal["batchmean", "mean"] = Field("batchmean", description="distillation KL reduction")
    distill_epochs: int = Field(1, ge=1, description="R: passes over the public batch per distillation")
    distill_steps: int | None = Field(None, ge=1, description="mini-batch steps instead of distill_epochs")
    distill_lr: float | None = Field(None, gt=0, description="η2 (default train.lr)",
                                     json_schema_extra=same_as("train.lr"))
    distill_batch_size: int = Field(256, ge=1)
    distill_momentum: Momentum | Literal["train"] = Field(0.0, description=MOMENTUM_DOC)
    score: Literal["after_distill", "after_local"] = Field("after_local", description=SCORE_DOC)


class KTpFLOptions(TransferOptions):
    """KT-pFL options; the ones left unset take the value of `preset` (see the module docstring)."""
    search: ClassVar[dict[str, Space]] = {**TransferOptions.search, "lam": Search(0.1, 10.0, log=True),
                                            "c_lr": Search(1e-3, 0.1, log=True)}  # fmt: skip

    preset: Literal["paper", "official"] = Field("paper", description="defaults for the unset options")
    homogeneous: bool = Field(False, description="one architecture (model.name), parameters as knowledge")
    temperature: float | None = Field(None, gt=0, description="softmax temperature T of the soft predictions")
    lam: float = Field(1.0, gt=0, description="λ: weight of the KL term in Eq. 4 / 7")
    rho: float | None = Field(None, ge=0, description="ρ: pull of c towards 1/N")
    c_lr: float = Field(0.01, gt=0, description="η3: step size of the c update (c_step=fixed)")
    c_grad: Literal["kl", "mse"] | None = Field(None, description="kl: Eq. 7; mse: the authors' code")
    c_kl: Literal["sum", "mean"] | None = Field(None, description="KL of the c objective over public samples")
    c_step: Literal["fixed", "power5"] | None = Field(None, description="fixed c_lr, or the code's adaptive step")
    c_normalize: Literal["simplex", "softmax5"] | None = Field(None, description="how rows stay weights")
    order: Literal["train_first", "distill_first"] | None = Field(None, description="paper or code round order")
    epoch_ramp: bool | None = Field(None, description="local epochs 1, 2, … up to train.local_epochs")
    kl_reduction: Literal["batchmean", "mean"] | None = Field(None, description="distillation KL reduction")
    update_then_target: bool | None = Field(None, description="form targets with the updated c (the code)")
    distill_momentum: Momentum | Literal["train"] | None = Field(None, description=MOMENTUM_DOC)
    score: Literal["after_distill", "after_local"] | None = Field(None, description=SCORE_DOC)

    @model_validator(mode="after")
    def _apply_preset(self) -> KTpFLOptions:
        for key, value in PRESETS[self.preset].items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        return self


class KTpFL(Algorithm):
    name = "ktpfl"
    dp_refused = (
        "replies are soft predictions on public data, not a parameter update, and the server weighs each "
        "client's own"
    )
    Config = KTpFLOptions

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.homogeneous = bool(getattr(self.opts, "homogeneous", False))
        fed = ctx.federation
        if fed.public.numel() == 0:
            raise ConfigError(f"{self.name} needs public data: set federation.public > 0")
        self.clients = list(fed.participated)
        self._publics: dict[int, ClientData] = {}
        self.index = {c: i for i, c in enumerate(self.clients)}
        self.n_total = len(fed.clients)
        self.models: dict[str, BlockNet] = {ctx.cfg.model.name: ctx.model}
        if not self.homogeneous:
            for a in self.opts.architectures:
                if a not in self.models:
                    self.models[a] = ctx.new_model(a)

    # --- helpers ---------------------------------------------------------------------------------------------
    def arch_of(self, cid: int) -> str:
        if self.homogeneous:
            return self.ctx.cfg.model.name
        return architecture_of(cid, self.opts.architectures, self.n_total)

    def _fresh_params(self, cid: int) -> Tensors:
        return fresh_client_params(self.models[self.arch_of(cid)], self.ctx.seed, cid)

    def _public_x(self, rnd: int) -> torch.Tensor:
        """The samples of the public batch ξ_rnd, in batch order."""
        public = self._public(rnd)
        return public.x[public.train]

    def _local(self, server: Tensors, c: int) -> Tensors:
        """Homogeneous: client c's last uploaded model (the initial model before its first upload)."""
        prefix = f"local/{c}/"
        return {k: server.get(prefix + k, v) for k, v in self.ctx.initial_params.items()}

    def _mixed(self, server: Tensors, weights: torch.Tensor) -> Tensors:
        """Homogeneous: Σ_m weights[m]·w_m over the participated clients."""
        models = {c: self._local(server, c) for c in self.clients}
        return weighted_mean(models, {c: float(weights[self.index[c]]) for c in self.clients})

    def _public(self, rnd: int) -> ClientData:
        """The public batch ξ_rnd as samples a plan's phase trains on: the training pool's rows (no augmentation),
        each labelled with its position in the batch — the row of a client's targets it is distilled towards.
        One object per round (kept for the last `PUBLIC_ROUNDS` rounds), so clients distilling on the same batch
        train together (`Phase.data`)."""
        if rnd not in self._publics:
            pool = self.ctx.source.train
            idx = kd.public_batch(self.ctx.federation.public, self.opts.public_batch, self.ctx.seed, rnd)
            position = torch.full((len(pool.y),), -1, dtype=torch.long, device=idx.device)
            position[idx] = torch.arange(len(idx), device=idx.device)
            empty = idx[:0]
            self._publics[rnd] = ClientData(-1, pool.x, position, idx, empty, empty.float())
            while len(self._publics) > PUBLIC_ROUNDS:
                self._publics.pop(next(iter(self._publics)))
        return self._publics[rnd]

    def _distillation(self, model: BlockNet, batch_round: int, private: bool) -> Phase:
        """Eq. 6 as a plan's phase: SGD on every block towards the client's targets (`consts["targets"]`) on the
        public batch ξ_{batch_round}; R = `distill_epochs` passes, or `distill_steps` mini-batches.

        `private` (score = after_distill): the batch order and the dropout come from (seed, DISTILL_STREAM,
        batch_round, client) alone (`Phase.stream`), never from the client's round stream, which local training
        then starts afresh: the result depends on the targets' round and the client only, so `personal_model`
        computes the model the client will hold. Otherwise the draws continue the client's round stream."""
        o, t = self.opts, self.ctx.cfg.train
        data = self._public(batch_round)
        epochs = o.distill_epochs
        if o.distill_steps is not None:  # enough passes for the steps, the last cut short (`Phase.steps`)
            epochs = -(-o.distill_steps // -(-data.num_train // o.distill_batch_size))
        momentum = t.momentum if o.distill_momentum == "train" else o.distill_momentum
        return Phase(tuple(model.block_names()), epochs, o.distill_lr or t.lr, steps=o.distill_steps,
                     batch_size=o.distill_batch_size, momentum=momentum, weight_decay=0.0,
                     objective=kd.DistillObjective(o.temperature, o.kl_reduction), data=data,
                     stream=(self.ctx.seed, DISTILL_STREAM, batch_round) if private else None)  # fmt: skip

    def _epochs(self, rnd: int) -> int:
        """Local epochs of this round: train.local_epochs, or the ramp min(k, E) in the k-th round that holds a
        local training (counted by round, as the authors' code does, not by the client's own trainings)."""
        e = self.ctx.cfg.train.local_epochs
        k = rnd - (1 if self.opts.order == "distill_first" and not self.homogeneous else 0)
        return min(k, e) if self.opts.epoch_ramp else e

    def _normalize(self, V: torch.Tensor) -> torch.Tensor:
        if self.opts.c_normalize == "softmax5":
            return F.softmax(5.0 * V, dim=1)
        return kd.project_rows_to_simplex(V)

    def update_coefficients(self, V: torch.Tensor, S: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """One c step (Eq. 7, or the code's variant) on row-stochastic V with predictions S (|A|, B, C)."""
        o = self.opts
        if o.c_grad == "kl":
            lam = o.lam * (S.shape[1] if o.c_kl == "sum" else 1.0)  # S: (clients, public samples, classes)
            G = kd.coefficient_grad(V, S, weights, lam, o.rho, 1.0 / V.shape[0])
        else:
            G = kd.mse_coefficient_grad(V, S, o.rho)
        if o.c_step == "power5":
            steps = torch.tensor([kd.power5_step(g) for g in G], dtype=V.dtype, device=V.device)[:, None]
        else:
            steps = torch.full((V.shape[0], 1), o.c_lr, dtype=V.dtype, device=V.device)
        return self._normalize(V - steps * G)

    def mixing(self, V: torch.Tensor, S: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(targets of the replying clients, their coefficient block after this round) from predictions S.

        KT-pFL: targets with the current c, then the c step (or the reverse with `update_then_target`).
        The baselines (FedMD, Sim-pFL, TopK-pFL) override this with their fixed mixing rules.
        """
        if self.opts.update_then_target:
            V = self.update_coefficients(V, S, weights)
            return kd.mix(V, S), V
        return kd.mix(V, S), self.update_coefficients(V, S, weights)

    # --- federation ------------------------------------------------------------------------------------------
    def init_server(self) -> Tensors:
        n = len(self.clients)
        return {"W": torch.full((n, n), 1.0 / n, dtype=torch.float64, device=self.ctx.device)}

    def init_client(self, cid: int) -> Tensors:
        state: Tensors = {"cid": torch.tensor(cid, device=self.ctx.device)}
        if not self.homogeneous:
            state.update({f"w/{k}": v for k, v in self._fresh_params(cid).items()})
        return state

    def configure(self, rnd: int, server: Tensors, cids: list[int]) -> dict[int, Tensors]:
        if self.homogeneous:
            return {c: self._mixed(server, server["W"][self.index[c]]) for c in cids}
        payloads: dict[int, Tensors] = {}
        for c in cids:
            payloads[c] = {}
            if f"t/{c}" in server:
                payloads[c] = {"targets": server[f"t/{c}"], "batch_round": server[f"r/{c}"]}
        return payloads

    def payload_fits(self, rnd: int, cid: int, payload: Tensors, state: Tensors) -> str | None:
        """Homogeneous: the mixed model (the default). Heterogeneous: nothing before a client's first reply; after
        it, its targets on the public batch of the round it last replied in (float32, a row per sample of the batch,
        a column per class) and that round, an int64 from 1 to the round before."""
        if self.homogeneous:
            return super().payload_fits(rnd, cid, payload, state)
        if not payload:
            return None
        why = misfit(payload, {"targets": self.targets_spec(), "batch_round": ((), torch.int64)}, UNSENT)
        if why is None and not 1 <= int(payload["batch_round"]) < rnd:
            why = f"has 'batch_round' {int(payload['batch_round'])}: not a round from 1 to {rnd - 1}"
        return why

    def targets_spec(self) -> Spec:
        """A client's distillation targets: float32, a row per sample of a round's public batch (the whole public
        set where it is smaller), a column per class."""
        return (min(self.opts.public_batch, self.ctx.federation.public.numel()), self.ctx.source.num_classes), \
            torch.float32

    def view_groups(self, cids: list[int]) -> list[dict[str, Spec]]:
        """Each participated client's entries from its first reply, every client's (the view holds the whole
        state): homogeneous, its uploaded model (`local/<cid>/`); heterogeneous, its pending targets and their round
        (`t/<cid>`, `r/<cid>`)."""
        if self.homogeneous:
            model = specs(self.ctx.initial_params)
            return [{f"local/{c}/{k}": s for k, s in model.items()} for c in self.clients]
        return [{f"t/{c}": self.targets_spec(), f"r/{c}": ((), torch.int64)} for c in self.clients]

    def round_plan(self, payload: Tensors, state: Tensors, data: ClientData, cctx: ClientContext) -> LocalSGDPlan:
        """Homogeneous: local SGD from the payload. Heterogeneous: (1) the pending distillation, if any, then
        (2) local training (none in round 1 of `distill_first`), then (3) the reply s_n on ξ_rnd, in `finish`."""
        o, t, rnd = self.opts, self.ctx.cfg.train, cctx.rnd
        model = self.models[self.arch_of(data.cid)]
        local = (Phase(tuple(model.block_names()), self._epochs(rnd), t.lr),)
        if self.homogeneous:
            return LocalSGDPlan(payload, local, lambda p: (p, {"cid": state["cid"]}))
        if o.order == "distill_first" and rnd == 1:  # round 1 only predicts
            local = ()
        consts: Tensors = {}
        if "targets" in payload:  # step ⑤ of the round in which this client last replied
            local = (self._distillation(model, int(payload["batch_round"]), o.score == "after_distill"), *local)
            consts = {"targets": payload["targets"].float()}

        def finish(trained: Tensors) -> tuple[Tensors, Tensors]:
            load_params(model, trained)
            s = kd.soft_predictions(model, self._public_x(rnd), o.temperature)
            return {"s": s}, {"cid": state["cid"], **{f"w/{k}": v for k, v in trained.items()}}

        start = {k[2:]: v for k, v in state.items() if k.startswith("w/")}
        return LocalSGDPlan(start, local, finish, consts=consts, model=model)

    def aggregate(self, rnd: int, server: Tensors, replies: dict[int, Tensors], weights: dict[int, float]) -> Tensors:
        cids = sorted(replies)
        out = dict(server)
        if self.homogeneous:
            model, x = self.ctx.model, self._public_x(rnd)
            preds = []
            for c in cids:
                for k, v in replies[c].items():
                    out[f"local/{c}/{k}"] = v
                load_params(model, replies[c])
                preds.append(kd.soft_predictions(model, x, self.opts.temperature))
            S = torch.stack(preds).double()
        else:
            S = torch.stack([replies[c]["s"] for c in cids]).double()
        W = server["W"].clone()
        idx = torch.tensor([self.index[c] for c in cids], device=W.device)
        block = W[idx][:, idx]
        mass = block.sum(1, keepdim=True)
        V = block / mass
        w = torch.tensor([float(weights[c]) for c in cids], dtype=torch.float64, device=S.device)
        w = w / w.sum()
        targets, V = self.mixing(V, S, w)
        W[idx[:, None], idx[None, :]] = mass * V
        out["W"] = W
        if not self.homogeneous:
            for i, c in enumerate(cids):
                out[f"t/{c}"] = targets[i].float()
                out[f"r/{c}"] = torch.tensor(rnd, device=W.device)
        return out

    # --- evaluation ------------------------------------------------------------------------------------------
    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        cid = int(state["cid"])
        if self.homogeneous:
            return Predictor(self.ctx.model, self._mixed(server, server["W"][self.index[cid]]))
        params = {k[2:]: v for k, v in state.items() if k.startswith("w/")}
        model = self.models[self.arch_of(cid)]
        if self.opts.score == "after_distill" and f"t/{cid}" in server:  # the pending distillation, as Alg. 1
            pending = LocalSGDPlan(params, (self._distillation(model, int(server[f"r/{cid}"]), True),),
                                   lambda p: (p, {}), consts={"targets": server[f"t/{cid}"].float()})  # fmt: skip
            with torch.enable_grad():  # its own stream: the generator given is never drawn from
                params, _ = run_plan(model, pending, self.ctx.client_data(cid), self.ctx.cfg.train, torch.Generator())
        return Predictor(model, params)

    def _uniform(self, server: Tensors) -> Tensors:
        return self._mixed(server, torch.full((len(self.clients),), 1.0 / len(self.clients), device="cpu"))

    def zero_shot(self, server: Tensors, data: ClientData) -> Predictor | None:
        """Homogeneous: the uniform mix (c's prior row); heterogeneous: none (an untrained model)."""
        return Predictor(self.ctx.model, self._uniform(server)) if self.homogeneous else None

    def personalize(
        self, server: Tensors, data: ClientData, budget: Budget, generator: torch.Generator
    ) -> Iterator[Predictor]:
        """A new client: from the uniform mix (homogeneous) or from scratch on its architecture (heterogeneous)."""
        if self.homogeneous:
            yield from finetune_epochs(self.ctx.model, self._uniform(server), data, budget, generator)
        else:
            start = self._fresh_params(data.cid)
            yield from finetune_epochs(self.models[self.arch_of(data.cid)], start, data, budget, generator)

    # --- diagnostics -----------------------------------------------------------------------------------------
    def diagnostics(self, rnd: int, server: Tensors, state_of: Callable[[int], Tensors]) -> dict[str, Any]:
        W = server["W"]
        return {
            "c_row_entropy": round(float(kd.row_entropy(W).mean()), 6),
            "c_row_entropy_uniform": round(math.log(W.shape[0]), 6),
            "c_diag": round(float(W.diagonal().mean()), 6),
        }

    def artifacts(self, server: Tensors, state_of: Callable[[int], Tensors], out_dir: Path) -> dict[str, str]:
        """The final coefficient matrix, clients sorted by label set (heat-map PNG + CSV)."""
        fed = self.ctx.federation
        order = sorted(self.clients, key=lambda c: (kd.label_set(fed.clients[c].prior), c))
        pos = torch.tensor([self.index[c] for c in order], device=server["W"].device)
        mat = server["W"][pos][:, pos].cpu()  # plotted and written from host memory
        rows = [(c, self.arch_of(c), kd.label_set(fed.clients[c].prior)) for c in order]
        return kd.write_coefficients(self.name, rows, mat, out_dir)
