"""pFedDF — FedDF (Lin, Kong, Stich & Jaggi, "Ensemble Distillation for Robust Model Fusion in Federated
Learning", NeurIPS 2020) followed by local fine-tuning, the personalized baseline of the KT-pFL paper (Zhang et al.,
NeurIPS 2021, §5.1, footnote 2: "We use the fused prototype models at the last round of FedDF as the pFedDF's
initial models. Each client fine-tunes it on the local private dataset with several epochs.").

Why fine-tune: FedDF's fused models are global — one per architecture — so under label skew they fit no client
well; a few local epochs from the fused model adapt it to the client's own label distribution while keeping what
the ensemble taught it.

Everything of FedDF is unchanged (training, fusion, server distillation, options — see `feddf`); pFedDF adds:
  - `finetune_epochs` (default: `train.local_epochs`, the clients' local budget in every other method): epochs of
    local SGD at `train.lr` (`train.batch_size`, `train.momentum`, `train.weight_decay`) that turn the received
    global model into the client's personal model.
  - Exact order inside a participating client's round r: (1) load the received global model g_{r−1} of its
    architecture, run FedDF's local training and compute the reply (its parameters); (2) load g_{r−1} again (not
    the locally trained model) and fine-tune it for `finetune_epochs`; (3) keep the result as personal state.
    Both phases draw their mini-batch order from the client's (seed, round, id) generator, (2) continuing where
    (1) stopped. The reply is exactly FedDF's, so the global models of FedDF and pFedDF are identical.
  - Both trainings are one plan (`plan`: the fine-tuning a second model of it, `local_sgd.Phase.model`), so
    `executor.batch_clients` trains a round's clients of the run's model together.
  - Personal model: the client's stored fine-tuned model; a client never sampled yet falls back to its
    architecture's current global model.

Deviations from the KT-pFL paper's pFedDF:
  - The paper fine-tunes the fused models *of the last round* once, after FedDF finished. Here fine-tuning happens
    within each round a client participates in, from the global model it received, so the personal model is
    evaluated throughout training and is built from the global model one round older than the last fusion
    (g_{T−1} for a client sampled in the final round T; older for a client last sampled earlier). The last fused
    model g_T is never delivered to the clients in this engine. With one architecture, `eval.finetune: [ft]`
    additionally reports the paper's protocol exactly (fine-tuning g_T).
  - "Several epochs" is unspecified in the paper; `finetune_epochs` defaults to the local epochs E (the paper's own
    E is 20); one epoch, an earlier default, is not "several" (the suite figures for both: benchmarks/results).
  - Fine-tuning costs client compute in every participating round (`finetune_epochs` extra epochs), not once.
  - Plus all of FedDF's deviations (see `feddf`).

Communication: identical to FedDF (the personal model never leaves the client).
"""

from __future__ import annotations

from functools import partial
from typing import ClassVar

import torch
from pydantic import Field

from pflbed.algorithms.base import Predictor, Tensors
from pflbed.algorithms.feddf import FedDF, FedDFOptions
from pflbed.algorithms.local_sgd import LocalSGDPlan, Phase
from pflbed.models import BlockNet
from pflbed.search import IntSearch, Space, same_as

PERSONAL = "p/"  # the fine-tuned model's tensors, in the plan and the client's state


class PFedDFOptions(FedDFOptions):
    """FedDF's options plus the local fine-tuning length."""
    search: ClassVar[dict[str, Space]] = {**FedDFOptions.search, "finetune_epochs": IntSearch(1, 20)}

    finetune_epochs: int | None = Field(
        None, ge=1, description="local fine-tuning epochs from the global model at train.lr (None: train.local_epochs)",
        json_schema_extra=same_as("train.local_epochs"),
    )


class PFedDF(FedDF):
    name = "pfeddf"
    Config = PFedDFOptions

    def plan(self, model: BlockNet, payload: Tensors, state: Tensors) -> LocalSGDPlan:
        """FedDF's phase (the reply), then `finetune_epochs` from the *received* global model again — a second
        model of the plan (`p/`) — into the personal state."""
        t = self.ctx.cfg.train
        epochs = self.opts.finetune_epochs or t.local_epochs
        every = tuple(model.block_names())
        phases = (Phase(every, t.local_epochs, t.lr), Phase(every, epochs, t.lr, model=PERSONAL))
        start = {**payload, **{PERSONAL + k: v for k, v in payload.items()}}
        return LocalSGDPlan(start, phases, partial(_split, list(payload), state["cid"]))

    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        """The stored fine-tuned model; the architecture's global model for a client never sampled."""
        personal = {k[len(PERSONAL) :]: v for k, v in state.items() if k.startswith(PERSONAL)}
        if not personal:
            return super().personal_model(server, state)
        return Predictor(self.models[self.arch_of(int(state["cid"]))], personal)


def _split(keys: list[str], cid: torch.Tensor, trained: Tensors) -> tuple[Tensors, Tensors]:
    """(FedDF's reply, the personal state) from the plan's two models."""
    return {k: trained[k] for k in keys}, {"cid": cid, **{k: trained[k] for k in trained if k.startswith(PERSONAL)}}
