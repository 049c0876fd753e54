"""FedPer — Arivazhagan, Aggarwal, Singh & Choudhary, "Federated Learning with Personalization Layers",
arXiv:1912.00818, 2019 (papers/fedper.txt).

Model (Eq. 1): ŷ = f(x; W_B, W_Pj) — K_B shared *base* layers followed by K_P *personalization* layers private to
client j. K_P counts blocks from the top (§4.3: K_P = 1 is the classifier alone, K_P = 2 adds the block below it).

Client j, round k (Algorithm 1): receive W_B^(k-1); (W_B,j^(k), W_Pj^(k)) ← SGD_j(W_B^(k-1), W_Pj^(k-1), η) — e
epochs of mini-batch SGD on *both* parts from the client's own data; send W_B,j^(k) only.
Server (Algorithm 2): W_B^(k) = Σ_j γ_j · W_B,j^(k), γ_j = n_j / Σ n — over the clients sampled this round, with
the engine's weights |D_m|.
App. A.3 option (`head_finetune_epochs`): at the start of each round first train W_Pj alone, W_B frozen, for that
many epochs (the paper uses 1), then run the usual local SGD.

Options (`algorithm.<key>`): `personal_blocks` K_P (default 1 = classifier; the paper finds K_P = 1 best on
CIFAR-100, K_P = 2 on CIFAR-10); `head_finetune_epochs` (default 0 = off, as in the paper's main results).
Local epochs, batch size, lr, momentum and weight decay are `train.*` (paper: e = 4, lr 0.01 constant, 100 rounds).

Interpretations and deviations:
- Personal layers start from the run's initial model (`ctx.initial_params`), identical for every client. Algorithm 1
  says "initialize W_Pj at random"; one shared random draw is such an initialization, and it makes the round-0
  personal model equal the initial global model (the same starting point as FedAvg, so comparisons isolate the
  training rule).
- Partial participation (`federation.sample_fraction`) is allowed; the paper assumes every client in every round.
  A client's personal layers only change in rounds it is sampled.
- K_P = 0 is FedAvg (§4) — use `fedavg`; here K_P ≥ 1 and at least one block must stay in the base.
- There is no global model with a head (G-FL is null) and no zero-shot model: a new client has no personal layers.
- New clients (not in the paper): start from the server base plus the *initial* personal layers (what a joining
  client would get under Algorithm 1); `ft` trains everything, `lp` only the K_P personal blocks on the frozen base
  (a true linear probe when K_P is the classifier).
- Momentum (if configured) restarts every round and every phase: the paper uses plain SGD.

Shared helpers for the partial-model methods (FedRep, LG-FedAvg, FedBABU import them from here):
`block_params`, `frozen`, `train_blocks`, `run_blocks`, `personalize_blocks`, `blocks_for` and `subset`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from pflbed.algorithms.base import Algorithm, Budget, ClientContext, ClientData, Context, Predictor, Tensors
from pflbed.algorithms.training import finetune_epochs, get_params, load_params, local_sgd, sgd_epochs, weighted_mean
from pflbed.config import TrainConfig
from pflbed.errors import ConfigError
from pflbed.models import BlockNet

# --- shared helpers for methods that train or share parts of a BlockNet -----------------------------------------


def block_params(model: BlockNet, blocks: Iterable[str]) -> list[nn.Parameter]:
    """The parameters of the given blocks, found through the module tree (never by parameter-name matching)."""
    return [p for b in blocks for p in model.blocks[b].parameters()]


@contextmanager
def frozen(model: BlockNet, blocks: Iterable[str]) -> Iterator[None]:
    """Turn off gradients of the given blocks' parameters for the duration.

    Freezing is already guaranteed by giving the optimizer only the trainable parameters; this also saves the
    backward pass into frozen blocks (a head-only phase then never backpropagates through the body), and leaves no
    stale `.grad` on parameters nobody steps. Restored on exit, so the shared model object stays trainable.
    """
    params = block_params(model, blocks)
    before = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, rg in zip(params, before, strict=True):
            p.requires_grad_(rg)


def train_blocks(
    model: BlockNet,
    data: ClientData,
    blocks: Sequence[str],
    *,
    epochs: int,
    lr: float,
    train: TrainConfig,
    generator: torch.Generator,
) -> float:
    """Local SGD (batch size, momentum, weight decay from `train`) updating only `blocks`; the others are frozen.

    The model is used as loaded (call `load_params` first) and the forward is the full model in train mode, as in
    the papers (a frozen block's output still depends on the current input). Returns the mean training loss;
    zero epochs is a no-op that draws nothing from the generator.
    """
    others = [b for b in model.block_names() if b not in set(blocks)]
    with frozen(model, others):
        return local_sgd(
            model,
            data,
            epochs=epochs,
            batch_size=train.batch_size,
            lr=lr,
            momentum=train.momentum,
            weight_decay=train.weight_decay,
            params=block_params(model, blocks),
            generator=generator,
        )


def run_blocks(model: BlockNet, blocks: Iterable[str], x: torch.Tensor) -> torch.Tensor:
    """Forward `x` through the given blocks in order (a contiguous slice of the model)."""
    for b in blocks:
        x = model.blocks[b](x)
    return x


def personalize_blocks(
    model: BlockNet,
    start: Tensors,
    data: ClientData,
    budget: Budget,
    generator: torch.Generator,
    blocks: Sequence[str],
) -> Iterator[Predictor]:
    """Adapt from `start` training only `blocks` (all others frozen), yielding the full model after each epoch.

    - every block: plain fine-tuning (`finetune_epochs` "ft");
    - exactly the head blocks: the library's linear probe (`finetune_epochs` "lp": body features cached once in
      eval mode, head trained on them; evaluation then shares the body's features across clients);
    - a top slice of several blocks (FedPer with K_P > 1): the same idea one cut lower — the frozen lower blocks'
      outputs are computed once in eval mode and only the top slice is trained on them;
    - any other set (e.g. LG-FedAvg's lower, local blocks under a frozen global top): full forward in train mode,
      the frozen blocks without gradients, one epoch at a time so the model is never left frozen between yields.
    """
    names = model.block_names()
    blocks = [b for b in names if b in set(blocks)]  # model order
    if not blocks:
        raise ValueError("personalization must train at least one block")
    if blocks == names:
        yield from finetune_epochs(model, start, data, replace(budget, method="ft"), generator)
        return
    if blocks == model.head_blocks():
        yield from finetune_epochs(model, start, data, replace(budget, method="lp"), generator)
        return
    load_params(model, start)
    kw = dict(epochs=budget.epochs, batch_size=budget.batch_size, lr=budget.lr, momentum=budget.momentum,
              generator=generator, params=block_params(model, blocks))  # fmt: skip
    if blocks == model.top_blocks(len(blocks)):
        lower = names[: len(names) - len(blocks)]
        model.eval()
        with torch.no_grad():
            feats = run_blocks(model, lower, data.x[data.train])
        on_feats = ClientData(data.cid, feats, data.y[data.train], torch.arange(len(feats)), data.val[:0], data.prior)
        for _ in sgd_epochs(model, on_feats, forward=lambda z: run_blocks(model, blocks, z), **kw):
            yield Predictor(model, get_params(model))
        return
    epochs = sgd_epochs(model, data, **kw)  # one optimizer for all epochs (momentum carries over)
    others = [b for b in names if b not in set(blocks)]
    for _ in range(budget.epochs):
        with frozen(model, others):
            next(epochs)
        yield Predictor(model, get_params(model))


def subset(params: Tensors, keys: Iterable[str]) -> Tensors:
    """The entries of `params` under `keys` (the same tensors, not copies)."""
    return {k: params[k] for k in keys}


def blocks_for(budget: Budget, model: BlockNet, *, lp: Sequence[str], ft: Sequence[str] | None = None) -> list[str]:
    """The blocks a personalization budget trains: `ft` (default: all) or `lp`."""
    if budget.method == "ft":
        return list(ft if ft is not None else model.block_names())
    if budget.method == "lp":
        return list(lp)
    raise ValueError(f"unknown personalization method {budget.method!r}")


# --- FedPer ------------------------------------------------------------------------------------------------------


class FedPerOptions(BaseModel):
    """FedPer options."""

    model_config = ConfigDict(extra="forbid")
    personal_blocks: int = Field(1, ge=1, description="K_P: top blocks kept personal (1 = the classifier)")
    head_finetune_epochs: int = Field(
        0, ge=0, description="App. A.3: epochs training the personal layers alone (base frozen) at the start of a round"
    )


class FedPer(Algorithm):
    name = "fedper"
    Config = FedPerOptions

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        m, k = ctx.model, self.opts.personal_blocks
        if k >= len(m.block_names()):
            raise ConfigError(
                f"algorithm.personal_blocks: the model has {len(m.block_names())} blocks and at least one must stay "
                f"in the shared base (got {k})"
            )
        self.personal = m.top_blocks(k)
        self.base = [b for b in m.block_names() if b not in self.personal]
        self.personal_keys = m.state_keys(self.personal)
        self.base_keys = m.state_keys(self.base)

    def init_server(self) -> Tensors:
        return subset(self.ctx.initial_params, self.base_keys)

    def init_client(self, cid: int) -> Tensors:
        return subset(self.ctx.initial_params, self.personal_keys)

    def configure(self, rnd: int, server: Tensors, cids: list[int]) -> dict[int, Tensors]:
        return {c: server for c in cids}

    def client_update(
        self, payload: Tensors, state: Tensors, data: ClientData, cctx: ClientContext
    ) -> tuple[Tensors, Tensors]:
        model, t = self.ctx.model, self.ctx.cfg.train
        load_params(model, {**payload, **state})
        if self.opts.head_finetune_epochs:
            train_blocks(model, data, self.personal, epochs=self.opts.head_finetune_epochs, lr=t.lr, train=t,
                         generator=cctx.generator)  # fmt: skip
        train_blocks(model, data, model.block_names(), epochs=t.local_epochs, lr=t.lr, train=t,
                     generator=cctx.generator)  # fmt: skip
        params = get_params(model)
        return subset(params, self.base_keys), subset(params, self.personal_keys)

    def aggregate(self, rnd: int, server: Tensors, replies: dict[int, Tensors], weights: dict[int, float]) -> Tensors:
        return weighted_mean(replies, weights, self.base_keys)

    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        # With K_P = the head, every client's body is the server base: evaluation computes its features once.
        shared_body = self.personal == self.ctx.model.head_blocks()
        return Predictor(self.ctx.model, {**server, **state}, ("fedper-base", id(server)) if shared_body else None)

    def personalize(
        self, server: Tensors, data: ClientData, budget: Budget, generator: torch.Generator
    ) -> Iterator[Predictor]:
        start = {**server, **self.init_client(data.cid)}
        blocks = blocks_for(budget, self.ctx.model, lp=self.personal)
        yield from personalize_blocks(self.ctx.model, start, data, budget, generator, blocks)

    def zero_shot(self, server: Tensors, data: ClientData) -> Predictor | None:
        return None  # a new client has no personal layers yet
