"""FedAvg — McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized Data",
AISTATS 2017, Algorithm 1.

Server: w_{t+1} = Σ_{m∈S_t} (n_m / n_S) · w^m_{t+1}, the weights being the clients' training-set sizes |D_m|.
Client: E epochs of mini-batch SGD (batch B, lr η) from w_t on its own data.

Choices: the whole state dict is averaged, including BatchNorm statistics (FedBN, which keeps them local, is its
own algorithm); momentum, if configured, restarts every round (the paper uses plain SGD). The personal model of
FedAvg is the global model itself; `eval.finetune` adds the FedAvg+FT / FedAvg+LP evaluations.
"""

from __future__ import annotations

from pflbed.algorithms.base import Algorithm, ClientData, Predictor, Tensors
from pflbed.algorithms.local_sgd import LocalSGDPlan, Phase
from pflbed.algorithms.training import WeightedMean


class FedAvg(Algorithm):
    name = "fedavg"
    dp_refused = None  # replies: the shared entries' new values, averaged (client-level DP applies)

    def init_server(self) -> Tensors:
        return dict(self.ctx.initial_params)

    def configure(self, rnd: int, server: Tensors, cids: list[int]) -> dict[int, Tensors]:
        return {c: server for c in cids}

    def sgd_plan(self, payload: Tensors, state: Tensors, data: ClientData) -> LocalSGDPlan:
        t = self.ctx.cfg.train
        every = tuple(self.ctx.model.block_names())
        return LocalSGDPlan(payload, (Phase(every, t.local_epochs, t.lr),), lambda params: (params, state))

    def aggregator(self, rnd: int, server: Tensors, weights: dict[int, float]) -> WeightedMean:
        return WeightedMean(weights)

    def generic_model(self, server: Tensors) -> Predictor:
        return Predictor(self.ctx.model, server)

    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        return self.generic_model(server)
