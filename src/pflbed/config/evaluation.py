"""`eval.*`: when and how runs are scored, the final fine-tuning and the new-client protocol."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pflbed.config.base import INT_MAX, Strict


class NewClientsConfig(Strict):
    """The new-client protocol (FedBasis paper §5 / Table 2): personalize held-out clients after training."""

    methods: list[Literal["ft", "lp"]] = Field(default_factory=lambda: ["ft", "lp"],
        description="how new clients personalize: ft (fine-tune all) and / or lp (the head only)")
    fractions: list[float] = Field(
        default_factory=lambda: [0.5, 1.0], description="training-data fractions, reported as S, M, L"
    )
    epochs: int = Field(20, ge=1, le=100_000, description="new clients: personalization epochs")
    lrs: list[float] = Field(default_factory=lambda: [0.005, 0.01, 0.05], min_length=1,
        description="new clients: the learning rates tried; one is chosen for all new clients, the best mean "
        "validation accuracy over them (Last and Best each choose their own). A client's mini-batch order is drawn "
        "per place in this list, so reordering or extending it changes the draws")
    zero_shot: bool = Field(True, description="also evaluate with no adaptation, where the method allows it")

    @model_validator(mode="after")
    def _check(self) -> NewClientsConfig:
        if not 1 <= len(self.fractions) <= 3 or any(not 0 < f <= 1 for f in self.fractions):
            raise ValueError("fractions: one to three values in (0, 1]")
        if any(lr <= 0 for lr in self.lrs):
            raise ValueError("lrs must be > 0")
        return self


class EvalConfig(Strict):
    every: int = Field(5, ge=1, le=INT_MAX, description="evaluate every N rounds (the last round always)")
    pfl_test: Literal["local", "global"] = Field(
        "local",
        description="P-FL test data: the client's own test split, or the global balanced test set "
        "class-weighted by the client's training class distribution (protocol pflbed: its domain's test set, so "
        "local only)",
    )
    finetune: list[Literal["ft", "lp"]] = Field(
        default_factory=lambda: ["ft", "lp"],
        description="at the final round, also personalize the generic model per client: ft = full fine-tune, "
        "lp = linear probe (head only)",
    )
    ft_epochs: int = Field(1, ge=1, le=100_000, description="+FT / +LP after training: epochs")
    ft_lr: float = Field(0.01, gt=0, description="+FT / +LP after training: learning rate")
    batch_size: int = Field(
        256, ge=1, le=INT_MAX,
        description="most rows per inference forward; fewer for models whose widest activation would pass 8 MiB "
        "(pflbed.models.inference: measured fastest on CPU)",
    )
    test_subsample: int | None = Field(
        None, ge=1, le=INT_MAX,
        description="intermediate evaluations use at most this many shared-test samples per class",
    )
    new_clients: NewClientsConfig = Field(default_factory=NewClientsConfig)
