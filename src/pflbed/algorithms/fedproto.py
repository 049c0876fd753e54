"""FedProto — Tan, Long, Liu, Zhou, Lu, Jiang & Zhang, "FedProto: Federated Prototype Learning across Heterogeneous
Clients", AAAI 2022 (arXiv 2105.00243), Algorithm 1.

Source note: the stored copies of the paper that could be read here hold its abstract and introduction only. The
equations below are the paper's method as public discussions of it quote it (Eq. 6's structure is quoted in the
authors' issue tracker; the other numbers are the paper's as remembered, not checked against its text) and as the
authors' public code computes it (read, not copied). Where the two differ, the choice is stated below.

Idea: clients never exchange models. Client i's model F_i = g_i ∘ f_i (f_i the embedding: the BlockNet body, its
output flattened to a d-vector; g_i the decision layers: the head) stays on the client, personal from start to end.
Only class prototypes travel: the mean embedding of each class.

  Local prototype of class j on client i (Eq. 5), D_{i,j} its training samples of class j:
      C_i^(j) = (1/|D_{i,j}|)·Σ_{(x,y) ∈ D_{i,j}} f_i(x).
  Global prototype (Eq. 6), N_j the clients that hold class j:
      C̄^(j) = Σ_{i ∈ N_j} |D_{i,j}|·C_i^(j) / Σ_{i ∈ N_j} |D_{i,j}|                    (`weighting: samples`).
  Local objective (Eq. 8), trained by E epochs of mini-batch SGD from the client's own model:
      L_i = L_S(F_i(x), y) + λ·L_R,   L_S the cross-entropy, L_R the distance of the embeddings to C̄
      (`regularizer`, choice 3); a class without a global prototype adds nothing (all of them in the first round:
      plain local training).
  Inference: ŷ = argmin_j ‖f_i(x) − C̄^(j)‖₂, the nearest global prototype in the client's own embedding space.

Round: the server sends every sampled client C̄ (and which classes have one); the client trains on Eq. 8 from its
own model, then replies its local prototypes C_i^(j) and class counts |D_{i,j}|; the server forms C̄ (Eq. 6).

Choices and deviations:
 1. Eq. 6. The paper weights each local prototype by the client's share of class j, |D_{i,j}|/N_j, and prints an
    extra factor 1/|N_j| before the sum; taken literally that shrinks every global prototype by the number of
    clients holding its class (the authors' tracker has an open question on it), so it is read as the weighted
    mean above. The authors' code takes the plain mean over the clients holding j instead (`weighting: clients`):
    it changes results wherever clients hold a class in unequal amounts.
 2. Local prototypes (`local_protos`). `final` (default): Eq. 5 as written, with the client's model after its local
    training, over all its training samples, in eval mode (no dropout; BatchNorm's running statistics), computed
    in float32 with autocast off. The authors' code instead averages the embeddings that the training forwards of
    the last local epoch produced (train mode, each batch's before its step): `last_epoch`. That one needs the
    training's own forwards, so its clients train one by one (no `executor.batch_clients` grouping).
 3. The regulariser L_R (`regularizer`). The paper writes it between the global and the local prototypes,
    λ·Σ_j L_R(C̄^(j), C_i^(j)), as remembered; the authors' code, which produced the paper's numbers, puts every
    sample's embedding against its class's global prototype with torch's MSELoss (mean over the batch and the d
    features; a sample of a class without a prototype counts 0). The default is the code's (`per_sample`):
        L_R = (1/B)·Σ_b 1[C̄^(y_b) exists]·‖f_i(x_b) − C̄^(y_b)‖²/d.
    `class_mean` is the paper's form on each mini-batch: Σ_j ‖C_{i,batch}^(j) − C̄^(j)‖²/d over the classes of the
    batch that have a global prototype, C_{i,batch}^(j) the batch's mean embedding of class j (the same 1/d).
 4. Partial participation (the paper and its code train every client every round): the server forms C̄^(j) from
    the round's replies; a class that none of them holds keeps its previous global prototype (none before any
    client held it), so a class never disappears from the clients' regulariser and predictions.
 5. Prediction (`predict`): `prototypes` (default): nearest global prototype over every class that has one (the
    paper's rule). `own_prototypes`: only over the classes of the client's own training data, as the authors'
    evaluation code does. `head`: the client's own classifier head, the code's other readout. A class without a
    global prototype is never predicted; before any prototype exists, the head predicts.
 6. Initialisation: every client starts from the run's initial model (`model.init_from` where set); the authors'
    code initialises each client's model separately. All parameters train with `train.*` (lr, momentum, weight
    decay, batch size, `local_epochs`); the optimizer is new each round (momentum restarts, as in the code).
 7. Models (`models`). Unset (default): one architecture for all clients, the run's `model.name`. Set, the paper's
    heterogeneous setting: each client trains its own architecture, client c of the N clients (new ones included
    in the id range) models[⌊c·A/N⌋], A the list's length — the contiguous equal blocks of `feddf` and `ktpfl`
    (`training.architecture_of`: 20 clients, [lenet5, lenet5_bn]: 0–9 lenet5, 10–19 lenet5_bn); a name listed
    twice gets two blocks. Nothing changes on the wire: prototypes and counts of every architecture go into one
    C̄^(j) per class (Eq. 6 across architectures), which every client regularises towards and predicts by in its
    own embedding space. That needs one embedding size d for all architectures: the paper has no projection
    layer, so a list whose bodies' flattened outputs differ in size on the run's data is refused as a config
    error (`algorithm.models`), as is an unknown name (the zoo's sizes, 28×28 or 32×32 input: 84 lenet5,
    lenet5_bn; 200 mlp; 512 cnn, cnn_bn, resnet18, resnet18_imagenet, resnet34, resnet34_imagenet; 1024
    alexnet_small_x025, shufflenetv2, shufflenetv2_x05, mobilenet_v1, mobilenet_v1_imagenet; 128 resnet18_x025;
    4096 alexnet_small). Initial models (choice 6 per architecture): the
    architecture equal to `model.name` starts from the run's initial model — `models: [<model.name>]` is the
    default run bit for bit — every other from one initialisation of its own, seeded by (seed, init stream,
    FedProto's stream, its index among the distinct names), shared by all its clients (the paper does not say;
    the authors' code gives every client its own). Under `executor.batch_clients` the clients of the run's model
    train together; the others one by one.
 8. There is no global model: G-FL is null, and no +FT/+LP rows are reported for the participated clients.
    New clients (`personalize`) receive C̄ and train their architecture's initial model (the run's by default) on
    Eq. 8 with the budget (`ft`: every block; `lp`: the head only, which leaves the embeddings and so the prototype
    readout at the initial model), predicting as in 5 after each epoch. `zero_shot`: none (an untrained embedding).

Defaults (`algorithm.<key>`): λ = `lam` 1.0 (the code's default and its MNIST/FEMNIST runs; 0.1 for CIFAR-10),
searched log-uniformly over [0.01, 10]. The code's other settings (momentum 0.5, lr 0.01, batch size 4, one local
epoch) are `train.*` here.

Communication per round: down C×d + C numbers; up C×d + C. The client's model never leaves it.
DP does not apply (its replies are prototypes and counts, not new values of a shared model). Nothing in the server
state belongs to one client: a site-local site receives the whole (shared) state. The update is a plan
(`sgd_plan`) with `local_protos: final`: `executor.batch_clients` trains a round's clients of the run's model
together.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from functools import partial
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from pflbed import rng
from pflbed.algorithms.base import Algorithm, Budget, ClientContext, ClientData, Context, Predictor, Tensors
from pflbed.algorithms.fedrod import feature_dim
from pflbed.algorithms.local_sgd import LocalSGDPlan, Phase, features_and_logits, run_plan, weighted_mean
from pflbed.algorithms.partial import block_params, blocks_for, frozen
from pflbed.algorithms.reply_shapes import misfit
from pflbed.algorithms.training import architecture_of, get_params, load_params, sgd_epochs
from pflbed.errors import ConfigError
from pflbed.models import BlockNet, ModelNames
from pflbed.search import Search, Space

NET = "net."  # the prototype classifier's keys of the wrapped model
CHUNK_ELEMENTS = 1 << 22  # rows × classes × d of one distance computation
STREAM = 0xF9070  # FedProto's own random stream (not one of pflbed.rng's tags): the other architectures' initial models


class FedProtoOptions(BaseModel):
    """FedProto options."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    search: ClassVar[dict[str, Space]] = {"lam": Search(0.01, 10.0, log=True)}  # code: 1 (MNIST), 0.1 (CIFAR-10)
    lam: float = Field(1.0, ge=0, le=1e4, description="λ: weight of the prototype regulariser L_R (0: local "
                       "training, predicting by the prototypes)")  # fmt: skip
    weighting: Literal["samples", "clients"] = Field(
        "samples", description="global prototypes: samples = weighted by each client's class count (Eq. 6); "
        "clients = plain mean over the clients holding the class (the authors' code)")  # fmt: skip
    regularizer: Literal["per_sample", "class_mean"] = Field(
        "per_sample", description="L_R: per_sample = every embedding against its class's prototype (the code's "
        "MSE); class_mean = each class's batch mean against it (the paper's form)")  # fmt: skip
    local_protos: Literal["final", "last_epoch"] = Field(
        "final", description="final = Eq. 5 with the trained model (eval mode); last_epoch = mean of the last "
        "local epoch's training embeddings (the code; clients then train one by one)")  # fmt: skip
    predict: Literal["prototypes", "own_prototypes", "head"] = Field(
        "prototypes", description="P-FL readout: nearest global prototype over all classes (the paper), over the "
        "client's own classes (the code's evaluation), or the client's own head")  # fmt: skip
    models: ModelNames | None = Field(
        None, min_length=1, description="heterogeneous clients (choice 7): client c of N trains "
        "models[⌊c·A/N⌋] (A the list's length, new clients in the id range), every one with the same embedding "
        "size; unset: every client the run's model.name")  # fmt: skip


# --- the pieces ----------------------------------------------------------------------------------------------------
def class_means(z: torch.Tensor, y: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(C × d mean embedding per class, zero where a class has no sample; C sample counts), float64: Eq. 5."""
    flat = z.flatten(1).double()
    onehot = (y.unsqueeze(1) == torch.arange(num_classes, device=y.device)).double()  # a matmul: no atomics
    counts = onehot.sum(0)
    return onehot.T @ flat / counts.clamp_min(1.0).unsqueeze(1), counts


def embeddings(model: BlockNet, x: torch.Tensor, rows: int = 1024) -> torch.Tensor:
    """f(x) flattened, eval mode, no gradient, float32 with autocast off (a prototype is exchanged in float32)."""
    model.eval()
    with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
        return torch.cat([model.features(x[i : i + rows]).flatten(1).float() for i in range(0, max(len(x), 1), rows)])


class PrototypeObjective:
    """Eq. 8 on a batch: CE + λ·L_R (choice 3), the global prototypes `protos` and their `proto_mask` the plan's
    constants. In the loop (`w` None) batch means; in a batched step each client's real samples weighted by `w`.
    One object per algorithm: plans that share it train together."""

    def __init__(self, lam: float, regularizer: str) -> None:
        self.lam, self.regularizer = lam, regularizer

    def __call__(
        self, model: BlockNet, params: Tensors, consts: Tensors, x: torch.Tensor, y: torch.Tensor,
        w: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        return self.loss(model, params, consts, x, y, w)[0]

    def loss(
        self, model: BlockNet, params: Tensors, consts: Tensors, x: torch.Tensor, y: torch.Tensor,
        w: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(the loss, the batch's embeddings)."""
        z, logits = features_and_logits(model, params, x)
        ce = F.cross_entropy(logits, y, reduction="mean" if w is None else "none")
        ce = ce if w is None else weighted_mean(ce, w)
        if not self.lam:
            return ce, z
        return ce + self.lam * self.distance(z, y, consts["protos"], consts["proto_mask"], w), z

    def distance(self, z: torch.Tensor, y: torch.Tensor, protos: torch.Tensor, mask: torch.Tensor,
                 w: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        """L_R of the embeddings `z` of a batch labelled `y`; classes with `mask` 0 add nothing."""
        flat = z.flatten(1)
        protos, mask = protos.to(flat.dtype), mask.to(flat.dtype)
        if self.regularizer == "per_sample":
            return weighted_mean(((flat - protos[y]) ** 2).mean(1) * mask[y], w)
        onehot = (y.unsqueeze(1) == torch.arange(len(protos), device=y.device)).to(flat.dtype)
        ww = torch.ones_like(y, dtype=flat.dtype) if w is None else w.to(flat.dtype)
        counts = onehot.T @ ww  # padding (weight 0) is no sample
        means = onehot.T @ (flat * ww.unsqueeze(1)) / torch.where(counts > 0, counts, 1.0).unsqueeze(1)
        present = (counts > 0).to(flat.dtype) * mask
        return (((means - protos) ** 2).mean(1) * present).sum()


class Recorder:
    """The plan's objective, keeping the embeddings of the last epoch's training forwards (`local_protos:
    last_epoch`): the authors' code's local prototypes. Made per client update (loop only)."""

    def __init__(self, objective: PrototypeObjective, skip: int) -> None:
        self.objective, self.skip = objective, skip  # forwards before the last epoch's first
        self.z: list[torch.Tensor] = []
        self.y: list[torch.Tensor] = []

    def __call__(
        self, model: BlockNet, params: Tensors, consts: Tensors, x: torch.Tensor, y: torch.Tensor,
        w: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        loss, z = self.objective.loss(model, params, consts, x, y, w)
        if self.skip > 0:
            self.skip -= 1
        else:
            self.z.append(z.detach().flatten(1).float())
            self.y.append(y)
        return loss


class PrototypeClassifier(nn.Module):
    """ŷ = argmin_j ‖f(x) − C̄^(j)‖² over the allowed classes: `forward` gives −‖f(x) − C̄^(j)‖² as logits (−∞ where a
    class is not allowed; the head's logits when none is). Keys: the model's under `net.`, `protos` (C × d) and
    `allowed` (C, 1 or 0). A module, so a predictor of it is a plain `Predictor` (copied, pickled, run anywhere)."""

    def __init__(self, net: BlockNet, num_classes: int, dim: int) -> None:
        super().__init__()
        self.net = net
        device = next(net.parameters()).device
        self.register_buffer("protos", torch.zeros(num_classes, dim, device=device))
        self.register_buffer("allowed", torch.zeros(num_classes, device=device))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.net.features(x)

    def classify(self, z: torch.Tensor) -> torch.Tensor:
        allowed = self.allowed > 0
        if not bool(allowed.any()):
            return self.net.classify(z)
        with torch.autocast(z.device.type, enabled=False):
            flat, protos = z.flatten(1).float(), self.protos.float()
            rows = max(1, CHUNK_ELEMENTS // max(protos.numel(), 1))  # row by row exact: any chunking, one result
            d = torch.cat([((flat[i : i + rows].unsqueeze(1) - protos) ** 2).sum(2)
                           for i in range(0, max(len(flat), 1), rows)])  # fmt: skip
        return (-d).masked_fill(~allowed, -math.inf)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classify(self.features(x))


# --- the algorithm -------------------------------------------------------------------------------------------------
class FedProto(Algorithm):
    name = "fedproto"
    Config = FedProtoOptions
    dp_refused = ("its replies are each client's class prototypes and counts, which the server combines per class "
                  "with the replied counts, not new values of a shared model")  # fmt: skip

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        run_model = ctx.cfg.model.name
        self.n_total = len(ctx.federation.clients)
        self.blocks = list(self.opts.models or [run_model])  # client c: blocks[⌊c·A/N⌋] (choice 7)
        self.archs = list(dict.fromkeys(self.blocks))  # distinct architectures, first-seen order
        self.models: dict[str, BlockNet] = {run_model: ctx.model}
        self.initial: dict[str, Tensors] = {run_model: ctx.initial_params}
        for i, a in enumerate(self.archs):
            if a not in self.models:  # its own initial model, seeded by (seed, init, FedProto's stream, index)
                with rng.fork(ctx.device):
                    rng.seed_global(rng.derive_seed(ctx.seed, rng.INIT, STREAM, i), ctx.device)
                    self.models[a] = ctx.new_model(a)
                self.initial[a] = get_params(self.models[a])
        dims = {a: feature_dim(self.models[a], ctx.source.input_shape) for a in self.archs}
        if len(set(dims.values())) > 1:
            sizes, shape = ", ".join(f"{a} {d}" for a, d in dims.items()), "×".join(map(str, ctx.source.input_shape))
            raise ConfigError(f"algorithm.models: FedProto averages prototypes across architectures, so their "
                              f"embeddings (the body's flattened output) need one size; on {shape} inputs they "
                              f"differ ({sizes})")  # fmt: skip
        self.keys = {a: list(self.models[a].state_dict()) for a in self.archs}
        self.num_classes = ctx.source.num_classes
        self.dim = dims[self.archs[0]]
        self.objective = PrototypeObjective(self.opts.lam, self.opts.regularizer)  # one: plans batch together
        self.classifiers = {a: PrototypeClassifier(self.models[a], self.num_classes, self.dim) for a in self.archs}

    def arch_of(self, cid: int) -> str:
        """Client `cid`'s architecture (choice 7): contiguous blocks of ids, as in `feddf` and `ktpfl`."""
        return architecture_of(cid, self.blocks, self.n_total)

    # --- federation ------------------------------------------------------------------------------------------
    def init_server(self) -> Tensors:
        dev = self.ctx.device
        return {"protos": torch.zeros(self.num_classes, self.dim, device=dev),
                "proto_mask": torch.zeros(self.num_classes, device=dev)}  # fmt: skip

    def init_client(self, cid: int) -> Tensors:
        """The client's own model (its architecture's initial one, choices 6 and 7) and its id."""
        return {"cid": torch.tensor(cid, device=self.ctx.device), **self.initial[self.arch_of(cid)]}

    def configure(self, rnd: int, server: Tensors, cids: list[int]) -> dict[int, Tensors]:
        payload = {"protos": server["protos"], "proto_mask": server["proto_mask"]}
        return dict.fromkeys(cids, payload)

    def plan(self, payload: Tensors, state: Tensors, data: ClientData, objective, finish) -> LocalSGDPlan:
        """E epochs of SGD on every block from the client's own model (of its architecture) on `objective`
        (Eq. 8), the global prototypes the constants."""
        t, arch = self.ctx.cfg.train, self.arch_of(data.cid)
        phase = Phase(tuple(self.models[arch].block_names()), t.local_epochs, t.lr)
        consts = {"protos": payload["protos"], "proto_mask": payload["proto_mask"]}
        return LocalSGDPlan({k: state[k] for k in self.keys[arch]}, (phase,), finish, objective, consts)

    def final_plan(self, payload: Tensors, state: Tensors, data: ClientData) -> LocalSGDPlan:
        """The plan with the local prototypes by Eq. 5 in its `finish` (`local_protos: final`)."""
        dtype, model = payload["protos"].dtype, self.models[self.arch_of(data.cid)]
        return self.plan(payload, state, data, self.objective, partial(self._final, model, data, state["cid"], dtype))

    def sgd_plan(self, payload: Tensors, state: Tensors, data: ClientData) -> LocalSGDPlan | None:
        """The plan of a client of the run's model; None under `local_protos: last_epoch`, whose prototypes come
        from the training forwards, and for a client of another architecture (`executor.batch_clients` stacks
        clients of the run's model): those train one by one (`client_update`)."""
        if self.opts.local_protos == "last_epoch" or self.models[self.arch_of(data.cid)] is not self.ctx.model:
            return None
        return self.final_plan(payload, state, data)

    def client_update(
        self, payload: Tensors, state: Tensors, data: ClientData, cctx: ClientContext
    ) -> tuple[Tensors, Tensors]:
        t, model = self.ctx.cfg.train, self.models[self.arch_of(data.cid)]
        if self.opts.local_protos == "final":
            return run_plan(model, self.final_plan(payload, state, data), data, t, cctx.generator)
        per_epoch = math.ceil(data.num_train / t.batch_size)
        rec = Recorder(self.objective, (t.local_epochs - 1) * per_epoch)
        finish = partial(self._recorded, rec, state["cid"], payload["protos"].dtype)
        return run_plan(model, self.plan(payload, state, data, rec, finish), data, t, cctx.generator)

    def _final(self, model: BlockNet, data: ClientData, cid: torch.Tensor, dtype: torch.dtype, trained: Tensors
               ) -> tuple[Tensors, Tensors]:  # fmt: skip
        """Eq. 5 with the trained model over the client's training samples; the model kept."""
        load_params(model, trained)
        z = embeddings(model, data.x[data.train])
        return self._reply(*class_means(z, data.y[data.train], self.num_classes), dtype), {"cid": cid, **trained}

    def _recorded(self, rec: Recorder, cid: torch.Tensor, dtype: torch.dtype, trained: Tensors
                  ) -> tuple[Tensors, Tensors]:  # fmt: skip
        """The mean of the last epoch's training embeddings per class (choice 2, `last_epoch`). The last epoch
        recorded a batch at least: every client has a training sample (a federation or a site refuses one without),
        and `train.local_epochs` is at least 1."""
        z, y = torch.cat(rec.z), torch.cat(rec.y)
        return self._reply(*class_means(z, y, self.num_classes), dtype), {"cid": cid, **trained}

    @staticmethod
    def _reply(protos: torch.Tensor, counts: torch.Tensor, dtype: torch.dtype) -> Tensors:
        return {"proto": protos.to(dtype), "count": counts.to(dtype)}

    def aggregate(self, rnd: int, server: Tensors, replies: dict[int, Tensors], weights: dict[int, float]) -> Tensors:
        """Eq. 6 per class over the round's replies (`weighting`, choice 1); a class no reply holds keeps its
        prototype (choice 4). The engine's `weights` are not used: the weights are the replied class counts."""
        cids = sorted(replies)
        counts = torch.stack([replies[c]["count"].double() for c in cids])  # m × C
        protos = torch.stack([replies[c]["proto"].double() for c in cids])  # m × C × d
        held = counts > 0
        w = counts * held if self.opts.weighting == "samples" else held.double()
        total = w.sum(0)
        glob = (w.unsqueeze(2) * protos).sum(0) / total.clamp_min(1e-300).unsqueeze(1)
        new = held.any(0)
        one = torch.ones_like(server["proto_mask"])
        return {"protos": torch.where(new.unsqueeze(1), glob.to(server["protos"]), server["protos"]),
                "proto_mask": torch.where(new, one, server["proto_mask"])}  # fmt: skip

    def reply_fits(self, payload: Tensors, reply: Tensors) -> str | None:
        """None if `reply` is what a client replies to `payload`, else why not: its prototypes `proto` (C × d) and
        class counts `count` (C, none negative: the server weighs by them) in the dtype of the prototypes sent."""
        protos = payload["protos"]
        why = misfit(reply, {"proto": (tuple(protos.shape), protos.dtype), "count": ((protos.shape[0],), protos.dtype)})
        if why is None and bool((reply["count"] < 0).any()):
            return "has 'count' with a negative entry"
        return why

    # --- evaluation and new clients --------------------------------------------------------------------------
    def predictor(self, arch: str, model_params: Tensors, server: Tensors, classes: torch.Tensor | None
                  ) -> Predictor:  # fmt: skip
        """The readout of `predict` (choice 5) on a client's model of architecture `arch`; `classes`: its own
        classes (bool, C)."""
        keys = self.keys[arch]
        if self.opts.predict == "head":
            return Predictor(self.models[arch], {k: model_params[k] for k in keys})
        allowed = server["proto_mask"] > 0
        if self.opts.predict == "own_prototypes" and classes is not None:
            allowed = allowed & classes
        params = {**{NET + k: model_params[k] for k in keys}, "protos": server["protos"],
                  "allowed": allowed.to(server["proto_mask"].dtype)}  # fmt: skip
        return Predictor(self.classifiers[arch], params)

    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        cid = int(state["cid"])
        return self.predictor(self.arch_of(cid), state, server, self.ctx.federation.clients[cid].prior > 0)

    def personalize(
        self, server: Tensors, data: ClientData, budget: Budget, generator: torch.Generator
    ) -> Iterator[Predictor]:
        """A new client: Eq. 8 towards the received C̄ from its architecture's initial model (choice 8), after each
        epoch its model with the readout of `predict`."""
        arch = self.arch_of(data.cid)
        model = self.models[arch]
        load_params(model, self.initial[arch])
        blocks = blocks_for(budget, model, lp=model.head_blocks())
        others = [b for b in model.block_names() if b not in set(blocks)]
        protos, mask = server["protos"], server["proto_mask"]

        def loss(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            ce = F.cross_entropy(model.classify(z), y)
            return ce + self.opts.lam * self.objective.distance(z, y, protos, mask, None) if self.opts.lam else ce

        epochs = sgd_epochs(model, data, **budget.sgd(generator), params=block_params(model, blocks), loss_fn=loss,
                            forward=model.features)  # fmt: skip
        for _ in range(budget.epochs):
            with frozen(model, others):
                next(epochs)
            yield self.predictor(arch, get_params(model), server, data.prior > 0)

    def zero_shot(self, server: Tensors, data: ClientData) -> Predictor | None:
        return None

    def diagnostics(self, rnd: int, server: Tensors, state_of) -> dict:
        """`proto_classes`: how many classes have a global prototype."""
        return {"proto_classes": int(server["proto_mask"].sum())}
