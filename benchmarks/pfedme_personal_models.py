"""Why pFedMe's personal models score below its own global model in KT-pFL's homogeneous table.

Reads the finished pFedMe cells of `benchmarks/suites/fmnist_ktpfl_homogeneous.yaml` (their checkpoints: run the
suite first) and prints, per cell, the mean accuracy on the clients' own test splits (the table's P-FL) of
- θ_i: each client's personal model as the run scores it — the inner solution of Eq. 7 left from the last mini-batch
  of the client's last participated round (w⁰ for a client never sampled);
- w: the final global model;
- θ̂_i(w): the personal model re-solved from the final w on all of the client's training data (full-batch gradient
  steps on f_i(θ) + λ/2‖θ − w‖² at the run's η_p, `--steps` of them) — what a fresh, whole-data personalization of
  the final model gives.
Clients are grouped by the last round they were sampled in (the schedule is recomputed from the seed), so the
cost of stale personal models under partial participation shows separately from the one-batch inner solution.

    python benchmarks/pfedme_personal_models.py [--suite benchmarks/suites/fmnist_ktpfl_homogeneous.yaml]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from pflbed.federation import sample_clients
from pflbed.results.bench import Bench, load_suite
from pflbed.results.trained import load_run


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def resolved(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, lam: float, lr: float, steps: int) -> None:
    """θ̂(w) in place: full-batch gradient steps on f(θ) + λ/2‖θ − w‖² from θ = w (the model's current weights)."""
    anchor = [p.detach().clone() for p in model.parameters()]
    model.train()
    for _ in range(steps):
        grads = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
        with torch.no_grad():
            for p, g, w in zip(model.parameters(), grads, anchor, strict=True):
                p.sub_(lr * (g + lam * (p - w)))
    model.eval()


def cell_figures(path: Path, steps: int) -> dict[str, dict[str, float]]:
    run = load_run(path)
    cfg, fed = run.config, run.algo.ctx.federation
    last = dict.fromkeys(fed.participated, 0)
    for rnd in range(1, run.round + 1):
        for c in sample_clients(cfg.seed, rnd, fed.participated, cfg.federation.sample_fraction):
            last[c] = rnd
    rounds = run.round
    half = rounds // 2
    groups = {"never sampled": (0, 0), f"last sampled in 1–{half}": (1, half),
              f"in {half + 1}–{rounds - 1}": (half + 1, rounds - 1), f"in {rounds}": (rounds, rounds)}
    glob = run.generic_model()
    assert glob is not None
    per: dict[int, tuple[float, float, float]] = {}
    for cid in sorted(fed.participated):
        data = run.algo.ctx.client_data(cid)
        test = fed.clients[cid].test
        x, y = data.x[test], data.y[test]
        fresh = run.generic_model()
        assert fresh is not None
        resolved(fresh, data.x[data.train], data.y[data.train], run.algo.opts.lam, run.algo.opts.personal_lr, steps)
        per[cid] = (accuracy(run.personal_model(cid), x, y), accuracy(glob, x, y), accuracy(fresh, x, y))
    out = {}
    for name, (lo, hi) in groups.items():
        cids = [c for c in per if lo <= last[c] <= hi]
        if cids:
            out[f"{name} ({len(cids)})"] = {k: 100 * sum(per[c][i] for c in cids) / len(cids)
                                            for i, k in enumerate(("θ_i", "w", "θ̂_i(w)"))}  # fmt: skip
    out[f"all ({len(per)})"] = {k: 100 * sum(v[i] for v in per.values()) / len(per)
                                for i, k in enumerate(("θ_i", "w", "θ̂_i(w)"))}  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", default="benchmarks/suites/fmnist_ktpfl_homogeneous.yaml")
    ap.add_argument("--steps", type=int, default=50, help="full-batch steps re-solving the inner problem")
    args = ap.parse_args()
    torch.set_num_threads(1)
    bench = Bench(load_suite(args.suite))
    for table, (setting, method, seed) in bench.cells():
        path = table.run_dir(setting, method, seed)
        if method != "pFedMe" or not (path / "summary.json").is_file():
            continue
        print(f"{setting} · seed {seed} — accuracy (%) on the clients' test splits", flush=True)
        for group, accs in cell_figures(path, args.steps).items():
            print(f"  {group:<28} " + "  ".join(f"{k} {v:6.2f}" for k, v in accs.items()), flush=True)

if __name__ == "__main__":
    main()
