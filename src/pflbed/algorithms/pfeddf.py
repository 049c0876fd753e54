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

from pydantic import Field

from pflbed.algorithms.base import ClientContext, ClientData, Predictor, Tensors
from pflbed.algorithms.feddf import FedDF, FedDFOptions
from pflbed.algorithms.training import get_params, load_params, local_sgd


class PFedDFOptions(FedDFOptions):
    """FedDF's options plus the local fine-tuning length."""

    finetune_epochs: int | None = Field(
        None, ge=1, description="local fine-tuning epochs from the global model at train.lr (None: train.local_epochs)"
    )


class PFedDF(FedDF):
    name = "pfeddf"
    Config = PFedDFOptions

    def client_update(
        self, payload: Tensors, state: Tensors, data: ClientData, cctx: ClientContext
    ) -> tuple[Tensors, Tensors]:
        """FedDF's reply first, then fine-tune the *received* global model into the personal state."""
        reply, _ = super().client_update(payload, state, data, cctx)
        t = self.ctx.cfg.train
        model = self.models[self.arch_of(data.cid)]
        load_params(model, payload)
        epochs = self.opts.finetune_epochs or t.local_epochs
        local_sgd(model, data, epochs=epochs, batch_size=t.batch_size, lr=t.lr,
                  momentum=t.momentum, weight_decay=t.weight_decay, generator=cctx.generator)  # fmt: skip
        new_state = {"cid": state["cid"], **{f"p/{k}": v for k, v in get_params(model).items()}}
        return reply, new_state

    def personal_model(self, server: Tensors, state: Tensors) -> Predictor:
        """The stored fine-tuned model; the architecture's global model for a client never sampled."""
        personal = {k[2:]: v for k, v in state.items() if k.startswith("p/")}
        if not personal:
            return super().personal_model(server, state)
        return Predictor(self.models[self.arch_of(int(state["cid"]))], personal)
