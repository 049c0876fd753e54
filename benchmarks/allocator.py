"""What keeping freed memory (`executor.keep_freed_memory`, `pflbed.allocator`) does to a round on a CPU, side by side.

Every case (algorithm, model, executor) runs its rounds with the setting on and off, each in a fresh process (the
heap's state is per process), alternating on/off repeat by repeat so that the machine's load hits both alike. It
prints each one's median seconds per round (the rounds after a warm-up round), its peak resident memory, the
ratio off ÷ on, its kernel (system) CPU seconds, and whether the two trained the same server state bit for bit.

    python benchmarks/allocator.py [--repeats 3] [--clients 4] [--samples 64] [--cases fedbasis/resnet18/batched ...]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import statistics
import subprocess
import sys
import time

CASES = ["fedbasis/resnet18/batched", "fedavg/resnet18/batched", "fedavg/cnn/batched", "fedbasis/resnet18/loop",
         "fedavg/resnet18/loop"]  # fmt: skip


def one(case: str, keep: bool, clients: int, samples: int, rounds: int) -> dict:
    """This process: `rounds` rounds of `case` (the first a warm-up) with the setting `keep`."""
    import torch

    from pflbed.allocator import kept_freed_memory
    from pflbed.config import validate_config
    from pflbed.engine.build import make_executor, prepare
    from pflbed.engine.driver import Driver

    alg, model, executor = case.split("/")
    cfg = validate_config({
        "dataset": {"name": "synthetic", "synthetic": {"shape": [3, 32, 32], "n_train": int(clients * samples / 0.8),
                                                       "n_test": 100}},
        "model": {"name": model},
        "federation": {"clients": clients, "partition": "iid", "val_fraction": 0.1, "test_fraction": 0.1},
        "train": {"rounds": rounds, "batch_size": 32, "lr": 0.01, "checkpoint_every": 0},
        "eval": {"every": 10**6, "finetune": []},
        "executor": {"name": "loop", "threads": 1, "batch_clients": executor == "batched", "keep_freed_memory": keep},
        "algorithm": {"name": alg, **({"alpha_epochs": 1, "basis_epochs": 1, "warmup_fraction": 0.0}
                                     if alg == "fedbasis" else {})},
    })  # fmt: skip
    algo = prepare(cfg)
    ex, _ = make_executor(algo)
    driver = Driver(algo, ex)
    server, times = algo.init_server(), []
    with kept_freed_memory(keep):  # as `results.experiment` holds it around a run's rounds
        for rnd in range(1, rounds + 1):
            t0 = time.perf_counter()
            server, _ = driver.train_round(rnd, server)
            times.append(time.perf_counter() - t0)
    digest = hashlib.sha256()
    for k in sorted(server):
        digest.update(k.encode() + server[k].detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"s_per_round": statistics.median(times[1:]), "peak_gb": usage.ru_maxrss / 2**20,
            "sys_s": usage.ru_stime, "state": digest.hexdigest()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--samples", type=int, default=64, help="training samples per client")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per process, the first a warm-up")
    ap.add_argument("--cases", nargs="*", default=CASES, metavar="ALG/MODEL/EXECUTOR")
    ap.add_argument("--one", nargs=2, metavar=("CASE", "KEEP"), help=argparse.SUPPRESS)  # a child's task
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one[0], a.one[1] == "on", a.clients, a.samples, a.rounds)))
        return
    print(f"{a.clients} clients × {a.samples} samples, batch 32, 1 thread, {a.rounds - 1} timed rounds a process, "
          f"{a.repeats} processes per setting (medians)")  # fmt: skip
    print(f"{'case':28s} {'off s/rnd':>9s} {'on s/rnd':>9s} {'off÷on':>7s} {'off sys':>8s} {'on sys':>7s} "
          f"{'off GB':>7s} {'on GB':>6s} same state")  # fmt: skip
    for case in a.cases:
        got: dict[str, list[dict]] = {"off": [], "on": []}
        for _ in range(a.repeats):
            for keep in ("off", "on"):
                out = subprocess.run([sys.executable, __file__, "--one", case, keep, "--clients", str(a.clients),
                                      "--samples", str(a.samples), "--rounds", str(a.rounds)],
                                     capture_output=True, text=True)  # fmt: skip
                if out.returncode:
                    sys.exit(f"{case} ({keep}) failed:\n{out.stderr[-2000:]}")
                got[keep].append(json.loads(out.stdout.strip().splitlines()[-1]))

        def med(keep: str, key: str, got: dict[str, list[dict]] = got) -> float:
            return statistics.median(r[key] for r in got[keep])

        same = len({r["state"] for r in got["off"] + got["on"]}) == 1
        print(f"{case:28s} {med('off', 's_per_round'):9.2f} {med('on', 's_per_round'):9.2f} "
              f"{med('off', 's_per_round') / med('on', 's_per_round'):6.2f}× {med('off', 'sys_s'):8.1f} "
              f"{med('on', 'sys_s'):7.1f} {med('off', 'peak_gb'):7.2f} {med('on', 'peak_gb'):6.2f} "
              f"{'yes' if same else 'NO'}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
