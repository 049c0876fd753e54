"""Client updates that are plain local SGD, declared as data.

FedAvg, FedPer, FedRep, LG-FedAvg and FedBABU all update a client the same way: load a starting state, run one or
more phases of mini-batch SGD, each training some blocks with the others frozen, then split the trained state into
the reply and the client's new state. Declaring that as a `LocalSGDPlan` (`Algorithm.sgd_plan`) lets the engine run
it either one client at a time (`run_plan`, the rule itself) or many clients of one architecture together
(`engine.batched`), with one definition of the update.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pflbed.algorithms.common import ClientData, Tensors
from pflbed.algorithms.partial import train_blocks
from pflbed.algorithms.training import get_params, load_params
from pflbed.models import BlockNet

if TYPE_CHECKING:
    from pflbed.config import TrainConfig  # annotations only


@dataclass(frozen=True)
class Phase:
    """`epochs` epochs of SGD at `lr` on `blocks`, every other block frozen; a fresh optimizer (no momentum carried
    over from an earlier phase). Batch size, momentum and weight decay are `train.*`."""

    blocks: tuple[str, ...]
    epochs: int
    lr: float


@dataclass(frozen=True)
class LocalSGDPlan:
    """Load `start` (the model's full state), run `phases` in order, then `finish` maps the trained state to
    (reply, new client state)."""

    start: Tensors
    phases: tuple[Phase, ...]
    finish: Callable[[Tensors], tuple[Tensors, Tensors]]


def run_plan(
    model: BlockNet, plan: LocalSGDPlan, data: ClientData, train: TrainConfig, generator: torch.Generator
) -> tuple[Tensors, Tensors]:
    """One client's plan, on the shared model object. A phase of zero epochs draws nothing from the generator."""
    load_params(model, plan.start)
    for ph in plan.phases:
        train_blocks(model, data, ph.blocks, epochs=ph.epochs, lr=ph.lr, train=train, generator=generator)
    return plan.finish(get_params(model))
