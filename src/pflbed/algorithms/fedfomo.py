"""FedFomo — Zhang, Sapra, Fidler, Yeung & Alvarez, "Personalized Federated Learning with First Order Model
Optimization", ICLR 2021 (arXiv 2012.08565; §3: the first-order federated update and the client-to-client
affinity matrix with ε-greedy model sampling).

Every client i keeps its own model θ_i; there is no global model. In a round in which client i takes part it
receives M models θ_n that other clients uploaded, and forms its personalized federated update

    θ_i^t = θ_i^{t−1} + Σ_n w_n · (θ_n − θ_i^{t−1})                                  (federated update)

with the first-order weights, measured on the client's own validation data (L_i: its validation loss)

    w_n = max(L_i(θ_i^{t−1}) − L_i(θ_n), 0) / ‖θ_n − θ_i^{t−1}‖,   then   w_n ← w_n / Σ_m w_m.

A model that does not lower the client's validation loss gets weight 0; when no model does (every w_n = 0) the
client keeps θ_i^{t−1} unchanged. The client then trains locally from θ_i^t (`train.*`: E = `train.local_epochs`
epochs of SGD on its training split) and uploads the trained model with its weights (w_n, n).

The server keeps the latest uploaded model of every client (`local/{cid}/{param}`) and the affinity matrix P
(`P[i, n]`: how much client i has gained from client n's models). After each round P[i, n] ← P[i, n] + w_n for
the models client i received (`affinity: weights`, the default; `deltas` is the authors' code's rule, below). The
M models sent to client i are chosen ε-greedily from P's row i: each of the M
download slots explores with probability ε_t (a model chosen uniformly among those not yet picked) and otherwise
exploits (the not-yet-picked model of highest P[i, n]; ties, e.g. the all-zero P of the first rounds, broken at
random). ε decays linearly over the rounds: ε_t = max(0, ε − δ·(t − 1)).

Round structure (one engine round):
  - configure: for client i, candidates are the clients ≠ i in the pool (`candidates`: every client that has
    uploaded at least once, the default, or the authors' latest round's uploaders; their latest models); up to M
    are chosen as above. Payload: `m/{slot}/{param}` and `fomo/ids` (the slots' client ids). In round 1 nobody
    has uploaded: the round's sampled clients only train locally (`train.local_epochs`) and upload, as in the
    authors' released commands (`-fr 1.0`). With a federating ratio below 1 their first round differs: every
    client of the federation trains one local epoch and a random subset of the sampled size uploads (a round of
    non-sampled clients is outside the engine's contract: not reproduced).
  - client: weights on the validation split → θ_i^t → local training → reply (`{param}` of the trained model,
    `fomo/w`, `fomo/ids`; with `affinity: deltas` also the normalized signed gains `fomo/gain`, always finite);
    the client state is the trained model (θ_i for the next time it is sampled).
  - aggregate: store each reply's model under `local/{cid}/`, add its weights (or its normalized gains) to
    P[i, ids].

Choices (the paper leaves them open or they follow from our contract):
  - θ_i^{t−1} is the client's own latest model (its state: the model it trained and uploaded last time; the run's
    initial model before its first round). It is the expansion point of the first-order rule, not a candidate:
    a candidate equal to it has w = 0/0, taken as 0, and adds a zero term (θ_i − θ_i) to the update, so including
    it would change nothing. M therefore counts other clients' models.
  - ‖·‖ is the Euclidean norm over all trainable parameters (flattened together; `norm: l1` below). The update
    is applied to every floating-point tensor of the state (BatchNorm running statistics are combined like the
    weights); integer buffers (BatchNorm's batch counter) keep the client's own value.
  - L_i is the mean cross-entropy on the validation split, models in eval mode (dropout off, BN running
    statistics), computed in float64. A loss that is not finite gives weight 0 (a diverged candidate); an infinite
    gain (a finite candidate loss against a non-finite own loss) takes all the weight, shared equally.
  - Validation data: `ClientData.val` (the client's local validation split, `federation.val_fraction`). A client
    with an empty validation split falls back, in this order, to (1) its domain's shared validation set under
    `federation.protocol=pflbed`, each sample weighted by the client's training class prior P_m(y) — the data and
    weighting the protocol scores that client's validation accuracy with; (2) its training split (e.g.
    `federation.val_fraction=0`), which favours its own model, trained on those samples: FedFomo then federates
    little. Test data is never used.
  - ε-greedy per download slot, the decay linear per round (ε_t above, t = the engine round), as in the authors'
    code. The draws come from a generator seeded by (seed, round, client id) alone, so the choice is the same
    whichever executor runs the clients and in whatever order. P starts at 0.
  - P is kept over the participated clients (rows and columns in `federation.participated` order).

Defaults:
  - `M` = 5: the smaller of the paper's two model counts ("5 models" and "10 models"; the authors' CIFAR-10
    commands: 15 clients, 5 latent distributions). Those commands request 4 and 9 other clients' models besides
    the client's own (`--num_update_clients`), so `M: 4` matches their "5 models" exactly.
  - `epsilon` ε = 0.3, `epsilon_decay` δ = 0.05 per round: the authors' released commands
    (`--client_weight_epsilon 0.3 --client_weight_epsilon_decay 0.05`): ε reaches 0 in round 7.
  - The paper holds out 20% of each client's local data as its validation set (authors' `--train_split 0.8`);
    here the split is the federation's: set `federation.val_fraction: 0.2` for the same fraction.
  - Local training: `train.*` (the authors use SGD lr 0.1 with 0.99 decay per round, 5 local epochs, batch 50).
    It is a plan (`sgd_plan`: FedAvg's epochs from θ_i^t, the federated update computed first), so
    `executor.batch_clients` trains a round's clients together.

The authors' code, as options (the defaults are the rules above):
  - `affinity: deltas`: P[i, n] += δ_n / |Σ_m δ_m| over the models client i received, δ_n = (L_i(θ_i^{t−1}) −
    L_i(θ_n)) / ‖θ_n − θ_i^{t−1}‖ the *signed* gain before clipping (a |Σ| below 1e-9 is raised by 1e-9, as there).
    A model that raised the client's loss adds a negative amount and ranks below the never-tried ones (P = 0);
    under `weights` it adds 0 and ties with them, so the greedy slots keep offering it until an exploration or a
    tie-break passes it over. Edge cases: δ = 0 for a zero distance or a NaN loss (a diverged candidate adds 0
    here: the authors' code would write NaN into P); infinite gains take the whole increment, sign(δ)/count each.
    The update itself still uses the clipped weights w. The server then also counts, per client, the updates
    that took in other models (`updates`), for the diagnostics.
  - `candidates: last_round`: the download pool is the clients that uploaded in the latest round with an upload
    (the authors' `uploaded_clients`: the previous round's participants), instead of every client that ever
    uploaded. New clients draw on the same pool.
  - `norm: l1`: the distance in the weights is the L1 norm, Σ over the parameters of |θ_n − θ_prev|, the default
    of the authors' code (`--model_delta_norm l1`, which their released commands keep). The paper writes ‖·‖
    without naming the norm, so the default stays Euclidean. Under L1, a model that differs in many parameters is
    discounted more, relative to one that differs in a few, than under L2.

Not reproduced from the authors' code (it differs from the paper's rule): its released commands measure the gains
against the client's model *before* its last local training (`--baseline_model first_model`) and count the
client's freshly trained model among the candidates (so that model can receive weight); they also cluster the
clients into sub-federations every round (`-nf 5`: spectral clustering of the affinities) and add the clusters'
averages and their mean to every client's candidates.

What is scored: the authors' code logs each client's test accuracy right after its federated update, before its
local training (`local_eval` precedes `local_train`; after the last round one more update is made and scored).
Here a client's P-FL model is its state, the model after its local training, as for every algorithm of the
engine.

New clients (the paper defines none): the same first-order rule as one FedFomo update with every stored model of
the pool as a candidate — θ_prev is the run's initial model (a new client never uploaded), the weights come from
its validation data (the fallback above included), and the result is its zero-shot model; `personalize`
fine-tunes it (FT/LP, `training.finetune_epochs`). If no stored model improves on θ_prev, the start is θ_prev.
`eval.finetune` does not run for the participated clients (FedFomo has no generic model, and the engine
fine-tunes participated clients only from one); called with a participated client's data, `personalize` would
start from that client's stored model instead — a path the engine never takes.

Diagnostics: `diag.federated_updates` (the number of client updates so far that took in other models: the sum
of P under `affinity: weights`, since each such reply's weights sum to 1; the `updates` counter under `deltas`)
and `diag.partners_per_client` (mean count of clients n with P[i, n] > 0: under `deltas`, those that helped more
than they harmed).

Communication: down M models per client (fewer while fewer clients have uploaded) and M client ids; up one model
and M weights and ids (with `affinity: deltas`, also M gains).

Site-local runs (`sites.local`): a site evaluating its clients receives, of the server state, only their own stored
models `local/<cid>/` and their own rows of P, `last_upload` and `updates` (the others' zeroed, `server_view`): a
client's P-FL model is its own state. A training payload still carries the M models chosen for the client — other
clients' models, which FedFomo hands out by design.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from functools import partial
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from pflbed import rng
from pflbed.algorithms.base import Algorithm, Budget, ClientData, Context, Predictor, Tensors, own_rows
from pflbed.algorithms.local_sgd import LocalSGDPlan, Phase
from pflbed.algorithms.reply_shapes import UNSENT, Spec, misfit, specs
from pflbed.algorithms.training import finetune_epochs, validation_data
from pflbed.search import IntSearch, Search, Space

_STREAM = 0xF0A0  # the server's model-sampling stream, apart from the engine's tags (1–4)
IDS, WEIGHTS, GAINS, UPDATES = "fomo/ids", "fomo/w", "fomo/gain", "updates"


class FedFomoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # the paper: M = 5, ε = 0.3
    search: ClassVar[dict[str, Space]] = {"M": IntSearch(1, 10), "epsilon": Search(0.0, 0.5)}
    M: int = Field(5, ge=1, description="other clients' models each sampled client downloads per round")
    epsilon: float = Field(0.3, ge=0, le=1, description="ε: initial exploration probability per download slot")
    epsilon_decay: float = Field(0.05, ge=0, description="δ: ε_t = max(0, ε − δ·(t − 1)) in round t")
    affinity: Literal["weights", "deltas"] = Field("weights", description="P[i, n] += the update's weight w_n, or "
                                                   "the authors' signed gain δ_n/|Σδ| (harmful models go "
                                                   "negative)")  # fmt: skip
    candidates: Literal["uploaded", "last_round"] = Field("uploaded", description="download pool: every client "
                                                          "that ever uploaded, or the authors' latest round's "
                                                          "uploaders")  # fmt: skip
    norm: Literal["l2", "l1"] = Field("l2", description="‖θ_n − θ_prev‖ in the weights: Euclidean, or the "
                                      "authors' code's default, the L1 norm (summed absolute differences)")


def signed_gains(own_loss: torch.Tensor, losses: torch.Tensor, distances: torch.Tensor) -> torch.Tensor:
    """δ_n = (L(θ_prev) − L(θ_n)) / ‖θ_n − θ_prev‖, signed: > 0 for a model that lowers the loss, < 0 for one that
    raises it. A zero distance (the model is θ_prev) or a NaN (a NaN loss) gives 0; ±∞ stay."""
    gain = own_loss - losses
    raw = torch.where(distances > 0, gain / torch.where(distances > 0, distances, 1.0), 0.0)
    return torch.where(torch.isnan(raw), 0.0, raw)


def first_order_weights(own_loss: torch.Tensor, losses: torch.Tensor, distances: torch.Tensor) -> torch.Tensor:
    """The normalized FedFomo weights: max(L(θ_prev) − L(θ_n), 0) / ‖θ_n − θ_prev‖, divided by their sum.

    All zeros when no model lowers the loss (the client keeps its model). A zero distance (the model is θ_prev)
    or a non-finite loss gives 0; an infinite gain takes all the weight (the limit of the normalization).
    """
    raw = signed_gains(own_loss, losses, distances).clamp(min=0.0)
    if bool(torch.isinf(raw).any()):
        raw = torch.isinf(raw).to(raw.dtype)
    total = raw.sum()
    return raw / total if bool(total > 0) else torch.zeros_like(raw)


def affinity_deltas(gains: torch.Tensor) -> torch.Tensor:
    """The authors' affinity increments: the signed gains δ_n divided by |Σ_m δ_m| (a sum below 1e-9 in absolute
    value raised by 1e-9, as their code does), so a model that raised the loss adds a negative amount. Infinite
    gains take the whole increment (the limit of the normalization): sign(δ_n)/(their count) each, 0 for the rest.
    """
    inf = torch.isinf(gains)
    if bool(inf.any()):
        return torch.where(inf, torch.sign(gains), 0.0) / inf.sum()
    norm = gains.sum().abs()
    return gains / (norm + 1e-9 if bool(norm < 1e-9) else norm)


def combine(own: Tensors, models: list[Tensors], weights: torch.Tensor) -> Tensors:
    """θ_prev + Σ_n w_n (θ_n − θ_prev) over the floating-point tensors; integer buffers keep θ_prev's values.
    With every weight 0 the result is θ_prev itself, bit for bit."""
    w = weights.tolist()  # host numbers
    out: Tensors = {}
    for k, v in own.items():
        acc = v.clone()
        if v.is_floating_point():
            for wn, m in zip(w, models, strict=True):
                if wn > 0:
                    acc.add_(m[k] - v, alpha=wn)
        out[k] = acc
    return out


class FedFomo(Algorithm):
    name = "fedfomo"
    dp_refused = "the server hands clients each other's individual models, which each client weighs on its own data"
    Config = FedFomoOptions
    client_entries = r"local/(\d+)/"
    client_rows: ClassVar[tuple[str, ...]] = ("P", "last_upload", UPDATES)  # row i: the i-th participated client's

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.clients = list(ctx.federation.participated)
        self.index = {c: i for i, c in enumerate(self.clients)}
        self.keys = list(ctx.initial_params)
        self.param_keys = [k for k, _ in ctx.model.named_parameters()]

    # --- the first-order rule --------------------------------------------------------------------------------
    def validation(self, data: ClientData) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(x, y, per-sample weights or None) the client's L_i is measured on: its validation split, else its
        domain's shared validation set weighted by its class prior (PFLBED), else its training split."""
        idx, prior = validation_data(self.ctx.federation, data)
        if idx.numel() > 0:
            y = data.y[idx]
            if prior is None:
                return data.x[idx], y, None
            sw = prior.to(torch.float64)[y]
            if bool(sw.sum() > 0):
                return data.x[idx], y, sw
        return data.x[data.train], data.y[data.train], None

    def loss(self, params: Tensors, x: torch.Tensor, y: torch.Tensor, sw: torch.Tensor | None) -> torch.Tensor:
        """L_i(θ): mean cross-entropy (weighted by `sw` where given) in eval mode, float64."""
        logits = Predictor(self.ctx.model, params).logits(x, self.ctx.cfg.eval.batch_size)
        ce = F.cross_entropy(logits.to(torch.float64), y, reduction="none")
        return ce.mean() if sw is None else (sw * ce).sum() / sw.sum()

    def distance(self, a: Tensors, b: Tensors) -> torch.Tensor:
        """‖a − b‖ over the trainable parameters, flattened together (float64): Euclidean, or L1 (`norm`)."""
        diffs = [a[k].to(torch.float64) - b[k].to(torch.float64) for k in self.param_keys]
        if self.opts.norm == "l1":
            return sum(d.abs().sum() for d in diffs)
        return torch.sqrt(sum((d**2).sum() for d in diffs))

    def federated_update(
        self, own: Tensors, models: list[Tensors], data: ClientData
    ) -> tuple[Tensors, torch.Tensor, torch.Tensor]:
        """(θ_i^t, w, δ): the combined model, the first-order weights of `models` against `own` on the client's
        validation data, and the signed gains they come from."""
        if not models:
            none = torch.zeros(0, dtype=torch.float64, device=self.ctx.device)
            return dict(own), none, none
        x, y, sw = self.validation(data)
        own_loss = self.loss(own, x, y, sw)
        losses = torch.stack([self.loss(m, x, y, sw) for m in models])
        distances = torch.stack([self.distance(m, own) for m in models])
        w = first_order_weights(own_loss, losses, distances)
        return combine(own, models, w), w, signed_gains(own_loss, losses, distances)

    # --- model sampling --------------------------------------------------------------------------------------
    def epsilon(self, rnd: int) -> float:
        """ε_t: linear decay from `epsilon` by `epsilon_decay` per round, floored at 0."""
        return max(0.0, self.opts.epsilon - self.opts.epsilon_decay * (rnd - 1))

    def choose(self, rnd: int, cid: int, candidates: list[int], affinity: list[float]) -> list[int]:
        """Up to M of `candidates` (client ids, with client cid's affinities to them), ε-greedily per slot.

        Every random number is drawn whatever ε is, from (seed, round, cid) alone: the explore coins, a random
        tie-break for the greedy order and a random order for exploration.
        """
        n = len(candidates)
        m = min(self.opts.M, n)
        g = rng.generator(self.ctx.seed, _STREAM, rnd, cid)
        coins = torch.rand(max(m, 1), generator=g, dtype=torch.float64, device="cpu").tolist()
        tie = torch.rand(max(n, 1), generator=g, dtype=torch.float64, device="cpu").tolist()
        shuffled = torch.randperm(n, generator=g, device="cpu").tolist()
        greedy = sorted(range(n), key=lambda j: (-affinity[j], tie[j]))
        eps, picked = self.epsilon(rnd), []
        for s in range(m):
            order = shuffled if coins[s] < eps else greedy
            picked.append(next(j for j in order if j not in picked))
        return [candidates[j] for j in picked]

    def stored(self, server: Tensors, cid: int) -> Tensors:
        return {k: server[f"local/{cid}/{k}"] for k in self.keys}

    def uploaded(self, server: Tensors) -> list[int]:
        """Participated clients with a stored model, in client order."""
        seen = server["last_upload"].tolist()
        return [c for c in self.clients if seen[self.index[c]] > 0]

    def pool(self, server: Tensors) -> list[int]:
        """The clients whose stored models may be downloaded: every one that uploaded (`uploaded`), or those of
        the latest round with an upload (`last_round`), in client order."""
        if self.opts.candidates == "uploaded":
            return self.uploaded(server)
        seen = server["last_upload"].tolist()
        latest = max(seen, default=0)
        return [c for c in self.clients if latest > 0 and seen[self.index[c]] == latest]

    # --- federation ------------------------------------------------------------------------------------------
    def init_server(self) -> Tensors:
        n, dev = len(self.clients), self.ctx.device
        server = {"P": torch.zeros((n, n), dtype=torch.float64, device=dev),
                  "last_upload": torch.zeros(n, dtype=torch.int64, device=dev)}  # fmt: skip
        if self.opts.affinity == "deltas":  # P's sum no longer counts the federated updates: a counter does
            server[UPDATES] = torch.zeros(n, dtype=torch.int64, device=dev)
        return server

    def init_client(self, cid: int) -> Tensors:
        return dict(self.ctx.initial_params)  # θ_i^0: the run's initial model

    def configure(self, rnd: int, server: Tensors, cids: list[int]) -> dict[int, Tensors]:
        available = self.pool(server)
        payloads: dict[int, Tensors] = {}
        for c in cids:
            candidates = [n for n in available if n != c]
            row = server["P"][self.index[c]].tolist()
            chosen = self.choose(rnd, c, candidates, [row[self.index[n]] for n in candidates])
            payload: Tensors = {IDS: torch.tensor(chosen, dtype=torch.int64, device=self.ctx.device)}
            for s, n in enumerate(chosen):
                payload.update({f"m/{s}/{k}": v for k, v in self.stored(server, n).items()})
            payloads[c] = payload
        return payloads

    def sgd_plan(self, payload: Tensors, state: Tensors, data: ClientData) -> LocalSGDPlan:
        """The federated update (Eq. 6–7, on the client's validation split: no batch drawn) gives the start; local
        training is FedAvg's epochs from it (a plan: `executor.batch_clients` trains a round's clients together)."""
        models = [{k: payload[f"m/{s}/{k}"] for k in self.keys} for s in range(len(payload[IDS]))]
        start, w, gains = self.federated_update(state, models, data)
        t = self.ctx.cfg.train
        phase = Phase(tuple(self.ctx.model.block_names()), t.local_epochs, t.lr)
        return LocalSGDPlan(start, (phase,), partial(self._finish, w, gains, payload[IDS]))

    def _finish(self, w: torch.Tensor, gains: torch.Tensor, ids: torch.Tensor, trained: Tensors
                ) -> tuple[Tensors, Tensors]:  # fmt: skip
        reply = {**trained, WEIGHTS: w, IDS: ids}
        if self.opts.affinity == "deltas":  # normalized here: finite, so a reply never looks diverged
            reply[GAINS] = affinity_deltas(gains)
        return reply, trained

    def aggregate(self, rnd: int, server: Tensors, replies: dict[int, Tensors], weights: dict[int, float]) -> Tensors:
        out, deltas = dict(server), self.opts.affinity == "deltas"
        P, last = server["P"].clone(), server["last_upload"].clone()
        updates = server[UPDATES].clone() if deltas else None
        for c in sorted(replies):
            reply, i = replies[c], self.index[c]
            out.update({f"local/{c}/{k}": reply[k] for k in self.keys})
            cols = [self.index[int(n)] for n in reply[IDS].tolist()]
            if cols:
                added = (reply[GAINS] if deltas else reply[WEIGHTS]).to(P.dtype)
                P[i, torch.tensor(cols, dtype=torch.int64, device=P.device)] += added
            if updates is not None and bool(reply[WEIGHTS].sum() > 0):
                updates[i] += 1
            last[i] = rnd
        out["P"], out["last_upload"] = P, last
        if updates is not None:
            out[UPDATES] = updates
        return out

    def payload_fits(self, rnd: int, cid: int, payload: Tensors, state: Tensors) -> str | None:
        """`fomo/ids`: up to M distinct other participated clients (int64), and each one's stored model `m/<s>/`,
        every entry of the run's model: the structure `configure` gives, whichever clients the server chose."""
        ids = payload.get(IDS)
        if ids is None:
            return f"lacks '{IDS}'"
        if ids.dim() != 1 or ids.dtype != torch.int64:
            return f"has '{IDS}' of shape {list(ids.shape)} and dtype {ids.dtype}, expected one dimension of int64"
        chosen = ids.tolist() if len(ids) <= self.opts.M else None  # not a list of any length the server sent
        if chosen is None or len(set(chosen)) < len(chosen) or not set(chosen) <= set(self.index) - {cid}:
            return f"has '{IDS}' {ids[:8].tolist()}: not up to M = {self.opts.M} distinct other clients of the run"
        model = specs(self.ctx.initial_params)
        return misfit(payload, {IDS: ((len(chosen),), torch.int64),
                                **{f"m/{s}/{k}": v for s in range(len(chosen)) for k, v in model.items()}}, UNSENT)

    def reply_fits(self, payload: Tensors, reply: Tensors) -> str | None:
        """None if `reply` is what a client replies to `payload`, else why not: the trained model (every entry of
        the run's model), its weights `fomo/w` (float64, one per model sent), `fomo/ids` exactly as sent and, under
        `affinity: deltas`, its gains `fomo/gain` (as `fomo/w`). The server stores the model as the client's and
        adds the weights into P at the columns of the replied ids: another id would credit (or crash on) a client
        the server did not send, and weights of another length would not fit those columns."""
        ids = payload[IDS]
        m = ((len(ids),), torch.float64)
        want = {**specs(self.ctx.initial_params), WEIGHTS: m, IDS: (tuple(ids.shape), ids.dtype)}
        if self.opts.affinity == "deltas":
            want[GAINS] = m
        why = misfit(reply, want)
        if why is None and not torch.equal(reply[IDS].cpu(), ids.cpu()):
            why = f"has '{IDS}' {reply[IDS].tolist()}, not the ids the server sent, {ids.tolist()}"
        return why

    # --- evaluation ------------------------------------------------------------------------------------------
    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        return Predictor(self.ctx.model, state)

    def server_view(self, server: Tensors, cids: Collection[int]) -> Tensors:
        """The stored models of `cids` and their rows of the per-client tables: P's row i is what client i
        gained from each other client's model, measured on its own validation data."""
        view = super().server_view(server, cids)
        rows = [self.index[c] for c in cids if c in self.index]
        return {k: own_rows(v, rows) if k in self.client_rows else v for k, v in view.items()}

    def view_groups(self, cids: list[int]) -> list[dict[str, Spec]]:
        """Each client's stored model `local/<cid>/` (every entry of the run's model), once it has uploaded."""
        model = specs(self.ctx.initial_params)
        return [{f"local/{c}/{k}": s for k, s in model.items()} for c in cids]

    def start_for(self, server: Tensors, data: ClientData) -> Tensors:
        """One FedFomo update of the client's stored model (θ^0 if it has none) over every other stored model."""
        own = self.stored(server, data.cid) if data.cid in self.uploaded(server) else dict(self.ctx.initial_params)
        models = [self.stored(server, n) for n in self.pool(server) if n != data.cid]
        return self.federated_update(own, models, data)[0]

    def zero_shot(self, server: Tensors, data: ClientData) -> Predictor | None:
        return Predictor(self.ctx.model, self.start_for(server, data))

    def personalize(
        self, server: Tensors, data: ClientData, budget: Budget, generator: torch.Generator
    ) -> Iterator[Predictor]:
        yield from finetune_epochs(self.ctx.model, self.start_for(server, data), data, budget, generator)

    # --- diagnostics -----------------------------------------------------------------------------------------
    def diagnostics(self, rnd: int, server: Tensors, state_of: Callable[[int], Tensors]) -> dict[str, Any]:
        """How much federating happened: every reply whose weights are not all zero adds exactly 1 to P, so P's
        sum counts the client updates that took in other models (0: FedFomo has behaved as Local so far)."""
        P = server["P"]
        updates = float(server[UPDATES].sum()) if UPDATES in server else float(P.sum())
        return {"federated_updates": round(updates, 6),
                "partners_per_client": round(float((P > 0).sum(1).to(torch.float64).mean()), 6)}  # fmt: skip
