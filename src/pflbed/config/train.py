"""`train.*`: the rounds and every client's local SGD."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from pflbed.config.base import INT_MAX, Strict
from pflbed.search import IntSearch, Search, Space


class TrainConfig(Strict):
    # tuned for every method by `pflbed tune` (pflbed.search)
    search: ClassVar[dict[str, Space]] = {"lr": Search(1e-3, 0.3, log=True), "local_epochs": IntSearch(1, 5),
                                          "momentum": Search(0.0, 0.9)}  # fmt: skip
    rounds: int = Field(30, ge=1, le=1_000_000, description="communication rounds")
    local_epochs: int = Field(1, ge=1, le=100_000, description="local epochs per round")
    batch_size: int = Field(32, ge=1, le=INT_MAX, description="client mini-batch size")
    lr: float = Field(0.05, gt=0, description="client SGD learning rate")
    momentum: float = Field(0.0, ge=0, lt=1, description="client SGD momentum (restarts each round)")
    weight_decay: float = Field(0.0, ge=0, description="client SGD weight decay")
    checkpoint_every: int = Field(
        10, ge=0, le=INT_MAX, description="checkpoint every N rounds for --resume (0: only the final state)"
    )
