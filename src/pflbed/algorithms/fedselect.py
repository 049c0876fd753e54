"""FedSelect — Tamirisa, Xie, Bao, Zhou, Arel & Shamsian, "FedSelect: Personalized Federated Learning with Customized
Selection of Parameters for Fine-Tuning", CVPR 2024 (Algorithm 1 FedSelect, Algorithm 2 LocalAlt, Algorithm 3
GradSelect; ablations of Table 3; mask overlap of Fig. 4). The title is the paper's own; the venue is the one the
authors' repository (lapisrocks/fedselect) gives, as the stored paper text carries no venue line.

Idea: personalize individual parameter *entries* rather than whole layers. Each client k holds a binary mask m_k
(1 = personal v_k, 0 = global u_k), all 0 at the start — so the first round is FedAvg — and grows it, entry by
entry, with the entries that changed most during its local training (the paper's "FL gradient-based lottery ticket
hypothesis"). Global entries are averaged across the clients for which they are still global.

Client k, each time it is sampled:
  1. Model: the server's global values on the entries that were global in its last training, its own trained values
     on the entries that were personal then. Entries GradSelect turned personal after that training start from the
     fresh global value: Alg. 1 broadcasts θ_g into ¬m_k^t before the new mask m_k^{t+1} applies.
  2. LocalAlt (Alg. 2), E = `train.local_epochs` times (paper: 3): one pass over the client's data updating only the
     personal entries, then one pass updating only the global entries.
  3. GradSelect (Alg. 3), in a mask-update round: Δ = |θ after LocalAlt − θ_ref|; per eligible tensor, among its
     still-global entries, the top `p` fraction of |Δ| become personal (mask OR new selection); a tensor whose
     personal fraction has reached `alpha` stops growing. The new mask takes effect in the client's next round.
  4. Upload the entries that were global during this training.
Server: per entry, the uniform mean over the replying clients for which it was global (sum and count tensor ω of
Alg. 1); an entry no replying client shares keeps its last server value. Each client then receives, next time, the
global values of its own global entries only.

Options (`algorithm.<key>`; unset ones come from `preset`):
  - `preset`: "paper" (default) or "official" (the authors' code):
      paper:    p = 0.25, alpha = 0.3, update_every = 1, eligible = "all",     delta_from = "round_start"
      official: p = 0.25, alpha = 0.8, update_every = 3, eligible = "weights", delta_from = "last_update"
    The paper states no p (it varies p in its appendix), so both presets use the official default 0.25. α = 0.3 is
    inside the recommended α ∈ [0.3, 0.5]: the best α on CIFAR-10 in Table 2 and the α of the paper's CIFAR-10
    result in Table 1 (α = 0.5 won on CIFAR10-C and Mini-ImageNet). Paper Alg. 1 runs GradSelect every round over
    all of θ; the official code only selects among tensors named "weight", every 3rd round, α = 0.8, and measures Δ
    from the state at the previous mask update.
  - `p` ∈ [0, 1]: personalization rate. `alpha` ∈ [0, 1]: personalization limit (α = 0: FedAvg; α = 1 with p = 1:
    local training after the first update).
  - `update_every` (≥ 1): grow masks after every `update_every`-th round *of the client* (see below).
  - `eligible`: "weights" (the `weight` of Linear/Conv modules, found by module type) or "all" (every parameter).
  - `delta_from`: "round_start" (Alg. 3: Δ from the model this round's LocalAlt started from) or "last_update"
    (official: Δ from the model after local training at the client's previous mask update; the initial model
    before the first).
  - `selection`: "largest" (the paper), "smallest" (Table 3 "Personalize Least"), "random" (Table 3 "Random": a
    random mask of the same size, drawn from the client's round generator).
  - `layers`: "all" or one block name of the model (Table 3's single-layer ablation: only that block's eligible
    tensors can become personal).
  - `limit`: "stop" (Alg. 3 and the official code: the limit is tested before growing, so the last growth step may
    overshoot α) or "cap" (the step is trimmed so that no tensor ever exceeds ⌊α·n⌋ personal entries).
  Batch size, learning rate, momentum and weight decay come from `train.*`. The paper's setting is not an algorithm
  option: 10 clients × 2 classes (`federation.partition=classes`), 100 training samples per client
  (`federation.train_per_client=100`), E = 3 (`train.local_epochs=3`), 200 rounds, plain SGD.

Wire format — what the engine counts as communication, and shrinks as masks grow:
  - up (reply): for an eligible tensor in which the client had personal entries, `<key>` = the flat (row-major)
    values of its global entries and `mask/<key>` = its mask packed to bits (uint8, `numpy.packbits` layout,
    `masks.pack_bits`); every other tensor as a full `<key>`. No mask key means "all global", so with α = 0 the
    reply is byte for byte FedAvg's.
  - down (payload, per client): for the same tensors only the entries global for that client, flat; full tensors
    otherwise. The server knows which entries those are because it keeps the packed mask of each client's last reply
    (server keys `mask/<cid>/<key>`, one bit per entry) — the per-client masks Alg. 1's server also uses to
    broadcast into ¬m_k.
  Client state: `rounds` (its participations), `mask/<key>` (packed mask for its next training), `held/<key>`
  (packed mask of its last training), `v/<key>` (its personal values, flat), and `ref/<key>` (the Δ reference,
  `last_update` only). Absent masks are all zero, so a client that never personalized costs no memory.

Interpretations and deviations:
  - Schedule: `update_every` counts the client's own rounds (participations), not the global round: with partial
    participation a global counter would make a client's growth depend on whether it happens to be sampled in a
    multiple of `update_every`. Under full participation (the paper's setting) both counters agree, up to the
    official code's offset: it updates after 0-based rounds 3, 6, … and never after the first round, we after the
    client's 3rd, 6th, … round, and with update_every = 1 after every round including the first, as Alg. 1 does.
  - The limit α and the rate p apply per eligible tensor (the official code; Alg. 3 writes "sparsity of ¬m_k"
    without saying over what). A tensor grows while its personal fraction is < α (official: while ≤ α, a
    difference only at exact equality). New entries per update: ⌊p·n_global + ½⌋ of the tensor's still-global
    entries, ties in |Δ| broken by `torch.topk` (official: a percentile cut-off that takes every tie).
  - Not eligible, hence always global and averaged every round: biases etc. under "weights"; and always the
    buffers (BatchNorm running statistics, averaged uniformly; integer counters take the maximum, as FedAvg's
    `weighted_mean`). The official code selects by the *name* "weight", which also catches BatchNorm γ, and keeps
    BatchNorm buffers local (it only broadcasts weight/bias keys); neither is reproduced: selection is by module
    type and a buffer is a statistic of the data, not a learned entry GradSelect could rank.
  - LocalAlt: each of the E epochs is one full pass per side (Alg. 2 with τ = one epoch, as the official
    `local_alt`), so a round costs 2E passes — twice FedAvg's compute at equal E. One learning rate `train.lr` for
    both sides (Alg. 2 allows γ_u ≠ γ_v; the official code uses one). Each side has its own optimizer for the
    round, kept across the round's epochs, so momentum never leaks from one side to the other nor across rounds.
    Entries a side must not train are restored after every step (gradient masking alone would not do: weight decay
    and momentum still move entries with zero gradient). A side with no entry to train is skipped outright (no
    forward pass, no batch drawn), so α = 0 trains exactly like FedAvg, and an all-personal client exactly like
    local-only training.
    The update is a `LocalSGDPlan` (each side a phase, the masks per-client constants), so `executor.batch_clients`
    trains a round's clients together; `selection: random`'s GradSelect draws from the client's generator after
    training, where training left it, in a batched round as in the loop.
  - Aggregation is uniform over the replying clients, ignoring the engine's |D_m| weights, as in Alg. 1 (a count
    tensor, not a weight sum). With α = 0 FedSelect is therefore FedAvg with uniform weights; it equals the
    library's FedAvg when all clients hold equally many samples (tensors no reply masks are averaged with
    `weighted_mean` at equal weights: the same arithmetic as FedAvg's server).
  - Evaluation: a client's personal model is the model it would start its next round from (Alg. 1's θ_k^{t+1}).
    The official code scores the locally trained models before aggregation (and skips the final aggregation); not
    reproduced. There is no generic model (G-FL is null; `eval.finetune` does not run): at entries personal for
    every client the server holds values frozen since the last client shared them, so the server vector is not a
    model anybody trains, and the paper reports personalized accuracy only.
  - New clients: a new client's mask is all zero, so its model is the server's global values; `zero_shot` returns
    it, and `personalize` fine-tunes it (ft: every parameter; lp: the head blocks only, `finetune_epochs`). No mask
    is grown for a new client: the budget protocol has no federated rounds to grow it in.
  - The official code's default flags run a reversed variant (masks start all personal and shrink; `--invert`
    off); the paper's algorithm is that code with `--invert`, which is what the "official" preset follows.

Diagnostics: per evaluation, the mean over participated clients of the personal fraction of each block's parameter
entries, of all parameters and of the eligible entries (`diag.personal_fraction`), and the same fractions for every
client (`diag.personal_fraction_clients`, keyed by client id): metrics.jsonl holds them round by round.
Artifacts: the final mask IoU between clients for the classifier (the head blocks' eligible tensors), clients
sorted by their majority class (paper Fig. 4), as a heat-map PNG and a CSV.

Site-local runs (`sites.local`): a site evaluating its clients receives the global values and, of the stored masks
`mask/<cid>/<key>`, only its own clients' (`client_entries`): a client's P-FL model is composed from the global
values and its own state. Which entries another client holds personal never reaches a site.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from pflbed.algorithms.base import Algorithm, Budget, ClientContext, ClientData, Context, Predictor, Tensors
from pflbed.algorithms.local_sgd import LocalSGDPlan, Phase
from pflbed.algorithms.masks import (
    any_each,
    eligible_keys,
    fill,
    grow_mask,
    iou_matrix,
    masked_mean,
    pack_bits,
    take,
    unpack_bits,
)
from pflbed.algorithms.reply_shapes import UNSENT, Spec, misfit
from pflbed.algorithms.training import finetune_epochs, weighted_mean
from pflbed.search import Search, Space

PRESETS: dict[str, dict[str, Any]] = {
    "paper": {"p": 0.25, "alpha": 0.3, "update_every": 1, "eligible": "all", "delta_from": "round_start"},
    "official": {"p": 0.25, "alpha": 0.8, "update_every": 3, "eligible": "weights", "delta_from": "last_update"},
}



class FedSelectOptions(BaseModel):
    """FedSelect options; the ones left unset take the value of `preset`."""

    model_config = ConfigDict(extra="forbid")
    search: ClassVar[dict[str, Space]] = {"p": Search(0.05, 0.5), "alpha": Search(0.1, 0.9)}
    preset: Literal["paper", "official"] = Field("paper", description="defaults for the unset options")
    p: float | None = Field(None, ge=0, le=1, description="personalization rate: share of global entries selected")
    alpha: float | None = Field(None, ge=0, le=1, description="personalization limit per tensor (0: FedAvg)")
    update_every: int | None = Field(None, ge=1, description="grow masks after every N-th round of the client")
    eligible: Literal["weights", "all"] | None = Field(
        None, description="weights: Linear/Conv weights only (official); all: every parameter (paper)"
    )
    delta_from: Literal["round_start", "last_update"] | None = Field(
        None, description="Δ reference: this round's starting model (paper) or the model at the last mask update"
    )
    selection: Literal["largest", "smallest", "random"] = Field(
        "largest", description="personalize the most changed entries (paper), the least changed, or random ones"
    )
    layers: str = Field("all", description="'all', or one block name: only that block can be personalized")
    limit: Literal["stop", "cap"] = Field(
        "stop", description="stop: stop growing once α is reached (may overshoot); cap: never exceed α"
    )

    @model_validator(mode="after")
    def _apply_preset(self) -> FedSelectOptions:
        for key, value in PRESETS[self.preset].items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        return self


class FedSelect(Algorithm):
    name = "fedselect"
    dp_refused = (
        "the server averages each entry over the clients whose personal masks kept it: the counts reveal "
        "the masks, and no single shared update is averaged"
    )
    Config = FedSelectOptions
    client_entries = r"mask/(\d+)/"

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        model = ctx.model
        self.keys = list(ctx.initial_params)
        self.shapes = {k: v.shape for k, v in ctx.initial_params.items()}
        self.eligible = eligible_keys(model, self.opts.eligible, self.opts.layers)
        self.block_of = {k: b for b in model.block_names() for k in model.state_keys([b])}
        self.param_keys = [k for k, _ in model.named_parameters()]

    # --- helpers ---------------------------------------------------------------------------------------------
    def _mask(self, store: Tensors, key: str, k: str) -> torch.Tensor:
        """The bool mask stored packed under `key` for tensor `k`; all zero (all global) when absent."""
        bits = store.get(key)
        if bits is None:
            return torch.zeros(self.shapes[k], dtype=torch.bool, device=self.ctx.device)
        return unpack_bits(bits, self.shapes[k])

    def _globals(self, server: Tensors) -> Tensors:
        return {k: server[k] for k in self.keys}

    def _compose(self, shared: Tensors, state: Tensors) -> Tensors:
        """Full model: the client's own values at the entries it held personal in its last training, `shared`
        (full tensors, or the flat global entries of a payload) elsewhere."""
        out = dict(shared)
        for k in self.eligible:
            if f"held/{k}" in state:
                out[k] = fill(self._mask(state, f"held/{k}", k), state[f"v/{k}"], shared[k])
        return out

    # --- federation ------------------------------------------------------------------------------------------
    def init_server(self) -> Tensors:
        return dict(self.ctx.initial_params)

    def configure(self, rnd: int, server: Tensors, cids: list[int]) -> dict[int, Tensors]:
        """Each client gets the global values of its global entries only (as of its last reply)."""
        payloads: dict[int, Tensors] = {}
        for c in cids:
            payloads[c] = {}
            for k in self.keys:
                stored = f"mask/{c}/{k}"
                payloads[c][k] = take(server[k], ~self._mask(server, stored, k)) if stored in server else server[k]
        return payloads

    def round_plan(self, payload: Tensors, state: Tensors, data: ClientData, cctx: ClientContext) -> LocalSGDPlan:
        """LocalAlt (Alg. 2): per epoch, a pass on the personal entries (constants `own/<key>`), then one on the
        global entries (`shared/<key>`), each side one optimizer for the round; a side with no entry to train is
        left out (no pass, no batch drawn). Every eligible tensor carries both masks, all-False where it has
        nothing on that side, so every client's plan has the same shape whatever its masks. `finish` holds the
        client's generator: `selection: random` draws its GradSelect from it after training, where training
        left it (in a batched round too)."""
        generator = cctx.generator
        start = self._compose(payload, state)
        mask = {k: self._mask(state, f"mask/{k}", k) for k in self.eligible}
        lr = self.ctx.cfg.train.lr
        all_blocks = tuple(self.ctx.model.block_names())
        sides = []
        if any(m.any() for m in mask.values()):
            sides.append(Phase(all_blocks, 1, lr, keys=tuple(self.eligible), entries="own/", optimizer="personal"))
        if len(self.param_keys) > len(self.eligible) or not all(m.all() for m in mask.values()):
            sides.append(Phase(all_blocks, 1, lr, entries="shared/", optimizer="global"))
        consts = {f"own/{k}": m for k, m in mask.items()} | {f"shared/{k}": ~m for k, m in mask.items()}
        return LocalSGDPlan(start, tuple(sides) * self.ctx.cfg.train.local_epochs,
                            partial(self._finish, start, mask, state, generator), consts=consts)  # fmt: skip

    def _finish(
        self, start: Tensors, mask: Tensors, state: Tensors, generator: torch.Generator | None, trained: Tensors
    ) -> tuple[Tensors, Tensors]:
        """Upload the entries global during this training; GradSelect (Alg. 3) in a mask-update round."""
        o = self.opts
        held = dict(zip(self.eligible, any_each([mask[k] for k in self.eligible]), strict=True))  # one device read
        reply: Tensors = {}
        for k in self.keys:
            if held.get(k):
                reply[k], reply[f"mask/{k}"] = take(trained[k], ~mask[k]), pack_bits(mask[k])
            else:
                reply[k] = trained[k]

        rounds = int(state["rounds"]) + 1 if "rounds" in state else 1
        new_state: Tensors = {"rounds": torch.tensor(rounds, device=self.ctx.device)}
        update = rounds % o.update_every == 0
        new_mask = dict(mask)
        for k in self.eligible if update else ():  # in key order: `random` draws from the generator in it
            ref = start[k] if o.delta_from == "round_start" else state.get(f"ref/{k}", self.ctx.initial_params[k])
            new_mask[k] = grow_mask(mask[k], trained[k] - ref, rate=o.p, limit=o.alpha, selection=o.selection,
                                    cap=o.limit == "cap", generator=generator)  # fmt: skip
        grown = dict(zip(self.eligible, any_each([new_mask[k] for k in self.eligible]), strict=True)) if update \
            else held  # fmt: skip
        for k in self.eligible:
            if o.delta_from == "last_update" and (update or f"ref/{k}" in state):
                new_state[f"ref/{k}"] = trained[k] if update else state[f"ref/{k}"]
            if held[k]:
                new_state[f"held/{k}"], new_state[f"v/{k}"] = pack_bits(mask[k]), take(trained[k], mask[k])
            if grown[k]:
                new_state[f"mask/{k}"] = pack_bits(new_mask[k])
        return reply, new_state

    def aggregate(self, rnd: int, server: Tensors, replies: dict[int, Tensors], weights: dict[int, float]) -> Tensors:
        """Count-masked uniform mean (Alg. 1); the |D_m| `weights` are deliberately unused (see module doc)."""
        cids = sorted(replies)
        masked = [k for k in self.keys if any(f"mask/{k}" in replies[c] for c in cids)]
        plain = [k for k in self.keys if k not in set(masked)]
        out = dict(server)  # keeps the stored masks of clients not sampled this round
        if plain:
            out.update(weighted_mean(replies, dict.fromkeys(cids, 1.0), keys=plain))
        for k in masked:
            values, shared = [], []
            for c in cids:
                r = replies[c]
                if f"mask/{k}" in r:
                    glob = ~self._mask(r, f"mask/{k}", k)
                    values.append(fill(glob, r[k], torch.zeros(self.shapes[k], dtype=r[k].dtype, device=r[k].device)))
                    shared.append(glob)
                else:
                    values.append(r[k])
                    shared.append(torch.ones(self.shapes[k], dtype=torch.bool, device=r[k].device))
            out[k] = masked_mean(server[k], values, shared)
        for c in cids:
            for k in self.eligible:
                if f"mask/{k}" in replies[c]:
                    out[f"mask/{c}/{k}"] = replies[c][f"mask/{k}"]
                else:
                    out.pop(f"mask/{c}/{k}", None)
        return out

    def payload_fits(self, rnd: int, cid: int, payload: Tensors, state: Tensors) -> str | None:
        """Every model entry in the model's dtype: flat, the global entries of the mask the client held in its last
        training (`held/<key>` of its state: the mask its reply sent, which the server keeps as `mask/<cid>/`),
        else whole."""
        want: dict[str, Spec] = {}
        for k in self.keys:
            dtype = self.ctx.initial_params[k].dtype
            held = f"held/{k}" in state
            want[k] = ((int((~self._mask(state, f"held/{k}", k)).sum()),) if held else tuple(self.shapes[k]), dtype)
        return misfit(payload, want, UNSENT)

    def view_groups(self, cids: list[int]) -> list[dict[str, Spec]]:
        """Each client's mask of each eligible tensor (`mask/<cid>/<key>`, packed bits), alone: the server keeps
        the masks a client's latest reply sent, which need not cover every eligible tensor."""
        return [{f"mask/{c}/{k}": ((math.ceil(self.shapes[k].numel() / 8),), torch.uint8)} for c in cids
                for k in self.eligible]  # fmt: skip

    def reply_fits(self, payload: Tensors, reply: Tensors) -> str | None:
        """None if `reply` is what a client replies to `payload`, else why not (see the wire format above).

        For each model entry `<key>`, either the full tensor, or — for an eligible tensor only — `mask/<key>`
        (uint8, ⌈n/8⌉ bytes, padding bits zero) with the flat values of exactly the entries that mask leaves
        global, in the model's dtype. The mask holds at least one personal entry (an empty one is not sent), at
        most as many as α and p let it grow (`most_personal`) and, since masks only grow, at least as many as
        the mask the server holds for the client (the payload sent the tensor flat, so a reply to it has a
        mask). That it holds every entry of the stored mask cannot be checked here: the payload carries the
        count of those entries, not which. The server unpacks each mask and scatters the values into it: a mask
        of another size, or values of another count, would crash that; a mask of a tensor that is not eligible
        would make its mean masked."""
        want: dict[str, Spec] = {}
        for k in self.keys:
            shape, dtype = tuple(self.shapes[k]), self.ctx.initial_params[k].dtype
            n, bits = self.shapes[k].numel(), reply.get(f"mask/{k}")
            if bits is None or k not in self.eligible:  # a mask of an ineligible tensor: an extra key below
                if tuple(payload[k].shape) != shape:
                    return f"lacks 'mask/{k}', though the server holds a mask of '{k}' for this client"
                want[k] = (shape, dtype)
                continue
            packed: Spec = (((n + 7) // 8,), torch.uint8)
            why = misfit({f"mask/{k}": bits}, {f"mask/{k}": packed})
            if why is not None:
                return why
            flat = (bits.reshape(-1, 1) >> torch.arange(7, -1, -1, dtype=torch.uint8, device=bits.device)) & 1
            personal, padding = int(flat.reshape(-1)[:n].sum()), int(flat.reshape(-1)[n:].sum())
            if padding or not personal:
                return f"has 'mask/{k}' with " + ("padding bits set" if padding else "no personal entry")
            if personal > self.most_personal(n):
                return (f"has 'mask/{k}' of {personal} personal entries, more than alpha and p let a client grow "
                        f"({self.most_personal(n)})")  # fmt: skip
            if personal < n - payload[k].numel():
                return (f"has 'mask/{k}' of {personal} personal entries, fewer than the {n - payload[k].numel()} "
                        "the server holds for this client")  # fmt: skip
            want[k], want[f"mask/{k}"] = ((n - personal,), dtype), packed
        return misfit(reply, want)

    def most_personal(self, n: int) -> int:
        """The most personal entries GradSelect (`grow_mask`) lets a tensor of n entries reach: it grows a mask
        while its count b is below α·n, by ⌊p·(n − b) + ½⌋ (trimmed to ⌊α·n⌋ under `limit: cap`), and that is
        largest from the largest such b."""
        o = self.opts
        b = math.ceil(o.alpha * n - 1e-9) - 1  # the largest count that still grows
        if b < 0:
            return 0
        most = b + math.floor(o.p * (n - b) + 0.5)
        return min(most, math.floor(o.alpha * n + 1e-9)) if o.limit == "cap" else min(most, n)

    # --- evaluation ------------------------------------------------------------------------------------------
    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        return Predictor(self.ctx.model, self._compose(self._globals(server), state))

    def zero_shot(self, server: Tensors, data: ClientData) -> Predictor:
        """A new client's mask is all zero: its model is the server's global values."""
        return Predictor(self.ctx.model, self._globals(server))

    def personalize(
        self, server: Tensors, data: ClientData, budget: Budget, generator: torch.Generator
    ) -> Iterator[Predictor]:
        """Fine-tune a new client's all-global model (ft: everything; lp: the head only)."""
        yield from finetune_epochs(self.ctx.model, self._globals(server), data, budget, generator)

    # --- diagnostics -----------------------------------------------------------------------------------------
    def personal_counts(self, state: Tensors) -> dict[str, int]:
        """Personal entries per eligible tensor in a client's current mask (the one its next round trains with)."""
        return {k: int(self._mask(state, f"mask/{k}", k).sum()) for k in self.eligible}

    def diagnostics(self, rnd: int, server: Tensors, state_of: Callable[[int], Tensors]) -> dict[str, Any]:
        clients = list(self.ctx.federation.participated)
        size: dict[str, int] = {}
        for k in self.param_keys:
            size[self.block_of[k]] = size.get(self.block_of[k], 0) + self.shapes[k].numel()
        total = sum(size.values())
        n_eligible = sum(self.shapes[k].numel() for k in self.eligible)
        sums = dict.fromkeys([*size, "all", "eligible"], 0.0)
        per_client: dict[str, dict[str, float]] = {}
        for c in clients:
            counts = self.personal_counts(state_of(c))
            per_block = dict.fromkeys(size, 0)
            for k, n in counts.items():
                per_block[self.block_of[k]] += n
            frac = {b: n / max(size[b], 1) for b, n in per_block.items()}
            frac["all"] = sum(counts.values()) / max(total, 1)
            frac["eligible"] = sum(counts.values()) / max(n_eligible, 1)
            per_client[str(c)] = {b: round(v, 6) for b, v in frac.items()}
            for b, v in frac.items():
                sums[b] += v
        return {"personal_fraction": {b: round(s / max(len(clients), 1), 6) for b, s in sums.items()},
                "personal_fraction_clients": per_client}  # fmt: skip

    def iou_keys(self) -> list[str]:
        """The tensors of the "classifier layer" for the IoU plot: the head blocks' eligible tensors, or (under a
        single-layer ablation that excludes the head) those of the topmost block that has any."""
        model = self.ctx.model
        for blocks in [model.head_blocks(), *([b] for b in reversed(model.block_names()))]:
            keys = [k for k in self.eligible if self.block_of[k] in blocks]
            if keys:
                return keys
        return list(self.eligible)

    def artifacts(self, server: Tensors, state_of: Callable[[int], Tensors], out_dir: Path) -> dict[str, str]:
        """Paper Fig. 4: final mask IoU between clients on the classifier, sorted by majority class (PNG + CSV)."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fed = self.ctx.federation
        keys = self.iou_keys()
        order = sorted(fed.participated, key=lambda c: (int(fed.clients[c].prior.argmax()), c))
        masks = [torch.cat([self._mask(state_of(c), f"mask/{k}", k).reshape(-1) for k in keys]) for c in order]
        mat = iou_matrix(masks).cpu()  # plotted and written from host memory
        labels = []
        for c in order:
            prior = fed.clients[c].prior
            top = [int(i) for i in prior.argsort(descending=True)[:2] if prior[i] > 0]
            labels.append(f"c{c}: {','.join(map(str, top))}")

        out_dir.mkdir(parents=True, exist_ok=True)
        csv_name, png_name = "fedselect_mask_iou.csv", "fedselect_mask_iou.png"
        with open(out_dir / csv_name, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["client", "majority_class", *[f"c{c}" for c in order]])
            for i, c in enumerate(order):
                w.writerow([c, int(fed.clients[c].prior.argmax()), *[f"{v:.6f}" for v in mat[i].tolist()]])

        n = len(order)
        side = min(4 + 0.35 * n, 24)
        fig = Figure(figsize=(side + 1.5, side))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        im = ax.imshow(mat.numpy(), vmin=0, vmax=1, cmap="viridis")  # NaN (both masks empty) is left blank
        ax.set_xticks(range(n), labels, rotation=90, fontsize=7)
        ax.set_yticks(range(n), labels, fontsize=7)
        layer = ", ".join(sorted({self.block_of[k] for k in keys}))
        ax.set_title(f"FedSelect mask IoU, {layer} (final masks)\nclients sorted by majority class", fontsize=9)
        fig.colorbar(im, ax=ax, label="IoU (blank: both masks empty)")
        fig.tight_layout()
        fig.savefig(out_dir / png_name, dpi=120)
        return {"mask_iou_png": png_name, "mask_iou_csv": csv_name}
