"""FedDF — Lin, Kong, Stich & Jaggi, "Ensemble Distillation for Robust Model Fusion in Federated Learning",
NeurIPS 2020 (Algorithm 1; heterogeneous "prototype" models §3), as used by the KT-pFL paper's heterogeneous
baselines (Zhang et al., NeurIPS 2021, §5.1, Table 1).

Idea: parameter averaging only works within one architecture, but predictions can be averaged across any
architectures. FedDF therefore keeps one global ("prototype") model per architecture, fuses each with plain FedAvg,
and then lets *every* received client model — of every architecture — teach each fused model through ensemble
distillation on unlabelled server-side data. Knowledge crosses architectures without the clients ever seeing
anything but their own architecture's global model.

Round r (one engine round; only tensors cross the boundary):
  1. configure: each sampled client n receives the global model of its architecture a(n).
  2. client: local CE training from it (`train.*`: E = `train.local_epochs` epochs of SGD); reply = its parameters.
     A plan (`plan`), so `executor.batch_clients` trains a round's clients of the run's model (`model.name`)
     together; clients of the other architectures train one by one.
  3. aggregate, per architecture a with at least one reply: x̂_a = Σ_{n: a(n)=a} (|D_n| / Σ|D|)·w_n (FedAvg; integer
     buffers take the maximum, as in `weighted_mean`).
  4. aggregate, ensemble distillation: on the public batch ξ_r the teacher logits are the *uniform* average of the
     logits of all received client models (across architectures, eval mode): z̄ = (1/|S_r|)·Σ_n f(w_n, ξ_r). Each
     fused x̂_a is then trained for `server_steps` Adam steps (lr `server_lr`, mini-batches of `server_batch_size`
     drawn from ξ_r) on KL(softmax(z̄/T) ‖ softmax(f(x̂_a)/T)) and becomes the new global model of a.
  The server builds the client models from the uploaded parameters in model objects it owns (one per
  architecture); nothing is shared with the clients. ξ_r = `public_batch` indices of `federation.public` drawn from
  (seed, r) exactly as in `ktpfl` (`distill.public_batch`); the mini-batch order comes from a generator seeded by
  (seed, FedDF's stream, r, architecture index), and so are the dropout masks of the distillation (torch's global
  RNG, forked around it) — so results do not depend on execution order or on which process trained the clients.

Options (`algorithm.<key>`):
  - `architectures` (default KT-pFL's zoo [lenet5, alexnet_small, resnet18, shufflenetv2]): client c gets
    architectures[⌊c·A / federation.clients⌋] — the same contiguous blocks as `ktpfl`, new clients included.
  - `homogeneous` (default false): every client uses the run's `model.name` (one global model).
  - `public_batch` (default 5000, or the whole public set if smaller — KT-pFL's per-round public batch).
  - `temperature` T (default 1: FedDF's Algorithm 1 distils σ(average logits) into σ(student logits) without a
    temperature).
  - `server_steps` (default 500), `server_lr` (default 1e-3, the paper's Adam rate), `server_batch_size`
    (default 256, KT-pFL's public-data batch), `server_schedule` ("cosine", default: the paper's cosine annealing of
    the Adam rate, here over the `server_steps` of one round; or "constant").

Evaluation: the personal model of a client is its architecture's global model (FedDF is not personalized). The
generic model (G-FL) is the global model when there is one architecture; with several architectures there is no
single generic model and G-FL is null (so `eval.finetune` is skipped). New clients start from their
architecture's global model (zero-shot) and fine-tune it (`personalize`).

Deviations from Lin et al. (all stated):
  - Fixed step count instead of early stopping: the paper distils for up to 10⁴ steps and stops once accuracy on a
    server-side validation set plateaus (patience 10³). There is no labelled server-side validation data here, so
    distillation runs exactly `server_steps` steps (default 500: a compute-bounded choice, not the paper's).
  - Distillation data: the paper draws fresh unlabelled mini-batches from the whole distillation set; here they are
    drawn (with reshuffling, passes repeated as needed) from the round's public batch ξ_r, so the teacher logits are
    computed once per round with the client models fixed.
  - Student mode: the fused model trains in train mode (dropout active, BatchNorm statistics updated on the public
    batches), as any SGD/Adam step here; teachers predict in eval mode.
  - Architectures without a reply in a round keep their global model unchanged and are not distilled (Algorithm 1
    has no prototype without a received model).
  - Initial models: the architecture equal to `model.name` starts from the run's initial model (so a homogeneous
    FedDF with `server_steps = 0` is exactly FedAvg); every other architecture from its own random initialization
    seeded by (seed, init stream, FedDF's stream, architecture index). The paper does not specify this.
  - The KT-pFL paper gives no FedDF hyper-parameters beyond its shared ones (batch 128 private / 256 public,
    public batch 3000 in the text, 5000 in its code); the defaults above are documented choices.

Communication: payloads and replies are the parameters of the client's architecture (like FedAvg); the public data
stays on the server.

Diagnostics: `diag.distill_kl_start` / `diag.distill_kl_end` — the mean (over distilled architectures) KL of the
fused model to the ensemble teacher on ξ_r before and after the server distillation of the evaluated round.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from pflbed import rng
from pflbed.algorithms import distill as kd
from pflbed.algorithms.base import Algorithm, Budget, ClientContext, ClientData, Context, Predictor, Tensors
from pflbed.algorithms.ktpfl import DEFAULT_ARCHITECTURES
from pflbed.algorithms.local_sgd import LocalSGDPlan, Phase, run_plan
from pflbed.algorithms.reply_shapes import UNSENT, Spec, misfit, specs, whole
from pflbed.algorithms.training import (
    architecture_of,
    finetune_epochs,
    get_params,
    index_batches,
    load_params,
    weighted_mean,
)
from pflbed.errors import ConfigError
from pflbed.models import BlockNet, ModelNames
from pflbed.search import IntSearch, Search, Space

STREAM = 0xFEDDF  # FedDF's own random streams (not one of pflbed.rng's tags): 0 initial models, 1 server distillation


class FedDFOptions(BaseModel):
    """FedDF options (see the module docstring for the defaults and where they come from)."""
    # server_steps: its server distillation is most of its training (500 steps of 256 public samples a round, the
    # paper's upper bound with early stopping): searched on a log scale down to 10, so that a compute-equal search
    # can trade it against more trials
    search: ClassVar[dict[str, Space]] = {"temperature": Search(0.5, 10.0, log=True),
                                          "server_lr": Search(1e-4, 1e-2, log=True),
                                          "server_steps": IntSearch(10, 500, log=True)}  # fmt: skip

    model_config = ConfigDict(extra="forbid")
    architectures: ModelNames = Field(default_factory=lambda: list(DEFAULT_ARCHITECTURES), min_length=1)
    homogeneous: bool = Field(False, description="every client uses model.name (one global model)")
    public_batch: int = Field(5000, ge=1, description="public samples per round (capped at the public set)")
    temperature: float = Field(1.0, gt=0, description="distillation temperature T (FedDF: none, i.e. 1)")
    server_steps: int = Field(500, ge=0, description="server distillation steps per round (0: FedAvg per arch)")
    server_lr: float = Field(1e-3, gt=0, description="Adam learning rate of the server distillation")
    server_batch_size: int = Field(256, ge=1, description="public mini-batch of the server distillation")
    server_schedule: Literal["cosine", "constant"] = Field("cosine", description="Adam learning-rate schedule")


def ensemble_logits(model: nn.Module, params: list[Tensors], x: torch.Tensor, batch_size: int = 1024) -> torch.Tensor:
    """Sum of the logits of `model` loaded with each parameter set in `params`, eval mode, no gradient.

    A sum (not a mean) so that teachers of several architectures can be accumulated; the caller divides by the
    total number of teachers.
    """
    total = torch.zeros((), device=x.device)
    model.eval()
    for p in params:
        load_params(model, p)
        with torch.no_grad():
            total = total + torch.cat([model(x[i : i + batch_size]) for i in range(0, len(x), batch_size)]).float()
    return total


def distill_kl(model: nn.Module, x: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> float:
    """KL(softmax(teacher/T) ‖ softmax(student/T)) over all of `x`, eval mode: the distillation objective's value."""
    model.eval()
    with torch.no_grad():
        z = torch.cat([model(x[i : i + 1024]) for i in range(0, len(x), 1024)])
    return float(kd.kl_to_target(z, F.softmax(teacher_logits / temperature, dim=1), temperature))


def ensemble_distill(
    model: nn.Module,
    x: torch.Tensor,
    teacher_logits: torch.Tensor,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    temperature: float,
    generator: torch.Generator,
    schedule: Literal["cosine", "constant"] = "cosine",
) -> float:
    """FedDF's server step: `steps` Adam steps on KL(softmax(z̄/T) ‖ softmax(f(x)/T)); returns the mean loss.

    Mini-batches are reshuffled passes over `x` (as many as needed). Adam is re-created every call: the paper
    distils each round's fused model afresh. With `cosine`, the rate anneals from `lr` to 0 over the `steps`.
    """
    if steps <= 0:
        return 0.0
    target = F.softmax(teacher_logits.float() / temperature, dim=1)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps) if schedule == "cosine" else None
    n_epochs = math.ceil(steps * batch_size / max(len(x), 1)) + 1
    total, done = torch.zeros((), device=x.device), 0
    model.train()
    for b in index_batches(torch.arange(len(x), device=x.device), batch_size, n_epochs, generator):
        if done >= steps:
            break
        loss = kd.kl_to_target(model(x[b]), target[b], temperature)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        total += loss.detach()
        done += 1
    return float(total) / max(done, 1)


class FedDF(Algorithm):
    name = "feddf"
    dp_refused = (
        "the server distils from each client's model one by one on public data (an ensemble of "
        "individual models), not from their mean"
    )
    Config = FedDFOptions

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        fed = ctx.federation
        if self.opts.server_steps > 0 and fed.public.numel() == 0:
            raise ConfigError(f"{self.name} needs public data for server distillation: set federation.public > 0")
        self.n_total = len(fed.clients)
        self.blocks = [ctx.cfg.model.name] if self.opts.homogeneous else list(self.opts.architectures)
        self.archs = list(dict.fromkeys(self.blocks))  # distinct architectures, first-seen order
        self.models: dict[str, BlockNet] = {ctx.cfg.model.name: ctx.model}
        for a in self.archs:
            if a not in self.models:
                self.models[a] = ctx.new_model(a)
        self._cache: tuple[Tensors | None, dict[str, Tensors]] = (None, {})

    # --- helpers ---------------------------------------------------------------------------------------------
    def arch_of(self, cid: int) -> str:
        return architecture_of(cid, self.blocks, self.n_total)

    def global_params(self, server: Tensors, arch: str) -> Tensors:
        """Architecture `arch`'s global model from the server state (cached per server dict, so that evaluation
        sees one parameter dict per architecture and batches all its clients together)."""
        cached_server, cache = self._cache
        if cached_server is not server:
            cache = {}
            self._cache = (server, cache)
        if arch not in cache:
            prefix = f"g/{arch}/"
            cache[arch] = {k[len(prefix) :]: v for k, v in server.items() if k.startswith(prefix)}
        return cache[arch]

    def _initial(self, i: int, arch: str) -> Tensors:
        if arch == self.ctx.cfg.model.name:
            return dict(self.ctx.initial_params)
        with rng.fork(self.ctx.device):
            torch.manual_seed(rng.derive_seed(self.ctx.seed, rng.INIT, STREAM, i))
            return get_params(self.ctx.new_model(arch))

    def _public_x(self, rnd: int) -> torch.Tensor:
        idx = kd.public_batch(self.ctx.federation.public, self.opts.public_batch, self.ctx.seed, rnd)
        return self.ctx.source.train.x[idx]

    # --- federation ------------------------------------------------------------------------------------------
    def init_server(self) -> Tensors:
        server: Tensors = {}
        for i, a in enumerate(self.archs):
            server.update({f"g/{a}/{k}": v for k, v in self._initial(i, a).items()})
        return server

    def init_client(self, cid: int) -> Tensors:
        return {"cid": torch.tensor(cid, device=self.ctx.device)}

    def configure(self, rnd: int, server: Tensors, cids: list[int]) -> dict[int, Tensors]:
        return {c: self.global_params(server, self.arch_of(c)) for c in cids}

    def payload_fits(self, rnd: int, cid: int, payload: Tensors, state: Tensors) -> str | None:
        """The global model of the client's architecture, every entry of that model (read off the model the client
        trains, not built anew: the default would build every architecture's initial model, per payload)."""
        return misfit(payload, specs(self.models[self.arch_of(cid)].state_dict()), UNSENT)

    def view_fits(self, view: Tensors, cids: list[int]) -> str | None:
        """Every architecture's global model (`g/<arch>/`, read off the models the clients train: the default would
        build each architecture's initial model) and, held whole, `view_groups`."""
        want = {f"g/{a}/{k}": s for a in self.archs for k, s in specs(self.models[a].state_dict()).items()}
        return misfit(view, whole(view, want, self.view_groups(cids)), UNSENT)

    def view_groups(self, cids: list[int]) -> list[dict[str, Spec]]:
        """The distillation's mean KL before and after it (`kl_start`, `kl_end`: scalars), from its first round."""
        kl = ((), torch.get_default_dtype())
        return [{"kl_start": kl, "kl_end": kl}]

    def client_update(
        self, payload: Tensors, state: Tensors, data: ClientData, cctx: ClientContext
    ) -> tuple[Tensors, Tensors]:
        model = self.models[self.arch_of(data.cid)]
        return run_plan(model, self.plan(model, payload, state), data, self.ctx.cfg.train, cctx.generator)

    def sgd_plan(self, payload: Tensors, state: Tensors, data: ClientData) -> LocalSGDPlan | None:
        """The client's plan where its architecture is the run's model (`executor.batch_clients` stacks clients of
        that one model); None for a client of another architecture, which trains client by client."""
        model = self.models[self.arch_of(data.cid)]
        return self.plan(model, payload, state) if model is self.ctx.model else None

    def plan(self, model: BlockNet, payload: Tensors, state: Tensors) -> LocalSGDPlan:
        """Local training: FedAvg's epochs on the client's architecture from its global model; the reply."""
        t = self.ctx.cfg.train
        return LocalSGDPlan(payload, (Phase(tuple(model.block_names()), t.local_epochs, t.lr),),
                            partial(_reply_only, state))  # fmt: skip

    def fuse(self, replies: dict[int, Tensors], weights: dict[int, float]) -> dict[str, Tensors]:
        """Step 3: FedAvg (|D_n|-weighted) within each architecture that replied."""
        fused: dict[str, Tensors] = {}
        for a in self.archs:
            group = [c for c in sorted(replies) if self.arch_of(c) == a]
            if group:
                fused[a] = weighted_mean({c: replies[c] for c in group}, {c: weights[c] for c in group})
        return fused

    def teacher_logits(self, x: torch.Tensor, replies: dict[int, Tensors]) -> torch.Tensor:
        """Step 4's teacher: the uniform average of all received client models' logits on `x`."""
        total = torch.zeros((), device=x.device)
        for a in self.archs:
            group = [replies[c] for c in sorted(replies) if self.arch_of(c) == a]
            if group:
                total = total + ensemble_logits(self.models[a], group, x)
        return total / len(replies)

    def aggregate(self, rnd: int, server: Tensors, replies: dict[int, Tensors], weights: dict[int, float]) -> Tensors:
        o = self.opts
        out = dict(server)
        fused = self.fuse(replies, weights)
        if o.server_steps > 0 and fused:
            x = self._public_x(rnd)
            teacher = self.teacher_logits(x, replies)
            before, after = [], []
            for a, params in fused.items():
                model = self.models[a]
                load_params(model, params)
                before.append(distill_kl(model, x, teacher, o.temperature))
                gen = rng.generator(self.ctx.seed, STREAM, 1, rnd, self.archs.index(a))
                with rng.fork(self.ctx.device):  # dropout masks from this stream, not from whatever ran last
                    torch.manual_seed(gen.initial_seed())
                    ensemble_distill(model, x, teacher, steps=o.server_steps, batch_size=o.server_batch_size,
                                     lr=o.server_lr, temperature=o.temperature, schedule=o.server_schedule,
                                     generator=gen)  # fmt: skip
                after.append(distill_kl(model, x, teacher, o.temperature))
                fused[a] = get_params(model)
            out["kl_start"] = torch.tensor(sum(before) / len(before), device=self.ctx.device)
            out["kl_end"] = torch.tensor(sum(after) / len(after), device=self.ctx.device)
        for a, params in fused.items():
            out.update({f"g/{a}/{k}": v for k, v in params.items()})
        return out

    # --- evaluation ------------------------------------------------------------------------------------------
    def generic_model(self, server: Tensors) -> Predictor | None:
        """The global model with one architecture; None with several (no single generic model exists)."""
        if len(self.archs) != 1:
            return None
        return Predictor(self.models[self.archs[0]], self.global_params(server, self.archs[0]))

    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        arch = self.arch_of(int(state["cid"]))
        return Predictor(self.models[arch], self.global_params(server, arch))

    def zero_shot(self, server: Tensors, data: ClientData) -> Predictor | None:
        """A new client: its architecture's global model."""
        arch = self.arch_of(data.cid)
        return Predictor(self.models[arch], self.global_params(server, arch))

    def personalize(
        self, server: Tensors, data: ClientData, budget: Budget, generator: torch.Generator
    ) -> Iterator[Predictor]:
        """A new client fine-tunes its architecture's global model (the generic model is per architecture)."""
        arch = self.arch_of(data.cid)
        yield from finetune_epochs(self.models[arch], self.global_params(server, arch), data, budget, generator)

    # --- diagnostics -----------------------------------------------------------------------------------------
    def diagnostics(self, rnd: int, server: Tensors, state_of: Callable[[int], Tensors]) -> dict[str, Any]:
        if "kl_start" not in server:
            return {}
        return {"distill_kl_start": round(float(server["kl_start"]), 6),
                "distill_kl_end": round(float(server["kl_end"]), 6)}  # fmt: skip


def _reply_only(state: Tensors, trained: Tensors) -> tuple[Tensors, Tensors]:
    """The trained model replied, the client's state as it was."""
    return trained, state
