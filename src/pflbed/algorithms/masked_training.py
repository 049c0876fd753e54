"""Entry-masked local training: SGD on chosen entries of chosen tensors, every other entry held exactly, and
LocalAlt — a pass on the personal entries, then one on the global ones (FedSelect, Tamirisa et al., CVPR 2024,
Alg. 2). Shared machinery beside `masks.py` (the masks themselves); this module defines no `Algorithm`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pflbed.algorithms.common import ClientData
from pflbed.algorithms.sgd import SGD
from pflbed.algorithms.training import index_batches
from pflbed.errors import ConfigError
from pflbed.models import BlockNet

if TYPE_CHECKING:
    from pflbed.config import TrainConfig  # annotations only

# Modules whose `weight` is a learned linear map: the tensors `eligible="weights"` may personalize.
WEIGHT_MODULES: tuple[type[nn.Module], ...] = (
    nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
)  # fmt: skip


def eligible_keys(model: BlockNet, which: str, layers: str = "all") -> list[str]:
    """State keys of the tensors whose entries may become personal, chosen by module type and block, in model order.

    Raises `ConfigError` for an unknown block or a choice that leaves nothing to personalize.
    """
    if which == "weights":
        modules = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, WEIGHT_MODULES)]
        wanted = {f"{name}.weight" for name, mod in modules if isinstance(getattr(mod, "weight", None), nn.Parameter)}
    else:
        wanted = {k for k, p in model.named_parameters() if p.is_floating_point()}
    if layers != "all":
        if layers not in model.block_names():
            known = ", ".join(model.block_names())
            raise ConfigError(f"algorithm.layers: unknown block {layers!r}; the model has {known}")
        wanted &= set(model.state_keys([layers]))
    keys = [k for k in model.state_dict() if k in wanted]
    if not keys:
        raise ConfigError(f"algorithm.layers: block {layers!r} has no {which} tensor to personalize")
    return keys


class MaskedPhase:
    """One side of LocalAlt: SGD on chosen entries of chosen tensors, every other parameter entry held exactly.

    `entries` maps a parameter name to None (train the whole tensor) or a bool mask (train those entries only);
    parameters not named are frozen — `requires_grad` is off during a pass, so no backward runs into them. The
    optimizer (SGD with `momentum` and `weight_decay`) is created once and kept for every pass of the round, like
    `sgd_epochs`' one optimizer for all epochs. Entries of partly trained tensors that this side must not move are
    put back after every step: zeroing their gradient would not be enough, since weight decay adds wd·θ and momentum
    replays earlier steps. Their optimizer state is then irrelevant: SGD acts entry by entry and those entries are
    never kept by this side.
    """

    def __init__(
        self, model: nn.Module, entries: dict[str, torch.Tensor | None], *, lr: float, momentum: float,
        weight_decay: float,
    ) -> None:  # fmt: skip
        self.model = model
        params = dict(model.named_parameters())
        self.names = [k for k in params if k in entries]  # model order, as `sgd_epochs` passes them
        self.frozen = {k: ~m for k, m in entries.items() if m is not None}
        self.opt = (SGD([params[k] for k in self.names], lr=lr, momentum=momentum,
                                    weight_decay=weight_decay) if self.names else None)  # fmt: skip

    def run_pass(self, data: ClientData, batch_size: int, generator: torch.Generator) -> float | None:
        """One shuffled pass over the client's training data; the mean loss, or None (nothing to train, no-op)."""
        if self.opt is None:
            return None
        params = dict(self.model.named_parameters())
        train = set(self.names)
        others = [p for k, p in params.items() if k not in train]
        before = [p.requires_grad for p in others]
        anchors = {k: params[k].detach().clone() for k in self.frozen}  # the other side moved them
        total, steps = torch.zeros((), device=data.x.device), 0
        try:
            for p in others:
                p.requires_grad_(False)
            self.model.train()
            for b in index_batches(data.train, batch_size, 1, generator):
                x, y = data.batch(b, generator)
                loss = F.cross_entropy(self.model(x), y)
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                self.opt.step()
                with torch.no_grad():  # `where`, not `p[m] = …`: boolean indexing syncs with a GPU every step
                    for k, m in self.frozen.items():
                        params[k].copy_(torch.where(m, anchors[k], params[k]))
                total += loss.detach()
                steps += 1
        finally:
            for p, rg in zip(others, before, strict=True):
                p.requires_grad_(rg)
        return float(total) / max(steps, 1)


def local_alt(
    model: nn.Module, data: ClientData, personal: dict[str, torch.Tensor], *, epochs: int, train: TrainConfig,
    generator: torch.Generator,
) -> float:  # fmt: skip
    """LocalAlt (Alg. 2) on the loaded model: per epoch, a pass on the personal entries, then one on the global ones.

    `personal` maps parameter names to bool masks (True = personal); parameters not in it are entirely global.
    Returns the mean training loss over the passes that ran.
    """
    own: dict[str, torch.Tensor | None] = {k: (None if m.all() else m) for k, m in personal.items() if m.any()}
    shared: dict[str, torch.Tensor | None] = {}
    for k, _ in model.named_parameters():
        m = personal.get(k)
        if m is None or not m.any():
            shared[k] = None
        elif not m.all():
            shared[k] = ~m
    kw = dict(lr=train.lr, momentum=train.momentum, weight_decay=train.weight_decay)
    sides = (MaskedPhase(model, own, **kw), MaskedPhase(model, shared, **kw))
    losses = []
    for _ in range(epochs):
        for side in sides:
            loss = side.run_pass(data, train.batch_size, generator)
            if loss is not None:
                losses.append(loss)
    return sum(losses) / max(len(losses), 1)
