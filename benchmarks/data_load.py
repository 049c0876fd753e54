"""Load time and peak memory of a CIFAR-10-sized set in the official CIFAR python format.

Writes 60,000 generated 32×32×3 images as `data_batch_1` … `data_batch_5` and `test_batch` (Python 2 pickles,
exactly as the official archive holds them: `tests/data_formats.py`), then loads them with `pflbed` in fresh
processes:

- cold: the files' pages dropped from the OS page cache first (`posix_fadvise(DONTNEED)`), so they are read
  from disk;
- warm files: a fresh process, the files in the page cache (what a second run on the same machine sees);
- cached: a second `load_dataset` call in the same process (the loader's in-process cache: a run's later
  phases, sweeps and evaluations ask again).

Peak RSS is the process's maximum resident set (`ru_maxrss`); "over imports" subtracts the RSS right before the
load. The loaded tensor itself is 60,000 × 3,072 float32 = 737 MB.

    PYTHONPATH=src python benchmarks/data_load.py [--dir DIR] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, resource, sys, time
import torch
from pflbed.data import load_dataset

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

directory, cold = sys.argv[1], sys.argv[2] == "1"
if cold:
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
before = rss_mb()
t = time.perf_counter()
source = load_dataset("cifar10", path=directory)
first = time.perf_counter() - t
t = time.perf_counter()
again = load_dataset("cifar10", path=directory)
second = time.perf_counter() - t
assert again is source and len(source.train) == 50000 and len(source.test) == 10000
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"load_s": first, "cached_s": second, "rss_before_mb": before, "peak_rss_mb": peak,
                  "threads": torch.get_num_threads()}))
"""


def write_set(directory: Path) -> float:
    sys.path.insert(0, str(ROOT))
    from tests.data_formats import cifar_batch

    rng = np.random.default_rng(0)
    t = time.perf_counter()
    for name in [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]:
        images = rng.integers(0, 256, size=(10000, 32, 32, 3), dtype=np.uint8)
        labels = rng.integers(0, 10, size=10000)
        cifar_batch(directory / name, images, {"labels": [int(v) for v in labels]})
    return time.perf_counter() - t


def measure(directory: Path, cold: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, "-c", CHILD, str(directory), "1" if cold else "0"], env=env, check=True,
                         capture_output=True, text=True).stdout  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, help="where to write the set (default: a temporary directory)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="pflbed-cifar-") as tmp:
        directory = args.dir or Path(tmp)
        directory.mkdir(parents=True, exist_ok=True)
        wrote = write_set(directory)
        size = sum(p.stat().st_size for p in directory.iterdir()) / 2**20
        print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
              f"Python {platform.python_version()}")  # fmt: skip
        print(f"wrote 60,000 images (6 batch files, {size:.0f} MiB) in {wrote:.1f} s")
        runs = {"cold": [measure(directory, True) for _ in range(args.repeats)],
                "warm files": [measure(directory, False) for _ in range(args.repeats)]}  # fmt: skip
    print(f"{'':<12} {'load s (median, min–max)':>26} {'peak RSS MiB':>13} {'over imports':>13}")
    for label, rs in runs.items():
        loads = [r["load_s"] for r in rs]
        peak = max(r["peak_rss_mb"] for r in rs)
        over = max(r["peak_rss_mb"] - r["rss_before_mb"] for r in rs)
        print(f"{label:<12} {statistics.median(loads):>11.2f} ({min(loads):.2f}–{max(loads):.2f}){'':>6} "
              f"{peak:>13.0f} {over:>13.0f}")  # fmt: skip
    cached = [r["cached_s"] for rs in runs.values() for r in rs]
    print(f"{'cached':<12} {statistics.median(cached) * 1e6:>11.0f} µs (in-process cache: the same object)")
    print(f"loaded tensors: x float32 [60000, 3, 32, 32] = {60000 * 3072 * 4 / 2**20:.0f} MiB; "
          f"torch threads {runs['cold'][0]['threads']}")  # fmt: skip


if __name__ == "__main__":
    main()
