"""The machinery behind FedBasis (`pflbed.algorithms.fedbasis`), as functions: combining basis models, sharpening
combination vectors, training through a combination (the mini-batch loop, trainable copies of the bases, the V
step's reparameterization, and the hand-back of BatchNorm statistics to them), the k-means warm start, and the
collapse diagnostics of the paper's Fig. 2.

Kept free of any `Algorithm` so that each piece can be tested on hand-built tensors, and so that the
combination used in training, in evaluation and in the tests is one and the same function; the algorithm file
keeps what the paper specifies (the steps of Eq. 9, Alg. 2, the schedule, the wire format). The Fig. 4
mixing-weight table and its heat-map/CSV writer are in `pflbed.algorithms.basis_plots`.

Conventions: K non-major bases are held *stacked*, one tensor of shape (K, *shape) per state key; combination
coefficients are a (G, K) matrix, one row per coefficient group (a block of the model, or G = 1 for one vector
for the whole network); `group_of` maps each state key to its row.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from pflbed.algorithms.common import ClientData
from pflbed.algorithms.local_sgd import model_forward
from pflbed.algorithms.local_sgd import weighted_mean as batch_mean
from pflbed.algorithms.sgd import SGD
from pflbed.algorithms.training import index_batches, weighted_mean

Tensors = dict[str, torch.Tensor]

MAJOR_WEIGHT = 0.5  # θ = ½·v' + ½·Σ_k α[k]·v_k (paper §4.4, "the major basis")
# A plan's tensors (`CombinedObjective`): the stacked bases' parameters and statistics, the major basis's, ψ, and
# the V step's own two (`v_step_theta`): the step P of the combination and the decay a of the starting bases
BASES_V, STATS_V, BASES_M, STATS_M, PSI, STEP, DECAY = "v.", "vs.", "m.", "ms.", "psi", "dv.", "decay"


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


def coefficients(alpha: torch.Tensor, major: bool) -> torch.Tensor:
    """The (G, [1 +] K) coefficients c_i of the combination, one row per group: the major basis's ½ first (if any),
    then the non-major bases' (`mixing_weights`)."""
    w_major, w = mixing_weights(alpha, major)
    return torch.cat([w.new_full((w.shape[0], 1), w_major), w], 1) if major else w


def v_step_theta(
    stacked: Mapping[str, torch.Tensor],
    major: Mapping[str, torch.Tensor] | None,
    alpha: torch.Tensor,
    step: Mapping[str, torch.Tensor],
    decay: torch.Tensor,
    group_of: Mapping[str, int],
    keys: Iterable[str],
) -> Tensors:
    """θ during the V step (Eq. 9 step 4), from the bases V⁰ it started from, its step P and decay a: θ = a·θ(α†, V⁰)
    + P, with the gradient reaching P multiplied by S = Σ_i c_i² of the key's group (`coefficients`) and none
    reaching a or V⁰.

    Why: with α† fixed, θ = Σ_i c_i·v_i is linear in the bases, each basis's gradient is c_i·∇θL (Eq. 8), and
    SGD with momentum μ and weight decay λ (`sgd.SGD`) keeps every basis of the form v_i = a·v_i⁰ + c_i·U: by
    induction, d_i = c_i·∇θL + λ·v_i = λa·v_i⁰ + c_i·(∇θL + λU) and the momentum buffers take the same form, so one
    SGD on U (gradient ∇θL, the same μ, λ and lr) and one on the scalar a (gradient 0, moved by λ alone: a = 1
    without weight decay) follow every basis exactly. Trained as P = S·U (then θ = a·θ⁰ + P, and SGD on P with
    gradient S·∇θL is S times SGD on U, weight decay included), the step holds one model's tensors a client
    instead of K + 1 bases, their gradients and momenta: in a batched round of ResNet-18s the difference between
    fitting a device and not. `trained_bases` gives the bases back: v_i = a·v_i⁰ + (c_i / S)·P. The same SGD in
    exact arithmetic; in floating point the sums are formed in another order (the tests compare with SGD on every
    basis written out, to 1e-5)."""
    frozen, frozen_major = detached(stacked, major)
    alpha = alpha.detach()
    start = combine(frozen, alpha, group_of, frozen_major, keys)
    scale = coefficients(alpha, major is not None).pow(2).sum(-1)  # S per group
    a = decay.detach() + 0 * decay  # a gradient of zeros, not none: weight decay still moves a
    out: Tensors = {}
    for k in keys:
        p = step[k]
        s = scale[group_of[k]].to(p.dtype)
        out[k] = a * start[k] + p + (s - 1) * (p - p.detach())  # the value a·θ⁰ + P; ∂/∂P = S·∇θL
    return out


def trained_bases(
    stacked: Mapping[str, torch.Tensor],
    major: Mapping[str, torch.Tensor] | None,
    alpha: torch.Tensor,
    step: Mapping[str, torch.Tensor],
    decay: torch.Tensor,
    group_of: Mapping[str, int],
    keys: Iterable[str],
) -> tuple[list[Tensors], Tensors | None]:
    """The bases after a V step of `v_step_theta` from `stacked` / `major` (V⁰): v_i = a·v_i⁰ + (c_i / S)·P over
    `keys`: (one dict per non-major basis, the major basis's or None), each entry a fresh tensor of its own — a
    reply as it is, with no stacked copy of the K bases beside it. c_i / S is `stat_update_shares` of the
    coefficients: the same split of a move of θ over the bases as for the statistics, and a basis with c_i = 0
    only decays."""
    shares_of = stat_update_shares(coefficients(alpha.detach(), major is not None))
    keys = list(keys)
    new: list[Tensors] = [{} for _ in range(stacked[keys[0]].shape[0])] if keys else []
    new_major: Tensors | None = {} if major is not None else None
    with torch.no_grad():
        for k in keys:
            p, shares = step[k], shares_of[group_of[k]].to(step[k].dtype)
            if new_major is not None and major is not None:
                new_major[k] = (major[k] * decay).addcmul_(p, shares[0])
                shares = shares[1:]
            for i, basis in enumerate(new):  # in place on the new tensor: no temporary between the kept ones
                basis[k] = (stacked[k][i] * decay).addcmul_(p, shares[i])
    return new, new_major


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
    v = vectors.double()
    return gram_mean_cosine(v @ v.T)


def gram_mean_cosine(gram: torch.Tensor) -> float | None:
    """`mean_pairwise_cosine` of the rows whose (K, K) Gram matrix of dot products (float64) is `gram`. Why from
    the Gram matrix: the Gram matrix of concatenated vectors is the sum of their parts' ones, so per-block and
    whole-model cosines need one pass over the parameters, not a concatenated float64 copy of each basis."""
    n = gram.shape[0]
    if n < 2:
        return None
    norms = gram.diagonal().clamp_min(0).sqrt().clamp_min(1e-30)
    sims = gram / norms[:, None] / norms[None, :]
    iu = torch.triu_indices(n, n, offset=1, device=gram.device)
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


def tracked_statistics(
    stacked: Mapping[str, torch.Tensor],
    major: Mapping[str, torch.Tensor] | None,
    alpha: torch.Tensor,
    before: Mapping[str, torch.Tensor],
    after: Mapping[str, torch.Tensor],
    keys: Iterable[str],
    group_of: Mapping[str, int],
    var_keys: Container[str],
) -> tuple[Tensors, Tensors | None]:
    """The bases' running statistics after one batch's update of the combined ones is handed back to them: (new
    stacked statistics, new major statistics or None) over `keys`, as fresh tensors (functional: it also runs
    inside a vmapped step, `engine.batched`).

    A training forward updates only the fresh combined copies (`combine` never aliases the bases), from `before`
    to `after`. Without this the bases would keep their warm-start statistics forever while their weights move
    on, and every combined model would normalize with stale moments. Each float statistic's Δ = after − before is
    split by `stat_update_shares` over the coefficients c_i of the combination (½ for v', ½·α[g, k] for v_k;
    α alone without a major basis): Δv_i = c_i·Δ / Σ_j c_j², so the combination follows exactly the EMA a single
    model would have, and a basis with c_i = 0 keeps its statistics (like its weights: ∇v_k = α[k]·∇θ = 0).

    Integer tensors (BatchNorm's batch counters) are counts, not weights: every basis (and v') adds the whole Δ,
    whatever its coefficient — it counts every batch of every client it was sent to. A running variance (a key
    in `var_keys`) is floored at 0 afterwards: a share c_i / Σ_j c_j² can exceed 1 (v' with uniform α over K = 4
    gets 1.6·Δ), so a shrinking combined variance could push a basis's below zero.

    Every step stays on the tensors' device, with no value read back per statistic (a ResNet-18 has 40 of them
    per batch: a host read each would stall a GPU each time).
    """
    shares_of = stat_update_shares(coefficients(alpha.double(), major is not None))  # (groups, [v'] + bases)
    new: Tensors = {}
    new_major: Tensors | None = {} if major is not None else None
    with torch.no_grad():
        for k in keys:
            delta = after[k] - before[k]
            v = stacked[k]
            if not v.is_floating_point():  # batch counters: every basis counts the batches
                new[k] = v + delta
                if new_major is not None and major is not None:
                    new_major[k] = major[k] + delta
                continue
            shares = shares_of[group_of[k]].to(v.dtype)
            if new_major is not None and major is not None:
                new_major[k] = major[k] + shares[0] * delta
                shares = shares[1:]
            new[k] = v + shares.view(-1, *([1] * delta.dim())) * delta
            if k in var_keys:
                new[k] = new[k].clamp_min(0)
                if new_major is not None:
                    new_major[k] = new_major[k].clamp_min(0)
    return new, new_major


class CombinedObjective:
    """FedBasis's local loss as a plan's objective (`local_sgd.Objective`): cross-entropy of the combined model
    θ(α, V) (`combine`), the plan's tensors being the bases' parameters `v.<key>` (stacked, (K, …)), their
    running statistics `vs.<key>`, the major basis's `m.<key>` / `ms.<key>` (if any), ψ (`psi`, (G, K)), and the
    V step's step `dv.<key>` and decay `decay` (`v_step_theta`: the bases themselves stay as the round sent them).

    `alpha`: where α comes from — "softmax": softmax(ψ) (the ψ step, Eq. 9 steps 1–2, ψ trained, V frozen);
    "sharpened": SHARPEN(softmax(ψ); τ), held fixed (the V step with α†, Eq. 9 steps 3–4, ψ as the ψ step left
    it); "given": the plan's constant `alpha` (a V step with an α† of the caller's). It also serves the model's
    BatchNorm statistics per batch (`running`: combined from the bases with α detached — statistics are not
    trained) and, with `track`, hands their update back to the bases (`hand_back`: `tracked_statistics`) — the
    hooks `local_sgd.run_plan` and `engine.batched` call around each step. A class, not a closure: the algorithm
    travels to `procs` workers by pickle, and clients' plans batch together when they share one objective.
    """

    def __init__(self, param_keys: Sequence[str], buffer_keys: Sequence[str], group_of: Mapping[str, int],
                 var_keys: Container[str], *, alpha: str, tau: float, track: bool) -> None:  # fmt: skip
        self.param_keys, self.buffer_keys, self.group_of = list(param_keys), list(buffer_keys), dict(group_of)
        self.var_keys, self.alpha, self.tau, self.track = var_keys, alpha, tau, track

    def coefficients(self, params: Tensors, consts: Tensors) -> torch.Tensor:
        if self.alpha == "given":
            return consts["alpha"]
        a = torch.softmax(params[PSI], -1)
        return sharpen(a, self.tau).detach() if self.alpha == "sharpened" else a

    @staticmethod
    def bases(params: Tensors, keys: Sequence[str], stats: bool) -> tuple[Tensors, Tensors | None]:
        """(stacked bases, major basis or None) over `keys` from the plan's tensors."""
        v, m = (STATS_V, STATS_M) if stats else (BASES_V, BASES_M)
        major = {k: params[m + k] for k in keys} if keys and m + keys[0] in params else None
        return {k: params[v + k] for k in keys}, major

    def running(self, params: Tensors, consts: Tensors) -> Tensors:
        """The batch's BatchNorm statistics: the bases' combined with α, detached."""
        stacked, major = self.bases(params, self.buffer_keys, True)
        return combine(stacked, self.coefficients(params, consts).detach(), self.group_of, major, self.buffer_keys)

    def hand_back(self, params: Tensors, consts: Tensors, before: Tensors, after: Tensors) -> Tensors:
        """The bases' new statistics (`vs.` / `ms.`) after the forward moved the combined ones; none without
        `track`."""
        if not self.track:
            return {}
        stacked, major = self.bases(params, self.buffer_keys, True)
        new, new_major = tracked_statistics(stacked, major, self.coefficients(params, consts).detach(), before, after,
                                            self.buffer_keys, self.group_of, self.var_keys)  # fmt: skip
        return {STATS_V + k: v for k, v in new.items()} | {STATS_M + k: v for k, v in (new_major or {}).items()}

    def __call__(
        self, model: nn.Module, params: Tensors, consts: Tensors, x: torch.Tensor, y: torch.Tensor,
        w: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        stacked, major = self.bases(params, self.param_keys, False)
        alpha = self.coefficients(params, consts)
        if self.alpha == "softmax":
            frozen, frozen_major = detached(stacked, major)  # V is frozen: no gradient of the bases computed
            theta = combine(frozen, alpha, self.group_of, frozen_major, self.param_keys)
        else:
            step = {k: params[STEP + k] for k in self.param_keys}
            theta = v_step_theta(stacked, major, alpha, step, params[DECAY], self.group_of, self.param_keys)
        logits = model_forward(model, theta, x)
        return F.cross_entropy(logits, y) if w is None else batch_mean(F.cross_entropy(logits, y, reduction="none"), w)


def detached(
    stacked: Mapping[str, torch.Tensor], major: Mapping[str, torch.Tensor] | None
) -> tuple[Tensors, Tensors | None]:
    """The bases cut from the autograd graph (views, no copies): frozen for a step, or handed on after one."""
    frozen_major = {k: v.detach() for k, v in major.items()} if major is not None else None
    return {k: v.detach() for k, v in stacked.items()}, frozen_major


def trainable_copies(
    stacked: Mapping[str, torch.Tensor], major: Mapping[str, torch.Tensor] | None, param_keys: Sequence[str]
) -> tuple[Tensors, Tensors | None, list[torch.Tensor]]:
    """(stacked bases, major basis, leaves): detached copies whose parameters are leaves that require grad.

    Why copies: the bases come from a payload that other clients of the round (and the server state) share, and
    the optimizer updates its leaves in place. The statistics are plain copies, not leaves: they are never
    trained, only tracked by `tracked_statistics`. `leaves` lists the parameters in the order of `param_keys`, first
    those of the stacked bases, then those of the major basis (if any) — the optimizer's parameter order.
    """
    named = set(param_keys)

    def leaf(k: str, t: torch.Tensor) -> torch.Tensor:
        t = t.detach().clone()
        return t.requires_grad_(True) if k in named else t

    copies = {k: leaf(k, v) for k, v in stacked.items()}
    major_copy = {k: leaf(k, v) for k, v in major.items()} if major is not None else None
    leaves = [copies[k] for k in param_keys] + ([major_copy[k] for k in param_keys] if major_copy else [])
    return copies, major_copy, leaves


def sgd_through_combination(
    model: nn.Module,
    data: ClientData,
    params: Callable[[], Tensors],
    alpha: Callable[[], torch.Tensor],
    stacked: Tensors,
    major: Tensors | None,
    opt: SGD,
    *,
    epochs: int,
    batch_size: int,
    generator: torch.Generator,
    group_of: Mapping[str, int],
    buffer_keys: Sequence[str],
    var_keys: Container[str],
    track: bool,
) -> None:
    """Mini-batch SGD (cross-entropy) through the combined model θ(α, V), run by `functional_call` on `model`.

    θ's parameters come from `params()`, rebuilt every batch so that the gradient reaches whatever the caller
    made a leaf (ψ inside `alpha`, the bases of `trainable_copies`, or both); `opt` steps those. Its statistics
    (`buffer_keys`) are combined from `stacked`/`major` with α detached — statistics are not trained — into fresh
    copies, so the forward's in-place running-statistic update never reaches the bases, nor the template `model`
    (whose own tensors `functional_call` never reads or writes: one shared model serves every client). With
    `track`, each batch's update of those copies is handed back to the bases by `tracked_statistics`; without it
    the bases keep their statistics (a frozen V). Batches: `epochs` passes over the client's training indices,
    through `ClientData.batch` (the run's augmentation, drawn from `generator`).
    """
    model.train()
    for b in index_batches(data.train, batch_size, epochs, generator):
        x, y = data.batch(b, generator)
        a = alpha()
        with torch.no_grad():
            before = combine(stacked, a.detach(), group_of, major, buffer_keys)
        running = {k: v.clone() for k, v in before.items()}
        out = functional_call(model, {**params(), **running}, (x,))
        loss = F.cross_entropy(out, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if track:  # in place: the caller's bases
            new, new_major = tracked_statistics(stacked, major, a.detach(), before, running, buffer_keys, group_of,
                                                var_keys)  # fmt: skip
            with torch.no_grad():
                for k in buffer_keys:
                    stacked[k].copy_(new[k])
                    if major is not None and new_major is not None:
                        major[k].copy_(new_major[k])


def kmeans_bases(
    pool: Mapping[int, Tensors], param_keys: Sequence[str], keys: Sequence[str], k: int, iters: int,
    generator: torch.Generator,
) -> Tensors:  # fmt: skip
    """The warm start's K bases (paper §4.4): centroids of a k-means over the clients' local models, stacked.

    `pool` maps client ids to full state dicts. The clustering runs on the flattened *parameters* only
    (`param_keys`: BatchNorm statistics have large magnitudes and would dominate the distances without being
    learned), unweighted ("cluster {θ_m} into K clusters"). A centroid is the plain mean of its members' full
    state dicts over `keys` (statistics included; integer counters take the maximum, as `weighted_mean`).
    Clusters are numbered by their lowest client id, so the bases do not depend on the order k-means++ happened
    to seed them in (only on the partition), and a rerun with the same `generator` gives the same bases.
    """
    cids = sorted(pool)
    points = torch.stack([flatten(pool[c], param_keys) for c in cids])
    assign, _ = kmeans(points, k, iters, generator)
    del points  # n flattened models: freed before the centroids are built
    clusters = [[c for c, a in zip(cids, assign.tolist(), strict=True) if a == j] for j in range(k)]
    clusters.sort(key=min)
    centroids = [weighted_mean({c: pool[c] for c in members}, dict.fromkeys(members, 1.0), keys)
                 for members in clusters]  # fmt: skip
    return stack_bases(centroids, keys)


def collapse_diagnostics(
    stacked: Mapping[str, torch.Tensor],
    param_keys: Sequence[str],
    blocks: Mapping[str, Sequence[str]],
    alpha_star: Sequence[torch.Tensor],
    alpha_dagger: Sequence[torch.Tensor],
) -> dict[str, Any]:
    """The collapse signals of the paper's Fig. 2, as reported per evaluation (values rounded to 6 decimals).

    `basis_cos`: mean pairwise cosine similarity of the K non-major bases' flattened parameters (`param_keys`;
    statistics and v' excluded: the question is whether the *learned* bases stay distinct), and
    `basis_cos_blocks`: the same per block (`blocks`: block name → its parameter keys, in the model's order; a
    block without parameters is left out). `alpha_entropy` / `alpha_sharp_entropy`: mean entropy (nats) of the
    clients' α* / α† (one (groups, K) matrix each, in the same client order), over clients and groups — None
    without clients; `alpha_entropy_max` = log K is the value of a collapsed, uniform combination;
    `alpha_clients`: how many clients entered the means.
    """
    k = next(iter(stacked.values())).shape[0]

    grams = {}
    for key in dict.fromkeys([*param_keys, *(key for keys in blocks.values() for key in keys)]):
        m = stacked[key].reshape(k, -1).double()
        grams[key] = m @ m.T

    def cosine(keys: Sequence[str]) -> float | None:
        return _round6(gram_mean_cosine(sum(grams[key] for key in keys)))

    everything = cosine(param_keys)
    per_block = {b: cosine(keys) for b, keys in blocks.items() if keys}
    ent = [float(entropy(a).mean()) for a in alpha_star]
    sharp = [float(entropy(a).mean()) for a in alpha_dagger]
    return {
        "basis_cos": everything,
        "basis_cos_blocks": per_block,
        "alpha_entropy": _round6(sum(ent) / len(ent)) if ent else None,
        "alpha_sharp_entropy": _round6(sum(sharp) / len(sharp)) if sharp else None,
        "alpha_entropy_max": _round6(max_entropy(k)),
        "alpha_clients": len(alpha_star),
    }


def _round6(x: float | None) -> float | None:
    """Six decimals, as the diagnostics are reported (metrics, summary.json): stable to compare across runs."""
    return None if x is None else round(x, 6)
