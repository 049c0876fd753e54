"""pflbed on Flower vs in-process executors, side by side: per-round time and where it goes.

The default experiment (FedAvg on the embedded digits, 20 clients all participating, the McMahan CNN, 1 local
epoch) for `--rounds` rounds with `loop` (1 thread), `procs` (`--workers` processes), `flower` simulation (one
SuperNode per client, `--workers` ClientApp processes, the runtime started once before timing) and a local
deployment (`pflbed flower local`: a SuperLink and `--workers` SuperNodes as processes, plain and TLS). Printed:
training seconds per round (`timing.s_per_round`, evaluation excluded), each ÷ loop, and for Flower the split of
its round time: records built and read by the server, waiting for replies, and within the wait the client updates
and their records on the nodes (summed over clients ÷ nodes working at once). Results must equal loop's.

    python benchmarks/flower_speed.py [--rounds 5] [--workers 2] [--no-deployment]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from pflbed.config import validate_config
from pflbed.engine.procs import WorkerPool
from pflbed.flower.local import run_local
from pflbed.flower.simulation import FlowerSimulation
from pflbed.results.experiment import run


def figures(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k not in ("timing", "provenance")}


def executors(workers: int) -> dict[str, dict]:
    """Each compared executor's section, every one named: the default, `auto`, would run a large enough federation
    on `procs` and time it as `loop`."""
    return {"loop": {"name": "loop", "threads": 1}, "procs": {"name": "procs", "workers": workers, "threads": 1},
            "flower": {"name": "flower", "workers": workers, "threads": 1}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--no-deployment", action="store_true", help="skip the local deployments")
    a = ap.parse_args()
    torch.set_num_threads(1)
    base = {"train": {"rounds": a.rounds}, "eval": {"every": 1000, "finetune": []}}
    cfg = {n: validate_config({**base, "executor": ex}) for n, ex in executors(a.workers).items()}
    clients = cfg["loop"].federation.clients
    with WorkerPool(a.workers, threads=1) as pool, FlowerSimulation(clients, a.workers) as sim:
        loop = run(cfg["loop"], write=False, progress=False)
        procs = run(cfg["procs"], write=False, progress=False, pool=pool)
        flower = run(cfg["flower"], write=False, progress=False, simulation=sim)
    summaries = {"loop": loop.summary, "procs": procs.summary, "flower simulation": flower.summary}
    splits = {"flower simulation": flower.executor.timing}
    if not a.no_deployment:
        with tempfile.TemporaryDirectory() as tmp:
            for tls in (False, True):
                name = f"flower local{' TLS' if tls else ''}"
                out = Path(tmp) / name.replace(" ", "-")
                summaries[name] = run_local(cfg["flower"], out, a.workers, tls=tls, log=lambda *_: None)
                splits[name] = json.loads((out / "flower" / "executor_timing.json").read_text())
    same = all(figures(s) == figures(json.loads(json.dumps(loop.summary))) for s in summaries.values())
    print(f"FedAvg, digits, {clients} clients all participating, cnn, {a.rounds} rounds, {a.workers} workers or "
          f"nodes; results equal: {same}")  # fmt: skip
    t = {n: s["timing"]["s_per_round"] for n, s in summaries.items()}
    for n, s in t.items():
        print(f"{n:20s} {s:7.3f} s/round   {s / t['loop']:6.2f} × loop")
    for n, split in splits.items():
        ft = {k: v / a.rounds for k, v in split.items() if k != "rounds"}
        par = (ft["client_update_s"] + ft["client_records_s"]) / a.workers
        print(f"{n}: server records {ft['server_records_s']:.3f} s, waiting {ft['wait_s']:.3f} s (client updates "
              f"{ft['client_update_s'] / a.workers:.3f} s and node records {ft['client_records_s'] / a.workers:.3f} s "
              f"per worker; the rest, {ft['wait_s'] - par:.3f} s: runtime, messages, ClientApp process starts)")


if __name__ == "__main__":
    main()
