"""Engine speed side by side: executors, memory layout, and scale in clients — ratios from one script run.

1. Executors. For each model, FedAvg on Fashion-MNIST (20 clients, Dir(0.1), batch 10 by default) runs `--rounds`
   rounds with `loop` (1 thread), `procs` (`--workers` workers, 1 thread each), `loop` with batched clients
   (`executor.batch_clients`) and `loop` with `model.channels_last`, alternating repeat by repeat so that machine
   load hits all alike. Printed: training seconds per round (`timing.s_per_round`, evaluation excluded), loop ÷ each,
   and each procs worker's samples/s as a fraction of the centralized limit — plain SGD steps on one thread in this
   process, same model and batch size, no federation at all.
2. Scale. FedPer (personal classifier), `--scale-clients` clients (1,000 and 10,000), 1 % of them per round,
   `eval.every=5`, 10 rounds, each in a fresh process so that its peak RSS is its own: setup seconds, training
   seconds per round, seconds per evaluation of all clients and per client, evaluation's share of the run, peak RSS;
   with the default layout (nchw), `model.channels_last` (nhwc), and the default layout on `procs` with 2 workers
   (procs: training in the workers, evaluation's forwards split over them; its peak RSS is the main process's).
3. GPU (only where CUDA is available): FedAvg, 100 clients all participating, 1 local epoch, batch 32, `cnn` —
   seconds per round for loop, batched and procs on the GPU.

    python benchmarks/speed.py [--models lenet5 cnn] [--workers 2] [--rounds 2] [--repeats 2] [--batch 10]
                               [--scale-clients 1000 10000] [--scale-model cnn] [--skip executors scale gpu]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch
from threads import step_time  # benchmarks/threads.py: the same plain SGD step

from pflbed.config import validate_config
from pflbed.engine.procs import WorkerPool
from pflbed.models import build_model
from pflbed.results.experiment import run

VARIANTS = {  # name → (executor section, model section)
    "loop": ({"name": "loop", "threads": 1}, {}),  # named: the default, `auto`, picks procs for a large run
    "procs": ({"name": "procs", "threads": 1}, {}),
    "batched": ({"name": "loop", "threads": 1, "batch_clients": True}, {}),
    "nhwc": ({"name": "loop", "threads": 1}, {"channels_last": True}),
}


def config(model: dict, executor: dict, rounds: int, batch: int, clients: int = 20, fed: dict | None = None) -> dict:
    return {
        "dataset": {"name": "fmnist"},
        "model": model,
        "federation": fed or {"clients": clients, "partition": "dirichlet", "alpha": 0.1},
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


def executors(a: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    names = list(VARIANTS)
    head = [f"{n + ' s/round':>15s}" for n in names] + [f"{'loop÷' + n:>12s}" for n in names[1:]]
    print(f"{'model':8s} " + " ".join(head) + f" {'procs worker÷centralized':>25s}")
    with WorkerPool(a.workers, threads=1) as pool:
        for model in a.models:
            times: dict[str, list[float]] = {n: [] for n in names}
            samples = 0
            for _ in range(a.repeats):
                for n in names:
                    ex, mo = VARIANTS[n]
                    ex = {**ex, "workers": a.workers} if n == "procs" else ex
                    cfg = validate_config(config({"name": model, **mo}, ex, a.rounds, a.batch))
                    r = run(cfg, write=False, progress=False, pool=pool if n == "procs" else None)
                    times[n].append(r.summary["timing"]["s_per_round"])
                    fed = r.executor.algo.ctx.federation
                    samples = sum(fed.num_train(c) for c in fed.participated)
            med = {n: statistics.median(t) for n, t in times.items()}
            per_worker = samples / med["procs"] / a.workers / centralized_samples_per_s(model, a.batch)
            row = [f"{med[n]:15.2f}" for n in names] + [f"{med['loop'] / med[n]:12.2f}" for n in names[1:]]
            print(f"{model:8s} " + " ".join(row) + f" {per_worker:25.2f}")


def peak_rss_mb() -> float:
    """This process's peak resident memory. Linux's VmHWM belongs to the process image, whereas `ru_maxrss` keeps
    the parent's peak across fork and exec (a child started by a 1.5 GB parent would report 1.5 GB)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


SCALE_VARIANTS = {  # name → (executor section, model section)
    "nchw": ({"name": "loop", "threads": 1}, {}),
    "nhwc": ({"name": "loop", "threads": 1}, {"channels_last": True}),
    "procs": ({"name": "procs", "workers": 2, "threads": 1}, {}),
}


def scale_child(clients: int, model: str, variant: str) -> None:
    """One scale measurement in this (fresh) process; prints a JSON line."""
    t0 = time.perf_counter()
    executor, model_section = SCALE_VARIANTS[variant]
    cfg = validate_config({
        "dataset": {"name": "fmnist"}, "model": {"name": model, **model_section},
        "federation": {"clients": clients, "partition": "iid", "sample_fraction": 0.01, "min_size": 1},
        "train": {"rounds": 10, "batch_size": 10, "lr": 0.01, "checkpoint_every": 0},
        "eval": {"every": 5, "finetune": []}, "executor": executor, "algorithm": {"name": "fedper"},
    })  # fmt: skip
    r = run(cfg, write=False, progress=False)
    t = r.summary["timing"]
    evals = len(r.history)
    print(json.dumps({
        "clients": clients, "model": model, "total_s": time.perf_counter() - t0, "train_s_per_round": t["s_per_round"],
        "eval_s": t["eval_s"] / evals, "eval_share": t["eval_s"] / (t["eval_s"] + t["train_s"]),
        "setup_s": time.perf_counter() - t0 - t["wall_s"], "evaluated": r.summary["clients"]["participated"],
        "peak_rss_mb": peak_rss_mb(),
    }))  # fmt: skip


def scale(a: argparse.Namespace) -> None:
    print(f"\nFedPer, {a.scale_model}, 1 % of clients per round, eval.every=5, 10 rounds (fresh process each)")
    print(f"{'clients':>8s} {'variant':>7s} {'setup s':>8s} {'train s/round':>13s} {'s/eval':>7s} "
          f"{'ms/eval/client':>14s} {'eval share':>10s} {'peak RSS MB':>11s}")  # fmt: skip
    for n, variant in [(n, variant) for n in a.scale_clients for variant in SCALE_VARIANTS]:
        out = subprocess.run([sys.executable, __file__, "--scale-child", str(n), a.scale_model, variant],
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
        m = json.loads(out.strip().splitlines()[-1])
        print(f"{n:8d} {variant:>7s} {m['setup_s']:8.1f} {m['train_s_per_round']:13.2f} {m['eval_s']:7.2f} "
              f"{1000 * m['eval_s'] / m['evaluated']:14.3f} {100 * m['eval_share']:9.1f}% "
              f"{m['peak_rss_mb']:11.0f}")  # fmt: skip


def gpu(a: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        print("\nGPU: none on this machine")
        return
    name = torch.cuda.get_device_name()
    print(f"\nGPU ({name}): FedAvg, 100 clients all participating, 1 local epoch, batch 32, cnn")
    fed = {"clients": 100, "partition": "dirichlet", "alpha": 0.1}
    runs = {"loop": {"device": "cuda", "name": "loop", "batch_clients": False},
            "batched": {"device": "cuda", "name": "loop", "batch_clients": True},
            "procs": {"device": "cuda", "name": "procs", "workers": a.workers, "threads": 1}}  # fmt: skip
    for n, ex in runs.items():
        r = run(validate_config(config({"name": "cnn"}, ex, a.rounds + 1, 32, fed=fed)), write=False, progress=False)
        print(f"{n:8s} {r.summary['timing']['s_per_round']:.3f} s/round (first round included: CUDA warm-up)")


def main() -> None:
    if sys.argv[1:2] == ["--scale-child"]:
        scale_child(int(sys.argv[2]), sys.argv[3], sys.argv[4])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["lenet5", "cnn"])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--scale-clients", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--scale-model", default="cnn")
    ap.add_argument("--skip", nargs="*", default=[], choices=["executors", "scale", "gpu"])
    a = ap.parse_args()
    for part in (executors, scale, gpu):
        if part.__name__ not in a.skip:
            part(a)


if __name__ == "__main__":
    main()
