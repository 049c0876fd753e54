"""Local-only training: every client trains its own model and nothing is shared.

The lower reference every PFL paper reports. A client trains only in the rounds it is sampled (the same schedule,
epochs and lr as the federated methods), so its compute budget matches theirs. There is no generic model (G-FL is
null).

Options (`algorithm.<key>`):
  - `architectures` (default none: every client uses `model.name` and starts from the run's initial model): a
    heterogeneous federation by the rule of `ktpfl` / `feddf` — client c gets architectures[⌊c·A / N⌋] and its own
    random initialization, seeded as theirs. It is the no-transfer control of the knowledge-transfer family: on the
    same config a KT-pFL / FedMD client starts from the same weights and runs the same local training, so the
    difference to Local is what the transfer adds. New clients then train their architecture from scratch.

The update is a plan (`plan`), so `executor.batch_clients` trains a round's clients of the run's model together.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field

from pflbed.algorithms.base import Algorithm, Budget, ClientContext, ClientData, Context, Predictor, Tensors
from pflbed.algorithms.local_sgd import LocalSGDPlan, Phase, run_plan
from pflbed.algorithms.training import architecture_of, finetune_epochs, fresh_client_params
from pflbed.models import BlockNet, ModelNames
from pflbed.search import Space


class LocalOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    search: ClassVar[dict[str, Space]] = {}  # nothing beyond the shared train.*
    architectures: ModelNames | None = Field(None, min_length=1, description="heterogeneous clients (ktpfl's rule)")


class LocalOnly(Algorithm):
    name = "local"
    dp_refused = "nothing leaves a client, so there is nothing for DP to protect"
    Config = LocalOptions

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.archs = self.opts.architectures
        self.models: dict[str, BlockNet] = {ctx.cfg.model.name: ctx.model}
        for a in self.archs or []:
            if a not in self.models:
                self.models[a] = ctx.new_model(a)

    def arch_of(self, cid: int) -> str:
        if self.archs is None:
            return self.ctx.cfg.model.name
        return architecture_of(cid, self.archs, len(self.ctx.federation.clients))

    def init_server(self) -> Tensors:
        return {}

    def init_client(self, cid: int) -> Tensors:
        if self.archs is None:
            return dict(self.ctx.initial_params)
        fresh = fresh_client_params(self.models[self.arch_of(cid)], self.ctx.seed, cid)
        return {"cid": torch.tensor(cid, device=self.ctx.device), **fresh}

    def configure(self, rnd: int, server: Tensors, cids: list[int]) -> dict[int, Tensors]:
        return {c: {} for c in cids}

    def client_update(
        self, payload: Tensors, state: Tensors, data: ClientData, cctx: ClientContext
    ) -> tuple[Tensors, Tensors]:
        model = self.models[self.arch_of(data.cid)]
        return run_plan(model, self.plan(model, state), data, self.ctx.cfg.train, cctx.generator)

    def sgd_plan(self, payload: Tensors, state: Tensors, data: ClientData) -> LocalSGDPlan | None:
        """The client's plan where its architecture is the run's model (`executor.batch_clients` stacks clients of
        that one model); None for a client of another architecture, which trains client by client."""
        model = self.models[self.arch_of(data.cid)]
        return self.plan(model, state) if model is self.ctx.model else None

    def plan(self, model: BlockNet, state: Tensors) -> LocalSGDPlan:
        """Every block for `train.local_epochs` epochs from the client's own model; nothing replied."""
        t = self.ctx.cfg.train
        every = (Phase(tuple(model.block_names()), t.local_epochs, t.lr),)
        return LocalSGDPlan(self._params(state), every, partial(_keep, state.get("cid")))

    @staticmethod
    def _params(state: Tensors) -> Tensors:
        return {k: v for k, v in state.items() if k != "cid"}

    def aggregate(self, rnd: int, server: Tensors, replies: dict[int, Tensors], weights: dict[int, float]) -> Tensors:
        return server

    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        model = self.models[self.arch_of(int(state["cid"]))] if "cid" in state else self.ctx.model
        return Predictor(model, self._params(state))

    def personalize(
        self, server: Tensors, data: ClientData, budget: Budget, generator: torch.Generator
    ) -> Iterator[Predictor]:
        """A new client has nothing to start from but an untrained model: train from scratch on its own data."""
        model = self.models[self.arch_of(data.cid)]
        start = self.ctx.initial_params if self.archs is None else fresh_client_params(model, self.ctx.seed, data.cid)
        yield from finetune_epochs(model, dict(start), data, budget, generator)

    def zero_shot(self, server: Tensors, data: ClientData) -> Predictor | None:
        return None


def _keep(cid: torch.Tensor | None, params: Tensors) -> tuple[Tensors, Tensors]:
    """Nothing replied; the trained model kept (with the client's id in a heterogeneous federation)."""
    return {}, params if cid is None else {"cid": cid, **params}
