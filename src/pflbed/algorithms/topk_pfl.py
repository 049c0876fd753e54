"""TopK-pFL — the top-K baseline of KT-pFL (Zhang et al., "Parameterized Knowledge Transfer for Personalized
Federated Learning", NeurIPS 2021, §5.1 Baselines and footnote 3, K = 5; "TopK-pFD" in Table 1): client n's
target is the uniform mean of the soft predictions of the K clients most similar to it (cosine similarity of the
soft predictions on the round's public batch): t_n = (1/K)·Σ_{m ∈ topK(n)} s_m.

Round structure, options and pipelining are those of `ktpfl` (see its module docstring); option `k` (default 5,
the paper's) and `include_self` (default true). Interpretations: the similarity is that of soft predictions (see
`sim_pfl`); the client itself counts among its K most similar (its cosine is 1) unless `include_self` is false, in
which case the K most similar *other* clients are used; K larger than the number of candidates means all of them;
ties are broken by `torch.topk`. `W` stores the last round's matrix for diagnostics and the heat-map.
Deviation: T defaults to 10, KT-pFL's own; the authors' code for this baseline takes its soft predictions and
distils at T = 1 (`temperature: 1`). Their code's K is about half the clients; the paper's footnote, followed
here, says 5.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field

from pflbed.algorithms import distill as kd
from pflbed.algorithms.ktpfl import KTpFL, TransferOptions
from pflbed.search import IntSearch, Space


class TopKPFLOptions(TransferOptions):
    """TopK-pFL options: the shared knowledge-transfer options plus K."""
    search: ClassVar[dict[str, Space]] = {**TransferOptions.search, "k": IntSearch(1, 10)}  # the paper: 5

    k: int = Field(5, ge=1, description="number of most similar clients averaged (paper: 5)")
    include_self: bool = Field(True, description="the client counts among its own K most similar")


class TopKPFL(KTpFL):
    name = "topk_pfl"
    Config = TopKPFLOptions

    def mixing(self, V: torch.Tensor, S: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Uniform weights on the K most similar clients of this round, zero elsewhere."""
        sim = kd.cosine_similarity_matrix(S).to(V.dtype)
        n = sim.shape[0]
        if not self.opts.include_self and n > 1:
            # cosines lie in [-1, 1]: self never makes the cut
            sim = sim - 3.0 * torch.eye(n, dtype=sim.dtype, device=sim.device)
            W = kd.topk_rows(sim, min(self.opts.k, n - 1))
        else:
            W = kd.topk_rows(sim, self.opts.k)
        return kd.mix(W, S), W
