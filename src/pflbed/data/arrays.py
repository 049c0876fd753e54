"""In-memory datasets.

Every source lands in one tensor per split so training batches are index tensors into it: no `DataLoader`, no
per-sample Python, and a client's data is just a tensor of indices.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class ArrayDataset:
    """Features `x` (float32 [N, C, H, W] or [N, D], normalized), labels `y` (int64 [N]), optional domains."""

    x: torch.Tensor
    y: torch.Tensor
    domain: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def to(self, device: torch.device | str) -> ArrayDataset:
        """`x` and `y` on `device` (what training and evaluation read); `domain` stays where it is, since only the
        federation's partitioning (NumPy, on the CPU) reads it. No copy where they are already there."""
        return replace(self, x=self.x.to(device), y=self.y.to(device))


@dataclass(frozen=True)
class DataSource:
    """A dataset's train and test splits plus what a model needs to know about them."""

    name: str
    train: ArrayDataset
    test: ArrayDataset
    num_classes: int
    origin: str  # where the data came from (a path, "scikit-learn", "generated"), shown by `pflbed data list`
    pixel_norm: tuple[float, float] = (0.0, 1.0)  # (mean, std) that mapped [0, 1] pixels to `x`
    domain_names: tuple[str, ...] = ()  # names of the values in `domain`, when the data has domains

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.train.x.shape[1:])

    def to(self, device: torch.device | str) -> DataSource:
        """Both splits' samples and labels on `device` (`ArrayDataset.to`); the same object where already there."""
        train, test = self.train.to(device), self.test.to(device)
        if train.x is self.train.x and train.y is self.train.y and test.x is self.test.x and test.y is self.test.y:
            return self
        return replace(self, train=train, test=test)

    def fingerprint(self) -> str:
        """Content hash keying federation caches: name, shapes, every label and a strided pixel sample."""
        h = hashlib.sha256(self.name.encode())
        for split in (self.train, self.test):
            h.update(str(tuple(split.x.shape)).encode())
            h.update(split.y.cpu().numpy().tobytes())
            flat = split.x.reshape(len(split), math.prod(split.x.shape[1:]))
            h.update(flat[:, :: max(1, flat.shape[1] // 7)].cpu().contiguous().numpy().tobytes())
        return h.hexdigest()[:16]
