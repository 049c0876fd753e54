"""Algorithms whose server state is the model plus a tensor of their own per trainable parameter (SCAFFOLD's control
variate c, FedDyn's h), and whose clients keep one such tensor too (c_i, g_k), all starting at zero.

The extra tensors live in the server state under `<prefix><parameter name>`; evaluation sees the model part
alone, one dict per server state (cached), so the evaluation batches every client's forward together.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from pflbed.algorithms.base import Algorithm, Context, Predictor, Tensors


class ModelWithExtras(Algorithm):
    prefix: ClassVar[str]

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.params = [k for k, _ in ctx.model.named_parameters()]
        self.model_keys = list(ctx.initial_params)
        self._cache: tuple[Tensors, Tensors] | None = None  # (server state, its model part)

    def zeros(self) -> Tensors:
        return {k: torch.zeros_like(self.ctx.initial_params[k]) for k in self.params}

    def init_server(self) -> Tensors:
        return {**self.ctx.initial_params, **{f"{self.prefix}{k}": v for k, v in self.zeros().items()}}

    def init_client(self, cid: int) -> Tensors:
        return self.zeros()

    def model_part(self, server: Tensors) -> Tensors:
        """The model alone (cached per server state, held so that no later state can take its address: evaluation
        sees one parameter dict)."""
        if self._cache is None or self._cache[0] is not server:
            self._cache = (server, {k: server[k] for k in self.model_keys})
        return self._cache[1]

    def generic_model(self, server: Tensors) -> Predictor:
        return Predictor(self.ctx.model, self.model_part(server))

    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        return self.generic_model(server)
