"""FedCAC — Wu, Liu, Niu, Zhu & Tang, "Bold but Cautious: Unlocking the Potential of Personalized Federated Learning
through Cautiously Aggressive Collaboration", ICCV 2023 (arXiv 2309.11103).

Source note: the stored copies of the paper that could be read here hold its abstract and introduction only; the
rule below is the method as the authors' code (kxzxvbk/Fling, `fedcac_client.py`, `fedcac_group.py`; read, not
copied) computes it, matching the paper's description of it. The equation numbers are this docstring's own.

Idea: which parameters a client should keep to itself depends not only on how sensitive they are to its non-IID
data but also on who it shares them with. Each client marks its most sensitive ("critical") parameters; those are
shared only with clients whose critical parameters lie in similar places, the others with everybody.

Client i, each round it is sampled, trains E epochs of SGD from its personalized model θ_i^{t,0} and then scores
every parameter entry by the first-order estimate of the loss change its removal causes, the accumulated update
standing in for the gradient:

    s_i = | (θ_i^{t,E} − θ_i^{t,0}) ⊙ θ_i^{t,E} |                                                        (1)

Per parameter tensor l of n_l entries, the ⌊τ·n_l⌋ largest sensitivities are critical:

    m_i[k] = 1  iff  s_i[k] ≥ thresh_l,  thresh_l the ⌊τ·n_l⌋-th largest s_i in tensor l                (2)

(the authors' code: a tensor with ⌊τ·n_l⌋ = 0 has no critical entry; a threshold ≤ 1e-10 is replaced by the
smallest sensitivity above 1e-20, so that entries that did not move are not critical; if there is none, the
threshold stays and every entry of the tensor is critical. Ties at the threshold are all critical.)
It replies its trained model θ_i and m_i. The server, over the round's replies,

    O_ij = 1 − ‖m_i − m_j‖₁ / (2‖m_i‖₁)                        (overlap of i's critical entries with j's)  (3)
    E_t  = Ō + ((t + 1)/β)·(O_max − Ō),   Ō, O_max the mean and maximum of O_ij over ordered pairs i ≠ j   (4)
    C_i  = {i} ∪ {j : O_ij ≥ E_t},   θ̄_i^c = (1/|C_i|)·Σ_{j∈C_i} θ_j        (customized model, unweighted)
    θ̄^g  = Σ_j (n_j/Σn)·θ_j                                                  (global model: FedAvg)
    θ_i  ← m_i ⊙ θ̄_i^c + (1 − m_i) ⊙ θ̄^g                                    (next personalized model)    (5)

t counts aggregations from 0 (here t + 1 = the round, rounds counting from 1). The threshold rises from the mean
overlap to the largest: early on critical parameters are shared with many clients, after β rounds only with clients
whose overlap ties the largest, i.e. in practice not at all.

Choices and deviations (the authors' code runs every client in every round; the rest is stated where it differs):
  1. Partial participation (`federation.sample_fraction` < 1): Eqs. 3–4 and C_i run over the round's repliers only
     (as PFLlib's reimplementation does). The server keeps each replier's mask and critical values until the client
     is sampled again; a client's personalized model (Eq. 5) always mixes them with the *latest* global model — the
     model it would start its next round from (PFLlib composes the same way when it sends). A client that has not
     trained yet has no mask: its model is the global model. With full participation all of this is the paper's.
  2. BatchNorm running statistics stay local, as in the authors' code (Eq. 5 is applied to parameters only, and a
     client's statistics are never overwritten): the client keeps those of its last training in its state. A client
     without any yet (its first round) starts from the global model's. The global model θ̄^g averages them
     (integer counters: their maximum), as the code's FedAvg does.
  3. Overlap with an empty mask (⌊τ·n_l⌋ = 0 for every tensor, e.g. τ = 0): the code divides by zero; here O_ij = 0.
     With one replier there is no pair: C_i = {i}.
  4. Eq. 4 is computed in float64 as (1 − s)·Ō + s·O_max with s = (t + 1)/β — the same number, but exactly O_max at
     s = 1 (the code's float32 Ō + s·(O_max − Ō) may miss it by an ulp and so decide that round's ties by
     rounding). The overlaps are ratios of exact integer counts.
  5. The customized models are kept as whole tensors on the server (`custom/<cid>/<key>`) beside the masks
     (`mask/<cid>/<key>`, one bit per entry); only their critical entries are ever read.
  6. G-FL scores the global model θ̄^g. P-FL scores θ_i of Eq. 5 (the code's "after aggregation" test). New
     clients and the final +FT/+LP start from θ̄^g (the paper defines no procedure for clients that never trained).
  7. The optimizer (`train.*`) is re-created each round, as in the code (SGD, momentum 0.9 there).

Defaults: τ = 0.5 and β = 100 (the official CIFAR-10 config; CIFAR-100: τ = 0.4, β = 170). β counts rounds: with a
run much shorter than β the threshold never reaches O_max. The search covers τ in [0.1, 0.9] and β in [1, 300].

Communication: down θ_i (one model per client), up θ_i and m_i (one bit per parameter entry). The server's rule
reads every reply one by one (Eqs. 3–5), so client-level DP does not apply. The update is a plan (`sgd_plan`, the
mask computed in its `finish`): `executor.batch_clients` trains a round's clients together.

Site-local runs (`sites.local`): a site evaluating its clients receives the global model and, of the stored masks and
customized models, only its own clients' (`client_entries`).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field

from pflbed.algorithms.base import Algorithm, ClientData, Context, Predictor, Tensors
from pflbed.algorithms.local_sgd import LocalSGDPlan, Phase
from pflbed.algorithms.masks import pack_bits, unpack_bits
from pflbed.algorithms.reply_shapes import Spec, misfit, specs
from pflbed.algorithms.training import weighted_mean
from pflbed.search import IntSearch, Search, Space

MASK, CUSTOM = "mask/", "custom/"  # server: mask/<cid>/<param>, custom/<cid>/<param>; reply: mask/<param>
COLLABORATORS = "cac/collaborators"  # the last round's mean number of other clients in C_i (diagnostics)
ZERO, TINY = 1e-10, 1e-20  # Eq. 2's fallback: a threshold ≤ ZERO becomes the smallest sensitivity > TINY
CHUNK = 2**24  # entries per float32 matmul of 0/1 masks: every partial sum is an exact integer


class FedCACOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    search: ClassVar[dict[str, Space]] = {"tau": Search(0.1, 0.9), "beta": IntSearch(1, 300, log=True)}
    tau: float = Field(0.5, ge=0, le=1, description="τ: the fraction of each parameter tensor's entries that are "
                       "critical, the most sensitive ones (official 0.5 CIFAR-10, 0.4 CIFAR-100; 0: none)")  # fmt: skip
    beta: int = Field(100, ge=1, le=1_000_000, description="β: rounds over which the collaboration threshold rises "
                      "from the mean overlap to the largest (official 100 CIFAR-10, 170 CIFAR-100)")  # fmt: skip


def critical_mask(before: torch.Tensor, after: torch.Tensor, tau: float) -> torch.Tensor:
    """Eqs. 1–2 for one tensor: True where |(after − before)·after| is among its ⌊τ·n⌋ largest, with the authors'
    zero-threshold fallback. No host sync (the fallback is a `where`)."""
    c = ((after - before) * after).abs()
    flat = c.reshape(-1)
    nz = int(tau * flat.numel())
    if nz == 0:
        return torch.zeros_like(c, dtype=torch.bool)
    thresh = torch.kthvalue(flat, flat.numel() - nz + 1).values  # the nz-th largest
    smallest = torch.where(flat > TINY, flat, torch.full_like(flat, math.inf)).min()
    thresh = torch.where((thresh <= ZERO) & torch.isfinite(smallest), smallest, thresh)
    return c >= thresh


def overlap_matrix(masks: list[dict[str, torch.Tensor]], keys: list[str]) -> torch.Tensor:
    """Eq. 3 for every ordered pair (float64; O_ij = 0 where m_i is empty). The intersections are counted by
    float32 matmuls of 0/1 chunks of at most CHUNK entries (exact integers), summed in float64."""
    r = len(masks)
    dev = masks[0][keys[0]].device
    inter = torch.zeros(r, r, dtype=torch.float64, device=dev)
    step = max(1, CHUNK // r)
    for k in keys:
        flat = torch.stack([m[k].reshape(-1) for m in masks])
        for s in range(0, flat.shape[1], step):
            part = flat[:, s : s + step].to(torch.float32)
            inter += (part @ part.T).double()
    size = inter.diagonal()
    differ = size[:, None] + size[None, :] - 2 * inter  # ‖m_i − m_j‖₁
    return torch.where(size[:, None] > 0, 1 - differ / (2 * size[:, None]).clamp(min=1), torch.zeros_like(inter))


def collaborators(overlap: torch.Tensor, rnd: int, beta: int) -> torch.Tensor:
    """C_i as a 0/1 matrix (row i: i's collaborators, i itself included) from Eq. 4's threshold."""
    r = overlap.shape[0]
    eye = torch.eye(r, dtype=torch.bool, device=overlap.device)
    if r < 2:
        return eye
    pairs = overlap[~eye]
    s = rnd / beta
    threshold = (1 - s) * pairs.mean() + s * pairs.max()
    return eye | (overlap >= threshold)


class FedCAC(Algorithm):
    name = "fedcac"
    Config = FedCACOptions
    dp_refused = ("the server compares the clients' critical-parameter masks pair by pair and averages each client's "
                  "collaborators' models for it, not only the mean of the replies")  # fmt: skip
    client_entries = rf"(?:{MASK}|{CUSTOM})(\d+)/"

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        m = ctx.model
        self.keys = list(m.state_dict())
        self.params = [k for k, _ in m.named_parameters()]
        self.buffers = [k for k in self.keys if k not in set(self.params)]  # local (choice 2)
        self.blocks = tuple(m.block_names())
        self._global: tuple[Tensors, Tensors] | None = None  # (server state, its global model)

    # --- server-state views ----------------------------------------------------------------------------------
    def global_of(self, server: Tensors) -> Tensors:
        """θ̄^g: the model's entries of the server state (one dict per state, so its predictors group)."""
        if self._global is None or self._global[0] is not server:
            self._global = (server, {k: server[k] for k in self.keys})
        return self._global[1]

    def personalized(self, server: Tensors, cid: int) -> Tensors:
        """Eq. 5 for client `cid` with the latest global model: its critical entries from its customized model,
        the rest (and the buffers) global; the global model itself while it has no mask (choice 1)."""
        glob = self.global_of(server)
        if f"{MASK}{cid}/{self.params[0]}" not in server:
            return glob
        out = dict(glob)
        for k in self.params:
            m = unpack_bits(server[f"{MASK}{cid}/{k}"], glob[k].shape)
            out[k] = torch.where(m, server[f"{CUSTOM}{cid}/{k}"], glob[k])
        return out

    # --- federation ------------------------------------------------------------------------------------------
    def init_server(self) -> Tensors:
        return {**self.ctx.initial_params, COLLABORATORS: torch.zeros((), dtype=torch.float64, device=self.ctx.device)}

    def init_client(self, cid: int) -> Tensors:
        return {"cid": torch.tensor(cid, device=self.ctx.device)}

    def configure(self, rnd: int, server: Tensors, cids: list[int]) -> dict[int, Tensors]:
        return {c: self.personalized(server, c) for c in cids}

    def sgd_plan(self, payload: Tensors, state: Tensors, data: ClientData) -> LocalSGDPlan:
        """E epochs of SGD on every block from θ_i (the client's own BatchNorm statistics where it has them); the
        mask of Eqs. 1–2 is computed from the start and the trained model in `finish`."""
        t = self.ctx.cfg.train
        start = {k: state[k] if k in state else payload[k] for k in self.keys}
        phase = Phase(self.blocks, t.local_epochs, t.lr)
        return LocalSGDPlan(start, (phase,), partial(self.finish, start, state["cid"]))

    def finish(self, start: Tensors, cid: torch.Tensor, trained: Tensors) -> tuple[Tensors, Tensors]:
        """Reply: the trained model and its packed critical mask per parameter; state: the id and the buffers."""
        reply = {k: trained[k] for k in self.keys}
        for k in self.params:
            reply[MASK + k] = pack_bits(critical_mask(start[k], trained[k], self.opts.tau))
        return reply, {"cid": cid, **{k: trained[k] for k in self.buffers}}

    def aggregate(self, rnd: int, server: Tensors, replies: dict[int, Tensors], weights: dict[int, float]) -> Tensors:
        """θ̄^g over the replies (n-weighted), then per replier its mask and customized model (Eqs. 3–4); the
        other clients' stored entries are kept."""
        cids = sorted(replies)
        out = dict(server)
        out.update(weighted_mean({c: replies[c] for c in cids}, weights, self.keys))
        shapes = {k: server[k].shape for k in self.params}
        masks = [{k: unpack_bits(replies[c][MASK + k], shapes[k]) for k in self.params} for c in cids]
        member = collaborators(overlap_matrix(masks, self.params), rnd, self.opts.beta)
        step = max(1, CHUNK // len(cids))
        for k in self.params:
            share = member.to(server[k].dtype)
            count = share.sum(1, keepdim=True)
            flat = [server[k].new_empty(shapes[k].numel()) for _ in cids]
            for s in range(0, len(flat[0]), step):  # one matmul per chunk: Σ_{j∈C_i} θ_j / |C_i| for every i
                part = torch.stack([replies[c][k].reshape(-1)[s : s + step] for c in cids])
                mean = (share @ part) / count
                for i in range(len(cids)):
                    flat[i][s : s + step] = mean[i]
            for i, c in enumerate(cids):  # in the parameter's memory format (channels_last convolutions)
                out[f"{CUSTOM}{c}/{k}"] = torch.empty_like(server[k]).copy_(flat[i].view(shapes[k]))
                out[f"{MASK}{c}/{k}"] = replies[c][MASK + k]
        out[COLLABORATORS] = (member.sum(1).double() - 1).mean().to(server[COLLABORATORS])
        return out

    def reply_fits(self, payload: Tensors, reply: Tensors) -> str | None:
        """None if `reply` is what a client replies to `payload` — the model as sent, and per parameter a packed
        mask (uint8, one bit per entry) — else why not. The server unpacks the masks to the parameters' shapes and
        stores them: a mask of another length would not unpack."""
        bits = {MASK + k: ((math.ceil(payload[k].numel() / 8),), torch.uint8) for k in self.params}
        return misfit(reply, {**specs(payload, self.keys), **bits})

    def view_groups(self, cids: list[int]) -> list[dict[str, Spec]]:
        """Each client's mask and customized model (`mask/<cid>/`, `custom/<cid>/`: per parameter, packed bits
        and the parameter's structure), stored together from its first reply."""
        model = specs(self.ctx.initial_params, self.params)
        bits = {k: ((math.ceil(math.prod(s) / 8),), torch.uint8) for k, (s, _) in model.items()}
        return [{**{f"{MASK}{c}/{k}": b for k, b in bits.items()}, **{f"{CUSTOM}{c}/{k}": model[k] for k in model}}
                for c in cids]  # fmt: skip

    # --- evaluation and new clients --------------------------------------------------------------------------
    def generic_model(self, server: Tensors) -> Predictor:
        return Predictor(self.ctx.model, self.global_of(server))

    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        """θ_i of Eq. 5 with the client's own BatchNorm statistics (the global model's before its first round)."""
        params = self.personalized(server, int(state["cid"]))
        own = {k: state[k] for k in self.buffers if k in state}
        if own:
            params = {**params, **own}
        return Predictor(self.ctx.model, params)

    def diagnostics(self, rnd: int, server: Tensors, state_of: Any) -> dict[str, Any]:
        """The last round's mean number of other clients each replier shares its critical parameters with."""
        return {"collaborators": float(server[COLLABORATORS])}
