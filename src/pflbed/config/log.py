"""`log.*`: what a run logs besides its metrics files."""

from __future__ import annotations

import importlib.util

from pydantic import Field, model_validator

from pflbed.config.base import Strict


class LogConfig(Strict):
    tensorboard: bool = Field(
        False, description="also log every evaluation's figures as TensorBoard scalars into <run>/tensorboard/ (the "
        "tensorboard extra)"
    )

    @model_validator(mode="after")
    def _check(self) -> LogConfig:
        if self.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ValueError("tensorboard needs the tensorboard extra: pip install 'pflbed[tensorboard]'")
        return self
