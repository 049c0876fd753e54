"""In-memory datasets.

Every source lands in one tensor per split so training batches are index tensors into it: no `DataLoader`, no
per-sample Python, and a client's data is just a tensor of indices.
"""

from __future__ import annotations

import hashlib
import math
import numbers
from dataclasses import dataclass, replace

import numpy as np
import torch

from pflbed.errors import DataError

# Raw samples reaching this many times their range are no samples of it (a format's overflow, a wrong file): on the
# normalized scale, training on them diverged in its first epoch, and the divergence was blamed on the lr. A
# bound far above the mismatches that still train (8-bit images given to digits, 0–16: 16×) keeps them accepted.
RAW_RANGE_MAX = 10_000


@dataclass(frozen=True)
class ArrayDataset:
    """Features `x` (float32 [N, C, H, W] or [N, D], normalized), labels `y` (int64 [N]), optional domains and
    optional per-sample user ids `user` (int64 [N]: the writer, speaker or account a sample comes from, which
    `federation.partition: natural` turns into clients; names, where the data has them, in
    `DataSource.user_names`)."""

    x: torch.Tensor
    y: torch.Tensor
    domain: torch.Tensor | None = None
    user: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def to(self, device: torch.device | str) -> ArrayDataset:
        """`x` and `y` on `device` (what training and evaluation read); `domain` and `user` stay where they are,
        since only the federation's partitioning (NumPy, on the CPU) reads them. No copy where they are already
        there."""
        return replace(self, x=self.x.to(device), y=self.y.to(device))


@dataclass(frozen=True)
class DataSource:
    """A dataset's train and test splits plus what a model needs to know about them."""

    name: str
    train: ArrayDataset
    test: ArrayDataset
    num_classes: int
    origin: str  # where the data came from (a path, "scikit-learn", "generated"), shown by `pflbed data list`
    # (mean, std) that mapped [0, 1] pixels to `x`: one number each, or one per channel (ImageNet normalization)
    pixel_norm: tuple[float | tuple[float, ...], float | tuple[float, ...]] = (0.0, 1.0)
    domain_names: tuple[str, ...] = ()  # names of the values in `domain`, when the data has domains
    raw_scale: float = 1.0  # raw samples span [0, raw_scale] (digits 16, 8-bit images 255): x = (raw/scale − mean)/std
    raw_channels_last: bool = False  # raw images are [H, W, C] (decoded image files), `x` is [C, H, W]
    user_names: tuple[str, ...] = ()  # names of the values in `user`, when the data has users

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.train.x.shape[1:])

    @property
    def raw_shape(self) -> tuple[int, ...]:
        """The shape of one raw sample: [H, W] for one-channel images, [H, W, C] for decoded colour images."""
        shape = self.input_shape
        if len(shape) == 3 and self.raw_channels_last:
            return (*shape[1:], shape[0])
        return shape[1:] if len(shape) == 3 and shape[0] == 1 else shape

    def inputs(self, raw: np.ndarray | torch.Tensor, scale: float | None = None, what: str = "x") -> torch.Tensor:
        """Raw samples in this dataset's native format (e.g. digits' 8×8 images in 0–16, Fashion-MNIST's 28×28
        uint8 images) → model inputs, transformed as the loader transformed its own. `scale` overrides the raw
        range (images read from files span 0–255 whatever the dataset's own range). `what` names the input in
        errors. Why here: the transform is the loader's, and a trained model is useless without it."""
        arr = raw if isinstance(raw, torch.Tensor) else np.asarray(raw)
        kind = ("c" if arr.is_complex() else "f") if isinstance(arr, torch.Tensor) else arr.dtype.kind
        if kind not in "biuf":  # booleans, integers, floats: text, objects or complex numbers are no pixel values
            raise DataError(f"{what}: samples must be real numbers (got {arr.dtype})")
        x = torch.as_tensor(arr, dtype=torch.float32)
        if not bool(torch.isfinite(x).all()):  # a NaN sample trains a NaN model without a word
            bad = int((~torch.isfinite(x.reshape(len(x), -1))).any(1).sum()) if x.ndim else 1
            raise DataError(f"{what}: {bad} of {len(x) if x.ndim else 1} samples hold NaN or infinite values")
        if x.ndim < 1 or tuple(x.shape[1:]) not in (self.raw_shape, self.input_shape):
            raise DataError(f"{what}: samples of shape {list(x.shape[1:])}, but {self.name} samples are "
                            f"{list(self.raw_shape)}")  # fmt: skip
        real = isinstance(scale, numbers.Real) and not isinstance(scale, bool)
        if scale is not None and not (real and math.isfinite(scale) and scale > 0):
            raise DataError(f"{what}: scale must be a finite number > 0, the largest value the samples' format "
                            f"holds (255 for 8-bit images); got {scale!r}")  # fmt: skip
        scale = scale or self.raw_scale  # 0 was taken for unset, a negative scale flipped every pixel
        if x.numel() and (top := float(x.abs().max())) > RAW_RANGE_MAX * scale:
            raise DataError(f"{what}: values up to {top:.3g}, over {RAW_RANGE_MAX:,} times the range 0…{scale:g} "
                            f"the samples are scaled by; give raw samples in it, or pass their own range as "
                            f"scale")  # fmt: skip
        if tuple(x.shape[1:]) != self.input_shape:
            x = x.permute(0, 3, 1, 2) if self.raw_channels_last else x.unsqueeze(1)
        mean, std = (v if isinstance(v, float | int) else torch.tensor(v).view(-1, *[1] * (x.ndim - 2))
                     for v in self.pixel_norm)  # fmt: skip
        return ((x / scale - mean) / std).contiguous()

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


def held_out(n: int, fraction: float, seed: int, rank: int) -> np.ndarray:
    """Which of a user's `n` samples (in their order) a loader holds out as its test split: round(fraction · n)
    of them, at least one when the user has two or more and never all, drawn from the stream of (`seed`, the
    user's `rank` among the sorted user ids) — so the split is fixed by the data alone, the same on every machine."""
    k = min(max(round(fraction * n), 1 if n >= 2 else 0), n - 1) if n else 0
    mask = np.zeros(n, dtype=bool)
    mask[np.random.default_rng([seed, rank]).permutation(n)[:k]] = True
    return mask
