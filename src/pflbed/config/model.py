"""`model.*`: the zoo model every client trains, and the weights it starts from.

The zoo's names are listed here rather than read from `pflbed.models`, which imports torch: a misspelt name is then
reported at once (`tests/project/test_config_package.py` keeps the list equal to the zoo's).
"""

from __future__ import annotations

import sys

from pydantic import Field, field_validator

from pflbed import plugins
from pflbed.config.base import Strict

MODEL_NAMES = (
    "mlp", "cnn", "lenet5", "cnn_bn", "lenet5_bn", "resnet18", "resnet18_imagenet", "resnet34", "resnet34_imagenet",
    "mobilenet_v1", "mobilenet_v1_imagenet", "resnet34_linear_base", "mobilenet_v1_linear_base", "alexnet_small",
    "shufflenetv2", "resnet18_x025", "alexnet_small_x025", "shufflenetv2_x05",
)  # fmt: skip


def known_models() -> tuple[str, ...]:
    """The zoo's live names once it is imported (models registered from outside pflbed and plugins included), else
    the built-in ones and the plugins' declared ones (`pflbed.plugins`): read from `sys.modules`, never imported here
    (the zoo imports torch)."""
    zoo = sys.modules.get("pflbed.models.zoo")
    return tuple(dict.fromkeys((*MODEL_NAMES, *plugins.names(plugins.MODELS)))) if zoo is None else tuple(zoo.models())


class ModelConfig(Strict):
    name: str = Field("cnn", description="a model of the zoo (pflbed.models.MODELS)")
    channels_last: bool = Field(
        False, description="store conv weights channels-last (NHWC): faster convolutions on CPU, float results "
        "change by rounding, so opt-in (docs/guide/speed.md)"
    )
    init_from: str | None = Field(
        None, description="start from these weights instead of a random init: a `pflbed pretrain` output "
        "(its directory or model.pt), a model saved by `pflbed personalize --out`, a plain state dict (.pt), or for "
        "resnet18_imagenet / resnet34_imagenet a torchvision/timm ResNet-18 / ResNet-34 state dict (.pt/.pth, or "
        "timm's .safetensors; its classifier is replaced by the run's)"
    )
    init_blocks: list[str] = Field(
        default_factory=lambda: ["all"], min_length=1, description="what init_from loads: [all], [body], [head] "
        "or block names (e.g. [conv1, conv2]); the other blocks keep the seed's random init"
    )

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        known = known_models()
        if v not in known and (why := plugins.problem(plugins.MODELS, v)) is not None:
            raise ValueError(why)
        if v not in known:
            raise ValueError(f"unknown model; known: {', '.join(sorted(known))}")
        return v
