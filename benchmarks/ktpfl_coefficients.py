"""Do KT-pFL's learned coefficients favour clients with common labels? Summarize the final c matrices of a suite.

Each knowledge-transfer run (KT-pFL, Sim-pFL, TopK-pFL, FedMD) writes `plots/<algorithm>_coefficients.csv`: the
final mixing weights W[n, m] (student n, teacher m) with every client's label set. For each run this prints the
mean off-diagonal weight a student gives a teacher that shares at least one label with it and one that shares
none, and the share of the students' off-diagonal mass that goes to label-sharing teachers next to the share such
teachers have among all teachers (what a uniform c would give). When every client holds every label (the
Dirichlet setting) label *sets* say little, so it also prints the Pearson correlation, over all off-diagonal
(student, teacher) pairs, between W[n, m] and the cosine similarity of the two clients' label distributions
(rebuilt from the run's config: the federation is deterministic in it).

    python benchmarks/ktpfl_coefficients.py [suite.yaml]
"""

from __future__ import annotations

import csv
import functools
import statistics
import sys
from pathlib import Path

import torch

from pflbed.config import DatasetConfig, FederationConfig, load_config
from pflbed.data import load_source
from pflbed.federation.build import build_federation
from pflbed.results.bench import Bench, load_suite

ALGORITHMS = ("ktpfl", "sim_pfl", "topk_pfl", "fedmd")


def read_coefficients(path: Path) -> tuple[list[int], list[set[str]], list[list[float]]]:
    """(client ids in the CSV's row order — rows and columns share it —, their label sets, W)."""
    with path.open() as f:
        rows = list(csv.reader(f))[1:]
    ids = [int(r[0].lstrip("c")) for r in rows]
    return ids, [set(r[2].split()) for r in rows], [[float(v) for v in r[3:]] for r in rows]


def summarize(labels: list[set[str]], w: list[list[float]]) -> tuple[str, str, str, str]:
    share, none, mass, frac = [], [], [], []
    for n, row in enumerate(w):
        sharing = [m for m in range(len(row)) if m != n and labels[n] & labels[m]]
        others = [m for m in range(len(row)) if m != n and not labels[n] & labels[m]]
        share += [row[m] for m in sharing]
        none += [row[m] for m in others]
        off = sum(row[m] for m in sharing + others)
        if off > 0:
            mass.append(sum(row[m] for m in sharing) / off)
            frac.append(len(sharing) / (len(sharing) + len(others)))

    def mean(x: list[float], fmt: str) -> str:
        return format(statistics.mean(x), fmt) if x else "—"

    return mean(share, ".4f"), mean(none, ".4f"), mean(mass, ".0%"), mean(frac, ".0%")


@functools.cache
def client_priors(dataset: str, federation: str, seed: int) -> dict[int, torch.Tensor]:
    """Every client's label distribution; runs of one setting and seed share the federation, so it is built once."""
    fed_cfg = FederationConfig.model_validate_json(federation)
    fed = build_federation(load_source(DatasetConfig.model_validate_json(dataset)), fed_cfg, seed)
    return {c: client.prior.double() for c, client in enumerate(fed.clients)}


def prior_correlation(run_dir: Path, order: list[int], w: list[list[float]]) -> str:
    """Pearson r between W[n, m] and cos(P_n(y), P_m(y)) over the off-diagonal pairs, clients in CSV order."""
    cfg = load_config(run_dir / "config.yaml")
    prior = client_priors(cfg.dataset.model_dump_json(), cfg.federation.model_dump_json(), cfg.seed)
    priors = torch.stack([prior[c] for c in order])
    unit = priors / priors.norm(dim=1, keepdim=True)
    sim, mat = unit @ unit.T, torch.tensor(w, dtype=torch.double)
    off = ~torch.eye(len(order), dtype=torch.bool)
    if float(mat[off].std()) < 1e-9:  # a constant W (FedMD) has no correlation with anything
        return "—"
    return f"{float(torch.corrcoef(torch.stack([mat[off], sim[off]]))[0, 1]):+.2f}"


def main(suite_path: str = "benchmarks/suites/fmnist_ktpfl.yaml") -> None:
    bench = Bench(load_suite(suite_path))
    print("| run | W, label-sharing teacher | W, no common label | off-diagonal mass on sharing "
          "| uniform c would give | r(W, label-distribution cosine) |")
    print("|---|---|---|---|---|---|")
    for name in ALGORITHMS:
        for table, (setting, method, seed), path in bench.cell_files(f"plots/{name}_coefficients.csv"):
            order, labels, w = read_coefficients(path)
            s, n, mass, frac = summarize(labels, w)
            r = prior_correlation(path.parent.parent, order, w)
            print(f"| {table.name}/{setting or '-'}/{method}/seed{seed} | {s} | {n} | {mass} | {frac} | {r} |")


if __name__ == "__main__":
    main(*sys.argv[1:])
