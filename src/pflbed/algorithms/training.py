"""Shared training pieces, as plain functions (not base-class layers) so algorithms compose them freely."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pflbed import compute, rng
from pflbed.algorithms.common import Budget, ClientData, Predictor, Same, Tensors, load_params
from pflbed.algorithms.sgd import SGD
from pflbed.federation import Federation
from pflbed.models import BlockNet

if TYPE_CHECKING:
    from pflbed.config import TrainConfig  # annotations only

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def get_params(model: nn.Module, keys: Iterable[str] | None = None) -> Tensors:
    """Detached copies of the model's state (all of it, or `keys`)."""
    state = model.state_dict()
    return {k: state[k].clone() for k in (keys if keys is not None else state)}


def architecture_of(cid: int, architectures: list[str], n_clients: int) -> str:
    """Heterogeneous federations: contiguous equal blocks of client ids per architecture (20 clients, 4
    architectures: 0–4 the first, 5–9 the second, …), new clients included in the id range — one rule for every
    algorithm, so that the same config gives every client the same model in all of them."""
    return architectures[cid * len(architectures) // n_clients]


def fresh_client_params(model: nn.Module, seed: int, cid: int) -> Tensors:
    """A new random initialization of `model` seeded by (run seed, client id) alone: heterogeneous clients build
    their models independently, and two algorithms on the same config start each client from the same weights.

    Drawn on the CPU (a copy of a model on another device), like `build_model`'s initialization: one seed gives the
    same weights on every device. The result is on the model's device.
    """
    device = next(model.parameters()).device
    template = model if device.type == "cpu" else copy.deepcopy(model).cpu()
    with rng.fork(device):
        torch.manual_seed(rng.derive_seed(seed, rng.INIT, 1 + cid))
        for m in template.modules():
            if m is not template and hasattr(m, "reset_parameters"):
                m.reset_parameters()
    return {k: v.to(device) for k, v in get_params(template).items()}


def validation_data(fed: Federation, data: ClientData) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(pool indices, class weights or None) a client validates on inside an algorithm: its own val split; without
    one (PFLBED gives clients none) its domain's shared val set, weighted by the client's training class prior —
    the data and weighting the protocol scores that client's validation accuracy with; else an empty split. Never
    test data."""
    if data.val.numel():
        return data.val, None
    if fed.domain_val and data.cid < len(fed.clients):
        return fed.domain_val[fed.clients[data.cid].domain], data.prior
    return data.val, None


def index_batches(
    idx: torch.Tensor, batch_size: int, epochs: int, generator: torch.Generator, passes: int = 1
) -> Iterator[torch.Tensor]:
    """Shuffled mini-batches of indices, epoch after epoch; the last batch of an epoch may be smaller.

    The permutation is drawn on the generator's device (the CPU: one seed, the same order on every device) and
    applied to `idx`, so the batches are on `idx`'s device — the data's, since the federation's indices live there.
    Each batch is counted as training work (`pflbed.compute`) when it is taken: its samples times `passes`, the
    gradient computations the caller makes on it.
    """
    for _ in range(epochs):
        perm = idx[torch.randperm(len(idx), generator=generator, device=generator.device)]
        for b in perm.split(batch_size):
            compute.add(len(b) * passes)
            yield b


def sgd_epochs(
    model: nn.Module,
    data: ClientData,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    generator: torch.Generator,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    params: Iterable[nn.Parameter] | None = None,
    loss_fn: LossFn = F.cross_entropy,
    forward: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Iterator[float]:
    """Mini-batch SGD on the client's training indices, yielding the mean loss after each epoch. Batches come
    through `ClientData.batch` (the run's augmentation, drawn from `generator` after each batch's indices).

    `params` restricts what the optimizer updates; `forward` replaces `model(x)` (e.g. a head on cached
    features). One optimizer for all epochs, created per call: FedAvg clients start each round without
    momentum history.
    """
    trainable = list(params) if params is not None else list(model.parameters())
    opt = SGD(trainable, lr=lr, momentum=momentum, weight_decay=weight_decay)
    fwd = forward or model
    for _ in range(epochs):
        model.train()  # every epoch: a consumer may have evaluated (eval mode) between two epochs
        total, steps = torch.zeros((), device=data.x.device), 0  # a device scalar: no sync per step on a GPU
        for b in index_batches(data.train, batch_size, 1, generator):
            x, y = data.batch(b, generator)
            loss = loss_fn(fwd(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.detach()
            steps += 1
        yield float(total) / max(steps, 1)


def local_sgd(model: nn.Module, data: ClientData, **kwargs) -> float:
    """`sgd_epochs` run to the end; returns the mean training loss over all epochs."""
    losses = list(sgd_epochs(model, data, **kwargs))
    return sum(losses) / max(len(losses), 1)


def train_from(
    model: nn.Module, start: Tensors, data: ClientData, train: TrainConfig, generator: torch.Generator
) -> Tensors:
    """Load `start`, run the configured local SGD (`train.*` keys) on the client's data, return the new state."""
    load_params(model, start)
    local_sgd(
        model,
        data,
        epochs=train.local_epochs,
        batch_size=train.batch_size,
        lr=train.lr,
        momentum=train.momentum,
        weight_decay=train.weight_decay,
        generator=generator,
    )
    return get_params(model)


def weighted_mean(replies: dict[int, Tensors], weights: dict[int, float], keys: Iterable[str] | None = None) -> Tensors:
    """Σ_m w_m·x_m / Σ_m w_m per key (`WeightedMean` over `replies` in their order)."""
    agg = WeightedMean({c: weights[c] for c in replies}, keys)
    for c, reply in replies.items():
        agg.add(c, reply)
    return agg.result()


class WeightedMean:
    """Σ_m w_m·x_m / Σ_m w_m per key, one reply at a time (an `Aggregator`): float tensors accumulate w_m/Σw·x_m
    in the order the replies come, integer tensors (e.g. BN's batch counters) take the maximum. `weights` names
    every client to come; the normalized weights are computed up front in float64. `keys`: which keys to average
    (default: all of the first reply's); `base`: tensors the result carries unchanged besides (e.g. a frozen
    head)."""

    def __init__(self, weights: dict[int, float], keys: Iterable[str] | None = None, base: Tensors | None = None):
        w = torch.tensor([float(v) for v in weights.values()], dtype=torch.float64, device="cpu")  # host numbers
        self.w = dict(zip(weights, (w / w.sum()).tolist(), strict=True))
        self.keys = list(keys) if keys is not None else None
        self.base = base or {}
        self.out: Tensors = {}
        self.floats: list[str] = []  # the keys averaged
        self.ints: list[str] = []  # the keys whose maximum is taken
        self.added = 0

    def add(self, cid: int, reply: Tensors) -> None:
        """Fold `reply` in: its float tensors with one multi-tensor call (`torch._foreach_add_`, each tensor's own
        `add_` on a CPU, the same numbers) — why: on a GPU every call is a launch from the host, and a reply of a
        10-tensor model was 10 launches a client, 1,000 a round of 100 clients, while the device sat idle."""
        self.added += 1
        if self.added == 1:
            self.keys = self.keys if self.keys is not None else list(reply)
            self.out = {k: torch.zeros_like(reply[k]) if reply[k].is_floating_point() else reply[k].clone()
                        for k in self.keys}  # fmt: skip
            self.floats = [k for k in self.keys if self.out[k].is_floating_point()]
            self.ints = [k for k in self.keys if k not in self.floats]
        if self.floats:
            torch._foreach_add_([self.out[k] for k in self.floats], [reply[k] for k in self.floats],
                                alpha=self.w[cid])  # fmt: skip
        for k in self.ints:
            torch.maximum(self.out[k], reply[k], out=self.out[k])

    def result(self) -> Tensors:
        if not self.added:
            raise ValueError("no replies to average")
        return {**self.base, **self.out}


def finetune_epochs(
    model: BlockNet, start: Tensors, data: ClientData, budget: Budget, generator: torch.Generator
) -> Iterator[Predictor]:
    """Personalize from `start` on the client's training data, yielding the model after every epoch.

    ft: every parameter is trained. lp (linear probe): the body is frozen — its features of the client's
    training samples are computed once, in eval mode (BatchNorm statistics untouched), and only the head is
    trained on them.
    """
    load_params(model, start)
    kw = budget.sgd(generator)
    if budget.method == "ft":
        for _ in sgd_epochs(model, data, **kw):
            yield Predictor(model, get_params(model))
    elif budget.method == "lp":
        model.eval()
        with torch.no_grad():
            feats = model.features(data.x[data.train])
        on_feats = ClientData(data.cid, feats, data.y[data.train], torch.arange(len(feats), device=feats.device),
                              data.val[:0], data.prior)  # fmt: skip
        head = set(model.state_keys(model.head_blocks()))
        trainable = [p for k, p in model.named_parameters() if k in head]
        body = {k: v for k, v in start.items() if k not in head}
        for _ in sgd_epochs(model, on_feats, params=trainable, forward=model.classify, **kw):
            yield Predictor(model, {**body, **get_params(model, sorted(head))}, feature_key=("body", Same(start)))
    else:
        raise ValueError(f"unknown personalization method {budget.method!r}")
