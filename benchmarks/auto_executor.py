"""`executor.name: auto` on a CPU: where `procs` beats `loop`, side by side, and what the rule picks.

For each experiment below, whole runs (`pflbed.run`, the pool's start-up included, as a user's run pays it) with
`loop` (1 thread) and `procs` (one worker per core, 1 thread each), alternating repeat by repeat; printed: the
run's estimated training work (`engine.auto.training_macs`), median wall seconds of each, loop ÷ procs, and what
`auto` chose. The rule's threshold (`engine.auto.PROCS_MIN_MACS`) sits between the largest experiment where
`loop` won and the smallest where `procs` did.

    python benchmarks/auto_executor.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from pflbed.config import validate_config
from pflbed.engine.auto import choose_executor, training_macs
from pflbed.engine.build import prepare
from pflbed.results.experiment import run

FMNIST = {"dataset": {"name": "fmnist"}, "federation": {"clients": 20, "train_per_client": 200}}
EXPERIMENTS = {  # name → config (executor filled in below)
    "synthetic mlp, 6 clients, 4 rounds (the tests' run)": {
        "dataset": {"name": "synthetic"}, "model": {"name": "mlp"},
        "federation": {"clients": 6, "sample_fraction": 0.5}, "train": {"rounds": 4, "batch_size": 16}},
    "digits cnn, 20 clients, 5 rounds": {"train": {"rounds": 5}},
    "digits cnn, 20 clients, 30 rounds (`pflbed run`)": {},
    "fmnist lenet5, 20 × 200 samples, 5 rounds": {**FMNIST, "model": {"name": "lenet5"}, "train": {"rounds": 5}},
    "fmnist cnn, 20 × 200 samples, 1 round": {**FMNIST, "model": {"name": "cnn"}, "train": {"rounds": 1}},
    "fmnist cnn, 20 × 200 samples, 3 rounds": {**FMNIST, "model": {"name": "cnn"}, "train": {"rounds": 3}},
    "fmnist cnn, 20 × 200 samples, 10 rounds": {**FMNIST, "model": {"name": "cnn"}, "train": {"rounds": 10}},
}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    cores = os.cpu_count() or 1
    print(f"{cores} cores; loop: 1 thread; procs: {cores} workers × 1 thread, started by each run")
    print(f"{'experiment':52s} {'GMAC':>8s} {'loop s':>7s} {'procs s':>7s} {'loop÷procs':>10s} {'auto':>6s}")
    for name, tree in EXPERIMENTS.items():
        tree = {**tree, "eval": {"every": 10**6, "finetune": []}}
        times: dict[str, list[float]] = {"loop": [], "procs": []}
        for _ in range(a.repeats):
            for ex in times:
                cfg = validate_config({**tree, "executor": {"name": ex, "threads": 1}})
                t0 = time.perf_counter()
                run(cfg, write=False, progress=False)
                times[ex].append(time.perf_counter() - t0)
        algo = prepare(validate_config({**tree, "executor": {"name": "auto"}}))
        macs = training_macs(algo.ctx)
        chosen = choose_executor(algo.ctx.cfg.executor, algo.ctx)
        loop, procs = statistics.median(times["loop"]), statistics.median(times["procs"])
        print(f"{name:52s} {macs / 1e9:8.1f} {loop:7.2f} {procs:7.2f} {loop / procs:10.2f} {chosen:>6s}", flush=True)
        torch.set_num_threads(1)


if __name__ == "__main__":
    main()
