"""FedDyn — Acar, Zhao, Matas, Mattina, Whatmough & Saligrama, "Federated Learning Based on Dynamic
Regularization", ICLR 2021 (Algorithm 1).

Client k keeps g_k = ∇L_k(θ_k^{t−1}) (its state; zero at first). Sampled in round t, it solves from θ^{t−1}

    θ_k^t = argmin_θ  L_k(θ) − ⟨g_k, θ⟩ + α/2 · ‖θ − θ^{t−1}‖²

(E epochs of mini-batch SGD on that objective, declared as a plan: `executor.batch_clients` trains a round's clients
together), replies θ_k^t and updates g_k ← g_k − α(θ_k^t − θ^{t−1}). The server
keeps h (zero at first):

    h^t = h^{t−1} − α · (1/m) Σ_{k∈P_t} (θ_k^t − θ^{t−1}),    θ^t = (1/|P_t|) Σ_{k∈P_t} θ_k^t − h^t / α,

m the number of (participating) clients. Faithful to Algorithm 1, the mean over P_t is uniform, not |D_k|-weighted;
BatchNorm statistics are averaged (uniformly) with the model and carry no h. `alpha` defaults to 0.01, in the
paper's grid {0.1, 0.01, 0.001}. One α serves every client, as Algorithm 1 writes; the authors' code
(alpemreacar/FedDyn, `utils_methods.py` `train_FedDyn`, read only) gives client k its own α_k = α · n̄/n_k (its
"adaptive alpha", n̄ the mean client size), so a small client is pulled harder towards θ^{t−1}; the two agree when
clients hold equally many samples. That code also clips every local gradient's norm at 10, for every method it
runs; not here.

Which model is scored (`eval_model`): the clients always start from θ^t, Algorithm 1's server model (the "cloud"
model of the authors' code). G-FL and P-FL (FedDyn has no personal model: P-FL scores the same model) and every
personalization (+FT/+LP, new clients, zero-shot) use
- `cloud` (default): θ^t = mean − h^t/α, the model Algorithm 1 returns;
- `mean`: the round's uniform mean (1/|P_t|) Σ_{k∈P_t} θ_k^t of the client models — the authors' code's `avg_model`.
  That code scores it, the cloud model and the mean of every client's latest model (`all_model`, the curve its
  CIFAR-10 example plots; not offered here); which of them the paper's tables report it does not say. With every
  client in every round `mean` and `all_model` are the same model. The mean is kept in the server state
  (`mean/<parameter>`, the initial model before round 1) and never sent; BatchNorm statistics are the same in both
  (they carry no h).

Under client-level DP (`privacy`): the mean over P_t becomes the release w + (Σ_{P_t} Δ̃_k + z)/(qN) (DP-FedAvg's
fixed denominator, `pflbed.privacy`), and h's step uses it with |P_t| replaced by its expectation qN:

    h^t = h^{t−1} − α · (qN/m) · (release − θ^{t−1}),

so (qN/m)(release − θ) = (Σ Δ̃_k + z)/m estimates (1/m) Σ_{k∈P_t} (θ_k^t − θ^{t−1}) without the round's count. With
the actual |P_t| the server step would read how many clients replied, which the release hides (it is not
post-processing of the noised sum): a deviation from Algorithm 1 only under DP.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from pflbed.algorithms.base import ClientData, Context, Predictor, Tensors
from pflbed.algorithms.local_sgd import LocalSGDPlan, Phase, RegularizedObjective
from pflbed.algorithms.server_extras import ModelWithExtras
from pflbed.algorithms.training import WeightedMean
from pflbed.search import Search, Space

H, MEAN = "h/", "mean/"


class FedDynOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    search: ClassVar[dict[str, Space]] = {"alpha": Search(1e-3, 1.0, log=True)}  # the paper: α ∈ {0.1, 0.01, 0.001}
    alpha: float = Field(0.01, gt=0, description="α of the dynamic regularizer")
    eval_model: Literal["cloud", "mean"] = Field("cloud", description="the model scored and personalized: θ = "
                                                 "mean − h/α (Alg. 1), or the round's mean of the client models "
                                                 "(the authors' reported figures)")  # fmt: skip


GRAD, PREV = "g/", "prev/"  # a plan's constants: the client's g_k and θ^{t−1}


class FedDyn(ModelWithExtras):
    name = "feddyn"
    dp_refused = None  # replies: the model's new values; the server reads their (uniform) mean only
    Config = FedDynOptions
    prefix = H  # h; clients' g_k start at zero too

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self._mean_cache: tuple[Tensors, Tensors] | None = None  # (server state, its mean model)
        # L_k(θ) − ⟨g_k, θ⟩ + α/2·‖θ − θ^{t−1}‖²; one function: the round's plans batch together
        self.objective = RegularizedObjective(self.params, self.opts.alpha, anchor=PREV, linear=GRAD, sign=-1.0)

    def init_server(self) -> Tensors:
        server = super().init_server()
        if self.opts.eval_model == "mean":
            server.update({f"{MEAN}{k}": self.ctx.initial_params[k].clone() for k in self.params})
        return server

    def generic_model(self, server: Tensors) -> Predictor:
        if self.opts.eval_model == "cloud":
            return super().generic_model(server)
        if self._mean_cache is None or self._mean_cache[0] is not server:  # one dict per server state (batching)
            mean = {k: server[f"{MEAN}{k}"] if k in self.params else server[k] for k in self.model_keys}
            self._mean_cache = (server, mean)
        return Predictor(self.ctx.model, self._mean_cache[1])

    def configure(self, rnd: int, server: Tensors, cids: list[int]) -> dict[int, Tensors]:
        theta = self.model_part(server)
        return {c: theta for c in cids}

    def sgd_plan(self, payload: Tensors, state: Tensors, data: ClientData) -> LocalSGDPlan:
        """The local problem as a plan: every block at `train.lr` on L_k(θ) − ⟨g_k, θ⟩ + α/2·‖θ − θ^{t−1}‖²
        (`local_sgd.RegularizedObjective`; the client's g_k and θ^{t−1} as its constants); `finish` returns θ_k^t
        and the new g_k = g_k − α(θ_k^t − θ^{t−1})."""
        t, a = self.ctx.cfg.train, self.opts.alpha
        prev = {k: payload[k].detach() for k in self.params}

        def finish(theta: Tensors) -> tuple[Tensors, Tensors]:
            return theta, {k: state[k] - a * (theta[k] - prev[k]) for k in self.params}

        consts = {**{f"{GRAD}{k}": state[k] for k in self.params}, **{f"{PREV}{k}": prev[k] for k in self.params}}
        phase = Phase(tuple(self.ctx.model.block_names()), t.local_epochs, t.lr)
        return LocalSGDPlan(dict(payload), (phase,), finish, self.objective, consts)

    def aggregator(self, rnd: int, server: Tensors, weights: dict[int, float]) -> _FedDynServer:
        return _FedDynServer(self, server, list(weights))


class _FedDynServer:
    def __init__(self, algo: FedDyn, server: Tensors, cids: list[int]) -> None:
        self.algo, self.server = algo, server
        self.mean = WeightedMean(dict.fromkeys(cids, 1.0), keys=algo.model_keys)  # uniform over P_t

    def add(self, cid: int, reply: Tensors) -> None:
        self.mean.add(cid, reply)

    def result(self) -> Tensors:
        ctx = self.algo.ctx
        a, m = self.algo.opts.alpha, len(ctx.federation.participated)
        mean = self.mean.result()
        s = self.server
        # (1/m) Σ_{P_t} (θ_k − θ) = (|P_t|/m)(mean − θ); under DP the mean is the release and |P_t| its expectation
        # qN (the count of repliers is not released)
        share = ctx.cfg.federation.sample_fraction if ctx.cfg.privacy.enabled else len(self.mean.w) / m
        h = {k: s[f"{H}{k}"] - a * share * (mean[k] - s[k]) for k in self.algo.params}
        theta = {k: mean[k] - h[k] / a if k in h else mean[k] for k in self.algo.model_keys}
        kept = {f"{MEAN}{k}": mean[k] for k in self.algo.params} if self.algo.opts.eval_model == "mean" else {}
        return {**theta, **{f"{H}{k}": v for k, v in h.items()}, **kept}
