"""Do FedBasis clients group by domain? Summarize the final α heat-maps (paper Fig. 4) of a bench suite's runs.

Each FedBasis run writes `plots/fedbasis_alpha.csv`: per participated client its domain and, per block, the mixing
weights of the bases in its model (major basis first). For every block this prints

- the mean L1 distance between the coefficient vectors of two clients of the *same* domain and of *different*
  domains (grouping by domain means the first is clearly smaller), and
- the accuracy of predicting a client's domain from its coefficients by the nearest domain centroid computed
  without that client (leave-one-out; chance = 1 / number of domains).

    python benchmarks/fedbasis_alpha.py [suite.yaml]
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import torch

from pflbed.results.bench import Bench, load_suite


def read_alpha(path: Path) -> tuple[list[int], dict[str, torch.Tensor]]:
    """(domain per client, {block: clients × bases weights}) from a run's `fedbasis_alpha.csv`."""
    with path.open() as f:
        rows = list(csv.reader(f))
    head, body = rows[0], rows[1:]
    domains = [int(r[1]) for r in body]
    blocks: dict[str, list[int]] = {}
    for j, name in enumerate(head[2:], start=2):
        blocks.setdefault(name.split("/")[0], []).append(j)
    return domains, {b: torch.tensor([[float(r[j]) for j in cols] for r in body]) for b, cols in blocks.items()}


def grouping(domains: list[int], a: torch.Tensor) -> tuple[float, float, float]:
    """(mean L1 within domains, mean L1 across domains, leave-one-out nearest-centroid domain accuracy)."""
    d = torch.tensor(domains)
    dist = torch.cdist(a, a, p=1)
    same = d[:, None] == d[None, :]
    off = ~torch.eye(len(d), dtype=torch.bool)
    within, across = dist[same & off].mean().item(), dist[~same].mean().item()
    hits = 0
    for i in range(len(d)):
        keep = torch.arange(len(d)) != i
        cents = {k: a[keep & (d == k)].mean(0) for k in d.unique().tolist() if (keep & (d == k)).any()}
        guess = min(cents, key=lambda k: (a[i] - cents[k]).abs().sum().item())
        hits += int(guess == domains[i])
    return within, across, hits / len(d)


def main(suite_path: str = "benchmarks/suites/fmnist_rot4_fedbasis.yaml") -> None:
    bench = Bench(load_suite(suite_path))
    print("| run | block | L1 within domain | L1 across domains | domain from α (LOO) |")
    print("|---|---|---|---|---|")
    for table, (_, method, seed), path in bench.cell_files("plots/fedbasis_alpha.csv"):
        domains, blocks = read_alpha(path)
        for block, a in blocks.items():
            w, x, acc = grouping(domains, a)
            print(f"| {table.name}/{method}/seed{seed} | {block} | {w:.3f} | {x:.3f} | {100 * acc:.0f} % |")


if __name__ == "__main__":
    main(*sys.argv[1:])
