"""FedALA — Zhang, Hua, Wang, Song, Xue, Ma & Guan, "FedALA: Adaptive Local Aggregation for Personalized Federated
Learning", AAAI 2023, 37(9):11237-11244 (arXiv 2212.01197: Algorithm 1; Eqs. 4-6 numbered as there, the
authors' poster's (2), (1), (3)).

FedAvg overwrites a client's model with the global one at the start of every round; FedALA instead aggregates the
two *locally*, with element-wise weights the client learns on its own data. Client i, sampled in round t, receives
the global model Θ^{t−1} and holds its local model Θ_i^{t−1} (its last trained one; Θ^0 until it trains). Its
locally initialized model is

    Θ̂_i^t = Θ_i^{t−1} + (Θ^{t−1} − Θ_i^{t−1}) ⊙ [1^{|Θ_i|−p}; W_i^p],                                      (Eq. 4)

the lower |Θ_i| − p layers taking the global model whole (weight 1) and the top p layers mixing the "update"
Θ^{t−1} − Θ_i^{t−1} in with one weight in [0, 1] per parameter entry, W_i^p. The weights learn on s% of the client's
training data D_i^{s,t}, drawn anew each round, by gradient steps on the cross-entropy of Θ̂_i^t, each followed by
a clip to [0, 1], Θ̂_i^t recomputed after every step:

    W_i^p ← clip_[0,1]( W_i^p − η ∇_{W_i^p} L(Θ̂_i^t, D_i^{s,t}; Θ^{t−1}) ),                                (Eq. 5)

i.e. Θ̂_i^t ← Θ̂_i^t − η (Θ^{t−1} − Θ_i^{t−1}) ⊙ (Θ^{t−1} − Θ_i^{t−1}) ⊙ ∇_{Θ̂_i} L on the top layers (Eq. 6,
before the clip). W_i^p starts at all ones (the first local aggregation is FedAvg's overwrite), persists from round
to round and is never reset: in the first aggregation that runs (the start phase) it trains to convergence, after
that one pass over the round's sample of data per round. In the first round ALA is off (Θ^0 = Θ_i^0: there is no
update to weigh). The client then trains Θ̂_i^t by E epochs of SGD into Θ_i^t, its reply and its new local model;
the server averages the replies as FedAvg does, Θ^t = Σ_i n_i/n · Θ_i^t. Exchanged: the same as FedAvg's.

Choices and deviations (sources: the authors' poster and slides, which quote the paper's equations, and their code,
TsingZ0/FedALA and PFLlib's `utils/ALA.py`, read only):
  1. p counts blocks from the top (`layers`, `BlockNet.top_blocks`), the paper's layers. The code counts parameter
     tensors (its `-p 2`, the last Linear's weight and bias, is p = 1 here). `layers: 0` learns no weight: Eq. 4 is
     then FedAvg's overwrite and, on a model without BatchNorm, the run is FedAvg's bit for bit (with it, the
     statistics stay the client's own, 2.); `layers` = every block is the code's `-p 0`.
  2. ALA mixes parameters (the paper's Θ). BatchNorm statistics, not parameters, stay the local model's own, as in
     the code, which overwrites, mixes and averages parameters only; the server averages the whole state (FedAvg's
     rule), so the generic model has averaged statistics, where the code's global model (a copy of the first
     reply with its parameters re-averaged) carries the first replying client's. This changes G-FL only.
  3. ALA is off while the received model equals the local one (every parameter): in the first round. The start
     phase then waits for the first aggregation that runs; a client first sampled later holds Θ^0 and runs it (as
     in the code). The code tests the signed sum of the first tensor's difference for zero.
  4. The sample of data: ⌊s·n_i/100⌋ samples (at least one) drawn at random from the client's generator each
     round, in random order, in mini-batches of `train.batch_size`, every sample used and the same batches on every
     pass (the paper: "randomly sample s% of local data"). The code takes a contiguous window at a random offset of
     its stored (once-shuffled) sample list, from Python's unseeded `random`.
  5. Convergence of the start phase, as the code tests it: after each pass the pass's last mini-batch loss is
     recorded; it stops once more than `num_pre_loss` are recorded and the population standard deviation of the
     last `num_pre_loss` is below `threshold`. `threshold` 0.01 is the paper's (the authors' README); the code's
     default 0.1 (what `main.py` runs) stops sooner: an option. The code has no cap and may never stop; here at
     most `max_start_epochs` passes.
  6. Only the round's sampled clients run ALA (the paper's Algorithm 1). The code runs it on every client every
     round, replacing the local models of clients that do not train as well; the engine updates sampled clients
     only, so that is not offered (the two agree with every client sampled, the paper's experiments).
  7. The weights' forward runs in training mode (the code's temporary model is a copy of the local model, last in
     training mode): BatchNorm normalizes with batch statistics, whose move of the running ones is discarded, and
     dropout draws from the client's seeded stream. Lower layers run without gradients (frozen, as in the code);
     in the start phase their output of each batch is computed once where every pass would give the same (no
     dropout below the top blocks, no augmentation), which makes its many passes cost little more than one.
  8. P-FL (`personal`). The code reports Θ̂_i^t, the locally aggregated model before training, at the start of the
     next round. Evaluation here reads the server's and the client's states only (no data), so `initialized`
     (default) scores Eq. 4 on the current global model with the client's last learned W_i^p — the model the
     client would start its next round from, but for that round's one pass of Eq. 5; a client with no weights yet
     gets the global parameters (W = 1). `trained` scores the client's trained model Θ_i^t (Θ^0 if it never
     trained), the model it holds at the end of a round. G-FL scores the global model.
  9. New clients (the paper defines none): a new client's local model would be the global one, so Eq. 4 gives Θ
     whatever W: zero-shot is the global model and +FT/+LP fine-tune it, as for FedAvg.
Defaults from the paper and the code: s = 80 (`rand_percent`), p = 1, η = 1.0, `num_pre_loss` 10 (code),
threshold 0.01 (paper); local training is `train.*` (the paper: batch 10, lr 0.005, E = 1).

The client update is a plan (`round_plan`): the weights are learned client by client (a convergence test sets how
many passes), from the client's generator and torch's global RNG, and the E epochs of local SGD that follow are the
plan, which `executor.batch_clients` trains with the round's other clients, going on from the client's streams
where the weight learning left them (the loop's draws).
Client-level DP applies (the replies are new values of the global model's entries, averaged: FedAvg's
`dp_refused`); the server state holds no per-client entries (a site-local run sends every site all of it).
"""

from __future__ import annotations

import statistics
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from pflbed import compute
from pflbed.algorithms.base import Algorithm, ClientContext, ClientData, Context, Predictor, Same, Tensors
from pflbed.algorithms.fedavg import FedAvg
from pflbed.algorithms.local_sgd import LocalSGDPlan, Phase, run_blocks
from pflbed.errors import ConfigError
from pflbed.search import Choice, IntSearch, Search, Space

WEIGHT = "ala/"  # client state: W_i^p, one tensor per top-layer parameter, under ala/<parameter key>


class FedALAOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # the paper's ablations: s 5-100, p 1-6 (best 1-2); η 1
    search: ClassVar[dict[str, Space]] = {"rand_percent": IntSearch(5, 100), "layers": Choice([1, 2]),
                                          "eta": Search(0.1, 10.0, log=True)}  # fmt: skip
    rand_percent: int = Field(80, ge=1, le=100, description="s: percent of the client's training data the weights "
                              "learn on, drawn anew each round (paper 80)")  # fmt: skip
    layers: int = Field(1, ge=0, description="p: top blocks whose parameters mix the global model in by learned "
                        "weights; the lower blocks take it whole (paper 1; 0: FedAvg)")  # fmt: skip
    eta: float = Field(1.0, ge=0, description="η: learning rate of the aggregation weights (paper 1.0)")
    threshold: float = Field(0.01, gt=0, description="start phase: stop once the std of the last num_pre_loss "
                             "recorded losses is below this (paper 0.01; the code's default 0.1)")  # fmt: skip
    num_pre_loss: int = Field(10, ge=2, description="start phase: how many recorded losses the std covers (code 10)")
    max_start_epochs: int = Field(100, ge=1, description="start phase: at most this many passes over the sample "
                                  "(the code has no cap)")  # fmt: skip
    personal: Literal["initialized", "trained"] = Field(
        "initialized", description="P-FL model: Eq. 4 on the current global model with the client's learned "
        "weights (the code's evaluated model), or the client's trained local model")  # fmt: skip


class FedALA(FedAvg):
    name = "fedala"
    Config = FedALAOptions
    sgd_plan = Algorithm.sgd_plan

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        m, p = ctx.model, self.opts.layers
        names = m.block_names()
        if p > len(names):
            raise ConfigError(f"algorithm.layers: the model has {len(names)} blocks; choose 0 to {len(names)} "
                              f"(got {p})")  # fmt: skip
        self.top_blocks = m.top_blocks(p)
        self.lower_blocks = [b for b in names if b not in set(self.top_blocks)]
        params = [k for k, _ in m.named_parameters()]
        top = set(m.state_keys(self.top_blocks))
        self.params = params
        self.top = [k for k in params if k in top]  # the parameters W_i^p weighs
        self.lower = [k for k in params if k not in top]  # taken from the global model whole
        self.buffers = [k for k in m.state_dict() if k not in set(params)]  # the local model's own
        # Without dropout below the top and without augmentation, the lower blocks' output of a batch is the same on
        # every pass (BatchNorm normalizes by the batch's own statistics): the start phase computes it once.
        self.fixed_lower = ctx.augment is None and not any(
            isinstance(mod, torch.nn.Dropout) for b in self.lower_blocks for mod in m.blocks[b].modules())  # fmt: skip
        body_buffers = set(self.buffers) & set(m.state_keys(m.body_blocks()))
        # With p = the head and no statistics in the body, every client's body is the global one: evaluation
        # computes its features once.
        self.shared_body = self.top_blocks == m.head_blocks() and not body_buffers

    def init_client(self, cid: int) -> Tensors:
        return {}  # no model of its own yet: its local model is Θ^0 (`local_model`)

    def local_model(self, state: Tensors) -> Tensors:
        """Θ_i: the client's last trained model; Θ^0, the model every client starts from, before it trains."""
        return {k: state[k] for k in self.ctx.initial_params} if self.params[0] in state else self.ctx.initial_params

    def weights(self, state: Tensors) -> Tensors | None:
        """W_i^p from the client's state; None before its first local aggregation."""
        return {k: state[WEIGHT + k] for k in self.top} if self.top and WEIGHT + self.top[0] in state else None

    def aggregated(self, glob: Tensors, local: Tensors, weights: Tensors | None) -> Tensors:
        """Eq. 4: the lower parameters the global model's, the top ones Θ_i + (Θ − Θ_i) ⊙ W_i^p; without weights yet
        (W = 1) the global parameters; the statistics the local model's (choice 2)."""
        out = {**{k: glob[k] for k in self.params}, **{k: local[k] for k in self.buffers}}
        if weights is not None:
            out.update({k: local[k] + (glob[k] - local[k]) * weights[k] for k in self.top})
        return out

    def round_plan(self, payload: Tensors, state: Tensors, data: ClientData, cctx: ClientContext) -> LocalSGDPlan:
        """ALA (Eq. 5, the weights learned here, client by client, from the client's generator), then E epochs of
        local SGD from Θ̂_i^t (Eq. 4) as the plan; the reply Θ_i^t, the new state Θ_i^t and W_i^p."""
        local = self.local_model(state)
        weights = self.weights(state)
        if self.top and not all(torch.equal(payload[k], local[k]) for k in self.params):
            weights = self.learn_weights(payload, local, weights, data, cctx.generator)
        kept = {WEIGHT + k: v for k, v in weights.items()} if weights is not None else {}
        t, every = self.ctx.cfg.train, tuple(self.ctx.model.block_names())
        return LocalSGDPlan(self.aggregated(payload, local, weights), (Phase(every, t.local_epochs, t.lr),),
                            lambda trained: (trained, {**trained, **kept}))  # fmt: skip

    def learn_weights(
        self, glob: Tensors, local: Tensors, weights: Tensors | None, data: ClientData, generator: torch.Generator
    ) -> Tensors:
        """Eq. 5 on ⌊s·n_i/100⌋ samples drawn from `generator`: from all ones to convergence in the start phase
        (`weights` None), else one pass from the client's weights. Returns the new W_i^p."""
        o, model, t = self.opts, self.ctx.model, self.ctx.cfg.train
        start_phase = weights is None
        w = {k: torch.ones_like(glob[k]) for k in self.top} if start_phase else dict(weights)
        n = data.num_train
        if n == 0:
            return w
        size = max(1, n * o.rand_percent // 100)
        sample = data.train[torch.randperm(n, generator=generator, device=generator.device)[:size]]
        batches = sample.split(t.batch_size)
        update = {k: glob[k] - local[k] for k in self.top}  # Θ − Θ_i, the paper's "update"
        # the lower layers: the global model's, frozen; statistics: a copy of the local model's, which the training
        # mode forwards move and which is then dropped
        fixed = {**{k: glob[k] for k in self.lower}, **{k: local[k].clone() for k in self.buffers}}
        losses: list[float] = []
        seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # batch → (lower blocks' output, labels)
        keep = start_phase and self.fixed_lower
        model.train()
        for _ in range(o.max_start_epochs if start_phase else 1):
            for i, b in enumerate(batches):
                compute.add(len(b))
                if i in seen:
                    z, y = seen[i]
                else:
                    x, y = data.batch(b, generator)
                    with torch.no_grad():
                        z = run_blocks(model, fixed, self.lower_blocks, x)
                    if keep:
                        seen[i] = z, y
                leaf = {k: v.detach().requires_grad_(True) for k, v in w.items()}
                mixed = {k: local[k] + update[k] * leaf[k] for k in self.top}
                loss = F.cross_entropy(run_blocks(model, {**fixed, **mixed}, self.top_blocks, z), y)
                grads = torch.autograd.grad(loss, [leaf[k] for k in self.top])
                with torch.no_grad():
                    w = {k: (w[k] - o.eta * g).clamp(0.0, 1.0) for k, g in zip(self.top, grads, strict=True)}
            losses.append(float(loss.detach()))  # the pass's last mini-batch loss (choice 5)
            recent = losses[-o.num_pre_loss :]
            if len(losses) > o.num_pre_loss and statistics.pstdev(recent) < o.threshold:
                break
        return w

    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        local = self.local_model(state)
        if self.opts.personal == "trained":
            return Predictor(self.ctx.model, local)
        key = ("fedala-body", Same(server)) if self.shared_body else None
        return Predictor(self.ctx.model, self.aggregated(server, local, self.weights(state)), key)
