"""Model zoo with named blocks (see `blocks.BlockNet`)."""

from pflbed.models.blocks import BlockNet
from pflbed.models.zoo import MODELS, ModelNames, build_model

__all__ = ["MODELS", "BlockNet", "ModelNames", "build_model"]
