"""FedPAC — Xu, Tong & Huang, "Personalized Federated Learning with Feature Alignment and Classifier Collaboration",
ICLR 2023 (arXiv 2306.11867), Algorithm 1.

Source note: the stored copies of the paper that could be read here hold its abstract and introduction only; the
equations below are the paper's method as summarised by secondary descriptions and as the authors' public code
computes it (read, not copied). Where the two could differ, the choice is stated.

Model: client i predicts with w_i ∘ φ — a feature extractor φ (the BlockNet body, shared) and a linear classifier
w_i (the head blocks, personal). f(x) is the body output, flattened to a d-vector.

Client i in round t receives φ^t, the global class prototypes c_k and its personalized head ŵ_i^t, then:
  0. feature statistics with the received φ^t (eval mode, no gradient), over its n_i training samples:
       class prior p_i(k) = n_{i,k}/n_i, class means μ_{i,k} = mean_{y=k} f(x),
       h_i = E_{P_i}[f(x)·e_yᵀ]  (the C×d matrix with rows p_i(k)·μ_{i,k}),
       V_i = E_{P_i}‖f(x)·e_yᵀ − h_i‖²_F = (1/n_i)·Σ_l ‖f(x_l)‖² − ‖h_i‖²_F       (the variance term);
  1. head phase: `head_epochs` epochs of SGD on CE, body frozen, from ŵ_i^t;
  2. body phase: `body_epochs` epochs of SGD with the new head frozen on the feature-aligned objective
       L_i(φ) = (1/B)·Σ_b [ CE(w_i(f(x_b)), y_b) ] + λ·(1/B)·Σ_b ‖f(x_b) − c_{y_b}‖²          (alignment, R_i)
     per mini-batch of size B (the paper's (1/n_i)·Σ_l over the client's data, estimated by mini-batches);
  3. local prototypes with the trained body (eval mode, no gradient): ĉ_{i,k} = mean_{y=k} f(x), counts n_{i,k};
  4. upload φ_i, w_i, ĉ_i, n_{i,·}, h_i, V_i, n_i.
  Steps 1–2 are a plan (`sgd_plan`: two phases, the body's on `AlignedObjective` with the prototypes as the
  client's constants; 0 before it, 3–4 in its `finish`), so `executor.batch_clients` trains a round's clients
  together.
Server:
  - φ^{t+1} = Σ_i n_i·φ_i / Σ_i n_i                                                   (FedAvg of the bodies);
  - c_k = Σ_i n_{i,k}·ĉ_{i,k} / Σ_i n_{i,k}                        (sample-count-weighted global prototypes);
  - for every client i of the round, the combination weights α_i on the simplex Δ solve the estimated
    test-loss bound (bias² + variance of combining the heads)
        min_{α ∈ Δ}  ‖Σ_j α_j·(h_i − h_j)‖²_F + Σ_j α_j²·V_j/n_j  =  αᵀ·P_i·α,
        P_i[j, k] = ⟨h_i − h_j, h_i − h_k⟩_F + δ_jk·V_j/n_j                          (`combination_matrix`),
    (the identity uses Σ_j α_j = 1), and client i's personalized head is ŵ_i = Σ_j α_ij·w_j.

QP solver (`simplex_qp`): P_i is positive semi-definite by construction (a Gram matrix plus a non-negative
diagonal), so the problem is convex. It is solved in float64 by accelerated projected gradient (FISTA with
adaptive restart, step 1/L with L = 2·λ_max(P) from `eigvalsh`), projecting onto the simplex by the exact
sort-based projection. It starts from the uniform weights and stops when the Frank–Wolfe gap
g(α) = ∇f(α)ᵀα − min_j ∇f(α)_j — an upper bound on f(α) − f* over the simplex — is at most
`qp_tol`·max|P_i| (default 1e-10), or after `qp_max_iter` steps. Every 25 steps it also solves the KKT system
on the current support exactly (P_SS·x = ν·1, Σx = 1) and returns that point if it is on the simplex and passes
the same gap test (an active-set finish: the answer is exact once the support is identified). Everything is
deterministic (no randomness; fixed operation order). Official code solves the same QP with cvxpy after clipping
small eigenvalues; no dependency is added here. Cost: about 1 s per round for 100 repliers on one CPU thread.

Choices and deviations (stated where the paper or the official code leave room):
 1. Partial participation: only the round's replies enter the server step — bodies, prototypes and the QP (its
    clients j are the round's repliers, as the official code does with its sampled clients). A class that no
    replier holds has no global prototype next round (`proto_mask` = 0); its samples get no alignment term (the
    official code aligns such samples to its pre-training local prototype instead). In round 1 no prototype
    exists, so the body phase is plain CE (as in the official code, which skips the term in the first round).
 2. The server keeps each client's latest personalized head ŵ_i under `head/<cid>/<key>` and sends it the next
    time the client is sampled; a client never sampled starts from the run's initial head (the same for all).
 3. Statistics h_i, V_i use the received body φ^t (the common feature space of the round; official code does the
    same, before local training); prototypes use the trained local body φ_i (official: after local training).
    Both are computed in eval mode. V_i is sent per sample and divided by n_i on the server.
 4. Scale of the alignment term (`align_reduction`). The paper writes λ·(1/n)·Σ‖f(x) − c_y‖² (`sum`: summed over
    the d feature dimensions); the official code, which produced the paper's numbers with λ = 1, computes it with
    MSELoss, i.e. also divided by d (`mean`). Default `mean`: λ = 1 is only the paper's setting together with that
    normalization — with `sum`, λ = 1 and d = 512 (the zoo's `cnn`) the body phase diverges at the library's
    default lr 0.05 on digits. `sum` with λ is `mean` with λ·d: the two differ only in the scale of λ.
 5. `min_weight` (default 0: off): official code zeroes weights below 1e-3 and renormalizes; set it to 1e-3 for
    that behaviour.
 6. The body average is weighted by n_i (the engine's weights), as in the official code.
 7. P-FL of client i: the server's body φ^{t+1} with the client's latest personalized head ŵ_i (the model the
    paper's round outputs for client i; official code evaluates this model at the start of the next round).
    FedPAC has no global head, so there is no generic model (G-FL is null).
 8. New clients (the paper defines none): the start head is the sample-count-weighted mean of the last round's
    uploaded heads (`mean_head`, the initial head before any round). `zero_shot` = server body + that head;
    `personalize`: `lp` trains the head alone on the frozen body's features, `ft` trains everything
    (`partial.personalize_blocks`), from the same start.
 9. Each phase builds a fresh SGD optimizer (`train.momentum`, `train.weight_decay`); `train.local_epochs` is not
    used (the two phase lengths replace it).

Defaults (`algorithm.<key>`), from the official code's defaults (the paper's experimental setup section could not
be read here): `lam` λ = 1.0 (`--lam 1.0`, on MSELoss: `align_reduction: mean`, choice 4), `head_epochs` 1 (one
classifier epoch), `body_epochs` 5 (`--local_epoch 5`). Official code trains the head at lr 0.1 and the body at
lr 0.01 with momentum 0.5 and weight decay 5e-4; here `head_lr` / `body_lr` default to `train.lr` and the rest
comes from `train.*`.

Communication per round: down body + head + C×d prototypes; up body + head + 2·C×d statistics + C + 2 numbers.

Site-local runs (`sites.local`): a site evaluating its clients receives the body, the prototypes and the mean head,
and of the personalized heads `head/<cid>/` only its own clients' (`client_entries`): a client's P-FL model is the
shared body with its own head.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from pflbed.algorithms.base import Algorithm, Budget, ClientData, Context, Predictor, Same, Tensors
from pflbed.algorithms.fedrod import feature_dim
from pflbed.algorithms.local_sgd import LocalSGDPlan, Phase, features_and_logits
from pflbed.algorithms.local_sgd import weighted_mean as batch_mean
from pflbed.algorithms.partial import blocks_for, personalize_blocks, subset
from pflbed.algorithms.reply_shapes import Spec, misfit, specs
from pflbed.algorithms.training import load_params, weighted_mean
from pflbed.models import BlockNet
from pflbed.search import Search, Space, same_as

HEAD = "head/"  # the server's latest personalized head of client c: head/<cid>/<head key>
MEAN = "mean_head/"  # the new-client start head: mean_head/<head key>
STATS = ("proto", "count", "h", "v", "n")  # reply entries besides the model's state
SUPPORT_EVERY = 25  # QP: every this many steps, try the exact solution on the current support


class FedPACOptions(BaseModel):
    """FedPAC options."""
    # official: λ 1, 0.1
    search: ClassVar[dict[str, Space]] = {"lam": Search(0.1, 10.0, log=True), "head_lr": Search(1e-3, 0.3, log=True)}

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    lam: float = Field(1.0, ge=0, description="λ: weight of the feature-alignment term ‖f(x) − c_y‖² (official "
                       "code default 1.0)")  # fmt: skip
    head_epochs: int = Field(1, ge=0, description="E_w: epochs training the head with the body frozen (official 1)")
    body_epochs: int = Field(5, ge=0, description="E_φ: epochs training the body, head frozen, on CE + λ·alignment "
                             "(official 5)")  # fmt: skip
    head_lr: float | None = Field(None, gt=0, description="head-phase lr (None: train.lr; official code 0.1)",
                                  json_schema_extra=same_as("train.lr"))
    body_lr: float | None = Field(None, gt=0, description="body-phase lr (None: train.lr)",
                                  json_schema_extra=same_as("train.lr"))
    align_reduction: Literal["sum", "mean"] = Field("mean", description="sum: ‖f − c_y‖² summed over the features "
                                                    "(the paper's equation); mean: also divided by d (official "
                                                    "MSELoss, with which λ = 1 was run)")  # fmt: skip
    min_weight: float = Field(0.0, ge=0, lt=1, description="combination weights below this are zeroed and the rest "
                              "renormalized (official code 1e-3; 0: off)")  # fmt: skip
    qp_tol: float = Field(1e-10, gt=0, description="QP stop: Frank–Wolfe gap ≤ qp_tol·max|P| (bounds f − f*)")
    qp_max_iter: int = Field(20000, ge=1, description="QP: most projected-gradient steps")


# --- the quadratic program -----------------------------------------------------------------------------------------
def project_simplex(v: torch.Tensor) -> torch.Tensor:
    """Euclidean projection of `v` onto {α ≥ 0, Σα = 1} (exact, sort-based: Held et al. 1974, Duchi et al. 2008)."""
    u = torch.sort(v, descending=True).values
    css = u.cumsum(0) - 1.0
    ks = torch.arange(1, len(v) + 1, dtype=v.dtype, device=v.device)
    rho = int((u - css / ks > 0).nonzero().max())
    theta = css[rho] / (rho + 1)
    return (v - theta).clamp_min(0.0)


def simplex_qp(p: torch.Tensor, tol: float = 1e-10, max_iter: int = 20000) -> torch.Tensor:
    """argmin_{α ∈ simplex} αᵀ·p·α for a symmetric PSD `p` (float64): FISTA with adaptive restart from the uniform
    weights, stopped by the Frank–Wolfe gap ≤ tol·max|p| (a bound on the suboptimality). See the module docstring."""
    p = 0.5 * (p + p.T).double()
    n = p.shape[0]
    alpha = torch.full((n,), 1.0 / n, dtype=torch.float64, device=p.device)
    if n == 1:
        return alpha
    lip = 2.0 * float(torch.linalg.eigvalsh(p).max())
    scale = float(p.abs().max())
    if lip <= 0.0 or scale == 0.0:
        return alpha  # p = 0: every weight vector is optimal
    y, t = alpha.clone(), 1.0
    f_old = float(alpha @ p @ alpha)
    for it in range(max_iter):
        grad = 2.0 * (p @ alpha)
        if float(grad @ alpha - grad.min()) <= tol * scale:
            break
        if it % SUPPORT_EVERY == SUPPORT_EVERY - 1:
            exact = support_solution(p, alpha)
            if exact is not None and fw_gap(p, exact) <= tol * scale:
                return exact
        nxt = project_simplex(y - 2.0 * (p @ y) / lip)
        f_new = float(nxt @ p @ nxt)
        if f_new > f_old:  # adaptive restart: drop the momentum, take a plain projected-gradient step
            y, t = alpha.clone(), 1.0
            nxt = project_simplex(alpha - grad / lip)
            f_new = float(nxt @ p @ nxt)
        t_next = 0.5 * (1.0 + (1.0 + 4.0 * t * t) ** 0.5)
        y = nxt + ((t - 1.0) / t_next) * (nxt - alpha)
        alpha, t, f_old = nxt, t_next, f_new
    return alpha


def fw_gap(p: torch.Tensor, alpha: torch.Tensor) -> float:
    """The Frank–Wolfe gap ∇f(α)ᵀα − min_j ∇f(α)_j of f = αᵀpα at α on the simplex (≥ f(α) − f*)."""
    grad = 2.0 * (p @ alpha)
    return float(grad @ alpha - grad.min())


def support_solution(p: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor | None:
    """The exact minimizer of αᵀpα with Σα = 1 on the support of `alpha` (p_SS·x = ν·1), or None when p_SS is
    singular or x leaves the simplex. The caller accepts it only if its Frank–Wolfe gap certifies it."""
    s = alpha > 0
    try:
        x = torch.linalg.solve(p[s][:, s], torch.ones(int(s.sum()), dtype=p.dtype, device=p.device))
    except RuntimeError:
        return None
    if not bool(torch.isfinite(x).all()) or float(x.sum()) <= 0:
        return None
    x = x / x.sum()
    if bool((x < 0).any()):
        return None
    out = torch.zeros_like(alpha)
    out[s] = x
    return out


def combination_matrix(i: int, h: torch.Tensor, v_over_n: torch.Tensor) -> torch.Tensor:
    """P_i[j, k] = ⟨h_i − h_j, h_i − h_k⟩ + δ_jk·V_j/n_j, from the stacked statistics `h` (m × C·d, float64) and
    the variance terms `v_over_n` (m); row/column j is the j-th replier."""
    diff = h[i].unsqueeze(0) - h
    return diff @ diff.T + torch.diag(v_over_n)


def combination_weights(h: torch.Tensor, v_over_n: torch.Tensor, tol: float, max_iter: int, min_weight: float = 0.0):
    """The m × m matrix of α_ij (row i: client i's weights over the m repliers)."""
    rows = []
    for i in range(len(h)):
        a = simplex_qp(combination_matrix(i, h, v_over_n), tol, max_iter)
        if min_weight > 0:
            a = torch.where(a >= min_weight, a, torch.zeros_like(a))
            a = a / a.sum()
        rows.append(a)
    return torch.stack(rows)


# --- client-side pieces --------------------------------------------------------------------------------------------
def features_of(model: BlockNet, x: torch.Tensor, rows: int = 1024) -> torch.Tensor:
    """Flattened body outputs of `x`, eval mode, no gradient."""
    model.eval()
    with torch.no_grad():
        return torch.cat([model.features(x[i : i + rows]).flatten(1) for i in range(0, max(len(x), 1), rows)])


def class_statistics(z: torch.Tensor, y: torch.Tensor, num_classes: int) -> dict[str, torch.Tensor]:
    """Per-class counts n_k and means μ_k (zero for absent classes), h = rows p_k·μ_k, and V = E‖f‖² − ‖h‖²_F
    (the variance of f(x)·e_yᵀ), all in float64; n is the sample count."""
    z = z.double()
    n = len(y)
    onehot = F.one_hot(y, num_classes).to(torch.float64)  # a matmul, not index_add_: no atomics on a GPU
    count = onehot.sum(0)
    sums = onehot.T @ z
    mean = sums / count.clamp_min(1.0).unsqueeze(1)
    h = sums / max(n, 1)  # p_k·μ_k = n_k/n · sum_k/n_k
    v = (z * z).sum() / max(n, 1) - (h * h).sum()
    n_t = torch.tensor(float(n), dtype=torch.float64, device=z.device)
    return {"count": count, "proto": mean, "h": h, "v": v, "n": n_t}


def alignment(z: torch.Tensor, y: torch.Tensor, protos: torch.Tensor, mask: torch.Tensor, reduction: str):
    """(1/B)·Σ_b ‖f(x_b) − c_{y_b}‖² over the batch, counting only samples whose class has a global prototype
    (`mask`); `mean` also divides by the feature dimension."""
    z = z.flatten(1)
    sq = ((z - protos[y].to(z.dtype)) ** 2).sum(1) * mask[y].to(z.dtype)
    out = sq.sum() / max(len(y), 1)
    return out / z.shape[1] if reduction == "mean" else out


class AlignedObjective:
    """The body phase's loss (Eq. 8): CE + λ·alignment of the features to the global prototypes (`protos`, with
    `proto_mask` the classes that have one: the plan's constants). In the loop (`w` None) the batch means; in a
    batched step the same per sample, weighted. A class: the algorithm travels to `procs` workers by pickle."""

    def __init__(self, lam: float, reduction: str) -> None:
        self.lam, self.reduction = lam, reduction

    def __call__(
        self, model: BlockNet, params: Tensors, consts: Tensors, x: torch.Tensor, y: torch.Tensor,
        w: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        z, logits = features_and_logits(model, params, x)
        if w is None:
            loss = F.cross_entropy(logits, y)
            return loss + self.lam * alignment(z, y, consts["protos"], consts["proto_mask"], self.reduction) \
                if self.lam else loss  # fmt: skip
        loss = batch_mean(F.cross_entropy(logits, y, reduction="none"), w)
        if not self.lam:
            return loss
        flat = z.flatten(1)
        sq = ((flat - consts["protos"][y].to(flat.dtype)) ** 2).sum(1) * consts["proto_mask"][y].to(flat.dtype)
        aligned = batch_mean(sq, w)
        return loss + self.lam * (aligned / flat.shape[1] if self.reduction == "mean" else aligned)


# --- the algorithm -------------------------------------------------------------------------------------------------
class FedPAC(Algorithm):
    name = "fedpac"
    dp_refused = (
        "replies carry each client's class-wise feature centroids and statistics, which the server "
        "combines client by client"
    )
    Config = FedPACOptions
    client_entries = rf"{HEAD}(\d+)/"

    @staticmethod
    def unread_train(options: BaseModel) -> frozenset[str]:
        """The two phase lengths replace `train.local_epochs` (note 9)."""
        return frozenset({"local_epochs"})

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        m = ctx.model
        self.head, self.body = m.head_blocks(), m.body_blocks()
        self.head_keys, self.body_keys = m.state_keys(self.head), m.state_keys(self.body)
        self.num_classes = ctx.source.num_classes
        self.dim = feature_dim(m, ctx.source.input_shape)
        self.objective = AlignedObjective(self.opts.lam, self.opts.align_reduction)  # one: plans batch together

    # --- server-state views ----------------------------------------------------------------------------------
    def initial_head(self) -> Tensors:
        return subset(self.ctx.initial_params, self.head_keys)

    def head_of(self, server: Tensors, cid: int) -> Tensors:
        """Client `cid`'s latest personalized head ŵ_i; the initial head while it has none (choice 2)."""
        prefix = f"{HEAD}{cid}/"
        if prefix + self.head_keys[0] not in server:
            return self.initial_head()
        return {k: server[prefix + k] for k in self.head_keys}

    def body_of(self, server: Tensors) -> Tensors:
        return subset(server, self.body_keys)

    def mean_head(self, server: Tensors) -> Tensors:
        return {k: server[MEAN + k] for k in self.head_keys}

    # --- federation ------------------------------------------------------------------------------------------
    def init_server(self) -> Tensors:
        dev = self.ctx.device
        return {
            **subset(self.ctx.initial_params, self.body_keys),
            "protos": torch.zeros(self.num_classes, self.dim, device=dev),
            "proto_mask": torch.zeros(self.num_classes, device=dev),
            **{MEAN + k: v for k, v in self.initial_head().items()},
        }

    def init_client(self, cid: int) -> Tensors:
        return {"cid": torch.tensor(cid, device=self.ctx.device)}

    def configure(self, rnd: int, server: Tensors, cids: list[int]) -> dict[int, Tensors]:
        shared = {**self.body_of(server), "protos": server["protos"], "proto_mask": server["proto_mask"]}
        return {c: {**shared, **self.head_of(server, c)} for c in cids}

    def sgd_plan(self, payload: Tensors, state: Tensors, data: ClientData) -> LocalSGDPlan:
        """The feature statistics with the received body (choice 3), then the head phase (CE, body frozen) and the
        body phase (CE + λ·alignment, head frozen: `AlignedObjective`, the global prototypes as constants); the
        reply adds the trained body's prototypes (`finish`)."""
        m, t, o = self.ctx.model, self.ctx.cfg.train, self.opts
        start = {k: payload[k] for k in (*self.body_keys, *self.head_keys)}
        load_params(m, start)
        x, y = data.x[data.train], data.y[data.train]
        stats = class_statistics(features_of(m, x), y, self.num_classes)  # with the received body (choice 3)
        phases = (Phase(tuple(self.head), o.head_epochs, o.head_lr or t.lr),
                  Phase(tuple(self.body), o.body_epochs, o.body_lr or t.lr, objective=self.objective))  # fmt: skip
        consts = {"protos": payload["protos"], "proto_mask": payload["proto_mask"]}
        return LocalSGDPlan(start, phases, partial(self._finish, data, stats, payload["protos"].dtype, state),
                            consts=consts)  # fmt: skip

    def _finish(self, data: ClientData, stats: Tensors, dtype: torch.dtype, state: Tensors, trained: Tensors
                ) -> tuple[Tensors, Tensors]:  # fmt: skip
        m = self.ctx.model
        load_params(m, trained)
        local = class_statistics(features_of(m, data.x[data.train]), data.y[data.train], self.num_classes)
        reply = {**trained, "proto": local["proto"].to(dtype), "count": local["count"].to(dtype),
                 "h": stats["h"], "v": stats["v"], "n": stats["n"]}  # fmt: skip
        return reply, state

    def aggregate(self, rnd: int, server: Tensors, replies: dict[int, Tensors], weights: dict[int, float]) -> Tensors:
        cids = sorted(replies)
        o = self.opts
        out = {k: v for k, v in server.items() if not k.startswith(MEAN)}
        out.update(weighted_mean({c: replies[c] for c in cids}, weights, self.body_keys))
        # global prototypes: Σ_i n_{i,k}·ĉ_{i,k} / Σ_i n_{i,k}, per class, over the round's replies
        counts = torch.stack([replies[c]["count"].double() for c in cids])  # m × C
        protos = torch.stack([replies[c]["proto"].double() for c in cids])  # m × C × d
        total = counts.sum(0)
        glob = (counts.unsqueeze(2) * protos).sum(0) / total.clamp_min(1.0).unsqueeze(1)
        out["protos"] = glob.to(server["protos"].dtype)
        out["proto_mask"] = (total > 0).to(server["proto_mask"].dtype)
        # classifier collaboration: α_i from the QP, ŵ_i = Σ_j α_ij·w_j
        h = torch.stack([replies[c]["h"].double().flatten() for c in cids])
        n = torch.stack([replies[c]["n"].double() for c in cids])
        v = torch.stack([replies[c]["v"].double() for c in cids]).clamp_min(0.0) / n.clamp_min(1.0)
        alpha = combination_weights(h, v, o.qp_tol, o.qp_max_iter, o.min_weight)
        heads = {k: torch.stack([replies[c][k].double() for c in cids]) for k in self.head_keys}
        for i, c in enumerate(cids):
            for k in self.head_keys:
                out[f"{HEAD}{c}/{k}"] = combine(alpha[i], heads[k]).to(replies[c][k].dtype)
        share = n / n.sum()
        for k in self.head_keys:
            out[MEAN + k] = combine(share, heads[k]).to(server[MEAN + k].dtype)
        return out

    def view_groups(self, cids: list[int]) -> list[dict[str, Spec]]:
        """Each client's personalized head `head/<cid>/` (the head's entries), from its first reply."""
        head = specs(self.ctx.initial_params, self.head_keys)
        return [{f"{HEAD}{c}/{k}": s for k, s in head.items()} for c in cids]

    def reply_fits(self, payload: Tensors, reply: Tensors) -> str | None:
        """None if `reply` is what a client replies to `payload`, else why not: the model (body and head, as sent),
        its prototypes `proto` (C × d) and class counts `count` (C) in the dtype of the prototypes sent, and its
        statistics `h` (C × d), `v` and `n` (scalars), always float64. The server stacks these across the round's
        replies: one of another shape would crash the stack or the QP, and one of another dtype would change the
        dtype of the heads and prototypes it stores. Their values (e.g. `n` against the client's sample count)
        are not checked."""
        protos = payload["protos"]
        c, f64 = protos.shape[0], torch.float64
        return misfit(reply, {**specs(payload, (*self.body_keys, *self.head_keys)),
                              "proto": (tuple(protos.shape), protos.dtype), "count": ((c,), protos.dtype),
                              "h": (tuple(protos.shape), f64), "v": ((), f64), "n": ((), f64)})  # fmt: skip

    # --- evaluation and new clients --------------------------------------------------------------------------
    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        params = {**self.body_of(server), **self.head_of(server, int(state["cid"]))}
        return Predictor(self.ctx.model, params, ("fedpac-body", Same(server)))

    def start(self, server: Tensors) -> Tensors:
        return {**self.body_of(server), **self.mean_head(server)}

    def zero_shot(self, server: Tensors, data: ClientData) -> Predictor | None:
        return Predictor(self.ctx.model, self.start(server), ("fedpac-body", Same(server)))

    def personalize(
        self, server: Tensors, data: ClientData, budget: Budget, generator: torch.Generator
    ) -> Iterator[Predictor]:
        blocks = blocks_for(budget, self.ctx.model, lp=self.head)
        yield from personalize_blocks(self.ctx.model, self.start(server), data, budget, generator, blocks)


def combine(weights: torch.Tensor, stacked: torch.Tensor) -> torch.Tensor:
    """Σ_j weights_j·stacked_j (float64)."""
    return torch.tensordot(weights.to(stacked), stacked, dims=1)
