"""Summarize FedSelect's final classifier-mask IoU heat-maps (paper Fig. 4) over the seeds of a bench suite.

For every FedSelect cell of `benchmarks/suites/fmnist_fedselect.yaml` that has finished, read the IoU matrix its
run wrote (`plots/fedselect_mask_iou.csv`), rebuild the cell's federation to learn each client's label set, and
print the mean IoU of client pairs that share a label against pairs that share none. The paper's claim is that
clients with common labels grow overlapping personal subnetworks, so the first number should be the larger.

    python benchmarks/fedselect_iou.py [suite.yaml]
"""

from __future__ import annotations

import csv
import statistics
import sys
from pathlib import Path

from pflbed.data import load_source
from pflbed.federation.build import build_federation
from pflbed.results.bench import Bench, load_suite


def iou_matrix(path: Path) -> dict[tuple[int, int], float]:
    with path.open() as f:
        rows = list(csv.reader(f))
    cols = [int(c.lstrip("c")) for c in rows[0][2:]]
    return {(int(r[0]), cols[j]): float(v) for r in rows[1:] for j, v in enumerate(r[2:])}


def main(suite_path: str = "benchmarks/suites/fmnist_fedselect.yaml") -> None:
    bench = Bench(load_suite(suite_path))
    print("| method | seed | IoU, pairs sharing a label | IoU, pairs sharing none | pairs (share / none) |")
    print("|---|---|---|---|---|")
    for table, (setting, method, seed), path in bench.cell_files("plots/fedselect_mask_iou.csv"):
        cfg = table.cell_config(setting, method, seed)
        fed = build_federation(load_source(cfg.dataset), cfg.federation, cfg.seed)
        labels = {c: {int(k) for k in (fed.clients[c].prior > 0).nonzero().flatten()} for c in fed.participated}
        iou = iou_matrix(path)
        share, none = [], []
        for (a, b), v in iou.items():
            if a < b:
                (share if labels[a] & labels[b] else none).append(v)
        s, n = (f"{statistics.mean(x):.3f}" if x else "—" for x in (share, none))
        print(f"| {method} | {seed} | {s} | {n} | {len(share)} / {len(none)} |")


if __name__ == "__main__":
    main(*sys.argv[1:])
