"""pFedHN — Shamsian, Navon, Fetaya & Chechik, "Personalized Federated Learning using Hypernetworks", ICML 2021
(arXiv 2103.04628; §3, Algorithm 1, §5.3 generalization to novel clients).

A server-side hypernetwork h(·; φ) maps a learned client embedding v_i to the whole target network of client i,
θ_i = h(v_i; φ), and φ, v_1 … v_n minimize Σ_i L_i(h(v_i; φ)) (the paper's objective). Nothing of φ ever leaves the
server: clients receive θ_i and send back a parameter delta, so communication is the target model's size.

Algorithm 1, one step: sample client i; θ_i = h(v_i; φ), θ̃_i = θ_i; K local steps θ̃_i ← θ̃_i − η∇L_i(B) on
mini-batches B; Δθ_i = θ̃_i − θ_i; (line 10) φ ← φ − α(∇_φ θ_i)ᵀ·(direction from Δθ_i); (line 11) v_i likewise
through the chain rule. Here, per engine round:

- `configure`: θ_i = h(v_i; φ) for every sampled client i, each from its own embedding (per-client payloads: the
  target network's parameters, nothing else).
- `client_update`: K = `local_steps` (default 50) mini-batch SGD steps on the client's training data from θ_i, with
  `train.lr`, `train.momentum`, `train.weight_decay`, `train.batch_size` (a fresh optimizer per round); batches come
  epoch after epoch from `training.index_batches` with the client's generator (an epoch reshuffles, the steps stop
  after K batches). `local_steps: null` runs `train.local_epochs` epochs instead. The update is a plan
  (`sgd_plan`, a phase of K steps: `local_sgd.Phase.steps`), so `executor.batch_clients` trains a round's clients
  together. Reply: Δθ_i = θ̃_i − θ_i under the parameter names.
- `aggregate`: θ_i = h(v_i; φ) is recomputed with the autograd graph and the vector–Jacobian product
  g = (∂θ_i/∂(φ, v_i))ᵀ·(θ_i − θ̃_i) = −Jᵀ·Δθ_i gives the gradient of φ and of v_i; the hypernetwork optimizer then
  steps both (SGD with momentum and weight decay, below).

Sign (interpretation 1). g is the gradient of the surrogate ½‖h(v_i; φ) − θ̃_i‖² at the current (φ, v_i), so a
descent step moves the generated θ_i toward the client's trained θ̃_i; with K = 1 plain full-batch SGD,
Δθ_i = −η∇_θ L_i and g = η·∇_{φ,v_i} L_i(h(v_i; φ)), the exact chain-rule gradient (§3's motivation). Algorithm 1
as printed, φ − α(∇_φθ_i)ᵀΔθ_i with Δθ_i = θ̃_i − θ_i, would step away from θ̃_i; the authors' code feeds
θ_i − θ̃_i to autograd, as here. Line 11's "(∇_{v_i}φ)ᵀ(∇_φθ_i)ᵀΔθ_i" is read as the chain rule through θ_i,
(∇_{v_i}θ_i)ᵀ, which is what the authors' code computes (v_i are rows of the hypernetwork's embedding table).

Interpretations and deviations:
1. The update direction, above.
2. Several clients per round (the paper takes one client per step; with one client per round both modes are
   Algorithm 1 exactly). `combine: mean` (default): every reply's vector–Jacobian product at the round's φ; φ
   takes one step on their uniform mean (mini-batch SGD over clients: in expectation the paper's step), and each
   replying v_i one step on its own gradient (v_i enters only client i's term: line 11 for that client, not
   diluted by the number of clients). `combine: sequential`: one Algorithm 1 step per reply in increasing client
   id, each at the φ the previous one left, with the Δθ_i the client computed from the round's θ_i. All of a
   round's Δθ_i were computed from the same φ, so sequential steps apply stale deltas, and with momentum they
   compound. Measured (digits, LeNet-5, 16 participated clients, 8 per round, train.lr 0.05, K = 50, seed 0):
   sequential diverged in round 3; mean reached P-FL 0.47 after 20 rounds (hn_lr 0.03 and 0.05 learned faster,
   then diverged by round 20); one client per round (Algorithm 1 proper) reached 0.90 after 80 rounds. The
   engine's |D_i| weights are not used (the paper samples clients uniformly). Lost replies (Flower) are absent.
3. Hypernetwork optimizer: SGD, lr α = `hn_lr` 0.01, momentum 0.9, weight decay 1e-3 on φ and on the embeddings,
   the embeddings at `embed_lr` (default α) — the authors' released code (experiments/pfedhn/trainer.py defaults:
   --lr 1e-2, --wd 1e-3, SGD momentum 0.9, --embed-lr defaulting to --lr). The momentum buffers are server state
   (`mom.*`, zeros at the start: a zero buffer makes the first step torch's SGD first step), so a checkpoint holds
   the optimizer and `--resume` continues it. Deviation: the code steps the whole embedding table every step
   (weight decay and momentum also move clients that did not train); here a client's v_i and its momentum row move
   only in the steps that use its reply — only replying clients' embeddings change.
4. Architecture (§3 and §5 of the paper, the code's CNNHyper): v_i ∈ R^d, an MLP of `hidden_layers` = 3 hidden
   layers of `hidden` = 100 ReLU units, then one linear head per target-network parameter tensor, each reshaped to
   the tensor's shape. The code's trunk has one more linear layer without activation before the heads (composing
   with the linear heads); here each hidden layer is Linear + ReLU. d = `embed_dim`, default ⌊1 + n/4⌋ with n the
   number of participated clients (the code's `embed_dim = int(1 + num_nodes / 4)`). Size: the heads dominate,
   (hidden + 1)·|θ|; LeNet-5 on 28×28 inputs (|θ| = 61,706), 100 clients (d = 26), hidden 100: 6,255,206
   hypernetwork parameters (≈ 101·|θ|; FedBasis §4.3 quotes Q = 100|θ|) plus as many momentum entries — ≈ 50 MB of
   server state. `diagnostics` reports the count for the run's model (`hypernet_params`); `hidden` shrinks it.
   ResNet-18 (|θ| ≈ 11.2 M) at hidden 100 makes 1.13 G parameters (4.5 GB per copy); a server's round holds about
   ten copies at its peak (measured on the MLP). A hypernetwork of which even four copies exceed the server's
   memory (`pflbed.memory`) is refused in one line before the run starts, not killed by the system mid-run.
5. Initialization: every layer with PyTorch's default Linear init, the embeddings N(0, 1) (the code's
   nn.Embedding); both drawn on the CPU from pFedHN's own streams (seed, STREAM, 0) and (seed, STREAM, 1), moved to
   `ctx.device`. The target network's initial parameters (`ctx.initial_params`) are not used: θ_i comes from h.
   Extension (not in the paper), `start: initial_model`: each head's weight starts at zero and its bias at the
   target network's initial tensor, so h(v; φ⁰) = θ⁰ for every v — the hypernetwork starts by generating the run's
   initial model, e.g. a pretrained body (`model.init_from`), which the paper's init would overwrite with noise.
   The first step moves only the heads' weights (their gradient is −Δθ·fᵀ, the trunk's and v's pass through the
   zero weights); from the second step on, all of φ and v learn.
6. K = `local_steps` 50: the code's --inner-steps default. The code's inner optimizer (lr 5e-3, momentum 0.9,
   weight decay 5e-5, batch 64) is the run's `train.*` here, as for every algorithm: set those to reproduce it.
   The code draws every inner batch afresh (`next(iter(loader))`, with replacement across steps) and clips
   gradient norms at 50 on both sides; neither is part of Algorithm 1 — not done here.
7. BatchNorm statistics (models with buffers; the paper's LeNet has none) are not generated: each client keeps
   its own, from the initial model's, in its state (`buf.<name>`), never uploaded, and its personal model uses
   them. New clients start from the initial model's buffers.
8. Evaluation. P-FL of client i: h(v_i; φ) with its current embedding (a client never sampled: its initial one).
   G-FL: none (the method has no global model; `generic_model` is None), so `eval.finetune` does not run: the
   engine fine-tunes participated clients only from a generic model.
9. New clients (`personalize`, `zero_shot`; §5.3: a novel client learns only its embedding, φ frozen):
   - start embedding `new_embedding_init`: `mean` (default) of the participated clients' embeddings, or `random`
     (a fresh N(0, 1) draw from (seed, STREAM, 2, client)). Called with a participated client's data,
     `personalize` would start from that client's own embedding — a path the engine never takes (see 8).
     `zero_shot` = h(start; φ).
   - `new_client: embedding` (default; the FedBasis paper's "pFedHN" row): `budget.epochs` epochs of mini-batch
     SGD on the client's cross-entropy of h(v; φ) with respect to v only (φ detached, never written), lr
     `new_embed_lr` (default `budget.lr`), `budget.momentum`, no weight decay, batches from the given generator;
     one model per epoch. `budget.method` is ignored: the ft and lp rows are the same procedure.
   - `new_client: embedding+tune` (the FedBasis paper's "pFedHN+FT" / "pFedHN+LP" rows): the same embedding phase
     for `new_embed_epochs` epochs (default `budget.epochs`), not reported, then `budget.method` from
     h(v*; φ) for `budget.epochs` epochs with `training.finetune_epochs` — "ft" every target parameter, "lp" the
     head on frozen features — one model per epoch of that phase.

Site-local runs (`sites.local`): the server state (φ, the embeddings, the momentum) stays on the server. A site
evaluating its clients receives only their θ_i = h(v_i; φ) (`server_view`), what their training payloads carry:
with φ and another client's embedding it could generate that client's model. pFedHN has no generic model, so no
final +FT/+LP runs on the sites.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from torch.func import functional_call

from pflbed import rng
from pflbed.algorithms.base import Algorithm, Budget, ClientData, Context, Predictor, Tensors
from pflbed.algorithms.local_sgd import LocalSGDPlan, Phase
from pflbed.algorithms.reply_shapes import UNSENT, misfit, specs
from pflbed.algorithms.sgd import SGD
from pflbed.algorithms.training import finetune_epochs, get_params, index_batches
from pflbed.memory import check_fits
from pflbed.search import Search, Space

if TYPE_CHECKING:
    pass  # annotations only

STREAM = 0x9FED  # pFedHN's own random streams (not one of pflbed.rng's tags): 0 φ, 1 embeddings, 2 new clients
HN = "hn."  # server state: φ under hn.<hypernetwork parameter>
EMB = "emb"  # server state: the participated clients' embeddings, one row each (sorted client ids)
MOM = "mom."  # server state: momentum buffers, mom.hn.<…> and mom.emb
THETA = "theta/"  # a site's view of the server state: theta/<cid>/<parameter>, its own clients' θ_i = h(v_i; φ)
BUF = "buf."  # client state: the client's own buffers (BatchNorm statistics), buf.<model buffer>


class PFedHNOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    search: ClassVar[dict[str, Space]] = {"hn_lr": Search(1e-3, 0.1, log=True)}
    embed_dim: int | None = Field(None, ge=1, le=100_000, description="d of v_i (default ⌊1 + n/4⌋, n clients)")
    hidden: int = Field(100, ge=1, le=100_000, description="units per hidden layer of the hypernetwork")
    hidden_layers: int = Field(3, ge=1, le=100, description="hidden layers (Linear + ReLU) before the heads")
    local_steps: int | None = Field(50, ge=1, le=10_000_000, description="K local SGD steps (null: epochs)")
    hn_lr: float = Field(0.01, gt=0, description="α: SGD lr of the hypernetwork φ")
    hn_momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum of φ and the embeddings")
    hn_weight_decay: float = Field(1e-3, ge=0, description="SGD weight decay of φ and the embeddings")
    embed_lr: float | None = Field(None, gt=0, description="SGD lr of the embeddings v_i (default hn_lr)")
    combine: Literal["mean", "sequential"] = Field("mean", description="several replies in one round (note 2)")
    start: Literal["random", "initial_model"] = Field(
        "random", description="φ⁰: the paper's random init, or heads generating the initial model (note 5)"
    )
    new_client: Literal["embedding", "embedding+tune"] = Field(
        "embedding", description="new clients: learn v only, or v then budget.method (ft / lp) from h(v)"
    )
    new_embedding_init: Literal["mean", "random"] = Field("mean", description="a new client's starting v")
    new_embed_lr: float | None = Field(None, gt=0, description="lr of a new client's v (default budget.lr)")
    new_embed_epochs: int | None = Field(
        None, ge=1, le=100_000, description="embedding+tune: epochs of the embedding phase (default budget.epochs)"
    )


class HyperNetwork(nn.Module):
    """h(v; φ): embeddings (m × d) → every parameter tensor of the target network, batched (m × shape)."""

    def __init__(self, shapes: dict[str, torch.Size], embed_dim: int, hidden: int, hidden_layers: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = embed_dim
        for _ in range(hidden_layers):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        self.trunk = nn.Sequential(*layers)
        self.shapes = dict(shapes)
        # one linear head per target tensor; module names cannot hold dots
        self.heads = nn.ModuleDict({_head(k): nn.Linear(hidden, math.prod(s)) for k, s in self.shapes.items()})

    @staticmethod
    def size(shapes: dict[str, torch.Size], embed_dim: int, hidden: int, hidden_layers: int) -> int:
        """The parameters `HyperNetwork(shapes, embed_dim, hidden, hidden_layers)` holds, without building it."""
        trunk = (embed_dim + 1) * hidden + (hidden_layers - 1) * (hidden + 1) * hidden
        return trunk + sum((hidden + 1) * math.prod(s) for s in shapes.values())

    def forward(self, v: torch.Tensor) -> Tensors:
        f = self.trunk(v)
        return {k: self.heads[_head(k)](f).reshape(len(v), *s) for k, s in self.shapes.items()}


def _head(name: str) -> str:
    return name.replace(".", "_")


def sgd_step(
    p: torch.Tensor, g: torch.Tensor, buf: torch.Tensor, lr: float, momentum: float, weight_decay: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.optim.SGD's step (no dampening, no Nesterov), out of place: (new p, new momentum buffer). The buffer
    starts at zero, which makes the first step torch's (its first buffer is the gradient itself)."""
    d = torch.add(g, p, alpha=weight_decay) if weight_decay else g
    buf = buf * momentum + d if momentum else d
    return p - lr * buf, buf


def own_buffers(state: Tensors) -> Tensors:
    """A client's buffers (BatchNorm statistics) from its state, under the model's names (note 7)."""
    return {k[len(BUF) :]: v for k, v in state.items() if k.startswith(BUF)}


class PFedHN(Algorithm):
    name = "pfedhn"
    dp_refused = "the server holds each client's embedding and trains its hypernetwork on each client's own update"
    Config = PFedHNOptions

    @staticmethod
    def unread_train(options: PFedHNOptions) -> frozenset[str]:
        """K = `local_steps` steps replace `train.local_epochs`, which only `local_steps: null` reads."""
        return frozenset({"local_epochs"}) if options.local_steps is not None else frozenset()

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        o = self.opts
        self.rows = {c: i for i, c in enumerate(sorted(ctx.federation.participated))}
        self.embed_dim = o.embed_dim or int(1 + len(self.rows) / 4)
        self.param_names = [k for k, _ in ctx.model.named_parameters()]
        self.buffer_names = [k for k in ctx.initial_params if k not in set(self.param_names)]
        self._hyper: HyperNetwork | None = None  # built on first use: clients (workers) never need it

    # --- the hypernetwork ------------------------------------------------------------------------------------
    @property
    def hyper(self) -> HyperNetwork:
        """The hypernetwork module, its initial φ drawn from (seed, STREAM, 0) on the CPU (note 5)."""
        if self._hyper is None:
            shapes = {k: self.ctx.initial_params[k].shape for k in self.param_names}
            o = self.opts  # refused here, where it is built (the server's `init_server`), not where it is never used
            check_fits(HyperNetwork.size(shapes, self.embed_dim, o.hidden, o.hidden_layers), self.ctx.device,
                       "pfedhn's hypernetwork", "algorithm.hidden, algorithm.hidden_layers and algorithm.embed_dim")
            with rng.fork(self.ctx.device), torch.device("cpu"):
                torch.manual_seed(rng.derive_seed(self.ctx.seed, STREAM, 0))
                hyper = HyperNetwork(shapes, self.embed_dim, self.opts.hidden, self.opts.hidden_layers)
            if self.opts.start == "initial_model":  # h(v; φ⁰) = θ⁰ for every v (note 5)
                with torch.no_grad():
                    for k in self.param_names:
                        hyper.heads[_head(k)].weight.zero_()
                        hyper.heads[_head(k)].bias.copy_(self.ctx.initial_params[k].flatten())
            self._hyper = hyper.to(self.ctx.device)
        return self._hyper

    def num_hyper_params(self) -> int:
        return sum(p.numel() for p in self.hyper.parameters())

    def phi(self, server: Tensors) -> Tensors:
        return {k[len(HN) :]: v for k, v in server.items() if k.startswith(HN)}

    def theta(self, phi: Tensors, v: torch.Tensor) -> list[Tensors]:
        """h(v_j; φ) for the rows v_j of `v` (m × d), with whatever graph φ and v carry."""
        out = functional_call(self.hyper, phi, (v,))
        return [{k: out[k][j] for k in self.param_names} for j in range(len(v))]

    def generate(self, server: Tensors, v: torch.Tensor) -> Tensors:
        """θ = h(v; φ) of one embedding, detached: a target-network parameter dict that owns its storage."""
        with torch.no_grad():
            return {k: t.clone() for k, t in self.theta(self.phi(server), v[None])[0].items()}

    def embedding(self, server: Tensors, cid: int) -> torch.Tensor:
        """Client `cid`'s embedding: its row for a participated client, else the new-client start (note 9)."""
        if cid in self.rows:
            return server[EMB][self.rows[cid]]
        if self.opts.new_embedding_init == "mean":
            return server[EMB].mean(0)
        gen = rng.generator(self.ctx.seed, STREAM, 2, cid)
        return torch.randn(self.embed_dim, generator=gen, device=gen.device).to(self.ctx.device)

    def initial_buffers(self) -> Tensors:
        return {k: self.ctx.initial_params[k].clone() for k in self.buffer_names}

    # --- federation ------------------------------------------------------------------------------------------
    def init_server(self) -> Tensors:
        phi = {HN + k: v for k, v in get_params(self.hyper).items()}
        gen = rng.generator(self.ctx.seed, STREAM, 1)
        emb = torch.randn(len(self.rows), self.embed_dim, generator=gen, device=gen.device).to(self.ctx.device)
        server = {**phi, EMB: emb}
        return {**server, **{MOM + k: torch.zeros_like(v) for k, v in server.items()}}

    def init_client(self, cid: int) -> Tensors:
        state = {"cid": torch.tensor(cid, device=self.ctx.device)}
        return {**state, **{BUF + k: v for k, v in self.initial_buffers().items()}}

    def configure(self, rnd: int, server: Tensors, cids: list[int]) -> dict[int, Tensors]:
        if not cids:
            return {}
        emb = server[EMB]
        v = emb[torch.tensor([self.rows[c] for c in cids], device=emb.device)]
        with torch.no_grad():
            thetas = self.theta(self.phi(server), v)
        return {c: {k: t.clone() for k, t in theta.items()} for c, theta in zip(cids, thetas, strict=True)}

    def payload_fits(self, rnd: int, cid: int, payload: Tensors, state: Tensors) -> str | None:
        """The client's generated weights θ_i = h(v_i; φ): the target network's parameters (not its buffers),
        from the model's shapes; the default would build the hypernetwork on every site, which never needs it."""
        return misfit(payload, specs(self.ctx.initial_params, self.param_names), UNSENT)

    def view_fits(self, view: Tensors, cids: list[int]) -> str | None:
        """Each client's generated weights (`theta/<cid>/`, as its payload: `server_view`), from the model's shapes:
        the default would build the hypernetwork and run it for every client of the site."""
        theta = specs(self.ctx.initial_params, self.param_names)
        return misfit(view, {f"{THETA}{c}/{k}": s for c in cids if c in self.rows for k, s in theta.items()}, UNSENT)

    def sgd_plan(self, payload: Tensors, state: Tensors, data: ClientData) -> LocalSGDPlan:
        """K = `local_steps` mini-batch SGD steps from θ_i (epoch after epoch, reshuffled every epoch, the last cut
        short; `train.local_epochs` epochs with `local_steps: null`), the client's own buffers loaded (note 7); the
        reply is Δθ_i = θ̃_i − θ_i. K epochs bound K steps for any client with data (each epoch has a batch), so
        every client's plan has the same shape."""
        t, k = self.ctx.cfg.train, self.opts.local_steps
        epochs = t.local_epochs if k is None else k if data.num_train else 0
        phase = Phase(tuple(self.ctx.model.block_names()), epochs, t.lr, steps=k)
        return LocalSGDPlan({**payload, **own_buffers(state)}, (phase,), partial(self._finish, payload, state))

    def _finish(self, payload: Tensors, state: Tensors, trained: Tensors) -> tuple[Tensors, Tensors]:
        reply = {k: trained[k] - payload[k] for k in self.param_names}  # Δθ_i = θ̃_i − θ_i
        return reply, {"cid": state["cid"], **{BUF + k: trained[k] for k in self.buffer_names}}

    def hyper_gradient(self, phi: Tensors, v: torch.Tensor, delta: Tensors) -> tuple[Tensors, torch.Tensor]:
        """(∂θ/∂φ)ᵀ(θ − θ̃) and (∂θ/∂v)ᵀ(θ − θ̃) at (φ, v), θ − θ̃ = −Δθ: the gradients of ½‖h(v; φ) − θ̃‖²."""
        phi = {k: p.detach().requires_grad_() for k, p in phi.items()}
        v = v.detach().requires_grad_()
        theta = self.theta(phi, v[None])[0]
        grads = torch.autograd.grad([theta[k] for k in self.param_names], [*phi.values(), v],
                                    grad_outputs=[-delta[k] for k in self.param_names])  # fmt: skip
        return dict(zip(phi, grads[:-1], strict=True)), grads[-1]

    def aggregate(self, rnd: int, server: Tensors, replies: dict[int, Tensors], weights: dict[int, float]) -> Tensors:
        o = self.opts
        cids = sorted(replies)
        if not cids:
            return server
        lr_v = o.embed_lr if o.embed_lr is not None else o.hn_lr
        sgd = dict(momentum=o.hn_momentum, weight_decay=o.hn_weight_decay)
        phi = self.phi(server)
        mom = {k: server[MOM + HN + k] for k in phi}
        emb, mom_emb = server[EMB].clone(), server[MOM + EMB].clone()

        def step_phi(g: Tensors) -> None:
            for k in phi:
                phi[k], mom[k] = sgd_step(phi[k], g[k], mom[k], o.hn_lr, **sgd)

        def step_v(cid: int, g: torch.Tensor) -> None:
            r = self.rows[cid]
            emb[r], mom_emb[r] = sgd_step(emb[r], g, mom_emb[r], lr_v, **sgd)

        if o.combine == "sequential":  # one Algorithm 1 step per reply, in client order (note 2)
            for c in cids:
                g_phi, g_v = self.hyper_gradient(phi, emb[self.rows[c]], replies[c])
                step_phi(g_phi)
                step_v(c, g_v)
        else:  # φ: one step on the mean over the round's replies; each v_i: its own step; all at the round's φ
            total: Tensors = {k: torch.zeros_like(p) for k, p in phi.items()}
            per_v = {}
            for c in cids:
                g_phi, per_v[c] = self.hyper_gradient(phi, emb[self.rows[c]], replies[c])
                for k in total:
                    total[k] += g_phi[k]
            step_phi({k: g / len(cids) for k, g in total.items()})
            for c in cids:
                step_v(c, per_v[c])
        out = {**{HN + k: v for k, v in phi.items()}, EMB: emb}
        return {**out, **{MOM + HN + k: v for k, v in mom.items()}, MOM + EMB: mom_emb}

    def reply_fits(self, payload: Tensors, reply: Tensors) -> str | None:
        """None if `reply` is what a client replies to `payload` — Δθ_i, one entry per parameter of θ_i sent, of its
        shape and dtype — else why not. Each Δθ_i is the output gradient of the hypernetwork's backward pass, which
        needs exactly θ_i's shapes and dtypes."""
        return misfit(reply, specs(payload))

    # --- evaluation ------------------------------------------------------------------------------------------
    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        """θ_i = h(v_i; φ) with the client's own buffers; from a site's view (`server_view`), its θ_i as sent."""
        cid = int(state["cid"])
        prefix = f"{THETA}{cid}/"
        if prefix + self.param_names[0] in server:
            theta = {k: server[prefix + k] for k in self.param_names}
        else:
            theta = self.generate(server, self.embedding(server, cid))
        return Predictor(self.ctx.model, {**theta, **own_buffers(state)})

    def server_view(self, server: Tensors, cids: Collection[int]) -> Tensors:
        """θ_i = h(v_i; φ) of each client of `cids` (`theta/<cid>/…`), and nothing else: what its training payload
        carries. Neither φ nor an embedding: with φ and v_j a site would generate client j's model, and φ, which
        the paper keeps on the server, is some hundred times the target network's size."""
        view: Tensors = {}
        for c in sorted(c for c in cids if c in self.rows):  # one at a time, as `personal_model`: the same bits
            view.update({f"{THETA}{c}/{k}": t for k, t in self.generate(server, self.embedding(server, c)).items()})
        return view

    def zero_shot(self, server: Tensors, data: ClientData) -> Predictor:
        return Predictor(self.ctx.model, {**self.generate(server, self.embedding(server, data.cid)),
                                          **self.initial_buffers()})  # fmt: skip

    def personalize(
        self, server: Tensors, data: ClientData, budget: Budget, generator: torch.Generator
    ) -> Iterator[Predictor]:
        """Note 9: learn the client's embedding with φ frozen (then, with `embedding+tune`, ft / lp from h(v))."""
        o = self.opts
        tune = o.new_client == "embedding+tune"
        epochs = (o.new_embed_epochs or budget.epochs) if tune else budget.epochs
        phi = {k: p.detach() for k, p in self.phi(server).items()}  # φ frozen: no gradient, never written
        v = self.embedding(server, data.cid).detach().clone().requires_grad_()
        buffers = self.initial_buffers()
        opt = SGD([v], lr=o.new_embed_lr or budget.lr, momentum=budget.momentum)
        model = self.ctx.model
        for _ in range(epochs):
            model.train()
            for b in index_batches(data.train, budget.batch_size, 1, generator):
                x, y = data.batch(b, generator)
                theta = self.theta(phi, v[None])[0]
                loss = F.cross_entropy(functional_call(model, {**theta, **buffers}, (x,)), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            if not tune:
                snapshot = {k: b.clone() for k, b in buffers.items()}
                yield Predictor(model, {**self.generate(server, v.detach()), **snapshot})
        if tune:
            start = {**self.generate(server, v.detach()), **buffers}
            yield from finetune_epochs(model, start, data, budget, generator)

    # --- diagnostics -----------------------------------------------------------------------------------------
    def diagnostics(self, rnd: int, server: Tensors, state_of: Callable[[int], Tensors]) -> dict[str, Any]:
        """The hypernetwork's size for the run's model (note 4) and how far apart the embeddings are."""
        emb = server[EMB]
        spread = (emb - emb.mean(0)).norm(dim=1).mean()
        return {"hypernet_params": self.num_hyper_params(), "embed_dim": self.embed_dim,
                "emb_spread": round(float(spread), 6)}  # fmt: skip
