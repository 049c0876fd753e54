"""FedBasis's Fig. 4 artifact: the final mixing weights per client × block, as a table, a PNG heat-map and a CSV.

The weights shown are those of the combination θ = ½·v' + ½·Σ_k α†[k]·v_k (α† alone without the major basis,
`basis.mixing_weights`), not α† itself: the major basis's fixed half is part of every client's model, and leaving
it out would overstate how much a client leans on one non-major basis. Clients are ordered by domain, then id, so
that clients of one domain sit together and a domain-specific basis shows as a block of rows (the question Fig. 4
answers: do clients of one domain pick the same bases?). `benchmarks/fedbasis_alpha.py` reads the CSV back.

Functions only (no `Algorithm`): `mixing_table` builds the tensor that `write_mixing_weights` writes, so a test
can check the numbers and the files independently of a run.
"""

from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from pflbed.algorithms.basis import mixing_weights


def mixing_table(
    alphas: Mapping[int, torch.Tensor],
    domain: Mapping[int, int],
    k: int,
    major: bool,
    groups: int,
    device: torch.device | str = "cpu",
) -> tuple[list[int], list[str], torch.Tensor]:
    """(clients ordered by domain then id, basis labels, (clients, groups, bases) mixing weights incl. v').

    `alphas`: each client's α† (groups, K); `domain`: each client's domain. Labels are "major" (with the major
    basis, first) then "b0".."b{K−1}". Without clients the table is empty, shape (0, groups, bases), on `device`.
    """
    order = sorted(alphas, key=lambda c: (domain[c], c))
    labels = (["major"] if major else []) + [f"b{i}" for i in range(k)]
    rows = []
    for c in order:
        w_major, w = mixing_weights(alphas[c], major)
        if major:
            w = torch.cat([torch.full((w.shape[0], 1), w_major, device=w.device), w], 1)
        rows.append(w)
    table = torch.stack(rows) if rows else torch.zeros(0, groups, len(labels), device=device)
    return order, labels, table


def write_mixing_weights(
    order: Sequence[int],
    domains: Sequence[int],
    groups: Sequence[str],
    labels: Sequence[str],
    table: torch.Tensor,
    out_dir: Path,
) -> dict[str, str]:
    """`fedbasis_alpha.csv` and the heat-map `fedbasis_alpha.png` of a `mixing_table` in `out_dir` (created).

    CSV: one row per client (in `order`, with its domain from `domains`), then per group (block) every basis's
    weight, 6 decimals, columns "<group>/<label>". PNG: one panel per group on a fixed 0–1 colour scale (panels
    and runs stay comparable), white lines between domains. Returns {artifact key: file name}; no clients: no
    file, {}. `table` is read from host memory (moved there if it is not).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not order:
        return {}
    table = table.cpu()
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_name, png_name = "fedbasis_alpha.csv", "fedbasis_alpha.png"
    with open(out_dir / csv_name, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["client", "domain", *[f"{g}/{b}" for g in groups for b in labels]])
        for i, c in enumerate(order):
            w.writerow([c, domains[i], *[f"{v:.6f}" for v in table[i].reshape(-1).tolist()]])

    n, g = len(order), len(groups)
    fig = Figure(figsize=(1.5 + g * (0.35 * len(labels) + 0.9), min(2.0 + 0.22 * n, 24)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, g, squeeze=False)[0]
    im = None
    ylabels = [f"c{c} d{d}" for c, d in zip(order, domains, strict=True)]
    cuts = [i - 0.5 for i in range(1, n) if domains[i] != domains[i - 1]]
    for j, ax in enumerate(axes):
        im = ax.imshow(table[:, j, :].numpy(), vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set_title(groups[j], fontsize=8)
        ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=7)
        ax.set_yticks(range(n), ylabels if j == 0 else [""] * n, fontsize=6)
        for y in cuts:
            ax.axhline(y, color="white", lw=1)
    fig.suptitle("FedBasis mixing weights per client and block (final α†; clients by domain, id)", fontsize=9)
    fig.colorbar(im, ax=list(axes), label="weight in θ")
    fig.savefig(out_dir / png_name, dpi=120)
    return {"alpha_png": png_name, "alpha_csv": csv_name}
