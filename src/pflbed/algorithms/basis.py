"""Pure tensor functions behind FedBasis (`pflbed.algorithms.fedbasis`): combining basis models, sharpening
combination vectors, k-means over flattened models, and the collapse diagnostics of the paper's Fig. 2.

Kept free of any `Algorithm` so that each piece can be tested on hand-built tensors, and so that the
combination used in training, in evaluation and in the tests is one and the same function.

Conventions: K non-major bases are held *stacked*, one tensor of shape (K, *shape) per state key; combination
coefficients are a (G, K) matrix, one row per coefficient group (a block of the model, or G = 1 for one vector
for the whole network); `group_of` maps each state key to its row.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

Tensors = dict[str, torch.Tensor]

MAJOR_WEIGHT = 0.5  # θ = ½·v' + ½·Σ_k α[k]·v_k (paper §4.4, "the major basis")


def stack_bases(bases: list[Tensors], keys: Iterable[str] | None = None) -> Tensors:
    """One (K, *shape) tensor per key from K state dicts (copies: the stack never aliases its inputs)."""
    keys = list(keys) if keys is not None else list(bases[0])
    return {k: torch.stack([b[k] for b in bases]) for k in keys}


def mixing_weights(alpha: torch.Tensor, major: bool) -> tuple[float, torch.Tensor]:
    """(weight of the major basis, (G, K) weights of the non-major bases) of the combination.

    With a major basis every row sums to ½ + ½·Σα = 1; without it the major weight is 0 and the rows are α.
    """
    if major:
        return MAJOR_WEIGHT, (1.0 - MAJOR_WEIGHT) * alpha
    return 0.0, alpha


def combine(
    stacked: Mapping[str, torch.Tensor],
    alpha: torch.Tensor,
    group_of: Mapping[str, int],
    major: Mapping[str, torch.Tensor] | None = None,
    keys: Iterable[str] | None = None,
) -> Tensors:
    """θ[key] = w'·v'[key] + Σ_k w[g(key), k]·v_k[key] (paper Eq. 4 with §4.4's major basis and layer-wise rows).

    Differentiable in `alpha`, `stacked` and `major`. Integer tensors (BatchNorm's batch counters) are not
    combined: they are copied from the major basis, or from basis 0 without one — they are counts, not weights.
    The result holds fresh tensors only, so in-place updates of it (BatchNorm running statistics in a training
    forward) never reach the bases.
    """
    w_major, w = mixing_weights(alpha, major is not None)
    out: Tensors = {}
    for k in keys if keys is not None else stacked:
        v = stacked[k]
        if not v.is_floating_point():
            out[k] = (major[k] if major is not None else v[0]).clone()
            continue
        mixed = torch.tensordot(w[group_of[k]].to(v.dtype), v, dims=1)
        out[k] = mixed + w_major * major[k] if major is not None else mixed
    return out


def sharpen(alpha: torch.Tensor, tau: float) -> torch.Tensor:
    """SHARPEN(α; τ) = α^{1/τ} / Σ_k α[k]^{1/τ} along the last dimension (paper §4.2, Eq. 9 step 3).

    For α = softmax(ψ) this is softmax(ψ/τ), the paper's temperature softmax. Computed in log space so that a
    small τ gives a (near) one-hot vector instead of 0/0; τ = 1 returns α unchanged (the paper's no-sharpening
    ablation). A zero entry stays zero.
    """
    if tau <= 0:
        raise ValueError("tau must be > 0")
    return torch.softmax(torch.log(alpha) / tau, dim=-1)


def entropy(p: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) along the last dimension; 0·log 0 = 0. Uniform over K: log K (collapse, Fig. 2)."""
    return -(p * torch.log(p.clamp_min(1e-30))).sum(-1)


def mean_pairwise_cosine(vectors: torch.Tensor) -> float | None:
    """Mean cosine similarity over the K·(K−1)/2 pairs of rows of a (K, D) matrix (Fig. 2: bases collapse).

    None for fewer than two rows. A zero row has cosine 0 with everything (no direction to agree with).
    """
    n = vectors.shape[0]
    if n < 2:
        return None
    v = vectors.double()
    unit = v / v.norm(dim=1, keepdim=True).clamp_min(1e-30)
    sims = unit @ unit.T
    iu = torch.triu_indices(n, n, offset=1, device=v.device)
    return float(sims[iu[0], iu[1]].mean())


def kmeans_pp_init(points: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """Indices of k distinct initial centres by k-means++ (Arthur & Vassilvitskii 2007), drawn from `generator`.

    Why k-means++ rather than k random points: local models of one warm-start round are few and high
    dimensional; spreading the initial centres makes the K bases start from distinct clusters (K identical bases
    would stay identical forever, since identical bases receive identical gradients). Points at distance 0 from
    every chosen centre (duplicates) are drawn uniformly among the unchosen ones once no distance is left.
    """
    n = points.shape[0]
    if not 1 <= k <= n:
        raise ValueError(f"k-means needs 1 <= k <= number of points ({n}), got k = {k}")
    # drawn on the generator's device (the CPU; weights are copied there): the same centres on every device
    chosen = [int(torch.randint(n, (1,), generator=generator, device=generator.device))]
    d2 = torch.cdist(points, points[chosen[0]][None]).squeeze(1).double() ** 2
    while len(chosen) < k:
        free = torch.ones(n, dtype=torch.bool, device=points.device)
        free[chosen] = False
        weights = d2 * free
        if float(weights.sum()) <= 0:
            weights = free.double()
        nxt = int(torch.multinomial(weights.to(generator.device), 1, generator=generator))
        chosen.append(nxt)
        d2 = torch.minimum(d2, torch.cdist(points, points[nxt][None]).squeeze(1).double() ** 2)
    return torch.tensor(chosen, device=points.device)


def kmeans(points: torch.Tensor, k: int, iters: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's k-means on the rows of `points` (n, D): (assignment (n,), centroids (k, D)).

    Initialised by `kmeans_pp_init`; stops early when no assignment changes. A cluster that empties is given the
    point farthest from its current centroid (taken from a cluster with more than one member), so exactly k
    non-empty clusters come out whenever n ≥ k. Ties in distance go to the lower centroid index (argmin).
    """
    x = points  # no float64 copy: n flattened models can be large (80 ResNet-18s are 3.6 GB in float32)
    centroids = x[kmeans_pp_init(points, k, generator)].clone()
    assign = torch.full((x.shape[0],), -1, dtype=torch.long, device=x.device)
    for _ in range(max(iters, 1)):
        new = torch.cdist(x, centroids).argmin(1)
        for j in range(k):
            if not (new == j).any():
                dist = (x - centroids[new]).norm(dim=1)
                sizes = torch.bincount(new, minlength=k)
                dist[sizes[new] <= 1] = -1.0  # never empty another cluster
                new[int(dist.argmax())] = j
        if torch.equal(new, assign):
            break
        assign = new
        centroids = torch.stack([x[assign == j].mean(0) for j in range(k)])
    return assign, centroids


def stat_update_shares(coeffs: torch.Tensor) -> torch.Tensor:
    """How a change Δ of a combined statistic is split over the bases that form it: c_i / Σ_j c_j².

    θ = Σ_i c_i·v_i is linear in the bases; the smallest change of the bases (in the 2-norm) that moves θ by Δ is
    Δv_i = c_i·Δ / Σ_j c_j². It is proportional to c_i, like the gradient a basis receives (paper Eq. 8:
    ∇v_k = α[k]·∇θ), so a basis a client does not use (c_i = 0) keeps its statistics, while the combination
    tracks exactly the running statistics a single model would have accumulated.

    Along the last dimension, so a (G, n) matrix gives every coefficient group's shares at once. Computed on the
    tensors' device without reading a value back (FedBasis calls it every training batch: a host read there would
    stall a GPU each time); all-zero coefficients give zero shares.
    """
    total = (coeffs.double() ** 2).sum(-1, keepdim=True)
    return (coeffs / total.clamp_min(torch.finfo(torch.float64).tiny)).to(coeffs.dtype)


def flatten(params: Mapping[str, torch.Tensor], keys: Iterable[str]) -> torch.Tensor:
    """The given entries as one float vector, in the order of `keys`."""
    return torch.cat([params[k].detach().reshape(-1).float() for k in keys])


def max_entropy(k: int) -> float:
    """Entropy of the uniform vector over k entries (the collapsed state)."""
    return math.log(k) if k > 0 else 0.0
