"""Local-only training: every client trains its own model and nothing is shared.

The lower reference every PFL paper reports. All clients start from the same initial model; a client trains only
in the rounds it is sampled (the same schedule, epochs and lr as the federated methods), so its compute budget
matches theirs. There is no generic model (G-FL is null).
"""

from __future__ import annotations

from pflbed.algorithms.base import Algorithm, ClientContext, ClientData, Predictor, Tensors
from pflbed.algorithms.training import train_from


class LocalOnly(Algorithm):
    name = "local"

    def init_server(self) -> Tensors:
        return {}

    def init_client(self, cid: int) -> Tensors:
        return dict(self.ctx.initial_params)

    def configure(self, rnd: int, server: Tensors, cids: list[int]) -> dict[int, Tensors]:
        return {c: {} for c in cids}

    def client_update(
        self, payload: Tensors, state: Tensors, data: ClientData, cctx: ClientContext
    ) -> tuple[Tensors, Tensors]:
        return {}, train_from(self.ctx.model, state, data, self.ctx.cfg.train, cctx.generator)

    def aggregate(self, rnd: int, server: Tensors, replies: dict[int, Tensors], weights: dict[int, float]) -> Tensors:
        return server

    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        return Predictor(self.ctx.model, state)
