"""kNN-Per — Marfoq, Neglia, Kameni & Vidal, "Personalized Federated Learning through Local Memorization", ICML 2022
(arXiv 2111.09360; §3, the kNN-Per model and its algorithm).

Idea: a global model h = ψ ∘ φ (feature extractor φ = the model's body, head ψ) is trained collaboratively by
FedAvg; each client m then memorizes its local data in a datastore S_m = {(φ(x_j), y_j)} and predicts with the
interpolation of a local k-nearest-neighbours model on the shared representation and the global model:

    p_kNN(y | x) = Σ_{j ∈ N_k(x)} 1[y_j = y]·exp(−d(φ(x), φ(x_j))/T) / Σ_{j ∈ N_k(x)} exp(−d(φ(x), φ(x_j))/T)
    p_m(y | x)   = λ_m·p_kNN(y | x) + (1 − λ_m)·softmax(h(x))_y

N_k(x) = the k stored features nearest to φ(x). Both terms are probability distributions: the interpolation is of
probabilities, never of logits.

Training is FedAvg exactly (this class subclasses `FedAvg` and keeps its `configure`, `sgd_plan` and aggregator,
so the batched executors train it too): kNN-Per adds nothing to training; it is a personalization at inference.
G-FL scores the global model; P-FL scores the interpolated classifier of each client, built in `personal_model`
from the client's own data (the client state holds only its id, as in Per-FedAvg).

Defaults and where they come from:
- `distance = "sqeuclidean"`: squared Euclidean distance between features, the distance of the authors' datastore
  (an exact flat L2 index, which returns squared L2 distances) and of kNN-LM, which the kernel is taken from;
  `"euclidean"` (plain L2) is the option.
- `k = 7` neighbours: the authors' experiment scripts (heterogeneity and base-model studies, CIFAR-10/100: k = 7;
  their ablation varies k over {1, 3, 5, 7, 10}). k larger than the datastore uses the whole datastore.
- `temperature = None`: T = D, the feature dimension — the authors' code weighs a neighbour at squared distance d
  by exp(−d/(D·s)) with the kernel scale s = 1 (`--kernel_length_scale`, default 1). Dividing by D keeps the
  kernel's width comparable across feature sizes; a fixed T (e.g. 1, kNN-LM's plain exp(−d)) is the option. It
  matters: on LeNet-5's body (D = 84) trained by FedAvg on `fmnist-rot4`, the 7th neighbour of a training sample is
  a median 2.7 (squared) further than the 1st, so T = 1 weighs it e^−2.7 ≈ 0.07 of the nearest, T = D ≈ 0.97.
- λ_m: a hyper-parameter of each client (Eq. above), chosen per client on validation data over `lam_grid`
  (default {0, 0.1, …, 1}, the paper's range of λ), the value with the best validation accuracy (the smallest λ
  on ties: the one closest to the global model). Test data is never used — the authors' evaluation script
  reports a whole (λ, capacity) grid scored on test data; picking the best cell of it would select on test.
  `lam` fixes one λ for every client instead (λ = 0: the global model; λ = 1: the kNN model alone).
- Capacity: the datastore holds `capacity_fraction` (default 1: every local training sample, the paper's main
  setting) of the client's training samples, at most `capacity` samples if set; the paper's capacity study keeps
  a fraction of the local data, drawn at random. Capacity counts samples (never batches). The subset is drawn
  with a generator derived from (seed, stream 105, client id), so it is the same in every evaluation and executor.
  Only the client's training split ever enters the datastore (never validation or test data).

Choices and deviations:
- Features: the body's output (`BlockNet.features`) of the model in eval mode; the head gives p_model.
- Exact search (brute force in chunks of queries, so a 10k × 10k client needs no 10k × 10k matrix at once) where
  the authors use a FAISS index; ties in distance are broken by datastore order (lower pool index first), ties
  between classes by the lower class index (argmax). The kernel is computed as exp(−(d − d_min)/T), d_min being
  the query's nearest distance: the same normalized weights, without underflow when d/T is large.
- Validation data: the client's own val split (plain accuracy); a client without one (the PFLBED protocol gives
  clients none) uses its domain's shared val set, class-weighted by its training prior — the protocol's own
  validation score; with neither, λ = `lam_fallback` (default 0.5, the middle of the grid).
- A client with no training samples has an empty datastore: its model is the global model (λ = 0).
- `logits` of the personal predictor returns the interpolated probabilities (evaluation takes their argmax); with
  λ = 0 it returns the global model's logits themselves, so the predictions are the global model's exactly.
- New clients (the paper's RQ2: new clients build a datastore with the trained global model and no training):
  `new_client = "knn"` (default) yields one predictor, the frozen global features over the new client's own
  training data (there are no epochs to spend; Last = Best); `"ft+knn"` first fine-tunes the global model with the
  budget (`training.finetune_epochs`, FT or LP) and after every epoch yields the kNN-Per predictor built on the
  fine-tuned model's features and head. Zero-shot = the global model.
- `eval.finetune` (the participated clients, final round) goes through the same `personalize`. With
  `new_client = "knn"` it would fine-tune nothing and report kNN-Per itself under `final.ft` / `final.lp`, so it is
  skipped (`finetune_methods`: no such rows in the summary). With `"ft+knn"` the rows are kNN-Per on the model
  fine-tuned (ft) or linearly probed (lp) with the `eval.ft_*` budget: kNN-Per+FT / kNN-Per+LP.
- P-FL validation (`pfl_val`, which selects the reported round): each client's accuracy at its tuned λ, i.e. the
  maximum over `lam_grid` of its validation accuracy — the same data chose λ, so it is optimistic (more so the
  larger the grid and the smaller the validation set), and a round is selected on that optimistic figure. The
  test figures are not affected (λ never sees test data). A fixed `lam` makes `pfl_val` an unbiased estimate.
- Cost: `personal_model` rebuilds the client's datastore (one forward over its training samples) and tunes λ
  (one forward over its validation samples) at every evaluation; nothing but the client id is kept in its state.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from pflbed import rng
from pflbed.algorithms.base import Budget, ClientData, Predictor, Same, Tensors
from pflbed.algorithms.fedavg import FedAvg
from pflbed.algorithms.training import finetune_epochs, validation_data
from pflbed.search import IntSearch, Space

Weight = Annotated[float, Field(ge=0, le=1)]
DATASTORE_STREAM = 105  # rng stream tag of the datastore subsets (ktpfl uses 101)
CHUNK_ELEMENTS = 1 << 22  # distances held at once: queries per chunk × datastore size


class KNNPerOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # the authors: 7 (λ is chosen per client on validation already)
    search: ClassVar[dict[str, Space]] = {"k": IntSearch(1, 20)}
    k: int = Field(7, ge=1, description="neighbours of the local kNN model (the authors' experiments: 7)")
    temperature: float | None = Field(None, gt=0, description="T of the kernel exp(−d/T) (None: the feature "
                                      "dimension D, the authors' exp(−d/D))")  # fmt: skip
    distance: Literal["sqeuclidean", "euclidean"] = Field("sqeuclidean", description="d between features: squared "
                                                          "L2 (the authors' flat L2 index) or L2")  # fmt: skip
    lam: float | None = Field(None, ge=0, le=1, description="fixed λ for every client (None: tuned per client on "
                                                            "validation over lam_grid)")  # fmt: skip
    lam_grid: list[Weight] = Field(default_factory=lambda: [i / 10 for i in range(11)], min_length=1,
                                   description="λ candidates tuned on validation (smallest best on ties)")  # fmt: skip
    lam_fallback: float = Field(0.5, ge=0, le=1, description="λ of a client without any validation data")
    capacity_fraction: float = Field(1.0, gt=0, le=1, description="fraction of the client's training samples "
                                     "stored (random subset)")  # fmt: skip
    capacity: int | None = Field(None, ge=1, description="at most this many samples stored (None: no cap)")
    new_client: Literal["knn", "ft+knn"] = Field("knn", description="new clients: datastore on the global model, "
                                                 "or on the model fine-tuned with the budget first")  # fmt: skip


def pairwise_distances(q: torch.Tensor, s: torch.Tensor, distance: str) -> torch.Tensor:
    """d(q_i, s_j) for every pair: squared L2 or L2 (rows of `q` against rows of `s`)."""
    d2 = (q * q).sum(1, keepdim=True) - 2.0 * (q @ s.T) + (s * s).sum(1)
    d2 = d2.clamp_min(0.0)
    return d2 if distance == "sqeuclidean" else d2.sqrt()


def knn_probs(
    z: torch.Tensor, keys: torch.Tensor, labels: torch.Tensor, num_classes: int, k: int, temperature: float | None,
    distance: str = "sqeuclidean",
) -> torch.Tensor:  # fmt: skip
    """p_kNN(y | z) for every row of `z`: kernel-weighted votes exp(−d/T) of the k nearest `keys` (ties in distance
    by lower key index; T None: the feature dimension). Computed a chunk of queries at a time."""
    n, out = len(keys), torch.zeros(len(z), num_classes, device=z.device)
    if n == 0 or len(z) == 0:
        return out
    kk = min(k, n)
    z, keys = z.flatten(1).float(), keys.flatten(1).float()  # float32 distances under `executor.precision=bf16` too
    t = float(keys.shape[1]) if temperature is None else temperature
    rows = max(1, CHUNK_ELEMENTS // n)
    for i in range(0, len(z), rows):
        with torch.autocast(z.device.type, enabled=False):
            d = pairwise_distances(z[i : i + rows], keys, distance)
        d, nb = torch.sort(d, dim=1, stable=True)
        d, nb = d[:, :kk], nb[:, :kk]
        w = torch.exp(-(d - d[:, :1]) / t)  # ∝ exp(−d/T); the nearest neighbour weighs 1
        votes = torch.zeros(len(d), num_classes, device=z.device).scatter_add_(1, labels[nb], w)
        out[i : i + len(d)] = votes / w.sum(1, keepdim=True)
    return out


class KNNPerPredictor(Predictor):
    """The global model interpolated with a client's kNN model on its features: `logits` gives the interpolated
    probabilities (the model's logits where λ = 0)."""

    def __init__(self, model, params: Tensors, keys: torch.Tensor, labels: torch.Tensor, lam: float,
                 opts: KNNPerOptions, num_classes: int) -> None:  # fmt: skip
        super().__init__(model, params)
        self.keys, self.labels, self.lam, self.opts, self.num_classes = keys, labels, float(lam), opts, num_classes

    @property
    def group(self) -> tuple[Same, Same]:
        return Same(self.model), Same(self)  # one per client: never shares cached predictions with another

    def parts(self, x: torch.Tensor, batch_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
        """(p_kNN, model logits) of `x`."""
        z = self.features(x, batch_size)
        o = self.opts
        return knn_probs(z, self.keys, self.labels, self.num_classes, o.k, o.temperature, o.distance), self.classify(
            z, batch_size
        )

    def logits(self, x: torch.Tensor, batch_size: int = 1024) -> torch.Tensor:
        if self.lam == 0.0 or len(self.keys) == 0:
            return self.classify(self.features(x, batch_size), batch_size)
        p_knn, logits = self.parts(x, batch_size)
        return mix(p_knn, logits, self.lam)

    def module(self) -> KNNPerModule:
        """The model with this client's datastore and λ (`KNNPerModule`): the copy of the model alone would be the
        global model, not the client's kNN-Per classifier."""
        o = self.opts
        return KNNPerModule(super().module(), self.keys, self.labels, self.lam, self.num_classes, o.k, o.temperature,
                            o.distance).eval()  # fmt: skip


class KNNPerModule(torch.nn.Module):
    """A client's kNN-Per classifier as one module (a trained run's personal model, `pflbed personalize`): the
    network, the datastore (`keys`: training features, `labels`) and λ as buffers, so `state_dict` carries them
    all. Its forward is `KNNPerPredictor.logits` (the interpolated probabilities; the network's logits where
    λ = 0 or the datastore is empty). Loading a state dict takes the datastore's size from it: another client's
    datastore holds another number of samples."""

    def __init__(self, net: torch.nn.Module, keys: torch.Tensor, labels: torch.Tensor, lam: float, num_classes: int,
                 k: int, temperature: float | None, distance: str) -> None:  # fmt: skip
        super().__init__()
        self.net, self.num_classes, self.k, self.temperature, self.distance = net, num_classes, k, temperature, distance
        self.register_buffer("keys", keys.detach().clone())
        self.register_buffer("labels", labels.detach().clone())
        self.register_buffer("lam", torch.tensor(float(lam), dtype=torch.float64, device=keys.device))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        for name in ("keys", "labels"):
            if (saved := state_dict.get(prefix + name)) is not None and saved.shape != getattr(self, name).shape:
                setattr(self, name, getattr(self, name).new_empty(saved.shape))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.net.features(x)
        logits = self.net.classify(z)
        lam = float(self.lam)
        if lam == 0.0 or len(self.keys) == 0:
            return logits
        p_knn = knn_probs(z, self.keys, self.labels, self.num_classes, self.k, self.temperature, self.distance)
        return mix(p_knn, logits, lam)


def mix(p_knn: torch.Tensor, logits: torch.Tensor, lam: float) -> torch.Tensor:
    """λ·p_kNN + (1 − λ)·softmax(logits): the interpolation of probabilities."""
    return lam * p_knn + (1.0 - lam) * torch.softmax(logits.float(), dim=1)


class KNNPer(FedAvg):
    name = "knnper"
    Config = KNNPerOptions

    def init_client(self, cid: int) -> Tensors:
        return {"cid": torch.tensor(cid, device=self.ctx.device)}  # the personal model needs the client's data

    # --- the datastore and λ ---------------------------------------------------------------------------------
    def datastore_indices(self, data: ClientData) -> torch.Tensor:
        """The pool indices stored: `capacity_fraction` of the client's training samples (at most `capacity`),
        a random subset drawn from (seed, stream, client id), in pool order."""
        n, o = data.num_train, self.opts
        size = n if o.capacity_fraction >= 1.0 else max(1, int(o.capacity_fraction * n)) if n else 0
        if o.capacity is not None:
            size = min(size, o.capacity)
        if size >= n:
            return data.train.sort().values
        gen = rng.generator(self.ctx.seed, DATASTORE_STREAM, data.cid)
        pick = torch.randperm(n, generator=gen, device=gen.device)[:size].to(data.train.device)
        return data.train[pick].sort().values

    def choose_lam(self, pred: KNNPerPredictor, data: ClientData) -> float:
        """The λ of `lam_grid` with the best validation accuracy (smallest on ties); `lam_fallback` without
        validation data."""
        idx, weights = validation_data(self.ctx.federation, data)
        if idx.numel() == 0:
            return self.opts.lam_fallback
        y = data.y[idx]
        p_knn, logits = pred.parts(data.x[idx], self.ctx.cfg.eval.batch_size)
        best, best_acc = self.opts.lam_fallback, -1.0
        for lam in sorted(self.opts.lam_grid):  # ascending: on ties the first best is the smallest
            right = (mix(p_knn, logits, lam).argmax(1) == y).double()
            if weights is None:
                acc = float(right.mean())
            else:
                w = weights.double().to(y.device)[y]
                acc = float((w * right).sum() / w.sum()) if float(w.sum()) > 0 else float(right.mean())
            if acc > best_acc:
                best, best_acc = lam, acc
        return best

    def knn_model(self, params: Tensors, data: ClientData) -> KNNPerPredictor:
        """The kNN-Per classifier of `data`'s client on the model `params`: datastore of its training features,
        λ fixed or tuned on its validation data."""
        model = self.ctx.model
        store = self.datastore_indices(data)
        base = Predictor(model, params)
        keys = base.features(data.x[store], self.ctx.cfg.eval.batch_size) if store.numel() else data.x[:0]
        pred = KNNPerPredictor(model, params, keys, data.y[store], 0.0, self.opts, self.ctx.source.num_classes)
        if store.numel():
            pred.lam = self.opts.lam if self.opts.lam is not None else self.choose_lam(pred, data)
        return pred

    # --- evaluation and new clients --------------------------------------------------------------------------
    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        return self.knn_model(server, self.ctx.client_data(int(state["cid"])))

    def finetune_methods(self, server: Tensors, methods: list[str]) -> list[str]:
        """None with `new_client = "knn"` (nothing would be fine-tuned: the rows would be kNN-Per relabeled)."""
        return [] if self.opts.new_client == "knn" else super().finetune_methods(server, methods)

    def personalize(
        self, server: Tensors, data: ClientData, budget: Budget, generator: torch.Generator
    ) -> Iterator[Predictor]:
        """knn: one kNN-Per model on the global model and the new client's own data; ft+knn: fine-tune with the
        budget, a kNN-Per model on the fine-tuned model after every epoch."""
        if self.opts.new_client == "knn":
            yield self.knn_model(server, data)
            return
        for tuned in finetune_epochs(self.ctx.model, server, data, budget, generator):
            yield self.knn_model(tuned.params, data)
