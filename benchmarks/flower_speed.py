"""pflbed on Flower's simulation runtime vs in-process executors, side by side: per-round time and where it goes.

The default experiment (FedAvg on the embedded digits, 20 clients all participating, the McMahan CNN, 1 local
epoch) for `--rounds` rounds with `loop` (1 thread), `procs` (`--workers` processes) and `flower` (a simulation of
one SuperNode per client and `--workers` ClientApp processes, started once before timing). Printed: training
seconds per round (`timing.s_per_round`, evaluation excluded), each ÷ loop, and for Flower the split of its round
time: records built and read by the server, waiting for replies, and within the wait the client updates and
their records on the nodes (summed over clients ÷ workers: the nodes run in parallel). Results must equal loop's.

    python benchmarks/flower_speed.py [--rounds 5] [--workers 2]
"""

from __future__ import annotations

import argparse

import torch

from pflbed.config import validate_config
from pflbed.engine.loop import run
from pflbed.engine.procs import WorkerPool
from pflbed.flower.simulation import FlowerSimulation


def figures(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k not in ("timing", "provenance")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workers", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(1)
    base = {"train": {"rounds": a.rounds}, "eval": {"every": 1000, "finetune": []}}
    cfg = {n: validate_config({**base, "executor": ex}) for n, ex in {
        "loop": {"threads": 1}, "procs": {"name": "procs", "workers": a.workers, "threads": 1},
        "flower": {"name": "flower", "workers": a.workers, "threads": 1}}.items()}  # fmt: skip
    clients = cfg["loop"].federation.clients
    with WorkerPool(a.workers, threads=1) as pool, FlowerSimulation(clients, a.workers) as sim:
        loop = run(cfg["loop"], write=False, progress=False)
        procs = run(cfg["procs"], write=False, progress=False, pool=pool)
        flower = run(cfg["flower"], write=False, progress=False, simulation=sim)
    same = figures(flower.summary) == figures(loop.summary) == figures(procs.summary)
    print(f"FedAvg, digits, {clients} clients all participating, cnn, {a.rounds} rounds; results equal: {same}")
    t = {n: r.summary["timing"]["s_per_round"] for n, r in (("loop", loop), ("procs", procs), ("flower", flower))}
    for n, s in t.items():
        print(f"{n:7s} {s:7.3f} s/round   {s / t['loop']:5.2f} × loop")
    ft = {k: v / a.rounds for k, v in flower.executor.timing.items()}
    par = (ft["client_update_s"] + ft["client_records_s"]) / a.workers
    print(f"flower round: server records {ft['server_records_s']:.3f} s, waiting {ft['wait_s']:.3f} s "
          f"(client updates {ft['client_update_s'] / a.workers:.3f} s and node records "
          f"{ft['client_records_s'] / a.workers:.3f} s per worker; runtime {ft['wait_s'] - par:.3f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
