"""What a site's checks of what the server sends cost next to the work they guard, algorithm by algorithm, side by
side in one process: a client's payload (`Algorithm.payload_fits`, `flower.site_message.check_payload`) next to the
client update, and an evaluation's server view (`Algorithm.view_fits`, `check_view`) next to the site's evaluation.

A site checks each client's payload before the client trains on it, and each view before it evaluates. The default
checks rebuild the structure the algorithm's server sends from the initial server state (`init_server`, then
`configure` for that one client, or `server_view` for the site's clients), so their cost is that of those calls; an
algorithm that overrides one computes the structure from its options. This times both on a Fashion-MNIST
federation (the McMahan CNN, 100 clients): the payload of one client next to its update (one local epoch, the
smallest update a run makes), the initial view of a site of `--site` clients next to that site's evaluation of
them (its round's figures: personal models on test and validation data, the generic model's counts), alternating
check and checked work, and prints the median of each and their ratio.

    python benchmarks/site_checks.py [--repeats 5] [--algorithms fedavg,fedamp,...] [--clients 100] [--site 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pflbed.algorithms import ALGORITHMS
from pflbed.config import validate_config
from pflbed.engine.build import prepare
from pflbed.engine.executor import update_client
from pflbed.flower.site_eval import evaluate_site
from pflbed.flower.site_message import check_payload, check_view


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
    ap.add_argument("--site", type=int, default=10, help="clients of the site that evaluates")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{'algorithm':<14} {'payload ms':>10} {'update ms':>10} {'÷ update':>9}  {'view ms':>8} "
          f"{'evaluation ms':>14} {'÷ evaluation':>12}")  # fmt: skip
    for name in args.algorithms.split(","):
        algo = prepare(validate_config(setup(name, args.clients)), threads=1)
        cids = list(algo.ctx.federation.participated[: args.site])
        server, states = algo.init_server(), {c: algo.init_client(c) for c in cids}
        cid, view = cids[0], algo.server_view(server, cids)
        payload = algo.configure(1, server, [cid])[cid]
        check_payload(algo, 1, cid, payload, states[cid])  # warm: the first calls build what later ones reuse
        check_view(algo, view, cids)
        times: dict[str, list[float]] = {"payload": [], "update": [], "view": [], "evaluation": []}
        for _ in range(args.repeats):
            times["payload"].append(timed(check_payload, algo, 1, cid, payload, states[cid]))
            times["update"].append(timed(update_client, algo, 1, cid, payload, states[cid]))
            times["view"].append(timed(check_view, algo, view, cids))
            times["evaluation"].append(timed(evaluate_site, algo, view, states.__getitem__, cids))
        p, u, v, e = (statistics.median(times[k]) for k in times)
        print(f"{name:<14} {p * 1e3:>10.2f} {u * 1e3:>10.1f} {p / u:>9.4f}  {v * 1e3:>8.2f} {e * 1e3:>14.1f} "
              f"{v / e:>12.4f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
