"""The whole config: its sections, and the rules that tie keys of different sections together."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from pflbed.config.algorithm import AlgorithmConfig
from pflbed.config.base import SEED_MAX, Strict
from pflbed.config.dataset import DatasetConfig
from pflbed.config.evaluation import EvalConfig
from pflbed.config.executor import ExecutorConfig
from pflbed.config.federation import FederationConfig
from pflbed.config.log import LogConfig
from pflbed.config.model import ModelConfig
from pflbed.config.pretrain import PretrainConfig
from pflbed.config.privacy import PrivacyConfig
from pflbed.config.sites import SitesConfig
from pflbed.config.train import TrainConfig


class Config(Strict):
    seed: int = Field(0, ge=0, le=SEED_MAX,
        description="seeds the federation, the initial model, client sampling and every client's RNG")
    dataset: DatasetConfig = Field(default_factory=DatasetConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    federation: FederationConfig = Field(default_factory=FederationConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    executor: ExecutorConfig = Field(default_factory=ExecutorConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    pretrain: PretrainConfig = Field(default_factory=PretrainConfig)
    sites: SitesConfig = Field(default_factory=SitesConfig)
    privacy: PrivacyConfig = Field(default_factory=PrivacyConfig)

    @model_validator(mode="after")
    def _privacy(self) -> Config:
        """Privacy's accountant assumes Poisson sampling of clients: fixed-size sampling with it is refused."""
        if self.privacy.enabled and self.federation.sampling == "fixed":
            raise ValueError("federation.sampling: privacy's accountant assumes Poisson sampling of clients; "
                             "use federation.sampling=poisson (the default with privacy)")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _supernodes(self) -> Config:
        """A SuperNode serves the clients whose id is its number modulo `executor.supernodes`: past the number of
        clients a node serves none and only costs memory (in a local deployment, two processes each). Known here
        under the standard protocol; PFLBED's count of clients depends on the dataset's domains."""
        n, ex, fed = self.executor.supernodes, self.executor, self.federation
        clients = fed.clients + fed.new_clients
        known = ex.name == "flower" and fed.protocol == "standard" and not self.sites.local
        if n is not None and known and n > clients:
            raise ValueError(f"executor.supernodes: {n} SuperNodes for {clients} clients (node k serves the clients "
                             f"whose id is k modulo {n}, so {n - clients} would serve none); at most {clients}")
        return self

    def privacy_randomness(self) -> str:
        """Where privacy's noise and sample come from (`privacy.randomness`): `os` by default in a Flower run,
        whose sites all receive the config and its seed, so that a deployment never draws them from the seed
        unless its config asks for that by name; `seeded` elsewhere, so that a research run is reproducible."""
        return self.privacy.randomness or ("os" if self.executor.name == "flower" else "seeded")

    def poisson_sampling(self) -> bool:
        """Whether a round's clients are drawn independently (`federation.sampling`, default: with privacy)."""
        return (self.federation.sampling or ("poisson" if self.privacy.enabled else "fixed")) == "poisson"

    @model_validator(mode="after")
    def _pflbed_scoring(self) -> Config:
        """PFLBED scores a client on its domain's shared test set: `eval.pfl_test` would be ignored, so it is
        refused (as the standard protocol's federation settings are, `FederationConfig`)."""
        if self.federation.protocol == "pflbed" and self.eval.pfl_test != "local":
            raise ValueError(f"eval.pfl_test: {self.eval.pfl_test} is not read by federation.protocol pflbed, which "
                             "scores each client on its domain's shared test set, weighted by its training classes")
        return self

    @model_validator(mode="after")
    def _sites(self) -> Config:
        """What a deployment with the data on the sites cannot do (yet): each refused with the key that asks it."""
        if self.privacy.noise == "distributed" and not self.sites.secagg:
            raise ValueError("privacy.noise: distributed needs sites.secagg=true (the sites' noise shares are hidden "
                             "from the server only inside SecAgg+'s masked sum)")  # fmt: skip
        if self.privacy.noise == "distributed" and self.privacy_randomness() != "os":
            raise ValueError("privacy.randomness: seeded does not apply with privacy.noise=distributed (the sites "
                             "draw their noise shares from the operating system)")  # fmt: skip
        if not self.sites.local:
            return self
        refused = {
            "executor.name": (self.executor.name != "flower", "sites.local needs executor.name=flower"),
            "executor.state_dir": (self.executor.state_dir is not None, "a site keeps its clients' states in its own "
                                   "state-dir node config; the server does not choose it"),
            "federation.protocol": (self.federation.protocol == "pflbed", "PFLBED's shared domain val/test sets "
                                    "are not on the sites"),
            "federation.new_clients": (self.federation.new_clients > 0, "a site that joins after training "
                                       "personalizes on its own (pflbed personalize)"),
            "federation.public": (self.federation.public > 0, "public data is not on the sites"),
            "federation.manifest": (self.federation.manifest is not None, "the sites hold the data"),
            "eval.pfl_test": (self.eval.pfl_test != "local", "a site scores its clients on its own test data"),
            "model.init_from": (self.model.init_from is not None, "the sites would each need the weights file"),
            "dataset.path": (self.dataset.path is not None, "the server holds no client data"),
        }
        for key, (bad, why) in refused.items():
            if bad:
                raise ValueError(f"{key} does not apply with sites.local=true: {why}")
        return self

    def algorithm_options(self) -> dict[str, Any]:
        return dict(self.algorithm.model_extra or {})

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")
