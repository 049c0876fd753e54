"""Paired differences between two rows of a bench table, seed by seed.

Runs of one setting and seed share the federation, the new clients and every data split, so the per-seed difference
A − B removes the seed-to-seed spread the two rows have in common; its mean ± std over the seeds both rows finished
is the figure to quote for "does A beat B" (a table's two independent mean ± std overstate the uncertainty when
the seeds move both rows alike). Every column the table reports for A is differenced with the same column of B.

    python benchmarks/paired_differences.py SUITE TABLE A B
    python benchmarks/paired_differences.py benchmarks/suites/fmnist_rot4_pretrained.yaml new_clients FedBasis FedAvg+FT
"""

from __future__ import annotations

import json
import sys

from pflbed.results.bench import Bench, Table, _get, _mean_std, load_suite


def seed_values(table: Table, method: str, setting: str, field: str) -> dict[int, float]:
    """{seed: value of `field`} for the seeds of `method` (or the row it reuses) that finished."""
    out = {}
    for seed, run in table.finished_runs(method, setting).items():
        if (v := _get(json.loads((run / "summary.json").read_text()), field)) is not None:
            out[seed] = v
    return out


def main(suite_path: str, table_name: str, a: str, b: str) -> None:
    bench = Bench(load_suite(suite_path))
    table = bench.table(table_name)
    if table is None or a not in table.spec.methods or b not in table.spec.methods:
        sys.exit(f"{suite_path}: no table {table_name!r} with methods {a!r} and {b!r}")
    reports = {m: table.report_of(m) for m in (a, b)}
    print(f"{a} − {b} ({table_name}; per seed, then mean ± std over the seeds both finished)\n")
    print("| setting | column | per seed | mean ± std |")
    print("|---|---|---|---|")
    for setting in table.spec.settings:
        for col, field in reports[a].items():
            field_b = reports[b].get(col)
            if not field or not field_b:
                continue
            va, vb = seed_values(table, a, setting, field), seed_values(table, b, setting, field_b)
            seeds = sorted(va.keys() & vb.keys())
            if not seeds:
                continue
            scale = table.spec.column_scale.get(col, table.spec.scale)  # as the tables scale the column
            diffs = [(va[s] - vb[s]) * scale for s in seeds]
            mean, std = _mean_std(diffs)
            per_seed = ", ".join(f"{d:+.2f}" for d in diffs)
            print(f"| {setting or '-'} | {col} | {per_seed} | {mean:+.2f} ± {std:.2f} ({len(seeds)} seeds) |")


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    main(*sys.argv[1:])
