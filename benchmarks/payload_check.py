"""What a site's check of a payload costs (`Algorithm.payload_fits`, `flower.site_message.check_payload`) next to the
client update it guards, algorithm by algorithm, side by side in one process.

A site checks each client's payload before the client trains on it. The default check rebuilds the structure the
algorithm's server sends from the initial server state (`init_server`, then `configure` for that one client), so
its cost is that of those two calls; an algorithm that overrides it computes the structure from its options. This
times both on one client of a Fashion-MNIST federation (the McMahan CNN, 100 clients, one local epoch, the smallest
update a run makes), alternating check and update, and prints the median of each and their ratio.

    python benchmarks/payload_check.py [--repeats 5] [--algorithms fedavg,fedamp,...] [--clients 100]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pflbed.algorithms import ALGORITHMS
from pflbed.config import validate_config
from pflbed.engine.executor import update_client
from pflbed.engine.loop import prepare
from pflbed.flower.site_message import check_payload


def setup(name: str, clients: int) -> dict:
    return {"dataset": {"name": "fmnist"}, "model": {"name": "cnn"},
            "federation": {"clients": clients, "partition": "dirichlet", "alpha": 0.3, "sample_fraction": 0.1,
                           "public": 500},
            "train": {"rounds": 10, "local_epochs": 1, "batch_size": 32, "lr": 0.05},
            "eval": {"finetune": []}, "algorithm": {"name": name}, "executor": {"threads": 1}}  # fmt: skip


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--algorithms", default=",".join(sorted(ALGORITHMS)))
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{'algorithm':<14} {'check ms':>9} {'update ms':>10} {'check ÷ update':>15}")
    for name in args.algorithms.split(","):
        algo = prepare(validate_config(setup(name, args.clients)), threads=1)
        cid = algo.ctx.federation.participated[0]
        payload = algo.configure(1, algo.init_server(), [cid])[cid]
        state = algo.init_client(cid)
        check_payload(algo, 1, cid, payload, state)  # warm: the first call builds what later ones reuse
        checks, updates = [], []
        for _ in range(args.repeats):
            checks.append(timed(check_payload, algo, 1, cid, payload, state))
            updates.append(timed(update_client, algo, 1, cid, payload, state))
        c, u = statistics.median(checks), statistics.median(updates)
        print(f"{name:<14} {c * 1e3:>9.2f} {u * 1e3:>10.1f} {c / u:>15.4f}", flush=True)


if __name__ == "__main__":
    main()
