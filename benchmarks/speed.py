"""Round training time of the `loop` and `procs` executors side by side, against the centralized limit.

For each model, one configuration (FedAvg on Fashion-MNIST, 20 clients, Dir(0.1), batch 10 by default) is run for
`--rounds` rounds with `executor.name=loop` (1 thread) and with `executor.name=procs` (`--workers` workers, 1 thread
each), alternating repeat by repeat so that machine load hits both alike. Printed per model: seconds of training
per round (the run's `timing.s_per_round`, evaluation excluded) for each executor, loop ÷ procs, and each worker's
samples/s as a fraction of the centralized limit — plain SGD steps on one thread in this process, same model and
batch size, no federation at all.

    python benchmarks/speed.py [--models lenet5 cnn] [--workers 2] [--rounds 2] [--repeats 2] [--batch 10]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from threads import step_time  # benchmarks/threads.py: the same plain SGD step

from pflbed.config import validate_config
from pflbed.engine.loop import run
from pflbed.engine.procs import WorkerPool
from pflbed.models import build_model


def config(model: str, executor: dict, rounds: int, batch: int) -> dict:
    return {
        "dataset": {"name": "fmnist"},
        "model": {"name": model},
        "federation": {"clients": 20, "partition": "dirichlet", "alpha": 0.1},
        "train": {"rounds": rounds, "batch_size": batch, "lr": 0.01, "checkpoint_every": 0},
        "eval": {"every": 1000, "finetune": [], "test_subsample": 10},
        "executor": executor,
        "algorithm": {"name": "fedavg"},
    }


def centralized_samples_per_s(model: str, batch: int, steps: int = 200) -> float:
    """Plain SGD on one thread: the most any single process can train, with no federation around it."""
    net = build_model(model, (1, 28, 28), 10)
    x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    return batch / step_time(net, x, y, steps, threads=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["lenet5", "cnn"])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch", type=int, default=10)
    a = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{'model':8s} {'loop s/round':>12s} {'procs s/round':>13s} {'loop÷procs':>10s} "
          f"{'samples/round':>13s} {'per worker ÷ centralized':>25s}")  # fmt: skip
    with WorkerPool(a.workers, threads=1) as pool:
        for model in a.models:
            loop_cfg = validate_config(config(model, {"threads": 1}, a.rounds, a.batch))
            procs_cfg = validate_config(
                config(model, {"name": "procs", "workers": a.workers, "threads": 1}, a.rounds, a.batch)
            )
            times: dict[str, list[float]] = {"loop": [], "procs": []}
            samples = 0
            for _ in range(a.repeats):
                r = run(loop_cfg, write=False, progress=False)
                times["loop"].append(r.summary["timing"]["s_per_round"])
                r = run(procs_cfg, write=False, progress=False, pool=pool)
                times["procs"].append(r.summary["timing"]["s_per_round"])
                fed = r.executor.algo.ctx.federation
                samples = sum(fed.num_train(c) for c in fed.participated)
            loop_s, procs_s = statistics.median(times["loop"]), statistics.median(times["procs"])
            limit = centralized_samples_per_s(model, a.batch)
            per_worker = samples / procs_s / a.workers
            print(f"{model:8s} {loop_s:12.2f} {procs_s:13.2f} {loop_s / procs_s:10.2f} {samples:13d} "
                  f"{per_worker / limit:25.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
