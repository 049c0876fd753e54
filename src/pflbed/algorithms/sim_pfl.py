"""Sim-pFL — the similarity baseline of KT-pFL (Zhang et al., "Parameterized Knowledge Transfer for Personalized
Federated Learning", NeurIPS 2021, §5.1 Baselines; "Sim-pFD" in Table 1): KT-pFL with the learned coefficient
matrix replaced by a fixed rule — client n's weights over the teachers m are the cosine similarities of their soft
predictions on the round's public batch, normalized to sum 1:
W[n, m] = cos(s_n, s_m) / Σ_m' cos(s_n, s_m'), t_n = Σ_m W[n, m]·s_m (flattened over samples and classes).

Round structure, options and pipelining are those of `ktpfl` (see its module docstring). Interpretations: the
paper's §1 speaks of "cosine similarity between different model parameters", §5.1 of similarity between "two local
soft predictions"; heterogeneous models have no comparable parameters, so the soft predictions are used. The
client itself is included (cos = 1, its largest weight). Probabilities are non-negative, so every similarity is
≥ 0 and the rows are valid weights. The similarities are recomputed from every round's uploads (nothing learned);
`W` stores the last round's matrix for diagnostics and the heat-map.

Option `weights` — how the similarities become a row of weights (the paper names none):
  - `cosine` (default): cos / Σ cos, the paper's sentence read as it stands. Soft predictions on one public batch
    are alike however the clients' labels differ, so the rows come out close to uniform, FedMD's rule: the final W
    of the fmnist_ktpfl suite's runs (20 clients, T = 10, 3 seeds) has a mean row entropy of 2.966–2.976 nats with
    2 labels per client and 2.995 with all labels, against log 20 = 2.996 for uniform rows.
  - `minmax`: the authors' code (engine_cos.py): (cos − the row's smallest cos) / Σ (cos − the row's smallest), so
    a client's least similar teacher gets weight 0 and the others spread over the range of the similarities (a
    row whose similarities are all equal is uniform). In the same runs: 2.66–2.80 nats (2 labels) and 2.76–2.87
    (all labels) at T = 10, 1.39–1.40 and 2.75–2.79 at T = 1; the P-FL of every variant stays within the seeds'
    spread (docs/results/ktpfl.md).

Deviation: the authors' code for this baseline (and for FedMD and TopK-pFL) takes its soft predictions and distils
at T = 1; T here defaults to 10, KT-pFL's own (`temperature`). The authors' Sim-pFL is `weights: minmax` with
`temperature: 1`.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from pflbed.algorithms import distill as kd
from pflbed.algorithms.ktpfl import KTpFL, TransferOptions
from pflbed.search import Space


class SimPFLOptions(TransferOptions):
    """Sim-pFL options: the shared knowledge-transfer options and how similarities become weights."""
    search: ClassVar[dict[str, Space]] = TransferOptions.search

    weights: Literal["cosine", "minmax"] = Field("cosine", description="a row of weights from the similarities: "
                                                 "cos / Σ cos, or the authors' code's (cos − row min) / Σ (cos − row "
                                                 "min)")  # fmt: skip


class SimPFL(KTpFL):
    name = "sim_pfl"
    Config = SimPFLOptions

    def mixing(self, V: torch.Tensor, S: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cosine-similarity weights of this round's predictions, rows normalized (`weights`)."""
        C = kd.cosine_similarity_matrix(S).to(V.dtype)
        if self.opts.weights == "minmax":  # the authors' code: the least similar teacher of each row gets 0
            C = C - C.min(1, keepdim=True).values
        W = kd.normalize_rows(C)  # a row of zeros (every similarity equal, under minmax) becomes uniform
        return kd.mix(W, S), W
