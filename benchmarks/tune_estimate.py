"""What a tune suite will cost, before it runs: one default run of each method's trial configuration, timed.

    python benchmarks/tune_estimate.py benchmarks/suites/leaderboard_fmnist.yaml [--out DIR] [--cores 2]

Per method: the wall time and sample passes (`pflbed.compute`) of one run of its default configuration as a trial
runs it (the trial seed's data, no new-client stage). Its search then costs about budget × base run ÷ its passes ×
its wall time (trials are budgeted in compute, so a pruned or cheaper trial only leaves room for more), and its
re-runs 2 × seeds × (its wall time + the new-client stage, timed once on FedAvg's re-run configuration). The total
is divided by `--cores` (workers running trials side by side, one thread each). Resumable: each method's measurement
is a line of DIR/estimate.jsonl, kept; the estimate is printed as a table and written to DIR/estimate.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from pflbed import compute
from pflbed.errors import DivergedError
from pflbed.results.experiment import run
from pflbed.results.tune import Tuner, load_tune_suite


def measure(cfg) -> dict[str, float]:
    """One run's wall time and sample passes; a diverged run is scaled to its full length (its time and passes
    so far × rounds ÷ the rounds it ran), and says so."""
    before, t0 = compute.total(), time.perf_counter()
    try:
        res = run(cfg, write=False, progress=False)
    except DivergedError as e:
        scale = cfg.train.rounds / e.round
        return {"wall_s": (time.perf_counter() - t0) * scale, "passes": (compute.total() - before) * scale,
                "new_clients_s": 0.0, "diverged": e.round}  # fmt: skip
    return {"wall_s": time.perf_counter() - t0, "passes": compute.total() - before,
            "new_clients_s": res.summary.get("timing", {}).get("new_clients_s", 0.0)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("suite")
    ap.add_argument("--out", type=Path, default=Path("runs/tune_estimate"))
    ap.add_argument("--cores", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    suite = load_tune_suite(args.suite)
    tuner = Tuner(suite, out=args.out / "unused")
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "estimate.jsonl"
    done = {r["method"]: r for r in map(json.loads, log.read_text().splitlines())} if log.exists() else {}
    first = tuner.methods[0]
    if "_new_clients" not in done:  # the new-client stage of a re-run, on FedAvg's (the first method's) config
        row = {"method": "_new_clients", **measure(first.config(suite.seeds[0], {}, trial=False))}
        done[row["method"]] = row
        with log.open("a") as f:
            f.write(json.dumps(row) + "\n")
    for m in tuner.methods:
        if m.name in done:
            continue
        row = {"method": m.name, **measure(m.config(tuner.seed, {}))}
        done[m.name] = row
        with log.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{m.name}: {row['wall_s']:.0f} s, {row['passes'] / tuner.unit():.2f} base runs"
              + (f" (diverged in round {row['diverged']}: scaled)" if "diverged" in row else ""), flush=True)
    unit, nc_s = tuner.unit(), done["_new_clients"]["new_clients_s"]
    lines = ["| method | one run (s) | its training (base runs) | search (h) | re-runs (h) |", "|---|---|---|---|---|"]
    total = 0.0
    for m in tuner.methods:
        r = done[m.name]
        search = m.budget * unit / max(r["passes"], 1) * r["wall_s"]
        reruns = 2 * len(suite.seeds) * (r["wall_s"] + nc_s)
        total += search + reruns
        name = m.name + (f" (default diverged in round {r['diverged']})" if "diverged" in r else "")
        lines.append(f"| {name} | {r['wall_s']:.0f} | {r['passes'] / unit:.2f} | {search / 3600:.2f} | "
                     f"{reruns / 3600:.2f} |")  # fmt: skip
    lines.append(f"\nTotal: {total / 3600:.1f} core-hours; {total / 3600 / args.cores:.1f} h on {args.cores} cores "
                 f"(a base run: {unit:,.0f} sample passes; the new-client stage of a re-run: {nc_s:.0f} s).")
    text = "\n".join(lines) + "\n"
    (args.out / "estimate.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
