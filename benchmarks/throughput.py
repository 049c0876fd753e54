"""Local-training throughput of a FedAvg round vs plain centralized training, side by side in one process.

Both train the same model object with the same optimizer and batch size on the same samples (the union of the
round's sampled clients' training data), so the ratio measures what the federated machinery costs: per-client
parameter loading, payload/reply handling, aggregation and smaller last batches. Target: ratio >= 0.9.

    python benchmarks/throughput.py [--dataset fmnist] [--model cnn] [--repeats 3] [--strict]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pflbed.algorithms.base import ClientData
from pflbed.algorithms.training import load_params, local_sgd
from pflbed.config import validate_config
from pflbed.engine.build import prepare
from pflbed.engine.executor import LoopExecutor
from pflbed.federation import sample_clients


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="fmnist")
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--fraction", type=float, default=0.2)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--strict", action="store_true", help="also round-trip payloads through bytes")
    args = ap.parse_args()

    cfg = validate_config({
        "dataset": {"name": args.dataset}, "model": {"name": args.model},
        "federation": {"clients": args.clients, "partition": "dirichlet", "alpha": 0.3,
                       "sample_fraction": args.fraction},
        "train": {"rounds": 1, "local_epochs": 1, "batch_size": args.batch_size, "lr": 0.01, "momentum": 0.9},
        "executor": {"strict": args.strict}, "algorithm": {"name": "fedavg"},
    })  # fmt: skip
    algo = prepare(cfg)
    ctx, fed = algo.ctx, algo.ctx.federation
    cids = sample_clients(cfg.seed, 1, fed.participated, cfg.federation.sample_fraction)
    union = torch.cat([fed.clients[c].train for c in cids])
    n = len(union)
    central = ClientData(-1, ctx.source.train.x, ctx.source.train.y, union, union[:0], fed.clients[0].prior)
    t = cfg.train

    def centralized() -> float:
        load_params(ctx.model, ctx.initial_params)
        t0 = time.perf_counter()
        local_sgd(
            ctx.model,
            central,
            epochs=1,
            batch_size=t.batch_size,
            lr=t.lr,
            momentum=t.momentum,
            generator=torch.Generator().manual_seed(0),
        )
        return n / (time.perf_counter() - t0)

    def fedavg_round() -> float:
        executor = LoopExecutor(algo, strict=cfg.executor.strict)
        server = algo.init_server()
        t0 = time.perf_counter()
        payloads = algo.configure(1, server, cids)
        replies = executor.run(1, payloads)
        algo.aggregate(1, server, replies, {c: fed.num_train(c) for c in cids})
        return n / (time.perf_counter() - t0)

    centralized()  # warm-up (allocator, kernels)
    fed_sps, cen_sps = [], []
    for _ in range(args.repeats):  # interleaved, so machine noise hits both alike
        cen_sps.append(centralized())
        fed_sps.append(fedavg_round())
    c, f = statistics.median(cen_sps), statistics.median(fed_sps)
    print(
        f"{args.dataset}/{args.model}: {len(cids)} clients, {n} samples, batch {t.batch_size}, "
        f"torch threads {torch.get_num_threads()}, strict={args.strict}"
    )
    print(f"centralized : {c:8.1f} samples/s  (runs: {', '.join(f'{x:.0f}' for x in cen_sps)})")
    print(f"FedAvg round: {f:8.1f} samples/s  (runs: {', '.join(f'{x:.0f}' for x in fed_sps)})")
    print(f"ratio FedAvg/centralized = {f / c:.3f}  (target >= 0.9)")


if __name__ == "__main__":
    main()
