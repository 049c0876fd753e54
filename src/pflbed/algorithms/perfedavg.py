"""Per-FedAvg — Fallah, Mokhtari & Ozdaglar, "Personalized Federated Learning with Theoretical Guarantees: A
Model-Agnostic Meta-Learning Approach", NeurIPS 2020 (Algorithm 1, Eq. 3, §5).

Objective (Eq. 3): min_w (1/n) Σ_i f_i(w − α∇f_i(w)) — a meta-model from which one gradient step of size α on a
client's data is that client's model. A sampled client runs τ local steps from the global w; each step draws
independent batches D, D' (and D'' for HF):
- temporary model: w̃ = w − α ∇f_i(w; D);
- FO (first-order, §5 "Per-FedAvg (FO)"):  w ← w − β ∇f_i(w̃; D');
- HF (Hessian-free, §5 "Per-FedAvg (HF)"): w ← w − β (I − α ∇²f_i(w; D'')) ∇f_i(w̃; D'), the Hessian-vector
  product computed exactly by automatic differentiation.
The server averages the replies (|D_i|-weighted; the paper's clients are weighted equally). β = `train.lr`.

Personal model (P-FL): one (`personal_steps`) full-batch gradient step of size α on the client's own training data
from the meta-model — the paper's evaluation, deterministic here (full batch instead of a sampled one). G-FL scores
the meta-model. New clients (the FedBasis paper's Per-FedAvg+FT): fine-tune the meta-model (FT/LP).

The α-step of the personal model is taken in train mode, like the α-steps of training: Eq. 3 scores
f_i(w − α∇f_i(w)) with the same ∇f_i the local meta-updates differentiate through, so a step in eval mode would
adapt the meta-model by a map it was never trained for (the paper's MLPs have neither dropout nor BatchNorm, so it
does not say). What that means for such layers:
- dropout: each α-step draws its masks; they come from torch's global RNG seeded from (seed, stream 0x9EFA, client
  id) for the step and restored after it, so a client's personal model is a function of (server state, client
  data, seed) alone — the same in every executor, evaluation and process, whatever ran before. The round is not
  a key (the personal model is built from the server state, which already differs per round).
- BatchNorm: the gradient normalizes with the statistics of the client's training split (the full batch), as every
  training step normalizes with its batch's; the forward also moves the running statistics one momentum step
  (torch's default 0.1) toward that split's per α-step and counts the batch, and the personal model predicts
  with those running statistics: 0.9·the meta-model's + 0.1·the client's, a mild personalization of the
  statistics. The meta-model (server state) itself is never changed.

Choices: τ = `train.local_epochs` · ⌈n_i/B⌉ steps, the batches drawn from one shuffled stream (each step consumes
2 or 3 batches); plain SGD steps (the optimizer's momentum and weight decay are not used by the meta-update);
α defaults to 0.01 (the paper's α ∈ {0.001, 0.01}; choose on validation).

The local update is a plan (`sgd_plan`) whose one phase is `MetaStep`, a step rule (`local_sgd.StepRule`):
2τ (HF: 3τ) batches, that is `local_epochs` × 2 (3) whole epochs of the stream, each step taking its two (three).
`executor.batch_clients` trains a round's clients together; the loop runs the same rule with autograd.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from pflbed import rng
from pflbed.algorithms.base import ClientData, Predictor, Tensors
from pflbed.algorithms.fedavg import FedAvg
from pflbed.algorithms.local_sgd import Gradients, LocalSGDPlan, Phase
from pflbed.algorithms.training import get_params, load_params
from pflbed.search import Search, Space

PERSONAL_STREAM = 0x9EFA  # the personal α-step's dropout stream, apart from the engine's tags (1–4)


class PerFedAvgOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    search: ClassVar[dict[str, Space]] = {"alpha": Search(1e-4, 0.1, log=True)}  # β is train.lr, searched for all
    variant: Literal["fo", "hf"] = Field("fo", description="first-order, or Hessian-free (exact Hessian-vector)")
    alpha: float = Field(0.01, gt=0, description="α: the inner (personalization) step size")
    personal_steps: int = Field(1, ge=1, description="full-batch α-steps from the meta-model for a client's model")


class PerFedAvg(FedAvg):
    name = "perfedavg"
    Config = PerFedAvgOptions

    @staticmethod
    def unread_train(options: BaseModel) -> frozenset[str]:
        """The meta-update's plain SGD steps (choices)."""
        return frozenset({"momentum", "weight_decay"})

    def init_client(self, cid: int) -> Tensors:
        return {"cid": torch.tensor(cid, device=self.ctx.device)}  # the personal model needs the client's data

    def sgd_plan(self, payload: Tensors, state: Tensors, data: ClientData) -> LocalSGDPlan:
        """τ meta-steps (`MetaStep`) from the global w: 2τ (HF: 3τ) batches of one shuffled stream, whole epochs
        of it, since τ is `local_epochs` epochs of steps. The reply is w, the state kept."""
        t, model = self.ctx.cfg.train, self.ctx.model
        rule = MetaStep(self.opts.variant == "hf", self.opts.alpha, t.lr)
        phase = Phase(tuple(model.block_names()), rule.batches * t.local_epochs, t.lr, rule=rule)
        keys = list(model.state_dict())
        return LocalSGDPlan({k: payload[k] for k in keys}, (phase,), lambda p: ({k: p[k] for k in keys}, state))

    def _grad(self, data: ClientData, b: torch.Tensor) -> Tensors:
        """∇f on the samples `b` as they are (the personal adaptation's full batch)."""
        named = dict(self.ctx.model.named_parameters())
        loss = F.cross_entropy(self.ctx.model(data.x[b]), data.y[b])
        return dict(zip(named, torch.autograd.grad(loss, list(named.values())), strict=True))

    def adapted(self, server: Tensors, data: ClientData) -> Tensors:
        """The meta-model after `personal_steps` full-batch gradient steps of size α on `data`'s training set, in
        train mode; dropout masks from the (seed, client) stream, torch's global RNG restored afterwards."""
        model, dev = self.ctx.model, self.ctx.device
        load_params(model, server)
        model.train()
        named = dict(model.named_parameters())
        with rng.fork(dev):
            rng.seed_global(rng.derive_seed(self.ctx.seed, PERSONAL_STREAM, data.cid), dev)
            for _ in range(self.opts.personal_steps):
                g = self._grad(data, data.train)
                with torch.no_grad():
                    for k, p in named.items():
                        p.sub_(self.opts.alpha * g[k])
        return get_params(model)

    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        return Predictor(self.ctx.model, self.adapted(server, self.ctx.client_data(int(state["cid"]))))


@dataclass(frozen=True)
class MetaStep:
    """One local meta-step on batches D, D' (and D'' for HF), as a `local_sgd.StepRule`:
    w̃ = w − α∇f(w; D); w ← w − β∇f(w̃; D') (FO), or w ← w − β(I − α∇²f(w; D''))∇f(w̃; D') (HF)."""

    hf: bool
    alpha: float
    lr: float  # β

    @property
    def batches(self) -> int:
        return 3 if self.hf else 2

    @property
    def forwards(self) -> tuple[int, ...]:
        return (0, 1, 2) if self.hf else (0, 1)

    def __call__(self, grads: Gradients, params: Tensors) -> Tensors:
        w = params  # the model's parameters: the plan has no other tensor
        g = grads.grad(w, 0)  # ∇f(w; D)
        outer = grads.grad({k: w[k] - self.alpha * g[k] for k in w}, 1)  # ∇f(w̃; D')
        if self.hf:
            hv = grads.hvp(w, 2, outer)  # ∇²f(w; D'')·∇f(w̃; D')
            outer = {k: outer[k] - self.alpha * hv[k] for k in outer}
        return {k: w[k] - self.lr * outer[k] for k in w}
