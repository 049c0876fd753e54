"""LG-FedAvg — Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov & Morency, "Think Locally, Act Globally:
Federated Learning with Local and Global Representations", arXiv:2001.01523, 2020 (NeurIPS 2019 Workshop on
Federated Learning).

Model: device m computes a *local representation* H_m = ℓ_m(X; θ^l_m) with its own lower layers, and a *global
model* g(H; θ^g) — the top layers, shared by all devices — predicts from it. "Think locally, act globally": the
local part stays on the device, only the global top is communicated.

Device m in round t: load (θ^l_m, θ^g_t) and run local SGD on both jointly for E epochs on its own data
(`train.*`); send θ^g_{t,m} only, keep θ^l_m.  Server: θ^g_{t+1} = Σ_m (|D_m| / Σ|D|) · θ^g_{t,m} over the sampled
devices.  P-FL model of device m = its own lower blocks + the current global top.

Options (`algorithm.<key>`):
- `global_blocks` (default 1): how many TOP blocks form the global model. The global part is always the LAST blocks
  (the classifier end) and never the first — sharing the first layers is the opposite method (FedPer/FedRep-style)
  and a known trap of peer libraries (REFERENCE.md). Default 1 (the classifier) because it is the one block that is
  "the top" in every zoo model. The official MNIST run keeps the top 3 of its 5-layer MLP global
  (`--num_layers_keep 3`); on the 3-block `mlp` the closest split is `global_blocks: 2`. A value whose lowest block
  holds no parameters (`resnet18`'s `pool`: 2 there) would split the model as one fewer does, and is refused.
- `lp` (default "local"): what a *new* client trains under `budget.method == "lp"` — see below.

Interpretations and deviations:
- No FedAvg warm start. The official scripts first train FedAvg and start LG-FedAvg from a FedAvg checkpoint
  (`--load_fed best_400.pt` / `best_1200.pt`); here every device's lower blocks and the global top start from the
  run's initial model. Warm-starting needs a FedAvg phase inside the run and is not implemented.
- Aggregation is weighted by |D_m|; the official code takes the plain mean over the sampled devices (the same
  under its equal-size shards).
- Only the supervised objective: the paper's optional auxiliary objectives on the local representations
  (unsupervised / fair representation learning) are not implemented.
- The official code keeps, per device, the round with the best *test* accuracy ("best local models"); pflbed never
  selects on test — the run reports the last round and the round chosen on validation.
- The official CIFAR CNN (`models/Nets.py`) lists its weight groups as [fc1, fc2, fc3, conv2, conv1] and
  `main_lg.py` keeps the last `--num_layers_keep` of the list global, so the README's CIFAR command
  (`--num_layers_keep 2`) makes the two *conv* layers global; we follow the paper's definition (global = top).
- No generic model (the global top alone is not a classifier of raw inputs; G-FL is null) and no zero-shot model.
  The official code also reports the accuracy of the plain average of every device's whole model and of
  ensembles of all devices' outputs; both need every device's local layers in one place, which the protocol never
  sends, so neither is offered.
- New clients: lower blocks from the initial model + the trained global top. `ft` trains everything. `lp` = "local"
  (default) trains only the lower, local blocks under the frozen global top — the LG-FedAvg reading of "keep the
  federated part fixed, learn the personal part", and how the method adapts a new device. This is not a linear
  probe; `lp: head` gives the library's literal linear probe (head on the frozen, untrained lower blocks) instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from pflbed.algorithms.base import Algorithm, Budget, ClientData, Context, Predictor, Tensors
from pflbed.algorithms.local_sgd import LocalSGDPlan, Phase
from pflbed.algorithms.partial import blocks_for, personalize_blocks, split_top, subset
from pflbed.algorithms.training import WeightedMean
from pflbed.search import Space


class LGFedAvgOptions(BaseModel):
    """LG-FedAvg options."""
    search: ClassVar[dict[str, Space]] = {}  # which blocks are global: an architecture choice; `lp`: the protocol's

    model_config = ConfigDict(extra="forbid")
    global_blocks: int = Field(1, ge=1, description="top blocks forming the shared global model (1 = the classifier)")
    lp: Literal["local", "head"] = Field(
        "local", description="new clients, method lp: train the local lower blocks (global top frozen) or the head only"
    )


class LGFedAvg(Algorithm):
    name = "lg_fedavg"
    dp_refused = None  # replies: the shared entries' new values, averaged (client-level DP applies)
    Config = LGFedAvgOptions

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        m = ctx.model
        self.global_, self.local = split_top(m, self.opts.global_blocks, "global_blocks", splits_state=True)
        self.global_keys, self.local_keys = m.state_keys(self.global_), m.state_keys(self.local)

    def init_server(self) -> Tensors:
        return subset(self.ctx.initial_params, self.global_keys)

    def init_client(self, cid: int) -> Tensors:
        return subset(self.ctx.initial_params, self.local_keys)

    def configure(self, rnd: int, server: Tensors, cids: list[int]) -> dict[int, Tensors]:
        return {c: server for c in cids}

    def sgd_plan(self, payload: Tensors, state: Tensors, data: ClientData) -> LocalSGDPlan:
        t = self.ctx.cfg.train
        phases = (Phase(tuple(self.ctx.model.block_names()), t.local_epochs, t.lr),)
        return LocalSGDPlan(
            {**state, **payload},
            phases,
            lambda params: (subset(params, self.global_keys), subset(params, self.local_keys)),
        )

    def aggregator(self, rnd: int, server: Tensors, weights: dict[int, float]) -> WeightedMean:
        return WeightedMean(weights, self.global_keys)

    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        return Predictor(self.ctx.model, {**state, **server})

    def personalize(
        self, server: Tensors, data: ClientData, budget: Budget, generator: torch.Generator
    ) -> Iterator[Predictor]:
        start = {**self.init_client(data.cid), **server}
        lp = self.local if self.opts.lp == "local" else self.ctx.model.head_blocks()
        blocks = blocks_for(budget, self.ctx.model, lp=lp)
        yield from personalize_blocks(self.ctx.model, start, data, budget, generator, blocks)

    def zero_shot(self, server: Tensors, data: ClientData) -> Predictor | None:
        return None  # the global top on untrained lower blocks is no model of the new client
