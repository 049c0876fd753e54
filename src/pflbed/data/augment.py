"""Training-time augmentation (`dataset.augment`): random crop with 4-pixel padding and horizontal flip.

The standard CIFAR recipe (torchvision's `RandomCrop(size, padding=4)` then `RandomHorizontalFlip()`, per sample),
applied to each training mini-batch of client data where the batch lives, on the run's device, as batched tensor
operations: one gather per batch, no per-sample Python, no DataLoader.

Rule, per sample of an H×W image: pad every side by `PADDING` (4) pixels of black — raw pixel value 0, which in
the data's normalization is (0 − mean)/std per channel, since the recipe pads before normalizing — and take the
H×W window whose top-left corner is at (i, j), i and j uniform in 0 … 2·`PADDING`; then, with probability 1/2,
mirror it left–right (the last axis, W). `crop` and `flip` may be used alone; crop always comes first.

Randomness: drawn on the CPU from the generator of the work at hand — a client update's (seed, round, client)
generator, the final fine-tuning's and the new clients' — right after the batch's indices were drawn from it:
for a batch of n samples, first n (row, column) offsets (`crop`), then n coin flips (`flip`). A result thus depends
on (seed, round, client) alone, whatever executor, worker or device runs the client, and torch's global RNG is never
touched. The batched-clients executor draws the same numbers from the same generators in the same order
(`engine.batched`), so its clients see exactly the loop's augmented batches.

Only training mini-batches of client data go through it (`ClientData.batch`); never evaluation or validation,
features cached once for a linear probe (or a frozen lower slice), full-batch computations (SCAFFOLD's option-I
gradient, Per-FedAvg's personal adaptation), distillation on public data, or `pflbed pretrain`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pflbed.errors import ConfigError

PADDING = 4
AUGMENTS = ("crop", "flip")


@dataclass(frozen=True)
class Augment:
    """The augmentation of one run: `crop` (padding in pixels, 0: none), `flip`, and the padding's per-channel
    value in the data's normalization (`fill`)."""

    crop: int
    flip: bool
    fill: tuple[float, ...]
    _fills: dict = field(default_factory=dict, compare=False, repr=False)  # fill as a tensor, per device

    def draw(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """The random choices for `n` samples, int64 [n, 3] on the CPU: row offset, column offset (0 … 2·crop),
        flip (0 / 1). What is not augmented is 0 and draws nothing."""
        out = torch.zeros(n, 3, dtype=torch.int64)
        if self.crop:
            out[:, :2] = torch.randint(0, 2 * self.crop + 1, (n, 2), generator=generator)
        if self.flip:
            out[:, 2] = torch.randint(0, 2, (n,), generator=generator)
        return out

    def apply(self, x: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
        """`x` [n, C, H, W] augmented by `draws` (`draw`'s, on any device): a new tensor on `x`'s device."""
        n, c, h, w = x.shape
        d = draws.to(x.device)
        rows = torch.arange(h, device=x.device) + (d[:, :1] - self.crop)  # [n, H] source rows (may be outside)
        cols = torch.arange(w, device=x.device).expand(n, w)
        cols = torch.where(d[:, 2:3] == 1, (w - 1) - cols, cols) + (d[:, 1:2] - self.crop)  # [n, W]
        inside = ((rows >= 0) & (rows < h))[:, :, None] & ((cols >= 0) & (cols < w))[:, None, :]  # [n, H, W]
        flat = rows.clamp(0, h - 1)[:, :, None] * w + cols.clamp(0, w - 1)[:, None, :]  # [n, H, W]
        out = x.reshape(n, c, h * w).gather(2, flat.reshape(n, 1, h * w).expand(n, c, h * w)).view(n, c, h, w)
        return torch.where(inside[:, None], out, self._fill(x))

    def __reduce__(self) -> tuple:  # the per-device fill tensors stay behind (a worker rebuilds its own)
        return (Augment, (self.crop, self.flip, self.fill))

    def __call__(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return self.apply(x, self.draw(len(x), generator))

    def _fill(self, x: torch.Tensor) -> torch.Tensor:
        key = (x.device, x.dtype)
        if key not in self._fills:
            self._fills[key] = torch.tensor(self.fill, dtype=x.dtype).view(-1, 1, 1).to(x.device)
        return self._fills[key]


def black(pixel_norm: tuple, channels: int) -> tuple[float, ...]:
    """The normalized value of a raw 0 pixel, per channel, for a source's `pixel_norm` (mean, std)."""
    mean, std = (v if isinstance(v, Sequence) else (v,) * channels for v in pixel_norm)
    return tuple(-float(m) / float(s) for m, s in zip(mean, std, strict=True))


def make_augment(names: Sequence[str], input_shape: tuple[int, ...], pixel_norm: tuple) -> Augment | None:
    """`dataset.augment` for data of `input_shape` ([C, H, W]) normalized by `pixel_norm`; None for no augmentation.
    Image samples only (a ConfigError naming the field otherwise)."""
    if not names:
        return None
    if len(input_shape) != 3:
        raise ConfigError(f"dataset.augment: crop and flip need image samples [C, H, W]; these are "
                          f"{list(input_shape)}")  # fmt: skip
    return Augment(crop=PADDING if "crop" in names else 0, flip="flip" in names, fill=black(pixel_norm, input_shape[0]))
