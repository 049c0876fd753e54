"""P-FL per architecture of a heterogeneous zoo, and the share of clients left at chance, for every row of a table.

A heterogeneous run's P-FL is the mean over clients of every architecture; when one architecture trains and another
does not, the mean hides both. This reads each finished cell's per-client accuracies (`summary.json`,
`per_client`), maps client c to its architecture by the zoo rule (`architectures[⌊c·A / N⌋]`) and prints, per
method, the mean P-FL of each architecture's clients (mean ± std over seeds) and how many clients score within
2 points of chance (with `partition: classes`, 1 / classes per client, class-weighted: a model that predicts one
class for everything; "—" for other partitions, where a client's chance level is not one number).

    python benchmarks/architecture_breakdown.py SUITE TABLE
    python benchmarks/architecture_breakdown.py benchmarks/suites/fmnist_ktpfl_lowdata.yaml lowdata
"""

from __future__ import annotations

import json
import sys

from pflbed.algorithms.training import architecture_of
from pflbed.config import load_config
from pflbed.results.bench import Bench, _mean_std, load_suite


def main(suite_path: str, table_name: str) -> None:
    bench = Bench(load_suite(suite_path))
    table = bench.table(table_name)
    if table is None:
        sys.exit(f"{suite_path}: no table {table_name!r}")
    print("| method | setting | " + "P-FL by architecture (%) | clients at chance | seeds |")
    print("|---|---|---|---|---|")
    for method in table.spec.methods:
        for setting in table.spec.settings:
            by_arch: dict[str, list[float]] = {}
            at_chance, seeds = [], 0
            for run in table.finished_runs(method, setting).values():
                cfg = load_config(run / "config.yaml")
                archs, n = cfg.algorithm.architectures, cfg.federation.clients
                by_class = cfg.federation.partition == "classes"
                chance = 1.0 / cfg.federation.classes_per_client
                per_client = json.loads((run / "summary.json").read_text())["per_client"]
                groups: dict[str, list[float]] = {}
                for cid, acc in zip(per_client["cid"], per_client["pfl_acc"], strict=True):
                    groups.setdefault(architecture_of(cid, archs, n), []).append(acc)
                for arch, accs in groups.items():
                    by_arch.setdefault(arch, []).append(100 * sum(accs) / len(accs))
                if by_class:
                    at_chance.append(sum(abs(a - chance) < 0.02 for a in per_client["pfl_acc"]))
                seeds += 1
            if not seeds:
                continue
            parts = []
            for arch, vals in by_arch.items():
                m, s = _mean_std(vals)
                parts.append(f"{arch} {m:.2f} ± {s:.2f}")
            chance_txt = " / ".join(str(k) for k in at_chance) + f" of {n}" if at_chance else "—"
            print(f"| {method} | {setting or '-'} | {'; '.join(parts)} | {chance_txt} | {seeds} |")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(*sys.argv[1:])
