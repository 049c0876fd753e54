"""Do KT-pFL's learned coefficients favour clients with common labels? Summarize the final c matrices of a suite.

Each knowledge-transfer run (KT-pFL, Sim-pFL, TopK-pFL, FedMD) writes `plots/<algorithm>_coefficients.csv`: the
final mixing weights W[n, m] (student n, teacher m) with every client's label set. For each run this prints the
mean off-diagonal weight a student gives a teacher that shares at least one label with it and one that shares
none, and the share of the students' off-diagonal mass that goes to label-sharing teachers next to the share such
teachers have among all teachers (what a uniform c would give).

    python benchmarks/ktpfl_coefficients.py [suite.yaml]
"""

from __future__ import annotations

import csv
import statistics
import sys
from pathlib import Path

from pflbed.results.bench import Bench, load_suite

ALGORITHMS = ("ktpfl", "sim_pfl", "topk_pfl", "fedmd")


def read_coefficients(path: Path) -> tuple[list[set[str]], list[list[float]]]:
    with path.open() as f:
        rows = list(csv.reader(f))[1:]
    return [set(r[2].split()) for r in rows], [[float(v) for v in r[3:]] for r in rows]


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


def main(suite_path: str = "benchmarks/suites/fmnist_ktpfl.yaml") -> None:
    bench = Bench(load_suite(suite_path))
    print("| run | W, label-sharing teacher | W, no common label | off-diagonal mass on sharing "
          "| uniform c would give |")
    print("|---|---|---|---|---|")
    for name in ALGORITHMS:
        for table, (setting, method, seed), path in bench.cell_files(f"plots/{name}_coefficients.csv"):
            s, n, mass, frac = summarize(*read_coefficients(path))
            print(f"| {table.name}/{setting or '-'}/{method}/seed{seed} | {s} | {n} | {mass} | {frac} |")


if __name__ == "__main__":
    main(*sys.argv[1:])
