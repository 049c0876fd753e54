"""FedMD — Li & Wang, "FedMD: Heterogenous Federated Learning via Model Distillation", NeurIPS 2019 Workshop on
Federated Learning (arXiv:1910.03581), as defined by the KT-pFL paper's baselines (Zhang et al., NeurIPS 2021, §5.1):
every client distils towards the *uniform mean* of all clients' soft predictions on the public batch,
t = (1/|A|)·Σ_m s_m — one global consensus, no personalization of the target.

Round structure, options (`architectures`, `public_batch`, `temperature` T = 10, `order`, `epoch_ramp`,
`kl_reduction`, `distill_*`) and the one-round pipelining are those of `ktpfl` (see its module docstring): round r
delivers the consensus formed from round r − 1's uploads, the client distils on that round's public batch, trains
locally, and uploads s = softmax(z/T) on the new batch. FedMD's own round (communicate → aggregate → distribute →
digest → revisit) is the same per-client sequence.

Deviations from Li & Wang: the consensus is the mean of temperature-softmax probabilities and the digest loss is
KL(t ‖ s) (the KT-pFL paper's FedMD; Li & Wang average class scores and do not fix the loss); no transfer-learning
phase on labelled public data before collaboration (the public data here is unlabelled); the consensus averages
the clients replying in the round (all of them under full participation), uniformly — not weighted by |D_m|;
T defaults to 10, KT-pFL's own, where Li & Wang use none and the KT-pFL authors' FedMD code takes its soft
predictions and distils at T = 1 (`temperature: 1`; the fmnist_ktpfl_lowdata suite chooses T on validation).
The stored matrix `W` (diagnostics, heat-map) is the uniform mixing matrix of the last round.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from pflbed.algorithms import distill as kd
from pflbed.algorithms.ktpfl import KTpFL, TransferOptions
from pflbed.search import Space


class FedMDOptions(TransferOptions):
    """FedMD options: the shared knowledge-transfer options only."""
    search: ClassVar[dict[str, Space]] = TransferOptions.search


class FedMD(KTpFL):
    name = "fedmd"
    Config = FedMDOptions

    def mixing(self, V: torch.Tensor, S: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every target is the uniform consensus of the replying clients."""
        U = torch.full_like(V, 1.0 / V.shape[0])
        return kd.mix(U, S), U
