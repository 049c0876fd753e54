"""FedDBE — Zhang, Hua, Cao, Wang, Song, Xue, Ma & Guan, "Eliminating Domain Bias for Federated Learning in
Representation Space", NeurIPS 2023: FedAvg with the Domain Bias Eliminator (DBE), its two parts the personalized
representation bias memory (PRBM) and mean regularization (MR).

The model is a feature extractor f (every block below the top `head_blocks`) and a head h. Client i keeps a PRBM,
a trainable vector z̄_i^p of one representation's shape, zero at first and never uploaded; its head reads the
global representation shifted by it:

    ŷ = h(z_i^g + z̄_i^p; θ^h),   z_i^g = f(x; θ^f)                                                   [PRBM]

MR pulls the client's running mean of z_i^g toward a consensus mean z̄^g, the same for every client and fixed for
the whole run. Within a round (reset to 0 at its start), batch after batch,

    z̄_i^g ← (1 − m)·z̄_i^g + m·mean_batch(z_i^g)      (the earlier batches' part held constant)          [RM]
    L_i = CE(h(z_i^g + z̄_i^p), y) + κ·mean_k ½(z̄_{i,k}^g − z̄_k^g)²                                     [L]

and SGD on L_i moves θ^f, θ^h (train.lr) and z̄_i^p (`prbm_lr`). The server averages θ^f, θ^h as FedAvg does,
θ̄ = Σ_{i∈S_t} n_i/n_S·θ_i [AGG]; z̄_i^p stays on the client.
Initialization period [C]: before DBE's rounds every client trains once from the initial model on cross-entropy
alone (no PRBM, no MR), keeping the running mean [RM]; the server sets z̄^g = Σ_i n_i/Σ_j n_j·z̄_i^g over all the
clients and sends it to every client; the models trained for it are discarded.
P-FL of client i: h(f(x; θ̄^f) + z̄_i^p; θ̄^h), the server's model and the client's memory (what the authors' code
evaluates, after the download and before local training). G-FL: the global model θ̄ alone.

Sources: the paper's text could not be read here; the rule is the authors' code (TsingZ0/DBE `clientDBE.py`,
`serverDBE.py`, the same in PFLlib) and their run script, with reading notes of the paper that agree on PRBM, MR
and the initialization period. The labels [PRBM], [RM], [L], [C], [AGG] are ours: the paper's equation numbers
could not be checked.

Choices and deviations:
  1. The initialization period is round 1 of the run: the initial model goes to every participated client (the
     round's sample or not), each replies its running mean, and the server keeps θ^0 and adds z̄^g. A run of T
     rounds trains DBE in rounds 2…T; round 1 costs one model download per client. z̄^g is weighted by training-set
     sizes, as the code weights it (the engine's round weights name only the sample), over the replies that arrive.
  2. Defaults κ = 50 and m = 1: the authors' run script (Fashion-MNIST, the 4-layer CNN), the only values they
     publish; the code's argument defaults (κ = 0, m = 0.1) switch MR off. With m = 1 the running mean is the
     current batch's mean, and z̄^g the n-weighted mean of each client's last batch mean of the initialization
     period (the code drops a smaller last batch; pflbed's epochs keep it, for every method). The search covers κ
     log-uniform 0.1–100 and m uniform 0.1–1. The running mean is the code's, without bias correction: with m < 1
     a round's first batches are pulled toward 0.
  3. Where DBE sits (`head_blocks`, default 1): between the classifier and the blocks below, as the code splits
     (head = the last Linear). A reading note says the paper found "before every fully connected layer" best
     (head_blocks 2 on `cnn`, 3 on `lenet5`); unverified, so it is the option, not the default.
  4. Optimizers: z̄_i^p at `prbm_lr` (default train.lr, the code's); both with `train.momentum` and
     `train.weight_decay` (the code: plain SGD), restarted every round like all of pflbed's local SGD.
  5. With m = 1, a round's update is plain local SGD on a per-batch loss: a plan (`sgd_plan`), which
     `executor.batch_clients` trains together. With m < 1 the loss reads the running mean carried from batch to
     batch, and the initialization period replies it: those run client by client (`client_update`), on the same
     objective (`DBEObjective`).
  6. G-FL is the global model with no memory (how the paper's "GM" treats the PRBM could not be checked).
  7. New clients (not in the paper): zero-shot is the global model (a zero memory). `personalize` "ft" runs DBE's
     local update from θ̄ and a zero memory (every block and the memory at the budget's lr and momentum, no weight
     decay, the running mean restarted), "lp" the library's linear probe of the global model (with the default
     split, a memory in front of the linear classifier adds nothing its bias cannot).
  8. BatchNorm running statistics come down with the global model (the server's average); a client trains from
     them and its personal model is scored with them. The code's clients download parameters only
     (`set_parameters` over `.parameters()`) and keep statistics of their own: on a model with BatchNorm, a
     deviation.
Not for client-level DP or SecAgg+ (`dp_refused`); the server state holds nothing per client.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from pflbed.algorithms.base import Algorithm, Budget, ClientContext, ClientData, Context, Predictor, Same, Tensors
from pflbed.algorithms.local_sgd import LocalSGDPlan, Phase, run_blocks, run_plan, weighted_mean
from pflbed.algorithms.partial import split_top
from pflbed.algorithms.reply_shapes import UNSENT, Spec, misfit, spec, specs
from pflbed.algorithms.sgd import SGD
from pflbed.algorithms.training import WeightedMean, finetune_epochs, get_params, index_batches, load_params
from pflbed.models import BlockNet
from pflbed.search import Search, Space, same_as

PRBM = "prbm"  # the client state: z̄_i^p; also a plan tensor
CONSENSUS = "consensus"  # the server state (after the initialization period) and payload: z̄^g
RUNNING = "running"  # the initialization period's reply, and the loop's constant: the running mean z̄_i^g
NET = "net."  # the shared model's keys inside the personal predictor


class FedDBEOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    search: ClassVar[dict[str, Space]] = {"kappa": Search(0.1, 100.0, log=True), "mean_momentum": Search(0.1, 1.0)}
    kappa: float = Field(50.0, ge=0, description="κ, the weight of mean regularization (0: no MR)")
    mean_momentum: float = Field(1.0, gt=0, le=1, description="m, the running mean's momentum (1: the batch mean)")
    prbm_lr: float | None = Field(None, gt=0, description="SGD lr of the PRBM z̄_i^p (default: train.lr)",
                                  json_schema_extra=same_as("train.lr"))
    head_blocks: int = Field(1, ge=1, description="top blocks reading z + z̄_i^p (1: the classifier, as the code)")


class DBEObjective:
    """[L] on a batch, and the running mean [RM] it reads; a plan's objective (`local_sgd.Objective`).

    Without a consensus among the constants (the initialization period): cross-entropy of h(z) alone. The running
    mean's earlier part is the constant `running` (the loop's, m < 1); without it (the plan's, m = 1) the mean is the
    batch's. In a batched step (`w`) the batch mean and the cross-entropy are weighted per sample, MR counted once.
    A class, not a closure: the algorithm travels to `procs` workers by pickle."""

    def __init__(self, body: list[str], head: list[str], kappa: float, m: float) -> None:
        self.body, self.head, self.kappa, self.m = body, head, kappa, m

    def __call__(
        self, model: BlockNet, params: Tensors, consts: Tensors, x: torch.Tensor, y: torch.Tensor,
        w: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        return self.terms(model, params, consts, x, y, w)[0]

    def terms(
        self, model: BlockNet, params: Tensors, consts: Tensors, x: torch.Tensor, y: torch.Tensor,
        w: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(the loss, the running mean after this batch)."""
        z = run_blocks(model, params, self.body, x)  # z^g
        batch = z.mean(0) if w is None else (w.view(-1, *[1] * (z.dim() - 1)) * z).sum(0)
        history = consts.get(RUNNING)
        running = self.m * batch if history is None else (1 - self.m) * history + self.m * batch  # [RM]
        consensus = consts.get(CONSENSUS)
        if consensus is None:  # the initialization period: no PRBM, no MR
            logits = run_blocks(model, params, self.head, z)
        else:
            logits = run_blocks(model, params, self.head, z + params[PRBM])  # [PRBM]
        ce = F.cross_entropy(logits, y, reduction="mean" if w is None else "none")
        loss = ce if w is None else weighted_mean(ce, w)
        if consensus is not None:
            loss = loss + self.kappa * torch.mean(0.5 * (running - consensus) ** 2)  # [L]
        return loss, running


class PersonalPredictor(nn.Module):
    """h(f(x) + z̄^p): the shared BlockNet (`net.` keys) with a memory (`prbm`) added where the head starts.
    `features` is the shared body's output (no memory), so clients' predictors on one body share it."""

    def __init__(self, net: BlockNet, body: list[str], head: list[str], shape: tuple[int, ...]) -> None:
        super().__init__()
        self.net, self.body, self.head = net, body, head
        self.register_buffer(PRBM, torch.zeros(shape, device=next(net.parameters()).device))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        for name in self.body:
            x = self.net.blocks[name](x)
        return x

    def classify(self, z: torch.Tensor) -> torch.Tensor:
        z = z + self.prbm
        for name in self.head:
            z = self.net.blocks[name](z)
        return z

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classify(self.features(x))


class FedDBE(Algorithm):
    name = "feddbe"
    Config = FedDBEOptions
    dp_refused = ("the initialization period's replies are running feature means, no model entry, from every "
                  "client whether sampled or not")  # fmt: skip

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        o, model = self.opts, ctx.model
        self.head, self.body = split_top(model, o.head_blocks, "head_blocks")
        self.model_keys = list(model.state_dict())
        self.shape = self._feature_shape()
        self.objective = DBEObjective(self.body, self.head, o.kappa, o.mean_momentum)  # one object: plans batch
        self.predictor = PersonalPredictor(model, self.body, self.head, self.shape)

    def _feature_shape(self) -> tuple[int, ...]:
        """One sample's representation z^g: a forward of a zero input in eval mode (no statistics move)."""
        model, was = self.ctx.model, self.ctx.model.training
        model.eval()
        with torch.no_grad():
            z = torch.zeros(1, *self.ctx.source.input_shape, device=self.ctx.device)
            for name in self.body:
                z = model.blocks[name](z)
        model.train(was)
        return tuple(z.shape[1:])

    @property
    def prbm_lr(self) -> float:
        return self.opts.prbm_lr if self.opts.prbm_lr is not None else self.ctx.cfg.train.lr

    def model_params(self, server: Tensors) -> Tensors:
        """θ̄ out of the server state (a payload)."""
        return {k: server[k] for k in self.model_keys}

    # --- federation ------------------------------------------------------------------------------------------
    def init_server(self) -> Tensors:
        return dict(self.ctx.initial_params)  # no consensus yet: the next round is the initialization period

    def init_client(self, cid: int) -> Tensors:
        return {PRBM: torch.zeros(self.shape, device=self.ctx.device)}

    def configure(self, rnd: int, server: Tensors, cids: list[int]) -> dict[int, Tensors]:
        if CONSENSUS not in server:  # [C]: every client, sampled or not, from the initial model
            return dict.fromkeys(self.ctx.federation.participated, server)
        return dict.fromkeys(cids, server)

    def sgd_plan(self, payload: Tensors, state: Tensors, data: ClientData) -> LocalSGDPlan | None:
        """A DBE round with m = 1: every block at train.lr and z̄_i^p at `prbm_lr` on [L]; the reply θ, the new
        state z̄_i^p. None for the initialization period and for m < 1 (deviation 5)."""
        if CONSENSUS not in payload or self.opts.mean_momentum != 1:
            return None
        t = self.ctx.cfg.train
        phase = Phase(tuple(self.ctx.model.block_names()), t.local_epochs, t.lr, ((PRBM, self.prbm_lr),))
        start = {**self.model_params(payload), PRBM: state[PRBM]}
        return LocalSGDPlan(start, (phase,), self._finish, self.objective, {CONSENSUS: payload[CONSENSUS]})

    def _finish(self, params: Tensors) -> tuple[Tensors, Tensors]:
        return self.model_params(params), {PRBM: params[PRBM]}

    def client_update(
        self, payload: Tensors, state: Tensors, data: ClientData, cctx: ClientContext
    ) -> tuple[Tensors, Tensors]:
        t = self.ctx.cfg.train
        plan = self.sgd_plan(payload, state, data)
        if plan is not None:
            return run_plan(self.ctx.model, plan, data, t, cctx.generator)
        consensus = payload.get(CONSENSUS)
        *_, (prbm, running) = self.local_epochs(
            self.model_params(payload), state[PRBM], consensus, data, cctx.generator, epochs=t.local_epochs,
            batch_size=t.batch_size, lr=t.lr, prbm_lr=self.prbm_lr, momentum=t.momentum,
            weight_decay=t.weight_decay)  # fmt: skip
        if consensus is None:  # [C]: the running mean goes up, the trained model is discarded
            return {RUNNING: running}, dict(state)
        return get_params(self.ctx.model), {PRBM: prbm.detach().clone()}

    def local_epochs(
        self, start: Tensors, prbm: torch.Tensor, consensus: torch.Tensor | None, data: ClientData,
        generator: torch.Generator, *, epochs: int, batch_size: int, lr: float, prbm_lr: float, momentum: float,
        weight_decay: float,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
        """SGD on [L] from `start` (loaded into the shared model, trained in place) and the memory `prbm`, batch by
        batch carrying the running mean [RM] from 0; after each epoch, (the memory, the running mean). Without a
        consensus, the initialization period: cross-entropy alone, the memory neither read nor trained."""
        model = self.ctx.model
        load_params(model, start)
        named = dict(model.named_parameters())
        memory = prbm.detach().clone().requires_grad_(consensus is not None)
        groups = [{"params": list(named.values()), "lr": lr}]
        if consensus is not None:
            groups.append({"params": [memory], "lr": prbm_lr})
        opt = SGD(groups, lr=lr, momentum=momentum, weight_decay=weight_decay)
        params = {**named, PRBM: memory}
        const = {} if consensus is None else {CONSENSUS: consensus}
        running = torch.zeros(self.shape, device=self.ctx.device)
        for _ in range(epochs):
            model.train()
            for b in index_batches(data.train, batch_size, 1, generator):
                x, y = data.batch(b, generator)
                loss, mean = self.objective.terms(model, params, {**const, RUNNING: running}, x, y, None)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                running = mean.detach().to(running.dtype)
            yield memory, running

    def aggregator(self, rnd: int, server: Tensors, weights: dict[int, float]) -> WeightedMean | _Consensus:
        if CONSENSUS not in server:
            return _Consensus(self, server)
        return WeightedMean(weights, self.model_keys, base={CONSENSUS: server[CONSENSUS]})  # [AGG]

    def payload_fits(self, rnd: int, cid: int, payload: Tensors, state: Tensors) -> str | None:
        """Round 1 (the initialization period): the initial model; every later round: the model and z̄^g, of the
        shape and dtype [C] gives it."""
        if rnd == 1:
            return super().payload_fits(rnd, cid, payload, state)
        server = self.init_server()
        return misfit(payload, {**specs(server), **self.view_groups([])[0]}, UNSENT)

    def view_groups(self, cids: list[int]) -> list[dict[str, Spec]]:
        """z̄^g, from the initialization period's end: of the shape and dtype [C] gives it."""
        return [{CONSENSUS: spec(_Consensus(self, self.init_server()).total)}]

    def reply_fits(self, payload: Tensors, reply: Tensors) -> str | None:
        """None if `reply` is what a client replies to `payload`, else why not: the model's entries as sent in a
        DBE round; in the initialization period the running mean alone, of one representation's shape and the
        model's float dtype (the server adds it into z̄^g: another shape would broadcast, another dtype promote)."""
        if CONSENSUS in payload:
            return misfit(reply, specs(payload, self.model_keys))
        dtype = next(v.dtype for v in payload.values() if v.is_floating_point())
        return misfit(reply, {RUNNING: (self.shape, dtype)})

    # --- evaluation ------------------------------------------------------------------------------------------
    def generic_model(self, server: Tensors) -> Predictor:
        return Predictor(self.ctx.model, self.model_params(server))

    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        params = {**{NET + k: v for k, v in self.model_params(server).items()}, PRBM: state[PRBM]}
        return Predictor(self.predictor, params, feature_key=("feddbe-body", Same(server)))

    def personalize(
        self, server: Tensors, data: ClientData, budget: Budget, generator: torch.Generator
    ) -> Iterator[Predictor]:
        """Deviation 7: "ft" DBE's local update from θ̄ and a zero memory; "lp" the library's linear probe."""
        if budget.method != "ft":
            yield from finetune_epochs(self.ctx.model, self.model_params(server), data, budget, generator)
            return
        zero = self.init_client(data.cid)[PRBM]
        for memory, _ in self.local_epochs(
                self.model_params(server), zero, server.get(CONSENSUS), data, generator, epochs=budget.epochs,
                batch_size=budget.batch_size, lr=budget.lr, prbm_lr=budget.lr, momentum=budget.momentum,
                weight_decay=0.0):  # fmt: skip
            params = {**{NET + k: v for k, v in get_params(self.ctx.model).items()}, PRBM: memory.detach().clone()}
            yield Predictor(self.predictor, params)


class _Consensus:
    """[C] on the server: z̄^g = Σ_i n_i·z̄_i^g / Σ_i n_i over the replies that arrive (training-set sizes, every
    client's, not only the round's sample); the model stays θ^0."""

    def __init__(self, algo: FedDBE, server: Tensors) -> None:
        self.fed, self.server = algo.ctx.federation, server
        self.total, self.n = torch.zeros(algo.shape, device=algo.ctx.device), 0.0

    def add(self, cid: int, reply: Tensors) -> None:
        n = float(self.fed.num_train(cid))
        self.total.add_(reply[RUNNING], alpha=n)
        self.n += n

    def result(self) -> Tensors:
        if not self.n:
            raise ValueError("no replies to average")
        return {**self.server, CONSENSUS: self.total / self.n}
