"""FedCP — Zhang, Hua, Wang, Song, Xue, Ma & Guan, "FedCP: Separating Feature Information for Personalized Federated
Learning via Conditional Policy", KDD 2023 (arXiv 2307.01217), Figure 2.

Source note: the paper's full text could not be read here. The method below is the paper's Figure 2 (the forward
data flow of client i and the upload/download streams, with their captions), the authors' oral slides, and the
official code (TsingZ0/FedCP, read, not copied). The only equation number visible is Eq. 6, the pair of heads
Ŵ_i^hd = {W^hd, W_i^hd}; the other equations are given unnumbered.

Model of client i (Figure 2a). The feature extractor W_i^fe (the BlockNet body) gives h_i = φ(x; W_i^fe) ∈ R^K. The
Conditional Policy Network Θ_i (Linear K → 2K, LayerNorm, ReLU) reads the sample-specific h_i and the
client-specific vector v_i and gives, per feature, the policy {r_i, s_i} with r_i + s_i = 1:
    a_i = ReLU(LN(Θ_i(h_i ⊙ v_i/‖v_i‖))) ∈ R^{2×K},   (s_i, r_i) = softmax over the 2 rows of (a_i + g)/τ,
g standard Gumbel noise while training (Gumbel-softmax, τ = 1, soft). The global information r_i ⊙ h_i goes through
the frozen global head W^hd, the personalized information s_i ⊙ h_i through the personalized head W_i^hd, and the
outputs add (the heads Ŵ_i^hd of Eq. 6):
    out_i = W^hd(r_i ⊙ h_i) + W_i^hd(s_i ⊙ h_i).
v_i is the column sum over classes of W_i^hd's weight (of the product of the weights, for a head of several linear
layers), fixed (no gradient) while the client trains and recomputed from the trained W_i^hd after it.

Local learning (Figure 2a, the slides' "classification error" and "aligning features" losses): `train.local_epochs`
epochs of mini-batch SGD, one optimizer over W_i^fe, W_i^hd and Θ_i, on
    E_i = CE(out_i, y) + λ·E_i^d,   E_i^d = MMD²(h_i, h_i^g),   h_i^g = φ(x; W^fe),
h_i^g the features of the received extractor W^fe, kept frozen ("Overwrite & Freeze", like W^hd). MMD² is the
biased estimator over the batch, mean_ab[k(h_a, h_b) + k(h^g_a, h^g_b) − 2·k(h_a, h^g_b)], with the code's kernel
k(a, b) = Σ_σ exp(−‖a − b‖²/(2σ)), σ ∈ {10, 15, 20, 50} (σ enters as a variance).

Exchange (Figure 2b): a sampled client downloads W^fe (overwriting W_i^fe and the frozen copy), W^hd and Θ
(overwriting Θ_i), and uploads W_i^fe, W_i^hd and Θ_i. The server averages each, weighted by n_i/Σ_{j∈S_t} n_j:
    W^fe = Σ_i w_i·W_i^fe,   W^hd = Σ_i w_i·W_i^hd,   Θ = Σ_i w_i·Θ_i.
W_i^hd and v_i stay on the client (W_i^hd is uploaded, never overwritten). Only Θ adds to FedAvg's communication.
The P-FL model of client i is the whole of Figure 2a at inference: the server's W^fe, Θ and W^hd with the client's
W_i^hd and v_i — what the code evaluates at the start of the next round, after the download.

Choices and deviations:
  1. The uploaded head (`upload_mix` β): a client uploads (1 − β)·W_i^hd + β·W^hd. Figure 2b uploads W_i^hd
     itself (β = 0, the default); the authors' code uploads 0.5·W_i^hd + 0.5·W^hd (β = 0.5), which makes W^hd a
     moving average of the personalized heads' mean. This changes results: β = 0.5 reproduces the code.
  2. v_i before a client first trains (`initial_context`): `head` (default) computes it from W_i^hd like every later
     v_i; the code starts every client from a U(0, 1)^K draw of its own (`random`: client i's from the run's stream
     (seed, 0xFEDC9, 1, i); the code's clients draw one after the other from one seeded generator) until its first
     participation. Only first participations differ.
  3. Evaluation (`eval_noise`): the policy is the noise-free softmax by default, so a model's predictions are a
     function of its input. The code's Gumbel-softmax samples noise in evaluation too; `eval_noise: true` does so,
     drawing from (seed, 0xFEDC9, 2) afresh for each evaluation call (reproducible for a given `eval.batch_size`).
  4. Partial participation. The code sends W^fe to every client after each round, but W^hd and Θ only to that
     round's participants, after aggregation; a client not sampled keeps stale W^hd and Θ until it next
     participates. Here a client receives W^fe, W^hd and Θ when it is sampled (FedAvg's order), and P-FL evaluates
     every client with the server's current W^fe, W^hd and Θ. With every client in every round (the paper's
     setting, ρ = 1) the two are the same.
  5. The frozen W^fe's forward runs in training mode, as in the code (BatchNorm on batch statistics, so E_i^d is 0
     at the start of a round; dropout masks of its own). Its BatchNorm statistics are copies, never kept.
  6. Batches: shuffled each epoch from the client's generator, the last smaller batch kept (pflbed's convention);
     the authors' repository reads batches in a fixed order and drops the last partial one. The Gumbel noise of a
     batch, −log E with E ~ Exp(1), is drawn from the same generator after the batch, E floored at the smallest
     positive float (E = 0 would make the softmax NaN).
  7. Momentum and weight decay are `train.*` (the paper: plain SGD), for all of W_i^fe, W_i^hd and Θ_i, restarting
     every round.
  8. The split: body = every block below the model's head blocks (K = the flattened body output), W^hd and W_i^hd
     = the head blocks (the code's `head = model.fc`). A head without a linear layer is refused (v_i needs one).
  9. G-FL: W^fe with W^hd as a plain model (the paper evaluates no global model; with W_i^hd = W^hd the ensemble
     is this model up to a doubled bias, since r_i + s_i = 1).
 10. New clients (not in the paper): they start as a client joining would be given, W^fe, Θ, W^hd and W_i^hd = W^hd
     with v_i from it. `zero_shot` is that ensemble. `personalize` trains from it: `ft` runs FedCP's local learning
     (W_i^fe, W_i^hd, Θ_i on E_i, W^fe the frozen reference, at the budget's lr and momentum, no weight decay);
     `lp` trains W_i^hd alone on the frozen W^fe's features (computed once, in eval mode) through the policy. v_i
     stays fixed while training and is recomputed from W_i^hd for each yielded model, as after a round.
 11. BatchNorm running statistics come down with W^fe (the server's average), and a client trains from them and is
     scored with them. The code's clients download parameters only (`set_parameters` over `.parameters()`), so
     each keeps, and is scored with, statistics of its own: on a model with BatchNorm, a deviation.

Defaults (`algorithm.<key>`): λ (`lam`) 5, the authors' run script (MNIST, lr 0.005, batch 10; their repository's
default is 0, PFLlib's 1); τ 1; σ {10, 15, 20, 50}; β 0. E_i^d grows with how far W_i^fe moves in a round, so λ
interacts with the learning rate: at pflbed's default lr 0.05 on small clients λ = 5 holds the extractor near W^fe
(`pflbed tune` searches λ over [0.01, 10]). The update is a plan of local SGD on `LocalObjective`, whose Gumbel
noise each batch draws (`Objective.draw`) and whose reference forward moves statistics of its own (`models`): a
round's clients are batched (`executor.batch_clients`).
"""

from __future__ import annotations

from collections.abc import Iterator
from copy import deepcopy
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat
from torch import nn

from pflbed import rng
from pflbed.algorithms.base import Algorithm, Budget, ClientData, Context, Predictor, Same, Tensors
from pflbed.algorithms.common import load_params
from pflbed.algorithms.fedrod import feature_dim, unprefixed
from pflbed.algorithms.local_sgd import LocalSGDPlan, Phase, run_blocks, weighted_mean
from pflbed.algorithms.partial import frozen_params
from pflbed.algorithms.sgd import SGD
from pflbed.algorithms.training import WeightedMean, get_params, index_batches
from pflbed.errors import ConfigError
from pflbed.models import BlockNet
from pflbed.search import Search, Space

STREAM = 0xFEDC9  # FedCP's own random streams (not one of pflbed.rng's tags): 0 Θ, 1 the random v_i, 2 eval noise
NET, CPN, PERSONAL, CONTEXT = "net.", "cpn.", "personal.", "context"  # state-dict keys of `PolicyModel`
REFERENCE = "reference."  # the plan's frozen W^fe: its parameters (constants) and BatchNorm statistics (moved)


class FedCPOptions(BaseModel):
    """FedCP options."""

    model_config = ConfigDict(extra="forbid")
    search: ClassVar[dict[str, Space]] = {"lam": Search(0.01, 10.0, log=True)}  # the authors' script: λ 5
    lam: float = Field(5.0, ge=0, description="λ, the weight of E_i^d = MMD²(h_i, h_i^g) between the features of "
                       "the trained and the frozen received extractor (the authors' script: 5; 0: none)")  # fmt: skip
    tau: float = Field(1.0, gt=0, description="τ, the temperature of the Gumbel-softmax policy (the code's 1)")
    bandwidths: list[PositiveFloat] = Field([10.0, 15.0, 20.0, 50.0], min_length=1, description="σ of the MMD's "
                                            "kernel Σ_σ exp(−‖a − b‖²/(2σ)) (the code's 10, 15, 20, 50)")  # fmt: skip
    upload_mix: float = Field(0.0, ge=0, le=1, description="β: a client uploads (1 − β)·W_i^hd + β·W^hd as its "
                              "head (0: W_i^hd, the paper's Figure 2; 0.5: the authors' code)")  # fmt: skip
    initial_context: Literal["head", "random"] = Field("head", description="v_i before a client first trains: head: "
                                                       "from its personalized head; random: the code's U(0, 1)^K, "
                                                       "a draw for each client")  # fmt: skip
    eval_noise: bool = Field(False, description="Gumbel noise in the policy at evaluation too, as the authors' code "
                             "evaluates (false: the noise-free softmax)")  # fmt: skip


def policy_network(k: int) -> nn.Sequential:
    """Θ without its ReLU: Linear(K → 2K) and LayerNorm(2K) (the ReLU follows in `PolicyModel.policy`)."""
    return nn.Sequential(nn.Linear(k, 2 * k), nn.LayerNorm(2 * k))


def gumbel(generator: torch.Generator, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Standard Gumbel noise −log E, E ~ Exp(1) (what `F.gumbel_softmax` adds), drawn on the generator's device
    and moved to `device`; E is floored at the smallest positive float (deviation 6)."""
    e = torch.empty(shape, device=generator.device).exponential_(generator=generator)
    return (-e.clamp_min(torch.finfo(e.dtype).tiny).log()).to(device)


def mmd2(a: torch.Tensor, b: torch.Tensor, bandwidths: list[float], w: torch.Tensor | None = None) -> torch.Tensor:
    """Biased MMD² of the rows of `a` and `b`: mean_ij[k(a_i, a_j) + k(b_i, b_j) − 2·k(a_i, b_j)] with
    k(u, v) = Σ_σ exp(−‖u − v‖²/(2σ)); with row weights `w` (a batched step's: 1/n on a client's n real rows, 0 on
    its padding) the means are Σ_ij w_i·w_j·(…), over the real rows alone."""
    n, x = len(a), torch.cat([a, b])
    norms = (x * x).sum(1)
    sq = norms[:, None] + norms[None, :] - 2.0 * (x @ x.T)  # ‖x_i − x_j‖² over both sets at once
    sigma = torch.tensor(bandwidths, dtype=sq.dtype, device=sq.device)
    k = torch.exp(-0.5 * sq / sigma[:, None, None]).sum(0)
    if w is None:
        return k[:n, :n].mean() + k[n:, n:].mean() - 2.0 * k[:n, n:].mean()
    ww = w[:, None] * w[None, :]
    return (k[:n, :n] * ww).sum() + (k[n:, n:] * ww).sum() - 2.0 * (k[:n, n:] * ww).sum()


def context_of(head: Tensors, weights: list[str]) -> torch.Tensor:
    """v: the column sum over classes of the head's weight, W_L·…·W_1 for linear layers with weights `weights` (in
    model order, keys of `head`), detached."""
    w = head[weights[-1]]
    for k in reversed(weights[:-1]):
        w = w @ head[k]
    return w.detach().sum(0)


def policy(a: torch.Tensor, noise: torch.Tensor | None, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(r, s) from Θ's output `a` [B, 2K] before its ReLU: the softmax over the two rows of ReLU(a) plus `noise`
    [B, 2, K] (None: noise-free), at temperature τ. Row 0 weighs the personalized head and row 1 the global one
    (the code's order)."""
    a = F.relu(a).unflatten(1, (2, -1))
    p = torch.softmax((a if noise is None else a + noise) / tau, dim=1)
    return p[:, 1], p[:, 0]


class LocalObjective:
    """E_i = CE(out_i, y) + λ·MMD²(h_i, h_i^g) as a plan's objective (`local_sgd.Objective`), on the run's model
    with the plan's tensors: the model's own (W_i^fe, W^hd), `personal.` (W_i^hd, through the same head modules),
    `cpn.` (Θ_i); constants `context` (v_i) and `reference.` + the body's parameters (W^fe), whose forward moves the
    BatchNorm statistics `reference.` + the body's (its own, dropped after the round: deviation 5). `draw` gives a
    batch's Gumbel noise, drawn from the client's generator after the batch (deviation 6). Forwards in the order
    the model runs them: W_i^fe, W_i^hd, W^hd, then the frozen W^fe (its dropout masks drawn last). `inputs`
    False: the batch's x are features already (`lp`: no body, no E_i^d). In the loop (`w` None) the plain means;
    in a batched step, weighted per sample (`mmd2`'s weights). A class (not a closure): the algorithm travels to
    `procs` workers by pickle."""

    models = (PERSONAL, REFERENCE)

    def __init__(self, k: int, tau: float, lam: float, bandwidths: list[float], inputs: bool = True) -> None:
        self.k, self.tau, self.lam, self.bandwidths, self.inputs = k, tau, lam, bandwidths, inputs
        with torch.device("cpu"):  # only its structure: every call gives it the plan's Θ_i
            self.cpn = policy_network(k)

    def draw(self, n: int, generator: torch.Generator) -> torch.Tensor:
        return gumbel(generator, (n, 2, self.k), generator.device)

    def __call__(
        self, model: BlockNet, params: Tensors, consts: Tensors, x: torch.Tensor, y: torch.Tensor,
        w: torch.Tensor | None, noise: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        body, head = model.body_blocks(), model.head_blocks()
        z = run_blocks(model, params, body, x) if self.inputs else x
        h = z.flatten(1)
        a = torch.func.functional_call(self.cpn, unprefixed(CPN, params), (h * F.normalize(consts[CONTEXT], dim=0),))
        r, s = policy(a, noise, self.tau)
        personal = run_blocks(model, unprefixed(PERSONAL, params), head, (s * h).reshape(z.shape))
        out = run_blocks(model, params, head, (r * h).reshape(z.shape)) + personal
        ce = F.cross_entropy(out, y, reduction="mean" if w is None else "none")
        loss = ce if w is None else weighted_mean(ce, w)
        if not (self.inputs and self.lam > 0):
            return loss
        with torch.no_grad():
            z_g = run_blocks(model, {**unprefixed(REFERENCE, consts), **unprefixed(REFERENCE, params)}, body, x)
        return loss + self.lam * mmd2(h, z_g.flatten(1), self.bandwidths, w)


class PolicyModel(nn.Module):
    """The personalized model of Figure 2a: body → h; Θ(h ⊙ v̂) → policy (r, s); W^hd(r ⊙ h) + W_i^hd(s ⊙ h).

    State-dict keys: `net.` + the BlockNet's (the body W^fe and the global head W^hd), `personal.` + the BlockNet's
    head keys (W_i^hd), `cpn.` + Θ's, and `context` (v_i, not normalized). `features` / `classify` split it at the
    body like a BlockNet, so clients on the server's body share one computation of the features in evaluation."""

    def __init__(self, net: BlockNet, k: int, tau: float) -> None:
        super().__init__()
        self.net, self.tau = net, tau
        self.personal = nn.Module()
        self.personal.blocks = nn.ModuleDict({b: deepcopy(net.blocks[b]) for b in net.head_blocks()})
        device = next(net.parameters()).device
        with torch.device("cpu"):  # its values are always loaded; built where the zoo builds, then moved
            self.cpn = policy_network(k)
        self.cpn.to(device)
        self.register_buffer(CONTEXT, torch.zeros(k, device=device))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.net.features(x)

    def classify(self, z: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        h = z.flatten(1)
        r, s = policy(self.cpn(h * F.normalize(self.context, dim=0)), noise, self.tau)
        personal = (s * h).reshape(z.shape)
        for b in self.net.head_blocks():
            personal = self.personal.blocks[b](personal)
        return self.net.classify((r * h).reshape(z.shape)) + personal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classify(self.features(x))


class NoisyPredictor(Predictor):
    """A `PolicyModel` evaluated with Gumbel noise in its policy (`eval_noise`, deviation 3): every call draws from
    a fresh generator of (seed, STREAM, 2), chunk after chunk of `batch_size` rows. Its own methods, so evaluation
    never batches it with others or runs it elsewhere. As a module of its own (`module`: a trained run's
    personal model, `pflbed personalize`) it is the noise-free policy, a function of its input like any saved
    model."""

    model: PolicyModel

    def __init__(self, model: PolicyModel, params: Tensors, seed: int, feature_key: tuple | None = None) -> None:
        super().__init__(model, params, feature_key)
        self.seed = seed

    def _noisy(self, x: torch.Tensor, batch_size: int, inputs: bool) -> torch.Tensor:
        """The logits of inputs `x` (`inputs`) or of features `x`, the noise drawn in order of the rows."""
        load_params(self.model, self.params)
        self.model.eval()
        g, out = rng.generator(self.seed, STREAM, 2), []
        with torch.no_grad():
            for i in range(0, max(len(x), 1), batch_size):
                z = self.model.features(x[i : i + batch_size]) if inputs else x[i : i + batch_size]
                out.append(self.model.classify(z, gumbel(g, (len(z), 2, self.model.context.numel()), z.device)))
        return torch.cat(out)

    def logits(self, x: torch.Tensor, batch_size: int = 1024) -> torch.Tensor:
        return self._noisy(x, batch_size, inputs=True)

    def features(self, x: torch.Tensor, batch_size: int = 1024) -> torch.Tensor:
        return self._batched("features", x, batch_size)  # the body: nothing random

    def classify(self, z: torch.Tensor, batch_size: int = 1024) -> torch.Tensor:
        return self._noisy(z, batch_size, inputs=False)


class FedCP(Algorithm):
    name = "fedcp"
    dp_refused = None  # replies: new values of W^fe, W^hd and Θ, entries of the payload, averaged
    Config = FedCPOptions

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        m = ctx.model
        self.model_keys = list(m.state_dict())
        self.body_keys, self.head_keys = m.state_keys(m.body_blocks()), m.state_keys(m.head_blocks())
        self.weights = [".".join(filter(None, ("blocks", b, n, "weight"))) for b in m.head_blocks()
                        for n, mod in m.blocks[b].named_modules() if isinstance(mod, nn.Linear)]  # fmt: skip
        self.k = feature_dim(m, ctx.source.input_shape)
        if not self.weights or m.state_dict()[self.weights[0]].shape[1] != self.k:
            raise ConfigError(f"algorithm.name: fedcp needs a model whose head starts with a linear layer on the "
                              f"flattened body output ({self.k} features); {ctx.cfg.model.name} has none")  # fmt: skip
        self.ens = PolicyModel(m, self.k, self.opts.tau)
        o = self.opts
        self.objective = LocalObjective(self.k, o.tau, o.lam, o.bandwidths)
        # `lp`'s, on features; built once: building one initializes a policy network from torch's global RNG
        self.head_objective = LocalObjective(self.k, o.tau, 0.0, o.bandwidths, inputs=False)
        self.cpn_keys = [CPN + k for k in self.ens.cpn.state_dict()]
        self.body_params = [k for k, _ in m.named_parameters() if k in set(self.body_keys)]
        self.body_stats = [k for k in self.body_keys if k not in set(self.body_params)]
        self.trainable = [NET + k for k in m.state_keys(m.body_blocks())] + \
            [PERSONAL + k for k in self.head_keys] + self.cpn_keys  # fmt: skip

    # --- the pieces of a model ------------------------------------------------------------------------------
    def model_params(self, server: Tensors) -> Tensors:
        """W^fe and W^hd: the BlockNet's state out of the server state."""
        return {k: server[k] for k in self.model_keys}

    def context(self, personal: Tensors) -> torch.Tensor:
        """v_i of a personalized head given under `personal.` keys."""
        return context_of({k: personal[PERSONAL + k] for k in self.weights}, self.weights)

    def joining(self, server: Tensors) -> Tensors:
        """A new client's state: W_i^hd = W^hd, v_i from it (deviation 10)."""
        head = {PERSONAL + k: server[k] for k in self.head_keys}
        return {**head, CONTEXT: self.context(head)}

    def ensemble(self, server: Tensors, state: Tensors) -> Tensors:
        """The `PolicyModel`'s parameters: W^fe, W^hd and Θ of `server`, W_i^hd and v_i of a client's `state`."""
        return {**{NET + k: server[k] for k in self.model_keys}, **{k: server[k] for k in self.cpn_keys}, **state}

    def predictor(self, server: Tensors, params: Tensors, shared_body: bool) -> Predictor:
        key = ("fedcp-body", Same(server)) if shared_body else None  # the server's W^fe: features computed once
        if self.opts.eval_noise:
            return NoisyPredictor(self.ens, params, self.ctx.seed, key)
        return Predictor(self.ens, params, key)

    # --- federation ------------------------------------------------------------------------------------------
    def init_server(self) -> Tensors:
        with rng.fork(self.ctx.device), torch.device("cpu"):
            torch.manual_seed(rng.derive_seed(self.ctx.seed, STREAM, 0))
            theta = policy_network(self.k).state_dict()
        return {**self.ctx.initial_params, **{CPN + k: v.to(self.ctx.device) for k, v in theta.items()}}

    def init_client(self, cid: int) -> Tensors:
        head = {PERSONAL + k: self.ctx.initial_params[k] for k in self.head_keys}
        if self.opts.initial_context == "random":  # the code's torch.rand(1, K), drawn by each client in turn
            v = torch.rand(self.k, generator=rng.generator(self.ctx.seed, STREAM, 1, cid), device="cpu")
            return {**head, CONTEXT: v.to(self.ctx.device)}
        return {**head, CONTEXT: self.context(head)}

    def configure(self, rnd: int, server: Tensors, cids: list[int]) -> dict[int, Tensors]:
        return {c: server for c in cids}

    def sgd_plan(self, payload: Tensors, state: Tensors, data: ClientData) -> LocalSGDPlan:
        """E_i by SGD from the downloaded W^fe, Θ, W^hd and the client's W_i^hd, v_i (`LocalObjective`): W_i^fe (the
        body) and W_i^hd, Θ_i (`personal.`, `cpn.`) at `train.lr`, W^hd and the reference W^fe fixed. The reply is
        W_i^fe, Θ_i and the uploaded head (deviation 1), the new state W_i^hd and its v_i."""
        t, beta = self.ctx.cfg.train, self.opts.upload_mix
        start = {**self.model_params(payload), **{k: payload[k] for k in self.cpn_keys},
                 **{k: v for k, v in state.items() if k.startswith(PERSONAL)},
                 **{REFERENCE + k: payload[k] for k in self.body_stats}}  # fmt: skip
        consts = {CONTEXT: state[CONTEXT], **{REFERENCE + k: payload[k] for k in self.body_params}}
        blocks = tuple(self.ctx.model.body_blocks())
        phase = Phase(blocks, t.local_epochs, t.lr, ((PERSONAL, t.lr), (CPN, t.lr)))

        def finish(params: Tensors) -> tuple[Tensors, Tensors]:
            head = {k: (1.0 - beta) * params[PERSONAL + k] + beta * payload[k] if payload[k].is_floating_point()
                    else params[PERSONAL + k] for k in self.head_keys}  # fmt: skip
            reply = {**{k: params[k] for k in self.body_keys}, **head, **{k: params[k] for k in self.cpn_keys}}
            personal = {PERSONAL + k: params[PERSONAL + k] for k in self.head_keys}
            return reply, {**personal, CONTEXT: self.context(personal)}

        return LocalSGDPlan(start, (phase,), finish, self.objective, consts)

    def local_learning(
        self, start: Tensors, data: ClientData, train: list[str], reference: Tensors | None, epochs: int,
        batch_size: int, lr: float, momentum: float, weight_decay: float, generator: torch.Generator,
    ) -> Iterator[None]:  # fmt: skip
        """A new client's SGD on E_i (`LocalObjective`) from `start` (`PolicyModel` keys), training the entries
        `train`, every other parameter fixed; the features of `reference` (W^fe, the BlockNet's keys) are h^g
        (None: no E_i^d, and `data.x` are features, not inputs). Yields after each epoch, the trained values in
        `self.ens`; the optimizer (its momentum) kept across the epochs."""
        ens, model = self.ens, self.ctx.model  # `ens.net` is the run's model
        load_params(ens, start)
        named = dict(ens.named_parameters())
        params = [named[k] for k in train if k in named]
        others = [p for k, p in named.items() if k not in set(train)]
        tensors = {**unprefixed(NET, named), **{k: v for k, v in named.items() if not k.startswith(NET)}}
        consts = {CONTEXT: ens.context}
        objective = self.objective if reference is not None else self.head_objective
        if reference is not None:  # W^fe's statistics: copies, moved by its forwards, never kept (deviation 5)
            consts |= {REFERENCE + k: reference[k] for k in self.body_params}
            tensors |= {REFERENCE + k: reference[k].clone() for k in self.body_stats}
        opt = SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
        for _ in range(epochs):
            with frozen_params(others):
                ens.train()
                for b in index_batches(data.train, batch_size, 1, generator):
                    x, y = data.batch(b, generator)
                    noise = objective.draw(len(b), generator).to(x.device)
                    loss = objective(model, tensors, consts, x, y, None, noise)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
            yield

    def aggregator(self, rnd: int, server: Tensors, weights: dict[int, float]) -> WeightedMean:
        return WeightedMean(weights)  # W^fe, W^hd and Θ: Σ_i n_i/Σ_j n_j · (client i's upload)

    # --- evaluation and new clients --------------------------------------------------------------------------
    def generic_model(self, server: Tensors) -> Predictor:
        return Predictor(self.ctx.model, self.model_params(server))

    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        return self.predictor(server, self.ensemble(server, state), shared_body=True)

    def zero_shot(self, server: Tensors, data: ClientData) -> Predictor:
        return self.predictor(server, self.ensemble(server, self.joining(server)), shared_body=True)

    def personalize(
        self, server: Tensors, data: ClientData, budget: Budget, generator: torch.Generator
    ) -> Iterator[Predictor]:
        """From the joining state (deviation 10): `ft` FedCP's local learning, `lp` W_i^hd alone on the frozen
        W^fe's eval-mode features; each epoch's model with v_i of its trained W_i^hd."""
        start = self.ensemble(server, self.joining(server))
        personal = [PERSONAL + k for k in self.head_keys]
        if budget.method == "ft":
            train, on, reference = self.trainable, data, self.model_params(server)
        elif budget.method == "lp":
            net = self.ctx.model
            load_params(net, self.model_params(server))
            net.eval()
            with torch.no_grad():
                feats = net.features(data.x[data.train])
            on = ClientData(data.cid, feats, data.y[data.train], torch.arange(len(feats), device=feats.device),
                            data.val[:0], data.prior)  # fmt: skip
            train, reference = personal, None
        else:
            raise ValueError(f"unknown personalization method {budget.method!r}")
        epochs = self.local_learning(start, on, train, reference, budget.epochs, budget.batch_size, budget.lr,
                                     budget.momentum, 0.0, generator)  # fmt: skip
        for _ in epochs:
            params = get_params(self.ens) if budget.method == "ft" else \
                {**start, **get_params(self.ens, personal)}  # fmt: skip
            params[CONTEXT] = self.context(params)
            yield self.predictor(server, params, shared_body=budget.method == "lp")
