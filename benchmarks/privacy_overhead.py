"""What client-level DP costs per round: the same runs with and without `privacy.*`, side by side.

Both arms draw clients by Poisson sampling (`federation.sampling=poisson`), so the same clients train the same
batches in both and the difference is DP's own work alone: each client's update clipped where it ran (one norm over
the shared entries, a rescale where above C) and the round's noise drawn and added on the server. Arms alternate
repeat by repeat; printed: median training seconds per round (`summary.json` → `timing.s_per_round`, evaluation
excluded) of each arm and DP ÷ plain.

    python benchmarks/privacy_overhead.py [--repeats 3] [--rounds 10]
"""

from __future__ import annotations

import argparse
import statistics

from pflbed.config import validate_config
from pflbed.runs import run

SETUP = {  # benchmarks/suites/privacy_fmnist.yaml's federation and training
    "dataset": {"name": "fmnist"}, "model": {"name": "lenet5"},
    "federation": {"clients": 1000, "partition": "dirichlet", "alpha": 0.3, "sample_fraction": 0.1,
                   "sampling": "poisson"},
    "train": {"local_epochs": 1, "batch_size": 16, "lr": 0.05, "momentum": 0.5, "checkpoint_every": 0},
    "eval": {"every": 10**6, "finetune": []}, "executor": {"threads": 1},
}  # fmt: skip
DP = {"clip": 1.0, "noise_multiplier": 1.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--algorithms", nargs="*", default=["fedavg", "fedper"])
    a = ap.parse_args()
    print(f"FMNIST LeNet-5, 1000 clients, Poisson q = 0.1, {a.rounds} rounds, 1 thread; DP: C = 1, σ = 1")
    print(f"{'algorithm':10s} {'plain s/round':>13s} {'DP s/round':>10s} {'DP÷plain':>8s}")
    for name in a.algorithms:
        times: dict[str, list[float]] = {"plain": [], "dp": []}
        for _ in range(a.repeats):
            for arm in times:
                tree = {**SETUP, "algorithm": {"name": name}, "train": {**SETUP["train"], "rounds": a.rounds},
                        **({"privacy": DP} if arm == "dp" else {})}  # fmt: skip
                result = run(validate_config(tree), write=False, progress=False)
                times[arm].append(result.summary["timing"]["s_per_round"])
        plain, dp = statistics.median(times["plain"]), statistics.median(times["dp"])
        print(f"{name:10s} {plain:13.3f} {dp:10.3f} {dp / plain:8.3f}", flush=True)


if __name__ == "__main__":
    main()
