"""Which torch thread count trains each zoo model fastest: 1 thread vs all cores, side by side in one process.

For every model, the same SGD steps (batch 32, 28×28 or 8×8 inputs, like the clients of a run) are timed at
1 thread and at `torch.get_num_threads()` (all cores), interleaved repeat by repeat so that machine load hits both
alike; the script prints the median step time of each and the ratio. This is the measurement behind the default
thread policy (`executor.threads` unset → `pflbed.engine.threads.choose_threads`).

    python benchmarks/threads.py [--steps 20] [--repeats 5] [--models lenet5 cnn ...] [--input 28] [--busy N]

`--busy N` starts N processes that spin on one core each for the duration: a reproducible stand-in for a machine
shared with other work (another run, a test suite, a browser).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time

import torch
import torch.nn.functional as F

from pflbed.models import MODELS, build_model


def step_time(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, threads: int) -> float:
    torch.set_num_threads(threads)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model.train()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return (time.perf_counter() - t0) / steps


def _spin() -> None:
    while True:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--input", type=int, default=28, help="square input size (28: Fashion-MNIST, 8: digits)")
    ap.add_argument("--models", nargs="*", default=sorted(MODELS))
    ap.add_argument("--busy", type=int, default=0, help="spinning processes running alongside (a shared machine)")
    args = ap.parse_args()
    cores = torch.get_num_threads()
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.busy)]
    for p in spinners:
        p.start()
    try:
        _measure(args, cores)
    finally:
        for p in spinners:
            p.terminate()


def _measure(args: argparse.Namespace, cores: int) -> None:
    print(f"cores (torch default threads): {cores}; spinning processes alongside: {args.busy}; "
          f"load average before: {os.getloadavg()[0]:.2f}")
    print(f"{'model':<20} {'params':>10} {'1 thread ms':>12} {f'{cores} threads ms':>14} {'speed-up':>9}")
    g = torch.Generator().manual_seed(0)
    for name in args.models:
        model = build_model(name, (1, args.input, args.input), 10)
        x = torch.randn(args.batch_size, 1, args.input, args.input, generator=g)
        y = torch.randint(0, 10, (args.batch_size,), generator=g)
        step_time(model, x, y, 2, 1)  # warm-up
        one, many = [], []
        for _ in range(args.repeats):
            one.append(step_time(model, x, y, args.steps, 1))
            many.append(step_time(model, x, y, args.steps, cores))
        t1, tn = statistics.median(one), statistics.median(many)
        params = sum(p.numel() for p in model.parameters())
        print(f"{name:<20} {params:>10,} {1e3 * t1:>12.2f} {1e3 * tn:>14.2f} {t1 / tn:>8.2f}×")
    torch.set_num_threads(cores)


if __name__ == "__main__":
    main()
