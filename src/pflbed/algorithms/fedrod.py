"""FedRoD (linear) — Chen & Chao, "On Bridging Generic and Personalized Federated Learning for Image
Classification", ICLR 2022 (Federated Robust Decoupling), Algorithm 1, as the authors' slides present it.

Model: shared feature extractor z = f(x; θ) (the BlockNet body), generic head ŷ_G = h_G(z; ψ) (the BlockNet head)
and a personal head h_P(z; φ_m) per client; the personalized prediction is additive, ŷ_P = h_G(z; ψ) + h_P(z; φ_m).

Equations implemented (numbering of the source):
- Balanced-softmax loss (BSM, §4; unnumbered in the slides), the balanced risk L^BR_m = mean_i ℓ^BSM:
  ℓ^BSM(x, y; w) = −log( N_{m,y}^γ·exp(g_y(x; w)) / Σ_c N_{m,c}^γ·exp(g_c(x; w)) )
                 = CE(g(x; w) + γ·log N_m, y)                                          (`balanced_softmax_loss`)
- Eq. 7: min_{θ,ψ} Σ_m |D_m|/|D|·L^BR_m({θ, ψ})  and  min_{φ_m} L_m({θ, ψ, φ_m}) for every m.
- Eq. 8 (local, generic): θ*_m, ψ*_m = argmin_{θ,ψ} L^BR_m({θ, ψ}), initialised with θ̄, ψ̄.
- Eq. 9 (local, personal): φ*_m = argmin_{φ_m} L_m({θ, ψ, φ_m}) — plain cross-entropy of ŷ_P (the "P-loss"),
  initialised with the client's φ*_m of its previous round.
- Eq. 10 (global): θ̄ = Σ_{m∈S} |D_m|/Σ_{m'∈S}|D_{m'}|·θ*_m and likewise ψ̄ (Algorithm 1 normalises over the
  sampled clients S). φ_m never leaves the client.

Interpretations and deviations (everything the slides leave open):
1. Gradient separation. Eq. 8 trains θ, ψ with L^BR only and Eq. 9 trains φ_m only, so the P-loss is computed on
   ŷ_P = h_G(z).detach() + h_P(z.detach()): it gives no gradient to f or h_G, and L^BSM none to h_P.
2. Eq. 8 and Eq. 9 run simultaneously on the same mini-batches: one forward through f per batch, both losses, two
   SGD optimizers each stepping once per batch; each "argmin" is `train.local_epochs` epochs of mini-batch SGD, as
   in FedAvg. h_P is therefore fitted to the features of the body as it is before that batch's step.
3. Class counts N_{m,c} = P_m(y = c)·|D_m| (the client's exact training label counts). Zero counts are floored at
   1e-12 before the log (offset ≈ −27.6·γ): an absent class is effectively dropped from the softmax denominator,
   the limit N → 0 of ℓ^BSM. γ (option `gamma`) defaults to 1.
4. φ'_m, the initial personal head, is all zeros: ŷ_P = ŷ_G at the start, so h_P learns an additive correction of
   the generic predictor, and a client never sampled (or a new one) gets exactly the generic model.
5. h_P is one Linear(d, C) on the flattened body output (d = its size) — "both heads are FC"; it has the shape of
   the zoo models' classifier. If a model's head has several blocks, h_G is that whole head and h_P stays linear.
6. Optimizers: θ, ψ use SGD with `train.lr`, `train.momentum`, `train.weight_decay`; φ_m uses `personal_lr`
   (default `train.lr`) with the same momentum and weight decay. Both are created per round (momentum restarts,
   as for FedAvg in pflbed).
   The update is declared as a plan (`sgd_plan`: one phase over every block at `train.lr` and φ_m at
   `personal_lr`, `DecoupledObjective`, the class counts as the client's constants), so the loop runs it client by
   client and `executor.batch_clients` trains a round's clients together (`engine.batched`), to float rounding.
7. The whole model state dict is uploaded and averaged (Eq. 10 names θ and ψ only): BatchNorm statistics, if a
   model has any, are treated as part of θ and averaged like FedAvg does (integer batch counters take the max).
   They are updated by the only forward through f, the one of the BSM loss.
8. P-FL model of client m (option `pfl_body`): the client's own φ*_m on a body f, h_G that is
   - `server` (default): θ̄, ψ̄, the current server model — what the client holds at the start of its next round.
     One body for every client: evaluation computes its features once and runs only the heads per client, and
     the client state is φ_m alone.
   - `local`: θ*_m, ψ*_m, the client's locally updated body and generic head of its last participated round —
     Algorithm 1's client output {θ*_m, ψ*_m, φ*_m}. The client keeps them in its state (`local.` + the model's
     state-dict keys, BatchNorm statistics included), so the state is a whole model per client (memory, and
     checkpoint size, grow by clients × model size; under Flower a state travels with the client's task both
     ways, or with `executor.state_dir` from its node to the server to be evaluated once after each time it
     trains — traffic outside the communication figures, which count payloads and replies), and evaluation runs
     every trained client's own body over its test and validation samples (no features shared between clients;
     with `eval.pfl_test: global` that is one forward of the global test set per client instead of one in all).
     A client never sampled has no local body and uses θ̄, ψ̄ (with φ = 0: the generic model). Training, the
     replies, the server and G-FL are the same under both options; only the P-FL model differs.
9. New clients: `zero_shot` = the generic model (= ŷ_P with φ = 0). `personalize`: "lp" trains h_P (from zeros)
   with the P-loss on frozen f and h_G (features computed once, in eval mode); "ft" trains θ, ψ and φ together
   with plain CE on ŷ_P = h_G(z) + h_P(z) without stop-gradients — a new client minimises its own empirical risk,
   the objective of its personal model; the balanced risk is a federation-level objective. Both use the budget's
   lr and momentum and no weight decay, like the library's default personalization. `eval.finetune` (FedRoD+FT/LP
   of participated clients) goes through the same `personalize`, which sees no client state: it also starts from
   φ = 0, not from the client's trained φ*_m, and from θ̄, ψ̄ under `pfl_body: local` too (a new client has no
   local body).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from pflbed.algorithms.base import Algorithm, Budget, ClientData, Context, Predictor, Same, Tensors
from pflbed.algorithms.local_sgd import LocalSGDPlan, Phase, features_and_logits, weighted_mean
from pflbed.algorithms.training import WeightedMean, get_params, load_params, sgd_epochs
from pflbed.models import BlockNet
from pflbed.search import Search, Space, same_as

if TYPE_CHECKING:
    pass  # annotations only

COUNT_FLOOR = 1e-12  # zero class counts are floored here before the log (deviation 3)
NET, PERSONAL = "net.", "personal."  # state-dict prefixes of the additive predictor's two parts
LOCAL = "local."  # client-state prefix of the client's own θ*_m, ψ*_m (`pfl_body: local`, deviation 8)


# --- shared pieces (also used by fedrod_hyper) ---------------------------------------------------------------------
def class_counts(data: ClientData) -> torch.Tensor:
    """N_{m,c}: the client's training label counts, from its class prior and training-set size."""
    return data.prior.to(torch.float64) * data.num_train


def log_count_offsets(counts: torch.Tensor, gamma: float) -> torch.Tensor:
    """γ·log N_{m,c}, zero counts floored at `COUNT_FLOOR`."""
    return gamma * counts.to(torch.float64).clamp_min(COUNT_FLOOR).log()


def balanced_softmax_loss(
    logits: torch.Tensor, y: torch.Tensor, counts: torch.Tensor, gamma: float = 1.0
) -> torch.Tensor:
    """ℓ^BSM averaged over the batch: CE(g + γ·log N_m, y)."""
    return F.cross_entropy(logits + log_count_offsets(counts, gamma).to(logits), y)


def personal_logits(
    generic: torch.Tensor, z: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """ŷ_P for the P-loss: h_G(z).detach() + h_P(z.detach()) — gradient reaches only the personal head."""
    return generic.detach() + head(z.detach())


def personal_loss(generic: torch.Tensor, z: torch.Tensor, y: torch.Tensor, head: Callable) -> torch.Tensor:
    """The P-loss of Eq. 9: plain cross-entropy of the additive personal prediction (trains h_P only)."""
    return F.cross_entropy(personal_logits(generic, z, head), y)


class PersonalHead(nn.Linear):
    """h_P: one linear layer on the flattened body output, zero-initialised (deviation 4)."""

    def __init__(self, in_features: int, num_classes: int) -> None:
        super().__init__(in_features, num_classes)
        with torch.no_grad():
            self.weight.zero_()
            self.bias.zero_()

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return super().forward(z.flatten(1))


class AdditivePredictor(nn.Module):
    """The personal predictor ŷ_P = h_G(f(x)) + h_P(f(x)), wrapping the shared BlockNet and a personal head.

    State-dict keys are the BlockNet's prefixed with `net.` and the head's with `personal.`. `features` and
    `classify` split it at the body like a BlockNet, so frozen-body predictors can share cached features.
    """

    def __init__(self, net: BlockNet, personal: PersonalHead) -> None:
        super().__init__()
        self.net, self.personal = net, personal

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.net.features(x)

    def classify(self, z: torch.Tensor) -> torch.Tensor:
        return self.net.classify(z) + self.personal(z)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classify(self.features(x))


def feature_dim(model: BlockNet, input_shape: tuple[int, ...]) -> int:
    """d: the size of one sample's body output (one eval-mode forward of a zero input; no state changes)."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        x = torch.zeros(1, *input_shape, device=next(model.parameters()).device)
        d = int(math.prod(model.features(x).shape[1:]))
    model.train(was_training)
    return d


class DecoupledObjective:
    """FedRoD's local loss as a plan's objective (`local_sgd.Objective`): L^BSM of the generic logits (Eq. 8) plus
    the P-loss of the additive personal logits (Eq. 9), the personal head h_P = `personal.weight`, `personal.bias`
    (a linear layer on the flattened features) and the class counts `counts` from the plan. In the loop (`w`
    None) one backward of L^BSM + P-loss per batch (disjoint gradients: the stop-gradients of `personal_logits`
    separate the two objectives); in a batched step, the same losses per sample, weighted.
    A class (not a closure): the algorithm travels to `procs` workers by pickle."""

    def __init__(self, gamma: float) -> None:
        self.gamma = gamma

    def __call__(
        self, model: BlockNet, params: Tensors, consts: Tensors, x: torch.Tensor, y: torch.Tensor,
        w: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        z, g = features_and_logits(model, params, x)
        weight, bias = self.personal_head(params, consts)

        def head(feats: torch.Tensor) -> torch.Tensor:
            return F.linear(feats.flatten(1), weight, bias)

        if w is None:
            return balanced_softmax_loss(g, y, consts["counts"], self.gamma) + personal_loss(g, z, y, head)
        offsets = log_count_offsets(consts["counts"], self.gamma).to(g)
        bsm = F.cross_entropy(g + offsets, y, reduction="none")
        personal = F.cross_entropy(personal_logits(g, z, head), y, reduction="none")
        return weighted_mean(bsm, w) + weighted_mean(personal, w)

    def personal_head(self, params: Tensors, consts: Tensors) -> tuple[torch.Tensor, torch.Tensor]:
        """h_P's weight and bias: the plan's tensors `personal.weight`, `personal.bias`."""
        return params[PERSONAL + "weight"], params[PERSONAL + "bias"]


def personalize_additive(
    predictor: AdditivePredictor,
    server_model: Tensors,
    start_head: Tensors,
    data: ClientData,
    budget: Budget,
    generator: torch.Generator,
    feature_key: tuple,
) -> Iterator[Predictor]:
    """A new client's adaptation of ŷ_P from (θ̄, ψ̄, h_P = `start_head`), yielding the model after every epoch.

    lp: h_P alone, with the P-loss on features of the frozen body computed once in eval mode. ft: θ, ψ and h_P,
    with plain CE on ŷ_P (no stop-gradients). `start_head` has keys `weight`, `bias`.
    """
    net, head = predictor.net, predictor.personal
    load_params(net, server_model)
    load_params(head, start_head)
    kw = budget.sgd(generator)
    if budget.method == "ft":
        for _ in sgd_epochs(predictor, data, **kw):
            yield Predictor(predictor, get_params(predictor))
    elif budget.method == "lp":
        net.eval()  # stays in eval mode: sgd_epochs switches only the head to train mode
        with torch.no_grad():
            feats = net.features(data.x[data.train])
        on_feats = ClientData(data.cid, feats, data.y[data.train], torch.arange(len(feats), device=feats.device),
                              data.val[:0], data.prior)  # fmt: skip
        body = {NET + k: v for k, v in server_model.items()}

        def forward(z: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                g = net.classify(z)
            return personal_logits(g, z, head)

        for _ in sgd_epochs(head, on_feats, forward=forward, **kw):
            yield Predictor(predictor, {**body, **prefixed(PERSONAL, get_params(head))}, feature_key=feature_key)
    else:
        raise ValueError(f"unknown personalization method {budget.method!r}")


def prefixed(prefix: str, tensors: Tensors) -> Tensors:
    return {prefix + k: v for k, v in tensors.items()}


def unprefixed(prefix: str, tensors: Tensors) -> Tensors:
    return {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}


# --- the algorithm ------------------------------------------------------------------------------------------------
class FedRoDOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    search: ClassVar[dict[str, Space]] = {"gamma": Search(0.0, 1.0), "personal_lr": Search(1e-3, 0.3, log=True)}

    gamma: float = Field(1.0, ge=0, description="exponent γ of the class counts in the balanced-softmax loss")
    personal_lr: float | None = Field(None, gt=0, description="SGD lr of the personal head (default: train.lr)",
                                      json_schema_extra=same_as("train.lr"))
    pfl_body: Literal["server", "local"] = Field(
        "server",
        description="body f, h_G of the P-FL model. server: θ̄, ψ̄ of the server, shared by all clients (features "
        "computed once per evaluation). local: the client's own θ*_m, ψ*_m from its last participated round "
        "(Algorithm 1's client output), kept in the client state — a whole model per client in memory and in "
        "checkpoints, and one body forward per client at evaluation; clients never sampled use θ̄, ψ̄. Training, "
        "G-FL and new clients are the same under both",
    )


class FedRoD(Algorithm):
    name = "fedrod"
    dp_refused = None  # replies: the shared entries' new values, averaged (client-level DP applies)
    Config = FedRoDOptions

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.model_keys = list(ctx.model.state_dict())
        d = feature_dim(ctx.model, ctx.source.input_shape)
        with torch.device("cpu"):  # built where the zoo builds models (its init draws from the CPU RNG), then moved
            self.head = PersonalHead(d, ctx.source.num_classes)
        self.head.to(ctx.device)
        self.predictor = AdditivePredictor(ctx.model, self.head)
        self.objective = DecoupledObjective(self.opts.gamma)  # one function: clients' plans batch together

    @property
    def personal_lr(self) -> float:
        return self.opts.personal_lr if self.opts.personal_lr is not None else self.ctx.cfg.train.lr

    def model_params(self, server: Tensors) -> Tensors:
        """θ̄, ψ̄ (the BlockNet's state) out of the server state."""
        if len(server) == len(self.model_keys):
            return server  # same dict object: predictions of the generic model are cached across calls
        return {k: server[k] for k in self.model_keys}

    def zero_head(self) -> Tensors:
        return {k: torch.zeros_like(v) for k, v in self.head.state_dict().items()}

    def additive(self, server: Tensors, head: Tensors, body: Tensors | None = None) -> Predictor:
        """A body f, h_G + a personal head (keys `weight`, `bias`) as one predictor; the body is θ̄, ψ̄ of `server`
        unless a client's own `body` (model state-dict keys) is given.

        The server's body is every client's, so evaluation computes its features once (`feature_key`) and runs
        only h_G + h_P per client. A client's own body is no one else's: no feature key, its own forward.
        """
        if body is not None:
            return Predictor(self.predictor, {**prefixed(NET, body), **prefixed(PERSONAL, head)})
        params = {**prefixed(NET, self.model_params(server)), **prefixed(PERSONAL, head)}
        return Predictor(self.predictor, params, feature_key=("fedrod-body", Same(server)))

    def local_body(self, reply: Tensors) -> Tensors:
        """What a client keeps of its upload: θ*_m, ψ*_m (copies, under `local.`) with `pfl_body: local`, else
        nothing."""
        if self.opts.pfl_body != "local":
            return {}
        return {LOCAL + k: reply[k].clone() for k in self.model_keys}

    def personal_body(self, state: Tensors) -> Tensors | None:
        """The body of client m's P-FL model if it is not the server's: θ*_m, ψ*_m from the client's state with
        `pfl_body: local` once it has been sampled; None (the server's θ̄, ψ̄) otherwise."""
        if self.opts.pfl_body != "local" or LOCAL + self.model_keys[0] not in state:
            return None
        return {k: state[LOCAL + k] for k in self.model_keys}

    # --- federation ------------------------------------------------------------------------------------------
    def init_server(self) -> Tensors:
        return dict(self.ctx.initial_params)

    def init_client(self, cid: int) -> Tensors:
        return prefixed(PERSONAL, self.zero_head())

    def configure(self, rnd: int, server: Tensors, cids: list[int]) -> dict[int, Tensors]:
        return {c: server for c in cids}

    def sgd_plan(self, payload: Tensors, state: Tensors, data: ClientData) -> LocalSGDPlan:
        """Eq. 8 and Eq. 9 together (deviation 2): θ, ψ at `train.lr` and φ_m (`personal.`) at `personal_lr`, one
        SGD step on both per batch, on `DecoupledObjective`; the reply is θ*, ψ* (the model's state), the new
        state φ*_m (and θ*_m, ψ*_m under `pfl_body: local`)."""
        t = self.ctx.cfg.train
        start = {**self.model_params(payload), **{k: v for k, v in state.items() if k.startswith(PERSONAL)}}
        phase = Phase(tuple(self.ctx.model.block_names()), t.local_epochs, t.lr, ((PERSONAL, self.personal_lr),))

        def finish(params: Tensors) -> tuple[Tensors, Tensors]:
            reply = {k: params[k] for k in self.model_keys}
            return reply, {**{k: v for k, v in params.items() if k.startswith(PERSONAL)}, **self.local_body(reply)}

        return LocalSGDPlan(start, (phase,), finish, self.objective, {"counts": class_counts(data)})

    def aggregator(self, rnd: int, server: Tensors, weights: dict[int, float]) -> WeightedMean:
        return WeightedMean(weights)  # Eq. 10

    # --- evaluation ------------------------------------------------------------------------------------------
    def generic_model(self, server: Tensors) -> Predictor:
        return Predictor(self.ctx.model, self.model_params(server))

    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        return self.additive(server, unprefixed(PERSONAL, state), self.personal_body(state))  # deviation 8

    def zero_shot(self, server: Tensors, data: ClientData) -> Predictor:
        return self.generic_model(server)  # ŷ_P with h_P at its (zero) initialisation

    def personalize(
        self, server: Tensors, data: ClientData, budget: Budget, generator: torch.Generator
    ) -> Iterator[Predictor]:
        yield from personalize_additive(self.predictor, self.model_params(server), self.zero_head(), data, budget,
                                        generator, feature_key=("fedrod-body", Same(server)))  # fmt: skip
