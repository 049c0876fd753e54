"""`federation.*`: how the data is split into clients (partitions, the PFLBED protocol, held-out clients)."""

from __future__ import annotations

import typing
from typing import Annotated, Literal

from pydantic import Field, model_validator

from pflbed.config.base import INT_MAX, SEED_MAX, Strict


class PflbedSplitConfig(Strict):
    """PFLBED split of each domain (FedBasis paper §5): fractions of the domain's samples, clients per portion."""

    participated: float = Field(0.6, ge=0, le=1, description="PFLBED: share of each domain's samples given to its "
                                "training clients")
    new: float = Field(0.2, ge=0, le=1, description="PFLBED: share of each domain's samples given to its new clients")
    val: float = Field(0.05, gt=0, le=1,
        description="PFLBED: share of each domain's pool kept as its shared validation set")
    test: float = Field(0.15, gt=0, le=1, description="PFLBED: share of each domain's pool kept as its shared test set")
    clients_per_domain: int = Field(20, ge=1, le=INT_MAX, description="PFLBED: clients per domain")
    new_clients_per_domain: int = Field(10, ge=0, le=INT_MAX, description="PFLBED: new clients per domain")

    @model_validator(mode="after")
    def _check(self) -> PflbedSplitConfig:
        total = self.participated + self.new + self.val + self.test
        if total > 1 + 1e-9:
            raise ValueError(f"participated + new + val + test = {total:g} exceeds 1")
        if self.participated <= 0:
            raise ValueError("participated must be > 0")
        if self.new_clients_per_domain > 0 and self.new <= 0:
            raise ValueError("new clients need new > 0")
        return self


# The standard protocol's settings that the PFLBED split never reads, and what it reads instead. A value other than
# the default is refused rather than silently ignored: a user who sets `clients: 100` under pflbed expects 100 clients.
# (Compared with the default, not with what the user wrote: a config dumped and validated again carries every field.)
UNREAD_BY_PFLBED = {
    "clients": "its clients are pflbed.clients_per_domain per domain",
    "new_clients": "its new clients are pflbed.new_clients_per_domain per domain",
    "partition": "it splits each domain's portions by Dirichlet(alpha)",
    "classes_per_client": "it splits each domain's portions by Dirichlet(alpha)",
    "min_samples": "it has no natural users",
    "train_per_client": "each domain's share of training samples is pflbed.participated",
    "val_fraction": "its validation sets are shared per domain (pflbed.val)",
    "test_fraction": "its test sets are shared per domain (pflbed.test)",
}


def _set(section: Strict, keys: typing.Iterable[str]) -> list[str]:
    """The `keys` of `section` whose value is not their default."""
    fields = type(section).model_fields
    return [k for k in keys if getattr(section, k) != fields[k].default]


class FederationConfig(Strict):
    protocol: Literal["standard", "pflbed"] = Field(
        "standard",
        description="standard: partition the training split, per-client local test splits; pflbed: per-domain "
        "shared class-balanced val/test sets, participated and new clients per domain (federation.pflbed)",
    )
    pflbed: PflbedSplitConfig = Field(default_factory=PflbedSplitConfig)
    clients: int = Field(20, ge=1, le=INT_MAX, description="number of clients (standard protocol)")
    partition: Literal["iid", "dirichlet", "classes", "natural"] = Field(
        "dirichlet", description="natural: each user of the data (dataset.hf.user_column, a dataset's writers, else "
        "its domains) is one client; federation.clients of them are drawn (seeded)"
    )
    alpha: float = Field(0.3, gt=0, description="Dirichlet concentration (partition=dirichlet, and pflbed)")
    classes_per_client: int = Field(2, ge=1, le=INT_MAX, description="labels per client (partition=classes)")
    min_size: int = Field(10, ge=1, le=INT_MAX, description="minimum samples per client (partition=dirichlet)")
    min_samples: int = Field(10, ge=1, le=INT_MAX, description="partition=natural: users with fewer samples dropped")
    manifest: str | None = Field(
        None, min_length=1, description="a partition manifest (`pflbed data export`): run on its clients instead of "
        "partitioning; refused unless made from the same data"
    )
    sample_fraction: float = Field(1.0, gt=0, le=1, description="fraction of participated clients per round")
    sampling: Literal["fixed", "poisson"] | None = Field(
        None, description="how a round's clients are drawn: fixed (exactly round(sample_fraction × participated), "
        "without replacement) or poisson (each participated client independently with probability "
        "sample_fraction, as privacy's accountant assumes); default: poisson with privacy, fixed otherwise"
    )
    new_clients: int = Field(0, ge=0, le=INT_MAX, description="clients held out of training (evaluated as new clients)")
    public: int = Field(
        0, ge=0, le=INT_MAX,
        description="hold out this many training-pool samples as public (unlabelled) data, held by no client",
    )
    train_per_client: int | None = Field(
        None, ge=1, le=INT_MAX, description="keep at most this many training samples per client (e.g. FedSelect's 100)"
    )
    val_fraction: float = Field(0.1, ge=0, lt=1,
        description="each client's share of its samples kept as its validation split")
    test_fraction: float = Field(0.2, gt=0, lt=1,
        description="each client's share of its samples kept as its test split")
    exclude_test_of: list[Annotated[int, Field(ge=0, le=SEED_MAX)]] = Field(
        default_factory=list, max_length=1000,
        description="seeds whose federations (these settings, this key aside) test on samples this one must never "
        "train or validate on: they are left out of its pool (`pflbed tune`'s trials, so that no reported test "
        "sample tunes a hyperparameter)")

    @model_validator(mode="after")
    def _check(self) -> FederationConfig:
        unread = _set(self, UNREAD_BY_PFLBED) if self.protocol == "pflbed" else []
        if unread:
            raise ValueError(f"{unread[0]} is not read by protocol pflbed; {UNREAD_BY_PFLBED[unread[0]]}")
        split = _set(self.pflbed, PflbedSplitConfig.model_fields) if self.protocol == "standard" else []
        if split:
            raise ValueError(f"pflbed.{split[0]} is read only by protocol pflbed; set protocol: pflbed")
        if self.val_fraction + self.test_fraction >= 1:
            raise ValueError("val_fraction + test_fraction must be < 1")
        if self.new_clients >= self.clients:
            raise ValueError("new_clients must leave at least one participated client")
        if self.exclude_test_of and self.manifest is not None:
            raise ValueError("exclude_test_of draws a federation from a reduced pool; a manifest fixes one")
        return self
