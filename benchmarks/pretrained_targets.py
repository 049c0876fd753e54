"""What a bench suite's starting weights alone score on its targets, before any training: the summary's
`init_from.test_acc` for each setting and seed of one of its tables (each seed draws its own federation, so its own
test sets; the weights are the same).

    python benchmarks/pretrained_targets.py SUITE TABLE
    python benchmarks/pretrained_targets.py benchmarks/suites/fmnist_rot4_pretrained.yaml new_clients

Prints a markdown table: per setting and test set (G-FL's, then each domain's), the accuracy in % per seed and its
mean ± std. Why a script: cells run before the summary recorded the figure have it nowhere else, and it is what the
federated training's results are read against.
"""

from __future__ import annotations

import sys

from pflbed.engine.build import prepare
from pflbed.evaluation.pretrained import pretrained_accuracy
from pflbed.results.bench import Bench, _mean_std, load_suite


def main(suite_path: str, table_name: str) -> None:
    bench = Bench(load_suite(suite_path))
    table = bench.table(table_name)
    if table is None:
        sys.exit(f"{suite_path}: no table {table_name!r}")
    method = next(iter(table.spec.methods))  # the data, federation and weights are every method's
    print(f"The starting weights alone, before training ({table_name}; accuracy %, per seed, then mean ± std)\n")
    print("| setting | test set | per seed | mean ± std |")
    print("|---|---|---|---|")
    for setting in table.spec.settings:
        scores: dict[str, list[float]] = {}
        for seed in table.seeds:
            cfg = table.cell_config(setting, method, seed)
            if not cfg.model.init_from:
                sys.exit(f"{suite_path}: table {table_name!r}, setting {setting!r}: no model.init_from")
            acc = pretrained_accuracy(prepare(cfg).ctx)
            if "why" in acc:
                sys.exit(f"{suite_path}: setting {setting!r}: not scored: {acc['why']}")
            for name, v in {"all (G-FL)": acc["global"], **acc.get("domains", {})}.items():
                scores.setdefault(name, []).append(100 * v)
        for name, vals in scores.items():
            mean, std = _mean_std(vals)
            per_seed = ", ".join(f"{v:.2f}" for v in vals)
            print(f"| {setting or '-'} | {name} | {per_seed} | {mean:.2f} ± {std:.2f} ({len(vals)} seeds) |")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(*sys.argv[1:])
