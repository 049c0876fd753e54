"""FedAS — Yang, Huang & Ye, "FedAS: Bridging Inconsistency in Personalized Federated Learning", CVPR 2024
(pp. 11986–11995).

Source note: of the paper only the abstract could be read here. The method below is reconstructed from the authors'
official code (xiyuanyang45/FedAS, `clientas.py` / `serveras.py`, read, not copied), so no equation numbers are
given; the labels (PA), (LT), (FIM), (CS) are ours.

Model: a body f (the BlockNet body blocks, shared) and a head h (the head blocks). Each client keeps a whole local
model (f_i, h_i); the server keeps a whole global model θ^g = (f^g, h^g). The abstract's two parts:

Federated parameter alignment (PA): client i, sampled in round t, receives f^g and, before training,
  1. prototypes with its *old* local body (eval mode, no gradient), over its training samples:
        P_c = mean_{(x, y) ∈ D_i, y = c} f_i(x)   for every class c it holds;
  2. one epoch of plain SGD (lr η_PA) on f^g alone, the prototypes fixed, per mini-batch b:
        L_PA(f; b) = Σ_{c ∈ y_b} (1/|b_c|)·Σ_{x ∈ b_c} (1/d)·‖f(x) − P_c‖²                              (PA)
     (b_c: the batch's samples of class c; the code's MSELoss per class, summed over the classes of the batch);
  3. f_i ← the aligned f^g; its own head h_i is kept.
Local training (LT): E epochs of SGD on cross-entropy over the whole model (f_i, h_i).
Client synchronization (CS): after training, in eval mode, the trace of the empirical Fisher information over one
pass of its training data in mini-batches B_1 … B_m,
        F_i = Σ_j Σ_θ ‖∇_θ (1/|B_j|)·Σ_{(x, y) ∈ B_j} −log softmax(h_i(f_i(x)))_y‖²                     (FIM)
(not divided by the number of batches: it grows with the client's data), and the client replies (f_i, h_i, F_i).
The server replaces the sample-count weights by the Fisher weights, over the whole model (head included):
        θ^g = Σ_{i ∈ S_t} (F_i / Σ_{j ∈ S_t} F_j)·θ_i                                                  (CS)
P-FL scores each client's local model (f_i, h_i) after its last training (the code evaluates the same model at the
start of the next round); G-FL scores θ^g.

Choices and deviations:
  1. Independent alignment. Each sampled client aligns its own copy of the received f^g (what the paper's PA
     describes, and what the PFLlib port does since it copies the global model). The authors' repo passes the
     global model itself, so the k-th client of a round (in id order) aligns, and receives, a body the earlier
     clients already aligned; that chain is an artefact of a sequential simulation (it depends on client order
     and cannot run where clients train in parallel or on other machines) and is not offered.
  2. Batch sizes. PA runs on mini-batches of `train.batch_size` drawn from the client's generator (the code
     hard-codes 16 for PA; its own example runs with a local batch size of 16, where the two coincide). The FIM
     pass takes the client's training samples in their stored order in batches of `train.batch_size` (the code's
     loader: unshuffled in the authors' repo), the last batch smaller where the code drops it.
  3. Prototypes use every training sample, without augmentation (the code's loader drops the last incomplete
     batch of 16). Prototypes and F_i are computed in float32 even under `executor.precision: bf16`, F_i summed in
     float64.
  4. PA's SGD is plain (no momentum, no weight decay: the code's `SGD(lr=0.01)`); LT uses `train.*`.
  5. The server averages the whole state (BatchNorm statistics with the Fisher weights, integer counters by their
     maximum). Should Σ F_j not be a positive finite number (all gradients vanished; PFLlib issue #242 reports a
     NaN trace), the round falls back to the sample-count weights.
  6. The payload is f^g alone: the code sends the whole global model, of which a client reads only the body. f^g
     brings the body's BatchNorm statistics (the server's average), which replace the client's before alignment;
     the code's clients take parameters only and keep their own statistics (on a model with BatchNorm, a
     deviation; local training moves them again).
  7. Clients not sampled do nothing (the code computes their trace too, but only logs it).
  8. Ablations of the code as options: `align_epochs: 0` is its `--wo_local` (f^g installed unaligned) and
     `weighting: samples` its `--wo_global` (FedAvg's weights). Its unused `progress` and `yxy_hyper` are not
     reproduced.
  9. New clients (the code's new-client path fails): no previous model to align to; they start from θ^g, head
     included: zero-shot is θ^g, +FT/+LP fine-tune it (as for FedAvg).
Defaults, from the code: `align_epochs` 1, `align_lr` 0.01, `weighting` fisher. The update is a plan (`sgd_plan`:
the PA phase on the body, then the LT phase; prototypes before it, F_i in its `finish`), so
`executor.batch_clients` trains a round's clients together.

Client-level DP and SecAgg+ are refused: the server reads each reply's F_i, not only the mean of the models.
Site-local runs: the server state is the global model alone (no per-client entries); a site's F_i is checked to be
a finite non-negative number of the right type (`reply_fits`), its value cannot be checked.
"""

from __future__ import annotations

import math
from functools import partial
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from pflbed import compute
from pflbed.algorithms.base import Algorithm, ClientData, Context, Predictor, Tensors
from pflbed.algorithms.local_sgd import LocalSGDPlan, Phase, model_forward, run_blocks
from pflbed.algorithms.partial import subset
from pflbed.algorithms.reply_shapes import misfit, specs
from pflbed.algorithms.training import WeightedMean, load_params
from pflbed.models import BlockNet
from pflbed.search import IntSearch, Search, Space

FIM = "fim"  # the reply's Fisher-information trace F_i (a float64 scalar)


class FedASOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    search: ClassVar[dict[str, Space]] = {"align_lr": Search(1e-3, 0.1, log=True), "align_epochs": IntSearch(1, 5)}
    align_epochs: int = Field(1, ge=0, le=1000, description="epochs aligning the received body to the client's "
                              "prototypes (code: 1; 0: the body installed unaligned, --wo_local)")  # fmt: skip
    align_lr: float = Field(0.01, gt=0, le=10, description="SGD lr of the parameter alignment (code: 0.01)")
    weighting: Literal["fisher", "samples"] = Field(
        "fisher", description="server weights: fisher, each client's Fisher-information trace F_i (client "
        "synchronization); samples, its training-set size (FedAvg's, the code's --wo_global)")  # fmt: skip


class AlignmentObjective:
    """L_PA (PA) of a batch: per class of the batch, the mean over its samples of (1/d)·‖f(x) − P_c‖², summed over
    the classes; the prototypes `protos` (C × d) are the plan's constants. In the loop (`w` None) every sample
    counts 1; in a batched step its weight w (1/n on real samples, 0 on padding) — a class's mean is the same."""

    def __call__(
        self, model: BlockNet, params: Tensors, consts: Tensors, x: torch.Tensor, y: torch.Tensor,
        w: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        z = run_blocks(model, params, model.body_blocks(), x).flatten(1)
        protos = consts["protos"].to(z.dtype)
        err = ((z - protos[y]) ** 2).mean(1)  # per sample: the MSE to its class's prototype
        weight = torch.ones_like(err) if w is None else w.to(err.dtype)
        classes = torch.arange(len(protos), device=y.device)
        member = (y[:, None] == classes).to(err.dtype) * weight[:, None]  # B × C (no one_hot: vmap-safe)
        size = member.sum(0)
        per_class = (member * err[:, None]).sum(0) / torch.where(size > 0, size, torch.ones_like(size))
        return per_class.sum()


def class_prototypes(model: BlockNet, params: Tensors, data: ClientData, num_classes: int, rows: int = 1024
                     ) -> torch.Tensor:  # fmt: skip
    """P_c: the mean body output of the client's training samples of class c under `params` (eval mode, no
    gradient, float32); zero for a class it does not hold (never read: its batches hold no such sample)."""
    load_params(model, params)
    model.eval()
    x, y = data.x[data.train], data.y[data.train]
    with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
        z = torch.cat([model.features(x[i : i + rows]).flatten(1).float() for i in range(0, max(len(x), 1), rows)])
        member = (y[:, None] == torch.arange(num_classes, device=y.device)).to(z.dtype)
        size = member.sum(0)
        return (member.T @ z) / size.clamp_min(1.0)[:, None]


def fisher_trace(model: BlockNet, params: Tensors, data: ClientData, batch_size: int) -> torch.Tensor:
    """F_i (FIM): Σ over the batches of the client's training samples (stored order) of the squared norm of the
    gradient of the batch-mean negative log-likelihood, over every parameter; eval mode; a float64 scalar."""
    names = [k for k, _ in model.named_parameters()]
    leaves = {k: params[k].detach().clone().requires_grad_(True) for k in names}
    tensors = {**params, **leaves}
    total = torch.zeros((), dtype=torch.float64, device=data.x.device)
    model.eval()
    with torch.autocast(data.x.device.type, enabled=False):
        for b in data.train.split(batch_size):
            compute.add(len(b))  # one gradient computation per sample, as a training batch
            logits = model_forward(model, tensors, data.x[b])
            nll = -F.log_softmax(logits, dim=1).gather(1, data.y[b][:, None]).mean()
            grads = torch.autograd.grad(nll, [leaves[k] for k in names])
            total += sum(g.double().pow(2).sum() for g in grads)
    return total


class FisherMean:
    """θ = Σ_i F_i·θ_i / Σ_j F_j over the model's entries (CS), one reply at a time (an `Aggregator`): float entries
    accumulate F_i·θ_i in float64, integer ones (BatchNorm's counters) take the maximum. Beside it the sample-count
    mean, the result should Σ F_j not be positive and finite (choice 5)."""

    def __init__(self, keys: list[str], weights: dict[int, float]) -> None:
        self.keys = keys
        self.by_samples = WeightedMean(weights, keys)
        self.sums: Tensors = {}
        self.total = 0.0

    def add(self, cid: int, reply: Tensors) -> None:
        self.by_samples.add(cid, reply)
        f = float(reply[FIM])
        self.total += f
        if not self.sums:
            self.sums = {k: torch.zeros_like(reply[k], dtype=torch.float64) if reply[k].is_floating_point()
                         else reply[k].clone() for k in self.keys}  # fmt: skip
        for k in self.keys:
            acc = self.sums[k]
            if acc.is_floating_point():
                acc.add_(reply[k].double(), alpha=f)
            else:
                torch.maximum(acc, reply[k], out=acc)

    def result(self) -> Tensors:
        plain = self.by_samples.result()
        if not (math.isfinite(self.total) and self.total > 0):
            return plain
        return {k: (v / self.total).to(plain[k].dtype) if v.is_floating_point() else v for k, v in self.sums.items()}


class FedAS(Algorithm):
    name = "fedas"
    Config = FedASOptions
    dp_refused = "the server weights each client's model by the Fisher-information trace it replies, not a model entry"

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        m = ctx.model
        self.body, self.head = m.body_blocks(), m.head_blocks()
        self.body_keys, self.head_keys = m.state_keys(self.body), m.state_keys(self.head)
        self.keys = list(m.state_dict())
        self.num_classes = ctx.source.num_classes
        self.objective = AlignmentObjective()  # one object: a round's plans batch together

    def init_server(self) -> Tensors:
        return dict(self.ctx.initial_params)

    def init_client(self, cid: int) -> Tensors:
        return dict(self.ctx.initial_params)  # the local model a first-time client computes its prototypes with

    def configure(self, rnd: int, server: Tensors, cids: list[int]) -> dict[int, Tensors]:
        body = subset(server, self.body_keys)  # the global body: all a client reads (choice 6)
        return dict.fromkeys(cids, body)

    def sgd_plan(self, payload: Tensors, state: Tensors, data: ClientData) -> LocalSGDPlan:
        """Prototypes with the old local body (PA 1), then the PA phase (L_PA on the received body, plain SGD at
        η_PA: PA 2) and the LT phase (cross-entropy on the aligned body and the client's own head: PA 3, LT); the
        reply adds F_i of the trained model (`finish`)."""
        t, o = self.ctx.cfg.train, self.opts
        protos = class_prototypes(self.ctx.model, subset(state, self.body_keys), data, self.num_classes)
        phases = (Phase(tuple(self.body), o.align_epochs, o.align_lr, objective=self.objective, momentum=0.0,
                        weight_decay=0.0),
                  Phase(tuple(self.ctx.model.block_names()), t.local_epochs, t.lr))  # fmt: skip
        start = {**payload, **subset(state, self.head_keys)}
        return LocalSGDPlan(start, phases, partial(self.finish, data), consts={"protos": protos})

    def finish(self, data: ClientData, trained: Tensors) -> tuple[Tensors, Tensors]:
        """(the trained model and its F_i, the trained model as the client's new local model)."""
        model = {k: trained[k] for k in self.keys}
        fim = fisher_trace(self.ctx.model, model, data, self.ctx.cfg.train.batch_size)
        return {**model, FIM: fim}, dict(model)

    def aggregator(self, rnd: int, server: Tensors, weights: dict[int, float]) -> FisherMean | WeightedMean:
        if self.opts.weighting == "samples":
            return WeightedMean(weights, self.keys)
        return FisherMean(self.keys, weights)

    def reply_fits(self, payload: Tensors, reply: Tensors) -> str | None:
        """None if `reply` is what a client replies: the whole model (the body as sent, the head as the server
        holds it) and F_i, a finite non-negative float64 scalar (the server weights the model by it)."""
        head = specs(self.ctx.initial_params, self.head_keys)
        why = misfit(reply, {**specs(payload, self.body_keys), **head, FIM: ((), torch.float64)})
        if why is None and not (math.isfinite(f := float(reply[FIM])) and f >= 0):
            why = f"has '{FIM}' {f}, not a finite non-negative trace"
        return why

    def generic_model(self, server: Tensors) -> Predictor:
        return Predictor(self.ctx.model, server)

    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        return Predictor(self.ctx.model, state)
