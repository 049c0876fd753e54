"""`sites.*`: a Flower deployment whose clients' data stays on the sites."""

from __future__ import annotations

from pydantic import Field, model_validator

from pflbed.config.base import Strict


class SitesConfig(Strict):
    """A Flower deployment whose clients' data stays on the sites (`pflbed.flower.sites`)."""

    local: bool = Field(False, description="the clients' data is on the SuperNodes (each one's `data` node config): "
                        "the server holds none, and every figure but a server-side G-FL is computed on the sites. "
                        "Needs executor.name=flower")  # fmt: skip
    input_shape: list[int] | None = Field(None, description="local: one sample's shape, e.g. [1, 28, 28]; every "
                                          "site's data is checked against it")  # fmt: skip
    num_classes: int | None = Field(None, ge=2, le=100_000, description="local: the label space 0…num_classes−1; "
                                    "every site's labels are checked against it")  # fmt: skip
    secagg: bool = Field(False, description="local: secure aggregation (Flower's SecAgg+): the server learns only "
                         "the round's mean update of the shared model, not a site's (guide: privacy)")  # fmt: skip
    test: str | None = Field(None, min_length=1, description="local: a test set on the server (.npz with x and y) "
                             "for G-FL; unset: G-FL is the sample-weighted mean of the sites' figures for the "
                             "generic model on their own test data")  # fmt: skip
    max_client_samples: int = Field(10_000_000, ge=1, description="local: the most training samples the server "
                                    "accepts a site to report for one client; a count is a client's weight in "
                                    "the server's means, so an unbounded one would let one site dictate the "
                                    "model")  # fmt: skip
    max_update: float = Field(100.0, gt=0, description="local: the largest change of the shared model the server "
                              "accepts in one reply, as a multiple of max(1, the payload's norm) (honest replies "
                              "stay near or below 1); a site's reply beyond it is refused for the round")  # fmt: skip

    @model_validator(mode="after")
    def _check(self) -> SitesConfig:
        if not self.local:
            for key in ("input_shape", "num_classes", "test"):
                if getattr(self, key) is not None:
                    raise ValueError(f"{key} applies to sites.local=true")
            if self.secagg:
                raise ValueError("secagg applies to sites.local=true: with the data on the server, it would protect "
                                 "nothing the server does not hold already")  # fmt: skip
        elif self.input_shape is None or self.num_classes is None:
            raise ValueError("local needs sites.input_shape and sites.num_classes (what the server knows of the "
                             "sites' data)")  # fmt: skip
        if self.input_shape is not None and not (1 <= len(self.input_shape) <= 4 and min(self.input_shape) >= 1):
            raise ValueError("input_shape must be 1 to 4 positive sizes, e.g. [1, 28, 28]")
        return self
