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
"""

from __future__ import annotations

from typing import ClassVar

import torch

from pflbed.algorithms import distill as kd
from pflbed.algorithms.ktpfl import KTpFL, TransferOptions
from pflbed.search import Space


class SimPFLOptions(TransferOptions):
    """Sim-pFL options: the shared knowledge-transfer options only."""
    search: ClassVar[dict[str, Space]] = TransferOptions.search


class SimPFL(KTpFL):
    name = "sim_pfl"
    Config = SimPFLOptions

    def mixing(self, V: torch.Tensor, S: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cosine-similarity weights of this round's predictions, rows normalized."""
        W = kd.normalize_rows(kd.cosine_similarity_matrix(S).to(V.dtype))
        return kd.mix(W, S), W
