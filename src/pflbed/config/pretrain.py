"""`pretrain.*`: `pflbed pretrain`'s centralized training, for `model.init_from`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pflbed.config.base import INT_MAX, Strict


class PretrainConfig(Strict):
    """`pflbed pretrain`: centralized training on a declared source that no client and no evaluation of this
    config's federation uses (checked), for `model.init_from` (docs/guide/after-the-run.md, "Pretrained start")."""

    split: Literal["train", "test"] = Field("test", description="the dataset split the source is drawn from")
    domains: list[str] | None = Field(None, description="only samples of these domains (datasets with domains)")
    samples: int | None = Field(None, ge=1, le=INT_MAX, description="at most this many (a seeded draw; None: all)")
    val_fraction: float = Field(0.1, ge=0, lt=1, description="held out of the source to pick the epoch kept")
    epochs: int = Field(10, ge=1, le=100_000,
        description="pflbed pretrain: epochs (the best on its validation share is kept)")
    batch_size: int = Field(64, ge=1, le=INT_MAX, description="pflbed pretrain: mini-batch size")
    lr: float = Field(0.01, gt=0, description="pflbed pretrain: SGD learning rate")
    momentum: float = Field(0.9, ge=0, lt=1, description="pflbed pretrain: SGD momentum")
    weight_decay: float = Field(5e-4, ge=0, description="pflbed pretrain: SGD weight decay")
