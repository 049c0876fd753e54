"""Models as an ordered list of named blocks.

Personalized FL methods select parameter groups by *structure* ("the classifier", "the top two blocks",
"every BatchNorm") — never by matching parameter-name strings, which silently breaks when a model is renamed
(a trap several peer libraries fell into). A `BlockNet` runs its blocks in order; the last `num_head_blocks`
blocks form the head, the rest the body.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


class BlockNet(nn.Module):
    """Sequential network whose top-level children are named blocks."""

    def __init__(self, blocks: list[tuple[str, nn.Module]], num_head_blocks: int = 1) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict(blocks)
        if not 1 <= num_head_blocks < len(blocks):
            raise ValueError("a BlockNet needs at least one body block and one head block")
        self.num_head_blocks = num_head_blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            x = block(x)
        return x

    # --- structure -------------------------------------------------------------------------------------------
    def block_names(self) -> list[str]:
        return list(self.blocks.keys())

    def head_blocks(self) -> list[str]:
        return self.block_names()[-self.num_head_blocks :]

    def body_blocks(self) -> list[str]:
        return self.block_names()[: -self.num_head_blocks]

    def top_blocks(self, k: int) -> list[str]:
        """The top `k` blocks (FedPer's K_P personal layers are counted this way)."""
        if not 0 <= k <= len(self.blocks):
            raise ValueError(f"cannot take {k} top blocks of a {len(self.blocks)}-block model")
        return self.block_names()[len(self.blocks) - k :]

    def state_keys(self, blocks: Iterable[str]) -> list[str]:
        """State-dict keys (parameters and buffers) that belong to the given blocks, in model order."""
        wanted = set(blocks)
        unknown = wanted - set(self.blocks.keys())
        if unknown:
            raise KeyError(f"unknown blocks {sorted(unknown)}; model has {self.block_names()}")
        return [k for k in self.state_dict() if k.split(".")[1] in wanted]

    def module_state_keys(self, kinds: tuple[type[nn.Module], ...]) -> list[str]:
        """State-dict keys of every submodule of the given types (e.g. BatchNorm) — chosen by type, not name."""
        keys: list[str] = []
        for mname, module in self.named_modules():
            if isinstance(module, kinds):
                keys += [f"{mname}.{k}" for k in module.state_dict()]
        return keys

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Body output: the representation the head classifies."""
        for name in self.body_blocks():
            x = self.blocks[name](x)
        return x

    def classify(self, z: torch.Tensor) -> torch.Tensor:
        for name in self.head_blocks():
            z = self.blocks[name](z)
        return z
