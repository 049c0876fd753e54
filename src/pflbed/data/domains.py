"""Domains from declared transforms: rotations and corruptions applied deterministically.

Cross-domain benchmarks (rotated-MNIST style, or corrupted copies) need samples that differ in P(x) by domain.
Each sample of a split is assigned to one domain — stratified by class, so every domain has the same class
mix — and transformed by its domain's transform. The assignment and the random corruptions use a fixed seed
that belongs to the *dataset*, not the run: every run and every seed sees the same cross-domain data.

Transforms operate on normalized tensors. Rotations by multiples of 90° are exact (`torch.rot90`); blur and
contrast are affine so they commute with normalization; `invert` maps a pixel p to 1 − p, which needs the
(mean, std) the loader normalized with (`DataSource.pixel_norm`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F

from pflbed.data.arrays import ArrayDataset, DataSource
from pflbed.errors import DataError

_DATASET_SEED = 20221

Transform = Callable[[torch.Tensor, tuple[float, float], torch.Generator], torch.Tensor]


def _rot(k: int) -> Transform:
    return lambda x, norm, gen: torch.rot90(x, k, dims=(-2, -1)).contiguous()


def _noise(x: torch.Tensor, norm: tuple[float, float], gen: torch.Generator) -> torch.Tensor:
    return x + torch.randn(x.shape, generator=gen) * (0.3 / norm[1])  # σ = 0.3 in pixel units


def _blur(x: torch.Tensor, norm: tuple[float, float], gen: torch.Generator) -> torch.Tensor:
    k1 = torch.tensor([1.0, 2.0, 1.0])
    kernel = (k1[:, None] * k1[None, :] / 16).expand(x.shape[1], 1, 3, 3).contiguous()
    return F.conv2d(F.pad(x, (1, 1, 1, 1), mode="replicate"), kernel, groups=x.shape[1])


def _contrast(x: torch.Tensor, norm: tuple[float, float], gen: torch.Generator) -> torch.Tensor:
    m = x.mean(dim=(-3, -2, -1), keepdim=True)
    return m + 0.4 * (x - m)


def _invert(x: torch.Tensor, norm: tuple[float, float], gen: torch.Generator) -> torch.Tensor:
    mean, std = norm
    return (1 - 2 * mean) / std - x  # normalized value of (1 − pixel)


TRANSFORMS: dict[str, Transform] = {
    "clean": lambda x, norm, gen: x,
    "rot0": _rot(0),
    "rot90": _rot(1),
    "rot180": _rot(2),
    "rot270": _rot(3),
    "noise": _noise,
    "blur": _blur,
    "contrast": _contrast,
    "invert": _invert,
}

# Built-in cross-domain datasets: name → (base dataset, domain transforms).
BUILTIN: dict[str, tuple[str, tuple[str, ...]]] = {
    "fmnist-rot4": ("fmnist", ("rot0", "rot90", "rot180", "rot270")),
    "digits-rot4": ("digits", ("rot0", "rot90", "rot180", "rot270")),
}


def assign_domains(labels: torch.Tensor, num_domains: int, generator: torch.Generator) -> torch.Tensor:
    """Domain per sample: within each class, a random order dealt round-robin, so domains are class-balanced."""
    domain = torch.empty_like(labels)
    for c in labels.unique():
        idx = (labels == c).nonzero().squeeze(1)
        idx = idx[torch.randperm(len(idx), generator=generator)]
        domain[idx] = torch.arange(len(idx)) % num_domains
    return domain


def _apply(split: ArrayDataset, domains: tuple[str, ...], norm: tuple[float, float], gen: torch.Generator):
    if len(split) == 0:
        return ArrayDataset(split.x, split.y, split.y.clone(), split.user)
    domain = assign_domains(split.y, len(domains), gen)
    x = split.x.clone()
    for d, name in enumerate(domains):
        idx = (domain == d).nonzero().squeeze(1)
        if len(idx):
            x[idx] = TRANSFORMS[name](split.x[idx], norm, gen)
    return ArrayDataset(x, split.y, domain, split.user)


def with_domains(source: DataSource, domains: tuple[str, ...] | list[str], name: str | None = None) -> DataSource:
    """A copy of `source` whose samples are split into the given transform domains."""
    domains = tuple(domains)
    unknown = [d for d in domains if d not in TRANSFORMS]
    if unknown:
        raise DataError(f"dataset.domains: unknown transform(s) {unknown}; known: {', '.join(TRANSFORMS)}")
    if len(set(domains)) != len(domains) or len(domains) < 1:
        raise DataError(f"dataset.domains: need one or more distinct transforms, got {list(domains)}")
    if source.train.domain is not None:
        raise DataError(f"dataset {source.name!r} already has domains; dataset.domains cannot be added")
    shape = list(source.train.x.shape[1:])
    if len(shape) != 3:  # blur, contrast and the rotations act on a sample's channels, rows and columns
        raise DataError(
            f"dataset.domains: transforms act on images [C, H, W]; {source.name} has samples of shape {shape}"
        )
    turned = [d for d in domains if d in ("rot90", "rot270")]
    if turned and shape[1] != shape[2]:
        raise DataError(
            f"dataset.domains: {turned[0]} needs square images; {source.name} has {shape[1]}×{shape[2]} images"
        )
    gen = torch.Generator().manual_seed(_DATASET_SEED)
    return replace(
        source,
        name=name or f"{source.name}[{','.join(domains)}]",
        train=_apply(source.train, domains, source.pixel_norm, gen),
        test=_apply(source.test, domains, source.pixel_norm, gen),
        domain_names=domains,
    )
