"""Shared pieces of the knowledge-transfer family (KT-pFL, FedMD, FedDF, Sim-pFL, TopK-pFL), as pure functions.

These methods exchange *soft predictions* on a public batch instead of parameters: each client uploads
s_m = softmax(z_m / T) on the same public samples, the server mixes them into one target per client,
t_n = Σ_m W[n, m]·s_m, and each client distils towards its target. They differ only in how the mixing matrix W
is obtained (uniform for FedMD, cosine similarity for Sim-pFL, top-K for TopK-pFL, learned for KT-pFL), so the
matrix convention is fixed here once: **row n of W holds client n's weights over the teachers m** (rows sum to 1).
KT-pFL's paper writes the same matrix transposed (c_mn = W[n, m], t_n = Σ_m c_mn·s_m, Eq. 2); the authors' code
uses the row convention, which is what "row entropy" and "row re-normalization" refer to.

Nothing here touches an `Algorithm`, the engine or the wire format: all functions take and return tensors, so the
server side (mixing, coefficient updates) and the client side (prediction, distillation) stay independent.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from pflbed import rng
from pflbed.algorithms.common import Tensors
from pflbed.algorithms.local_sgd import model_forward, weighted_mean
from pflbed.models import BlockNet

EPS = 1e-12  # floor of probabilities inside logarithms: a teacher mix may put exactly zero mass on a class
PUBLIC_STREAM = 101  # rng tag of the public-batch stream (the engine's own tags are 1–4)
Reduction = Literal["batchmean", "mean"]


# --- public data -------------------------------------------------------------------------------------------------
def public_batch(public: torch.Tensor, size: int, seed: int, rnd: int) -> torch.Tensor:
    """The public indices of round `rnd`: `size` of them drawn without replacement from (seed, round) alone.

    Server and clients call this independently and get the same batch: only the round number (a tensor) needs to
    cross the wire, never the indices. `size` ≥ the public set's size means the whole set (in a fixed order).
    """
    if public.numel() == 0:
        raise ValueError("no public data: set federation.public > 0")
    if size >= public.numel():
        return public.clone()
    perm = torch.randperm(public.numel(), generator=rng.generator(seed, PUBLIC_STREAM, rnd), device="cpu")
    return public[perm[:size]]


# --- client side -------------------------------------------------------------------------------------------------
def soft_predictions(model: nn.Module, x: torch.Tensor, temperature: float, batch_size: int = 1024) -> torch.Tensor:
    """s = softmax(z / T) in eval mode (no dropout, BatchNorm running statistics untouched), no gradient."""
    model.eval()
    with torch.no_grad():
        z = torch.cat([model(x[i : i + batch_size]) for i in range(0, len(x), batch_size)])
    return F.softmax(z.float() / temperature, dim=1)


def kl_to_target(
    logits: torch.Tensor, target: torch.Tensor, temperature: float, reduction: Reduction = "batchmean"
) -> torch.Tensor:
    """KL(target ‖ softmax(logits / T)), the distillation loss of KT-pFL Eq. 6 (and FedMD / FedDF).

    `batchmean`: Σ over classes, mean over samples (the KL divergence per sample). `mean`: mean over all entries,
    i.e. batchmean / C (torch's `reduction='mean'`, what the KT-pFL code uses). No T² factor (neither the paper nor
    the code has one).
    """
    log_s = F.log_softmax(logits / temperature, dim=1)
    loss = F.kl_div(log_s, target, reduction="batchmean")
    return loss / logits.shape[1] if reduction == "mean" else loss


@dataclass(frozen=True)
class DistillObjective:
    """Eq. 6 as a plan's loss (`local_sgd.Objective`): KL(t ‖ softmax(z / T)) of the model's logits on public
    samples, `y` being each sample's position in the public batch and the client's targets `consts["targets"]`
    one row per position. In the loop (`w` None) exactly `kl_to_target`; in a batched step the same per-sample
    KL, weighted."""

    temperature: float
    reduction: Reduction

    def __call__(
        self, model: BlockNet, params: Tensors, consts: Tensors, x: torch.Tensor, y: torch.Tensor,
        w: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        logits, target = model_forward(model, params, x), consts["targets"][y]
        if w is None:
            return kl_to_target(logits, target, self.temperature, self.reduction)
        per_sample = F.kl_div(F.log_softmax(logits / self.temperature, dim=1), target, reduction="none").sum(1)
        return weighted_mean(per_sample / logits.shape[1] if self.reduction == "mean" else per_sample, w)


# --- server side -------------------------------------------------------------------------------------------------
def mix(W: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """Targets t_n = Σ_m W[n, m]·s_m for predictions S of shape (M, B, C); returns (N, B, C)."""
    return torch.einsum("nm,mbc->nbc", W, S)


def kl_per_client(T: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """KL(t_n ‖ s_n) per client, summed over classes and averaged over the public samples; shape (N,)."""
    return (T * (T.clamp_min(EPS).log() - S.clamp_min(EPS).log())).sum(-1).mean(-1)


def coefficient_objective(
    W: torch.Tensor, S: torch.Tensor, weights: torch.Tensor, lam: float, rho: float, prior: float
) -> torch.Tensor:
    """KT-pFL Eq. 4 as a function of the coefficients (models fixed): λ·Σ_n (D_n/D)·KL(t_n ‖ s_n) + ρ‖W − prior‖².

    `weights` are D_n/D. The KL is averaged over the public samples (Eq. 2 sums them: λ = |batch| gives the sum).
    Differentiable in W; `coefficient_grad` is its closed-form gradient.
    """
    return lam * (weights * kl_per_client(mix(W, S), S)).sum() + rho * ((W - prior) ** 2).sum()


def coefficient_grad(
    W: torch.Tensor, S: torch.Tensor, weights: torch.Tensor, lam: float, rho: float, prior: float
) -> torch.Tensor:
    """∂(Eq. 4)/∂W in closed form: the gradient of KT-pFL Eq. 7.

    With t_n = Σ_m W[n, m]·s_m and KL(t_n ‖ s_n) = mean_b Σ_c t_nbc (log t_nbc − log s_nbc):
    ∂KL_n/∂W[n, m] = mean_b Σ_c s_mbc (log t_nbc − log s_nbc + 1); rows other than n do not enter KL_n
    (the student s_n is the fixed model's prediction). Plus 2ρ(W − prior).
    """
    T = mix(W, S)
    d = T.clamp_min(EPS).log() - S.clamp_min(EPS).log() + 1.0  # ∂KL/∂t, shape (N, B, C)
    g = torch.einsum("mbc,nbc->nm", S, d) / S.shape[1]
    return lam * weights[:, None] * g + 2.0 * rho * (W - prior)


def mse_coefficient_grad(W: torch.Tensor, S: torch.Tensor, rho: float) -> torch.Tensor:
    """The gradient the KT-pFL code uses instead of Eq. 7 (one independent loss per row n):

    loss_n = mean_{b,c} (s_n − t_n)² + ρ·mean_m (W[n, m] − 1/N)², t_n = Σ_m W[n, m]·s_m (MSE of probabilities
    instead of KL, no D_n/D or λ; `torch.nn.MSELoss` means).
    """
    n, b, c = S.shape
    T = mix(W, S)
    g = 2.0 * torch.einsum("mbc,nbc->nm", S, T - S) / (b * c)
    return g + 2.0 * rho * (W - 1.0 / n) / n


def power5_step(grad_row: torch.Tensor) -> float:
    """The KT-pFL code's adaptive step size for one row: powers of 5 that bring the mean |gradient| near 0.01.

    a = Σ|g| / N, η = 1; five times: if a > 0.01 divide both by 5; then if a < 0.01 multiply both by 5. (The two
    tests run in sequence in each iteration, as in the authors' code.)
    """
    avg, lr = float(grad_row.abs().sum()) / grad_row.numel(), 1.0
    for _ in range(5):
        if avg > 0.01:
            avg, lr = avg / 5, lr / 5
        if avg < 0.01:
            avg, lr = avg * 5, lr * 5
    return lr


def project_rows_to_simplex(W: torch.Tensor) -> torch.Tensor:
    """Euclidean projection of every row onto the probability simplex {w ≥ 0, Σ w = 1} (Duchi et al., ICML 2008).

    The closest valid weight vector in L2, so a projected gradient step stays a gradient step wherever it can.
    """
    u, _ = W.sort(dim=1, descending=True)
    css = u.cumsum(1) - 1.0
    k = torch.arange(1, W.shape[1] + 1, dtype=W.dtype, device=W.device)
    cond = u - css / k > 0
    r = cond.to(W.dtype).cumsum(1).argmax(1, keepdim=True)  # last index where the condition holds
    theta = css.gather(1, r) / (r + 1).to(W.dtype)
    return (W - theta).clamp_min(0.0)


def row_entropy(W: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) of every row; log N for uniform rows, 0 for one-hot rows."""
    p = W.clamp_min(0.0)
    p = p / p.sum(1, keepdim=True).clamp_min(EPS)
    return -(p * p.clamp_min(EPS).log()).sum(1)


def cosine_similarity_matrix(S: torch.Tensor) -> torch.Tensor:
    """Cosine similarity between the clients' flattened soft predictions on the same public batch; (M, M)."""
    flat = F.normalize(S.reshape(S.shape[0], -1).float(), dim=1)
    return flat @ flat.T


def normalize_rows(W: torch.Tensor) -> torch.Tensor:
    """Rows scaled to sum 1 (negative entries clamped to 0 first; an all-zero row becomes uniform)."""
    W = W.clamp_min(0.0)
    s = W.sum(1, keepdim=True)
    return torch.where(s > 0, W / s.clamp_min(EPS), torch.full_like(W, 1.0 / W.shape[1]))


def topk_rows(W: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the `k` largest entries of every row at weight 1/k, zero elsewhere (ties broken by `torch.topk`)."""
    k = min(k, W.shape[1])
    out = torch.zeros_like(W)
    out.scatter_(1, W.topk(k, dim=1).indices, 1.0 / k)
    return out


def label_set(prior: torch.Tensor) -> tuple[int, ...]:
    """The client's majority labels: those with at least 1/C of its training distribution (at least the top one)."""
    c = len(prior)
    labels = sorted(int(i) for i in torch.nonzero(prior >= 1.0 / c).flatten())
    return tuple(labels) if labels else (int(prior.argmax()),)


def write_coefficients(name: str, rows: list[tuple[int, str, tuple[int, ...]]], mat: torch.Tensor,
                       out_dir: Path) -> dict[str, str]:  # fmt: skip
    """The mixing-weight matrix `mat` (student n × teacher m, in the order of `rows`: client, architecture, label
    set) as `<name>_coefficients.csv` and a heat-map `<name>_coefficients.png` in `out_dir`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = [f"c{c} ({arch}): {','.join(map(str, labels))}" for c, arch, labels in rows]
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_name, png_name = f"{name}_coefficients.csv", f"{name}_coefficients.png"
    with open(out_dir / csv_name, "w", newline="") as f:
        wr = csv.writer(f)
        wr.writerow(["student \\ teacher", "architecture", "labels", *[f"c{c}" for c, _, _ in rows]])
        for i, (c, arch, labels) in enumerate(rows):
            wr.writerow([f"c{c}", arch, " ".join(map(str, labels)), *[f"{v:.6f}" for v in mat[i].tolist()]])
    n = len(rows)
    side = min(4 + 0.35 * n, 24)
    fig = Figure(figsize=(side + 1.5, side))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    im = ax.imshow(mat.numpy(), cmap="viridis")
    ax.set_xticks(range(n), names, rotation=90, fontsize=7)
    ax.set_yticks(range(n), names, fontsize=7)
    ax.set_xlabel("teacher m")
    ax.set_ylabel("student n")
    ax.set_title(f"{name}: mixing weights W[n, m] (final)\nclients sorted by label set", fontsize=9)
    fig.colorbar(im, ax=ax, label="weight")
    fig.tight_layout()
    fig.savefig(out_dir / png_name, dpi=120)
    return {"coefficients_png": png_name, "coefficients_csv": csv_name}
