"""The types every piece of the algorithm contract shares (`base`, `training`, `partial`, `local_sgd`): tensor
dicts, cache keys, a client's data, adaptation budgets and predictors. They sit below `base.Algorithm`, whose
default methods use the shared training pieces, so those pieces import these without importing `base` (which
re-exports them: `from pflbed.algorithms.base import ClientData` keeps working).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from pflbed.data.augment import Augment
from pflbed.models.inference import inference_rows

Tensors = dict[str, torch.Tensor]


class Same:
    """A cache key for one object: equal only to a key of that very object, and holding it.

    `id(obj)` alone is not such a key: once `obj` is freed, a new object may get its address and read the old
    object's cache entry (a new round's server state would be evaluated with the last round's model). Holding
    the object keeps its address taken for as long as the key is in a cache.
    """

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Same) and other.obj is self.obj


@dataclass(frozen=True)
class ClientData:
    """A client's view of the training pool: the pool's tensors plus this client's indices into them.

    Training loops take their mini-batches through `batch`, which applies the run's augmentation (`augment`,
    `dataset.augment`); everything else (evaluation, validation, cached features) reads `x` directly."""

    cid: int
    x: torch.Tensor
    y: torch.Tensor
    train: torch.Tensor
    val: torch.Tensor
    prior: torch.Tensor
    augment: Augment | None = None

    @property
    def num_train(self) -> int:
        return int(self.train.numel())

    def batch(self, b: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """The training mini-batch of pool indices `b`: samples (augmented where the run augments, the random
        choices drawn from `generator` — the one `b` was drawn from) and labels."""
        x = self.x[b]
        return (x if self.augment is None else self.augment(x, generator)), self.y[b]


@dataclass(frozen=True)
class ClientContext:
    """Per-call facts for `client_update`: the round, and a generator derived from (seed, round, client id)."""

    rnd: int
    cid: int
    generator: torch.Generator


@dataclass(frozen=True)
class Budget:
    """How much adaptation a personalization may spend."""

    # The `train.*` keys a personalization's budget takes (`of`): a run that personalizes (`eval.finetune`, new
    # clients) reads them whatever its algorithm's training reads (`Algorithm.unread_train`).
    TRAIN_KEYS: ClassVar[frozenset[str]] = frozenset({"batch_size", "momentum"})

    method: str  # "ft" (all parameters) or "lp" (head only)
    epochs: int
    lr: float
    batch_size: int
    momentum: float = 0.0

    @classmethod
    def of(cls, method: str, epochs: int, lr: float, train: Any) -> Budget:
        """The budget of `epochs` epochs at `lr`, with the run's `train` batch size and momentum (`TRAIN_KEYS`)."""
        return cls(method, epochs, lr, train.batch_size, train.momentum)

    def sgd(self, generator: torch.Generator) -> dict[str, Any]:
        """`training.sgd_epochs`'s keyword arguments for this budget (no weight decay: a personalization adapts,
        it is not regularized), batches drawn from `generator`."""
        return {"epochs": self.epochs, "batch_size": self.batch_size, "lr": self.lr, "momentum": self.momentum,
                "generator": generator}


class Predictor:
    """A model ready to classify: one model object plus the parameters to load into it.

    Predictors that share `group` (the same model and parameter dict) are evaluated with one batched forward.
    A predictor with a `feature_key` declares that its body is shared with every predictor of the same key
    (e.g. linear probes on one frozen body): evaluation then computes body features once and runs only the head.
    """

    def __init__(self, model: torch.nn.Module, params: Tensors, feature_key: tuple | None = None) -> None:
        self.model, self.params, self.feature_key = model, params, feature_key

    @property
    def group(self) -> tuple[Same, Same]:
        return Same(self.model), Same(self.params)

    def _batched(self, method: str, x: torch.Tensor, batch_size: int) -> torch.Tensor:
        """`getattr(model, method)` over `x` in chunks of at most `batch_size` rows (fewer for models with wide
        activations: `models.inference.inference_rows`)."""
        load_params(self.model, self.params)
        self.model.eval()
        fn = getattr(self.model, method)
        rows = inference_rows(self.model, method, x, batch_size)
        with torch.no_grad():  # an empty x (a client without validation data) still gives an empty output
            return torch.cat([fn(x[i : i + rows]) for i in range(0, max(len(x), 1), rows)])

    def logits(self, x: torch.Tensor, batch_size: int = 1024) -> torch.Tensor:
        return self._batched("forward", x, batch_size)

    def features(self, x: torch.Tensor, batch_size: int = 1024) -> torch.Tensor:
        return self._batched("features", x, batch_size)

    def classify(self, z: torch.Tensor, batch_size: int = 1024) -> torch.Tensor:
        return self._batched("classify", z, batch_size)

    def module(self) -> torch.nn.Module:
        """This predictor as a module of its own, in eval mode, whose forward gives `logits` (a trained run's models:
        `results.trained`). Default: a copy of the model with the parameters loaded (the run's model objects are
        shared). A predictor that adds to its model (kNN-Per's datastore) overrides this: the copy alone would
        drop it and be another classifier."""
        model = copy.deepcopy(self.model)
        load_params(model, self.params)
        return model.eval()


def load_params(model: torch.nn.Module, params: Tensors) -> None:
    """Copy `params` (a subset of the state dict is fine) into the model in place."""
    state = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for k, v in params.items():
            state[k].copy_(v)
