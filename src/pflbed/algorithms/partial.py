"""Shared pieces for methods that train or share only *parts* of a BlockNet (FedPer, FedRep, LG-FedAvg, FedBABU).

Blocks are always chosen by structure (`top_blocks`, `head_blocks`, `body_blocks`), never by parameter names.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from pflbed.algorithms.common import Budget, ClientData, Predictor, Tensors
from pflbed.algorithms.training import finetune_epochs, get_params, load_params, local_sgd, sgd_epochs
from pflbed.errors import ConfigError
from pflbed.models import BlockNet

if TYPE_CHECKING:
    from pflbed.config import TrainConfig  # annotations only


def split_top(model: BlockNet, k: int, option: str, splits_state: bool = False) -> tuple[list[str], list[str]]:
    """(top k blocks, the rest); a one-line config error unless both parts are non-empty.

    `splits_state`: the option only decides which parameters and buffers sit on which side (FedPer's personal
    layers, LG-FedAvg's global ones). Then a k whose lowest block holds none (`resnet18`'s `pool`) is refused: it
    splits the state as k − 1 does, so a sweep over k would silently run one setting twice under two names."""
    names = model.block_names()
    n = len(names)
    if not 1 <= k < n:
        raise ConfigError(f"algorithm.{option}: the model has {n} blocks; choose 1 to {n - 1} (got {k})")
    top = model.top_blocks(k)
    if splits_state and not model.state_keys([top[0]]):
        holding = [j for j in range(1, n) if model.state_keys([names[n - j]])]
        near = [j for j in (max((j for j in holding if j < k), default=None),
                            min((j for j in holding if j > k), default=None)) if j is not None]  # fmt: skip
        choose = " or ".join(map(str, near)) or "another model"  # none: only a model of stateless blocks
        raise ConfigError(f"algorithm.{option}: block {top[0]!r}, the lowest of the top {k}, holds no parameters, so "
                          f"{k} splits the model as {k - 1} does; choose {choose}")  # fmt: skip
    return top, [b for b in names if b not in top]


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
    with frozen_params(block_params(model, blocks)):
        yield


@contextmanager
def frozen_params(params: list[nn.Parameter]) -> Iterator[None]:
    """No gradient into `params` for the duration; each one's `requires_grad` restored on exit."""
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
    kw = {**budget.sgd(generator), "params": block_params(model, blocks)}
    if blocks == model.top_blocks(len(blocks)):
        lower = names[: len(names) - len(blocks)]
        model.eval()
        with torch.no_grad():
            feats = run_blocks(model, lower, data.x[data.train])
        on_feats = ClientData(data.cid, feats, data.y[data.train], torch.arange(len(feats), device=feats.device),
                              data.val[:0], data.prior)  # fmt: skip
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
