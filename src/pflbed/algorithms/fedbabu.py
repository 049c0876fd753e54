"""FedBABU — Oh, Kim & Yun, "FedBABU: Towards Enhanced Representation for Federated Image Classification",
ICLR 2022 (Algorithm 1).

Model θ = (θ_ext, θ_cls): body (feature extractor, the model's body blocks) and head (classifier, the head blocks).

Federated training ("Body Aggregation and Body Update"): the head θ_cls is randomly initialized once, identical for
every client, and NEVER updated (its learning rate is zero throughout). Client m in round t loads
(θ_ext^t, θ_cls^0) and runs E epochs of local SGD (`train.*`) on the body only; it uploads θ_ext^{t,m}.
Server: θ_ext^{t+1} = Σ_m (|D_m| / Σ|D|) · θ_ext^{t,m} (FedAvg on the body); θ_cls stays θ_cls^0.

Evaluation ("and Personalization"): the global model (trained body + fixed initial head) is the generic model
(G-FL). FedBABU's personalized model is that global model fine-tuned on each client's own data — in pflbed that is
`personalize`, which the engine runs for every participated client under `eval.finetune` (reported as `final.ft`,
i.e. "FedBABU+FT", with `eval.ft_epochs` / `eval.ft_lr`) and for new clients. **P-FL of FedBABU is the `final.ft`
figure.** `personal_model` returns the un-fine-tuned global model (client state is empty), so the per-round
`pfl_acc` curve is FedBABU *before* fine-tuning.

Options (`algorithm.<key>`): `finetune` (default "full"): what `budget.method == "ft"` trains — "full" = body and
head, as in the paper's main results; "head" = the head alone on the frozen body (one of the paper's ablations).
`budget.method == "lp"` always trains the head only.

Interpretations and deviations:
- The fixed head is the head of the run's initial model (`ctx.initial_params`, the zoo's default initialization),
  i.e. one random draw shared by all clients, as the paper prescribes.
- The fixed head is sent down with the body each round (the paper broadcasts the whole model), but only the body
  goes up; the server keeps the head as initialized.
- Aggregation weighted by |D_m| (FedAvg); the authors' code takes the plain mean (`main_fed.py`), the same under
  its equal shards. Zero-shot for new clients is the global model with its fixed head.
- Head-only fine-tuning (`finetune: head` or `lp`) trains the head on body features computed once in eval mode
  (BatchNorm with its running statistics, dropout off). On a model without BatchNorm or dropout (`cnn`, `lenet5`,
  `mlp`) this equals a train-mode forward through the frozen body; on one with them (`resnet18`, `lenet5_bn`,
  `alexnet_small`) it does not, and the authors' models use batch statistics always (BatchNorm without running
  statistics): a deviation there.
- Momentum (if configured) restarts every round; fine-tuning uses the engine's budget (lr, epochs, momentum).
- The authors' fine-tuning budget (their `analysis.ipynb` and `--ft_ep`, github.com/jhoon-oh/FedBABU) is 5 epochs
  of SGD at lr 1e-3, momentum 0.9, batch 50 on the whole model, the same for FedAvg+FT; the engine's defaults are
  1 epoch at 0.01 with `train.*`'s momentum and batch. `eval.ft_epochs: 5`, `eval.ft_lr: 0.001`, `train.momentum:
  0.9` and `train.batch_size: 50` give theirs.
- Two of the authors' training choices are not made here: their lr drops ×0.1 at 1/2 and 3/4 of the rounds (pflbed
  has no schedule), and they fine-tune the checkpoint of best test accuracy (the PFLBED protocol never selects on
  test; the final model is fine-tuned).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from pflbed.algorithms.base import Algorithm, Budget, ClientData, Context, Predictor, Tensors
from pflbed.algorithms.local_sgd import LocalSGDPlan, Phase
from pflbed.algorithms.partial import blocks_for, personalize_blocks, subset
from pflbed.algorithms.training import WeightedMean
from pflbed.search import Space


class FedBABUOptions(BaseModel):
    """FedBABU options."""
    search: ClassVar[dict[str, Space]] = {}  # `finetune` is the protocol's choice of what adapts, not a knob

    model_config = ConfigDict(extra="forbid")
    finetune: Literal["full", "head"] = Field(
        "full", description="personalization 'ft' trains body + head (full, the paper's main results) or the head"
    )


class FedBABU(Algorithm):
    name = "fedbabu"
    dp_refused = None  # replies: the shared entries' new values, averaged (client-level DP applies)
    Config = FedBABUOptions

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        m = ctx.model
        self.head, self.body = m.head_blocks(), m.body_blocks()
        self.body_keys = m.state_keys(self.body)

    def init_server(self) -> Tensors:
        return dict(self.ctx.initial_params)  # body to train + the head that stays fixed

    def configure(self, rnd: int, server: Tensors, cids: list[int]) -> dict[int, Tensors]:
        return {c: server for c in cids}

    def sgd_plan(self, payload: Tensors, state: Tensors, data: ClientData) -> LocalSGDPlan:
        t = self.ctx.cfg.train
        return LocalSGDPlan(
            payload,
            (Phase(tuple(self.body), t.local_epochs, t.lr),),
            lambda params: (subset(params, self.body_keys), state),
        )

    def aggregator(self, rnd: int, server: Tensors, weights: dict[int, float]) -> WeightedMean:
        return WeightedMean(weights, self.body_keys, base=server)

    def generic_model(self, server: Tensors) -> Predictor:
        return Predictor(self.ctx.model, server)

    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        return self.generic_model(server)  # P-FL proper is the fine-tuned model: `final.ft`

    def personalize(
        self, server: Tensors, data: ClientData, budget: Budget, generator: torch.Generator
    ) -> Iterator[Predictor]:
        model = self.ctx.model
        ft = model.block_names() if self.opts.finetune == "full" else self.head
        blocks = blocks_for(budget, model, lp=self.head, ft=ft)
        yield from personalize_blocks(model, server, data, budget, generator, blocks)
