"""`privacy.*`: client-level differential privacy (`pflbed.privacy` applies it)."""

from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import Field, model_validator

from pflbed.config.base import Strict


class PrivacyConfig(Strict):
    """Client-level differential privacy (`pflbed.privacy`): the shared part of each reply clipped, their sum noised."""

    clip: float | None = Field(None, gt=0, description="client-level DP: each client's update of the shared "
                               "parameters is clipped to this L2 norm C (unset: no DP)")  # fmt: skip
    noise_multiplier: float | None = Field(None, ge=0, description="σ: Gaussian noise of standard deviation σ·C is "
                                           "added to the sum of the round's clipped updates")  # fmt: skip
    target_epsilon: float | None = Field(None, gt=0, description="instead of noise_multiplier: the ε to reach at "
                                         "delta after train.rounds rounds (σ derived by the accountant)")  # fmt: skip
    delta: float = Field(1e-5, gt=0, lt=1, description="δ of the (ε, δ) guarantee reported")
    randomness: Literal["seeded", "os"] | None = Field(None, description="where the noise and the round's sample "
                                                       "are drawn from: seeded (the run's seed: reproducible, for "
                                                       "research; anyone who knows the config can subtract the "
                                                       "noise) or os (the operating system's random source, for a "
                                                       "deployment); default: os with executor.name=flower, seeded "
                                                       "otherwise")  # fmt: skip
    accountant: Literal["rdp", "prv"] = Field("rdp", description="Opacus's accountant for ε: rdp (Rényi DP) or prv "
                                              "(privacy random variables: tighter, e.g. ε 3.53 where rdp gives "
                                              "4.0)")  # fmt: skip
    noise: Literal["central", "distributed"] = Field("central", description="who adds the Gaussian noise: central "
                                                     "(the server, to the sum it receives) or distributed (with "
                                                     "sites.secagg: each site adds its share before masking, so "
                                                     "neither the server nor any site sees a noise-free sum; guide: "
                                                     "privacy)")  # fmt: skip

    @property
    def enabled(self) -> bool:
        return self.clip is not None

    @model_validator(mode="after")
    def _check(self) -> PrivacyConfig:
        if self.clip is None:
            for key in ("noise_multiplier", "target_epsilon", "randomness"):
                if getattr(self, key) is not None:
                    raise ValueError(f"{key} needs privacy.clip (the norm each client's update is clipped to)")
            for key, default in (("accountant", "rdp"), ("noise", "central")):
                if getattr(self, key) != default:
                    raise ValueError(f"{key} needs privacy.clip (the norm each client's update is clipped to)")
        elif (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError("clip needs exactly one of privacy.noise_multiplier and privacy.target_epsilon")
        if self.clip is not None and importlib.util.find_spec("opacus") is None:  # the other keys need a clip
            raise ValueError("privacy needs the privacy extra (Opacus's accountants): pip install 'pflbed[privacy]'")
        return self
