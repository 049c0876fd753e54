"""Model zoo with named blocks (see `blocks.BlockNet`)."""

from pflbed.models.blocks import BlockNet
from pflbed.models.zoo import MODELS, build_model

__all__ = ["MODELS", "BlockNet", "build_model"]
