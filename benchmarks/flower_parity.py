"""Parity table: every algorithm's final P-FL with `loop`, Flower simulation, and a local Flower deployment with
TLS (`pflbed flower local --tls`, 2 SuperNodes), on a tiny synthetic federation (the tests' config), and whether
each summary equals loop's exactly (timing and provenance aside). Resumable: one JSON line per finished algorithm
in `--out` (default benchmarks/results/flower_parity.jsonl); the table is printed from it.

    python benchmarks/flower_parity.py [--only fedavg fedper] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from pflbed.algorithms import ALGORITHMS
from pflbed.config import validate_config
from pflbed.flower.local import run_local
from pflbed.flower.simulation import FlowerSimulation
from pflbed.results.experiment import run

TINY = {  # tests/tiny.py, with the light zoo of tests/engine/test_procs.py for the distillation family
    "dataset": {"name": "synthetic"}, "model": {"name": "mlp"},
    "federation": {"clients": 6, "partition": "dirichlet", "alpha": 1.0, "sample_fraction": 0.5, "public": 64},
    "train": {"rounds": 4, "batch_size": 16, "lr": 0.1}, "eval": {"every": 2, "finetune": []},
}  # fmt: skip
LIGHT = {"architectures": ["alexnet_small_x025", "mlp"], "server_steps": 3}


def cfg(name: str, executor: dict):
    fields = ALGORITHMS[name].Config.model_fields
    algorithm = {"name": name, **{k: v for k, v in LIGHT.items() if k in fields}}
    return validate_config({**TINY, "algorithm": algorithm, "executor": {"threads": 1, **executor}})


def figures(summary: dict) -> dict:
    """The summary's results: not timing, provenance, nor `artifacts` (paths of the plots a run directory gets, which
    the deployment writes and the in-memory runs do not)."""
    skip = ("timing", "provenance", "artifacts")
    return {k: v for k, v in json.loads(json.dumps(summary)).items() if k not in skip}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=sorted(ALGORITHMS))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/flower_parity.jsonl"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    done = {json.loads(line)["algorithm"] for line in a.out.read_text().splitlines()} if a.out.exists() else set()
    todo = [n for n in a.only if n not in done]
    if todo:
        with FlowerSimulation(supernodes=2, workers=2) as sim, tempfile.TemporaryDirectory() as tmp:
            for name in todo:
                loop = run(cfg(name, {}), write=False, progress=False).summary
                simulated = run(cfg(name, {"name": "flower"}), write=False, progress=False, simulation=sim).summary
                deployed = run_local(cfg(name, {"name": "flower", "supernodes": 2}), Path(tmp) / name, 2, tls=True,
                                     log=lambda *_: None)  # fmt: skip
                row = {"algorithm": name, **{k: s["final"]["pfl_acc"] for k, s in
                       (("loop", loop), ("simulation", simulated), ("deployment_tls", deployed))},
                       "simulation_equal": figures(simulated) == figures(loop),
                       "deployment_equal": figures(deployed) == figures(loop),
                       "deployment_s_per_round": deployed["timing"]["s_per_round"]}  # fmt: skip
                with open(a.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
                print(row, flush=True)
    print("| algorithm | loop P-FL | simulation | deployment (TLS, 2 nodes) | simulation = loop | deployment = loop |")
    print("|---|---|---|---|---|---|")
    for line in a.out.read_text().splitlines():
        r = json.loads(line)
        print(f"| {r['algorithm']} | {100 * r['loop']:.2f} | {100 * r['simulation']:.2f} | "
              f"{100 * r['deployment_tls']:.2f} | {r['simulation_equal']} | {r['deployment_equal']} |")


if __name__ == "__main__":
    main()
