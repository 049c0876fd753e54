"""Personalizing a trained run for a new client, from the command line, as a practitioner would.

Trains FedAvg, FedRoD-hyper and FedBasis on Fashion-MNIST (20 clients, Dirichlet(0.3), LeNet-5, `--rounds`
rounds; a run already in `--out` is reused), then builds one new client from Fashion-MNIST's test split — raw
28×28 uint8 images of three classes, `--samples` for training, as many for validation, the rest of those classes
for testing, all disjoint — and runs `pflbed personalize RUN --data train.npz --val val.npz --test test.npz` with
each method (`native`, and `ft` where there is a generic model). Printed per run and method: the test accuracy
of the generic model (where there is one), of the personalized model (the epoch validation picked) and the
personalization's time.

    python benchmarks/personalize_new_client.py [--rounds 10] [--samples 30] [--out runs/personalize]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

CLASSES = (0, 3, 7)  # T-shirt, dress, sneaker
METHODS = ("fedavg", "fedrod_hyper", "fedbasis")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--samples", type=int, default=30)
    ap.add_argument("--out", type=Path, default=Path("runs/personalize"))
    a = ap.parse_args()
    import pflbed
    from pflbed.data import load_dataset

    source = load_dataset("fmnist")
    raw = np.round(((source.test.x[:, 0] * source.pixel_norm[1] + source.pixel_norm[0]) * 255).numpy())
    labels = source.test.y.numpy()
    keep = np.random.default_rng(0).permutation(np.flatnonzero(np.isin(labels, CLASSES)))
    n = a.samples
    splits = {"train": keep[:n], "val": keep[n : 2 * n], "test": keep[2 * n :]}
    a.out.mkdir(parents=True, exist_ok=True)
    for name, idx in splits.items():
        np.savez(a.out / f"{name}.npz", x=raw[idx].astype(np.uint8), y=labels[idx])
    print(f"new client: Fashion-MNIST classes {CLASSES}, {n} training, {n} validation, {len(splits['test'])} test "
          f"samples; runs: 20 clients, Dirichlet(0.3), LeNet-5, {a.rounds} rounds")  # fmt: skip
    print("| run | method | generic model test % | personalized test % | epoch kept | seconds |")
    print("|---|---|---|---|---|---|")
    for algo in METHODS:
        run_dir = a.out / algo
        if not (run_dir / "summary.json").exists():
            cfg = {"dataset": {"name": "fmnist"}, "model": {"name": "lenet5"}, "algorithm": {"name": algo},
                   "federation": {"clients": 20, "alpha": 0.3, "sample_fraction": 0.5},
                   "train": {"rounds": a.rounds, "batch_size": 32, "lr": 0.01, "momentum": 0.9},
                   "eval": {"every": a.rounds, "finetune": []}, "executor": {"threads": 1}}  # fmt: skip
            pflbed.run(cfg, run_dir, force=True)
        run = pflbed.load_run(run_dir)
        test = np.load(a.out / "test.npz")
        generic = run.generic_model()
        generic_acc = f"{100 * float((run.predict(test['x']) == test['y']).mean()):.2f}" if generic else "—"
        for method in ("native", "ft") if generic else ("native",):
            out = a.out / f"{algo}-{method}"
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "pflbed", "personalize", str(run_dir), "--data",
                            str(a.out / "train.npz"), "--val", str(a.out / "val.npz"), "--test",
                            str(a.out / "test.npz"), "--method", method, "--out", str(out)], check=True,
                           stdout=subprocess.DEVNULL)  # fmt: skip
            wall = time.perf_counter() - t0
            s = json.loads((out / "summary.json").read_text())
            print(f"| {algo} | {method} (lr {s['lr']:g}, {len(s['epochs'])} epochs) | {generic_acc} | "
                  f"{100 * s['test_acc']:.2f} | {s['selected_epoch']} | {s['seconds']:.1f} ({wall:.1f} with the "
                  f"command) |")  # fmt: skip


if __name__ == "__main__":
    main()
