"""FedPer — Arivazhagan, Aggarwal, Singh & Choudhary, "Federated Learning with Personalization Layers",
arXiv:1912.00818, 2019.

Model (Eq. 1): ŷ = f(x; W_B, W_Pj) — K_B shared *base* layers followed by K_P *personalization* layers private to
client j. K_P counts blocks from the top (§4.3: K_P = 1 is the classifier alone, K_P = 2 adds the block below it).
The paper counts basic blocks of ResNet-34 and MobileNet-v1 (§4.1); the zoo's `resnet34` and `mobilenet_v1` are
built in that unit (a block per basic block), so there `personal_blocks` is the paper's K_P; on other models a
block is the model's own (a layer of `cnn`, a whole stage of `resnet18`). §4.4's check that the base learns (its
base replaced by one linear layer, Fig. 5, 6, 9) is the model `resnet34_linear_base` / `mobilenet_v1_linear_base`
with `personal_blocks: 2`. A K_P whose lowest block holds no
parameters (`resnet18`'s `pool`: K_P = 2 there) would split the model as K_P − 1 does and is refused, naming
the nearest values that differ (`partial.split_top`).

Client j, round k (Algorithm 1): receive W_B^(k-1); (W_B,j^(k), W_Pj^(k)) ← SGD_j(W_B^(k-1), W_Pj^(k-1), η) — e
epochs of mini-batch SGD on *both* parts from the client's own data; send W_B,j^(k) only.
Server (Algorithm 2): W_B^(k) = Σ_j γ_j · W_B,j^(k), γ_j = n_j / Σ n — over the clients sampled this round, with
the engine's weights |D_m|.
App. A.3 option (`head_finetune_epochs`): at the start of each round first train W_Pj alone, W_B frozen, for that
many epochs (the paper uses 1), then run the usual local SGD.

Options (`algorithm.<key>`): `personal_blocks` K_P (default 1 = classifier; the paper finds K_P = 1 best on
CIFAR-100, K_P = 2 on CIFAR-10); `head_finetune_epochs` (default 0 = off, as in the paper's main results).
Local epochs, batch size, lr, momentum and weight decay are `train.*` (paper: e = 4, lr 0.01 constant, 100 rounds).

Interpretations and deviations:
- Personal layers start from the run's initial model (`ctx.initial_params`), identical for every client. Algorithm 1
  says "initialize W_Pj at random"; one shared random draw is such an initialization, and it makes the round-0
  personal model equal the initial global model (the same starting point as FedAvg, so comparisons isolate the
  training rule).
- Partial participation (`federation.sample_fraction`) is allowed; the paper assumes every client in every round.
  A client's personal layers only change in rounds it is sampled.
- K_P = 0 is FedAvg (§4) — use `fedavg`; here K_P ≥ 1 and at least one block must stay in the base.
- There is no global model with a head (G-FL is null) and no zero-shot model: a new client has no personal layers.
- New clients (not in the paper): start from the server base plus the *initial* personal layers (what a joining
  client would get under Algorithm 1); `ft` trains everything, `lp` only the K_P personal blocks on the frozen base
  (a true linear probe when K_P is the classifier).
- Momentum (if configured) restarts every round and every phase: the paper uses plain SGD.

"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field

from pflbed.algorithms.base import Algorithm, Budget, ClientData, Context, Predictor, Same, Tensors
from pflbed.algorithms.local_sgd import LocalSGDPlan, Phase
from pflbed.algorithms.partial import blocks_for, personalize_blocks, split_top, subset
from pflbed.algorithms.training import WeightedMean
from pflbed.search import Space


class FedPerOptions(BaseModel):
    """FedPer options."""

    model_config = ConfigDict(extra="forbid")
    search: ClassVar[dict[str, Space]] = {}  # nothing beyond the shared train.* (K_P is an architecture choice)
    personal_blocks: int = Field(1, ge=1, description="K_P: top blocks kept personal (1 = the classifier)")
    head_finetune_epochs: int = Field(
        0, ge=0, description="App. A.3: epochs training the personal layers alone (base frozen) at the start of a round"
    )


class FedPer(Algorithm):
    name = "fedper"
    dp_refused = None  # replies: the shared entries' new values, averaged (client-level DP applies)
    Config = FedPerOptions

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        m = ctx.model
        self.personal, self.base = split_top(m, self.opts.personal_blocks, "personal_blocks", splits_state=True)
        # With K_P = the head, every client's body is the server base: evaluation computes its features once.
        self.shared_body = self.personal == m.head_blocks()
        self.personal_keys = m.state_keys(self.personal)
        self.base_keys = m.state_keys(self.base)

    def init_server(self) -> Tensors:
        return subset(self.ctx.initial_params, self.base_keys)

    def init_client(self, cid: int) -> Tensors:
        return subset(self.ctx.initial_params, self.personal_keys)

    def configure(self, rnd: int, server: Tensors, cids: list[int]) -> dict[int, Tensors]:
        return {c: server for c in cids}

    def sgd_plan(self, payload: Tensors, state: Tensors, data: ClientData) -> LocalSGDPlan:
        t = self.ctx.cfg.train
        phases = (Phase(tuple(self.personal), self.opts.head_finetune_epochs, t.lr),  # App. A.3 (0: none)
                  Phase(tuple(self.ctx.model.block_names()), t.local_epochs, t.lr))  # fmt: skip
        return LocalSGDPlan(
            {**payload, **state},
            phases,
            lambda params: (subset(params, self.base_keys), subset(params, self.personal_keys)),
        )

    def aggregator(self, rnd: int, server: Tensors, weights: dict[int, float]) -> WeightedMean:
        return WeightedMean(weights, self.base_keys)

    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        key = ("fedper-base", Same(server)) if self.shared_body else None
        return Predictor(self.ctx.model, {**server, **state}, key)

    def personalize(
        self, server: Tensors, data: ClientData, budget: Budget, generator: torch.Generator
    ) -> Iterator[Predictor]:
        start = {**server, **self.init_client(data.cid)}
        blocks = blocks_for(budget, self.ctx.model, lp=self.personal)
        yield from personalize_blocks(self.ctx.model, start, data, budget, generator, blocks)

    def zero_shot(self, server: Tensors, data: ClientData) -> Predictor | None:
        return None  # a new client has no personal layers yet
